"""Arrays in and out (zero copy, torch tensors, out=), saving and loading layers, state dicts for
PyTorch, and the config objects (keywords, to_dict, pickling, enum fields as strings)."""

import os
import pickle

import numpy as np
import pytest

import moh

from moh_test_helpers import EXACT, assert_close  # noqa: E402


@pytest.fixture
def layer():
    return moh.MoHAttention(moh.MoHConfig(embed_dim=32, num_heads=4, shared_heads=1,
                                          active_routed_heads=2), seed=3)


@pytest.fixture
def x(rng):
    return rng.standard_normal((2, 6, 32)).astype(np.float32)


# --- zero copy -------------------------------------------------------------------------------------

def test_c_contiguous_input_is_not_copied(layer, x):
    n = moh.input_copies()
    y = layer(x)
    kpm = np.zeros((2, 6), dtype=bool)
    layer(x, key_padding_mask=kpm, attn_bias=np.zeros((1, 1, 6, 6), np.float32))
    assert moh.input_copies() == n, "a C-contiguous float32 input (and mask, bias) must be read in place"
    assert y.shape == (2, 6, 32) and y.dtype == np.float32


def test_float64_layer_reads_float64_in_place(rng):
    layer = moh.MultiHeadAttention(moh.MHAConfig(embed_dim=16, num_heads=2), seed=1, dtype="float64")
    x = rng.standard_normal((2, 5, 16))
    n = moh.input_copies()
    y = layer(x)
    assert moh.input_copies() == n and y.dtype == np.float64


def test_strided_input_is_copied_once_and_right(layer, rng):
    big = rng.standard_normal((2, 12, 32)).astype(np.float32)
    view = big[:, ::2]
    assert not view.flags.c_contiguous
    want = layer(np.ascontiguousarray(view))
    n = moh.input_copies()
    got = layer(view)
    assert moh.input_copies() == n + 1
    np.testing.assert_array_equal(got, want)


def test_transposed_input_is_copied_once_and_right(layer, x):
    transposed = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)  # same values
    assert not transposed.flags.c_contiguous
    n = moh.input_copies()
    got = layer(transposed)
    assert moh.input_copies() == n + 1
    np.testing.assert_array_equal(got, layer(x))


def test_strided_mask_and_memory_are_copied(layer, x, rng):
    mask = np.zeros((2, 10), dtype=bool)[:, ::2]
    memory = rng.standard_normal((2, 10, 32)).astype(np.float32)[:, ::2]
    n = moh.input_copies()
    got = layer.forward_cross(x, memory, key_padding_mask=mask)
    assert moh.input_copies() == n + 2
    np.testing.assert_array_equal(got, layer.forward_cross(x, np.ascontiguousarray(memory)))


def test_result_survives_input_reuse(layer, x):
    buf = x.copy()
    y = layer(buf)
    before = y.copy()
    buf[:] = 0.0  # the caller reuses the input's memory
    buf += 5.0
    np.testing.assert_array_equal(y, before)
    assert not np.shares_memory(y, buf)


def test_out_array_is_written_and_returned(layer, x):
    want = layer(x)
    out = np.full((2, 6, 32), np.nan, dtype=np.float32)
    got = layer(x, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    # with need_weights: (out, probabilities)
    y, w = layer(x, out=out, need_weights=True)
    assert y is out and w.shape == (2, 4, 6, 6)


# --- torch tensors ---------------------------------------------------------------------------------

def test_torch_input_gives_torch_result(layer, x):
    torch = pytest.importorskip("torch")
    tx = torch.from_numpy(x.copy())
    n = moh.input_copies()
    ty = layer(tx)
    assert moh.input_copies() == n, "a contiguous CPU float32 tensor must be read in place"
    assert isinstance(ty, torch.Tensor) and ty.dtype == torch.float32 and tuple(ty.shape) == (2, 6, 32)
    np.testing.assert_array_equal(ty.numpy(), layer(x))
    tx.zero_()  # reusing the input tensor does not change the result
    np.testing.assert_array_equal(ty.numpy(), layer(x))
    # probabilities come back as a tensor too, and torch masks are accepted
    ty2, tw = layer(torch.from_numpy(x), need_weights=True,
                    key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    assert isinstance(ty2, torch.Tensor) and isinstance(tw, torch.Tensor)


def test_torch_noncontiguous_and_grad_input(layer, x):
    torch = pytest.importorskip("torch")
    big = torch.from_numpy(np.repeat(x, 2, axis=1))  # [2, 12, 32]
    view = big[:, ::2]
    assert not view.is_contiguous()
    n = moh.input_copies()
    y = layer(view)
    assert moh.input_copies() == n + 1
    np.testing.assert_array_equal(y.numpy(), layer(x))
    g = torch.from_numpy(x.copy()).requires_grad_(True)
    np.testing.assert_array_equal(layer(g).numpy(), layer(x))


def test_torch_out_tensor(layer, x):
    torch = pytest.importorskip("torch")
    out = torch.full((2, 6, 32), float("nan"))
    got = layer(torch.from_numpy(x), out=out)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), layer(x))


# --- save / load -----------------------------------------------------------------------------------

def _layers():
    return {
        "mha": moh.MultiHeadAttention(moh.MHAConfig(embed_dim=32, num_heads=4, bias=False), seed=1),
        "mha_gqa_rope": moh.MultiHeadAttention(moh.MHAConfig(embed_dim=32, num_heads=4,
                                                             num_kv_heads=2, rope=True), seed=1),
        "moh": moh.MoHAttention(moh.MoHConfig(embed_dim=32, num_heads=4, shared_heads=2,
                                              active_routed_heads=1, qk_norm=True), seed=2),
        "moh_vit": moh.MoHAttention(moh.MoHConfig.vit(32, 4, 1, 2, 2, 3), seed=3),
        "moh_llama": moh.MoHAttention(moh.MoHConfig(embed_dim=32, num_heads=4, num_kv_heads=2,
                                                    shared_heads=1, active_routed_heads=2,
                                                    router="query_norm", rope=True, qkv_bias=False,
                                                    proj_bias=False), seed=4),
        "moa": moh.MoAAttention(moh.MoAConfig(embed_dim=32, num_experts=4, top_k=2, head_dim=8),
                                seed=5),
        "jetmoe": moh.MoAAttention(moh.MoAConfig.jetmoe(32, 2, 4, 2, 8), seed=6),
    }


@pytest.mark.parametrize("kind", list(_layers()))
def test_save_then_load_rebuilds_an_equal_layer(tmp_path, rng, kind):
    layer = _layers()[kind]
    path = str(tmp_path / f"{kind}.safetensors")
    layer.save_safetensors(path)
    assert os.path.getsize(path) > 0
    loaded = moh.load_safetensors(path)
    assert type(loaded) is type(layer)
    assert loaded.config == layer.config
    assert loaded.dtype == "float32"
    for name, shape in layer.weight_infos():
        np.testing.assert_array_equal(loaded.weight(name), layer.weight(name), err_msg=name)
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    np.testing.assert_array_equal(loaded(x, causal=True), layer(x, causal=True))


def test_save_load_dtypes_and_prefix(tmp_path, rng):
    layer = _layers()["moh"]
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    path = str(tmp_path / "l.safetensors")
    moh.save_safetensors(layer, path, prefix="blocks.3.attn.", dtype="float64")
    loaded = moh.load_safetensors(path, prefix="blocks.3.attn.", dtype="float64")
    assert loaded.dtype == "float64"
    assert_close(loaded(x.astype(np.float64)), layer(x), 1e-5, "float64 reload")
    layer.save_safetensors(path, dtype="bfloat16")
    half = moh.load_safetensors(path)
    assert_close(half(x), layer(x), 3e-2, "bfloat16 file")
    # a layer built from its config loads the weights of the file
    fresh = moh.MoHAttention(layer.config)
    assert not fresh.weights_set
    fresh.load_safetensors(path)
    assert fresh.weights_set
    np.testing.assert_array_equal(fresh(x), half(x))


@pytest.mark.parametrize("kind", ["mha", "mha_no_bias", "moh", "moh_qk_norm", "moh_vit",
                                  "moh_llama", "moa", "jetmoe"])
def test_state_dict_of_loads_into_torch(mm, rng, kind):
    """moh.state_dict_of(layer, as_torch=True) loads into the matching torch module
    (load_state_dict, strict) and both compute the same."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 6, 32))
    if kind.startswith("mha"):
        layer = moh.MultiHeadAttention(moh.MHAConfig(embed_dim=32, num_heads=4,
                                                     bias=kind == "mha"), seed=1, dtype="float64")
        module = torch.nn.MultiheadAttention(32, 4, bias=kind == "mha", batch_first=True).double()
    elif kind.startswith("moh") and kind != "moh_vit" and kind != "moh_llama":
        qk = kind == "moh_qk_norm"
        layer = moh.MoHAttention(moh.MoHConfig(embed_dim=32, num_heads=4, shared_heads=2,
                                               active_routed_heads=1, qk_norm=qk), seed=2,
                                 dtype="float64")
        module = mm.MoHAttention(32, 4, shared_heads=2, active_routed_heads=1, qk_norm=qk).double()
    elif kind == "moh_vit":
        layer = moh.MoHAttention(moh.MoHConfig.vit(32, 4, 1, 2, 2, 3), seed=3, dtype="float64")
        module = mm.MoHViTAttention(32, 4, pretrain_grid=(2, 3), shared_heads=1,
                                    active_routed_heads=2).double()
    elif kind == "moh_llama":
        layer = moh.MoHAttention(moh.MoHConfig(embed_dim=32, num_heads=4, num_kv_heads=2,
                                               shared_heads=1, active_routed_heads=2,
                                               router="query_norm", rope=True, qkv_bias=False,
                                               proj_bias=False), seed=4, dtype="float64")
        module = mm.MoHLlamaAttention(32, 4, num_kv_heads=2, shared_heads=1,
                                      active_routed_heads=2).double()
    elif kind == "moa":
        layer = moh.MoAAttention(moh.MoAConfig(embed_dim=32, num_experts=4, top_k=2, head_dim=8),
                                 seed=5, dtype="float64")
        module = mm.MoAAttention(32, 8, 4, 2).double()
    else:
        layer = moh.MoAAttention(moh.MoAConfig.jetmoe(32, 2, 4, 2, 8), seed=6, dtype="float64")
        module = mm.JetMoEAttention(32, 8, 2, 4, 2).double()
    state = moh.state_dict_of(layer, as_torch=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    module.load_state_dict(state)  # strict: every name and shape must match
    tx = torch.from_numpy(x)
    with torch.no_grad():
        if kind.startswith("mha"):
            from moh_test_helpers import torch_mha

            want = torch_mha(module, x)
            got = layer(x)
        elif kind == "moh_vit":
            want, got = module(tx, (2, 3)).y, layer(x, grid=(2, 3))
        elif kind in ("moh_llama", "jetmoe"):
            want, got = module(tx, causal=True).y, layer(x, causal=True)
        else:
            want, got = module(tx).y, layer(x)
    assert_close(got, want, EXACT, f"{kind}: moh vs torch with moh's weights")


def test_state_dict_of_numpy_round_trip(rng):
    layer = _layers()["jetmoe"]
    state = moh.state_dict_of(layer)
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert {k: v.shape for k, v in state.items()} == {k: tuple(s) for k, s in layer.weight_infos()}
    copy = moh.MoAAttention(layer.config)
    copy.load_state_dict(state)
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    np.testing.assert_array_equal(copy(x, causal=True), layer(x, causal=True))
    # set_weight one tensor: the result changes; the old value restores it
    name = "experts.bias"
    copy.set_weight(name, state[name] + 1.0)
    assert np.abs(copy(x, causal=True) - layer(x, causal=True)).max() > 0.5
    copy.set_weight(name, state[name])
    np.testing.assert_array_equal(copy(x, causal=True), layer(x, causal=True))


def test_from_torch_with_prefix_and_kind(mm, rng):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32),
                                mm.MoHAttention(32, 4, shared_heads=1, active_routed_heads=2)).double()
    layer = moh.from_torch(model, kind="moh", prefix="1.", dtype="float64", num_heads=4,
                           shared_heads=1, active_routed_heads=2)
    x = rng.standard_normal((2, 5, 32))
    with torch.no_grad():
        want = model[1](torch.from_numpy(x)).y
    assert_close(layer(x), want, EXACT, "prefixed module")


# --- configs ---------------------------------------------------------------------------------------

def test_config_keywords_and_to_dict():
    c = moh.MoHConfig(embed_dim=64, num_heads=8, shared_heads=2, active_routed_heads=3,
                      qk_norm=True, rope_theta=5e5)
    assert (c.embed_dim, c.num_heads, c.shared_heads, c.active_routed_heads) == (64, 8, 2, 3)
    assert c.qk_norm is True and c.rope_theta == 5e5 and c.qkv_bias is True  # default kept
    assert c.routed_heads() == 6 and c.active_fraction() == pytest.approx(5 / 8)
    d = c.to_dict()
    assert d["embed_dim"] == 64 and d["qk_norm"] is True and d["router"] == moh.MoHRouterKind.Learned
    assert set(d) >= {"embed_dim", "num_heads", "head_dim", "num_kv_heads", "rope", "rope_theta",
                      "weight_storage", "shared_heads", "active_routed_heads", "router", "scores"}
    assert moh.MoHConfig(**d) == c
    c.num_heads = 4
    assert c.num_heads == 4 and c.to_dict()["num_heads"] == 4
    assert "num_heads=4" in repr(c)
    assert moh.MoHConfig(**d) != c


@pytest.mark.parametrize("config", [
    lambda: moh.MHAConfig(embed_dim=32, num_heads=4, num_kv_heads=2, rope=True, bias=False),
    lambda: moh.MoHConfig(embed_dim=32, num_heads=4, router="query_norm", scores="cosine",
                          weight_storage="bfloat16"),
    lambda: moh.MoAConfig(embed_dim=32, num_experts=4, top_k=2, head_dim=8, kdim=20),
    lambda: moh.MoAConfig.jetmoe(32, 2, 4, 2, 8, rope_theta=5e5),
    lambda: moh.MoHConfig.vit(32, 4, 1, 2, 3, 4),
], ids=["mha", "moh_strings", "moa", "jetmoe", "vit"])
def test_config_pickles(config):
    c = config()
    back = pickle.loads(pickle.dumps(c))
    assert type(back) is type(c) and back == c and back.to_dict() == c.to_dict()


def test_enum_fields_accept_strings():
    c = moh.MoHConfig(router="query_norm", scores="cosine", weight_storage="bfloat16")
    assert c.router == moh.MoHRouterKind.QueryNorm
    assert c.scores == moh.MoHScores.Cosine
    assert c.weight_storage == moh.WeightStorage.BFloat16
    c.router = "learned"
    assert c.router == moh.MoHRouterKind.Learned
    c.router = moh.MoHRouterKind.QueryNorm
    assert c.router == moh.MoHRouterKind.QueryNorm
    m = moh.MoAConfig(gating="top_k_softmax", names="jetmoe")
    assert m.gating == moh.MoAGating.TopKSoftmax and m.names == moh.MoANames.JetMoE


def test_factories_and_layer_config(rng):
    v = moh.MoHConfig.vit(32, 4, 1, 2, 3, 4)
    assert v.scores == moh.MoHScores.Cosine and (v.pretrain_h, v.pretrain_w) == (3, 4)
    assert v.train_tokens == 12
    j = moh.MoAConfig.jetmoe(32, 2, 4, 2, 8)
    assert j.rope and j.out_bias and j.kv_heads() == 2 and j.gating == moh.MoAGating.TopKSoftmax
    layer = moh.MoAAttention(j, seed=1)
    assert layer.config == j and layer.num_kv_heads == 2 and layer.head_dim == 8
    assert layer.weights_set and "MoAAttention" in repr(layer)
    zero = moh.MoAAttention(j, zero_weights=True)
    assert zero.weights_set
    y = zero(rng.standard_normal((1, 3, 32)).astype(np.float32), causal=True)
    assert np.all(y == 0.0)


def test_from_torch_warns_about_a_sequence_first_multihead_attention():
    """nn.MultiheadAttention defaults to [T, B, D]; moh takes [B, T, D]: converting one that is
    not batch_first says so (the weights convert all the same)."""
    import warnings

    import torch

    module = torch.nn.MultiheadAttention(16, 2)  # batch_first=False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = moh.from_torch(module)
    assert any("batch_first=False" in str(w.message) for w in caught)
    x = torch.randn(5, 3, 16)  # [T, B, D]
    with torch.no_grad():
        want = module(x, x, x, need_weights=False)[0].transpose(0, 1)
    got = layer(x.transpose(0, 1).contiguous())
    assert torch.allclose(got, want, atol=1e-5)
