"""from_torch on modules shaped as the authors' own classes (SkyworkAI/MoH): the attribute names
of MoH-DiT's MoHAttention (num_heads, head_dim, shared_head, routed_head; q_norm an Identity
without qk_norm) and of MoH-ViT's last-stage Attention (its ln(N_0) in the non-persistent buffer
seq_length_scale), with the reference modules of tools/moh_modules.py computing the formula."""

import math
import os
import sys

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
