"""The Python call overhead of one decode step on the CPU backend.

Batch 8, 8K-token context per sequence, Llama-8B-like attention (8 KV heads, 32 query
heads, head_dim 128), k2v2. The same `KvCache.decode` on the same cache and inputs is
timed two ways in one run: called from Python (`cache.decode(..., out=out)`, float32
query, preallocated output: the zero-copy path), and called from Rust in a loop inside
the extension (`cache._time_decode`, no Python in the loop). Medians over interleaved
rounds; the difference is what the binding costs per call (argument checks, numpy
borrows, GIL release and re-acquire, the cache's lock).

    python examples/overhead.py [rounds]
"""

import statistics
import sys
import time

import numpy as np

import rotkv


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    batch, context, hkv, hq, d = 8, 8192, 8, 32, 128
    cache = rotkv.KvCache(rotkv.CacheConfig.k2v2(d), 1, hkv, hq, batch, context)
    rng = np.random.default_rng(0)
    seqs = [cache.add_sequence() for _ in range(batch)]
    for s in seqs:
        for start in range(0, context, 2048):
            k = rng.standard_normal((2048, hkv, d), dtype=np.float32)
            cache.append(0, s, k, k * 0.5)
    q = rng.standard_normal((batch, hq, d), dtype=np.float32)
    out = np.empty((batch, hq, d), np.float32)
    for _ in range(3):  # warm up
        cache.decode(0, seqs, q, out=out)
    py_times, rust_times = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        cache.decode(0, seqs, q, out=out)
        py_times.append(time.perf_counter() - t)
        rust_times.extend(cache._time_decode(0, seqs, q, 1))
    py, rs = statistics.median(py_times), statistics.median(rust_times)
    print(f"decode step, batch {batch}, context {context}, {hkv} KV / {hq} query heads, head_dim {d}, k2v2, cpu")
    print(f"  called from Python: median {py * 1e6:9.1f} us")
    print(f"  called from Rust:   median {rs * 1e6:9.1f} us")
    print(f"  overhead:           {(py - rs) * 1e6:9.1f} us per call ({(py - rs) / rs * 100:.2f}% of the step)")
    # The fixed cost alone: a decode of one sequence holding one token.
    small = rotkv.KvCache(rotkv.CacheConfig.k2v2(d), 1, hkv, hq, 1, 64)
    s = small.add_sequence()
    small.append(0, s, np.ones((1, hkv, d), np.float32), np.ones((1, hkv, d), np.float32))
    q1, out1 = q[:1].copy(), np.empty((1, hq, d), np.float32)
    py1 = []
    for _ in range(2000):
        t = time.perf_counter()
        small.decode(0, [s], q1, out=out1)
        py1.append(time.perf_counter() - t)
    rs1 = small._time_decode(0, [s], q1, 2000)
    print(f"  1-token decode (fixed cost): Python {statistics.median(py1) * 1e6:.1f} us, "
          f"Rust {statistics.median(rs1) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
