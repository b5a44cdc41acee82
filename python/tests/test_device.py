"""The device API on the emulated GPU (rotkv.Device.sim()): numpy arrays as device
memory, against the CPU cache (KvCache) on the same tokens."""

import os
import threading
import time

import numpy as np
import pytest

import rotkv


def config():
    return rotkv.CacheConfig("k2v2", 64, page_size=16, window=16, sinks=2)


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


HKV, HQ, D = 2, 4, 64


def test_append_and_plan_run_match_the_cpu_cache():
    rng = np.random.default_rng(20)
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=2, max_tokens=128)
    cpu = rotkv.KvCache(config(), 1, HKV, HQ, 2, 128)
    lens, ids = [50, 7], []
    for n in lens:
        k = rng.standard_normal((n, HKV, D)).astype(np.float16)
        v = rng.standard_normal((n, HKV, D)).astype(np.float16)
        s, c = layer.add_sequence(), cpu.add_sequence()
        assert layer.append(s, k[:30], v[:30]) == min(n, 30)
        if n > 30:
            layer.append(s, k[30:], v[30:])
        cpu.append(0, c, k, v)
        ids.append(c)
        assert layer.len(s) == n
    plan = rotkv.DecodePlan(layer, max_seqs=2, max_q_len=1, max_context=128)
    assert plan.num_splits >= 1
    q = rng.standard_normal((2, 1, HQ, D)).astype(np.float32)
    launches = dev.launches
    out = np.zeros((2, 1, HQ, D), np.float32)
    got = plan.run(layer, q, out=out)
    assert got is out and dev.launches > launches
    want = cpu.decode(0, ids, q[:, 0])
    # The emulated kernels against the CPU backend on the same codes (f32 accumulation
    # in another order, the tensor-core kernel's f16 operands): 2e-3.
    assert rel(out[:, 0], want) < 2e-3, rel(out[:, 0], want)
    # A non-contiguous query is copied: the same result.
    q2 = np.asfortranarray(q)
    assert np.array_equal(plan.run(layer, q2), out)


def test_step_batch_prefill_and_decode_match_decode_tokens():
    rng = np.random.default_rng(21)
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=2, max_tokens=128)
    cpu = rotkv.KvCache(config(), 1, HKV, HQ, 2, 128)
    a, b = layer.add_sequence(), layer.add_sequence()
    ca, cb = cpu.add_sequence(), cpu.add_sequence()
    max_rows = 24
    batch = rotkv.StepBatch(dev, max_seqs=2, max_rows=max_rows)
    plan = rotkv.DecodePlan(layer, max_seqs=2, max_q_len=16, max_context=128)
    # Step 1: a takes 16 prompt tokens, b 8; step 2: one token each.
    for step in ([(a, ca, 16), (b, cb, 8)], [(a, ca, 1), (b, cb, 1)]):
        rows = sum(n for _, _, n in step)
        k = np.zeros((max_rows, HKV, D), np.float32)
        v = np.zeros((max_rows, HKV, D), np.float32)
        q = np.zeros((max_rows, HQ, D), np.float32)
        k[:rows] = rng.standard_normal((rows, HKV, D))
        v[:rows] = rng.standard_normal((rows, HKV, D))
        q[:rows] = rng.standard_normal((rows, HQ, D))
        for s, _, n in step:
            layer.reserve(s, layer.len(s) + n)
        batch.set(layer, [(s, n) for s, _, n in step])
        assert batch.rows == rows
        layer.append_batch(batch, k, v)
        out = plan.run_batch(layer, batch, q)
        at = 0
        for s, c, n in step:
            cpu.append(0, c, k[at:at + n], v[at:at + n])
            want = cpu.decode_tokens(0, [c], q[at:at + n][None])[0]
            assert rel(out[at:at + n], want) < 2e-3, rel(out[at:at + n], want)
            at += n
        assert not out[rows:].any()
    assert (layer.len(a), layer.len(b)) == (17, 9)


def test_run_step_in_passes_matches_the_cpu_cache_pass_by_pass():
    rng = np.random.default_rng(23)
    cfg = config()
    cfg.window = 16
    cfg.page_size = 16
    cfg.sinks = 2
    pass_rows = cfg.pass_rows()
    assert pass_rows == 8
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, cfg, HKV, HQ, max_seqs=2, max_tokens=128)
    cpu = rotkv.KvCache(cfg, 1, HKV, HQ, 2, 128)
    a, b = layer.add_sequence(), layer.add_sequence()
    ca, cb = cpu.add_sequence(), cpu.add_sequence()
    max_rows = 40
    batch = rotkv.StepBatch(dev, max_seqs=2, max_rows=max_rows, pass_rows=pass_rows, passes=4)
    assert (batch.passes, batch.pass_rows) == (4, 8)
    plan = rotkv.DecodePlan(layer, max_seqs=2, max_q_len=32, max_context=128)
    for step in ([(a, ca, 30), (b, cb, 5)], [(a, ca, 1), (b, cb, 1)], [(a, ca, 2), (b, cb, 27)]):
        rows = sum(n for _, _, n in step)
        k = np.zeros((max_rows, HKV, D), np.float32)
        v = np.zeros((max_rows, HKV, D), np.float32)
        q = np.zeros((max_rows, HQ, D), np.float32)
        k[:rows] = rng.standard_normal((rows, HKV, D))
        v[:rows] = rng.standard_normal((rows, HKV, D))
        q[:rows] = rng.standard_normal((rows, HQ, D))
        for s, _, n in step:
            layer.reserve(s, layer.len(s) + n)
        batch.set(layer, [(s, n) for s, _, n in step])
        out = plan.run_step(layer, batch, k, v, q)
        at = 0
        for s, c, n in step:
            # The CPU cache, pass by pass: append the pass's rows, then decode them.
            want = []
            for lo in range(0, n, pass_rows):
                hi = min(n, lo + pass_rows)
                cpu.append(0, c, k[at + lo:at + hi], v[at + lo:at + hi])
                want.append(cpu.decode_tokens(0, [c], q[at + lo:at + hi][None])[0])
            assert rel(out[at:at + n], np.concatenate(want)) < 2e-3
            at += n
        assert not out[rows:].any()
    assert (layer.len(a), layer.len(b)) == (33, 33)
    # A sequence with more rows than the passes hold is refused; nothing changes.
    with pytest.raises(rotkv.RotkvError):
        batch.set(layer, [(a, 33)])
    with pytest.raises(ValueError):
        plan.run_step(layer, batch, k, v.astype(np.float16), q)


def test_bad_device_inputs_raise_and_change_nothing():
    rng = np.random.default_rng(22)
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=1, max_tokens=64)
    s = layer.add_sequence()
    k = rng.standard_normal((20, HKV, D)).astype(np.float32)
    layer.append(s, k, k)
    before = layer.read_cache()
    plan = rotkv.DecodePlan(layer, max_seqs=1, max_q_len=1, max_context=64)
    cases = [
        lambda: layer.append(s, k[:, :1], k[:, :1]),  # heads
        lambda: layer.append(s, k, k.astype(np.float16)),  # mixed dtypes
        lambda: layer.append(s, k.astype(np.float64), k.astype(np.float64)),
        lambda: layer.append(s, np.zeros((50, HKV, D), np.float32), np.zeros((50, HKV, D), np.float32)),  # capacity
        lambda: plan.run(layer, np.zeros((2, 1, HQ, D), np.float32)),  # slots
        lambda: plan.run(layer, np.zeros((1, 2, HQ, D), np.float32)),  # q_len past the plan
        lambda: plan.run(layer, np.zeros((1, 1, HQ, D), np.float32), out=np.zeros((1, 1, HQ, D), np.float64)),
        lambda: rotkv.DeviceLayer(dev, rotkv.CacheConfig.k2v2(96), 1, 1, 1, 16),
        lambda: layer.len(rotkv.DeviceLayer(dev, config(), HKV, HQ, 1, 64).add_sequence()),  # foreign id
    ]
    for i, call in enumerate(cases):
        with pytest.raises(rotkv.RotkvError):
            call()
        after = layer.read_cache()
        assert after[0] == before[0] and np.array_equal(after[1], before[1]), i
    assert layer.len(s) == 20


def test_advance_and_check_batch_do_the_host_side_only():
    rng = np.random.default_rng(24)
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=2, max_tokens=64)
    s = layer.add_sequence()
    layer.reserve(s, 20)
    batch = rotkv.StepBatch(dev, max_seqs=2, max_rows=8)
    plan = rotkv.DecodePlan(layer, max_seqs=2, max_q_len=8, max_context=64)
    batch.set(layer, [(s, 5)])
    launches = dev.launches
    plan.check_batch(layer, batch)  # before the step's advance
    layer.advance(batch)
    plan.check_batch(layer, batch)  # and after it
    assert layer.len(s) == 5 and dev.launches == launches, "nothing enqueued"
    with pytest.raises(ValueError):
        layer.advance(batch)  # its start is no longer the sequence's length
    assert layer.len(s) == 5
    batch.set(layer, [(s, 8)])
    layer.advance(batch)
    k = rng.standard_normal((8, HKV, D)).astype(np.float32)
    with pytest.raises(ValueError):
        layer.append_batch(batch, k, k)  # already advanced past this batch


def test_a_thread_waiting_for_a_busy_layer_does_not_hold_the_gil():
    # One thread runs a long step on the emulator (the layer locked, the GIL released); a
    # second asks the layer for a length and waits for the lock; a pure-Python thread
    # must keep running while both wait.
    rng = np.random.default_rng(25)
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=1, max_tokens=1024)
    s = layer.add_sequence()
    layer.reserve(s, 1024)
    batch = rotkv.StepBatch(dev, max_seqs=1, max_rows=512)
    plan = rotkv.DecodePlan(layer, max_seqs=1, max_q_len=512, max_context=1024)
    batch.set(layer, [(s, 512)])
    k = rng.standard_normal((512, HKV, D)).astype(np.float32)
    q = rng.standard_normal((512, HQ, D)).astype(np.float32)
    times = {}

    def step():
        times["step"] = time.perf_counter()
        plan.run_step(layer, batch, k, k, q)
        times["step_end"] = time.perf_counter()

    def length():
        times["len"] = time.perf_counter()
        layer.len(s)
        times["len_end"] = time.perf_counter()

    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    tick = threading.Thread(target=ticker)
    tick.start()
    a = threading.Thread(target=step)
    a.start()
    time.sleep(0.05)
    b = threading.Thread(target=length)
    b.start()
    a.join()
    b.join()
    stop.set()
    tick.join()
    waited = (times["len"], min(times["len_end"], times["step_end"]))
    assert times["step_end"] - times["len"] > 0.05, "the step is too short to tell"
    during = [x for x in ticks if waited[0] < x < waited[1]]
    assert len(during) >= 10, (waited, len(during))


class FakeCudaArray:
    """A host array that also presents __cuda_array_interface__ (a test double of a device
    tensor: the emulated device takes it because it is host memory, __array_interface__
    at the same address)."""

    def __init__(self, a, strides=None, typestr=None, readonly=False):
        self.a = a
        self.__array_interface__ = a.__array_interface__
        self.__cuda_array_interface__ = {
            "shape": a.shape,
            "typestr": typestr or a.dtype.str,
            "data": (a.__array_interface__["data"][0], readonly),
            "strides": strides,
            "version": 3,
        }


def test_device_tensors_by_address_match_host_arrays():
    # The pointer path of the device API (what a CUDA device takes), on the emulated
    # device through host memory: the same results as numpy inputs, bit for bit.
    rng = np.random.default_rng(26)
    k = rng.standard_normal((20, HKV, D)).astype(np.float16)
    v = rng.standard_normal((20, HKV, D)).astype(np.float16)
    q = rng.standard_normal((1, 1, HQ, D)).astype(np.float32)
    qq = rng.standard_normal((4, HQ, D)).astype(np.float32)
    outs = []
    for wrap in (lambda a: a, FakeCudaArray):
        dev = rotkv.Device.sim()
        layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=1, max_tokens=64)
        s = layer.add_sequence()
        layer.append(s, wrap(k), wrap(v))
        plan = rotkv.DecodePlan(layer, max_seqs=1, max_q_len=1, max_context=64)
        out = np.zeros((1, 1, HQ, D), np.float32)
        got = plan.run(layer, wrap(q), out=wrap(out))
        assert got is not None
        outs.append(out.copy())
        # A step in passes through pointers too.
        batch = rotkv.StepBatch(dev, max_seqs=1, max_rows=4, pass_rows=2, passes=2)
        layer.reserve(s, 24)
        batch.set(layer, [(s, 4)])
        kk, vv = k[:4].copy(), v[:4].copy()
        o = np.zeros((4, HQ, D), np.float32)
        plan2 = rotkv.DecodePlan(layer, max_seqs=1, max_q_len=4, max_context=64)
        plan2.run_step(layer, batch, wrap(kk), wrap(vv), wrap(qq), out=wrap(o))
        outs.append(o)
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])
    assert outs[0].any() and outs[1].any()


def test_device_tensors_are_checked():
    dev = rotkv.Device.sim()
    layer = rotkv.DeviceLayer(dev, config(), HKV, HQ, max_seqs=1, max_tokens=64)
    s = layer.add_sequence()
    k = np.zeros((4, HKV, D), np.float32)
    plan = rotkv.DecodePlan(layer, max_seqs=1, max_q_len=1, max_context=64)
    q = np.zeros((1, 1, HQ, D), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        layer.append(s, FakeCudaArray(k, strides=(4, 16 * D, 4)), FakeCudaArray(k))
    with pytest.raises(ValueError, match="typestr"):
        layer.append(s, FakeCudaArray(k, typestr="<f8"), FakeCudaArray(k, typestr="<f8"))
    with pytest.raises(ValueError, match="both host or both device"):
        layer.append(s, FakeCudaArray(k), k)
    with pytest.raises(ValueError, match="writeable float32"):
        plan.run(layer, q, out=FakeCudaArray(np.zeros_like(q), readonly=True))
    with pytest.raises(ValueError, match="shares memory"):
        plan.run(layer, FakeCudaArray(q), out=FakeCudaArray(q))

    class Device:  # a device pointer: no __array_interface__
        def __init__(self, a):
            self.__cuda_array_interface__ = FakeCudaArray(a).__cuda_array_interface__

    with pytest.raises(rotkv.RotkvError, match="emulated device"):
        layer.append(s, Device(k), Device(k))
    assert layer.len(s) == 0


def test_cuda_device_without_a_gpu_raises():
    if os.environ.get("ROTKV_TEST_DEVICE") == "cuda":
        pytest.skip("a GPU is present")
    with pytest.raises(rotkv.RotkvError):
        rotkv.Device.cuda()
