"""moh: exact Mixture-of-Head and Mixture-of-Attention-heads layers whose cost follows the heads used.

The layers are moh's C++ layers (``moh._core``), with the same names and config fields as in C++::

    import numpy as np, moh
    config = moh.MoHConfig(embed_dim=256, num_heads=8, shared_heads=2, active_routed_heads=2)
    layer = moh.MoHAttention(config, seed=2)          # or moh.from_torch(trained_module)
    routing = moh.MoHRouting()
    y = layer(np.random.rand(2, 16, 256).astype(np.float32), routing=routing)
    routing.active_fraction()                         # 0.5: half of the heads per token

Inputs are NumPy arrays or CPU torch tensors ``[B, T, D]``; a C-contiguous one of the layer's dtype
(float32 by default, float64 with ``dtype="float64"``) is read where it lies, and the result has
the input's type. Options of a call are keyword arguments: ``key_padding_mask``, ``causal``,
``attn_bias``, ``need_weights`` / ``attention_weights``, ``grid``, ``mode``, ``position_offset``,
``query_padding_mask``, ``new_token_padding_mask``, ``routing``, ``threads`` / ``pool``, ``out``.
Every error of a call is a ``moh.Error``, a ``ValueError`` carrying the C++ message. Results carry
no autograd graph: moh computes inference only. ``layer.config`` is a copy (changing it changes
nothing); a KV cache or routing record is used by one call at a time (another thread's use while
a call runs is an error), while a layer serves any number of threads at once.
"""

from ._core import (  # noqa: F401  (the public API)
    CacheStorage,
    Causal,
    ComputeMode,
    Error,
    KvCache,
    MHAConfig,
    MoAConfig,
    MoAGating,
    MoANames,
    MoARouting,
    MoAAttention,
    MoHAttention,
    MoHConfig,
    MoHRouterKind,
    MoHRouting,
    MoHScores,
    MultiHeadAttention,
    ThreadPool,
    WeightStorage,
    input_copies,
    load_safetensors,
)
from .torch_interop import from_torch, state_dict_of  # noqa: F401


def _register_fork_handler():
    import os

    # A child made by fork() (multiprocessing, DataLoader workers) has none of the threads of the
    # pools behind threads=: it forgets them and makes its own. A moh.ThreadPool you made yourself
    # is in the same state there: make pools after forking.
    if hasattr(os, "register_at_fork"):
        from . import _core

        os.register_at_fork(after_in_child=_core._after_fork_in_child)


_register_fork_handler()


def save_safetensors(layer, path, prefix="", dtype="float32"):
    """Writes ``layer``'s weights under the authors' fused names (qkv, proj, in_proj_weight, ...)
    and its config to ``path``; ``moh.load_safetensors(path)`` rebuilds the layer. For a PyTorch
    module under other names (LLaMA's q_proj, ...), use ``moh.state_dict_of(layer,
    layout="split")``."""
    layer.save_safetensors(path, prefix, dtype)


__all__ = [
    "CacheStorage", "Causal", "ComputeMode", "Error", "KvCache", "MHAConfig", "MoAConfig",
    "MoAGating", "MoANames", "MoARouting", "MoAAttention", "MoHAttention", "MoHConfig",
    "MoHRouterKind", "MoHRouting", "MoHScores", "MultiHeadAttention", "ThreadPool",
    "WeightStorage", "from_torch", "input_copies", "load_safetensors", "save_safetensors",
    "state_dict_of",
]
