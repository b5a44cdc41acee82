"""Shared inputs and fixtures of the rotkv test suite."""

import os
import pathlib
import subprocess

import numpy as np
import pytest

import rotkv

PYTHON_DIR = pathlib.Path(__file__).resolve().parent.parent


def inputs(n, seed):
    """The golden inputs: ((i * 37 + seed * 101) % 211 - 105) / 50 in float32, as the Rust
    side (src/bin/golden.rs) computes them."""
    i = np.arange(n, dtype=np.int64)
    return (((i * 37 + seed * 101) % 211).astype(np.float32) - np.float32(105)) / np.float32(50)


def snapshot(cache):
    """Everything a call could change: every layer's bytes, every length, the free blocks."""
    return (
        [(p, s.tobytes()) for p, s in (cache.layer_bytes(layer) for layer in range(cache.layers))],
        cache.free_blocks,
    )


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory):
    """The Rust results of the golden scenario: $ROTKV_GOLDEN (written by `cargo xtask
    python`), else written now by `cargo run --release --bin rotkv-golden`."""
    given = os.environ.get("ROTKV_GOLDEN")
    if given:
        return pathlib.Path(given)
    out = tmp_path_factory.mktemp("golden")
    cmd = ["cargo", "run", "--quiet", "--release", "--manifest-path", str(PYTHON_DIR / "Cargo.toml"),
           "--bin", "rotkv-golden", "--", str(out)]
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"cannot produce the Rust golden results ({e}); set ROTKV_GOLDEN")
    return out


@pytest.fixture
def small_cache():
    """A k2v2 cache with small pages so that a few dozen tokens reach quantized pages."""
    config = rotkv.CacheConfig.k2v2(64)
    config.page_size = 16
    config.window = 16
    config.sinks = 2
    config.protected = 2
    return rotkv.KvCache(config, layers=2, num_kv_heads=2, num_q_heads=4, max_seqs=3, max_tokens=256)
