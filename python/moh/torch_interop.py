"""moh layers from trained PyTorch modules, and their weights back as a PyTorch state dict.

``from_torch(module)`` reads the module's settings from its attributes and its weights from its
``state_dict()`` (loaded as moh's C++ ``load_weights`` loads a file: every shape checked, fused
or split layouts, tensors of modules moh does not implement refused). It knows:

    torch.nn.MultiheadAttention                   -> MultiHeadAttention
    tools/moh_modules.py MoHAttention,            -> MoHAttention (learned router)
      the authors' MoH-DiT / MoH-ViT MoHAttention    (shared_head, routed_head, qkv, proj, wg*)
    tools/moh_modules.py MoHViTAttention,         -> MoHAttention, scores = cosine
      TransNeXt's last-stage attention with MoH      (temperature, query_embedding, cpb_fc1/2)
    tools/moh_modules.py MoHLlamaAttention,       -> MoHAttention, query-norm router, RoPE, GQA
      the authors' MoH-LLaMA3 LlamaAttention         (shared_head, routed_head, q/k/v/o_proj)
    tools/moh_modules.py MoAAttention (fairseq)   -> MoAAttention
    tools/moh_modules.py JetMoEAttention,         -> MoAAttention, MoAConfig.jetmoe
      Hugging Face JetMoe attention

Any other module whose state dict uses one of these sets of names works too when its kind and
the settings it does not carry are given: ``from_torch(m, kind="moh", num_heads=12,
shared_heads=4, active_routed_heads=4)``. Settings given explicitly always win over what is read
off the module, and are the config's C++ field names (plus ``pretrain_grid=(h, w)`` for cosine
attention).
"""

import math
import warnings

from . import _core

KINDS = ("mha", "moh", "moh_vit", "moh_llama", "moa", "jetmoe")


def _attr(module, *names, default=None):
    """The first of ``names`` that ``module`` (or its ``config``) has, else ``default``."""
    for owner in (module, getattr(module, "config", None)):
        if owner is None:
            continue
        for name in names:
            value = getattr(owner, name, None)
            if value is not None:
                return value
    return default


def _kind_of(module, state):
    """The moh layer kind of ``module``, from its class and tensor names."""
    cls = type(module).__name__
    try:
        import torch

        if isinstance(module, torch.nn.MultiheadAttention):
            return "mha"
    except ImportError:  # pragma: no cover - from_torch is only useful with torch
        pass
    if "temperature" in state and "cpb_fc1.weight" in state:
        return "moh_vit"
    if "experts.input_linear.weight" in state:
        return "jetmoe"
    if "q_proj.experts.w" in state:
        return "moa"
    if cls == "MoHLlamaAttention":
        return "moh_llama"
    if "q_proj.weight" in state and "o_proj.weight" in state and (
            _attr(module, "shared_head", "shared_heads") is not None):
        return "moh_llama"  # the authors' MoH-LLaMA3 LlamaAttention (shared_head, routed_head)
    if "qkv.weight" in state and (_attr(module, "shared_head", "shared_heads") is not None):
        return "moh"
    raise _core.Error(
        f"from_torch: cannot tell which moh layer a {cls} is (tensors: "
        f"{', '.join(sorted(state)[:8])}{', ...' if len(state) > 8 else ''}): expected a "
        f"torch.nn.MultiheadAttention, a module of tools/moh_modules.py, the authors' MoH or "
        f"JetMoE attention, or kind= one of {', '.join(KINDS)} with its settings")


def _numpy_state(module, prefix=""):
    """{name without prefix: float32/float64 NumPy array} of the module's state dict entries under
    ``prefix`` (bfloat16 and float16 widened to float32; buffers of no weight, such as masks,
    left out). Only those entries are converted: a whole model with a prefix is not copied."""
    import torch

    out = {}
    for name, t in module.state_dict().items():
        if not name.startswith(prefix) or not torch.is_tensor(t) or not t.is_floating_point():
            continue
        t = t.detach().cpu()
        if t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float32)
        out[name[len(prefix):]] = t.contiguous().numpy()
    return out


def _has_dropout(module):
    """Whether any part of the module drops out (nn.Dropout with p > 0, MultiheadAttention's
    dropout)."""
    import torch

    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, torch.nn.MultiheadAttention) and m.dropout > 0:
            return True
    return False


def _required(value, kind, field, module):
    if value is None:
        raise _core.Error(
            f"from_torch: a {kind} layer needs {field}, which the {type(module).__name__} does not "
            f"carry: expected {field}=... among the settings, got none")
    return value


def _mha_settings(module):
    import torch

    if not isinstance(module, torch.nn.MultiheadAttention):
        raise _core.Error(
            f"from_torch: kind='mha' reads a torch.nn.MultiheadAttention's settings: expected one, "
            f"got a {type(module).__name__} (give kind='moh_llama' with its settings for "
            f"q_proj/k_proj/v_proj/o_proj tensors)")
    if not getattr(module, "_qkv_same_embed_dim", True):
        raise _core.Error(
            "from_torch: torch.nn.MultiheadAttention with kdim/vdim != embed_dim: expected one "
            "in_proj_weight (kdim = vdim = embed_dim), got q/k/v_proj_weight: moh's "
            "MultiHeadAttention has no separate key/value widths")
    if module.bias_k is not None or module.add_zero_attn:
        raise _core.Error(
            "from_torch: torch.nn.MultiheadAttention: expected add_bias_kv=False and "
            "add_zero_attn=False, got add_bias_kv="
            f"{module.bias_k is not None}, add_zero_attn={module.add_zero_attn}")
    if not getattr(module, "batch_first", False):
        warnings.warn(
            "from_torch: this torch.nn.MultiheadAttention takes [T, B, D] (batch_first=False); "
            "the moh layer takes [B, T, D]: pass x.transpose(0, 1) (the weights are the same)",
            stacklevel=3)
    return {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
            "bias": module.in_proj_bias is not None}


def _moh_settings(module, state):
    qkv = state["qkv.weight"]
    s = {"embed_dim": int(qkv.shape[1])}
    heads = _attr(module, "num_heads")
    if heads is not None:
        s["num_heads"] = int(heads)
        s["head_dim"] = int(_attr(module, "head_dim", default=qkv.shape[0] // (3 * heads)))
    shared = _attr(module, "shared_heads", "shared_head")
    if shared is not None:
        s["shared_heads"] = int(shared)
    routed = _attr(module, "active_routed_heads", "routed_head")
    if routed is not None:
        s["active_routed_heads"] = int(routed)
    s["qkv_bias"] = "qkv.bias" in state
    s["proj_bias"] = "proj.bias" in state
    s["qk_norm"] = "q_norm.weight" in state
    return s


def _moh_vit_settings(module, state):
    s = _moh_settings(module, state)
    s.pop("head_dim", None)
    grid = _attr(module, "pretrain_grid")
    if grid is not None:
        s["pretrain_grid"] = tuple(int(g) for g in grid)
    tokens = _attr(module, "train_tokens")
    scale = getattr(module, "seq_length_scale", None)  # the authors' buffer: ln(N_0)
    if tokens is None and scale is not None:
        tokens = round(math.exp(float(scale)))
    if tokens is not None:
        s["train_tokens"] = int(tokens)
    s["cpb_hidden"] = int(state["cpb_fc1.weight"].shape[0])
    return s


def _refuse_rope_variants(module, kind):
    """Refuses the RoPE settings moh does not compute (it rotates whole heads, rotate-half
    pairs, unscaled frequencies), rather than computing as if they were not there."""
    scaling = _attr(module, "rope_scaling")
    if scaling is None:
        params = _attr(module, "rope_parameters")
        if isinstance(params, dict):
            scaling = {k: v for k, v in params.items() if k not in ("rope_theta",)}
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in (None, "default") or scaling.get("factor", 1.0) not in (None, 1, 1.0):
            raise _core.Error(
                f"from_torch: {kind}: rope_scaling {scaling!r}: moh computes unscaled RoPE only: "
                f"expected no rope_scaling (or rope_type 'default'), got rope_type {rope_type!r}")
    elif scaling is not None:
        raise _core.Error(f"from_torch: {kind}: rope_scaling: expected None or a dict, "
                          f"got {scaling!r}")
    partial = _attr(module, "partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise _core.Error(
            f"from_torch: {kind}: partial_rotary_factor: moh rotates whole heads: expected 1.0, "
            f"got {partial}")


def _moh_llama_settings(module, state):
    _refuse_rope_variants(module, "moh_llama")
    s = {"router": _core.MoHRouterKind.QueryNorm, "rope": True,
         "qkv_bias": "q_proj.bias" in state, "proj_bias": "o_proj.bias" in state}
    for field, names in (("embed_dim", ("embed_dim", "hidden_size")),
                         ("num_heads", ("num_heads", "num_attention_heads"))):
        value = _attr(module, *names)
        if value is not None:
            s[field] = int(value)
    for field, names in (("head_dim", ("head_dim",)),
                         ("num_kv_heads", ("num_kv_heads", "num_key_value_heads")),
                         ("shared_heads", ("shared_heads", "shared_head")),
                         ("active_routed_heads", ("active_routed_heads", "routed_head")),
                         ("rope_theta", ("rope_theta",))):
        value = _attr(module, *names)
        if value is not None:
            s[field] = float(value) if field == "rope_theta" else int(value)
    return s


def _moa_settings(module, state):
    w = state["q_proj.experts.w"]  # [E, D, d]
    k = state["k_proj.weight"]     # [d, kdim]
    s = {"embed_dim": int(w.shape[1]), "num_experts": int(w.shape[0]),
         "head_dim": int(w.shape[2]), "kdim": int(k.shape[1])}
    top_k = _attr(module, "top_k", "k")
    if top_k is not None:
        s["top_k"] = int(top_k)
    return s


def _jetmoe_settings(module, state):
    _refuse_rope_variants(module, "jetmoe")
    w = state["experts.input_linear.weight"]  # [E, H_kv d, D]
    s = {"embed_dim": int(w.shape[2]), "num_experts": int(w.shape[0]),
         "gating": _core.MoAGating.TopKSoftmax, "names": _core.MoANames.JetMoE, "rope": True,
         "out_bias": "experts.bias" in state}
    kv_heads = _attr(module, "num_kv_heads", "num_key_value_heads")
    head_dim = _attr(module, "head_dim", "kv_channels")
    if kv_heads is not None:
        s["num_kv_heads"] = int(kv_heads)
        if head_dim is None:
            head_dim = w.shape[1] // int(kv_heads)
    if head_dim is not None:
        s["head_dim"] = int(head_dim)
    top_k = _attr(module, "top_k", "moe_top_k", "num_experts_per_tok")
    if top_k is not None:
        s["top_k"] = int(top_k)
    theta = _attr(module, "rope_theta")
    if theta is not None:
        s["rope_theta"] = float(theta)
    return s


_SETTINGS = {"mha": lambda m, st: _mha_settings(m), "moh": _moh_settings,
             "moh_vit": _moh_vit_settings, "moh_llama": _moh_llama_settings,
             "moa": _moa_settings, "jetmoe": _jetmoe_settings}


def _config(kind, settings):
    if kind == "mha":
        return _core.MultiHeadAttention, _core.MHAConfig(**settings)
    if kind in ("moa", "jetmoe"):
        return _core.MoAAttention, _core.MoAConfig(**settings)
    settings = dict(settings)
    if kind == "moh_vit":
        grid = settings.pop("pretrain_grid", None)
        if grid is None and not ("pretrain_h" in settings and "pretrain_w" in settings):
            raise _core.Error(
                "from_torch: MoH-ViT attention: the pretraining grid is not on the module: "
                "expected pretrain_grid=(h, w) (the token grid of the pretraining image size)")
        if grid is not None:
            settings["pretrain_h"], settings["pretrain_w"] = (int(g) for g in grid)
        settings.setdefault("train_tokens", settings["pretrain_h"] * settings["pretrain_w"])
        settings["scores"] = _core.MoHScores.Cosine
    return _core.MoHAttention, _core.MoHConfig(**settings)


def from_torch(module, kind=None, dtype="float32", weight_storage=None, prefix="", **settings):
    """The moh layer that computes what ``module`` computes, with its weights.

    kind: one of ``KINDS`` (default: told from the module's class and tensor names).
    dtype: the moh layer's dtype, "float32" or "float64" (independent of the module's).
    weight_storage: ``moh.WeightStorage.BFloat16`` stores the projections in bfloat16;
        ``moh.WeightStorage.NativePacked`` adds a copy packed for the GEMM (short prefills).
    prefix: of the tensor names in the module's state dict ("blocks.3.attn." when passing a
    whole model with kind and settings given).
    settings: config fields (C++ names) that the module does not carry, or that override it.
    """
    unprefixed = _numpy_state(module, prefix)
    if kind is None:
        kind = _kind_of(module, unprefixed)
    if kind not in KINDS:
        raise _core.Error(f"from_torch: kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    try:
        read = _SETTINGS[kind](module, unprefixed)
    except KeyError as missing:  # a tensor the kind needs is not in the state dict
        raise _core.Error(f"from_torch: a {kind} layer's tensor {missing} is not in the "
                          f"state dict of the {type(module).__name__} (prefix {prefix!r})") from None
    read.update(settings)  # explicit settings win over what was read off the module
    if kind == "moh_llama":
        for field in ("embed_dim", "num_heads"):
            _required(read.get(field), kind, field, module)
    if getattr(module, "training", False) and _has_dropout(module):
        warnings.warn(
            f"from_torch: the {type(module).__name__} is in training mode with dropout; moh "
            "computes what eval() computes (no dropout)", stacklevel=2)
    if weight_storage is not None:
        read["weight_storage"] = weight_storage
    layer_class, config = _config(kind, read)
    config.validate()
    layer = layer_class(config, dtype=dtype)
    layer.load_state_dict(unprefixed)  # only this layer's tensors are copied
    return layer


def state_dict_of(layer, as_torch=False, layout=None):
    """{name: array} of ``layer``'s tensors, as NumPy arrays or (``as_torch``) torch tensors, for
    ``module.load_state_dict``.

    layout: "fused" (the authors' names: qkv, proj, in_proj_weight, ...) or "split" (each fused
    tensor as its published parts and a renamed tensor by its first other name: LLaMA's q_proj,
    k_proj, v_proj, o_proj). Default: "split" for a MoH layer with the query-norm router
    (MoH-LLaMA's modules use LLaMA's names), else "fused".
    """
    if layout is None:
        router = getattr(layer.config, "router", None)
        layout = "split" if router == _core.MoHRouterKind.QueryNorm else "fused"
    if layout not in ("fused", "split"):
        raise _core.Error(f"state_dict_of: layout: expected 'fused' or 'split', got {layout!r}")
    out = {}
    for name, _, parts, aliases in layer.weight_layouts():
        value = layer.weight(name)
        if layout == "split" and parts:
            first = 0
            for part, shape in parts:
                out[part] = value[first:first + shape[0]].copy()
                first += shape[0]
        elif layout == "split" and aliases:
            out[aliases[0]] = value
        else:
            out[name] = value
    if as_torch:
        import torch

        out = {k: torch.from_numpy(v) for k, v in out.items()}
    return out
