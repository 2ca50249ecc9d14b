"""Helpers shared by moh's Python tests: comparisons, random reference modules, torch references.

Tolerances: a float64 moh layer against a float64 torch module agrees to rounding (EXACT); a
float32 layer to FLOAT32 (relative to max(1, max|expected|), as tools/exporters.py checks); bfloat16
weights or caches to BF16.
"""

import math

import numpy as np

EXACT = 1e-9
FLOAT32 = 1e-4
BF16 = 3e-2


def as_np(a):
    """a (NumPy array, torch tensor or number) as a float64 / bool NumPy array."""
    try:
        import torch

        if torch.is_tensor(a):
            a = a.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(a)
    return a if a.dtype == bool else a.astype(np.float64)


def max_error(got, want):
    got, want = as_np(got), as_np(want)
    assert got.shape == want.shape, f"shape: expected {want.shape}, got {got.shape}"
    if got.size == 0:
        return 0.0
    return float(np.abs(got - want).max())


def assert_close(got, want, tol=EXACT, what="result"):
    """max|got - want| <= tol * max(1, max|want|), finite everywhere."""
    got, want = as_np(got), as_np(want)
    assert got.shape == want.shape, f"{what}: shape: expected {want.shape}, got {got.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite values in the result"
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    err = max_error(got, want)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:.1g} * {scale:.3g}"


def perturb(*tensors, mean=0.0, std=0.3):
    """Random values for parameters whose initial values would hide mistakes (ones, zeros)."""
    import torch

    with torch.no_grad():
        for t in tensors:
            t.normal_(mean, std)


def topk_margin(p, k):
    """Smallest gap between the k-th and (k+1)-th largest entry of any row of p [N, E]."""
    p = as_np(p)
    if k <= 0 or k >= p.shape[-1] or p.shape[0] == 0:
        return math.inf
    top = -np.sort(-p, axis=-1)
    return float((top[:, k - 1] - top[:, k]).min())


def padding_mask(B, T, side="right"):
    """[B, T] bool: sequence b pads min(b + 1, T - 1) tokens at its end (right) or start (left),
    as the golden-case exporter pads them."""
    from exporters import _padding_mask  # tools/exporters.py (conftest puts tools/ on the path)

    return _padding_mask(B, T, side).numpy()


def random_attn_bias(rng, shape, holes=True):
    """A random additive bias of `shape` [B|1, H|1, T, S] with some -inf entries (never a whole row)."""
    bias = rng.standard_normal(shape)
    if holes:
        T, S = shape[2], shape[3]
        i = np.arange(T).reshape(T, 1)
        j = np.arange(S).reshape(1, S)
        hole = ((i + 2 * j) % 5 == 3) & (j != i % S)  # every row keeps key i % S
        bias = np.where(hole, -np.inf, bias)
    return bias


def torch_mha(module, x, memory=None, key_padding_mask=None, causal=False, attn_bias=None,
              need_weights=False):
    """torch.nn.MultiheadAttention (batch_first) on NumPy / torch inputs, as moh is called:
    causal bottom-right aligned, attn_bias [B|1, H|1, T, S] added to the scores."""
    import torch

    def t(a):
        return None if a is None else (a if torch.is_tensor(a) else torch.from_numpy(np.asarray(a)))

    x, memory, kpm, bias = t(x), t(memory), t(key_padding_mask), t(attn_bias)
    kv = x if memory is None else memory
    B, T, S, H = x.shape[0], x.shape[1], kv.shape[1], module.num_heads
    future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    attn_mask = future if causal else None
    if bias is not None:
        attn_mask = bias.to(x.dtype).expand(B, H, T, S).reshape(B * H, T, S).clone()
        if causal:
            attn_mask = attn_mask.masked_fill(future, float("-inf"))
    # torch 1.13's fast path (no_grad) fails for bias=False modules: take the plain path.
    for p in module.parameters():
        p.requires_grad_(True)
    with torch.enable_grad():
        y, w = module(x, kv, kv, key_padding_mask=kpm, need_weights=need_weights,
                      attn_mask=attn_mask, average_attn_weights=False)
    y = y.detach().numpy()
    if need_weights:
        return y, w.detach().numpy()
    return y


def probs_reference(q, k, scale, causal=False, key_padding_mask=None, attn_bias=None):
    """softmax(q k^T * scale + bias + masks) for q [B, H, T, d], k [B, H|1, S, d] (torch) ->
    NumPy [B, H, T, S]; rows that see no key are zeros."""
    import torch

    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    B, H, T, S = scores.shape
    if attn_bias is not None:
        scores = scores + torch.as_tensor(attn_bias, dtype=scores.dtype)
    visible = torch.ones(B, H, T, S, dtype=torch.bool)
    if causal:
        i = torch.arange(T).view(T, 1)
        j = torch.arange(S).view(1, S)
        visible &= (j <= i + (S - T)).view(1, 1, T, S)
    if key_padding_mask is not None:
        visible &= ~torch.as_tensor(key_padding_mask).view(B, 1, 1, S)
    visible &= scores > float("-inf")
    anyv = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~anyv, 0.0)
    return (torch.softmax(scores, -1) * anyv).detach().numpy()
