"""Every moh layer kind against the PyTorch reference modules (tools/moh_modules.py) and
torch.nn.MultiheadAttention, on random inputs and random weights, through moh.from_torch.

float64 layers against float64 modules agree to rounding (EXACT); the default float32 layers to
FLOAT32. Besides y, the routing records are checked against what the torch modules return: MoH
gates [B*T, H] / aux_loss (load_balance_loss), MoH-LLaMA's head_mask, MoA's expert_counts and
switch / z / cv losses; and the attention probabilities (need_weights=True) against probabilities
computed here in torch.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import moh  # noqa: E402

from moh_test_helpers import (  # noqa: E402
    EXACT,
    FLOAT32,
    assert_close,
    padding_mask,
    perturb,
    probs_reference,
    random_attn_bias,
    topk_margin,
)

F = torch.nn.functional


def t64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def tmask(m):
    return None if m is None else torch.from_numpy(m)


# --- torch.nn.MultiheadAttention -> moh.MultiHeadAttention ---------------------------------------

MHA_CASES = ["plain", "key_padding_mask", "causal", "causal_left_padding", "attn_bias_BHTS",
             "attn_bias_11TS_causal", "cross", "cross_padding_attn_bias"]


def _mha_inputs(case, rng, B, T, H, D):
    memory = rng.standard_normal((B, 5, D)) if case.startswith("cross") else None
    S = T if memory is None else memory.shape[1]
    kpm = None
    if case in ("key_padding_mask", "cross_padding_attn_bias"):
        kpm = padding_mask(B, S, "right")
    elif case == "causal_left_padding":
        kpm = padding_mask(B, S, "left")
    causal = "causal" in case
    bias = None
    if case == "attn_bias_BHTS":
        bias = random_attn_bias(rng, (B, H, T, S))
    elif case == "attn_bias_11TS_causal":
        bias = random_attn_bias(rng, (1, 1, T, S))
    elif case == "cross_padding_attn_bias":
        bias = random_attn_bias(rng, (1, H, T, S))
    return memory, kpm, causal, bias


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_matches_torch(rng, bias, case):
    B, T, D, H = 2, 6, 32, 4
    module = torch.nn.MultiheadAttention(D, H, bias=bias, batch_first=True).double()
    if bias:
        perturb(module.in_proj_bias, module.out_proj.bias, std=0.1)
    layer = moh.from_torch(module, dtype="float64")
    assert isinstance(layer, moh.MultiHeadAttention)
    assert layer.config.bias == bias and layer.num_heads == H and layer.embed_dim == D
    x = rng.standard_normal((B, T, D))
    memory, kpm, causal, attn_bias = _mha_inputs(case, rng, B, T, H, D)
    if causal and case == "causal_left_padding":
        # the first query of sequence 1 sees only padding: torch gives NaN there; no such row
        kpm[:, 0] = False
    from moh_test_helpers import torch_mha

    want = torch_mha(module, x, memory, kpm, causal, attn_bias)
    opts = dict(key_padding_mask=kpm, causal=causal, attn_bias=attn_bias)
    got = layer(x, **opts) if memory is None else layer.forward_cross(x, memory, **opts)
    assert got.dtype == np.float64
    assert_close(got, want, EXACT, f"mha {case} y")


def test_mha_float32_matches_torch(rng):
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    layer = moh.from_torch(module)  # float32 by default
    assert layer.dtype == "float32"
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    kpm = padding_mask(2, 7)
    from moh_test_helpers import torch_mha

    want = torch_mha(module.double(), x.astype(np.float64), key_padding_mask=kpm, causal=True)
    got = layer(x, key_padding_mask=kpm, causal=True)
    assert got.dtype == np.float32
    assert_close(got, want, FLOAT32, "mha float32 y")


def test_mha_attention_probabilities_match_torch(rng):
    B, T, D, H = 2, 6, 32, 4
    module = torch.nn.MultiheadAttention(D, H, batch_first=True).double()
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((B, T, D))
    kpm = padding_mask(B, T)
    from moh_test_helpers import torch_mha

    want_y, want_w = torch_mha(module, x, key_padding_mask=kpm, need_weights=True)
    y, w = layer(x, key_padding_mask=kpm, need_weights=True)
    assert w.shape == (B, H, T, T)
    assert_close(y, want_y, EXACT, "y")
    assert_close(w, want_w, EXACT, "probabilities")
    assert np.all(w[:, :, :, kpm[1]][1] == 0.0), "padding keys must get probability 0"
    assert_close(w.sum(-1), np.ones((B, H, T)), EXACT, "row sums")


def test_mha_row_without_visible_key_is_zero_attention(mm, rng):
    """docs/semantics.md §1: a query that sees no key outputs zeros for that head (torch gives
    NaN); the layer's y is then the output projection's bias plus the other heads."""
    B, T, D, H = 1, 4, 16, 2
    module = torch.nn.MultiheadAttention(D, H, batch_first=True).double()
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((B, T, D))
    bias = rng.standard_normal((1, H, T, T))
    bias[0, 0, 2, :] = -np.inf  # head 0, query 2: no key
    with torch.no_grad():
        want = mm.mha_reference(t64(x), module.in_proj_weight, module.in_proj_bias,
                                module.out_proj.weight, module.out_proj.bias, H, D // H,
                                attn_bias=t64(bias))
    y, w = layer(x, attn_bias=bias, need_weights=True)
    assert np.isfinite(y).all()
    assert_close(y, want, EXACT, "y")
    assert np.all(w[0, 0, 2] == 0.0)
    assert_close(w[0, 1, 2].sum(), 1.0, EXACT, "the other head's row sum")


# --- MoHAttention (learned router) -----------------------------------------------------------------

MOH_CASES = {
    "shared1_routed2of3": dict(embed_dim=32, num_heads=4, shared_heads=1, active_routed_heads=2),
    "shared2_routed2of4": dict(embed_dim=48, num_heads=6, shared_heads=2, active_routed_heads=2),
    "routed_only": dict(embed_dim=32, num_heads=4, shared_heads=0, active_routed_heads=2),
    "all_active": dict(embed_dim=32, num_heads=4, shared_heads=2, active_routed_heads=2),
    "dense_weighted_sum": dict(embed_dim=32, num_heads=4, shared_heads=4, active_routed_heads=0),
    "no_qkv_bias_qk_norm": dict(embed_dim=48, num_heads=6, shared_heads=2, active_routed_heads=2,
                                qkv_bias=False, qk_norm=True),
    "head_dim_12": dict(embed_dim=32, num_heads=4, head_dim=12, shared_heads=1,
                        active_routed_heads=2),
}


def make_moh(mm, **kw):
    module = mm.MoHAttention(**kw).double()
    if module.qk_norm:
        perturb(module.q_norm.weight, module.k_norm.weight, mean=1.0)
        perturb(module.q_norm.bias, module.k_norm.bias)
    return module


def check_moh_routing(routing, out, module, x_rows, B, T):
    """The MoHRouting record against the torch module's gates / aux_loss."""
    H, S, K = module.num_heads, module.shared_heads, module.active_routed_heads
    gates = out.gates.reshape(B * T, H).detach().numpy()
    assert routing.batch == B and routing.tokens == T and routing.num_heads == H
    assert routing.shared_heads == S and routing.active_routed_heads == K
    assert routing.gates.shape == (B * T, H)
    assert_close(routing.gates, gates, EXACT, "gates")
    active = routing.active
    assert active.dtype == bool and active.shape == (B * T, H)
    np.testing.assert_array_equal(active, gates != 0)
    assert np.all(routing.gates[~active] == 0.0), "gates of unused heads must be exactly 0"
    np.testing.assert_array_equal(routing.head_counts, (gates != 0).sum(0))
    assert routing.active_fraction() == pytest.approx((S + K) / H)
    assert routing.load_balance_loss == pytest.approx(float(out.aux_loss), abs=EXACT)
    for b, t in ((0, 0), (B - 1, T - 1)):
        assert list(routing.heads_of(b, t)) == list(np.flatnonzero(gates[b * T + t]))
    if K > 0:
        with torch.no_grad():
            p = torch.softmax(module.wg(x_rows), -1).numpy()
        assert_close(routing.routed_probs, p, EXACT, "routed_probs")


@pytest.mark.parametrize("case", list(MOH_CASES))
def test_moh_matches_torch(mm, rng, case):
    kw = MOH_CASES[case]
    module = make_moh(mm, **kw)
    layer = moh.from_torch(module, dtype="float64")
    assert isinstance(layer, moh.MoHAttention)
    c = layer.config
    assert (c.num_heads, c.shared_heads, c.active_routed_heads) == (
        kw["num_heads"], kw["shared_heads"], kw["active_routed_heads"])
    assert c.qkv_bias == kw.get("qkv_bias", True) and c.qk_norm == kw.get("qk_norm", False)
    B, T = 2, 7
    x = rng.standard_normal((B, T, kw["embed_dim"]))
    with torch.no_grad():
        out = module(t64(x))
    routing = moh.MoHRouting()
    y = layer(x, routing=routing)
    assert_close(y, out.y, EXACT, f"moh {case} y")
    check_moh_routing(routing, out, module, t64(x).reshape(B * T, -1), B, T)
    if case == "dense_weighted_sum":
        assert routing.active.all() and routing.load_balance_loss == 0.0
        # g = H softmax(x W_s^T): not all 1 (a weighted sum, not plain MHA)
        assert np.abs(routing.gates - 1.0).max() > 1e-3
        assert_close(routing.gates.sum(-1), np.full(B * T, 4.0), EXACT, "dense gates sum to H")


MOH_OPTION_CASES = ["key_padding_mask_causal", "attn_bias_BHTS_causal", "attn_bias_B1TS",
                    "attn_bias_11TS_padding", "cross", "cross_padding", "cross_causal_s3_qk_norm",
                    "cross_attn_bias"]


@pytest.mark.parametrize("case", MOH_OPTION_CASES)
def test_moh_options_match_torch(mm, rng, case):
    B, T, D, H = 2, 6, 32, 4
    module = make_moh(mm, embed_dim=D, num_heads=H, shared_heads=1, active_routed_heads=2,
                      qk_norm="qk_norm" in case)
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((B, T, D))
    memory = None
    if case.startswith("cross"):
        memory = rng.standard_normal((B, 3 if "s3" in case else 8, D))
    S = T if memory is None else memory.shape[1]
    kpm = padding_mask(B, S) if "padding" in case else None
    causal = "causal" in case
    layout = {"attn_bias_BHTS_causal": (B, H), "attn_bias_B1TS": (B, 1),
              "attn_bias_11TS_padding": (1, 1), "cross_attn_bias": (1, H)}.get(case)
    bias = None if layout is None else random_attn_bias(rng, layout + (T, S))
    with torch.no_grad():
        out = module(t64(x), key_padding_mask=tmask(kpm), causal=causal,
                     memory=None if memory is None else t64(memory),
                     attn_bias=None if bias is None else t64(bias))
    routing = moh.MoHRouting()
    opts = dict(key_padding_mask=kpm, causal=causal, attn_bias=bias, routing=routing)
    y = layer(x, **opts) if memory is None else layer.forward_cross(x, memory, **opts)
    assert_close(y, out.y, EXACT, f"moh {case} y")
    check_moh_routing(routing, out, module, t64(x).reshape(B * T, D), B, T)


def test_moh_float32_matches_torch(mm, rng):
    module = make_moh(mm, embed_dim=48, num_heads=6, shared_heads=2, active_routed_heads=2)
    layer = moh.from_torch(module)  # float32 layer from a float64 module
    assert layer.dtype == "float32"
    x = rng.standard_normal((2, 8, 48))
    with torch.no_grad():
        out = module(t64(x), causal=True)
        p = torch.softmax(module.wg(t64(x).reshape(16, 48)), -1)
    assert topk_margin(p, 2) > 1e-5, "test setup: a routing near-tie (pick another seed)"
    routing = moh.MoHRouting()
    y = layer(x.astype(np.float32), causal=True, routing=routing)
    assert y.dtype == np.float32
    assert_close(y, out.y, FLOAT32, "y")
    assert_close(routing.gates, out.gates.reshape(16, 6), FLOAT32, "gates")
    assert routing.load_balance_loss == pytest.approx(float(out.aux_loss), abs=FLOAT32)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_moh_attention_probabilities(mm, rng, cross):
    """need_weights=True returns (y, probs [B, H, T, S]): 0 for the heads a token did not use, rows
    of the heads it used sum to 1 and equal softmax(q k^T / sqrt(d)) computed in torch."""
    B, T, D, H, d = 2, 6, 32, 4, 8
    module = make_moh(mm, embed_dim=D, num_heads=H, shared_heads=1, active_routed_heads=1)
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((B, T, D))
    memory = rng.standard_normal((B, 5, D)) if cross else None
    S = 5 if cross else T
    kpm = padding_mask(B, S)
    causal = not cross
    routing = moh.MoHRouting()
    if cross:
        y, w = layer.forward_cross(x, memory, key_padding_mask=kpm, need_weights=True, routing=routing)
    else:
        y, w = layer(x, key_padding_mask=kpm, causal=True, need_weights=True, routing=routing)
    assert w.shape == (B, H, T, S) and w.dtype == np.float64
    with torch.no_grad():
        out = module(t64(x), key_padding_mask=tmask(kpm), causal=causal,
                     memory=None if memory is None else t64(memory))
        q, k, _ = module.project(t64(x), None if memory is None else t64(memory))
    assert_close(y, out.y, EXACT, "y")
    want = probs_reference(q, k, 1.0 / math.sqrt(d), causal=causal, key_padding_mask=kpm)
    used = routing.active.reshape(B, T, H).transpose(0, 2, 1)  # [B, H, T]
    assert not used.all(), "test setup: some head must be unused"
    assert np.all(w[~used] == 0.0), "probabilities of heads a token did not use must be 0"
    assert_close(w[used].sum(-1), np.ones(int(used.sum())), EXACT, "row sums of used heads")
    assert_close(w[used], want[used], EXACT, "probabilities of used heads")
    # the layer writes into a given array as well
    buf = np.full((B, H, T, S), 7.0)
    if cross:
        layer.forward_cross(x, memory, key_padding_mask=kpm, attention_weights=buf)
    else:
        layer(x, key_padding_mask=kpm, causal=True, attention_weights=buf)
    np.testing.assert_array_equal(buf, w)


# --- MoH-ViT: cosine attention with a continuous position bias ------------------------------------

VIT_CASES = {
    "own_grid_3x4": dict(kw=dict(embed_dim=32, num_heads=4, pretrain_grid=(3, 4), shared_heads=1,
                                 active_routed_heads=2), grid=(3, 4)),
    "finetune_2x3_from_3x4_no_qkv_bias": dict(
        kw=dict(embed_dim=24, num_heads=3, pretrain_grid=(3, 4), train_tokens=12, shared_heads=0,
                active_routed_heads=2, qkv_bias=False), grid=(2, 3)),
    "dense_1x5_attn_bias": dict(kw=dict(embed_dim=16, num_heads=4, pretrain_grid=(2, 5),
                                        shared_heads=4, active_routed_heads=0), grid=(1, 5),
                                bias=True),
    "qk_norm_4x2_padding": dict(kw=dict(embed_dim=32, num_heads=4, pretrain_grid=(4, 4),
                                        train_tokens=16, shared_heads=2, active_routed_heads=1,
                                        qk_norm=True), grid=(4, 2), padding=True),
}


def make_moh_vit(mm, **kw):
    module = mm.MoHViTAttention(**kw).double()
    with torch.no_grad():  # spread TransNeXt's initial values, as tools/exporters.py does
        module.temperature.add_(0.5 * torch.randn_like(module.temperature))
        module.cpb_fc2.weight.mul_(4.0)
    perturb(module.query_embedding)
    if module.qk_norm:
        perturb(module.q_norm.weight, module.k_norm.weight, mean=1.0)
        perturb(module.q_norm.bias, module.k_norm.bias)
    return module


@pytest.mark.parametrize("case", list(VIT_CASES))
def test_moh_vit_matches_torch(mm, rng, case):
    spec = VIT_CASES[case]
    module = make_moh_vit(mm, **spec["kw"])
    layer = moh.from_torch(module, dtype="float64")
    c = layer.config
    assert c.scores == moh.MoHScores.Cosine
    assert (c.pretrain_h, c.pretrain_w) == tuple(spec["kw"]["pretrain_grid"])
    gh, gw = spec["grid"]
    B, T, D, H = 2, gh * gw, spec["kw"]["embed_dim"], spec["kw"]["num_heads"]
    x = rng.standard_normal((B, T, D))
    kpm = padding_mask(B, T) if spec.get("padding") else None
    bias = random_attn_bias(rng, (B, 1, T, T)) if spec.get("bias") else None
    with torch.no_grad():
        out = module(t64(x), (gh, gw), key_padding_mask=tmask(kpm),
                     attn_bias=None if bias is None else t64(bias))
        want_pb = module.position_bias((gh, gw))
    routing = moh.MoHRouting()
    y = layer(x, grid=(gh, gw), key_padding_mask=kpm, attn_bias=bias, routing=routing)
    assert_close(y, out.y, EXACT, f"moh_vit {case} y")
    check_moh_routing(routing, out, module, t64(x).reshape(B * T, D), B, T)
    pb = layer.position_bias(gh, gw)
    assert pb.shape == (H, T, T)
    assert_close(pb, want_pb, EXACT, "position bias")


def test_moh_vit_grid_changes_the_result(mm, rng):
    """The same 12 tokens as a 3 x 4 and as a 4 x 3 grid differ (the position bias follows the
    grid), each as torch computes it."""
    module = make_moh_vit(mm, embed_dim=32, num_heads=4, pretrain_grid=(3, 4), shared_heads=1,
                          active_routed_heads=2)
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((1, 12, 32))
    y34, y43 = layer(x, grid=(3, 4)), layer(x, grid=(4, 3))
    with torch.no_grad():
        assert_close(y34, module(t64(x), (3, 4)).y, EXACT, "3x4")
        assert_close(y43, module(t64(x), (4, 3)).y, EXACT, "4x3")
    assert np.abs(y34 - y43).max() > 1e-6
    np.testing.assert_array_equal(layer(x), y34)  # no grid: the pretraining grid


# --- MoH-LLaMA: query-norm router, GQA, RoPE -----------------------------------------------------

LLAMA_CASES = {
    "gqa_h4_kv2": dict(kw=dict(embed_dim=32, num_heads=4, head_dim=8, num_kv_heads=2,
                               shared_heads=1, active_routed_heads=2), causal=True),
    "mqa_d6_theta5e5": dict(kw=dict(embed_dim=24, num_heads=4, head_dim=6, num_kv_heads=1,
                                    shared_heads=1, active_routed_heads=2, rope_theta=500000.0),
                            causal=True),
    "h8_kv4_routed_only": dict(kw=dict(embed_dim=64, num_heads=8, head_dim=8, num_kv_heads=4,
                                       shared_heads=0, active_routed_heads=3), causal=True),
    "bidirectional_padding": dict(kw=dict(embed_dim=32, num_heads=4, num_kv_heads=2,
                                          shared_heads=2, active_routed_heads=1), causal=False,
                                  padding=True),
    "position_offset_attn_bias": dict(kw=dict(embed_dim=32, num_heads=4, num_kv_heads=2,
                                              shared_heads=1, active_routed_heads=2),
                                      causal=True, offset=5, bias=True),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_moh_llama_matches_torch(mm, rng, case):
    spec = LLAMA_CASES[case]
    kw = spec["kw"]
    module = mm.MoHLlamaAttention(**kw).double()
    layer = moh.from_torch(module, dtype="float64")
    c = layer.config
    assert c.router == moh.MoHRouterKind.QueryNorm and c.rope
    assert layer.num_kv_heads == kw["num_kv_heads"] and layer.num_heads == kw["num_heads"]
    B, T, D, H = 2, 7, kw["embed_dim"], kw["num_heads"]
    x = rng.standard_normal((B, T, D))
    kpm = padding_mask(B, T) if spec.get("padding") else None
    bias = random_attn_bias(rng, (B, H, T, T)) if spec.get("bias") else None
    offset = spec.get("offset", 0)
    with torch.no_grad():
        out = module(t64(x), key_padding_mask=tmask(kpm), causal=spec["causal"],
                     position_offset=offset, attn_bias=None if bias is None else t64(bias))
    routing = moh.MoHRouting()
    y = layer(x, causal=spec["causal"], key_padding_mask=kpm, attn_bias=bias,
              position_offset=offset or None, routing=routing)
    assert_close(y, out.y, EXACT, f"moh_llama {case} y")
    mask = out.head_mask.reshape(B * T, H).numpy()
    np.testing.assert_array_equal(routing.gates, mask)  # 0/1 gates
    np.testing.assert_array_equal(routing.active, mask != 0)
    np.testing.assert_array_equal(routing.head_counts, mask.sum(0).astype(np.int64))


def test_moh_llama_router_uses_query_norms(mm, rng):
    """routed_probs = softmax(||q_i|| / std) of the routed heads (queries before RoPE)."""
    module = mm.MoHLlamaAttention(32, 4, head_dim=8, num_kv_heads=2, shared_heads=1,
                                  active_routed_heads=2).double()
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((1, 5, 32))
    routing = moh.MoHRouting()
    layer(x, causal=True, routing=routing)
    with torch.no_grad():
        norms = module.q_proj(t64(x)).view(5, 4, 8)[:, 1:, :].norm(dim=-1)
        p = torch.softmax(norms / norms.std(dim=-1, unbiased=True, keepdim=True), -1).numpy()
    assert_close(routing.routed_probs, p, EXACT, "query-norm router probabilities")


# --- MoAAttention (fairseq) ------------------------------------------------------------------------

MOA_CASES = {
    "basic": dict(kw=dict(embed_dim=32, head_dim=8, num_experts=5, top_k=2)),
    "query_padding": dict(kw=dict(embed_dim=24, head_dim=8, num_experts=5, top_k=2),
                          query_padding="right"),
    "query_left_padding_causal_key_padding": dict(
        kw=dict(embed_dim=16, head_dim=6, num_experts=4, top_k=3), query_padding="left",
        causal=True, padding="left"),
    "cross_kdim20_padding": dict(kw=dict(embed_dim=32, head_dim=8, num_experts=4, top_k=2, kdim=20),
                                 memory=7, padding="right"),
    "cross_kdim12_attn_bias_query_padding": dict(
        kw=dict(embed_dim=16, head_dim=5, num_experts=3, top_k=1, kdim=12), memory=6,
        bias="B1TS", query_padding="right"),
    "attn_bias_11TS_causal": dict(kw=dict(embed_dim=16, head_dim=4, num_experts=4, top_k=2),
                                  bias="11TS", causal=True),
}


def moa_gates(module, x, qpm):
    """The kept gates [N, E] (p * kept, not renormalised) as the torch module computes them."""
    with torch.no_grad():
        rows = x.reshape(-1, x.shape[-1])
        p = torch.softmax(rows @ module.q_proj.w_gate, -1)
        live = torch.ones(rows.shape[0], 1, dtype=p.dtype)
        if qpm is not None:
            live = (~torch.from_numpy(qpm)).reshape(-1, 1).to(p.dtype)
        p = p * live
        from moh_modules import top_k_mask

        kept = top_k_mask(p, module.top_k) * live
        return (p * kept).numpy(), (rows @ module.q_proj.w_gate).numpy()


@pytest.mark.parametrize("case", list(MOA_CASES))
def test_moa_matches_torch(mm, rng, case):
    spec = MOA_CASES[case]
    kw = spec["kw"]
    module = mm.MoAAttention(**kw).double()
    layer = moh.from_torch(module, dtype="float64")
    assert isinstance(layer, moh.MoAAttention)
    c = layer.config
    assert (c.num_experts, c.top_k, c.head_dim) == (kw["num_experts"], kw["top_k"], kw["head_dim"])
    assert layer.memory_dim == kw.get("kdim", kw["embed_dim"])
    B, T, D = 3 if "left" in case else 2, 5, kw["embed_dim"]
    x = rng.standard_normal((B, T, D))
    memory = rng.standard_normal((B, spec["memory"], kw["kdim"])) if "memory" in spec else None
    S = T if memory is None else memory.shape[1]
    kpm = padding_mask(B, S, spec["padding"]) if "padding" in spec else None
    qpm = padding_mask(B, T, spec["query_padding"]) if "query_padding" in spec else None
    causal = spec.get("causal", False)
    if causal and kpm is not None:
        kpm[:, 0] = False  # no query row that sees no key at all (fine too, but keep y comparable)
    bias = None
    if "bias" in spec:
        bias = random_attn_bias(rng, ((B if spec["bias"][0] == "B" else 1), 1, T, S))
    with torch.no_grad():
        out = module(t64(x), key_padding_mask=tmask(kpm), causal=causal,
                     memory=None if memory is None else t64(memory),
                     attn_bias=None if bias is None else t64(bias), query_padding_mask=tmask(qpm))
    routing = moh.MoARouting()
    opts = dict(key_padding_mask=kpm, causal=causal, attn_bias=bias, query_padding_mask=qpm,
                routing=routing)
    y = layer(x, **opts) if memory is None else layer.forward_cross(x, memory, **opts)
    assert_close(y, out.y, EXACT, f"moa {case} y")
    assert routing.batch == B and routing.tokens == T
    assert routing.num_experts == kw["num_experts"] and routing.top_k == kw["top_k"]
    np.testing.assert_array_equal(routing.expert_counts, out.expert_counts.numpy().astype(np.int64))
    assert routing.switch_loss == pytest.approx(float(out.switch_loss), abs=EXACT)
    assert routing.z_loss == pytest.approx(float(out.z_loss), abs=EXACT)
    assert routing.cv_loss == pytest.approx(float(out.cv_loss), abs=EXACT)
    gates, logits = moa_gates(module, t64(x), qpm)
    assert_close(routing.gates, gates, EXACT, "gates")
    assert_close(routing.logits, logits, EXACT, "logits")
    sel = routing.selected
    assert sel.shape == (B * T, kw["top_k"])
    if qpm is not None:
        pad = qpm.reshape(-1)
        assert np.all(sel[pad] == -1), "padding queries select no expert"
        assert np.all(y.reshape(B * T, D)[pad] == 0.0), "padding queries output 0"
        assert np.all(sel[~pad] >= 0)
        assert int(routing.expert_counts.sum()) == int((~pad).sum()) * kw["top_k"]
    for row in range(B * T):
        if qpm is None or not qpm.reshape(-1)[row]:
            assert set(sel[row]) == set(np.flatnonzero(gates[row]))


def test_moa_float32_matches_torch(mm, rng):
    module = mm.MoAAttention(32, 8, 4, 2).double()
    layer = moh.from_torch(module)
    x = rng.standard_normal((2, 8, 32))
    with torch.no_grad():
        out = module(t64(x), causal=True)
        p = torch.softmax(t64(x).reshape(16, 32) @ module.q_proj.w_gate, -1)
    assert topk_margin(p, 2) > 1e-5, "test setup: a routing near-tie (pick another seed)"
    routing = moh.MoARouting()
    y = layer(x.astype(np.float32), causal=True, routing=routing)
    assert y.dtype == np.float32
    assert_close(y, out.y, FLOAT32, "y")
    np.testing.assert_array_equal(routing.expert_counts, out.expert_counts.numpy().astype(np.int64))
    assert routing.switch_loss == pytest.approx(float(out.switch_loss), abs=FLOAT32)


def test_moa_attention_probabilities(mm, rng):
    """probs [B, top_k, T, S]: slot s of token t is expert selected[t, s]'s softmax(q_e k^T / sqrt d)."""
    B, T, D, d, E, k = 2, 6, 32, 8, 5, 2
    module = mm.MoAAttention(D, d, E, k).double()
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((B, T, D))
    kpm = padding_mask(B, T)
    routing = moh.MoARouting()
    y, w = layer(x, key_padding_mask=kpm, causal=True, need_weights=True, routing=routing)
    assert w.shape == (B, k, T, T)
    with torch.no_grad():
        q = torch.einsum("bti,eio->beto", t64(x), module.q_proj.experts.w)  # [B, E, T, d]
        keys = module.k_proj(t64(x)).unsqueeze(1)
    pe = probs_reference(q, keys, 1.0 / math.sqrt(d), causal=True, key_padding_mask=kpm)
    sel = routing.selected.reshape(B, T, k)
    want = np.empty((B, k, T, T))
    for b in range(B):
        for s in range(k):
            want[b, s] = pe[b, sel[b, :, s], np.arange(T)]
    assert_close(w, want, EXACT, "MoA probabilities")


# --- JetMoE: multi-head experts, RoPE, top-k-then-softmax ------------------------------------------

JETMOE_CASES = {
    "gqa_prefill": dict(kw=dict(embed_dim=32, head_dim=8, num_kv_heads=2, num_experts=4, top_k=2),
                        causal=True),
    "mqa_d6_theta5e5": dict(kw=dict(embed_dim=24, head_dim=6, num_kv_heads=1, num_experts=3,
                                    top_k=3, rope_theta=500000.0), causal=True),
    "bidirectional_padding_attn_bias_top1": dict(
        kw=dict(embed_dim=16, head_dim=4, num_kv_heads=2, num_experts=4, top_k=1), causal=False,
        padding=True, bias=True),
    "position_offset": dict(kw=dict(embed_dim=32, head_dim=8, num_kv_heads=2, num_experts=4,
                                    top_k=2), causal=True, offset=3),
}


@pytest.mark.parametrize("case", list(JETMOE_CASES))
def test_jetmoe_matches_torch(mm, rng, case):
    spec = JETMOE_CASES[case]
    kw = spec["kw"]
    module = mm.JetMoEAttention(**kw).double()
    layer = moh.from_torch(module, dtype="float64")
    c = layer.config
    assert c.names == moh.MoANames.JetMoE and c.gating == moh.MoAGating.TopKSoftmax and c.rope
    assert layer.num_kv_heads == kw["num_kv_heads"]
    B, T, D = 2, 7, kw["embed_dim"]
    x = rng.standard_normal((B, T, D))
    kpm = padding_mask(B, T) if spec.get("padding") else None
    bias = random_attn_bias(rng, (1, 1, T, T)) if spec.get("bias") else None
    offset = spec.get("offset", 0)
    with torch.no_grad():
        out = module(t64(x), key_padding_mask=tmask(kpm), causal=spec["causal"],
                     attn_bias=None if bias is None else t64(bias), position_offset=offset)
        logits = module.router_logits(t64(x).reshape(B * T, D))
        from moh_modules import top_k_mask

        kept = top_k_mask(logits, kw["top_k"])
        gates = (torch.softmax(logits.masked_fill(kept == 0, float("-inf")), -1) * kept).numpy()
    routing = moh.MoARouting()
    y = layer(x, causal=spec["causal"], key_padding_mask=kpm, attn_bias=bias,
              position_offset=offset or None, routing=routing)
    assert_close(y, out.y, EXACT, f"jetmoe {case} y")
    np.testing.assert_array_equal(routing.expert_counts, out.expert_counts.numpy().astype(np.int64))
    assert routing.switch_loss == pytest.approx(float(out.switch_loss), abs=EXACT)
    assert routing.z_loss == pytest.approx(float(out.z_loss), abs=EXACT)
    assert_close(routing.gates, gates, EXACT, "top-k-then-softmax gates")


def test_jetmoe_attention_probabilities(mm, rng):
    """probs [B, top_k * H_kv, T, S]: slot s's heads at s H_kv .. s H_kv + H_kv - 1."""
    B, T, D, d, G, E, k = 2, 6, 32, 8, 2, 4, 2
    module = mm.JetMoEAttention(D, d, G, E, k).double()
    layer = moh.from_torch(module, dtype="float64")
    x = rng.standard_normal((B, T, D))
    routing = moh.MoARouting()
    y, w = layer(x, causal=True, need_weights=True, routing=routing)
    assert w.shape == (B, k * G, T, T)
    with torch.no_grad():
        pos = torch.arange(T)
        q = torch.einsum("bti,eoi->bteo", t64(x), module.experts.input_linear.weight)
        q = mm.rope(q.reshape(B, T, E * G, d), module.rope_theta, pos).transpose(1, 2)  # [B, E G, T, d]
        keys = module.kv_proj(t64(x)).chunk(2, dim=-1)[0]
        keys = mm.rope(keys.reshape(B, T, G, d), module.rope_theta, pos).transpose(1, 2)
        keys = keys.repeat(1, E, 1, 1)
    pe = probs_reference(q, keys, 1.0 / math.sqrt(d), causal=True)  # [B, E G, T, T]
    sel = routing.selected.reshape(B, T, k)
    want = np.empty((B, k * G, T, T))
    for b in range(B):
        for s in range(k):
            for j in range(G):
                want[b, s * G + j] = pe[b, sel[b, :, s] * G + j, np.arange(T)]
    assert_close(w, want, EXACT, "JetMoE probabilities")
