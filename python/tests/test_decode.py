"""Incremental decoding through KV caches equals the full forward.

A prompt then tokens one at a time through layer.make_cache(batch, capacity) and
layer.forward_cached(x_new, cache) equals layer.forward(x, causal=True) (and the torch module);
a memory cache (make_memory_cache) equals forward_cross with the memory; a ragged cache (reset /
truncate of one sequence) decodes each sequence as if it were alone; a bfloat16 cache and
bfloat16 weights stay within bfloat16 tolerance of the float ones.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import moh  # noqa: E402

from moh_test_helpers import BF16, EXACT, assert_close, max_error, padding_mask  # noqa: E402


def t64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def make_layer(mm, kind, dtype="float64", **kw):
    """(moh layer, float64 torch module) of a decoder layer kind."""
    if kind == "moh_llama":
        module = mm.MoHLlamaAttention(32, 4, head_dim=8, num_kv_heads=2, shared_heads=1,
                                      active_routed_heads=2).double()
    elif kind == "moh_llama_mqa":
        module = mm.MoHLlamaAttention(24, 4, head_dim=6, num_kv_heads=1, shared_heads=0,
                                      active_routed_heads=2, rope_theta=500000.0).double()
    elif kind == "jetmoe":
        module = mm.JetMoEAttention(32, 8, 2, 4, 2).double()
    elif kind == "mha":
        module = torch.nn.MultiheadAttention(32, 4, batch_first=True).double()
    elif kind == "moh":
        module = mm.MoHAttention(32, 4, shared_heads=1, active_routed_heads=2).double()
    else:
        raise AssertionError(kind)
    return moh.from_torch(module, dtype=dtype, **kw), module


def decode(layer, cache, x, prompt, **kw):
    """forward_cached on x[:, :prompt], then one token at a time; the outputs concatenated."""
    ys = [layer.forward_cached(x[:, :prompt], cache, **kw)] if prompt else []
    for t in range(prompt, x.shape[1]):
        ys.append(layer.forward_cached(x[:, t:t + 1], cache, **kw))
    return np.concatenate(ys, axis=1)


def torch_full(module, x):
    """The torch module's causal forward on x."""
    with torch.no_grad():
        if isinstance(module, torch.nn.MultiheadAttention):
            from moh_test_helpers import torch_mha

            return torch_mha(module, x, causal=True)
        return module(t64(x), causal=True).y.numpy()


DECODERS = ["moh_llama", "moh_llama_mqa", "jetmoe", "mha", "moh"]


@pytest.mark.parametrize("prompt", [0, 1, 4], ids=lambda p: f"prompt{p}")
@pytest.mark.parametrize("kind", DECODERS)
def test_decode_equals_full_forward(mm, rng, kind, prompt):
    layer, module = make_layer(mm, kind)
    B, T = 2, 9
    x = rng.standard_normal((B, T, layer.embed_dim))
    full = layer(x, causal=True)
    assert_close(full, torch_full(module, x), EXACT, f"{kind} full forward vs torch")
    cache = layer.make_cache(B, 12)
    assert cache.batch == B and cache.capacity == 12 and cache.dtype == "float64"
    assert cache.kv_heads == layer.num_kv_heads and cache.head_dim == layer.head_dim
    assert not cache.is_memory and cache.length() == 0
    got = decode(layer, cache, x, prompt)
    assert_close(got, full, EXACT, f"{kind} decode")
    assert cache.length() == T and cache.lengths() == [T, T] and not cache.ragged


def test_decode_in_chunks_and_routing(mm, rng):
    """Chunks of 3 tokens; each call's MoHRouting rows equal those of the full forward."""
    layer, _ = make_layer(mm, "moh_llama")
    x = rng.standard_normal((2, 9, 32))
    full_routing = moh.MoHRouting()
    full = layer(x, causal=True, routing=full_routing)
    cache = layer.make_cache(2, 9)
    ys, gates = [], []
    for start in range(0, 9, 3):
        r = moh.MoHRouting()
        ys.append(layer.forward_cached(x[:, start:start + 3], cache, routing=r))
        assert r.batch == 2 and r.tokens == 3
        gates.append(r.gates.reshape(2, 3, 4))
    assert_close(np.concatenate(ys, 1), full, EXACT, "chunked decode")
    np.testing.assert_array_equal(np.concatenate(gates, 1).reshape(18, 4), full_routing.gates)


def test_decode_float32_and_threads(mm, rng):
    """A float32 layer decodes within float32 rounding of its full forward, and the same with 2
    threads bitwise."""
    layer, _ = make_layer(mm, "jetmoe", dtype="float32")
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    full = layer(x, causal=True)
    c1, c2 = layer.make_cache(2, 8), layer.make_cache(2, 8)
    assert c1.dtype == "float32"
    y1 = decode(layer, c1, x, 3)
    y2 = decode(layer, c2, x, 3, threads=2)
    assert_close(y1, full, 1e-5, "float32 decode")
    np.testing.assert_array_equal(y1, y2)


def test_decode_with_padded_prompt(mm, rng):
    """Left-padded prompts (new_token_padding_mask) then steps equal the full forward with the
    same key_padding_mask, on the tokens that are not padding."""
    layer, module = make_layer(mm, "moh_llama")
    B, T = 3, 8
    x = rng.standard_normal((B, T, 32))
    pad = np.zeros((B, T), dtype=bool)
    pad[:, :5] = padding_mask(B, 5, "left")
    full = layer(x, causal=True, key_padding_mask=pad)
    with torch.no_grad():
        want = module(t64(x), key_padding_mask=torch.from_numpy(pad)).y.numpy()
    assert_close(full[~pad], want[~pad], EXACT, "full forward vs torch")
    cache = layer.make_cache(B, T)
    ys = [layer.forward_cached(x[:, :5], cache, new_token_padding_mask=pad[:, :5])]
    ys += [layer.forward_cached(x[:, t:t + 1], cache) for t in range(5, T)]
    got = np.concatenate(ys, 1)
    assert_close(got[~pad], full[~pad], EXACT, "padded-prompt decode")


def test_decode_attention_probabilities(mm, rng):
    """need_weights in forward_cached: [B, H, T_new, cached + T_new], the last row of the full
    forward's probabilities."""
    layer, _ = make_layer(mm, "moh_llama")
    x = rng.standard_normal((2, 6, 32))
    _, w_full = layer(x, causal=True, need_weights=True)
    cache = layer.make_cache(2, 6)
    layer.forward_cached(x[:, :5], cache)
    y, w = layer.forward_cached(x[:, 5:6], cache, need_weights=True)
    assert w.shape == (2, 4, 1, 6)
    assert_close(w, w_full[:, :, 5:6, :], EXACT, "step probabilities")


# --- memory caches ---------------------------------------------------------------------------------

def _cross_layer(mm, kind):
    if kind == "moh":
        module = mm.MoHAttention(32, 4, shared_heads=1, active_routed_heads=2, qk_norm=True).double()
        return moh.from_torch(module, dtype="float64"), 32
    if kind == "mha":
        module = torch.nn.MultiheadAttention(32, 4, batch_first=True).double()
        return moh.from_torch(module, dtype="float64"), 32
    module = mm.MoAAttention(32, 8, 4, 2, kdim=20).double()
    return moh.from_torch(module, dtype="float64"), 20


@pytest.mark.parametrize("kind", ["moh", "mha", "moa_kdim20"])
def test_memory_cache_equals_forward_cross(mm, rng, kind):
    layer, width = _cross_layer(mm, kind)
    B, T, S = 2, 5, 7
    memory = rng.standard_normal((B, S, width))
    kpm = padding_mask(B, S)
    mc = layer.make_memory_cache(memory, key_padding_mask=kpm)
    assert mc.is_memory and mc.length() == S and mc.batch == B
    for step in range(2):  # the cache is read, never changed: twice the same
        x = rng.standard_normal((B, T, 32))
        want = layer.forward_cross(x, memory, key_padding_mask=kpm)
        got = layer.forward_cross(x, mc)
        assert_close(got, want, EXACT, f"{kind} memory cache, call {step}")
        assert mc.length() == S
    # one query token at a time reads the same cache
    x1 = x[:, 2:3]
    assert_close(layer.forward_cross(x1, mc), want[:, 2:3], EXACT, "one token")
    # threads for computing the memory's keys and values do not change them
    mc2 = layer.make_memory_cache(memory, key_padding_mask=kpm, threads=2)
    np.testing.assert_array_equal(layer.forward_cross(x, mc2), got)


def test_memory_cache_matches_torch_moa(mm, rng):
    module = mm.MoAAttention(32, 8, 4, 2, kdim=20).double()
    layer = moh.from_torch(module, dtype="float64")
    x, memory = rng.standard_normal((2, 4, 32)), rng.standard_normal((2, 6, 20))
    with torch.no_grad():
        want = module(t64(x), memory=t64(memory)).y.numpy()
    assert_close(layer.forward_cross(x, layer.make_memory_cache(memory)), want, EXACT, "moa")


# --- ragged caches -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["moh_llama", "jetmoe", "mha"])
def test_ragged_cache_reset_and_truncate(mm, rng, kind):
    """Sequences of different lengths advance in one call; each equals itself decoded alone."""
    layer, _ = make_layer(mm, kind)
    D = layer.embed_dim
    a = rng.standard_normal((1, 10, D))  # sequence 0's tokens
    b = rng.standard_normal((1, 10, D))  # sequence 1's tokens (after its reset)
    cache = layer.make_cache(2, 12)
    layer.forward_cached(np.concatenate([a[:, :4], rng.standard_normal((1, 4, D))]), cache)
    cache.reset(1)  # sequence 1 starts over: a new request in the same slot
    assert cache.lengths() == [4, 0] and cache.ragged
    y = layer.forward_cached(np.concatenate([a[:, 4:7], b[:, :3]]), cache)
    assert cache.lengths() == [7, 3]
    assert_close(y[0:1], layer(a[:, :7], causal=True)[:, 4:7], EXACT, "sequence 0")
    assert_close(y[1:2], layer(b[:, :3], causal=True), EXACT, "sequence 1 (alone)")
    # truncate sequence 0 back to 5 tokens: a[:, 5:7] are forgotten
    cache.truncate(0, 5)
    assert cache.lengths() == [5, 3]
    y = layer.forward_cached(np.concatenate([a[:, 7:9], b[:, 3:5]]), cache)
    alone0 = layer(np.concatenate([a[:, :5], a[:, 7:9]], 1), causal=True)[:, 5:7]
    assert_close(y[0:1], alone0, EXACT, "sequence 0 after truncate")
    assert_close(y[1:2], layer(b[:, :5], causal=True)[:, 3:5], EXACT, "sequence 1")
    # truncate(n): every sequence cut back to at most n
    cache.truncate(4)
    assert cache.lengths() == [4, 4]
    cache.reset()
    assert cache.lengths() == [0, 0] and cache.length() == 0


def test_ragged_decode_equals_each_sequence_alone(mm, rng):
    """Three sequences started at different times through one cache of 3 slots."""
    layer, _ = make_layer(mm, "moh_llama")
    seqs = [rng.standard_normal((1, 8, 32)) for _ in range(3)]
    alone = [layer(s, causal=True) for s in seqs]
    cache = layer.make_cache(3, 16)  # finished sequences take padding tokens: room for them
    pos = [0, 0, 0]
    start = [0, 2, 5]  # step at which each sequence begins (slot reset then)
    outs = [[], [], []]
    for step in range(8 + 5):
        for b in range(3):
            if step == start[b]:
                cache.reset(b)
                pos[b] = 0
        live = [b for b in range(3) if start[b] <= step and pos[b] < 8]
        if not live:
            break
        x = np.zeros((3, 1, 32))
        for b in range(3):
            if b in live:
                x[b, 0] = seqs[b][0, pos[b]]
        # sequences not live this step get a padding token, which no later query sees
        pad = np.array([[b not in live] for b in range(3)])
        y = layer.forward_cached(x, cache, new_token_padding_mask=pad)
        for b in live:
            outs[b].append(y[b:b + 1])
            pos[b] += 1
        for b in range(3):
            if b not in live and start[b] > step:
                cache.reset(b)  # not begun: keep its slot empty
    for b in range(3):
        assert_close(np.concatenate(outs[b], 1), alone[b], EXACT, f"sequence {b}")


def test_cache_clone_is_independent(mm, rng):
    layer, _ = make_layer(mm, "jetmoe")
    x = rng.standard_normal((2, 6, 32))
    cache = layer.make_cache(2, 8)
    layer.forward_cached(x[:, :4], cache)
    twin = cache.clone()
    y_twin = layer.forward_cached(x[:, 4:6], twin)
    assert cache.lengths() == [4, 4] and twin.lengths() == [6, 6]
    y = layer.forward_cached(x[:, 4:6], cache)
    np.testing.assert_array_equal(y, y_twin)
    assert_close(y, layer(x, causal=True)[:, 4:6], EXACT, "clone")


# --- bfloat16 caches and weights -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["moh_llama", "jetmoe", "mha"])
def test_bf16_cache_within_bf16_tolerance(mm, rng, kind):
    layer, _ = make_layer(mm, kind, dtype="float32")
    x = rng.standard_normal((2, 9, layer.embed_dim)).astype(np.float32)
    native = layer.make_cache(2, 12)
    bf16 = layer.make_cache(2, 12, moh.CacheStorage.BFloat16)
    assert native.storage == moh.CacheStorage.Native and bf16.storage == moh.CacheStorage.BFloat16
    assert bf16.bytes * 2 == native.bytes, "a bfloat16 cache holds half the bytes of a float32 one"
    want = decode(layer, native, x, 3)
    got = decode(layer, bf16, x, 3)
    assert_close(got, want, BF16, f"{kind} bf16 cache")
    assert max_error(got, want) > 0, "a bfloat16 cache rounds the keys and values"


def test_bf16_weight_storage_from_torch(mm, rng):
    module = mm.MoHLlamaAttention(32, 4, head_dim=8, num_kv_heads=2, shared_heads=2,
                                  active_routed_heads=1)
    native = moh.from_torch(module)
    bf16 = moh.from_torch(module, weight_storage=moh.WeightStorage.BFloat16)
    assert bf16.config.weight_storage == moh.WeightStorage.BFloat16
    assert bf16.weight_bytes * 2 == native.weight_bytes
    # the stored values are the bfloat16 roundings of the module's
    for name, _ in bf16.weight_infos():
        want = torch.from_numpy(native.weight(name)).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(bf16.weight(name), want, err_msg=name)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    want, got = native(x, causal=True), bf16(x, causal=True)
    assert_close(got, want, BF16, "bf16 weights")
    assert max_error(got, want) > 0
    # and decodes as its own full forward
    assert_close(decode(bf16, bf16.make_cache(2, 8), x, 2), got, 1e-5, "bf16 weights decode")


def _config_maker(kind, embed_dim):
    """(a function making a fresh config of `kind` with 4 heads or experts, the layer class)."""
    if kind == "mha":
        return (lambda: moh.MHAConfig(embed_dim=embed_dim, num_heads=4)), moh.MultiHeadAttention
    if kind == "moh":
        return (lambda: moh.MoHConfig(embed_dim=embed_dim, num_heads=4, shared_heads=1,
                                      active_routed_heads=2)), moh.MoHAttention
    return (lambda: moh.MoAConfig(embed_dim=embed_dim, num_experts=4, top_k=2,
                                  head_dim=embed_dim // 4)), moh.MoAAttention


@pytest.mark.parametrize("kind", ["mha", "moh", "moa"])
def test_packed_weight_storage_gives_the_native_bits(rng, kind):
    """weight_storage NativePacked (or 'native_packed'): more bytes, the same results."""
    make, cls = _config_maker(kind, 64)
    native_cfg, packed_cfg = make(), make()
    packed_cfg.weight_storage = "native_packed"
    assert packed_cfg.weight_storage == moh.WeightStorage.NativePacked
    native, packed = cls(native_cfg, seed=7), cls(packed_cfg, seed=7)
    assert packed.weight_bytes > native.weight_bytes
    x = rng.standard_normal((2, 37, 64)).astype(np.float32)
    np.testing.assert_array_equal(packed(x), native(x))
    np.testing.assert_array_equal(packed(x, threads=2), native(x))


@pytest.mark.parametrize("kind", ["mha", "moh", "moa"])
def test_bf16_weight_storage_in_config(rng, kind):
    """config.weight_storage = BFloat16 (also as the string 'bfloat16'), seeded weights."""
    make, cls = _config_maker(kind, 32)
    native_cfg, bf16_cfg = make(), make()
    bf16_cfg.weight_storage = moh.WeightStorage.BFloat16
    str_cfg = make()
    str_cfg.weight_storage = "bfloat16"
    assert str_cfg == bf16_cfg and str_cfg.weight_storage == moh.WeightStorage.BFloat16
    native, bf16 = cls(native_cfg, seed=5), cls(bf16_cfg, seed=5)
    assert bf16.weight_bytes < native.weight_bytes
    # the native layer with the bfloat16 layer's (rounded) weights computes nearly the same
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    a, b = native(x), bf16(x)
    assert_close(b, a, BF16, f"{kind} bf16 weights")
    # moh routing may flip on a near-tie; MHA has none: it must differ only by rounding
    if kind == "mha":
        assert max_error(a, b) > 0
    rounded = cls(native_cfg, dtype="float32")
    rounded.load_state_dict({n: bf16.weight(n) for n, _ in bf16.weight_infos()})
    assert_close(rounded(x), b, 1e-5, "native layer with the rounded weights")


@pytest.mark.parametrize("kind", ["moh_llama", "jetmoe"])
@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "llama3"),
    ({"type": "linear", "factor": 2.0}, "linear"),
])
def test_from_torch_refuses_a_rope_scaling_it_does_not_compute(mm, kind, scaling, named):
    _, module = make_layer(mm, kind)
    module.rope_scaling = scaling
    with pytest.raises(moh.Error, match=f"rope_scaling.*{named}"):
        moh.from_torch(module)
    module.rope_scaling = {"rope_type": "default"}  # unscaled: what moh computes
    moh.from_torch(module)


def test_from_torch_refuses_a_partial_rotary_factor(mm):
    _, module = make_layer(mm, "moh_llama")
    module.partial_rotary_factor = 0.5
    with pytest.raises(moh.Error, match="partial_rotary_factor.*expected 1.0, got 0.5"):
        moh.from_torch(module)
