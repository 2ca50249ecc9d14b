"""Turn PyTorch attention modules into moh-case/1 golden cases, and check cases against torch.

export_mha, export_moh, export_moh_vit, export_moa, export_jetmoe and export_moh_llama write a
case for a given module and input: its weights under their PyTorch names, x [B, T, D] and the
optional inputs (memory, key_padding_mask, attn_bias, query_padding_mask), the expected outputs
(computed in float64 from the float32 values that go into the file) and the metadata that moh's
C++ side needs to rebuild the layer. export_random builds a seeded random layer and input and
exports it; verify_case and verify_fixtures run the torch modules on existing cases; roundtrip
exports ROUNDTRIP_CASES (and, asked to, FAMILY_CASES) and runs moh_parity on them. The file
format is written by safetensors_io.py; export_torch.py is the command line over all of this.

Only the standard library and torch are used (no safetensors, no numpy).
"""

import copy
import glob
import math
import os
import subprocess
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moh_modules import (  # noqa: E402
    JetMoEAttention,
    MoAAttention,
    MoHAttention,
    MoHLlamaAttention,
    MoHViTAttention,
    mha_reference,
)
from safetensors_io import CaseError, read_safetensors, write_safetensors  # noqa: E402

__all__ = [
    "export_mha",
    "export_moh",
    "export_moh_vit",
    "export_moa",
    "export_jetmoe",
    "export_moh_llama",
    "export_random",
    "verify_case",
    "verify_fixtures",
    "roundtrip",
]

FORMAT = "moh-case/1"
LAYERS = ("mha", "moh", "moh_vit", "moa", "jetmoe", "moh_llama")
# The input tensors a case may hold besides the weights (FIXTURES.md).
INPUTS = ("x", "key_padding_mask", "memory", "attn_bias", "query_padding_mask")
# Expected outputs a case of the layer may leave out (jetmoe: the losses with decode_from).
OPTIONAL_OUTPUTS = {"moa": ("cv_loss",), "jetmoe": ("switch_loss", "z_loss")}
# Layers whose attn_bias has one head row for every head (the head dimension of M is 1).
_SINGLE_BIAS_HEAD = ("moa", "jetmoe")
# A computed tensor c passes against the expected e when max|c - e| <= TOLERANCE * max(1, max|e|).
TOLERANCE = 1e-4
# Routing decisions closer than this (in probability) may go the other way in float32.
FRAGILE_MARGIN = 1e-5


# --- inputs and the float64 copy -------------------------------------------------------------------


def _as_mask(name, value, shape):
    """value as a bool CPU tensor of the given shape (bool or 0/1 values accepted)."""
    mask = torch.as_tensor(value).detach().cpu()
    if list(mask.shape) != list(shape):
        raise CaseError(f"{name}: expected {list(shape)}, got {list(mask.shape)}")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise CaseError(f"{name}: expected bool or 0/1 values")
        mask = mask.to(torch.bool)
    return mask


def _check_input(x, embed_dim, key_padding_mask=None, memory=None, memory_dim=None,
                 attn_bias=None, bias_heads=1, query_padding_mask=None):
    """The case's inputs as {name: CPU tensor} (float32 or bool), checked against FIXTURES.md.

    x [B, T, D]; memory [B, S, memory_dim] (cross-attention, else S = T); key_padding_mask
    [B, S]; attn_bias [B|1, bias_heads|1, T, S] (finite or -inf); query_padding_mask [B, T].
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CaseError(f"x: expected a float tensor [B, T, {embed_dim}], got {got}")
    if x.shape[2] != embed_dim or x.shape[0] < 1 or x.shape[1] < 1:
        raise CaseError(f"x: expected [B >= 1, T >= 1, {embed_dim}], got {list(x.shape)}")
    x = x.detach().cpu().to(torch.float32).contiguous()
    B, T = x.shape[0], x.shape[1]
    inputs = {"x": x}
    S = T
    if memory is not None:
        width = embed_dim if memory_dim is None else memory_dim
        if (not isinstance(memory, torch.Tensor) or memory.dim() != 3 or not memory.is_floating_point()
                or memory.shape[0] != B or memory.shape[1] < 1 or memory.shape[2] != width):
            got = list(memory.shape) if isinstance(memory, torch.Tensor) else type(memory).__name__
            raise CaseError(f"memory: expected a float tensor [{B}, S >= 1, {width}], got {got}")
        inputs["memory"] = memory.detach().cpu().to(torch.float32).contiguous()
        S = memory.shape[1]
    if key_padding_mask is not None:
        inputs["key_padding_mask"] = _as_mask("key_padding_mask", key_padding_mask, [B, S])
    if attn_bias is not None:
        bias = torch.as_tensor(attn_bias).detach().cpu()
        heads = "1" if bias_heads == 1 else f"{bias_heads}|1"
        expected = f"[{B}|1, {heads}, {T}, {S}]"
        if (bias.dim() != 4 or not bias.is_floating_point() or bias.shape[0] not in (1, B)
                or bias.shape[1] not in (1, bias_heads) or bias.shape[2] != T or bias.shape[3] != S):
            raise CaseError(f"attn_bias: expected a float tensor {expected}, got "
                            f"{list(bias.shape)} {bias.dtype}")
        bias = bias.to(torch.float32).contiguous()
        if bool(torch.isnan(bias).any() | (bias == float("inf")).any()):
            raise CaseError("attn_bias: expected finite values or -inf (in float32), got NaN or +inf")
        inputs["attn_bias"] = bias
    if query_padding_mask is not None:
        inputs["query_padding_mask"] = _as_mask("query_padding_mask", query_padding_mask, [B, T])
    return inputs


def _float64(module):
    """A float64 eval-mode copy of module whose weights are the float32-rounded originals."""
    return copy.deepcopy(module).cpu().float().double().eval()


def _weights(module, names):
    """The named parameters as float32 CPU tensors; names must be exactly the module's state dict."""
    state = module.state_dict()
    if sorted(state) != sorted(names):
        raise CaseError(f"{type(module).__name__} weights: expected {sorted(names)}, got {sorted(state)}")
    return {name: state[name].detach().cpu().to(torch.float32) for name in names}


def _visible(B, H, T, S, mask, causal, attn_bias):
    """[B, H, T, S] bool: which key each query of each head sees (causal, padding, -inf bias)."""
    visible = torch.ones(B, H, T, S, dtype=torch.bool)
    if causal:
        i = torch.arange(T).view(T, 1)
        j = torch.arange(S).view(1, S)
        visible &= j <= i + (S - T)
    if mask is not None:
        visible &= ~mask.view(B, 1, 1, S)
    if attn_bias is not None:
        visible &= (attn_bias > float("-inf")).expand(B, H, T, S)
    return visible


def _topk_margin(p, k):
    """Smallest gap between the k-th and (k+1)-th largest entry of any row of p [N, E]."""
    if k <= 0 or k >= p.shape[-1] or p.shape[0] == 0:
        return math.inf
    top = torch.sort(p, dim=-1, descending=True).values
    return float((top[:, k - 1] - top[:, k]).min())


def _warn_fragile(what, margin):
    if margin < FRAGILE_MARGIN:
        print(f"export_torch: warning: {what}: a routing decision is within {margin:.2g} of a tie; "
              "float32 may choose differently (try another seed or input)", file=sys.stderr)


# --- what each layer outputs (shared by export and verification) ---------------------------------
# Each takes (float64 module, {input name: float64 or bool tensor}, causal, metadata) and returns
# {expected tensor name: float64 tensor}.


def _mha_outputs(module, inputs, causal, meta):
    """y of a float64 torch.nn.MultiheadAttention, checked against docs/semantics.md."""
    x, memory = inputs["x"], inputs.get("memory")
    mask, bias = inputs.get("key_padding_mask"), inputs.get("attn_bias")
    kv = x if memory is None else memory
    B, T, _ = x.shape
    S, H = kv.shape[1], module.num_heads
    inp, kv_inp = (x, kv) if module.batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
    # torch masks where the bool mask is True: key j for query i when j > i + (S - T).
    future = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    attn_mask = future if causal else None
    if bias is not None:
        attn_mask = bias.expand(B, H, T, S).reshape(B * H, T, S).clone()
        if causal:
            attn_mask = attn_mask.masked_fill(future, float("-inf"))
    # With grad enabled (and parameters that require it) torch 1.13 takes the plain path; its
    # "fast path" under no_grad fails outright for bias=False modules.
    for param in module.parameters():
        param.requires_grad_(True)
    with torch.enable_grad():
        y = module(inp, kv_inp, kv_inp, key_padding_mask=mask, need_weights=False,
                   attn_mask=attn_mask)[0]
    with torch.no_grad():
        y = y.detach().clone()
        if not module.batch_first:
            y = y.transpose(0, 1)
        reference = mha_reference(x, module.in_proj_weight, module.in_proj_bias,
                                  module.out_proj.weight, module.out_proj.bias, H, module.head_dim,
                                  causal, mask, memory, bias)
        # torch gives NaN for a whole row where any head's query sees no key; docs/semantics.md says
        # that head's attention output is zero, which the reference computes.
        blind = (~_visible(B, H, T, S, mask, causal, bias).any(dim=-1)).any(dim=1)  # [B, T]
        y[blind] = reference[blind]
    if not torch.isfinite(y).all():
        raise CaseError("torch.nn.MultiheadAttention returned non-finite values outside the rows "
                        "that see no key")
    error = float((y - reference).abs().max())
    if error > 1e-9 * max(1.0, float(reference.abs().max())):
        raise CaseError(f"torch.nn.MultiheadAttention and docs/semantics.md §2 disagree by {error:.3g}")
    return {"y": y}


def _warn_moh_router(module, x):
    if module.wg is not None:
        p = torch.softmax(module.wg(x.reshape(-1, x.shape[2])), dim=-1)
        _warn_fragile("moh router", _topk_margin(p, module.active_routed_heads))


def _moh_outputs(module, inputs, causal, meta):
    with torch.no_grad():
        x = inputs["x"]
        out = module(x, key_padding_mask=inputs.get("key_padding_mask"), causal=causal,
                     memory=inputs.get("memory"), attn_bias=inputs.get("attn_bias"))
        _warn_moh_router(module, x)
    return {"y": out.y, "gates": out.gates, "aux_loss": out.aux_loss.reshape(1)}


def _moh_vit_outputs(module, inputs, causal, meta):
    with torch.no_grad():
        x = inputs["x"]
        grid = (int(meta["grid_h"]), int(meta["grid_w"]))
        out = module(x, grid, key_padding_mask=inputs.get("key_padding_mask"), causal=causal,
                     attn_bias=inputs.get("attn_bias"))
        _warn_moh_router(module, x)
    return {"y": out.y, "gates": out.gates, "aux_loss": out.aux_loss.reshape(1)}


def _moa_outputs(module, inputs, causal, meta):
    with torch.no_grad():
        x, qpm = inputs["x"], inputs.get("query_padding_mask")
        out = module(x, key_padding_mask=inputs.get("key_padding_mask"), causal=causal,
                     memory=inputs.get("memory"), attn_bias=inputs.get("attn_bias"),
                     query_padding_mask=qpm)
        p = torch.softmax(x.reshape(-1, x.shape[2]) @ module.q_proj.w_gate, dim=-1)
        if qpm is not None:
            p = p[~qpm.reshape(-1)]
        _warn_fragile("moa router", _topk_margin(p, module.top_k))
    return {"y": out.y, "expert_counts": out.expert_counts,
            "switch_loss": out.switch_loss.reshape(1), "z_loss": out.z_loss.reshape(1),
            "cv_loss": out.cv_loss.reshape(1)}


def _jetmoe_outputs(module, inputs, causal, meta):
    with torch.no_grad():
        x = inputs["x"]
        out = module(x, key_padding_mask=inputs.get("key_padding_mask"), causal=causal,
                     attn_bias=inputs.get("attn_bias"))
        p = torch.softmax(module.router_logits(x.reshape(-1, x.shape[2])), dim=-1)
        _warn_fragile("jetmoe router", _topk_margin(p, module.top_k))
    expected = {"y": out.y, "expert_counts": out.expert_counts}
    if "decode_from" not in meta:  # the losses of a decoded case are per call: not stored
        expected.update(switch_loss=out.switch_loss.reshape(1), z_loss=out.z_loss.reshape(1))
    return expected


def _moh_llama_outputs(module, inputs, causal, meta):
    with torch.no_grad():
        x = inputs["x"]
        out = module(x, key_padding_mask=inputs.get("key_padding_mask"), causal=causal,
                     attn_bias=inputs.get("attn_bias"))
        S, H, d = module.shared_heads, module.num_heads, module.head_dim
        norms = module.q_proj(x).view(-1, H, d)[:, S:, :].norm(dim=-1)
        if norms.shape[1] > 1:
            # The decision is made on norms; compare the gap relative to their size.
            _warn_fragile("query-norm router", _topk_margin(norms / norms.max(), module.active_routed_heads))
    return {"y": out.y, "head_mask": out.head_mask}


_OUTPUTS = {"mha": _mha_outputs, "moh": _moh_outputs, "moh_vit": _moh_vit_outputs,
            "moa": _moa_outputs, "jetmoe": _jetmoe_outputs, "moh_llama": _moh_llama_outputs}


def _export(path, layer, module, weight_names, inputs, causal, metadata):
    """Computes the expected outputs with a float64 copy of module and writes the case."""
    meta = {"format": FORMAT, "layer": layer, "causal": "1" if causal else "0"}
    meta.update({k: str(v) for k, v in metadata.items()})
    module64 = _float64(module)
    inputs64 = {name: t.double() if t.is_floating_point() else t for name, t in inputs.items()}
    expected = _OUTPUTS[layer](module64, inputs64, causal, meta)
    tensors = _weights(module, weight_names)
    tensors.update(inputs)
    for name, value in expected.items():
        if not torch.isfinite(value).all():
            raise CaseError(f"expected output '{name}' is not finite")
        tensors[name] = value.to(torch.float32)
    write_safetensors(path, tensors, meta)
    return expected


def _check_decode_from(decode_from, T, causal, inputs):
    if not isinstance(decode_from, int) or isinstance(decode_from, bool) or not 0 <= decode_from <= T:
        raise CaseError(f"decode_from: expected an integer in 0..{T} (tokens), got {decode_from!r}")
    if not causal:
        raise CaseError("decode_from: token-by-token decoding equals the full sequence only "
                        "with causal=True, got causal=False")
    if "attn_bias" in inputs:
        raise CaseError("decode_from with attn_bias: FIXTURES.md does not say how a bias [T, S] "
                        "splits over the decoding calls; export the bias without decode_from")


def _moh_flags(module):
    """qkv_bias and qk_norm metadata where they differ from the defaults (1 and 0)."""
    flags = {}
    if not module.qkv_bias:
        flags["qkv_bias"] = 0
    if module.qk_norm:
        flags["qk_norm"] = 1
    return flags


# --- export_* ------------------------------------------------------------------------------------


def export_mha(module, x, path, key_padding_mask=None, causal=False, memory=None, attn_bias=None):
    """Writes a `mha` case for a torch.nn.MultiheadAttention.

    x is [B, T, D] (batch first) whatever module.batch_first says; the module is called in its
    own layout. memory [B, S, D] makes it cross-attention; key_padding_mask [B, S] (True =
    padding); causal masks later keys (bottom-right aligned); attn_bias [B|1, H|1, T, S] is
    added to the scores. Returns the expected outputs {"y": [B, T, D] float64}.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise CaseError(f"export_mha: expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise CaseError(f"export_mha: kdim and vdim must equal embed_dim ({module.embed_dim}), "
                        f"got kdim={module.kdim}, vdim={module.vdim}")
    if module.bias_k is not None or module.add_zero_attn:
        raise CaseError("export_mha: add_bias_kv and add_zero_attn are not part of moh-case/1")
    inputs = _check_input(x, module.embed_dim, key_padding_mask, memory, module.embed_dim,
                          attn_bias, module.num_heads)
    names = ["in_proj_weight", "out_proj.weight"]
    if module.in_proj_bias is not None:
        names += ["in_proj_bias", "out_proj.bias"]
    return _export(path, "mha", module, names, inputs, causal,
                   {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
                    "head_dim": module.head_dim})


def export_moh(module, x, path, key_padding_mask=None, causal=False, memory=None, attn_bias=None):
    """Writes a `moh` case for a moh_modules.MoHAttention (a trained MoH ViT/DiT attention's
    state dict loads into one; qkv_bias, qk_norm and the dense S_h = H, K = 0 variant included).

    x [B, T, D]; memory [B, S, D] for cross-attention; key_padding_mask [B, S]; attn_bias
    [B|1, H|1, T, S]. Returns {"y", "gates", "aux_loss"} in float64.
    """
    if not isinstance(module, MoHAttention):
        raise CaseError(f"export_moh: expected moh_modules.MoHAttention, got {type(module).__name__}")
    inputs = _check_input(x, module.embed_dim, key_padding_mask, memory, module.embed_dim,
                          attn_bias, module.num_heads)
    meta = {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
            "head_dim": module.head_dim, "shared_heads": module.shared_heads,
            "active_routed_heads": module.active_routed_heads}
    meta.update(_moh_flags(module))
    return _export(path, "moh", module, list(module.state_dict()), inputs, causal, meta)


def _parse_grid(grid, what="grid"):
    """(h, w) from a pair or an 'HxW' string."""
    try:
        if isinstance(grid, str):
            h, w = (int(s) for s in grid.lower().split("x"))
        else:
            h, w = (int(s) for s in grid)
    except (TypeError, ValueError):
        raise CaseError(f"{what}: expected (h, w) or 'HxW', got {grid!r}") from None
    return h, w


def export_moh_vit(module, x, path, grid, key_padding_mask=None, causal=False, attn_bias=None):
    """Writes a `moh_vit` case for a moh_modules.MoHViTAttention (docs/semantics.md §8).

    x [B, h w, D] holds the grid (h, w) = grid (a pair or 'HxW') in row-major order; the
    module's pretrain_grid and train_tokens go into the metadata. attn_bias [B|1, H|1, T, T] is
    added to the scores and the position bias. Returns {"y", "gates", "aux_loss"} in float64.
    """
    if not isinstance(module, MoHViTAttention):
        raise CaseError(f"export_moh_vit: expected moh_modules.MoHViTAttention, "
                        f"got {type(module).__name__}")
    h, w = _parse_grid(grid)
    inputs = _check_input(x, module.embed_dim, key_padding_mask, None, None, attn_bias,
                          module.num_heads)
    T = inputs["x"].shape[1]
    if h < 1 or w < 1 or h * w != T:
        raise CaseError(f"grid: expected h x w = {T} tokens (x), got {h}x{w}")
    h0, w0 = module.pretrain_grid
    meta = {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
            "head_dim": module.head_dim, "shared_heads": module.shared_heads,
            "active_routed_heads": module.active_routed_heads, "grid_h": h, "grid_w": w,
            "pretrain_h": h0, "pretrain_w": w0, "train_tokens": module.train_tokens}
    meta.update(_moh_flags(module))
    return _export(path, "moh_vit", module, list(module.state_dict()), inputs, causal, meta)


def export_moa(module, x, path, key_padding_mask=None, causal=False, memory=None, attn_bias=None,
               query_padding_mask=None):
    """Writes a `moa` case for a moh_modules.MoAAttention. x [B, T, D].

    memory [B, S, module.kdim] is cross-attention (kdim goes into the metadata); without it
    kdim must be D. key_padding_mask [B, S]; attn_bias [B|1, 1, T, S]; query_padding_mask
    [B, T] (True = a padding query that routes nothing). Returns {"y", "expert_counts",
    "switch_loss", "z_loss", "cv_loss"} in float64.
    """
    if not isinstance(module, MoAAttention):
        raise CaseError(f"export_moa: expected moh_modules.MoAAttention, got {type(module).__name__}")
    if memory is None and module.kdim != module.embed_dim:
        raise CaseError(f"export_moa: self-attention needs kdim = embed_dim ({module.embed_dim}), "
                        f"got kdim={module.kdim}; pass a memory [B, S, {module.kdim}]")
    inputs = _check_input(x, module.embed_dim, key_padding_mask, memory, module.kdim, attn_bias,
                          1, query_padding_mask)
    meta = {"embed_dim": module.embed_dim, "head_dim": module.head_dim,
            "num_experts": module.num_experts, "top_k": module.top_k}
    if memory is not None:
        meta["kdim"] = module.kdim
    names = ["q_proj.experts.w", "q_proj.output_experts.w", "q_proj.w_gate", "k_proj.weight",
             "v_proj.weight"]
    return _export(path, "moa", module, names, inputs, causal, meta)


def export_jetmoe(module, x, path, key_padding_mask=None, causal=True, attn_bias=None,
                  decode_from=None):
    """Writes a `jetmoe` case for a moh_modules.JetMoEAttention (a Hugging Face JetMoE layer's
    self_attention state dict loads into one). x [B, T, D], positions 0..T-1.

    key_padding_mask [B, T]; attn_bias [B|1, 1, T, T]; decode_from = P asks the C++ side to run
    tokens 0..P-1 as one prompt and every later token through its KV cache (needs causal; the
    per-call losses are then not stored). Returns {"y", "expert_counts"[, "switch_loss",
    "z_loss"]} in float64.
    """
    if not isinstance(module, JetMoEAttention):
        raise CaseError(f"export_jetmoe: expected moh_modules.JetMoEAttention, "
                        f"got {type(module).__name__}")
    inputs = _check_input(x, module.embed_dim, key_padding_mask, None, None, attn_bias, 1)
    meta = {"embed_dim": module.embed_dim, "head_dim": module.head_dim,
            "num_kv_heads": module.num_kv_heads, "num_experts": module.num_experts,
            "top_k": module.top_k, "rope_theta": repr(float(module.rope_theta))}
    if decode_from is not None:
        _check_decode_from(decode_from, inputs["x"].shape[1], causal, inputs)
        meta["decode_from"] = decode_from
    names = ["experts.input_linear.weight", "experts.output_linear.weight",
             "experts.router.layer.weight", "experts.bias", "kv_proj.weight"]
    return _export(path, "jetmoe", module, names, inputs, causal, meta)


def export_moh_llama(module, x, path, key_padding_mask=None, causal=True, decode_from=None,
                     attn_bias=None):
    """Writes a `moh_llama` case for a moh_modules.MoHLlamaAttention. x [B, T, D], positions 0..T-1.

    decode_from = P asks the C++ side to run tokens 0..P-1 as one prompt and every later token
    through its KV cache (needs causal). attn_bias [B|1, H|1, T, T] (not with decode_from).
    Returns {"y", "head_mask"} in float64.
    """
    if not isinstance(module, MoHLlamaAttention):
        raise CaseError(f"export_moh_llama: expected moh_modules.MoHLlamaAttention, "
                        f"got {type(module).__name__}")
    inputs = _check_input(x, module.embed_dim, key_padding_mask, None, None, attn_bias,
                          module.num_heads)
    meta = {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
            "head_dim": module.head_dim, "num_kv_heads": module.num_kv_heads,
            "shared_heads": module.shared_heads, "active_routed_heads": module.active_routed_heads,
            "rope_theta": repr(float(module.rope_theta))}
    if decode_from is not None:
        _check_decode_from(decode_from, inputs["x"].shape[1], causal, inputs)
        meta["decode_from"] = decode_from
    return _export(path, "moh_llama", module,
                   ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"],
                   inputs, causal, meta)


# --- verification of existing cases ----------------------------------------------------------------


def _meta_int(meta, key, path):
    try:
        return int(meta[key])
    except KeyError:
        raise CaseError(f"{path}: metadata '{key}' missing") from None
    except ValueError:
        raise CaseError(f"{path}: metadata '{key}': expected an integer, got '{meta[key]}'") from None


def _meta_flag(meta, key, path, default):
    """A 0/1 metadata flag; default (a bool) when the key is absent."""
    if key not in meta:
        return default
    if meta[key] not in ("0", "1"):
        raise CaseError(f"{path}: metadata '{key}': expected 0 or 1, got '{meta[key]}'")
    return meta[key] == "1"


def _meta_float(meta, key, path):
    try:
        return float(meta[key])
    except KeyError:
        raise CaseError(f"{path}: metadata '{key}' missing") from None
    except ValueError:
        raise CaseError(f"{path}: metadata '{key}': expected a number, got '{meta[key]}'") from None


def _case_module(layer, meta, tensors, path):
    """(weight names, compute(inputs, causal, meta)) of the float64 torch layer of a case file."""
    D = _meta_int(meta, "embed_dim", path)
    d = _meta_int(meta, "head_dim", path)
    if layer == "mha":
        H = _meta_int(meta, "num_heads", path)
        bias = "in_proj_bias" in tensors
        if H * d == D:
            module = nn.MultiheadAttention(D, H, bias=bias, batch_first=True)
        else:  # torch.nn.MultiheadAttention cannot have head_dim != D / H; use the formula alone.
            names = [n for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
                     if n in tensors]
            w = {n: tensors[n].double() for n in names}
            return names, lambda inputs, causal, meta: {"y": mha_reference(
                inputs["x"], w.get("in_proj_weight"), w.get("in_proj_bias"), w.get("out_proj.weight"),
                w.get("out_proj.bias"), H, d, causal, inputs.get("key_padding_mask"),
                inputs.get("memory"), inputs.get("attn_bias"))}
    elif layer in ("moh", "moh_vit"):
        H = _meta_int(meta, "num_heads", path)
        split = (_meta_int(meta, "shared_heads", path), _meta_int(meta, "active_routed_heads", path))
        # Without the metadata, the file's tensors tell (FIXTURES.md defaults: qkv_bias 1, qk_norm 0).
        qkv_bias = _meta_flag(meta, "qkv_bias", path, "qkv.bias" in tensors)
        qk_norm = _meta_flag(meta, "qk_norm", path, "q_norm.weight" in tensors)
        try:
            if layer == "moh":
                module = MoHAttention(D, H, d, *split, qkv_bias=qkv_bias, qk_norm=qk_norm)
            else:
                if H * d != D:
                    raise CaseError(f"{path}: moh_vit: expected head_dim = embed_dim / num_heads = "
                                    f"{D // H if H else '?'}, got {d}")
                pretrain = (_meta_int(meta, "pretrain_h", path), _meta_int(meta, "pretrain_w", path))
                module = MoHViTAttention(D, H, pretrain, _meta_int(meta, "train_tokens", path), *split,
                                         qkv_bias=qkv_bias, qk_norm=qk_norm)
        except CaseError:
            raise
        except ValueError as e:
            raise CaseError(f"{path}: {e}") from None
    elif layer == "moa":
        kdim = _meta_int(meta, "kdim", path) if "kdim" in meta else D
        module = MoAAttention(D, d, _meta_int(meta, "num_experts", path), _meta_int(meta, "top_k", path),
                              kdim)
    elif layer == "jetmoe":
        module = JetMoEAttention(D, d, _meta_int(meta, "num_kv_heads", path),
                                 _meta_int(meta, "num_experts", path), _meta_int(meta, "top_k", path),
                                 _meta_float(meta, "rope_theta", path))
    elif layer == "moh_llama":
        module = MoHLlamaAttention(D, _meta_int(meta, "num_heads", path), d,
                                   _meta_int(meta, "num_kv_heads", path),
                                   _meta_int(meta, "shared_heads", path),
                                   _meta_int(meta, "active_routed_heads", path),
                                   _meta_float(meta, "rope_theta", path))
    else:
        raise CaseError(f"{path}: layer: expected one of {', '.join(LAYERS)}, got '{layer}'")
    state = module.state_dict()
    names = list(state)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CaseError(f"{path}: weights missing for layer {layer}: {missing}")
    for n in names:
        if list(tensors[n].shape) != list(state[n].shape):
            raise CaseError(f"{path}: tensor '{n}': expected {list(state[n].shape)} for this "
                            f"{layer} layer, got {list(tensors[n].shape)}")
    module.load_state_dict({n: tensors[n] for n in names})
    module = module.double().eval()
    fn = _OUTPUTS[layer]
    return names, lambda inputs, causal, meta: fn(module, inputs, causal, meta)


def verify_case(path, tolerance=TOLERANCE):
    """Runs the torch module of the case at path on its inputs and compares with its expected
    tensors.

    Returns (passed, layer, [(name, max_error, allowed, zeros_exact)]). Raises CaseError on a
    malformed file (a missing or unknown tensor among them).
    """
    tensors, meta = read_safetensors(path)
    if meta.get("format") != FORMAT:
        raise CaseError(f"{path}: format: expected {FORMAT}, got '{meta.get('format')}'")
    layer = meta.get("layer", "")
    causal = _meta_int(meta, "causal", path)
    if causal not in (0, 1):
        raise CaseError(f"{path}: metadata 'causal': expected 0 or 1, got {causal}")
    if "x" not in tensors:
        raise CaseError(f"{path}: tensor 'x' missing")
    inputs = {n: tensors[n].double() if tensors[n].is_floating_point() else tensors[n]
              for n in INPUTS if n in tensors}
    for n in ("key_padding_mask", "query_padding_mask"):
        if n in inputs:
            inputs[n] = inputs[n].to(torch.bool)
    names, compute = _case_module(layer, meta, tensors, path)
    # decode_from only changes how the C++ side feeds the tokens; the expected y is the full
    # causal sequence either way.
    computed = compute(inputs, bool(causal), meta)
    unknown = sorted(set(tensors) - set(names) - set(INPUTS) - set(computed)
                     - set(OPTIONAL_OUTPUTS.get(layer, ())))
    if unknown:
        raise CaseError(f"{path}: tensors {unknown} are not part of a {layer} case with this metadata")
    checks = []
    for name, value in computed.items():
        if name not in tensors:
            if name in OPTIONAL_OUTPUTS.get(layer, ()):
                continue
            raise CaseError(f"{path}: expected tensor '{name}' missing for layer {layer}")
        e = tensors[name].double()
        c = value.double().reshape(-1)
        if c.numel() != e.numel():
            raise CaseError(f"{path}: tensor '{name}': expected {c.numel()} values, got {e.numel()}")
        e = e.reshape(-1)
        finite = torch.isfinite(e)
        scale = max(1.0, float(e[finite].abs().max())) if bool(finite.any()) else 1.0
        err = float((c - e).abs().max()) if bool(finite.all() and torch.isfinite(c).all()) else math.inf
        zeros = bool(((e != 0) | (c == 0)).all()) if name in ("gates", "head_mask") else True
        checks.append((name, err, tolerance * scale, zeros))
    passed = all(err <= tol and zeros for _, err, tol, zeros in checks)
    return passed, layer, checks


def _format_checks(checks):
    return "".join(f" {name}={err:.3g}/{tol:.3g}{'' if zeros else '(nonzero where 0 expected)'}"
                   for name, err, tol, zeros in checks)


def verify_fixtures(directory, out=sys.stdout):
    """verify_case on every DIR/*.safetensors; prints one line each. Returns the number failed."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    failed = 0
    for path in files:
        try:
            passed, layer, checks = verify_case(path)
            print(f"{'PASS' if passed else 'FAIL'} {path} [{layer}]{_format_checks(checks)}", file=out)
        except (CaseError, KeyError, ValueError, RuntimeError) as e:
            passed = False
            text = str(e)
            print(f"FAIL {text}" if text.startswith(path) else f"FAIL {path}: {text}", file=out)
        failed += 0 if passed else 1
    print(f"{len(files) - failed} passed, {failed} failed", file=out)
    return failed


# --- random layers -------------------------------------------------------------------------------


def _padding_mask(B, T, side):
    """Sequence b pads min(b + 1, T - 1) tokens at its end (right) or start (left)."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        n = min(b + 1, T - 1)
        if n > 0:
            if side == "left":
                mask[b, :n] = True
            else:
                mask[b, T - n:] = True
    return mask


# attn_bias layouts export_random takes: which of [B, H, T, S] are full ('B', 'H') or 1.
ATTN_BIAS_LAYOUTS = ("BHTS", "1HTS", "B1TS", "11TS")


def _random_attn_bias(layout, B, H, T, S):
    """A seeded random bias of the layout (ATTN_BIAS_LAYOUTS) with -inf holes: every key j of
    query i with (i + 2 j) % 5 == 3, and the whole last query row of the first [T, S] slice,
    which then sees no key at all."""
    if layout not in ATTN_BIAS_LAYOUTS:
        raise CaseError(f"attn_bias: expected one of {', '.join(ATTN_BIAS_LAYOUTS)}, got {layout!r}")
    shape = [B if layout[0] == "B" else 1, H if layout[1] == "H" else 1, T, S]
    bias = torch.randn(shape)
    i = torch.arange(T).view(T, 1)
    j = torch.arange(S).view(1, S)
    bias = bias.masked_fill((i + 2 * j) % 5 == 3, float("-inf"))
    bias[0, 0, T - 1, :] = float("-inf")
    return bias


def _perturb(*tensors, mean=0.0, std=0.3):
    """Fills parameters whose initial values would hide mistakes (ones, zeros, tiny) at random."""
    with torch.no_grad():
        for t in tensors:
            t.normal_(mean, std)


def export_random(path, layer, batch=2, tokens=None, embed_dim=32, heads=None, head_dim=None,
                  shared=None, routed_active=None, experts=None, top_k=None, kv_heads=None,
                  causal=False, padding=None, decode_from=None, rope_theta=None, bias=True,
                  seq_first=False, seed=0, qkv_bias=True, qk_norm=False, memory=None, kdim=None,
                  attn_bias=None, query_padding=None, grid=None, pretrain_grid=None,
                  train_tokens=None):
    """Builds a randomly initialised layer (torch.manual_seed(seed)) and input, exports the case.

    padding: None, "right" or "left" (see _padding_mask), over the keys (the memory with memory
    = S, a memory of S tokens); query_padding the same over the queries (moa). attn_bias: None
    or a layout of ATTN_BIAS_LAYOUTS ('H' is not for moa, jetmoe). bias=False: mha without
    biases; qkv_bias=False: moh, moh_vit without qkv.bias. grid (h, w) or 'HxW': moh_vit's token
    grid (tokens = h w), pretrain_grid defaults to grid, train_tokens to its size.
    Defaults: tokens 7; heads 4; head_dim D / heads (moa D / 4, jetmoe D / kv_heads); shared 1
    (moh, moh_vit), heads / 2 (moh_llama); routed_active max(1, routed / 2); experts 4, top_k 2;
    kv_heads = heads (moh_llama), 2 (jetmoe); kdim D; rope_theta 10000. Returns the expected
    outputs.
    """
    if layer not in LAYERS:
        raise CaseError(f"layer: expected one of {', '.join(LAYERS)}, got '{layer}'")
    torch.manual_seed(seed)
    B, D = batch, embed_dim
    if layer == "moh_vit":
        if grid is None:
            raise CaseError("moh_vit: expected a grid (h, w) or 'HxW' for the tokens")
        grid = _parse_grid(grid)
        if grid[0] < 1 or grid[1] < 1:
            raise CaseError(f"grid: expected both sides >= 1, got {grid[0]}x{grid[1]}")
        if tokens is not None and tokens != grid[0] * grid[1]:
            raise CaseError(f"tokens: the grid {grid[0]}x{grid[1]} has {grid[0] * grid[1]}, got {tokens}")
        tokens = grid[0] * grid[1]
    elif grid is not None or pretrain_grid is not None or train_tokens is not None:
        raise CaseError(f"grid, pretrain_grid and train_tokens are for moh_vit, got layer {layer}")
    T = tokens if tokens is not None else 7
    H = heads if heads is not None else 4
    G = kv_heads if kv_heads is not None else (2 if layer == "jetmoe" else H)
    if layer == "moa":
        d = head_dim if head_dim is not None else max(1, D // 4)
    elif layer == "jetmoe":
        if head_dim is None and D % G:
            raise CaseError(f"embed_dim {D} is not a multiple of kv_heads {G}: give head_dim")
        d = head_dim if head_dim is not None else D // G
    else:
        if head_dim is None and D % H:
            raise CaseError(f"embed_dim {D} is not a multiple of heads {H}: give head_dim")
        d = head_dim if head_dim is not None else D // H
    default_shared = H // 2 if layer == "moh_llama" else 1
    S_h = shared if shared is not None else min(default_shared, H)
    K = routed_active if routed_active is not None else (max(1, (H - S_h) // 2) if H > S_h else 0)
    E = experts if experts is not None else 4
    k = top_k if top_k is not None else 2
    theta = rope_theta if rope_theta is not None else 10000.0
    if memory is not None and layer not in ("mha", "moh", "moa"):
        raise CaseError(f"memory: cross-attention is for mha, moh and moa, got layer {layer}")
    if kdim is not None and (layer != "moa" or memory is None):
        raise CaseError("kdim: the memory width of a moa layer; needs memory")
    if not bias and layer != "mha":
        raise CaseError(f"bias=False is for mha (moh and moh_vit: qkv_bias=False; proj always "
                        f"has a bias), got layer {layer}")
    if (not qkv_bias or qk_norm) and layer not in ("moh", "moh_vit"):
        raise CaseError(f"qkv_bias and qk_norm are for moh and moh_vit, got layer {layer}")
    if query_padding is not None and layer != "moa":
        raise CaseError(f"query_padding is for moa, got layer {layer}")
    if attn_bias is not None and layer in _SINGLE_BIAS_HEAD and attn_bias[1:2] == "H":
        raise CaseError(f"attn_bias: a {layer} bias has one head row (layout B1TS or 11TS), "
                        f"got {attn_bias}")
    try:
        if layer == "mha":
            if d * H != D:
                raise CaseError(f"torch.nn.MultiheadAttention needs head_dim = embed_dim / heads = "
                                f"{D}/{H}, got head_dim {d}")
            module = nn.MultiheadAttention(D, H, bias=bias, batch_first=not seq_first)
        elif layer == "moh":
            module = MoHAttention(D, H, d, S_h, K, qkv_bias=qkv_bias, qk_norm=qk_norm)
        elif layer == "moh_vit":
            if d * H != D:
                raise CaseError(f"moh_vit: head_dim is embed_dim / heads = {D}/{H}, got {d}")
            module = MoHViTAttention(D, H, pretrain_grid or grid, train_tokens, S_h, K,
                                     qkv_bias=qkv_bias, qk_norm=qk_norm)
            # TransNeXt starts with one temperature and a tiny query embedding: spread them so
            # that a head mixed up shows, and make the position bias matter.
            with torch.no_grad():
                module.temperature.add_(0.5 * torch.randn_like(module.temperature))
                module.cpb_fc2.weight.mul_(4.0)
            _perturb(module.query_embedding)
        elif layer == "moa":
            module = MoAAttention(D, d, E, k, kdim if kdim is not None else D)
        elif layer == "jetmoe":
            module = JetMoEAttention(D, d, G, E, k, theta)
        else:
            module = MoHLlamaAttention(D, H, d, G, S_h, K, theta)
    except ValueError as e:
        if isinstance(e, CaseError):
            raise
        raise CaseError(str(e)) from None
    if qk_norm:
        _perturb(module.q_norm.weight, module.k_norm.weight, mean=1.0)
        _perturb(module.q_norm.bias, module.k_norm.bias)
    x = torch.randn(B, T, D)
    mem = None
    if memory is not None:
        mem = torch.randn(B, memory, kdim if kdim is not None else D)
    S = memory if memory is not None else T
    mask = _padding_mask(B, S, padding) if padding else None
    heads_of_bias = 1 if layer in _SINGLE_BIAS_HEAD else H
    bias_tensor = _random_attn_bias(attn_bias, B, heads_of_bias, T, S) if attn_bias else None
    if layer == "mha":
        return export_mha(module, x, path, mask, causal, mem, bias_tensor)
    if layer == "moh":
        return export_moh(module, x, path, mask, causal, mem, bias_tensor)
    if layer == "moh_vit":
        return export_moh_vit(module, x, path, grid, mask, causal, bias_tensor)
    if layer == "moa":
        qpm = _padding_mask(B, T, query_padding) if query_padding else None
        return export_moa(module, x, path, mask, causal, mem, bias_tensor, qpm)
    if layer == "jetmoe":
        return export_jetmoe(module, x, path, mask, causal, bias_tensor, decode_from)
    return export_moh_llama(module, x, path, mask, causal, decode_from, bias_tensor)


# The cases --roundtrip exports and checks: every layer with causal, padding (right, and left
# for rows that see no key), T = 1, 3, 17, head sizes not a multiple of 8, GQA / MQA and decoding.
ROUNDTRIP_CASES = [
    ("mha_basic", "mha", dict(batch=2, tokens=5, embed_dim=16, heads=4)),
    ("mha_seq_first_causal_padding", "mha", dict(batch=3, tokens=17, embed_dim=20, heads=4,
                                                 causal=True, padding="right", seq_first=True, seed=1)),
    ("mha_left_padding_causal", "mha", dict(batch=2, tokens=3, embed_dim=24, heads=2, causal=True,
                                            padding="left", seed=2)),
    ("mha_one_token_no_bias", "mha", dict(batch=2, tokens=1, embed_dim=12, heads=3, bias=False, seed=3)),
    ("moh_shared_routed", "moh", dict(batch=2, tokens=6, embed_dim=32, heads=8, shared=2, routed_active=3)),
    ("moh_routed_only_t17", "moh", dict(batch=1, tokens=17, embed_dim=24, heads=6, shared=0,
                                        routed_active=2, seed=4)),
    ("moh_single_shared_causal_padding", "moh", dict(batch=2, tokens=7, embed_dim=32, heads=4,
                                                     head_dim=12, shared=1, routed_active=2,
                                                     causal=True, padding="right", seed=5)),
    ("moh_all_active_t1", "moh", dict(batch=3, tokens=1, embed_dim=16, heads=4, shared=2,
                                      routed_active=2, seed=6)),
    ("moh_shared_only_d5", "moh", dict(batch=2, tokens=3, embed_dim=15, heads=3, head_dim=5,
                                       shared=3, routed_active=0, seed=7)),
    ("moh_left_padding_causal_d5", "moh", dict(batch=2, tokens=3, embed_dim=20, heads=5, shared=2,
                                               routed_active=2, causal=True, padding="left", seed=8)),
    ("moa_basic", "moa", dict(batch=2, tokens=6, embed_dim=32, head_dim=8, experts=6, top_k=2)),
    ("moa_causal_padding_d12_t17", "moa", dict(batch=2, tokens=17, embed_dim=24, head_dim=12,
                                               experts=4, top_k=3, causal=True, padding="right", seed=9)),
    ("moa_one_expert_t1", "moa", dict(batch=2, tokens=1, embed_dim=10, head_dim=5, experts=1,
                                      top_k=1, seed=10)),
    ("moa_all_experts_left_padding", "moa", dict(batch=2, tokens=3, embed_dim=16, head_dim=7,
                                                 experts=3, top_k=3, causal=True, padding="left",
                                                 seed=11)),
    ("moh_llama_gqa_prefill", "moh_llama", dict(batch=1, tokens=9, embed_dim=64, heads=8, kv_heads=2,
                                                shared=4, routed_active=2, causal=True)),
    ("moh_llama_mqa_t17_d6", "moh_llama", dict(batch=2, tokens=17, embed_dim=24, heads=4, head_dim=6,
                                               kv_heads=1, shared=1, routed_active=2, causal=True,
                                               rope_theta=500000.0, seed=12)),
    ("moh_llama_decode", "moh_llama", dict(batch=2, tokens=10, embed_dim=64, heads=8, kv_heads=4,
                                           shared=4, routed_active=2, causal=True, decode_from=4,
                                           seed=13)),
    ("moh_llama_decode_all_padding", "moh_llama", dict(batch=2, tokens=7, embed_dim=32, heads=4,
                                                       head_dim=10, kv_heads=2, shared=0,
                                                       routed_active=2, causal=True, decode_from=0,
                                                       padding="right", seed=14)),
    ("moh_llama_decode_left_padding", "moh_llama", dict(batch=3, tokens=5, embed_dim=16, heads=4,
                                                        kv_heads=2, shared=2, routed_active=1,
                                                        causal=True, decode_from=3, padding="left",
                                                        seed=15)),
    ("moh_llama_t1_bidirectional", "moh_llama", dict(batch=1, tokens=1, embed_dim=16, heads=2,
                                                     shared=1, routed_active=1, seed=16)),
    ("moh_llama_t3_noncausal_padding", "moh_llama", dict(batch=2, tokens=3, embed_dim=16, heads=4,
                                                         kv_heads=2, shared=1, routed_active=3,
                                                         padding="right", seed=17)),
]

# The cases of docs/semantics.md §6-9 (--roundtrip --families): qkv_bias / qk_norm, the
# dense MoH variant, cross-attention (memory, kdim, causal with S != T), attn_bias in every
# layout and layer, moh_vit (own and fine-tuned grids), MoA query padding and jetmoe (GQA / MQA,
# decoding, T = 1, 17, odd head sizes).
FAMILY_CASES = [
    ("moh_qk_norm_no_qkv_bias", "moh", dict(batch=2, tokens=6, embed_dim=48, heads=6, shared=2,
                                            routed_active=2, qkv_bias=False, qk_norm=True, seed=20)),
    ("moh_dense_d6_causal_padding", "moh", dict(batch=2, tokens=5, embed_dim=24, heads=4, shared=4,
                                                routed_active=0, causal=True, padding="right",
                                                seed=21)),
    ("moh_dense_one_head_t1_qk_norm", "moh", dict(batch=2, tokens=1, embed_dim=8, heads=1, shared=1,
                                                  routed_active=0, qk_norm=True, seed=22)),
    ("moh_cross_memory_padding", "moh", dict(batch=2, tokens=5, embed_dim=32, heads=4, shared=1,
                                             routed_active=2, memory=8, padding="right", seed=23)),
    ("moh_cross_causal_t17_s3_d7", "moh", dict(batch=1, tokens=17, embed_dim=20, heads=4, head_dim=7,
                                               shared=0, routed_active=2, memory=3, causal=True,
                                               qk_norm=True, seed=24)),
    ("moh_attn_bias_full_causal", "moh", dict(batch=2, tokens=6, embed_dim=32, heads=4, shared=1,
                                              routed_active=2, causal=True, attn_bias="BHTS", seed=25)),
    ("mha_attn_bias_shared_left_padding", "mha", dict(batch=2, tokens=6, embed_dim=24, heads=3,
                                                      attn_bias="11TS", padding="left", seed=26)),
    ("mha_cross_memory_attn_bias", "mha", dict(batch=2, tokens=4, embed_dim=16, heads=2, memory=9,
                                               padding="right", attn_bias="1HTS", seq_first=True,
                                               seed=27)),
    ("moh_vit_4x5", "moh_vit", dict(batch=2, embed_dim=32, heads=4, grid=(4, 5), shared=1,
                                    routed_active=2, seed=28)),
    ("moh_vit_3x3_from_4x5_no_qkv_bias", "moh_vit", dict(batch=1, embed_dim=24, heads=3, grid=(3, 3),
                                                         pretrain_grid=(4, 5), train_tokens=20,
                                                         shared=0, routed_active=2, qkv_bias=False,
                                                         seed=29)),
    ("moh_vit_dense_1x7_attn_bias", "moh_vit", dict(batch=2, embed_dim=16, heads=4, grid=(1, 7),
                                                    pretrain_grid=(2, 7), shared=4, routed_active=0,
                                                    attn_bias="B1TS", seed=30)),
    ("moh_vit_qk_norm_5x2_d5", "moh_vit", dict(batch=2, embed_dim=20, heads=4, grid=(5, 2),
                                               pretrain_grid=(7, 7), train_tokens=49, shared=2,
                                               routed_active=1, qk_norm=True, seed=31)),
    ("moa_query_padding", "moa", dict(batch=2, tokens=7, embed_dim=24, head_dim=8, experts=5,
                                      top_k=2, query_padding="right", seed=32)),
    ("moa_query_left_padding_causal", "moa", dict(batch=3, tokens=5, embed_dim=16, head_dim=6,
                                                  experts=4, top_k=3, causal=True, padding="left",
                                                  query_padding="left", seed=33)),
    ("moa_cross_kdim_padding", "moa", dict(batch=2, tokens=5, embed_dim=32, head_dim=8, experts=4,
                                           top_k=2, memory=7, kdim=20, padding="right", seed=34)),
    ("moa_cross_attn_bias_query_padding", "moa", dict(batch=2, tokens=3, embed_dim=12, head_dim=5,
                                                      experts=3, top_k=1, memory=6, attn_bias="B1TS",
                                                      query_padding="right", seed=35)),
    ("moa_attn_bias_causal_t17", "moa", dict(batch=1, tokens=17, embed_dim=16, head_dim=4, experts=4,
                                             top_k=2, causal=True, attn_bias="11TS", seed=36)),
    ("jetmoe_prefill", "jetmoe", dict(batch=2, tokens=7, embed_dim=32, kv_heads=2, head_dim=8,
                                      experts=4, top_k=2, causal=True, seed=37)),
    ("jetmoe_decode_left_padding", "jetmoe", dict(batch=2, tokens=8, embed_dim=32, kv_heads=2,
                                                  experts=4, top_k=2, causal=True, decode_from=3,
                                                  padding="left", seed=38)),
    ("jetmoe_mqa_d6_t17", "jetmoe", dict(batch=1, tokens=17, embed_dim=24, kv_heads=1, head_dim=6,
                                         experts=3, top_k=3, causal=True, rope_theta=500000.0,
                                         seed=39)),
    ("jetmoe_t1_top1_decode_all", "jetmoe", dict(batch=2, tokens=1, embed_dim=16, kv_heads=4,
                                                 head_dim=4, experts=2, top_k=1, causal=True,
                                                 decode_from=0, seed=40)),
    ("jetmoe_bidirectional_attn_bias", "jetmoe", dict(batch=2, tokens=5, embed_dim=16, kv_heads=2,
                                                      head_dim=4, experts=4, top_k=1,
                                                      padding="right", attn_bias="11TS", seed=41)),
    ("moh_llama_attn_bias_causal", "moh_llama", dict(batch=2, tokens=6, embed_dim=32, heads=4,
                                                     kv_heads=2, shared=1, routed_active=2,
                                                     causal=True, attn_bias="BHTS", seed=42)),
]


def roundtrip(directory, parity, families=False):
    """Exports ROUNDTRIP_CASES (and FAMILY_CASES with families) into directory, reads each back
    with verify_case, runs parity on them all. Returns the exit status (0 = every case passed
    both)."""
    os.makedirs(directory, exist_ok=True)
    paths, failed = [], 0
    for name, layer, settings in ROUNDTRIP_CASES + (FAMILY_CASES if families else []):
        path = os.path.join(directory, f"{name}.safetensors")
        export_random(path, layer, **settings)
        passed, _, checks = verify_case(path)
        if not passed:
            print(f"FAIL {path}: the file does not read back as written:{_format_checks(checks)}")
            failed += 1
        paths.append(path)
    sys.stdout.flush()
    rc = subprocess.call([parity] + paths)
    return 1 if failed or rc else 0
