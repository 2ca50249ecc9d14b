#!/usr/bin/python3
"""Exports torch.nn.MultiheadAttention(D, H, batch_first=True) self-attention (q = k = v = x) to
ONNX (opset 17) at the benchmark shapes, with a reference input/output pair per model.

Run with Debian's python3-torch: /usr/bin/python3 bench/ort/export_mha.py OUT_DIR
Writes OUT_DIR/mha_B_T_D_H.onnx, .in.bin and .out.bin (float32, row-major [B, T, D]) and
OUT_DIR/models.json listing them.
"""
import json
import os
import sys

import torch

SHAPES = [(1, 197, 768, 12), (8, 256, 512, 8), (1, 2048, 1024, 16)]


class SelfAttention(torch.nn.Module):
    """y = MultiheadAttention(x, x, x), no attention weights returned."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(d_model, heads, batch_first=True)

    def forward(self, x):
        # The module's own math (torch.nn.functional.multi_head_attention_forward, the path the
        # module takes outside its inference fast path, which has no ONNX export).
        m = self.mha
        xt = x.transpose(0, 1)  # [T, B, D]
        y, _ = torch.nn.functional.multi_head_attention_forward(
            xt, xt, xt, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias,
            None, None, False, 0.0, m.out_proj.weight, m.out_proj.bias,
            training=False, need_weights=False)
        return y.transpose(0, 1)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "ort-models"
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    models = []
    for (b, t, d, h) in SHAPES:
        module = SelfAttention(d, h).eval()
        x = torch.rand(b, t, d) * 2 - 1
        with torch.no_grad():
            ref = module(x)
            direct = module.mha(x, x, x, need_weights=False)[0]
        err = (ref - direct).abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"export_mha: wrapper differs from nn.MultiheadAttention by {err}")
        name = f"mha_{b}_{t}_{d}_{h}"
        path = os.path.join(out_dir, name + ".onnx")
        torch.onnx.export(module, (x,), path, opset_version=17, input_names=["x"],
                          output_names=["y"], do_constant_folding=True)
        x.numpy().astype("float32").tofile(os.path.join(out_dir, name + ".in.bin"))
        ref.numpy().astype("float32").tofile(os.path.join(out_dir, name + ".out.bin"))
        models.append({"name": name, "batch": b, "tokens": t, "d_model": d, "heads": h,
                       "onnx": name + ".onnx", "input": name + ".in.bin",
                       "output": name + ".out.bin"})
        print(f"exported {path} (torch {torch.__version__})", file=sys.stderr)
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(models, f, indent=1)


if __name__ == "__main__":
    main()
