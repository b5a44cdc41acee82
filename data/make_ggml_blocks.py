"""Writes ggml_blocks.json: random blocks of every ggml type rotkv's GGUF reader reads,
with the f32 values gguf-py (llama.cpp's own Python package, an independent
implementation) dequantizes them to. The test `tests/tests/ggml_blocks.rs` checks
`rotkv::model::gguf::dequantize` against them.

Usage: pip install gguf==0.19.0 numpy && python3 data/make_ggml_blocks.py
"""
import json, os
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

rng = np.random.default_rng(7)
out = {}
for t in [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K]:
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=2 * size, dtype=np.uint8)
    # Keep the f16 scale fields finite and moderate: set every f16 field to a random
    # value in [-2, 2] (their byte offsets per type).
    f16_fields = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
                  T.Q4_K: [0, 2], T.Q6_K: [208]}[t]
    for b in range(2):
        for off in f16_fields:
            v = np.float16(rng.uniform(-2, 2))
            raw[b * size + off: b * size + off + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    values = quants.dequantize(raw, t).reshape(-1).astype(np.float32)
    assert values.size == 2 * block and np.all(np.isfinite(values))
    out[t.name] = {"type": int(t), "bytes": raw.tobytes().hex(), "values": [float(x) for x in values]}
path = os.path.join(os.path.dirname(__file__), "ggml_blocks.json")
with open(path, "w") as f:
    json.dump(out, f)
print("wrote", path)
