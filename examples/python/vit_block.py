#!/usr/bin/env python3
"""MoH-ViT stage-4 block in user code, NumPy around moh's attention, on a 7x7 token grid:
x = x + MoH(LayerNorm(x)); x = x + fc2(GELU(fc1(LayerNorm(x)))).

    PYTHONPATH=build-py/python /usr/bin/python3 examples/python/vit_block.py
"""
import os
import sys

import numpy as np

try:
    import moh
except ImportError:  # not on PYTHONPATH: look in the repository's build folders
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.path[:0] = [os.path.join(root, b, "python") for b in ("build", "build-py")]
    import moh

GRID, BATCH, D, H = 7, 4, 384, 12
T = GRID * GRID  # tokens in row-major grid order (a 224 px image at stride 32)

# MoH-ViT's last-stage attention: cosine attention with a continuous position bias, 3 shared
# heads always on, the router picks 6 of the 9 others per token (9 of 12 heads = 75%).
# Seeded weights stand in for a checkpoint; a trained PyTorch module converts with
# moh.from_torch(tools/moh_modules.MoHViTAttention(...)), or load a file with load_safetensors.
attn = moh.MoHAttention(moh.MoHConfig.vit(D, H, 3, 6, GRID, GRID), seed=2024)

# The MLP (hidden 4 D), with torch.nn.Linear's init U(-1/sqrt(in), 1/sqrt(in)).
rng = np.random.default_rng(0)
fc1_w, fc1_b, fc2_w, fc2_b = (
    rng.uniform(-b, b, shape).astype(np.float32)
    for shape, b in [((4 * D, D), D**-0.5), (4 * D, D**-0.5), ((D, 4 * D), (4 * D)**-0.5),
                     (D, (4 * D)**-0.5)])


def layer_norm(x, eps=1e-6):  # weight 1, bias 0 (MoH-ViT's eps)
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def gelu(x):  # tanh approximation (NumPy has no erf)
    return 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))


def block(x, routing=None):
    # The attention reads the float32 [B, T, D] array in place; grid= gives the position bias.
    x = x + attn(layer_norm(x), grid=(GRID, GRID), routing=routing)
    return x + gelu(layer_norm(x) @ fc1_w.T + fc1_b) @ fc2_w.T + fc2_b


x = rng.standard_normal((BATCH, T, D), dtype=np.float32)
routing = moh.MoHRouting()  # filled by the call: which heads each token used, and its gates
y = block(x, routing)
print(f"block: {BATCH} images x {GRID}x{GRID} tokens, D={D} -> {y.shape} {y.dtype}, "
      f"norm {np.linalg.norm(y):.1f}")

# Head usage: each head's share of tokens and its mean gate where used (heads 0-2 shared).
counts = routing.head_counts
mean_gate = routing.gates.sum(0) / np.maximum(counts, 1)
print(f"heads used: {100 * routing.active_fraction():.0f}% of (token, head) pairs, load-balance "
      f"loss {routing.load_balance_loss:.3f} (balanced: {attn.config.active_routed_heads})")
print("  head      " + "".join(f"{h:6d}" for h in range(H)))
print("  tokens %  " + "".join(f"{100 * c / (BATCH * T):6.0f}" for c in counts))
print("  mean gate " + "".join(f"{g:6.2f}" for g in mean_gate))

# The sparse path (only the heads each token uses) against the dense reference (every head).
n = layer_norm(x)
diff = np.abs(attn(n, grid=(GRID, GRID)) - attn(n, grid=(GRID, GRID), mode="dense")).max()
print(f"attention: max |sparse - dense| = {diff:.2e}")

# Probabilities [B, H, T, T] (rows of heads a token does not use are 0): the centre token of
# image 0, for the last head it uses. Seeded weights give no spatial pattern; trained ones do.
_, probs = attn(n, grid=(GRID, GRID), need_weights=True, routing=routing)
query = (GRID // 2) * GRID + GRID // 2
head = routing.heads_of(0, query)[-1]
print(f"attention of token {query} (row {GRID // 2}, column {GRID // 2}), head {head}:")
for row in probs[0, head, query].reshape(GRID, GRID):
    print("  " + " ".join(f"{p:.3f}" for p in row))
sys.exit(0 if diff < 1e-4 else 1)
