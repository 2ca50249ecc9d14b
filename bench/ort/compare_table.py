#!/usr/bin/env python3
"""Merges onnxruntime-node timings (run_ort.js JSON lines) and moh_bench's BM_MHA_Prefill JSON into
one markdown table. Standard library only.

    compare_table.py --torch VERSION --ort R1.jsonl [R2.jsonl ...] --moh R1.json [R2.json ...]

Several files per side (rounds run alternately) are pooled: each time is the median of every
sample of that shape across the rounds.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from report import UNIT_MS, cpu_model  # noqa: E402  (bench/report.py)


def mha_flops(b, t, d_model, heads):
    n, d = b * t, d_model // heads
    return 2 * n * d_model * 3 * d_model + 4 * b * heads * t * t * d + 2 * n * d_model * d_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch", default="?")
    ap.add_argument("--ort", nargs="+", required=True)
    ap.add_argument("--moh", nargs="+", required=True)
    args = ap.parse_args()
    torch_version = args.torch
    ort = {}
    ort_meta = {}
    for path in args.ort:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                key = (r["batch"], r["tokens"], r["d_model"], r["heads"])
                ort.setdefault(key, {"cpu": [], "wall": []})
                ort[key]["cpu"] += r["cpu_samples"]
                ort[key]["wall"] += r["wall_samples"]
                ort_meta = r
    moh = {}
    context = {}
    for path in args.moh:
        with open(path) as f:
            bench = json.load(f)
        context = bench.get("context", context)
        for b in bench["benchmarks"]:
            if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
                continue
            m = re.match(r"BM_MHA_Prefill/batch:(\d+)/tokens:(\d+)/d_model:(\d+)/heads:(\d+)$",
                         b["run_name"])
            if not m:
                continue
            key = tuple(int(g) for g in m.groups())
            scale = UNIT_MS[b.get("time_unit", "ns")]
            moh.setdefault(key, {"cpu": [], "wall": []})
            moh[key]["cpu"].append(b["cpu_time"] * scale)
            moh[key]["wall"].append(b["real_time"] * scale)

    ort_version = ort_meta.get("ort_version", "?")
    runs = max((len(v["cpu"]) for v in ort.values()), default=0)
    reps = max((len(v["cpu"]) for v in moh.values()), default=0)
    rounds = len(args.moh)
    print("# Dense MHA: moh vs ONNX Runtime (CPU, one thread)")
    print()
    print(f"- date: {datetime.date.today().isoformat()}; machine: {cpu_model()}, "
          f"{context.get('num_cpus', '?')} cores (shared with other jobs, so noisy)")
    print(f"- ONNX Runtime: onnxruntime-node {ort_version}, CPU execution provider, "
          "intraOpNumThreads=1, interOpNumThreads=1, sequential, graph optimisation 'all'; "
          f"model: torch {torch_version} torch.nn.MultiheadAttention(D, H, batch_first=True), "
          f"self-attention q=k=v=x, exported with opset 17; median of {runs} timed runs after warmup; "
          "output checked against torch")
    print(f"- moh and ORT ran alternately in {rounds} rounds in the same script run, so both see "
          "the same machine load; medians pool every round")
    print(f"- moh: BM_MHA_Prefill (MultiHeadAttention<float>, pool = nullptr: one thread, "
          f"non-causal, bias), median of {reps} repetitions")
    print("- time = CPU time (ORT: process CPU time per run; moh: the benchmark thread's CPU time),"
          " because the machine is shared; wall-clock medians in the last two columns")
    print("- speed ratio = ORT time / moh time (> 1: moh is faster); "
          "GFLOP/s = (2 N D 3D + 4 B H T^2 d + 2 N D D) / time")
    print()
    print("| shape (B, T, D, H) | ORT ms | moh ms | moh/ORT speed | ORT GFLOP/s | moh GFLOP/s "
          "| ORT wall ms | moh wall ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key in list(ort) + [k for k in moh if k not in ort]:
        flops = mha_flops(*key)
        o = ort.get(key)
        m = moh.get(key)
        o_ms = statistics.median(o["cpu"]) if o else None
        m_ms = statistics.median(m["cpu"]) if m else None
        cells = [f"({', '.join(str(v) for v in key)})",
                 f"{o_ms:.2f}" if o_ms else "n/a",
                 f"{m_ms:.2f}" if m_ms else "n/a",
                 f"{o_ms / m_ms:.2f}x" if o_ms and m_ms else "n/a",
                 f"{flops / o_ms * 1e-6:.1f}" if o_ms else "n/a",
                 f"{flops / m_ms * 1e-6:.1f}" if m_ms else "n/a",
                 f"{statistics.median(o['wall']):.2f}" if o else "n/a",
                 f"{statistics.median(m['wall']):.2f}" if m else "n/a"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
