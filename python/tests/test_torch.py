"""torch interop: CPU torch.Tensors (float32, float16, bfloat16, strided views) read like
the numpy arrays of the same values, bit for bit, on the CPU cache and the emulated
device; one attention layer of a real model on torch tensors against
torch.nn.functional.scaled_dot_product_attention (examples/torch_attention.py).

`cargo xtask python` installs the PyPI torch wheel (pinned) into its venv, so these run in
CI; elsewhere they skip when torch is not installed."""

import sys

import ml_dtypes
import numpy as np
import pytest

import rotkv
from conftest import PYTHON_DIR

torch = pytest.importorskip("torch")

sys.path.insert(0, str(PYTHON_DIR / "examples"))
import torch_attention  # noqa: E402


def kv(n, seed, hkv=2, d=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_tensors_read_like_numpy_arrays(dtype):
    tdt = getattr(torch, dtype)
    ndt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    k, v = kv(100, 1)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(2))
    k, v, q = k.to(tdt), v.to(tdt), q.to(tdt)

    def numpy_of(t):
        return t.float().numpy().astype(ndt)

    outs = []
    for conv in (lambda t: t, numpy_of):
        cache = rotkv.KvCache(rotkv.CacheConfig.k2v2(64), 1, 2, 4, 1, 128)
        s = cache.add_sequence()
        cache.append(0, s, conv(k[:70]), conv(v[:70]))
        cache.append(0, s, conv(k[70:]), conv(v[70:]))
        outs.append(cache.decode(0, [s], conv(q)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_strided_torch_views_are_read_in_order():
    # A transposed view (a [heads, tokens, d] layout read as [tokens, heads, d]) is copied
    # in C order, as numpy's strided arrays are.
    k, v = kv(40, 3)
    kt, vt = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    assert not kt.is_contiguous()
    q = torch.randn(1, 4, 64)
    outs = []
    for a, b in ((k, v), (kt, vt)):
        cache = rotkv.KvCache(rotkv.CacheConfig.k4v2(64), 1, 2, 4, 1, 64)
        s = cache.add_sequence()
        cache.append(0, s, a, b)
        outs.append(cache.decode(0, [s], q))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_the_device_api_takes_torch_tensors():
    k, v = kv(24, 4)
    q = torch.randn(1, 1, 4, 64)
    outs = []
    for conv in (lambda t: t, lambda t: t.numpy()):
        dev = rotkv.Device.sim()
        layer = rotkv.DeviceLayer(dev, rotkv.CacheConfig.k2v2(64), 2, 4, max_seqs=1, max_tokens=64)
        s = layer.add_sequence()
        layer.append(s, conv(k), conv(v))
        plan = rotkv.DecodePlan(layer, max_seqs=1, max_q_len=1, max_context=64)
        outs.append(plan.run(layer, conv(q)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_bad_torch_inputs_raise():
    cache = rotkv.KvCache(rotkv.CacheConfig.k2v2(64), 1, 2, 4, 1, 64)
    s = cache.add_sequence()
    k, v = kv(8, 5)
    with pytest.raises(ValueError):
        cache.append(0, s, k.double(), v.double())  # float64
    with pytest.raises(ValueError):
        cache.append(0, s, k.to(torch.int32), v.to(torch.int32))
    with pytest.raises(ValueError):
        cache.append(0, s, k[:, :1], v[:, :1])  # heads
    assert cache.len(0, s) == 0


# The same bounds as the numpy example's test (the README's "attn-out rel err"), for
# float16 and bfloat16 inputs; measured 0.088 / 0.077 / 0.015 (layer 0) and 0.191 /
# 0.102 / 0.027 (layer 5) for k2v2 / k4v2 / k4v4 with float16 inputs.
@pytest.mark.parametrize("layer,preset,low,high", [
    (0, "k4v2", 0.075, 0.080), (5, "k4v2", 0.099, 0.105),
    (0, "k2v2", 0.05, 0.100), (5, "k2v2", 0.10, 0.290),
    (0, "k4v4", 0.005, 0.03), (5, "k4v4", 0.005, 0.05),
])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_attention_layer_on_torch_tensors_matches_sdpa(layer, preset, low, high, dtype):
    tile = torch_attention.load_safetensors(torch_attention.TILE)
    err = torch_attention.layer_error(tile, layer, preset, dtype=getattr(torch, dtype))
    assert low < err < high, err
