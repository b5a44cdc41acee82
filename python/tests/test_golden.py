"""The Python module against the Rust API, bit for bit: the scenario of
src/bin/golden.rs (appends of float32, float16 and bfloat16, a protected position, a
calibrated layer, decode with a fixed split count, decode_tokens, a sliding window and a
softmax scale) run through `rotkv` from numpy, compared with the Rust program's output
(every decode result and every layer's pool and side stores)."""

import ml_dtypes
import numpy as np

import rotkv
from conftest import inputs


def read(golden_dir, name, dtype):
    return np.fromfile(golden_dir / f"{name}.bin", dtype=dtype)


def test_every_result_matches_rust_bit_for_bit(golden_dir):
    hkv, hq, d = 2, 4, 64
    row, qrow = hkv * d, hq * d
    config = rotkv.CacheConfig("k2v2", 64, page_size=16, window=16, sinks=2, protected=2)
    cache = rotkv.KvCache(config, layers=2, num_kv_heads=hkv, num_q_heads=hq, max_seqs=3, max_tokens=256)
    i = np.arange(row)
    calib = rotkv.Calibration(
        key_mean=inputs(row, 7).reshape(hkv, d),
        key_scale=(1.0 + (i % 3) / 4.0).astype(np.float32).reshape(hkv, d),
        key_perm=(d - 1 - i % d).reshape(hkv, d),
        value_perm=((i % d) * 5 % d).reshape(hkv, d),
    )
    cache.set_calibration(1, calib)
    a = cache.add_sequence()
    b = cache.add_sequence()
    kv = lambda n, seed, dtype=np.float32: inputs(n * row, seed).reshape(n, hkv, d).astype(dtype)  # noqa: E731
    cache.append(0, a, kv(50, 1), kv(50, 2))
    cache.protect(0, a, [45])
    cache.append(0, a, kv(30, 3, np.float16), kv(30, 4, np.float16))
    cache.append(0, b, kv(7, 5, ml_dtypes.bfloat16), kv(7, 6, ml_dtypes.bfloat16))
    cache.append(1, a, kv(80, 8), kv(80, 1))
    out0 = cache.decode(0, [a, b], inputs(2 * qrow, 9).reshape(2, hq, d))
    out1 = cache.decode(0, [b, a], inputs(2 * qrow, 10).reshape(2, hq, d).astype(np.float16), num_splits=3)
    out2 = cache.decode_tokens(0, [a], inputs(3 * qrow, 11).reshape(1, 3, hq, d).astype(ml_dtypes.bfloat16))
    cache.set_window_left(1, 20)
    cache.set_softmax_scale(0.2)
    out3 = cache.decode(1, [a], inputs(qrow, 12).reshape(1, hq, d))
    for name, out in [("out0", out0), ("out1", out1), ("out2", out2), ("out3", out3)]:
        want = read(golden_dir, name, np.float32)
        assert out.size == want.size, name
        assert np.array_equal(out.reshape(-1).view(np.uint32), want.view(np.uint32)), name
        assert np.isfinite(out).all() and np.abs(out).max() > 0.01, name
    for layer in range(2):
        pool, sides = cache.layer_bytes(layer)
        assert pool == read(golden_dir, f"pool{layer}", np.uint8).tobytes(), f"pool of layer {layer}"
        assert np.array_equal(sides.view(np.uint16), read(golden_dir, f"sides{layer}", np.uint16)), layer
    assert cache.protected(0, a) == [45]
    assert (cache.len(0, a), cache.len(0, b), cache.len(1, a), cache.len(1, b)) == (80, 7, 80, 0)
