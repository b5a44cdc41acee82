"""One attention layer of a real model through rotkv, against plain softmax attention.

The bundled tile data/smollm2-alice-kv-l0-l5.safetensors holds SmolLM2-135M's post-RoPE
queries, keys and values (float16, [tokens, heads, 64]) for the first 2048 tokens of
alice29.txt, layers 0 and 5. For each preset this appends every token to a rotkv cache
and decodes each of the last 128 queries right after its own token's append (as a
serving loop would), then compares with float64 softmax attention over the unquantized
keys and values: the relative error ||out - ref|| / ||ref|| over all 128 x 9 rows, the
"attn-out rel err" column of the README's quality table.

    python examples/attention.py [path to the .safetensors tile]

torch users: `rotkv.KvCache.append`/`decode` take CPU torch tensors as they are (read
through DLPack); `torch.nn.functional.scaled_dot_product_attention` computes the same
reference as `attention` below.
"""

import json
import pathlib
import struct
import sys

import numpy as np

import rotkv

TILE = pathlib.Path(__file__).resolve().parents[2] / "data" / "smollm2-alice-kv-l0-l5.safetensors"


def load_safetensors(path):
    """A safetensors file as a dict of numpy arrays (float16 tensors only)."""
    raw = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F16", t
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float16).reshape(t["shape"])
    return out


def attention(q, k, v):
    """Causal softmax attention of one query row in float64: q [q_heads, d] over k and v
    [tokens, kv_heads, d]; query head h reads KV head h // (q_heads // kv_heads)."""
    hq, d = q.shape
    group = hq // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1)  # [tokens, q_heads, d]
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("hd,thd->ht", q.astype(np.float64), kk) / np.sqrt(d)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("ht,thd->hd", p, vv) / p.sum(axis=1, keepdims=True)


def layer_error(tile, layer, preset, queries=128):
    q, k, v = (tile[f"layer{layer}.{x}"] for x in ("q", "k", "v"))
    tokens, hkv, d = k.shape
    hq = q.shape[1]
    cache = rotkv.KvCache(rotkv.CacheConfig.preset(preset, d), 1, hkv, hq, 1, tokens)
    seq = cache.add_sequence()
    first = tokens - queries
    cache.append(0, seq, k[:first], v[:first])
    got, want = [], []
    for p in range(first, tokens):
        cache.append(0, seq, k[p:p + 1], v[p:p + 1])
        got.append(cache.decode(0, [seq], q[p:p + 1])[0])
        want.append(attention(q[p], k[:p + 1], v[:p + 1]))
    got, want = np.array(got), np.array(want)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def main():
    tile = load_safetensors(sys.argv[1] if len(sys.argv) > 1 else TILE)
    print("layer  preset  attn-out rel err (128 queries x 9 heads, against float64 attention)")
    for layer in (0, 5):
        for preset in ("k2v2", "k4v2", "k4v4"):
            print(f"{layer:>5}  {preset:>6}  {layer_error(tile, layer, preset):.3f}")


if __name__ == "__main__":
    main()
