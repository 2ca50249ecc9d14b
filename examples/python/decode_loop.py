#!/usr/bin/env python3
"""A small decoder generating greedily with a KV cache, moh's MoH attention in NumPy user code:
an embedding table, 2 layers of x = x + MoH(RMSNorm(x)); x = x + MLP(RMSNorm(x)), and the
output head tied to the embedding. The prompt goes in one forward_cached call, then one token
per call; the logits are then checked against one causal forward over the whole sequence.

    PYTHONPATH=build-py/python /usr/bin/python3 examples/python/decode_loop.py
"""
import os
import sys
import time

import numpy as np

try:
    import moh
except ImportError:  # not on PYTHONPATH: look in the repository's build folders
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.path[:0] = [os.path.join(root, b, "python") for b in ("build", "build-py")]
    import moh

VOCAB, D, LAYERS, PROMPT, NEW = 512, 256, 2, 12, 32

# MoH-LLaMA3 attention (MoHConfig.moh_llama3, the released model's split at a small size): 8
# query heads of 32 over 2 key/value heads (grouped-query), RoPE, no biases; heads 0-3 shared,
# the parameter-free query-norm router keeps the 2 of heads 4-7 with the largest query norms per
# token: 6 of 8 heads per token.
config = moh.MoHConfig.moh_llama3(D, 8, 2)
rng = np.random.default_rng(0)
embed = 0.3 * rng.standard_normal((VOCAB, D), dtype=np.float32)  # also the output head (tied)
layers = [dict(attn=moh.MoHAttention(config, seed=i),  # seeded stand-ins for a checkpoint
               up=rng.uniform(-1, 1, (4 * D, D)).astype(np.float32) / np.sqrt(D),
               down=rng.uniform(-1, 1, (D, 4 * D)).astype(np.float32) / np.sqrt(4 * D))
          for i in range(LAYERS)]
used = [np.zeros(config.num_heads, np.int64) for _ in layers]  # tokens per head, per layer


def rms_norm(x, eps=1e-6):  # weight 1
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def forward(tokens, caches=None):
    """Logits [T, VOCAB] of `tokens`: appended to `caches` (one per layer), or, without caches,
    one causal self-attention call over all of them."""
    x = embed[tokens][None]  # [1, T, D]
    for i, layer in enumerate(layers):
        h = rms_norm(x)
        if caches is None:
            x = x + layer["attn"](h, causal=True)
        else:  # causal over the cached keys and the new ones; RoPE continues at cache length
            routing = moh.MoHRouting()
            x = x + layer["attn"].forward_cached(h, caches[i], routing=routing)
            used[i] += routing.head_counts
        u = rms_norm(x) @ layer["up"].T
        x = x + (u / (1 + np.exp(-u))) @ layer["down"].T  # SiLU MLP
    return rms_norm(x)[0] @ embed.T


def pick(row, previous):  # greedy, except that a token never directly repeats itself
    return int(np.argmax(np.where(np.arange(VOCAB) == previous, -np.inf, row)))


prompt = rng.integers(0, VOCAB, PROMPT)
caches = [layer["attn"].make_cache(1, PROMPT + NEW) for layer in layers]  # batch 1
# (NumPy's MLP and output products take most of the time measured below.)
start = time.perf_counter()
logits = [forward(prompt, caches)]  # the prompt: one call
prefill_s = time.perf_counter() - start
generated = [pick(logits[-1][-1], prompt[-1])]
start = time.perf_counter()
while len(generated) < NEW:  # then one token per call, greedy
    logits.append(forward(np.array(generated[-1:]), caches))
    generated.append(pick(logits[-1][-1], generated[-1]))
decode_s = time.perf_counter() - start

print(f"prompt   {prompt.tolist()}")
print(f"decoded  {generated}")
print(f"prefill: {PROMPT} tokens in {1e3 * prefill_s:.2f} ms; decode: {NEW - 1} steps, "
      f"{(NEW - 1) / decode_s:.0f} tokens/s; cache {caches[0].length()} tokens per layer")
for i, counts in enumerate(used):
    tokens = caches[i].length()
    print(f"layer {i}: {counts.sum() / tokens:.1f} of {config.num_heads} heads per token; "
          f"tokens per head {counts.tolist()} (heads 0-3 shared)")

# The same sequence in one causal forward, no cache: the same logits at every position.
sequence = np.concatenate([prompt, generated[:-1]])
full = forward(sequence)
diff = np.abs(full - np.concatenate(logits)).max()
same = [pick(full[t], sequence[t]) for t in range(PROMPT - 1, len(sequence))] == generated
print(f"cached decode vs one causal forward: max |logit diff| = {diff:.2e}, "
      f"greedy tokens {'identical' if same else 'DIFFERENT'}")
sys.exit(0 if diff < 1e-3 and same else 1)
