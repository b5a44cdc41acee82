#!/usr/bin/env python3
"""Independent reference forward pass (numpy, float64) of a small llama / qwen2 / qwen3
GGUF file with F32 tensors, for tests/tests/model_arch.rs.

    python3 reference_forward.py MODEL.gguf TOKENS(comma-separated) OUT.f64

Reads the GGUF itself (no rotkv code), undoes llama.cpp's q/k row permutation for
`llama` files, and writes the logits [tokens][vocab] as little-endian float64.
Implements: RMSNorm, RoPE (rotate_half) with llama-3 frequency factors
(`rope_freqs.weight`: inverse frequency i divided by factor i) and linear scaling
(`rope.scaling.type = linear`: every inverse frequency divided by the factor), q/k/v
biases (qwen2), per-head q/k RMSNorm before RoPE (qwen3), head_dim from
`attention.key_length`, grouped-query causal attention, SwiGLU, tied or untied output.
"""
import struct
import sys

import numpy as np


def read_gguf(path):
    b = open(path, "rb").read()
    o = 0

    def rd(fmt):
        nonlocal o
        v = struct.unpack_from("<" + fmt, b, o)
        o += struct.calcsize("<" + fmt)
        return v[0]

    def rstr():
        nonlocal o
        n = rd("Q")
        s = b[o:o + n].decode("utf-8")
        o += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t == 8:
            return rstr()
        if t == 9:
            inner = rd("I")
            n = rd("Q")
            return [value(inner) for _ in range(n)]
        return rd(scalar[t])

    assert b[:4] == b"GGUF"
    o = 4
    rd("I")
    n_tensors, n_kv = rd("Q"), rd("Q")
    meta = {}
    for _ in range(n_kv):
        k = rstr()
        meta[k] = value(rd("I"))
    infos = []
    for _ in range(n_tensors):
        name = rstr()
        dims = [rd("Q") for _ in range(rd("I"))]
        kind, off = rd("I"), rd("Q")
        assert kind == 0, f"{name}: only F32 tensors"
        infos.append((name, dims, off))
    align = meta.get("general.alignment", 32)
    start = (o + align - 1) // align * align
    tensors = {}
    for name, dims, off in infos:
        n = int(np.prod(dims))
        a = np.frombuffer(b, dtype="<f4", count=n, offset=start + off).astype(np.float64)
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
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    if "rope_freqs.weight" in t:
        inv = inv / t["rope_freqs.weight"]
    if m("rope.scaling.type") == "linear":
        inv = inv / m("rope.scaling.factor")
    n = len(tokens)
    ang = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):  # x [n][h][d]
        a, b = x[..., : d // 2], x[..., d // 2:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def unpermute(w, h):  # GGUF row (head, i, half) -> Hugging Face row (head, half, i)
        return w.reshape(h, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(h * d, -1)

    x = t["token_embd.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for l in range(layers):
        p = lambda s: t[f"blk.{l}.{s}"]
        h = rms(x, p("attn_norm.weight"), eps)
        wq, wk = p("attn_q.weight"), p("attn_k.weight")
        if arch == "llama":
            wq, wk = unpermute(wq, heads), unpermute(wk, kv_heads)
        q, k, v = h @ wq.T, h @ wk.T, h @ p("attn_v.weight").T
        if f"blk.{l}.attn_q.bias" in t:
            q, k, v = q + p("attn_q.bias"), k + p("attn_k.bias"), v + p("attn_v.bias")
        q, k, v = q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v.reshape(n, kv_heads, d)
        if arch == "qwen3":
            q, k = rms(q, p("attn_q_norm.weight"), eps), rms(k, p("attn_k_norm.weight"), eps)
        q, k = rope(q), rope(k)
        g = heads // kv_heads
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", s, v).reshape(n, heads * d)
        x = x + att @ p("attn_output.weight").T
        h = rms(x, p("ffn_norm.weight"), eps)
        gate, up = h @ p("ffn_gate.weight").T, h @ p("ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p("ffn_down.weight").T
    out = t.get("output.weight", t["token_embd.weight"])
    return rms(x, t["output_norm.weight"], eps) @ out.T


def main():
    meta, tensors = read_gguf(sys.argv[1])
    tokens = [int(s) for s in sys.argv[2].split(",")]
    logits = forward(meta, tensors, tokens)
    open(sys.argv[3], "wb").write(logits.astype("<f8").tobytes())


if __name__ == "__main__":
    main()
