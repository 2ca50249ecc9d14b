"""PyTorch reference modules for the layers of moh, written from the project's docs/semantics.md.

Each module keeps its weights under the names the authors' PyTorch code uses, so a trained
state dict loads with ``load_state_dict`` and ``export_torch.py`` writes it as a ``moh-case/1``
golden case that ``moh_parity`` checks the C++ library against.

    MoHAttention        Mixture-of-Head attention, learned two-stage router (ViT / DiT style):
                        qkv, proj, wg, wg_0, wg_1, optional q_norm / k_norm; self- or
                        cross-attention. forward -> MoHOutput(y, gates, aux_loss)
    MoHViTAttention     MoH-ViT: TransNeXt's last-stage cosine attention with a continuous
                        position bias, routed as MoHAttention: plus temperature, query_embedding,
                        cpb_fc1, cpb_fc2. forward(x, grid) -> MoHOutput(y, gates, aux_loss)
    MoAAttention        Mixture of Attention heads (fairseq style): q_proj.experts.w,
                        q_proj.output_experts.w, q_proj.w_gate, k_proj, v_proj; query padding,
                        cross-attention over a memory of width kdim.
                        forward -> MoAOutput(y, expert_counts, switch_loss, z_loss, cv_loss)
    JetMoEAttention     JetMoE's mixture of multi-head attention experts (Hugging Face names):
                        experts.input_linear, experts.output_linear, experts.router.layer,
                        experts.bias, kv_proj; GQA-style heads, RoPE, top-k-then-softmax gates.
                        forward -> JetMoEOutput(y, expert_counts, switch_loss, z_loss)
    MoHLlamaAttention   LLaMA attention with the parameter-free query-norm router, GQA and RoPE:
                        q_proj, k_proj, v_proj, o_proj. forward -> MoHLlamaOutput(y, head_mask)

Shapes: x is [B, T, D] (batch first); memory (cross-attention) is [B, S, D_kv];
key_padding_mask is [B, S] bool, True = padding (S = T for self-attention); attn_bias is an
additive float bias [B|1, H|1, T, S] (-inf = masked; H is 1 for MoA and JetMoE).
The modules are plain differentiable torch code (any dtype); they aim at being obviously the
formula, not at speed.
"""

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "attention",
    "mha_reference",
    "rope",
    "top_k_mask",
    "MoHAttention",
    "MoHViTAttention",
    "MoAAttention",
    "JetMoEAttention",
    "MoHLlamaAttention",
    "MoHOutput",
    "MoAOutput",
    "JetMoEOutput",
    "MoHLlamaOutput",
]


# --- building blocks ---------------------------------------------------------------------------


def attention(q, k, v, causal=False, key_padding_mask=None, attn_bias=None, scale=None):
    """softmax(q k^T * scale + bias + mask) v for q [B, H, T, d], k and v [B, H or 1, S, d] -> [B, H, T, d].

    scale defaults to 1 / sqrt(d). attn_bias [B|1, H|1, T, S] is added after the scaling (-inf
    masks). Causal masks key j for query i when j > i + (S - T) (bottom-right aligned);
    key_padding_mask [B, S] (True = padding) hides keys. A query row left with no finite score
    gets a zero row.
    """
    T, d = q.shape[-2], q.shape[-1]
    S = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, T, S]
    if attn_bias is not None:
        scores = scores + attn_bias.to(scores.dtype)
    visible = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(T, device=q.device).unsqueeze(1)
        j = torch.arange(S, device=q.device).unsqueeze(0)
        visible = j <= i + (S - T)
    visible = visible.view(1, 1, T, S)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask.to(torch.bool).view(-1, 1, 1, S)
    visible = visible.expand(scores.shape)
    if attn_bias is not None:
        visible = visible & (scores > float("-inf"))
    any_visible = visible.any(dim=-1, keepdim=True)  # [B, H, T, 1]
    scores = scores.masked_fill(~visible, float("-inf"))
    # Rows with no visible key: softmax over zeros (finite), then zeroed, so no NaN anywhere.
    scores = scores.masked_fill(~any_visible, 0.0)
    weights = torch.softmax(scores, dim=-1) * any_visible.to(scores.dtype)
    return torch.matmul(weights, v)


def mha_reference(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads,
                  head_dim, causal=False, key_padding_mask=None, memory=None, attn_bias=None):
    """Dense multi-head attention (docs/semantics.md §2) on x [B, T, D] -> [B, T, D].

    Weights as torch.nn.MultiheadAttention stores them: in_proj_weight [3 H d, D] (q, k, v blocks,
    heads in order), out_proj_weight [D, H d]; biases may be None. memory [B, S, D] makes it
    cross-attention (keys and values from memory); attn_bias [B|1, H|1, T, S].
    """
    B, T, _ = x.shape
    q, k, v = _split_qkv(x, memory, in_proj_weight, in_proj_bias, num_heads, head_dim)
    o = attention(q, k, v, causal, key_padding_mask, attn_bias)
    o = o.transpose(1, 2).reshape(B, T, num_heads * head_dim)
    return F.linear(o, out_proj_weight, out_proj_bias)


def _split_qkv(x, memory, weight, bias, num_heads, head_dim):
    """Queries from x [B, T, D], keys and values from memory [B, S, D] (or x) with one packed
    projection weight [3 H d, D] (q, k, v blocks) -> 3 x [B, H, T or S, d]."""
    B, T, _ = x.shape
    H, d = num_heads, head_dim
    if memory is None:
        return F.linear(x, weight, bias).view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)
    width = H * d
    S = memory.shape[1]
    q = F.linear(x, weight[:width], None if bias is None else bias[:width])
    kv = F.linear(memory, weight[width:], None if bias is None else bias[width:])
    k, v = kv.view(B, S, 2, H, d).permute(2, 0, 3, 1, 4)
    return q.view(B, T, H, d).transpose(1, 2), k, v


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


def _switch_z_losses(p, logits, counts):
    """Switch loss E * sum_e (P_e / sum P) (c_e / sum c) and z-loss mean_t logsumexp(l_t)^2.

    p [N, E] (rows of tokens that route nothing are 0), logits [N, E], counts [E]. With no
    routed token at all the switch loss is 0.
    """
    E = p.shape[-1]
    total_p, total_c = p.sum(), counts.sum()
    if float(total_c) > 0 and float(total_p) > 0:
        switch = E * ((p.sum(dim=0) / total_p) * (counts / total_c)).sum()
    else:
        switch = p.new_zeros(())
    z = torch.logsumexp(logits, dim=-1).pow(2).mean() if logits.shape[0] else logits.new_zeros(())
    return switch, z


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


class _MoHBase(nn.Module):
    """What MoH ViT/DiT attention and MoH-ViT share: qkv [3 H d, D] (bias if qkv_bias),
    proj [D, H d] (always biased), the router wg / wg_0 / wg_1 (docs/semantics.md §3, §7) and
    the optional q_norm / k_norm LayerNorm(d)."""

    def __init__(self, name, embed_dim, num_heads, head_dim, shared_heads, active_routed_heads,
                 qkv_bias, qk_norm):
        super().__init__()
        if not (embed_dim > 0 and num_heads > 0 and head_dim > 0):
            raise ValueError(f"{name}: sizes must be positive, got embed_dim={embed_dim}, "
                             f"num_heads={num_heads}, head_dim={head_dim}")
        _check_head_split(name, num_heads, shared_heads, active_routed_heads)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.shared_heads, self.active_routed_heads = shared_heads, active_routed_heads
        self.qkv_bias, self.qk_norm = bool(qkv_bias), bool(qk_norm)
        width = num_heads * head_dim
        self.qkv = nn.Linear(embed_dim, 3 * width, bias=self.qkv_bias)
        self.proj = nn.Linear(width, embed_dim, bias=True)
        K, S = active_routed_heads, shared_heads
        self.wg = nn.Linear(embed_dim, num_heads - S, bias=False) if K > 0 else None
        self.wg_0 = nn.Linear(embed_dim, 2, bias=False) if S > 0 and K > 0 else None
        self.wg_1 = nn.Linear(embed_dim, S, bias=False) if S > 1 else None
        # The authors' timm-style Attention: one LayerNorm(head_dim) each for queries and keys.
        self.q_norm = nn.LayerNorm(head_dim, eps=1e-5) if self.qk_norm else None
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-5) if self.qk_norm else None

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

    def project(self, x, memory=None):
        """q [B, H, T, d] from x, k and v [B, H, S, d] from memory (or x), after qk_norm."""
        q, k, v = _split_qkv(x, memory, self.qkv.weight, self.qkv.bias, self.num_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def combine(self, o, gates):
        """proj(concat_h g_h o_h) for o [B, H, T, d] and gates [B, T, H] -> [B, T, D]."""
        B, H, T, d = o.shape
        o = o.transpose(1, 2) * gates.unsqueeze(-1)  # [B, T, H, d]
        return self.proj(o.reshape(B, T, H * d))


class MoHAttention(_MoHBase):
    """Mixture-of-Head attention (arXiv 2410.11842), ViT / DiT style (docs/semantics.md §3, §7).

    Heads 0..S_h-1 are shared (always on), heads S_h..H-1 routed; each token keeps its top K
    routed heads. Router weights (no bias): wg [H-S_h, D] if K > 0, wg_0 [2, D] if S_h > 0 and
    K > 0, wg_1 [S_h, D] if S_h > 1. S_h = H, K = 0 is the authors' dense weighted-sum variant.
    qkv has a bias only with qkv_bias, proj always; qk_norm adds q_norm / k_norm LayerNorm(d).
    forward(x, memory=...) is cross-attention: queries and routing from x, keys and values from
    memory [B, S, D] through the k and v blocks of qkv.
    """

    def __init__(self, embed_dim, num_heads, head_dim=None, shared_heads=0,
                 active_routed_heads=1, qkv_bias=True, qk_norm=False):
        super().__init__("MoHAttention", embed_dim, num_heads,
                         head_dim or (embed_dim // num_heads if num_heads > 0 else 0),
                         shared_heads, active_routed_heads, qkv_bias, qk_norm)

    def forward(self, x, key_padding_mask=None, causal=False, memory=None, attn_bias=None):
        B, T, D = x.shape
        gates, aux = self.route(x.reshape(B * T, D))
        gates = gates.view(B, T, self.num_heads)
        q, k, v = self.project(x, memory)
        o = attention(q, k, v, causal, key_padding_mask, attn_bias)  # [B, H, T, d]
        return MoHOutput(self.combine(o, gates), gates, aux)


class MoHViTAttention(_MoHBase):
    """MoH-ViT: TransNeXt's last-stage attention with MoH routing (docs/semantics.md §8).

    Tokens are an h x w grid in row-major order. Per head: cosine attention
    s_ij = ((q^_i + e_h) * softplus(tau_h) * ln(N_0)) . k^_j + P_h[i, j] (no 1/sqrt(d)), with
    q^, k^ the L2-normalised rows, e_h = query_embedding [H, 1, d], tau_h = temperature [H, 1, 1],
    N_0 = train_tokens, and P the continuous position bias cpb_fc2(relu(cpb_fc1(c))) of the
    log-spaced relative offsets c, scaled by the pretraining grid pretrain_grid = (h_0, w_0).
    Gates, qkv, proj and wg / wg_0 / wg_1 as MoHAttention; head_dim = embed_dim / num_heads.
    """

    CPB_HIDDEN = 512

    def __init__(self, embed_dim, num_heads, pretrain_grid, train_tokens=None, shared_heads=0,
                 active_routed_heads=1, qkv_bias=True, qk_norm=False):
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"MoHViTAttention: embed_dim must be a positive multiple of num_heads, "
                             f"got embed_dim={embed_dim}, num_heads={num_heads}")
        super().__init__("MoHViTAttention", embed_dim, num_heads, embed_dim // num_heads,
                         shared_heads, active_routed_heads, qkv_bias, qk_norm)
        h0, w0 = (int(s) for s in pretrain_grid)
        if h0 < 2 or w0 < 2:
            raise ValueError(f"MoHViTAttention: pretrain_grid: expected both sides >= 2, got "
                             f"{h0}x{w0}")
        train_tokens = h0 * w0 if train_tokens is None else int(train_tokens)
        if train_tokens < 2:
            raise ValueError(f"MoHViTAttention: train_tokens: expected >= 2 (ln N_0 > 0), got "
                             f"{train_tokens}")
        self.pretrain_grid, self.train_tokens = (h0, w0), train_tokens
        H, d = num_heads, self.head_dim
        # TransNeXt's initial values: softplus(temperature) = 1 / 0.24, a small query embedding.
        self.temperature = nn.Parameter(torch.log(torch.full((H, 1, 1), 1.0 / 0.24).exp() - 1.0))
        self.query_embedding = nn.Parameter(torch.empty(H, 1, d).normal_(0.0, 0.02))
        self.cpb_fc1 = nn.Linear(2, self.CPB_HIDDEN, bias=True)
        self.cpb_fc2 = nn.Linear(self.CPB_HIDDEN, H, bias=True)

    def position_bias(self, grid):
        """P [H, h w, h w] for the grid (h, w): query i = (y_i, x_i), key j = (y_j, x_j)."""
        h, w = grid
        h0, w0 = self.pretrain_grid
        dtype, device = self.cpb_fc1.weight.dtype, self.cpb_fc1.weight.device
        # One row per relative offset (y_i - y_j, x_i - x_j), offsets -(h-1)..h-1 x -(w-1)..w-1.
        dy = torch.arange(-(h - 1), h, dtype=dtype, device=device)
        dx = torch.arange(-(w - 1), w, dtype=dtype, device=device)
        offsets = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1).reshape(-1, 2)
        r = offsets * torch.tensor([8.0 / (h0 - 1), 8.0 / (w0 - 1)], dtype=dtype, device=device)
        c = torch.sign(r) * torch.log2(r.abs() + 1.0) / math.log2(8.0)
        table = self.cpb_fc2(torch.relu(self.cpb_fc1(c)))  # [(2h-1)(2w-1), H]
        ys = torch.arange(h, device=device).repeat_interleave(w)  # token i -> row y_i
        xs = torch.arange(w, device=device).repeat(h)             # token i -> column x_i
        index = (ys.view(-1, 1) - ys.view(1, -1) + h - 1) * (2 * w - 1) \
            + (xs.view(-1, 1) - xs.view(1, -1) + w - 1)  # [T, T]
        return table[index].permute(2, 0, 1)  # [H, T, T]

    def forward(self, x, grid, key_padding_mask=None, causal=False, attn_bias=None):
        B, T, D = x.shape
        h, w = (int(s) for s in grid)
        if h < 1 or w < 1 or h * w != T:
            raise ValueError(f"MoHViTAttention: grid: expected h x w = {T} tokens, got {h}x{w}")
        gates, aux = self.route(x.reshape(B * T, D))
        gates = gates.view(B, T, self.num_heads)
        q, k, v = self.project(x)
        q = F.normalize(q, dim=-1, eps=1e-12)  # q / max(||q||, 1e-12)
        k = F.normalize(k, dim=-1, eps=1e-12)
        # softplus(t) = ln(1 + e^t), computed without overflow.
        softplus = torch.logaddexp(self.temperature, torch.zeros_like(self.temperature))
        q = (q + self.query_embedding) * softplus * math.log(self.train_tokens)
        bias = self.position_bias((h, w)).unsqueeze(0)  # [1, H, T, T]
        if attn_bias is not None:
            bias = bias + attn_bias.to(bias.dtype)
        o = attention(q, k, v, causal, key_padding_mask, bias, scale=1.0)
        return MoHOutput(self.combine(o, gates), gates, aux)


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
    """Mixture of Attention heads (arXiv 2210.05144; docs/semantics.md §5, §9).

    E experts, each token uses the top k by p = softmax(x W_g) with gate p_e (not renormalised);
    expert e attends with q_e = x W_q^e over the shared single-head K = m W_k^T, V = m W_v^T
    (m = memory [B, S, kdim] for cross-attention, else x) and contributes p_e (o_e W_o^e). No bias
    anywhere. query_padding_mask [B, T] (True = padding) gives a token p = 0: it routes nothing,
    outputs 0 and is left out of expert_counts, the switch loss and the cv-loss (not the z-loss).
    """

    def __init__(self, embed_dim, head_dim, num_experts, top_k, kdim=None):
        super().__init__()
        kdim = embed_dim if kdim is None else kdim
        if not (embed_dim > 0 and head_dim > 0 and num_experts > 0 and kdim > 0):
            raise ValueError(f"MoAAttention: sizes must be positive, got embed_dim={embed_dim}, "
                             f"head_dim={head_dim}, num_experts={num_experts}, kdim={kdim}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoAAttention: top_k: expected 1..{num_experts}, got {top_k}")
        self.embed_dim, self.head_dim, self.kdim = embed_dim, head_dim, kdim
        self.num_experts, self.top_k = num_experts, top_k
        self.q_proj = MoAQueryProjection(embed_dim, head_dim, num_experts)
        self.k_proj = nn.Linear(kdim, head_dim, bias=False)
        self.v_proj = nn.Linear(kdim, head_dim, bias=False)

    def forward(self, x, key_padding_mask=None, causal=False, memory=None, attn_bias=None,
                query_padding_mask=None):
        B, T, D = x.shape
        E, k = self.num_experts, self.top_k
        rows = x.reshape(B * T, D)
        logits = rows @ self.q_proj.w_gate  # [N, E]
        p = torch.softmax(logits, dim=-1)
        live = x.new_ones(B * T, 1)
        if query_padding_mask is not None:
            live = (~query_padding_mask.to(torch.bool)).reshape(B * T, 1).to(p.dtype)
            p = p * live
        kept = top_k_mask(p, k) * live
        gate = (p * kept).view(B, T, E)
        q = torch.einsum("bti,eio->beto", x, self.q_proj.experts.w)  # [B, E, T, d]
        source = x if memory is None else memory
        keys = self.k_proj(source).unsqueeze(1)  # [B, 1, S, d], shared by all experts
        values = self.v_proj(source).unsqueeze(1)
        o = attention(q, keys, values, causal, key_padding_mask, attn_bias)  # [B, E, T, d]
        out = torch.einsum("beti,eio->bteo", o, self.q_proj.output_experts.w)  # [B, T, E, D]
        y = (out * gate.unsqueeze(-1)).sum(dim=2)

        counts = kept.sum(dim=0)  # [E]
        switch, z = _switch_z_losses(p, logits, counts)
        load = gate.reshape(B * T, E).sum(dim=0)
        if E > 1 and float(load.sum()) > 0:
            load = load / load.sum()
            cv = load.var(unbiased=True) / (load.mean().pow(2) + 1e-10)
        else:
            cv = load.new_zeros(())
        return MoAOutput(y, counts, switch, z, cv)


# --- JetMoE: mixture of multi-head attention experts ---------------------------------------------


class JetMoEOutput(NamedTuple):
    y: torch.Tensor              # [B, T, D]
    expert_counts: torch.Tensor  # [E] (token, slot) pairs routed to each expert
    switch_loss: torch.Tensor    # [] over p = softmax(logits) of all E experts
    z_loss: torch.Tensor         # []


class _JetMoEParallelExperts(nn.Module):
    """E projections stored as one weight [E, out, in], applied as x weight[e]^T (HF layout)."""

    def __init__(self, num_experts, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)


class _JetMoERouter(nn.Module):
    """The top-k gate: layer = Linear(D, E), no bias (logits l = x W_r^T)."""

    def __init__(self, embed_dim, num_experts):
        super().__init__()
        self.layer = nn.Linear(embed_dim, num_experts, bias=False)


class _JetMoEExperts(nn.Module):
    """JetMoE's MoA block: input_linear [E, H_kv d, D], output_linear [E, D, H_kv d], the router
    and one output bias [D] shared by all experts."""

    def __init__(self, embed_dim, width, num_experts):
        super().__init__()
        self.input_linear = _JetMoEParallelExperts(num_experts, embed_dim, width)
        self.output_linear = _JetMoEParallelExperts(num_experts, width, embed_dim)
        self.router = _JetMoERouter(embed_dim, num_experts)
        # Hugging Face starts it at zero; a random start makes exported cases test it.
        bound = 1.0 / math.sqrt(embed_dim)
        self.bias = nn.Parameter(torch.empty(embed_dim).uniform_(-bound, bound))


class JetMoEAttention(nn.Module):
    """The attention of JetMoE (Hugging Face transformers' JetMoeAttention; docs/semantics.md §9).

    [K | V] = x W_kv^T with kv_proj [2 H_kv d, D] (keys first), H_kv heads of size d, no bias.
    Router logits l = x W_r^T; the top k logits (ties: lower index) get gates softmax over those
    k. Slot s with expert e: q = x W_in^{e T} split into H_kv heads, RoPE (rope_theta) on queries
    and keys, query head j attends with key/value head j; y = sum_s g_s (o_s W_out^{e T}) + bias.
    Switch and z-losses as MoA with p = softmax(l) over all E experts.
    """

    def __init__(self, embed_dim, head_dim, num_kv_heads, num_experts, top_k, rope_theta=10000.0):
        super().__init__()
        if not (embed_dim > 0 and head_dim > 0 and num_kv_heads > 0 and num_experts > 0):
            raise ValueError(f"JetMoEAttention: sizes must be positive, got embed_dim={embed_dim}, "
                             f"head_dim={head_dim}, num_kv_heads={num_kv_heads}, "
                             f"num_experts={num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"JetMoEAttention: top_k: expected 1..{num_experts}, got {top_k}")
        if head_dim % 2:
            raise ValueError(f"JetMoEAttention: RoPE needs an even head_dim, got {head_dim}")
        if not (math.isfinite(rope_theta) and rope_theta > 0):
            raise ValueError(f"JetMoEAttention: rope_theta must be positive, got {rope_theta}")
        self.embed_dim, self.head_dim, self.num_kv_heads = embed_dim, head_dim, num_kv_heads
        self.num_experts, self.top_k, self.rope_theta = num_experts, top_k, float(rope_theta)
        width = num_kv_heads * head_dim
        self.experts = _JetMoEExperts(embed_dim, width, num_experts)
        self.kv_proj = nn.Linear(embed_dim, 2 * width, bias=False)

    def router_logits(self, x):
        """l [N, E] for token rows x [N, D]."""
        return self.experts.router.layer(x)

    def forward(self, x, key_padding_mask=None, causal=True, attn_bias=None, position_offset=0):
        B, T, D = x.shape
        E, k, G, d = self.num_experts, self.top_k, self.num_kv_heads, self.head_dim
        logits = self.router_logits(x.reshape(B * T, D))  # [N, E]
        kept = top_k_mask(logits, k)
        # Softmax over the k kept logits only; the other experts get exactly 0.
        gate = torch.softmax(logits.masked_fill(kept == 0, float("-inf")), dim=-1) * kept
        positions = torch.arange(position_offset, position_offset + T, device=x.device)
        # Every expert's queries (a slot's output depends only on its expert and token).
        q = torch.einsum("bti,eoi->bteo", x, self.experts.input_linear.weight)  # [B, T, E, G d]
        q = rope(q.reshape(B, T, E * G, d), self.rope_theta, positions).transpose(1, 2)
        keys, values = self.kv_proj(x).chunk(2, dim=-1)  # keys first
        keys = rope(keys.reshape(B, T, G, d), self.rope_theta, positions).transpose(1, 2)
        values = values.reshape(B, T, G, d).transpose(1, 2)  # [B, G, T, d]
        # Query head e * G + j (expert e, head j) reads key/value head j.
        keys, values = keys.repeat(1, E, 1, 1), values.repeat(1, E, 1, 1)
        o = attention(q, keys, values, causal, key_padding_mask, attn_bias)  # [B, E G, T, d]
        o = o.transpose(1, 2).reshape(B, T, E, G * d)
        out = torch.einsum("bteo,eio->btei", o, self.experts.output_linear.weight)  # [B, T, E, D]
        y = (out * gate.view(B, T, E, 1)).sum(dim=2) + self.experts.bias
        counts = kept.sum(dim=0)
        switch, z = _switch_z_losses(torch.softmax(logits, dim=-1), logits, counts)
        return JetMoEOutput(y, counts, switch, z)


# --- MoH-LLaMA: query-norm router, GQA, RoPE -------------------------------------------------------


class MoHLlamaOutput(NamedTuple):
    y: torch.Tensor          # [B, T, D]
    head_mask: torch.Tensor  # [B, T, H], 0/1


class MoHLlamaAttention(nn.Module):
    """LLaMA attention with MoH's parameter-free query-norm router (docs/semantics.md §4).

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

    def forward(self, x, key_padding_mask=None, causal=True, position_offset=0, attn_bias=None):
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
        o = attention(q, k, v, causal, key_padding_mask, attn_bias).transpose(1, 2)  # [B, T, H, d]
        o = (o * head_mask.unsqueeze(-1)).reshape(B, T, H * d)
        return MoHLlamaOutput(self.o_proj(o), head_mask)
