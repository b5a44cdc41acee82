"""One attention layer of a Hugging Face-style model on torch CPU tensors through rotkv,
against torch.nn.functional.scaled_dot_product_attention on the unquantized K/V.

The bundled tile data/smollm2-alice-kv-l0-l5.safetensors holds SmolLM2-135M's post-RoPE
queries, keys and values ([tokens, heads, 64], float16) for the first 2048 tokens of
alice29.txt, layers 0 and 5: what a Llama attention layer hands its cache after the
q/k/v projections and RoPE. Here they are torch tensors, as in a transformers model.
The prompt (all but the last 128 tokens) is appended in one call, as a prefill would;
then each of the last 128 tokens is appended and its query decoded from the cache, as a
decode loop would. The reference is SDPA in float32 over the unquantized keys and values
(causal, grouped-query: `enable_gqa=True`), one row per decoded token. Printed: the
relative error ||out - ref|| / ||ref|| over the 128 x 9 rows per preset.

    python examples/torch_attention.py
"""

import pathlib
import sys

import torch
import torch.nn.functional as F

import rotkv

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from attention import TILE, load_safetensors  # noqa: E402


def layer_error(tile, layer, preset, queries=128, dtype=torch.float16):
    q, k, v = (torch.from_numpy(tile[f"layer{layer}.{x}"].copy()).to(dtype) for x in ("q", "k", "v"))
    tokens, hkv, d = k.shape
    hq = q.shape[1]
    cache = rotkv.KvCache(rotkv.CacheConfig.preset(preset, d), 1, hkv, hq, 1, tokens)
    seq = cache.add_sequence()
    first = tokens - queries
    cache.append(0, seq, k[:first], v[:first])  # the prompt: torch tensors as they are
    got = []
    for p in range(first, tokens):
        cache.append(0, seq, k[p:p + 1], v[p:p + 1])
        got.append(torch.from_numpy(cache.decode(0, [seq], q[p:p + 1])[0]))
    got = torch.stack(got)  # [queries, q_heads, d]
    # SDPA over the unquantized K/V: [batch, heads, tokens, d], the last `queries` rows,
    # each causal (row i sees positions 0 ..= first + i).
    qq = q[first:].float().transpose(0, 1)[None]
    kk, vv = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]
    mask = torch.arange(tokens)[None, :] <= torch.arange(first, tokens)[:, None]
    want = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    return (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item()


def main():
    tile = load_safetensors(sys.argv[1] if len(sys.argv) > 1 else TILE)
    print(f"torch {torch.__version__}; attn-out rel err against SDPA (128 queries x 9 heads)")
    print("layer  preset  float16 inputs  bfloat16 inputs")
    for layer in (0, 5):
        for preset in ("k2v2", "k4v2", "k4v4"):
            e16 = layer_error(tile, layer, preset)
            ebf = layer_error(tile, layer, preset, dtype=torch.bfloat16)
            print(f"{layer:>5}  {preset:>6}  {e16:>14.3f}  {ebf:>15.3f}")


if __name__ == "__main__":
    main()
