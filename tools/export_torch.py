#!/usr/bin/env python3
"""Export a PyTorch attention layer as a self-checking moh-case/1 golden case.

The file (safetensors, see the project's FIXTURES.md) holds the layer's weights under their
PyTorch names, an input x [B, T, D] (and, as asked, a memory, a key or query padding mask and an
additive attn_bias), the expected outputs and the metadata that moh's C++ side needs to rebuild
the layer; `moh_parity FILE` then runs the C++ library on it and prints PASS/FAIL. Expected
outputs are computed in float64 from the float32 values that go into the file.

This file is the command line. The work is done by three modules next to it, whose public names
it re-exports: safetensors_io.py (write_safetensors, read_safetensors and CaseError, the minimal
safetensors I/O), moh_modules.py (the torch layers under the authors' weight names) and
exporters.py (export_*, verify_case, verify_fixtures and the built-in --roundtrip cases).

Library use (tools/ on sys.path):

    from export_torch import export_mha, export_moh, export_moh_vit, export_jetmoe
    mha = torch.nn.MultiheadAttention(64, 8, batch_first=True)
    export_mha(mha, torch.randn(2, 9, 64), "mha.safetensors", causal=True)
    vit = MoHViTAttention(64, 4, pretrain_grid=(7, 7), shared_heads=1, active_routed_heads=2)
    vit.load_state_dict(trained_state_dict)        # from moh_modules
    export_moh_vit(vit, torch.randn(1, 49, 64), "vit.safetensors", grid=(7, 7))

(`from exporters import ...`, `from moh_modules import ...` and `from safetensors_io import ...`
work as well.)

Command line:

    export_torch.py --layer {mha,moh,moh_vit,moa,jetmoe,moh_llama} --out FILE [settings]  random layer
    export_torch.py --verify-fixtures DIR        run the torch modules on DIR/*.safetensors
    export_torch.py --roundtrip DIR --parity EXE [--families]
                                                 export the built-in cases to DIR, run EXE on them

Only the standard library and torch are used (no safetensors, no numpy).
"""

import argparse
import glob
import importlib
import math
import os
import sys

if __name__ == "__main__":
    # Run as a tool: leave no __pycache__ in the source tree, for this file or the modules it
    # imports below (safetensors_io, exporters, moh_modules), so set it before importing them.
    sys.dont_write_bytecode = True
try:
    importlib.import_module("torch.nn")
except ImportError as e:  # pragma: no cover - depends on the machine
    if __name__ != "__main__":
        raise
    sys.exit(f"export_torch.py needs PyTorch ({e}); run it with a Python that has torch, "
             "e.g. /usr/bin/python3 with Debian's python3-torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exporters import (  # noqa: E402
    ATTN_BIAS_LAYOUTS,
    LAYERS,
    export_jetmoe,
    export_mha,
    export_moa,
    export_moh,
    export_moh_llama,
    export_moh_vit,
    export_random,
    roundtrip,
    verify_case,
    verify_fixtures,
)
from safetensors_io import CaseError, read_safetensors, write_safetensors  # noqa: E402

__all__ = [  # the library names: safetensors I/O and the exporters (not the round trip)
    "write_safetensors", "read_safetensors", "export_mha", "export_moh", "export_moh_vit",
    "export_moa", "export_jetmoe", "export_moh_llama", "export_random", "verify_case",
    "verify_fixtures",
]


# --- command line --------------------------------------------------------------------------------

# Which options each layer takes (beyond --batch, --tokens, --embed-dim, --causal, --padding,
# --attn-bias, --seed).
_LAYER_OPTIONS = {
    "heads": ("mha", "moh", "moh_vit", "moh_llama"),
    "head_dim": ("mha", "moh", "moa", "jetmoe", "moh_llama"),
    "shared": ("moh", "moh_vit", "moh_llama"),
    "routed_active": ("moh", "moh_vit", "moh_llama"),
    "experts": ("moa", "jetmoe"),
    "top_k": ("moa", "jetmoe"),
    "kv_heads": ("moh_llama", "jetmoe"),
    "decode_from": ("moh_llama", "jetmoe"),
    "rope_theta": ("moh_llama", "jetmoe"),
    "no_bias": ("mha",),
    "seq_first": ("mha",),
    "no_qkv_bias": ("moh", "moh_vit"),
    "qk_norm": ("moh", "moh_vit"),
    "memory": ("mha", "moh", "moa"),
    "kdim": ("moa",),
    "query_padding": ("moa",),
    "grid": ("moh_vit",),
    "pretrain_grid": ("moh_vit",),
    "train_tokens": ("moh_vit",),
}
_EXPORT_OPTIONS = (("batch", "tokens", "embed_dim", "causal", "padding", "attn_bias", "seed")
                   + tuple(_LAYER_OPTIONS))
# Layers whose attn_bias has a single head row (docs/semantics.md §6).
_SINGLE_BIAS_HEAD = ("moa", "jetmoe")


def _grid(text):
    """argparse type: 'HxW' -> (H, W), both sides positive integers."""
    try:
        h, w = (int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW (e.g. 7x7), got '{text}'") from None
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"expected positive sides, got '{text}'")
    return h, w


def _parser():
    p = argparse.ArgumentParser(
        prog="export_torch.py",
        description="Export a PyTorch attention layer (random, seeded) with a test input and its "
                    "output as a moh-case/1 golden case for moh_parity; or check torch against cases.",
        epilog="examples:\n"
               "  export_torch.py --layer moh --out moh.safetensors --heads 8 --shared 2 --routed-active 3\n"
               "  export_torch.py --layer moh --out dense.safetensors --heads 4 --shared 4 --routed-active 0 "
               "--qk-norm --no-qkv-bias\n"
               "  export_torch.py --layer moh --out cross.safetensors --memory 9 --padding --attn-bias BHTS\n"
               "  export_torch.py --layer moh_vit --out vit.safetensors --embed-dim 64 --grid 7x7 "
               "--pretrain-grid 14x14 --train-tokens 196\n"
               "  export_torch.py --layer moa --out moa.safetensors --memory 6 --kdim 20 --query-padding\n"
               "  export_torch.py --layer jetmoe --out jet.safetensors --kv-heads 2 --experts 8 --top-k 2 "
               "--causal --decode-from 3\n"
               "  export_torch.py --layer moh_llama --out d.safetensors --embed-dim 64 --heads 8 "
               "--kv-heads 2 --causal --decode-from 4\n"
               "  export_torch.py --verify-fixtures ../shared/fixtures/families\n"
               "  export_torch.py --roundtrip build/rt --parity build/tools/moh_parity --families\n"
               "exit status: 0 ok, 1 a case failed, 2 bad usage",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_argument_group("mode (exactly one)")
    mode.add_argument("--layer", choices=LAYERS, help="export a random layer of this kind")
    mode.add_argument("--verify-fixtures", metavar="DIR",
                      help="run the torch modules on DIR/*.safetensors and compare with the stored outputs")
    mode.add_argument("--roundtrip", metavar="DIR",
                      help="export the built-in cases into DIR and run --parity on them")
    p.add_argument("--out", metavar="FILE", help="case file to write (with --layer)")
    p.add_argument("--parity", metavar="EXE", help="moh_parity executable (with --roundtrip)")
    p.add_argument("--families", action="store_true",
                   help="with --roundtrip: also the cases of docs/semantics.md §6-9 (moh_vit, "
                        "jetmoe, qkv_bias, qk_norm, memory, kdim, attn_bias, query padding)")
    p.add_argument("--batch", type=int, metavar="B", help="sequences (default 2)")
    p.add_argument("--tokens", type=int, metavar="T",
                   help="tokens per sequence (default 7; moh_vit: the grid's)")
    p.add_argument("--embed-dim", type=int, metavar="D", help="model width (default 32)")
    p.add_argument("--heads", type=int, metavar="H", help="query heads (default 4; not moa, jetmoe)")
    p.add_argument("--head-dim", type=int, metavar="d",
                   help="head size (default D/H; moa D/4; jetmoe D/kv-heads; mha must be D/H; "
                        "moh_vit is always D/H)")
    p.add_argument("--shared", type=int, metavar="S",
                   help="shared heads (moh, moh_vit default 1, moh_llama default H/2; "
                        "--shared H --routed-active 0 is MoH's dense variant)")
    p.add_argument("--routed-active", type=int, metavar="K",
                   help="routed heads each token keeps (default max(1, (H-S)/2))")
    p.add_argument("--experts", type=int, metavar="E", help="moa, jetmoe: experts (default 4)")
    p.add_argument("--top-k", type=int, metavar="k", help="moa, jetmoe: experts per token (default 2)")
    p.add_argument("--kv-heads", type=int, metavar="G",
                   help="moh_llama: key/value heads (default H); jetmoe: heads of each expert (default 2)")
    p.add_argument("--rope-theta", type=float, metavar="BASE",
                   help="moh_llama, jetmoe: RoPE base (default 10000)")
    p.add_argument("--decode-from", type=int, metavar="P",
                   help="moh_llama, jetmoe: C++ runs tokens 0..P-1 as a prompt, the rest one by one "
                        "(needs --causal)")
    p.add_argument("--causal", action="store_true", help="causal attention (bottom-right aligned)")
    p.add_argument("--padding", nargs="?", const="right", choices=("right", "left"),
                   help="key padding mask: sequence b pads min(b+1, S-1) keys (of x, or of the "
                        "memory) at the end (right, the default) or start (left)")
    p.add_argument("--attn-bias", nargs="?", const="auto", metavar="LAYOUT",
                   help="additive bias on the scores, random with -inf holes and one query row "
                        f"without any key; LAYOUT one of {', '.join(ATTN_BIAS_LAYOUTS)} (1 = "
                        "broadcast; default 1HTS, moa and jetmoe 11TS: their head dimension is 1)")
    p.add_argument("--no-bias", action="store_true", help="mha: projections without bias")
    p.add_argument("--seq-first", action="store_true", help="mha: the torch module uses batch_first=False")
    p.add_argument("--no-qkv-bias", action="store_true",
                   help="moh, moh_vit: qkv without bias (proj always has one)")
    p.add_argument("--qk-norm", action="store_true",
                   help="moh, moh_vit: LayerNorm(d) on each query and key head (q_norm, k_norm)")
    p.add_argument("--memory", type=int, metavar="S",
                   help="mha, moh, moa: cross-attention over a random memory of S tokens")
    p.add_argument("--kdim", type=int, metavar="D_KV", help="moa: the memory's width (default D; needs --memory)")
    p.add_argument("--query-padding", nargs="?", const="right", choices=("right", "left"),
                   help="moa: query padding mask (padded queries route nothing), pattern as --padding")
    p.add_argument("--grid", type=_grid, metavar="HxW",
                   help="moh_vit (required): the token grid, T = H*W in row-major order")
    p.add_argument("--pretrain-grid", type=_grid, metavar="HxW",
                   help="moh_vit: the pretraining grid that scales the position bias (default "
                        "--grid; both sides at least 2)")
    p.add_argument("--train-tokens", type=int, metavar="N0",
                   help="moh_vit: N_0, the scale is ln N_0 (default the pretraining grid's tokens)")
    p.add_argument("--seed", type=int, metavar="N", help="torch.manual_seed (default 0)")
    return p


def _validate(p, a):
    """Exits with status 2 and a message naming the option for any bad combination."""
    modes = [m for m in ("layer", "verify_fixtures", "roundtrip") if getattr(a, m) is not None]
    if len(modes) != 1:
        p.error("give exactly one of --layer, --verify-fixtures, --roundtrip"
                + (f" (got {', '.join('--' + m.replace('_', '-') for m in modes)})" if modes else ""))
    if a.layer is None:
        given = [opt for opt in _EXPORT_OPTIONS if getattr(a, opt) not in (None, False)]
        if a.out is not None:
            given.insert(0, "out")
        if given:
            p.error(f"--{given[0].replace('_', '-')} applies only to --layer")
    if a.roundtrip is None and a.families:
        p.error("--families applies only to --roundtrip")
    if a.verify_fixtures is not None:
        if not os.path.isdir(a.verify_fixtures):
            p.error(f"--verify-fixtures: expected a directory, got '{a.verify_fixtures}'")
        if not glob.glob(os.path.join(a.verify_fixtures, "*.safetensors")):
            p.error(f"--verify-fixtures: no *.safetensors in '{a.verify_fixtures}'")
        return
    if a.roundtrip is not None:
        if not a.parity:
            p.error("--roundtrip needs --parity EXE (the moh_parity executable)")
        if not (os.path.isfile(a.parity) and os.access(a.parity, os.X_OK)):
            p.error(f"--parity: expected an executable file, got '{a.parity}'")
        return
    if a.parity is not None:
        p.error("--parity applies only to --roundtrip")
    if not a.out:
        p.error("--layer needs --out FILE")
    if a.no_bias and a.layer in ("moh", "moh_vit"):
        p.error(f"--no-bias applies only to --layer mha; for --layer {a.layer} use --no-qkv-bias "
                "(proj always has a bias)")
    for opt, layers in _LAYER_OPTIONS.items():
        value = getattr(a, opt)
        if value not in (None, False) and a.layer not in layers:
            p.error(f"--{opt.replace('_', '-')} applies only to --layer {' or '.join(layers)}, "
                    f"got --layer {a.layer}")
    for opt in ("batch", "tokens", "embed_dim", "heads", "head_dim", "experts", "top_k", "kv_heads",
                "memory", "kdim", "train_tokens"):
        value = getattr(a, opt)
        if value is not None and value < 1:
            p.error(f"--{opt.replace('_', '-')}: expected a positive integer, got {value}")
    for opt in ("shared", "routed_active", "decode_from", "seed"):
        value = getattr(a, opt)
        if value is not None and value < 0:
            p.error(f"--{opt.replace('_', '-')}: expected an integer >= 0, got {value}")
    if a.layer == "moh_vit":
        if a.grid is None:
            p.error("--layer moh_vit needs --grid HxW (the tokens' grid)")
        T = a.grid[0] * a.grid[1]
        if a.tokens is not None and a.tokens != T:
            p.error(f"--tokens: the grid {a.grid[0]}x{a.grid[1]} has {T} tokens, got {a.tokens}")
        a.tokens = T
        h0, w0 = a.pretrain_grid or a.grid
        if h0 < 2 or w0 < 2:
            p.error(f"--pretrain-grid: expected both sides at least 2, got {h0}x{w0}"
                    + ("" if a.pretrain_grid else " (from --grid; give --pretrain-grid)"))
        if a.train_tokens is not None and a.train_tokens < 2:
            p.error(f"--train-tokens: expected at least 2 (the scale is ln N0), got {a.train_tokens}")
    for opt, default in (("batch", 2), ("tokens", 7), ("embed_dim", 32), ("seed", 0)):
        if getattr(a, opt) is None:
            setattr(a, opt, default)
    parent = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(parent):
        p.error(f"--out: folder '{parent}' does not exist")
    if a.kdim is not None and a.memory is None:
        p.error("--kdim is the memory's width: it needs --memory S")
    if a.attn_bias is not None:
        if a.attn_bias == "auto":
            a.attn_bias = "11TS" if a.layer in _SINGLE_BIAS_HEAD else "1HTS"
        a.attn_bias = a.attn_bias.upper()
        if a.attn_bias not in ATTN_BIAS_LAYOUTS:
            p.error(f"--attn-bias: expected one of {', '.join(ATTN_BIAS_LAYOUTS)}, got '{a.attn_bias}'")
        if a.layer in _SINGLE_BIAS_HEAD and a.attn_bias[1] == "H":
            p.error(f"--attn-bias: a {a.layer} bias has one head row: expected B1TS or 11TS, "
                    f"got {a.attn_bias}")
        if a.decode_from is not None:
            p.error("--attn-bias with --decode-from: how a bias splits over the decoding calls is "
                    "not specified; drop one of them")
    D, H = a.embed_dim, a.heads if a.heads is not None else 4
    if a.layer == "mha" and D % H:
        p.error(f"--layer mha exports torch.nn.MultiheadAttention: expected --embed-dim a multiple "
                f"of --heads {H}, got {D}")
    if a.layer == "moh_vit" and D % H:
        p.error(f"--layer moh_vit: the head size is embed_dim / heads: expected --embed-dim a "
                f"multiple of --heads {H}, got {D}")
    G = a.kv_heads if a.kv_heads is not None else (2 if a.layer == "jetmoe" else H)
    if a.layer == "jetmoe":
        if a.head_dim is None and D % G:
            p.error(f"--embed-dim {D} is not a multiple of --kv-heads {G}: give --head-dim")
        d = a.head_dim if a.head_dim is not None else D // G
    elif a.layer == "moa":
        d = a.head_dim if a.head_dim is not None else max(1, D // 4)
    else:
        if a.head_dim is None and D % H:
            p.error(f"--embed-dim {D} is not a multiple of --heads {H}: give --head-dim")
        d = a.head_dim if a.head_dim is not None else D // H
    if a.layer == "mha" and d * H != D:
        p.error(f"--layer mha exports torch.nn.MultiheadAttention, whose head size is "
                f"embed_dim / heads: expected --head-dim {D // H}, got {d}")
    if a.layer in ("moh", "moh_vit", "moh_llama"):
        S = a.shared if a.shared is not None else min(H // 2 if a.layer == "moh_llama" else 1, H)
        if S > H:
            p.error(f"--shared: expected 0..{H} (--heads), got {S}")
        if a.routed_active is not None and a.routed_active > H - S:
            p.error(f"--routed-active: expected 0..{H - S} (heads - shared), got {a.routed_active}")
        if a.routed_active == 0 and S == 0:
            p.error("--shared 0 with --routed-active 0: no head would ever be active")
    if a.layer in ("moa", "jetmoe"):
        E = a.experts if a.experts is not None else 4
        k = a.top_k if a.top_k is not None else 2
        if k > E:
            p.error(f"--top-k: expected 1..{E} (--experts), got {k}")
    if a.layer in ("moh_llama", "jetmoe"):
        if a.layer == "moh_llama" and H % G:
            p.error(f"--kv-heads: expected a divisor of --heads {H}, got {G}")
        if d % 2:
            p.error(f"--head-dim: RoPE needs an even head size, got {d}")
        if a.rope_theta is not None and not (math.isfinite(a.rope_theta) and a.rope_theta > 0):
            p.error(f"--rope-theta: expected a positive number, got {a.rope_theta}")
        if a.decode_from is not None:
            if a.decode_from > a.tokens:
                p.error(f"--decode-from: expected 0..{a.tokens} (--tokens), got {a.decode_from}")
            if not a.causal:
                p.error("--decode-from needs --causal (decoding token by token is causal)")


def main(argv=None):
    p = _parser()
    a = p.parse_args(argv)
    _validate(p, a)
    try:
        if a.verify_fixtures is not None:
            return 1 if verify_fixtures(a.verify_fixtures) else 0
        if a.roundtrip is not None:
            return roundtrip(a.roundtrip, a.parity, families=a.families)
        export_random(a.out, a.layer, batch=a.batch, tokens=a.tokens, embed_dim=a.embed_dim,
                      heads=a.heads, head_dim=a.head_dim, shared=a.shared,
                      routed_active=a.routed_active, experts=a.experts, top_k=a.top_k,
                      kv_heads=a.kv_heads, causal=a.causal, padding=a.padding,
                      decode_from=a.decode_from, rope_theta=a.rope_theta, bias=not a.no_bias,
                      seq_first=a.seq_first, seed=a.seed, qkv_bias=not a.no_qkv_bias,
                      qk_norm=a.qk_norm, memory=a.memory, kdim=a.kdim, attn_bias=a.attn_bias,
                      query_padding=a.query_padding, grid=a.grid, pretrain_grid=a.pretrain_grid,
                      train_tokens=a.train_tokens)
        print(f"wrote {a.out}")
        return 0
    except CaseError as e:
        print(f"export_torch: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
