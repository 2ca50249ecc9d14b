"""What the binding guards beyond a single call: zero copy checked by address, misaligned and
overlapping arrays, a cache or routing record used by two threads, fork, the entry points'
probability shapes, from_torch on modules that carry no settings, and argument types."""

import os
import pathlib
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import moh
from moh_test_helpers import assert_close


def _moh_layer(D=32, H=4, **kw):
    c = moh.MoHConfig(embed_dim=D, num_heads=H, shared_heads=1, active_routed_heads=2, **kw)
    return moh.MoHAttention(c, seed=11)


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_the_call_reads_the_callers_memory():
    layer, x = _moh_layer(), _x(2, 5, 32)
    layer(x)
    assert moh._core._last_input_pointer() == x.ctypes.data
    t = torch.from_numpy(_x(2, 5, 32, seed=1))
    layer(t)
    assert moh._core._last_input_pointer() == t.data_ptr()
    strided = _x(2, 10, 32)[:, ::2]
    layer(strided)
    assert moh._core._last_input_pointer() != strided.ctypes.data  # a copy, counted


def test_a_misaligned_array_is_copied_not_read_in_place():
    layer, x = _moh_layer(), _x(1, 4, 32)
    raw = bytearray(x.nbytes + 2)
    skewed = np.frombuffer(raw, dtype=np.float32, count=x.size, offset=2).reshape(x.shape)
    skewed[...] = x
    assert not skewed.flags.aligned
    before = moh.input_copies()
    got = layer(skewed)
    assert moh.input_copies() == before + 1
    assert np.array_equal(got, layer(x))


def test_out_may_not_overlap_what_the_call_reads():
    layer, x = _moh_layer(), _x(2, 5, 32)
    with pytest.raises(ValueError, match="out: expected an array that shares no memory.*x"):
        layer(x, out=x)
    y = np.empty((2, 5, 32), np.float32)
    layer(x, out=y)  # a separate array is fine
    assert np.array_equal(y, layer(x))


def test_overlap_is_checked_against_the_bias_actually_passed():
    layer, x = _moh_layer(), _x(2, 5, 32)
    big = np.zeros((3, 4, 5, 5), np.float32)
    with pytest.raises(ValueError, match="attention_weights.*overlaps"):
        layer(x, attn_bias=big[:1], attention_weights=big[:2])  # shares big[0]
    layer(x, attn_bias=big[:1], attention_weights=big[1:3])  # adjacent, not overlapping


def test_out_tensor_that_requires_grad_is_refused():
    layer, x = _moh_layer(), torch.from_numpy(_x(1, 3, 32))
    out = torch.zeros(1, 3, 32, requires_grad=True)
    with pytest.raises(ValueError, match="requires_grad"):
        layer(x, out=out)


def _wait_for_error(thread, probe):
    """Calls probe() until it raises moh.Error or the thread ends; returns the error or None."""
    while thread.is_alive():
        try:
            probe()
        except moh.Error as e:
            return e
        time.sleep(0)
    return None


def test_a_cache_in_use_by_one_thread_is_refused_to_another():
    layer = _moh_layer(D=64, H=4)
    cache = layer.make_cache(1, 3000)
    x = _x(1, 3000, 64)
    worker = threading.Thread(target=lambda: layer.forward_cached(x, cache))
    worker.start()
    err = _wait_for_error(worker, lambda: cache.length())
    worker.join()
    assert err is not None and "in use by a call on another thread" in str(err)
    assert cache.length() == 3000  # the call finished; the cache is free again


def test_a_routing_record_being_filled_is_refused_to_another_thread():
    layer = _moh_layer(D=64, H=4)
    routing = moh.MoHRouting()
    x = _x(1, 3000, 64)
    worker = threading.Thread(target=lambda: layer(x, routing=routing))
    worker.start()
    err = _wait_for_error(worker, lambda: routing.gates)
    worker.join()
    assert err is not None and "filling" in str(err)
    assert routing.gates.shape == (3000, 4)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_threads_work_in_a_forked_child():
    layer, x = _moh_layer(), _x(2, 6, 32)
    want = layer(x, threads=2)  # the parent's pool of 2 exists now
    pid = os.fork()
    if pid == 0:  # the child: its copy of that pool has no threads
        try:
            os._exit(0 if np.array_equal(layer(x, threads=2), want) else 1)
        except BaseException:
            os._exit(2)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("a threads=2 call in a forked child did not return within 30 s")


def test_probabilities_of_a_memory_cache_and_of_a_ragged_cache():
    layer = moh.MoHAttention(moh.MoHConfig(embed_dim=32, num_heads=4, shared_heads=1,
                                           active_routed_heads=2), seed=3)
    x, memory = _x(2, 3, 32), _x(2, 7, 32, seed=1)
    y_direct, w_direct = layer.forward_cross(x, memory, need_weights=True)
    mem_cache = layer.make_memory_cache(memory)
    y_cached, w_cached = layer.forward_cross(x, mem_cache, need_weights=True)
    assert w_cached.shape == (2, 4, 3, 7)
    assert np.array_equal(y_cached, y_direct) and np.array_equal(w_cached, w_direct)
    with pytest.raises(ValueError, match="make_memory_cache"):
        layer.forward_cross(x, layer.make_cache(2, 8))

    cache = layer.make_cache(2, 16)
    layer.forward_cached(_x(2, 5, 32, seed=2), cache)
    cache.truncate(0, 2)  # sequence 0 holds 2 tokens, sequence 1 holds 5
    _, w = layer.forward_cached(_x(2, 1, 32, seed=4), cache, need_weights=True)
    assert w.shape == (2, 4, 1, 6)  # the longest sequence's 5 + the new token
    assert np.all(w[0, :, :, 3:] == 0)  # past sequence 0's 2 + 1 tokens
    used = w.sum(axis=-1)
    assert np.all((np.abs(used - 1) < 1e-5) | (used == 0))


def test_a_broadcast_bias_over_heads_equals_it_spelt_out():
    layer, x = _moh_layer(), _x(2, 5, 32)
    bias = _x(2, 1, 5, 5, seed=5)
    assert np.array_equal(layer(x, attn_bias=bias),
                          layer(x, attn_bias=np.ascontiguousarray(np.repeat(bias, 4, axis=1))))


class _LlamaNamed(nn.Module):
    """A module with LLaMA's tensor names and none of the settings (as a user's own class)."""

    def __init__(self, ref):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            ref.q_proj, ref.k_proj, ref.v_proj, ref.o_proj)


def test_from_torch_with_kind_and_settings_on_a_module_that_carries_none(mm):
    ref = mm.MoHLlamaAttention(32, 4, num_kv_heads=2, shared_heads=1, active_routed_heads=2,
                               rope_theta=500.0).double()
    plain = _LlamaNamed(ref)
    with pytest.raises(ValueError, match="embed_dim"):
        moh.from_torch(plain, kind="moh_llama")
    layer = moh.from_torch(plain, kind="moh_llama", dtype="float64", embed_dim=32, num_heads=4,
                           num_kv_heads=2, shared_heads=1, active_routed_heads=2, rope_theta=500.0)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        want = ref(x, causal=False).y
    assert_close(layer(x), want.numpy())
    with pytest.raises(ValueError, match="torch.nn.MultiheadAttention"):
        moh.from_torch(plain, kind="mha")


def test_argument_types(tmp_path):
    layer, x = _moh_layer(), _x(1, 3, 32)
    with pytest.raises(ValueError, match="seed: expected an integer, got float"):
        moh.MoHAttention(layer.config, seed=1.5)
    with pytest.raises(ValueError, match="at most 64 bits"):
        layer(x, position_offset=2 ** 70)
    assert layer.make_cache(1, 4, "bfloat16").storage == moh.CacheStorage.BFloat16
    with pytest.raises(ValueError, match="storage"):
        layer.make_cache(1, 4, "half")
    cache = layer.make_cache(1, 4)
    with pytest.raises(ValueError, match="KvCache.length: b: expected an integer, got str"):
        cache.length("0")
    with pytest.raises(ValueError, match="cache: expected a moh.KvCache, got NoneType"):
        layer.forward_cached(x, None)
    path = pathlib.Path(tmp_path) / "layer.safetensors"
    layer.save_safetensors(path)
    assert np.array_equal(moh.load_safetensors(path)(x), layer(x))
    c = moh.MHAConfig(embed_dim=8, num_heads=2, rope_theta=np.float32(500.0))
    assert c.rope_theta == 500.0
    assert layer(x, need_weights=np.bool_(True))[1].shape == (1, 4, 3, 3)
    assert (c == None) is False  # noqa: E711 - the comparison itself is under test
    with pytest.raises(ValueError, match="threads: expected 1..1024"):
        layer.make_memory_cache(x, threads=0)
