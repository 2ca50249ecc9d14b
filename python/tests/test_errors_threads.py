"""Errors and threads.

Every bad input raises ValueError (moh.Error is a subclass) whose message names what was expected
and what was given. threads=1, 2, 3 and an explicit moh.ThreadPool give bitwise identical
results, and Python threads calling one layer at once each get the right result (the GIL is
released while a layer computes).
"""

import concurrent.futures
import threading
import time

import numpy as np
import pytest

import moh


# --- layers the error cases call -------------------------------------------------------------------

class Ctx:
    def __init__(self):
        rng = np.random.default_rng(7)
        self.cfg = moh.MoHConfig(embed_dim=32, num_heads=4, shared_heads=1, active_routed_heads=2)
        self.moh = moh.MoHAttention(self.cfg, seed=3)
        self.moh64 = moh.MoHAttention(self.cfg, seed=3, dtype="float64")
        self.mha = moh.MultiHeadAttention(moh.MHAConfig(embed_dim=32, num_heads=4), seed=1)
        self.vit = moh.MoHAttention(moh.MoHConfig.vit(32, 4, 1, 2, 3, 4), seed=2)
        self.moa_kdim = moh.MoAAttention(moh.MoAConfig(embed_dim=32, num_experts=4, top_k=2,
                                                       head_dim=8, kdim=20), seed=4)
        self.jet = moh.MoAAttention(moh.MoAConfig.jetmoe(32, 2, 4, 2, 8), seed=5)
        self.x = rng.standard_normal((2, 6, 32)).astype(np.float32)
        self.x12 = rng.standard_normal((1, 12, 32)).astype(np.float32)
        self.state = {n: self.moh.weight(n) for n, _ in self.moh.weight_infos()}


@pytest.fixture(scope="module")
def ctx():
    return Ctx()


def _state_with(ctx, **extra):
    s = dict(ctx.state)
    s.update(extra)
    return s


def _readonly(a):
    a.setflags(write=False)
    return a


def _torch_tensor(dtype=None, device=None):
    torch = pytest.importorskip("torch")
    return torch.zeros(2, 6, 32, dtype=dtype or torch.float32, device=device)


def _saved_with_prefix(ctx, tmp_path):
    path = str(tmp_path / "prefixed.safetensors")
    ctx.moh.save_safetensors(path, "blocks.0.")
    return path


def _transnext_module():
    torch = pytest.importorskip("torch")
    import moh_modules as mm

    class TransNeXtLike(mm.MoHViTAttention):  # a first-stage AggregatedAttention's tensors
        def __init__(self):
            super().__init__(32, 4, pretrain_grid=(3, 4), shared_heads=1, active_routed_heads=2)
            self.sr = torch.nn.Conv2d(32, 32, 1)

    return TransNeXtLike()


# (id, call(ctx, tmp_path), parts the message must contain: what was expected, what was given; a
# tuple of strings is a part with alternative wordings)
ERROR_CASES = [
    ("x_wrong_embed_dim", lambda c, p: c.moh(np.zeros((2, 6, 16), np.float32)),
     ["x", "32", "[2, 6, 16]"]),
    ("x_wrong_dtype", lambda c, p: c.moh(np.zeros((2, 6, 32))), ["x", "float32", "float64"]),
    ("x_float32_into_float64_layer", lambda c, p: c.moh64(c.x), ["float64", "float32"]),
    ("x_wrong_axes", lambda c, p: c.moh(np.zeros((6, 32), np.float32)), ["3 axes", "[6, 32]"]),
    ("x_not_an_array", lambda c, p: c.moh([[1.0, 2.0]]), ["NumPy array", "list"]),
    ("x_torch_float16", lambda c, p: c.moh(_torch_tensor(dtype=__import__("torch").float16)),
     ["float32", "float16"]),
    ("x_torch_not_cpu", lambda c, p: c.moh(_torch_tensor(device="meta")), ["CPU", "meta"]),
    ("memory_wrong_width", lambda c, p: c.moh.forward_cross(c.x, np.zeros((2, 5, 16), np.float32)),
     ["memory", "32", "[2, 5, 16]"]),
    ("mask_wrong_shape", lambda c, p: c.moh(c.x, key_padding_mask=np.zeros((2, 5), bool)),
     ["key_padding_mask", "[2, 6]", "[2, 5]"]),
    ("mask_wrong_dtype", lambda c, p: c.moh(c.x, key_padding_mask=np.zeros((2, 6), np.int64)),
     ["key_padding_mask", "bool", "int64"]),
    ("mask_wrong_axes", lambda c, p: c.moh(c.x, key_padding_mask=np.zeros(6, bool)),
     ["key_padding_mask", "2 axes", "[6]"]),
    ("query_padding_mask_on_moh", lambda c, p: c.moh(c.x, query_padding_mask=np.zeros((2, 6), bool)),
     ["query_padding_mask", "MoAAttention", "[2, 6]"]),
    ("new_token_padding_mask_in_forward",
     lambda c, p: c.moh(c.x, new_token_padding_mask=np.zeros((2, 6), bool)),
     ["new_token_padding_mask", "forward_cached"]),
    ("attn_bias_wrong_shape", lambda c, p: c.moh(c.x, attn_bias=np.zeros((2, 4, 6, 5), np.float32)),
     ["attn_bias", "6, 6]", "[2, 4, 6, 5]"]),
    ("attn_bias_wrong_dtype", lambda c, p: c.moh(c.x, attn_bias=np.zeros((1, 1, 6, 6))),
     ["attn_bias", "float32", "float64"]),
    ("unknown_option", lambda c, p: c.moh(c.x, foo=1), ["unknown option 'foo'", "key_padding_mask"]),
    ("unknown_option_none", lambda c, p: c.moh(c.x, key_padding=None),
     ["unknown option 'key_padding'", "key_padding_mask"]),
    ("causal_bad_value", lambda c, p: c.moh(c.x, causal="maybe"), ["causal", "'maybe'", "'auto'"]),
    ("mode_bad_value", lambda c, p: c.moh(c.x, mode="fast"), ["mode", "'fast'", "'sparse'"]),
    ("threads_and_pool", lambda c, p: c.moh(c.x, threads=2, pool=moh.ThreadPool(2)),
     ["threads and pool", "both"]),
    ("threads_zero", lambda c, p: c.moh(c.x, threads=0), ["threads", "expected", "got 0"]),
    ("thread_pool_zero", lambda c, p: moh.ThreadPool(0), [">= 1", "0"]),
    ("grid_on_dot_product_layer", lambda c, p: c.moh(c.x, grid=(2, 3)), ["grid", "cosine", "2 x 3"]),
    ("grid_not_matching_tokens", lambda c, p: c.vit(c.x12, grid=(2, 3)), ["12 tokens", "2 x 3"]),
    ("grid_three_values", lambda c, p: c.vit(c.x12, grid=(1, 2, 6)),
     ["grid", "(h, w)", ("3 values", "(1, 2, 6)")]),
    ("position_offset_negative", lambda c, p: c.jet(c.x, position_offset=-3),
     ["position_offset", ">= 0", "-3"]),
    ("out_wrong_shape", lambda c, p: c.moh(c.x, out=np.zeros((2, 6, 31), np.float32)),
     ["out", "[2, 6, 32]", "[2, 6, 31]"]),
    ("out_wrong_dtype", lambda c, p: c.moh(c.x, out=np.zeros((2, 6, 32))),
     ["out", "float32", "float64"]),
    ("out_read_only", lambda c, p: c.moh(c.x, out=_readonly(np.zeros((2, 6, 32), np.float32))),
     ["out", "writeable", "read-only"]),
    ("attention_weights_wrong_shape",
     lambda c, p: c.moh(c.x, attention_weights=np.zeros((2, 4, 6, 5), np.float32)),
     ["attention_weights", "[2, 4, 6, 6]", "[2, 4, 6, 5]"]),
    ("attention_weights_and_need_weights",
     lambda c, p: c.moh(c.x, need_weights=True, attention_weights=np.zeros((2, 4, 6, 6), np.float32)),
     ["attention_weights and need_weights", "both"]),
    ("unknown_config_field", lambda c, p: moh.MoHConfig(embed_dim=32, foo=1),
     ["unknown field 'foo'", "embed_dim", "active_routed_heads"]),
    ("config_field_wrong_type", lambda c, p: moh.MoHConfig(num_heads="four"),
     ["num_heads", "integer", "str"]),
    ("config_bool_field_int", lambda c, p: moh.MHAConfig(bias=1), ["bias", "True or False", "int"]),
    ("config_bad_enum_string", lambda c, p: moh.MoHConfig(router="bogus"),
     ["router", "learned", "query_norm", "'bogus'"]),
    ("config_bad_enum_string_setter", lambda c, p: setattr(moh.MHAConfig(), "weight_storage", "fp8"),
     ["weight_storage", "bfloat16", "'fp8'"]),
    ("config_impossible", lambda c, p: moh.MoHConfig(embed_dim=32, num_heads=4, shared_heads=5).validate(),
     ["shared_heads", "0..4", "5"]),
    ("layer_of_impossible_config",
     lambda c, p: moh.MultiHeadAttention(moh.MHAConfig(embed_dim=30, num_heads=4), seed=1),
     ["multiple of 4", "30"]),
    ("layer_bad_dtype", lambda c, p: moh.MoHAttention(c.cfg, dtype="float16"),
     ["'float32' or 'float64'", "'float16'"]),
    ("layer_negative_seed", lambda c, p: moh.MoHAttention(c.cfg, seed=-1), ["seed", ">= 0", "-1"]),
    ("layer_seed_and_zero_weights", lambda c, p: moh.MoHAttention(c.cfg, seed=1, zero_weights=True),
     ["seed", "zero_weights", "both"]),
    ("weights_not_set", lambda c, p: moh.MoHAttention(c.cfg)(c.x),
     ["weights not set", "qkv.weight", "expected every weight set"]),
    ("cache_of_wrong_dtype", lambda c, p: c.moh.forward_cached(c.x, c.moh64.make_cache(2, 8)),
     ["cache", "float32", "float64"]),
    ("cache_full", lambda c, p: c.jet.forward_cached(np.zeros((2, 9, 32), np.float32),
                                                     c.jet.make_cache(2, 8)),
     ["full", "capacity 8", "9"]),
    ("cache_wrong_batch", lambda c, p: c.jet.forward_cached(np.zeros((3, 1, 32), np.float32),
                                                            c.jet.make_cache(2, 8)),
     ["batch", "3", "2"]),
    ("cache_of_another_layer", lambda c, p: c.jet.forward_cached(c.x, c.moh.make_cache(2, 8)),
     ["kv_heads", "2", "4"]),
    ("memory_cache_in_forward_cached",
     lambda c, p: c.moh.forward_cached(c.x, c.moh.make_memory_cache(c.x)),
     ["memory cache", "make_cache"]),
    ("padding_mask_with_memory_cache",
     lambda c, p: c.moh.forward_cross(c.x, c.moh.make_memory_cache(c.x),
                                      key_padding_mask=np.zeros((2, 6), bool)),
     ["key_padding_mask", "make_memory_cache", "[2, 6]"]),
    ("cache_bad_sizes", lambda c, p: c.moh.make_cache(0, 4), ["> 0", "0"]),
    ("cache_sequence_out_of_range", lambda c, p: c.moh.make_cache(2, 4).reset(5), ["[0, 2)", "5"]),
    ("cache_truncate_beyond", lambda c, p: c.moh.make_cache(2, 4).truncate(-1), ["length", "-1"]),
    ("routing_of_wrong_kind", lambda c, p: c.moh(c.x, routing=moh.MoARouting()),
     ["MoHRouting", "MoARouting"]),
    ("routing_on_mha", lambda c, p: c.mha(c.x, routing=moh.MoHRouting()),
     ["no routing record", "MoHRouting"]),
    ("routing_not_a_record", lambda c, p: c.jet(c.x, routing=3), ["MoARouting", "int"]),
    ("heads_of_out_of_range", lambda c, p: moh.MoHRouting().heads_of(0, 0), ["b in [0, 0)", "(0, 0)"]),
    ("moa_kdim_self_attention", lambda c, p: c.moa_kdim(c.x), ["kdim = 20", "forward_cross"]),
    ("load_state_dict_wrong_shape",
     lambda c, p: c.moh.load_state_dict(_state_with(c, **{"qkv.weight": np.zeros((96, 31), np.float32)})),
     ["qkv.weight", "[96, 32]", "[96, 31]"]),
    ("load_state_dict_wrong_dtype",
     lambda c, p: c.moh.load_state_dict(_state_with(c, **{"proj.bias": np.zeros(32, np.int32)})),
     ["proj.bias", "float32 or float64", "int32"]),
    ("load_state_dict_missing_tensor",
     lambda c, p: moh.MoHAttention(c.cfg).load_state_dict({"qkv.weight": c.state["qkv.weight"]}),
     ["missing", "expected"]),
    ("load_state_dict_transnext_sr",
     lambda c, p: c.moh.load_state_dict(_state_with(c, **{"sr.weight": np.zeros((32, 32, 1, 1), np.float32)})),
     ["sr.weight", "AggregatedAttention", "expected only the tensors"]),
    ("load_state_dict_cosine_tensor_on_dot_layer",
     lambda c, p: c.moh.load_state_dict(_state_with(c, temperature=np.zeros((4, 1, 1), np.float32))),
     ["temperature", "cosine"]),
    ("from_torch_transnext_sr", lambda c, p: moh.from_torch(_transnext_module()),
     ["sr.weight", "AggregatedAttention"]),
    ("set_weight_wrong_shape", lambda c, p: c.moh.set_weight("qkv.weight", np.zeros((3, 3), np.float32)),
     ["qkv.weight", "[96, 32]", "[3, 3]"]),
    ("set_weight_unknown_name", lambda c, p: c.moh.set_weight("nope", np.zeros(3, np.float32)),
     ["'nope'", "qkv.weight"]),
    ("weight_unknown_name", lambda c, p: c.jet.weight("nope"), ["'nope'", "kv_proj.weight"]),
    ("load_safetensors_missing_file", lambda c, p: moh.load_safetensors(str(p / "absent.safetensors")),
     ["absent.safetensors", "No such file"]),
    ("load_safetensors_wrong_prefix", lambda c, p: moh.load_safetensors(_saved_with_prefix(c, p)),
     ["moh.config", "layer.load_safetensors"]),
    ("load_safetensors_bad_dtype",
     lambda c, p: moh.load_safetensors(_saved_with_prefix(c, p), "blocks.0.", "float16"),
     ["'float32' or 'float64'", "'float16'"]),
    ("save_safetensors_bad_dtype", lambda c, p: c.moh.save_safetensors(str(p / "x.safetensors"), "", "int8"),
     ["bfloat16", "'int8'"]),
    ("from_torch_unknown_module",
     lambda c, p: moh.from_torch(__import__("torch").nn.Linear(3, 3)), ["Linear", "kind="]),
    ("from_torch_bad_kind",
     lambda c, p: moh.from_torch(__import__("torch").nn.MultiheadAttention(8, 2), kind="vit"),
     ["kind", "moh_llama", "'vit'"]),
    ("from_torch_mha_kdim",
     lambda c, p: moh.from_torch(__import__("torch").nn.MultiheadAttention(32, 4, kdim=16, vdim=16)),
     ["kdim", "in_proj_weight"]),
]


@pytest.mark.parametrize("call, parts", [pytest.param(c, s, id=i) for i, c, s in ERROR_CASES])
def test_bad_input_raises_value_error_naming_expected_and_got(ctx, tmp_path, call, parts):
    with pytest.raises(ValueError) as info:
        call(ctx, tmp_path)
    assert isinstance(info.value, moh.Error), f"expected a moh.Error, got {type(info.value).__name__}"
    message = str(info.value)
    missing = [p for p in parts
               if not any(alt in message for alt in (p if isinstance(p, tuple) else (p,)))]
    assert not missing, f"message {message!r} lacks {missing}"


def test_error_is_a_value_error():
    assert issubclass(moh.Error, ValueError)


# Options given a value of the wrong type: a ValueError naming the option, what it takes and
# what it got (not pybind11's "Unable to cast Python instance to C++ type").
MISTYPED_OPTIONS = [
    ("need_weights", "yes"),
    ("need_weights", 1),
    ("threads", "2"),
    ("threads", 2.5),
    ("pool", 3),
    ("grid", 5),
    ("grid", (2, "a")),
    ("position_offset", "3"),
    ("position_offset", 1.5),
]


@pytest.mark.parametrize("option, value", MISTYPED_OPTIONS,
                         ids=[f"{o}={v!r}" for o, v in MISTYPED_OPTIONS])
def test_mistyped_option_raises_value_error(ctx, option, value):
    with pytest.raises(ValueError) as info:
        ctx.jet(ctx.x, causal=True, **{option: value})
    assert isinstance(info.value, moh.Error)
    message = str(info.value)
    given = (type(value).__name__, repr(value), "str")  # the value, its type or the bad element's
    assert f"{option}: expected" in message and any(g in message for g in given), message


def test_numpy_integers_are_integers(ctx):
    """Integer options, config fields and cache sizes take NumPy integers (shapes, sums)."""
    c = moh.MoHConfig(embed_dim=np.int64(32), num_heads=np.int32(4), shared_heads=np.int64(1),
                      active_routed_heads=np.int16(2))
    assert c == ctx.cfg
    x = ctx.x
    np.testing.assert_array_equal(ctx.jet(x, causal=True, threads=np.int64(2)),
                                  ctx.jet(x, causal=True))
    np.testing.assert_array_equal(ctx.jet(x, causal=True, position_offset=np.int32(2)),
                                  ctx.jet(x, causal=True, position_offset=2))
    np.testing.assert_array_equal(ctx.vit(ctx.x12, grid=(np.int64(4), np.int64(3))),
                                  ctx.vit(ctx.x12, grid=(4, 3)))
    cache = ctx.jet.make_cache(np.int64(2), np.int64(4))
    assert cache.capacity == 4 and cache.batch == 2
    with pytest.raises(ValueError, match="expected an integer"):
        moh.MoHConfig(num_heads=True)  # a bool is not a count


def test_failed_call_leaves_cache_unchanged(ctx):
    """A call that fails (here: capacity) appends nothing; the cache still decodes correctly."""
    layer = ctx.jet
    x = np.random.default_rng(3).standard_normal((2, 6, 32)).astype(np.float32)
    cache = layer.make_cache(2, 6)
    layer.forward_cached(x[:, :4], cache)
    with pytest.raises(ValueError):
        layer.forward_cached(x[:, :3], cache)
    assert cache.lengths() == [4, 4]
    got = layer.forward_cached(x[:, 4:6], cache)
    np.testing.assert_allclose(got, layer(x, causal=True)[:, 4:6], rtol=0, atol=1e-5)


# --- threads ---------------------------------------------------------------------------------------

def _thread_layers():
    return {
        "mha": moh.MultiHeadAttention(moh.MHAConfig(embed_dim=64, num_heads=4, num_kv_heads=2,
                                                    rope=True), seed=1),
        "moh": moh.MoHAttention(moh.MoHConfig(embed_dim=64, num_heads=8, shared_heads=2,
                                              active_routed_heads=3), seed=2),
        "moh_vit": moh.MoHAttention(moh.MoHConfig.vit(64, 4, 1, 2, 4, 4), seed=3),
        "moh_llama": moh.MoHAttention(moh.MoHConfig(embed_dim=64, num_heads=8, num_kv_heads=2,
                                                    shared_heads=2, active_routed_heads=3,
                                                    router="query_norm", rope=True,
                                                    qkv_bias=False, proj_bias=False), seed=4),
        "moa": moh.MoAAttention(moh.MoAConfig(embed_dim=64, num_experts=6, top_k=2, head_dim=16),
                                seed=5),
        "jetmoe": moh.MoAAttention(moh.MoAConfig.jetmoe(64, 2, 4, 2, 16), seed=6),
    }


@pytest.mark.parametrize("kind", list(_thread_layers()))
def test_thread_counts_are_bitwise_identical(kind):
    layer = _thread_layers()[kind]
    x = np.random.default_rng(11).standard_normal((3, 16, 64)).astype(np.float32)
    kw = dict(causal=kind in ("moh_llama", "jetmoe", "mha"), need_weights=True)
    routing_kind = moh.MoARouting if kind in ("moa", "jetmoe") else moh.MoHRouting
    results = []
    pool = moh.ThreadPool(2)
    assert pool.size == 2
    for threads in ({"threads": 1}, {"threads": 2}, {"threads": 3}, {"pool": pool}, {}):
        r = None if kind == "mha" else routing_kind()
        y, w = layer(x, routing=r, **threads, **kw)
        results.append((y, w, None if r is None else r.gates))
    y0, w0, g0 = results[0]
    for (y, w, g), how in zip(results[1:], ["threads=2", "threads=3", "pool", "default"]):
        assert np.array_equal(y, y0), f"{kind}: y differs with {how}"
        assert np.array_equal(w, w0), f"{kind}: probabilities differ with {how}"
        if g is not None:
            assert np.array_equal(g, g0), f"{kind}: gates differ with {how}"


def test_python_threads_share_one_layer():
    layer = _thread_layers()["moh"]
    xs = [np.random.default_rng(i).standard_normal((2, 16, 64)).astype(np.float32) for i in range(6)]
    want = [layer(x) for x in xs]
    pool = moh.ThreadPool(2)

    def run(i):
        how = [{}, {"threads": 2}, {"pool": pool}][i % 3]
        r = moh.MoHRouting()
        y = layer(xs[i % 6], routing=r, **how)
        return i, y, r.tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(run, range(36)))
    for i, y, tokens in results:
        assert tokens == 16
        assert np.array_equal(y, want[i % 6]), f"call {i} got another call's result"


def test_python_threads_decode_own_caches():
    layer = _thread_layers()["moh_llama"]
    xs = [np.random.default_rng(20 + i).standard_normal((1, 8, 64)).astype(np.float32)
          for i in range(4)]
    want = [layer(x, causal=True) for x in xs]

    def run(i):
        cache = layer.make_cache(1, 8)
        ys = [layer.forward_cached(xs[i][:, :2], cache)]
        ys += [layer.forward_cached(xs[i][:, t:t + 1], cache) for t in range(2, 8)]
        return np.concatenate(ys, 1)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        got = list(ex.map(run, range(4)))
    for i in range(4):
        np.testing.assert_allclose(got[i], want[i], rtol=0, atol=1e-5)


def test_gil_is_released_during_forward():
    """While one thread is inside a long forward, the main thread keeps running Python."""
    layer = _thread_layers()["moh"]
    x = np.random.default_rng(0).standard_normal((1024, 16, 64)).astype(np.float32)
    best = 0
    for _ in range(3):
        span = {}

        def work():
            span["start"] = time.perf_counter()
            layer(x)
            span["end"] = time.perf_counter()

        worker = threading.Thread(target=work)
        stamps = []
        worker.start()
        while worker.is_alive():
            stamps.append(time.perf_counter())
        worker.join()
        a, b = span["start"], span["end"]
        quarter = (b - a) / 4
        inside = sum(1 for s in stamps if a + quarter < s < b - quarter)
        best = max(best, inside)
        if best > 10:
            break
    assert best > 10, ("the main thread did not run while a forward was computing: the GIL "
                       "seems held during the call")


def test_weight_changes_while_other_threads_compute():
    """set_weight / load_state_dict from one thread while others call the layer: every call sees
    either the old or the new weights as a whole, never a mix, and nothing deadlocks."""
    layer = moh.MoHAttention(moh.MoHConfig(embed_dim=64, num_heads=8, shared_heads=2,
                                           active_routed_heads=3), seed=2)
    x = np.random.default_rng(5).standard_normal((4, 16, 64)).astype(np.float32)
    old = {n: layer.weight(n) for n, _ in layer.weight_infos()}
    new = {n: (v * -1.0).astype(np.float32) for n, v in old.items()}
    want_old = layer(x)
    layer.load_state_dict(new)
    want_new = layer(x)
    layer.load_state_dict(old)
    assert np.abs(want_old - want_new).max() > 1e-3
    stop = threading.Event()
    swaps = [0]

    def swapper():
        while not stop.is_set():
            layer.load_state_dict(new)
            layer.load_state_dict(old)
            swaps[0] += 2

    def caller(_):
        y = layer(x, threads=2)
        return np.array_equal(y, want_old) or np.array_equal(y, want_new)

    t = threading.Thread(target=swapper)
    t.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as ex:
            ok = list(ex.map(caller, range(30)))
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive(), "the thread changing weights did not finish"
    assert swaps[0] > 0
    assert all(ok), f"{ok.count(False)} of {len(ok)} calls saw a mix of old and new weights"
    layer.load_state_dict(old)
    np.testing.assert_array_equal(layer(x), want_old)
