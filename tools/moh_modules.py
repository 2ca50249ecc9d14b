"""PyTorch reference modules for the layers of moh, written from the project's SEMANTICS.md.

Each module keeps its weights under the names the authors' PyTorch code uses, so a trained
state dict loads with ``load_state_dict`` and ``export_torch.py`` writes it as a ``moh-case/1``
golden case that ``moh_parity`` checks the C++ library against.

    MoHAttention        Mixture-of-Head attention, learned two-stage router (ViT / DiT style):
                        qkv, proj, wg, wg_0, wg_1. forward -> MoHOutput(y, gates, aux_loss)
    MoAAttention        Mixture of Attention heads (fairseq style): q_proj.experts.w,
                        q_proj.output_experts.w, q_proj.w_gate, k_proj, v_proj.
                        forward -> MoAOutput(y, expert_counts, switch_loss, z_loss, cv_loss)
    MoHLlamaAttention   LLaMA attention with the parameter-free query-norm router, GQA and RoPE:
                        q_proj, k_proj, v_proj, o_proj. forward -> MoHLlamaOutput(y, head_mask)

Shapes: x is [B, T, D] (batch first); key_padding_mask is [B, T] bool, True = padding.
The modules are plain differentiable torch code (any dtype); they aim at being obviously the
formula, not at speed.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "attention",
    "mha_reference",
    "rope",
    "top_k_mask",
    "MoHAttention",
    "MoAAttention",
    "MoHLlamaAttention",
    "MoHOutput",
    "MoAOutput",
    "MoHLlamaOutput",
]


# --- building blocks ---------------------------------------------------------------------------


def attention(q, k, v, causal=False, key_padding_mask=None):
    """softmax(q k^T / sqrt(d) + mask) v for q [B, H, T, d], k and v [B, H or 1, S, d] -> [B, H, T, d].

    Causal masks key j for query i when j > i + (S - T) (bottom-right aligned); key_padding_mask
    [B, S] (True = padding) hides keys. A query that sees no key at all gets a zero row.
    """
    T, d = q.shape[-2], q.shape[-1]
    S = k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)  # [B, H, T, S]
    visible = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(T, device=q.device).unsqueeze(1)
        j = torch.arange(S, device=q.device).unsqueeze(0)
        visible = j <= i + (S - T)
    visible = visible.view(1, 1, T, S)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask.to(torch.bool).view(-1, 1, 1, S)
    visible = visible.expand(scores.shape)
    any_visible = visible.any(dim=-1, keepdim=True)  # [B, H, T, 1]
    scores = scores.masked_fill(~visible, float("-inf"))
    # Rows with no visible key: softmax over zeros (finite), then zeroed, so no NaN anywhere.
    scores = scores.masked_fill(~any_visible, 0.0)
    weights = torch.softmax(scores, dim=-1) * any_visible.to(scores.dtype)
    return torch.matmul(weights, v)


def mha_reference(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads,
                  head_dim, causal=False, key_padding_mask=None):
    """Dense multi-head self-attention (SEMANTICS.md section 2) on x [B, T, D] -> [B, T, D].

    Weights as torch.nn.MultiheadAttention stores them: in_proj_weight [3 H d, D] (q, k, v blocks,
    heads in order), out_proj_weight [D, H d]; biases may be None.
    """
    B, T, _ = x.shape
    qkv = torch.nn.functional.linear(x, in_proj_weight, in_proj_bias)
    q, k, v = qkv.view(B, T, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, d]
    o = attention(q, k, v, causal, key_padding_mask)
    o = o.transpose(1, 2).reshape(B, T, num_heads * head_dim)
    return torch.nn.functional.linear(o, out_proj_weight, out_proj_bias)


def top_k_mask(p, k):
    """0/1 mask [N, E] of the top k entries of each row of p; ties go to the lower index."""
    mask = torch.zeros_like(p)
    if k == 0:
        return mask
    # A stable descending sort keeps equal values in index order: the lower index wins.
    order = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    return mask.scatter(1, order, 1.0)


def rope(x, theta, positions):
    """Rotate-half RoPE of x [B, T, heads, d] at positions [T]: theta_j = base^(-2j/d), j < d/2."""
    d = x.shape[-1]
    half = d // 2
    j = torch.arange(half, dtype=torch.float64, device=x.device)
    inv_freq = torch.pow(torch.tensor(float(theta), dtype=torch.float64), -2.0 * j / d)
    angle = positions.to(torch.float64).view(-1, 1) * inv_freq.view(1, -1)  # [T, d/2]
    c = torch.cos(angle).to(x.dtype).view(1, -1, 1, half)
    s = torch.sin(angle).to(x.dtype).view(1, -1, 1, half)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


# --- MoH: Mixture-of-Head attention with the learned router ------------------------------------



def _check_head_split(module, num_heads, shared_heads, active_routed_heads):
    """Raises ValueError unless 0 <= S_h <= H, 0 <= K <= H - S_h and S_h + K >= 1."""
    routed = num_heads - shared_heads
    if not 0 <= shared_heads <= num_heads:
        raise ValueError(f"{module}: shared_heads: expected 0..{num_heads}, got {shared_heads}")
    if not 0 <= active_routed_heads <= routed:
        raise ValueError(f"{module}: active_routed_heads: expected 0..{routed}, "
                         f"got {active_routed_heads}")
    if shared_heads + active_routed_heads < 1:
        raise ValueError(f"{module}: no head is ever active: expected shared_heads + "
                         "active_routed_heads >= 1, got 0")

class MoHOutput(NamedTuple):
    y: torch.Tensor         # [B, T, D]
    gates: torch.Tensor     # [B, T, H], exactly 0 for heads a token does not use
    aux_loss: torch.Tensor  # [] load-balance loss L_b over the routed heads


class MoHAttention(nn.Module):
    """Mixture-of-Head attention (arXiv 2410.11842), ViT / DiT style (SEMANTICS.md section 3).

    Heads 0..S_h-1 are shared (always on), heads S_h..H-1 routed; each token keeps its top K
    routed heads. Router weights (no bias): wg [H-S_h, D] if K > 0, wg_0 [2, D] if S_h > 0 and
    K > 0, wg_1 [S_h, D] if S_h > 1.
    """

    def __init__(self, embed_dim, num_heads, head_dim=None, shared_heads=0,
                 active_routed_heads=1, bias=True):
        super().__init__()
        head_dim = head_dim or embed_dim // num_heads
        routed = num_heads - shared_heads
        if not (embed_dim > 0 and num_heads > 0 and head_dim > 0):
            raise ValueError(f"MoHAttention: sizes must be positive, got embed_dim={embed_dim}, "
                             f"num_heads={num_heads}, head_dim={head_dim}")
        _check_head_split("MoHAttention", num_heads, shared_heads, active_routed_heads)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.shared_heads, self.active_routed_heads = shared_heads, active_routed_heads
        width = num_heads * head_dim
        self.qkv = nn.Linear(embed_dim, 3 * width, bias=bias)
        self.proj = nn.Linear(width, embed_dim, bias=bias)
        K, S = active_routed_heads, shared_heads
        self.wg = nn.Linear(embed_dim, routed, bias=False) if K > 0 else None
        self.wg_0 = nn.Linear(embed_dim, 2, bias=False) if S > 0 and K > 0 else None
        self.wg_1 = nn.Linear(embed_dim, S, bias=False) if S > 1 else None

    def route(self, x):
        """Gates [N, H] and load-balance loss for token rows x [N, D]."""
        N = x.shape[0]
        S, K, E = self.shared_heads, self.active_routed_heads, self.num_heads - self.shared_heads
        ones = x.new_ones(N, 1)
        a_s = a_r = ones
        if self.wg_0 is not None:
            mix = 2.0 * torch.softmax(self.wg_0(x), dim=-1)
            a_s, a_r = mix[:, 0:1], mix[:, 1:2]
        parts = []
        if S == 1:
            parts.append(a_s)
        elif S > 1:
            parts.append(S * torch.softmax(self.wg_1(x), dim=-1) * a_s)
        aux = x.new_zeros(())
        if K > 0:
            p = torch.softmax(self.wg(x), dim=-1)  # [N, E]
            kept = top_k_mask(p, K)
            p_kept = p * kept
            denom = p_kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
            parts.append(K * p_kept / denom * a_r)
            if N > 0:
                aux = E * (kept.mean(dim=0) * p.mean(dim=0)).sum()
        else:
            parts.append(x.new_zeros(N, E))
        return torch.cat(parts, dim=-1), aux

    def forward(self, x, key_padding_mask=None, causal=False):
        B, T, D = x.shape
        H, d = self.num_heads, self.head_dim
        gates, aux = self.route(x.reshape(B * T, D))
        gates = gates.view(B, T, H)
        q, k, v = self.qkv(x).view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, d]
        o = attention(q, k, v, causal, key_padding_mask).transpose(1, 2)  # [B, T, H, d]
        o = (o * gates.unsqueeze(-1)).reshape(B, T, H * d)
        return MoHOutput(self.proj(o), gates, aux)


# --- MoA: Mixture of Attention heads -----------------------------------------------------------


class MoAOutput(NamedTuple):
    y: torch.Tensor              # [B, T, D]
    expert_counts: torch.Tensor  # [E] (token, slot) pairs routed to each expert
    switch_loss: torch.Tensor    # []
    z_loss: torch.Tensor         # []
    cv_loss: torch.Tensor        # []


class ParallelExperts(nn.Module):
    """E independent projections stored as one tensor w [E, in, out], applied as x w[e]."""

    def __init__(self, num_experts, in_features, out_features):
        super().__init__()
        self.w = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.w, -bound, bound)


class MoAQueryProjection(nn.Module):
    """The routed part of MoA: per-expert query and output projections and the gate W_g [D, E]."""

    def __init__(self, embed_dim, head_dim, num_experts):
        super().__init__()
        self.experts = ParallelExperts(num_experts, embed_dim, head_dim)          # W_q [E, D, d]
        self.output_experts = ParallelExperts(num_experts, head_dim, embed_dim)   # W_o [E, d, D]
        self.w_gate = nn.Parameter(torch.empty(embed_dim, num_experts))           # W_g [D, E]
        bound = 1.0 / math.sqrt(embed_dim)
        nn.init.uniform_(self.w_gate, -bound, bound)


class MoAAttention(nn.Module):
    """Mixture of Attention heads (arXiv 2210.05144; SEMANTICS.md section 5).

    E experts, each token uses the top k by p = softmax(x W_g) with gate p_e (not renormalised);
    expert e attends with q_e = x W_q^e over the shared single-head K = x W_k^T, V = x W_v^T and
    contributes p_e (o_e W_o^e). No bias anywhere.
    """

    def __init__(self, embed_dim, head_dim, num_experts, top_k):
        super().__init__()
        if not (embed_dim > 0 and head_dim > 0 and num_experts > 0):
            raise ValueError(f"MoAAttention: sizes must be positive, got embed_dim={embed_dim}, "
                             f"head_dim={head_dim}, num_experts={num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoAAttention: top_k: expected 1..{num_experts}, got {top_k}")
        self.embed_dim, self.head_dim = embed_dim, head_dim
        self.num_experts, self.top_k = num_experts, top_k
        self.q_proj = MoAQueryProjection(embed_dim, head_dim, num_experts)
        self.k_proj = nn.Linear(embed_dim, head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, head_dim, bias=False)

    def forward(self, x, key_padding_mask=None, causal=False):
        B, T, D = x.shape
        E, k = self.num_experts, self.top_k
        rows = x.reshape(B * T, D)
        logits = rows @ self.q_proj.w_gate  # [N, E]
        p = torch.softmax(logits, dim=-1)
        kept = top_k_mask(p, k)
        gate = (p * kept).view(B, T, E)
        q = torch.einsum("bti,eio->beto", x, self.q_proj.experts.w)  # [B, E, T, d]
        keys = self.k_proj(x).unsqueeze(1)  # [B, 1, T, d], shared by all experts
        values = self.v_proj(x).unsqueeze(1)
        o = attention(q, keys, values, causal, key_padding_mask)  # [B, E, T, d]
        out = torch.einsum("beti,eio->bteo", o, self.q_proj.output_experts.w)  # [B, T, E, D]
        y = (out * gate.unsqueeze(-1)).sum(dim=2)

        counts = kept.sum(dim=0)  # [E]
        prob_share = p.sum(dim=0) / p.sum()
        switch = E * (prob_share * counts / counts.sum()).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        load = gate.reshape(B * T, E).sum(dim=0)
        load = load / load.sum()
        cv = load.var(unbiased=True) / (load.mean().pow(2) + 1e-10) if E > 1 else load.new_zeros(())
        return MoAOutput(y, counts, switch, z, cv)


# --- MoH-LLaMA: query-norm router, GQA, RoPE -------------------------------------------------------


class MoHLlamaOutput(NamedTuple):
    y: torch.Tensor          # [B, T, D]
    head_mask: torch.Tensor  # [B, T, H], 0/1


class MoHLlamaAttention(nn.Module):
    """LLaMA attention with MoH's parameter-free query-norm router (SEMANTICS.md section 4).

    l_i = ||q_i|| of each routed head (before RoPE), z = l / std(l) (unbiased), p = softmax(z),
    keep the top K; shared heads 0..S_h-1 always on; the gate is 0/1. RoPE (rotate-half) on q, k;
    query head h reads key/value head h // (H / H_kv). No bias.
    """

    def __init__(self, embed_dim, num_heads, head_dim=None, num_kv_heads=None, shared_heads=0,
                 active_routed_heads=1, rope_theta=10000.0):
        super().__init__()
        head_dim = head_dim or embed_dim // num_heads
        num_kv_heads = num_kv_heads or num_heads
        if not (embed_dim > 0 and num_heads > 0 and head_dim > 0 and num_kv_heads > 0):
            raise ValueError(f"MoHLlamaAttention: sizes must be positive, got embed_dim={embed_dim}, "
                             f"num_heads={num_heads}, head_dim={head_dim}, num_kv_heads={num_kv_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"MoHLlamaAttention: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads, got {num_kv_heads}")
        if head_dim % 2:
            raise ValueError(f"MoHLlamaAttention: RoPE needs an even head_dim, got {head_dim}")
        _check_head_split("MoHLlamaAttention", num_heads, shared_heads, active_routed_heads)
        if not (math.isfinite(rope_theta) and rope_theta > 0):
            raise ValueError(f"MoHLlamaAttention: rope_theta must be positive, got {rope_theta}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.num_kv_heads, self.rope_theta = num_kv_heads, float(rope_theta)
        self.shared_heads, self.active_routed_heads = shared_heads, active_routed_heads
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False)

    def route(self, q):
        """0/1 head mask [N, H] from the queries before RoPE, q [N, H, d].

        With one routed head, or all norms of a token equal (std 0), z is 0 and ties go to the
        lower index (the spec leaves this case open; this is what moh's C++ router does).
        """
        N = q.shape[0]
        S, K, E = self.shared_heads, self.active_routed_heads, self.num_heads - self.shared_heads
        norms = q[:, S:, :].norm(dim=-1)  # [N, E]
        if E > 1:
            std = norms.std(dim=-1, unbiased=True, keepdim=True)
            ok = torch.isfinite(std) & (std > 0)
            z = torch.where(ok, norms / torch.where(ok, std, torch.ones_like(std)),
                            torch.zeros_like(norms))
        else:
            z = torch.zeros_like(norms)
        p = torch.softmax(z, dim=-1)
        return torch.cat([q.new_ones(N, S), top_k_mask(p, K)], dim=-1)

    def forward(self, x, key_padding_mask=None, causal=True, position_offset=0):
        B, T, D = x.shape
        H, G, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, d)
        k = self.k_proj(x).view(B, T, G, d)
        v = self.v_proj(x).view(B, T, G, d)
        head_mask = self.route(q.reshape(B * T, H, d)).view(B, T, H)
        positions = torch.arange(position_offset, position_offset + T, device=x.device)
        q = rope(q, self.rope_theta, positions).transpose(1, 2)  # [B, H, T, d]
        k = rope(k, self.rope_theta, positions).transpose(1, 2)  # [B, G, T, d]
        v = v.transpose(1, 2)
        k = k.repeat_interleave(H // G, dim=1)  # query head h reads kv head h // (H / G)
        v = v.repeat_interleave(H // G, dim=1)
        o = attention(q, k, v, causal, key_padding_mask).transpose(1, 2)  # [B, T, H, d]
        o = (o * head_mask.unsqueeze(-1)).reshape(B, T, H * d)
        return MoHLlamaOutput(self.o_proj(o), head_mask)
