"""The Python module against the Rust API, bit for bit: the scenario of
src/bin/golden.rs (appends of float32, float16 and bfloat16, a protected position, a
calibrated layer, decode with a fixed split count, decode_tokens, a sliding window and a
softmax scale) run through `rotkv` from numpy, compared with the Rust program's output
(every decode result and every layer's pool and side stores)."""

import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

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


def test_calibration_files_load_as_the_rust_recipe(golden_dir):
    # A calibration file with a measured smoothing choice per KV head (written by the
    # Rust program): Calibration.load gives each layer's recipe for the config's key bits,
    # the same as Calibration::recipe_layer in Rust, bit for bit.
    for name, config in [("k2v2", rotkv.CacheConfig.k2v2(64)), ("k4v2", rotkv.CacheConfig.k4v2(64))]:
        cals = rotkv.Calibration.load(str(golden_dir / "cal.safetensors"), config)
        assert len(cals) == 2
        for layer, c in enumerate(cals):
            for what, got, dtype in [("mean", c.key_mean, np.float32), ("scale", c.key_scale, np.float32), ("perm", c.key_perm, np.uint16)]:
                want = read(golden_dir, f"cal_{name}_{layer}_{what}", dtype)
                assert np.array_equal(got.reshape(-1).view(want.dtype), want), (name, layer, what)
    # The two presets smooth differently (the choices differ per key bits).
    k2 = rotkv.Calibration.load(str(golden_dir / "cal.safetensors"), rotkv.CacheConfig.k2v2(64))
    k4 = rotkv.Calibration.load(str(golden_dir / "cal.safetensors"), rotkv.CacheConfig.k4v2(64))
    assert not np.array_equal(k2[0].key_scale, k4[0].key_scale)
    # A layer's recipe goes into a cache like any calibration.
    cache = rotkv.KvCache(rotkv.CacheConfig.k2v2(64), 2, 2, 4, 1, 64)
    cache.set_calibration(1, k2[1])
    # An older file (no measured choice), another head_dim, a missing file.
    with pytest.raises(rotkv.RotkvValueError, match="calibrate again"):
        rotkv.Calibration.load(str(golden_dir / "cal_old.safetensors"), rotkv.CacheConfig.k2v2(64))
    with pytest.raises(rotkv.RotkvValueError, match="head_dim"):
        rotkv.Calibration.load(str(golden_dir / "cal.safetensors"), rotkv.CacheConfig.k2v2(128))
    with pytest.raises(rotkv.RotkvError):
        rotkv.Calibration.load(str(golden_dir / "missing.safetensors"), rotkv.CacheConfig.k2v2(64))


def test_calibrate_a_real_model_and_load_its_recipe(tmp_path):
    # SmolLM2-135M and alice29.txt from the cache folder (`cargo xtask fetch`; `cargo
    # xtask python` passes it): 512 tokens, about 10-20 s on two cores.
    cache = pathlib.Path(os.environ.get("ROTKV_CACHE_DIR", "/nonexistent"))
    model, text = cache / "models/SmolLM2-135M-Instruct.Q4_1.gguf", cache / "text/alice29.txt"
    if not (model.exists() and text.exists()):
        pytest.skip(f"SmolLM2 or alice29.txt not in {cache} (cargo xtask fetch)")
    out = tmp_path / "cal.safetensors"
    assert rotkv.calibrate(str(model), str(text), str(out), tokens=512) == 30
    for config in (rotkv.CacheConfig.k2v2(64), rotkv.CacheConfig.k4v2(64)):
        cals = rotkv.Calibration.load(str(out), config)
        assert len(cals) == 30 and all(c.num_kv_heads == 3 and c.head_dim == 64 for c in cals)
        assert any(np.abs(c.key_mean).max() > 0 for c in cals), "centered"
        assert any(not np.all(c.key_scale == 1) for c in cals), "some head smoothed"
    with pytest.raises(rotkv.RotkvError):
        rotkv.calibrate(str(model), str(text), str(out), tokens=10**7)  # past the text
    with pytest.raises(rotkv.RotkvError):
        rotkv.calibrate(str(tmp_path / "missing.gguf"), str(text), str(out))
