#!/usr/bin/env python3
"""Independent reference forward pass (numpy, float64) of a llama / qwen2 / qwen3 / gemma3
GGUF file, for tests/tests/model_arch.rs (small random models with F32 tensors).

    python3 reference_forward.py MODEL.gguf TOKENS(comma-separated) OUT.f64
    python3 reference_forward.py --nll MODEL.gguf TOKENS_FILE(comma-separated ids) OUT.txt

The first form writes the logits [tokens][vocab] as little-endian float64. The second
writes the token ids and the next-token negative log-likelihood of every scored position
(text: `#` comment lines, the ids, the NLLs; tests/reference/gemma3_lcet10_640.txt) and
prints their mean and the perplexity (what `rotkv ppl` reports for exact attention): for real
quantized GGUF files, whose tensors are dequantized with gguf-py (`pip install gguf`,
the llama.cpp project's own Python reader; only then is it imported).

Reads the GGUF itself (no rotkv code), undoes llama.cpp's q/k row permutation for
`llama` files.
Implements: RMSNorm, RoPE (rotate_half) with llama-3 frequency factors
(`rope_freqs.weight`: inverse frequency i divided by factor i) and linear scaling
(`rope.scaling.type = linear`: every inverse frequency divided by the factor), q/k/v
biases (qwen2), per-head q/k RMSNorm before RoPE (qwen3, gemma3), head_dim from
`attention.key_length`, grouped-query causal attention, SwiGLU, tied or untied output;
gemma3: embeddings times sqrt(dim), RMSNorms after attention and MLP (the GGUF stores
Gemma's `1 + w` gains with the 1 added), GeGLU with the tanh GELU, and sliding-window
layers (all but every sixth: a query sees the newest `attention.sliding_window`
positions, RoPE base 10000, no scaling), as Hugging Face's Gemma3 model runs.
"""
import struct
import sys

import numpy as np


class Cursor:
    """Little-endian GGUF fields from `b`, starting at offset `o`."""

    SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def __init__(self, b, o=0):
        self.b, self.o = b, o

    def rd(self, fmt):
        v = struct.unpack_from("<" + fmt, self.b, self.o)
        self.o += struct.calcsize("<" + fmt)
        return v[0]

    def rstr(self):
        n = self.rd("Q")
        s = self.b[self.o:self.o + n].decode("utf-8")
        self.o += n
        return s

    def value(self, t):
        if t == 8:
            return self.rstr()
        if t == 9:
            inner, n = self.rd("I"), self.rd("Q")
            return [self.value(inner) for _ in range(n)]
        return self.rd(self.SCALAR[t])


def read_header(b):
    """The metadata of GGUF bytes `b`, the tensor count, and the cursor after them (the
    header alone is enough: the first chunk of a split file reads)."""
    assert b[:4] == b"GGUF"
    c = Cursor(b, 4)
    c.rd("I")
    n_tensors, n_kv = c.rd("Q"), c.rd("Q")
    meta = {}
    for _ in range(n_kv):
        k = c.rstr()
        meta[k] = c.value(c.rd("I"))
    return meta, n_tensors, c


def read_gguf(path):
    b = open(path, "rb").read()
    meta, n_tensors, c = read_header(b)
    infos = []
    for _ in range(n_tensors):
        name = c.rstr()
        dims = [c.rd("Q") for _ in range(c.rd("I"))]
        kind, off = c.rd("I"), c.rd("Q")
        infos.append((name, dims, kind, off))
    align = meta.get("general.alignment", 32)
    start = (c.o + align - 1) // align * align
    tensors = {}
    for name, dims, kind, off in infos:
        n = int(np.prod(dims))
        if kind == 0:
            a = np.frombuffer(b, dtype="<f4", count=n, offset=start + off).astype(np.float64)
        else:
            # Quantized: gguf-py's dequantization (the llama.cpp project's reference).
            from gguf import GGMLQuantizationType, quants
            from gguf.constants import GGML_QUANT_SIZES
            qt = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qt]
            raw = np.frombuffer(b, dtype=np.uint8, count=n // block * size, offset=start + off)
            a = quants.dequantize(raw, qt).astype(np.float64).reshape(-1)
        tensors[name] = a.reshape(list(reversed(dims)))  # [rows][cols]
    return meta, tensors


def rms(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def forward(meta, t, tokens):
    arch = meta["general.architecture"]
    m = lambda k, d=None: meta.get(f"{arch}.{k}", d)
    dim, layers, heads = m("embedding_length"), m("block_count"), m("attention.head_count")
    kv_heads = m("attention.head_count_kv", heads)
    d = m("attention.key_length", dim // heads)
    eps, theta = m("attention.layer_norm_rms_epsilon"), m("rope.freq_base", 10000.0)
    gemma = arch == "gemma3"
    n = len(tokens)

    def tables(theta, scaled):
        inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
        if scaled and "rope_freqs.weight" in t:
            inv = inv / t["rope_freqs.weight"]
        if scaled and m("rope.scaling.type") == "linear":
            inv = inv / m("rope.scaling.factor")
        ang = np.arange(n)[:, None] * inv[None, :]
        return np.cos(ang), np.sin(ang)

    full_rope, sliding_rope = tables(theta, True), tables(10000.0, False)

    def rope(x, cs):  # x [n][h][d]
        cos, sin = cs
        a, b = x[..., : d // 2], x[..., d // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def unpermute(w, h):  # GGUF row (head, i, half) -> Hugging Face row (head, half, i)
        return w.reshape(h, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(h * d, -1)

    x = t["token_embd.weight"][tokens]
    if gemma:
        x = x * np.sqrt(dim)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    window = m("attention.sliding_window")
    pos = np.arange(n)
    # A sliding layer's query at i sees keys j with i - j < window.
    sliding_mask = np.where(pos[:, None] - pos[None, :] >= (window or n + 1), -np.inf, mask)
    pattern = m("attention.sliding_window_pattern", 6)
    scale = 1.0 / np.sqrt(dim / heads if gemma and layers == 62 else d)
    for l in range(layers):
        p = lambda s: t[f"blk.{l}.{s}"]
        # A period (llama.cpp's set_swa_pattern) or one bool per layer (true: sliding).
        sliding = gemma and (pattern[l] if isinstance(pattern, list) else (l + 1) % pattern != 0)
        h = rms(x, p("attn_norm.weight"), eps)
        wq, wk = p("attn_q.weight"), p("attn_k.weight")
        if arch == "llama":
            wq, wk = unpermute(wq, heads), unpermute(wk, kv_heads)
        q, k, v = h @ wq.T, h @ wk.T, h @ p("attn_v.weight").T
        if f"blk.{l}.attn_q.bias" in t:
            q, k, v = q + p("attn_q.bias"), k + p("attn_k.bias"), v + p("attn_v.bias")
        q, k, v = q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v.reshape(n, kv_heads, d)
        if arch in ("qwen3", "gemma3"):
            q, k = rms(q, p("attn_q_norm.weight"), eps), rms(k, p("attn_k_norm.weight"), eps)
        cs = sliding_rope if sliding else full_rope
        q, k = rope(q, cs), rope(k, cs)
        g = heads // kv_heads
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * scale + (sliding_mask if sliding else mask)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", s, v).reshape(n, heads * d)
        o = att @ p("attn_output.weight").T
        if gemma:
            o = rms(o, p("post_attention_norm.weight"), eps)
        x = x + o
        h = rms(x, p("ffn_norm.weight"), eps)
        gate, up = h @ p("ffn_gate.weight").T, h @ p("ffn_up.weight").T
        if gemma:
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1 + np.exp(-gate))
        o = (act * up) @ p("ffn_down.weight").T
        if gemma:
            o = rms(o, p("post_ffw_norm.weight"), eps)
        x = x + o
    out = t.get("output.weight", t["token_embd.weight"])
    return rms(x, t["output_norm.weight"], eps) @ out.T


def main():
    if sys.argv[1] == "--nll":
        meta, tensors = read_gguf(sys.argv[2])
        tokens = [int(s) for s in open(sys.argv[3]).read().split(",")]
        logits = forward(meta, tensors, tokens[:-1])
        mx = logits.max(-1, keepdims=True)
        lse = (mx + np.log(np.exp(logits - mx).sum(-1, keepdims=True)))[:, 0]
        per = lse - logits[np.arange(len(tokens) - 1), tokens[1:]]
        nll = float(per.mean())
        summary = f"tokens {len(tokens)} scored {len(tokens) - 1} nll {nll:.6f} ppl {np.exp(nll):.4f}"
        print(summary)
        with open(sys.argv[4], "w") as f:
            f.write(f"# tests/scripts/reference_forward.py --nll on {sys.argv[2].split('/')[-1]}: {summary}\n")
            f.write("# line 1: token ids; line 2: next-token NLL (nats) of positions 0 .. n-2\n")
            f.write(",".join(str(t) for t in tokens) + "\n")
            f.write(",".join(f"{x:.7f}" for x in per) + "\n")
        return
    meta, tensors = read_gguf(sys.argv[1])
    tokens = [int(s) for s in sys.argv[2].split(",")]
    logits = forward(meta, tensors, tokens)
    open(sys.argv[3], "wb").write(logits.astype("<f8").tobytes())


if __name__ == "__main__":
    main()
