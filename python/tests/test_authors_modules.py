"""from_torch on modules shaped as the authors' own classes (SkyworkAI/MoH): the attribute names
of MoH-DiT's MoHAttention (num_heads, head_dim, shared_head, routed_head; q_norm an Identity
without qk_norm) and of MoH-ViT's last-stage Attention (its ln(N_0) in the non-persistent buffer
seq_length_scale), with the reference modules of tools/moh_modules.py computing the formula."""

import math
import os
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

import moh

sys.path.insert(0, os.path.join(os.environ.get("MOH_SOURCE_DIR", "."), "tools"))
import moh_modules  # noqa: E402


def _authors_router(ref, m):
    """The authors' router attributes: shared_head, routed_head and the wg, wg_0, wg_1 they have."""
    m.shared_head, m.routed_head = ref.shared_heads, ref.active_routed_heads
    for name in ("wg", "wg_0", "wg_1"):
        if getattr(ref, name) is not None:
            setattr(m, name, getattr(ref, name))


def _authors_dit(ref, qk_norm):
    """A module with the authors' MoH-DiT attribute names around ref's submodules."""
    m = nn.Module()
    m.num_heads, m.head_dim = ref.num_heads, ref.head_dim
    m.qkv, m.proj = ref.qkv, ref.proj
    m.q_norm = ref.q_norm if qk_norm else nn.Identity()
    m.k_norm = ref.k_norm if qk_norm else nn.Identity()
    _authors_router(ref, m)
    return m


def _authors_vit(ref, grid):
    m = nn.Module()
    m.dim, m.num_heads, m.head_dim = ref.embed_dim, ref.num_heads, ref.head_dim
    m.temperature, m.query_embedding = ref.temperature, ref.query_embedding
    m.register_buffer("seq_length_scale", torch.as_tensor(np.log(grid[0] * grid[1])),
                      persistent=False)
    m.qkv, m.proj, m.cpb_fc1, m.cpb_fc2 = ref.qkv, ref.proj, ref.cpb_fc1, ref.cpb_fc2
    _authors_router(ref, m)
    return m


def _perturb(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_authors_dit_attention(qk_norm):
    torch.manual_seed(1)
    ref = moh_modules.MoHAttention(32, 8, shared_heads=2, active_routed_heads=3,
                                   qkv_bias=False, qk_norm=qk_norm).double()
    _perturb(ref, 2)
    layer = moh.from_torch(_authors_dit(ref, qk_norm), dtype="float64")
    assert layer.config.shared_heads == 2 and layer.config.active_routed_heads == 3
    assert layer.config.qkv_bias is False and layer.config.qk_norm is qk_norm
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    routing = moh.MoHRouting()
    y = layer(x, routing=routing)
    with torch.no_grad():
        out = ref(x)
    assert torch.allclose(y, out.y, atol=1e-10, rtol=0)
    np.testing.assert_allclose(routing.gates, out.gates.reshape(14, 8).numpy(), atol=1e-12)
    assert routing.load_balance_loss == pytest.approx(float(out.aux_loss), abs=1e-12)


def test_authors_vit_attention_takes_train_tokens_from_its_buffer():
    torch.manual_seed(3)
    grid = (3, 4)
    ref = moh_modules.MoHViTAttention(48, 6, pretrain_grid=(4, 5), train_tokens=12,
                                      shared_heads=2, active_routed_heads=2).double()
    _perturb(ref, 4)
    authors = _authors_vit(ref, grid)
    with pytest.raises(ValueError, match="pretrain_grid"):
        moh.from_torch(authors)  # the pretraining grid is not on the authors' module
    layer = moh.from_torch(authors, pretrain_grid=(4, 5), dtype="float64")
    assert layer.config.train_tokens == 12 and layer.config.scores == moh.MoHScores.Cosine
    x = torch.randn(2, 12, 48, dtype=torch.float64)
    with torch.no_grad():
        out = ref(x, grid)
    assert torch.allclose(layer(x, grid=grid), out.y, atol=1e-9, rtol=0)
    assert math.isclose(float(authors.seq_length_scale), math.log(12))


def test_aggregated_attention_tensors_are_refused():
    torch.manual_seed(5)
    ref = moh_modules.MoHViTAttention(48, 6, pretrain_grid=(3, 4), shared_heads=2,
                                      active_routed_heads=2)
    authors = _authors_vit(ref, (3, 4))
    authors.sr = nn.Conv2d(48, 48, 1)  # TransNeXt's AggregatedAttention (stages 1-3)
    with pytest.raises(ValueError, match="AggregatedAttention"):
        moh.from_torch(authors, pretrain_grid=(3, 4))


def _authors_llama(ref, hidden_size, rope_theta):
    """A module with the attribute names of the authors' MoH-LLaMA3 LlamaAttention
    (MoH-LLaMA3/Inference_code/modeling_llama.py) around ref's projections: the split as the
    authors set it, shared_head = int(H * 0.5) and routed_head = int(H * (0.75 - 0.5))."""
    m = nn.Module()
    m.config = types.SimpleNamespace(hidden_size=hidden_size, num_attention_heads=ref.num_heads,
                                     num_key_value_heads=ref.num_kv_heads, rope_theta=rope_theta,
                                     rope_scaling=None, attention_bias=False)
    m.hidden_size, m.num_heads = hidden_size, ref.num_heads
    m.head_dim = hidden_size // ref.num_heads
    m.num_key_value_heads, m.rope_theta = ref.num_kv_heads, rope_theta
    m.q_proj, m.k_proj, m.v_proj, m.o_proj = ref.q_proj, ref.k_proj, ref.v_proj, ref.o_proj
    m.routed_head = int(ref.num_heads * (0.75 - 0.5))
    m.shared_head = int(ref.num_heads * 0.5)
    return m


def _assert_released_split(config, H):
    assert config.shared_heads == H // 2 and config.active_routed_heads == H // 4
    assert config.router == moh.MoHRouterKind.QueryNorm and config.rope
    assert config.qkv_bias is False and config.proj_bias is False


def test_authors_llama_attention_keeps_the_released_split():
    """Heads 0..H/2-1 always on, the top H/4 of the other half per token, 0/1 gates; the output
    and the head mask are the reference module's with that split."""
    torch.manual_seed(6)
    H, D, kv = 8, 64, 2
    ref = moh_modules.MoHLlamaAttention(D, H, num_kv_heads=kv, shared_heads=4,
                                        active_routed_heads=2, rope_theta=500000.0).double()
    _perturb(ref, 7)
    layer = moh.from_torch(_authors_llama(ref, D, 500000.0), dtype="float64")
    _assert_released_split(layer.config, H)
    preset = moh.MoHConfig.moh_llama3(D, H, kv)
    for field in ("embed_dim", "num_heads", "num_kv_heads", "shared_heads", "active_routed_heads",
                  "router", "rope", "rope_theta", "qkv_bias", "proj_bias"):
        assert getattr(layer.config, field) == getattr(preset, field), field
    x = torch.randn(2, 9, D, dtype=torch.float64)
    routing = moh.MoHRouting()
    y = layer(x, causal=True, routing=routing)
    with torch.no_grad():
        out = ref(x, causal=True)
    assert torch.allclose(y, out.y, atol=1e-10, rtol=0)
    gates = routing.gates
    np.testing.assert_array_equal(gates, out.head_mask.reshape(18, H).numpy())
    assert (gates[:, :4] == 1).all()                  # heads 0..3 always on
    assert (gates[:, 4:].sum(axis=1) == 2).all()      # 2 of the routed heads 4..7 per token
    assert set(np.unique(gates)) <= {0.0, 1.0}


def test_authors_llama3_8b_attention_is_the_preset():
    """The authors' module at LLaMA3-8B's sizes converts to MoHConfig.moh_llama3_8b(): heads
    0..15 always on and the top 8 of the 16 routed heads 16..31."""
    torch.manual_seed(8)
    ref = moh_modules.MoHLlamaAttention(4096, 32, num_kv_heads=8, shared_heads=16,
                                        active_routed_heads=8, rope_theta=500000.0)
    authors = _authors_llama(ref, 4096, 500000.0)
    assert (authors.shared_head, authors.routed_head) == (16, 8)
    layer = moh.from_torch(authors)
    preset = moh.MoHConfig.moh_llama3_8b()
    _assert_released_split(preset, 32)
    assert preset.head_dim == 128 and preset.num_kv_heads == 8 and preset.rope_theta == 500000.0
    for field in ("embed_dim", "num_heads", "num_kv_heads", "shared_heads", "active_routed_heads",
                  "router", "rope", "rope_theta", "qkv_bias", "proj_bias"):
        assert getattr(layer.config, field) == getattr(preset, field), field
    assert layer.head_dim == 128
    x = torch.randn(1, 3, 4096)
    routing = moh.MoHRouting()
    layer(x, causal=True, routing=routing)
    with torch.no_grad():
        mask = ref.route(ref.q_proj(x).view(3, 32, 128))
    np.testing.assert_array_equal(routing.gates, mask.numpy())
    assert (routing.gates[:, :16] == 1).all() and (routing.gates[:, 16:].sum(axis=1) == 8).all()
