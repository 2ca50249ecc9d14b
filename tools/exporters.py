"""Turn PyTorch attention modules into moh-case/1 golden cases, and check cases against torch.

export_mha, export_moh, export_moa and export_moh_llama write a case for a given module and input:
its weights under their PyTorch names, x [B, T, D], the expected outputs (computed in float64 from
the float32 values that go into the file) and the metadata that moh's C++ side needs to rebuild
the layer. export_random builds a seeded random layer and input and exports it; verify_case and
verify_fixtures run the torch modules on existing cases; roundtrip exports ROUNDTRIP_CASES and runs
moh_parity on them. The file format is written by safetensors_io.py; export_torch.py is the command
line over all of this.

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
from moh_modules import MoAAttention, MoHAttention, MoHLlamaAttention, mha_reference  # noqa: E402
from safetensors_io import CaseError, read_safetensors, write_safetensors  # noqa: E402

__all__ = [
    "export_mha",
    "export_moh",
    "export_moa",
    "export_moh_llama",
    "export_random",
    "verify_case",
    "verify_fixtures",
    "roundtrip",
]

FORMAT = "moh-case/1"
LAYERS = ("mha", "moh", "moa", "moh_llama")
# A computed tensor c passes against the expected e when max|c - e| <= TOLERANCE * max(1, max|e|).
TOLERANCE = 1e-4
# Routing decisions closer than this (in probability) may go the other way in float32.
FRAGILE_MARGIN = 1e-5


# --- inputs and the float64 copy -------------------------------------------------------------------


def _check_input(x, embed_dim, key_padding_mask):
    """x as float32 [B, T, D] on the CPU and the mask as bool [B, T] (or None)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CaseError(f"x: expected a float tensor [B, T, {embed_dim}], got {got}")
    if x.shape[2] != embed_dim or x.shape[0] < 1 or x.shape[1] < 1:
        raise CaseError(f"x: expected [B >= 1, T >= 1, {embed_dim}], got {list(x.shape)}")
    x = x.detach().cpu().to(torch.float32).contiguous()
    mask = None
    if key_padding_mask is not None:
        mask = torch.as_tensor(key_padding_mask).detach().cpu()
        if list(mask.shape) != list(x.shape[:2]):
            raise CaseError(f"key_padding_mask: expected [B, T] = {list(x.shape[:2])}, "
                            f"got {list(mask.shape)}")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise CaseError("key_padding_mask: expected bool or 0/1 values")
            mask = mask.to(torch.bool)
    return x, mask


def _float64(module):
    """A float64 eval-mode copy of module whose weights are the float32-rounded originals."""
    return copy.deepcopy(module).cpu().float().double().eval()


def _weights(module, names):
    """The named parameters as float32 CPU tensors; names must be exactly the module's state dict."""
    state = module.state_dict()
    if sorted(state) != sorted(names):
        raise CaseError(f"{type(module).__name__} weights: expected {sorted(names)}, got {sorted(state)}")
    return {name: state[name].detach().cpu().to(torch.float32) for name in names}


def _blind_rows(B, T, mask, causal):
    """[B, T] bool: query rows that see no key (their attention output is zero)."""
    visible = torch.ones(B, T, T, dtype=torch.bool)
    if causal:
        visible &= torch.ones(T, T, dtype=torch.bool).tril()
    if mask is not None:
        visible &= ~mask.view(B, 1, T)
    return ~visible.any(dim=-1)


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


def _mha_outputs(module, x, mask, causal):
    """y of a float64 torch.nn.MultiheadAttention on x [B, T, D], checked against SEMANTICS.md."""
    B, T, _ = x.shape
    inp = x if module.batch_first else x.transpose(0, 1)
    attn_mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None
    # With grad enabled (and parameters that require it) torch 1.13 takes the plain path; its
    # "fast path" under no_grad fails outright for bias=False modules.
    for param in module.parameters():
        param.requires_grad_(True)
    with torch.enable_grad():
        y = module(inp, inp, inp, key_padding_mask=mask, need_weights=False, attn_mask=attn_mask)[0]
    with torch.no_grad():
        y = y.detach().clone()
        if not module.batch_first:
            y = y.transpose(0, 1)
        # torch gives NaN where a query sees no key; SEMANTICS.md says its attention output is
        # zero, so y there is the output bias.
        blind = _blind_rows(B, T, mask, causal)
        bias = module.out_proj.bias
        y[blind] = bias if bias is not None else 0.0
        reference = mha_reference(x, module.in_proj_weight, module.in_proj_bias,
                                  module.out_proj.weight, bias, module.num_heads, module.head_dim,
                                  causal, mask)
    if not torch.isfinite(y).all():
        raise CaseError("torch.nn.MultiheadAttention returned non-finite values outside the rows "
                        "that see no key")
    error = float((y - reference).abs().max())
    if error > 1e-9 * max(1.0, float(reference.abs().max())):
        raise CaseError(f"torch.nn.MultiheadAttention and SEMANTICS.md disagree by {error:.3g}")
    return {"y": y}


def _moh_outputs(module, x, mask, causal):
    with torch.no_grad():
        out = module(x, key_padding_mask=mask, causal=causal)
        if module.wg is not None:
            p = torch.softmax(module.wg(x.reshape(-1, x.shape[2])), dim=-1)
            _warn_fragile("moh router", _topk_margin(p, module.active_routed_heads))
    return {"y": out.y, "gates": out.gates, "aux_loss": out.aux_loss.reshape(1)}


def _moa_outputs(module, x, mask, causal):
    with torch.no_grad():
        out = module(x, key_padding_mask=mask, causal=causal)
        p = torch.softmax(x.reshape(-1, x.shape[2]) @ module.q_proj.w_gate, dim=-1)
        _warn_fragile("moa router", _topk_margin(p, module.top_k))
    return {"y": out.y, "expert_counts": out.expert_counts,
            "switch_loss": out.switch_loss.reshape(1), "z_loss": out.z_loss.reshape(1)}


def _moh_llama_outputs(module, x, mask, causal):
    with torch.no_grad():
        out = module(x, key_padding_mask=mask, causal=causal)
        S, H, d = module.shared_heads, module.num_heads, module.head_dim
        norms = module.q_proj(x).view(-1, H, d)[:, S:, :].norm(dim=-1)
        if norms.shape[1] > 1:
            # The decision is made on norms; compare the gap relative to their size.
            _warn_fragile("query-norm router", _topk_margin(norms / norms.max(), module.active_routed_heads))
    return {"y": out.y, "head_mask": out.head_mask}


_OUTPUTS = {"mha": _mha_outputs, "moh": _moh_outputs, "moa": _moa_outputs,
            "moh_llama": _moh_llama_outputs}


def _export(path, layer, module, weight_names, x, mask, causal, metadata):
    """Computes the expected outputs with a float64 copy of module and writes the case."""
    module64 = _float64(module)
    expected = _OUTPUTS[layer](module64, x.double(), mask, causal)
    tensors = _weights(module, weight_names)
    tensors["x"] = x
    if mask is not None:
        tensors["key_padding_mask"] = mask
    for name, value in expected.items():
        if not torch.isfinite(value).all():
            raise CaseError(f"expected output '{name}' is not finite")
        tensors[name] = value.to(torch.float32)
    meta = {"format": FORMAT, "layer": layer, "causal": "1" if causal else "0"}
    meta.update({k: str(v) for k, v in metadata.items()})
    write_safetensors(path, tensors, meta)
    return expected


# --- export_* ------------------------------------------------------------------------------------


def export_mha(module, x, path, key_padding_mask=None, causal=False):
    """Writes a `mha` case for a torch.nn.MultiheadAttention (self-attention).

    x is [B, T, D] (batch first) whatever module.batch_first says; the module is called in its
    own layout. key_padding_mask [B, T] (True = padding); causal masks later keys. Returns the
    expected outputs {"y": [B, T, D] float64}.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise CaseError(f"export_mha: expected torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise CaseError(f"export_mha: kdim and vdim must equal embed_dim ({module.embed_dim}), "
                        f"got kdim={module.kdim}, vdim={module.vdim}")
    if module.bias_k is not None or module.add_zero_attn:
        raise CaseError("export_mha: add_bias_kv and add_zero_attn are not part of moh-case/1")
    x, mask = _check_input(x, module.embed_dim, key_padding_mask)
    names = ["in_proj_weight", "out_proj.weight"]
    if module.in_proj_bias is not None:
        names += ["in_proj_bias", "out_proj.bias"]
    return _export(path, "mha", module, names, x, mask, causal,
                   {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
                    "head_dim": module.head_dim})


def export_moh(module, x, path, key_padding_mask=None, causal=False):
    """Writes a `moh` case for a moh_modules.MoHAttention (a trained MoH ViT/DiT attention's
    state dict loads into one). x [B, T, D]. Returns {"y", "gates", "aux_loss"} in float64."""
    if not isinstance(module, MoHAttention):
        raise CaseError(f"export_moh: expected moh_modules.MoHAttention, got {type(module).__name__}")
    x, mask = _check_input(x, module.embed_dim, key_padding_mask)
    names = [n for n in module.state_dict()]
    return _export(path, "moh", module, names, x, mask, causal,
                   {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
                    "head_dim": module.head_dim, "shared_heads": module.shared_heads,
                    "active_routed_heads": module.active_routed_heads})


def export_moa(module, x, path, key_padding_mask=None, causal=False):
    """Writes a `moa` case for a moh_modules.MoAAttention. x [B, T, D].
    Returns {"y", "expert_counts", "switch_loss", "z_loss"} in float64."""
    if not isinstance(module, MoAAttention):
        raise CaseError(f"export_moa: expected moh_modules.MoAAttention, got {type(module).__name__}")
    x, mask = _check_input(x, module.embed_dim, key_padding_mask)
    names = ["q_proj.experts.w", "q_proj.output_experts.w", "q_proj.w_gate", "k_proj.weight",
             "v_proj.weight"]
    return _export(path, "moa", module, names, x, mask, causal,
                   {"embed_dim": module.embed_dim, "head_dim": module.head_dim,
                    "num_experts": module.num_experts, "top_k": module.top_k})


def export_moh_llama(module, x, path, key_padding_mask=None, causal=True, decode_from=None):
    """Writes a `moh_llama` case for a moh_modules.MoHLlamaAttention. x [B, T, D], positions 0..T-1.

    decode_from = P asks the C++ side to run tokens 0..P-1 as one prompt and every later token
    through its KV cache (needs causal). Returns {"y", "head_mask"} in float64.
    """
    if not isinstance(module, MoHLlamaAttention):
        raise CaseError(f"export_moh_llama: expected moh_modules.MoHLlamaAttention, "
                        f"got {type(module).__name__}")
    x, mask = _check_input(x, module.embed_dim, key_padding_mask)
    meta = {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
            "head_dim": module.head_dim, "num_kv_heads": module.num_kv_heads,
            "shared_heads": module.shared_heads, "active_routed_heads": module.active_routed_heads,
            "rope_theta": repr(float(module.rope_theta))}
    if decode_from is not None:
        T = x.shape[1]
        if not isinstance(decode_from, int) or not 0 <= decode_from <= T:
            raise CaseError(f"decode_from: expected an integer in 0..{T} (tokens), got {decode_from!r}")
        if not causal:
            raise CaseError("decode_from: token-by-token decoding equals the full sequence only "
                            "with causal=True, got causal=False")
        meta["decode_from"] = decode_from
    return _export(path, "moh_llama", module,
                   ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"],
                   x, mask, causal, meta)


# --- verification of existing cases ----------------------------------------------------------------


def _meta_int(meta, key, path):
    try:
        return int(meta[key])
    except KeyError:
        raise CaseError(f"{path}: metadata '{key}' missing") from None
    except ValueError:
        raise CaseError(f"{path}: metadata '{key}': expected an integer, got '{meta[key]}'") from None


def _case_module(layer, meta, tensors, path):
    """(float64 module with the case's weights, its output function) for a case file."""
    D = _meta_int(meta, "embed_dim", path)
    d = _meta_int(meta, "head_dim", path)
    if layer == "mha":
        H = _meta_int(meta, "num_heads", path)
        bias = "in_proj_bias" in tensors
        if H * d == D:
            module = nn.MultiheadAttention(D, H, bias=bias, batch_first=True)
        else:  # torch.nn.MultiheadAttention cannot have head_dim != D / H; use the formula alone.
            w = {n: tensors[n].double() for n in tensors}
            return None, lambda x, mask, causal: {"y": mha_reference(
                x, w["in_proj_weight"], w.get("in_proj_bias"), w["out_proj.weight"],
                w.get("out_proj.bias"), H, d, causal, mask)}
    elif layer == "moh":
        module = MoHAttention(D, _meta_int(meta, "num_heads", path), d,
                              _meta_int(meta, "shared_heads", path),
                              _meta_int(meta, "active_routed_heads", path), bias="qkv.bias" in tensors)
    elif layer == "moa":
        module = MoAAttention(D, d, _meta_int(meta, "num_experts", path), _meta_int(meta, "top_k", path))
    elif layer == "moh_llama":
        module = MoHLlamaAttention(D, _meta_int(meta, "num_heads", path), d,
                                   _meta_int(meta, "num_kv_heads", path),
                                   _meta_int(meta, "shared_heads", path),
                                   _meta_int(meta, "active_routed_heads", path),
                                   float(meta.get("rope_theta", "nan")))
    else:
        raise CaseError(f"{path}: layer: expected one of {', '.join(LAYERS)}, got '{layer}'")
    names = list(module.state_dict())
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CaseError(f"{path}: weights missing for layer {layer}: {missing}")
    module.load_state_dict({n: tensors[n] for n in names})
    module = module.double().eval()
    fn = _OUTPUTS[layer]
    return module, lambda x, mask, causal: fn(module, x, mask, causal)


def verify_case(path, tolerance=TOLERANCE):
    """Runs the torch module of the case at path on its x and compares with its expected tensors.

    Returns (passed, layer, [(name, max_error, allowed, zeros_exact)]). Raises CaseError on a
    malformed file.
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
    x = tensors["x"].double()
    mask = tensors.get("key_padding_mask")
    _, compute = _case_module(layer, meta, tensors, path)
    # decode_from only changes how the C++ side feeds the tokens; the expected y is the full
    # causal sequence either way.
    computed = compute(x, mask, bool(causal))
    checks = []
    for name, value in computed.items():
        if name not in tensors:
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


def export_random(path, layer, batch=2, tokens=7, embed_dim=32, heads=None, head_dim=None,
                  shared=None, routed_active=None, experts=None, top_k=None, kv_heads=None,
                  causal=False, padding=None, decode_from=None, rope_theta=None, bias=True,
                  seq_first=False, seed=0):
    """Builds a randomly initialised layer (torch.manual_seed(seed)) and input, exports the case.

    padding: None, "right" or "left" (see _padding_mask). Defaults: heads 4; head_dim D / heads
    (moa: D / 4); moh shared 1, moh_llama shared heads / 2, routed_active max(1, routed / 2);
    experts 4, top_k 2; kv_heads = heads; rope_theta 10000. Returns the expected outputs.
    """
    torch.manual_seed(seed)
    B, T, D = batch, tokens, embed_dim
    H = heads if heads is not None else 4
    if layer == "moa":
        d = head_dim if head_dim is not None else max(1, D // 4)
    else:
        if head_dim is None and D % H:
            raise CaseError(f"embed_dim {D} is not a multiple of heads {H}: give head_dim")
        d = head_dim if head_dim is not None else D // H
    default_shared = 1 if layer == "moh" else H // 2
    S = shared if shared is not None else min(default_shared, H)
    K = routed_active if routed_active is not None else (max(1, (H - S) // 2) if H > S else 0)

    if layer == "mha":
        if d * H != D:
            raise CaseError(f"torch.nn.MultiheadAttention needs head_dim = embed_dim / heads = "
                            f"{D}/{H}, got head_dim {d}")
        module = nn.MultiheadAttention(D, H, bias=bias, batch_first=not seq_first)
    elif layer == "moh":
        module = MoHAttention(D, H, d, S, K, bias=bias)
    elif layer == "moa":
        module = MoAAttention(D, d, experts if experts is not None else 4, top_k if top_k is not None else 2)
    elif layer == "moh_llama":
        module = MoHLlamaAttention(D, H, d, kv_heads if kv_heads is not None else H, S, K,
                                   rope_theta if rope_theta is not None else 10000.0)
    else:
        raise CaseError(f"layer: expected one of {', '.join(LAYERS)}, got '{layer}'")
    x = torch.randn(B, T, D)
    mask = _padding_mask(B, T, padding) if padding else None
    if layer == "mha":
        return export_mha(module, x, path, mask, causal)
    if layer == "moh":
        return export_moh(module, x, path, mask, causal)
    if layer == "moa":
        return export_moa(module, x, path, mask, causal)
    return export_moh_llama(module, x, path, mask, causal, decode_from)


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


def roundtrip(directory, parity):
    """Exports ROUNDTRIP_CASES into directory, reads each back with verify_case, runs parity on
    them all. Returns the exit status (0 = every case passed both)."""
    os.makedirs(directory, exist_ok=True)
    paths, failed = [], 0
    for name, layer, settings in ROUNDTRIP_CASES:
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
