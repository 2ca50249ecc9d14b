#!/usr/bin/env python3
"""Turns moh_bench's JSON output into markdown tables and a gnuplot chart. Standard library only.

    bench/report.py RESULTS_JSON [MORE_JSON ...] [--out-dir DIR] [--no-plot]

Several JSON files (rounds of one binary, run in turn) pool their repetitions. Writes
DIR/results.md (DIR defaults to the first JSON's folder), DIR/moh_vs_active.dat and .gp, runs
gnuplot (when installed) to draw DIR/moh_vs_active.png, and prints the markdown to stdout.

Every number is the median over the repetitions of one benchmark (run the benchmark with
--benchmark_repetitions=N --benchmark_report_aggregates_only=false). Times are CPU time of the
benchmark thread for single-threaded runs and wall time for runs named .../real_time (the ones
that use a thread pool): the same basis Google Benchmark uses for their rate counters.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import OrderedDict

UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
STANDARD_FIELDS = {
    "name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
    "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit", "label",
    "error_occurred", "error_message", "aggregate_name", "aggregate_unit",
}


class Run:
    """All repetitions of one benchmark instance, reduced to medians."""

    def __init__(self, run_name):
        self.run_name = run_name
        parts = run_name.split("/")
        self.family = parts[0]
        self.params = OrderedDict()
        self.real_time = "/real_time" in run_name  # before /threads:N when both
        for p in parts[1:]:
            if ":" in p:
                k, v = p.split(":", 1)
                self.params[k] = int(v) if v.lstrip("-").isdigit() else v
        self.times_ms = []
        self.counters = {}
        self.label = ""
        self.order = (0, 0)  # registration order in moh_bench (family, instance)

    def add(self, b):
        scale = UNIT_MS[b.get("time_unit", "ns")]
        t = b["real_time"] if self.real_time else b["cpu_time"]
        self.times_ms.append(t * scale)
        for k, v in b.items():
            if k not in STANDARD_FIELDS and isinstance(v, (int, float)):
                self.counters.setdefault(k, []).append(float(v))
        self.label = b.get("label", self.label)
        self.order = (b.get("family_index", 0), b.get("per_family_instance_index", 0))

    @property
    def ms(self):
        return statistics.median(self.times_ms)

    def c(self, name, default=None):
        vals = self.counters.get(name)
        return statistics.median(vals) if vals else default

    def p(self, name):
        return self.params.get(name)

    @property
    def reps(self):
        return len(self.times_ms)


def load_runs(paths):
    """Every repetition of every benchmark in the files, pooled by name; the first file's context."""
    datas = []
    for path in paths:
        with open(path) as f:
            datas.append(json.load(f))
    runs = OrderedDict()
    errors = []
    for b in (b for data in datas for b in data.get("benchmarks", [])):
        if b.get("run_type", "iteration") != "iteration":
            continue
        if b.get("error_occurred"):
            errors.append(f"{b['name']}: {b.get('error_message', 'error')}")
            continue
        name = b.get("run_name", b["name"])
        runs.setdefault(name, Run(name)).add(b)
    # Repetitions run interleaved in random order (run_suite.sh); report in registration order.
    runs = OrderedDict(sorted(runs.items(), key=lambda item: item[1].order))
    return datas[0].get("context", {}), runs, errors


def cpu_model():
    """The CPU's model name: from lscpu, else /proc/cpuinfo."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def fmt(x, digits=2):
    if x is None:
        return "n/a"
    if digits == 0:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def by_family(runs, family):
    return [r for r in runs.values() if r.family == family]


def shape_key(r):
    return (r.p("batch"), r.p("tokens"), r.p("d_model"))


def shape_title(r):
    return (f"batch {r.p('batch')}, tokens {r.p('tokens')}, d_model {r.p('d_model')}")


def prefill_section(runs, lines, plot_blocks):
    # Rows with another weight storage (".../weights:native", the companions of MoH-ViT's rows in
    # families.md) would share a key with the row they accompany.
    mha = {(*shape_key(r), r.p("heads")): r for r in by_family(runs, "BM_MHA_Prefill")
           if r.p("weights") is None}
    moh = by_family(runs, "BM_MoH_Prefill")
    gemm = {(r.p("rows"), r.p("in")): r for r in by_family(runs, "BM_GEMM")}
    moh_gemm = {(r.p("rows"), r.p("in")): r for r in by_family(runs, "BM_MohGEMM")}
    shapes = list(OrderedDict.fromkeys([(*shape_key(r), r.p("heads"))
                                        for r in list(mha.values()) + moh]))
    if not shapes:
        return
    lines.append("## Prefill: MHA vs MoH (1 thread, non-causal)")
    lines.append("")
    lines.append("MoH: learned router with seeded random weights, sparse path. Active heads "
                 "A = round(P H / 100); shared S = max(1, H/8) at P = 25, else H/4; routed "
                 "K = A - S per token. `vs MHA` = MoH time / MHA time in the same run "
                 "(< 1: MoH is faster).")
    lines.append("")
    for (B, T, D, H) in shapes:
        base = mha.get((B, T, D, H))
        rows = []
        if base:
            rows.append(["MHA", "100", "-", "-", "1.000", fmt(base.ms, 3), "1.00",
                         fmt(base.c("GFLOPs"), 1), fmt(base.c("tokens_per_s"), 0)])
        block = []
        for r in sorted((r for r in moh if (*shape_key(r), r.p("heads")) == (B, T, D, H)),
                        key=lambda r: r.p("active_pct")):
            ratio = r.ms / base.ms if base else None
            rows.append(["MoH", str(r.p("active_pct")), fmt(r.c("shared_heads"), 0),
                         fmt(r.c("routed_k"), 0), fmt(r.c("active_ratio"), 3), fmt(r.ms, 3),
                         fmt(ratio), fmt(r.c("GFLOPs"), 1), fmt(r.c("tokens_per_s"), 0)])
            block.append((r.c("active_ratio"), ratio, r.ms, r.p("active_pct")))
        lines.append(f"### {shape_title(base or moh[0])}, heads {H} (d = {D // H})")
        lines.append("")
        lines += table(["layer", "active %", "shared S", "routed K", "active ratio",
                        "time ms (median)", "vs MHA", "GFLOP/s", "tokens/s"], rows)
        g = gemm.get((B * T, D))
        if g:
            note = (f"Projection GEMM [{B * T} x {D}] x [{D} x {3 * D}] (Eigen, row-major): "
                    f"{fmt(g.ms, 3)} ms, {fmt(g.c('GFLOPs'), 1)} GFLOP/s")
            if base and g.c("GFLOPs"):
                note += (f"; MHA runs at {100 * base.c('GFLOPs') / g.c('GFLOPs'):.0f}% "
                         "of that rate.")
            mg = moh_gemm.get((B * T, D))
            if mg and mg.c("GFLOPs"):
                note += (f" moh's own GEMM (moh::linear) at the same shape: {fmt(mg.ms, 3)} ms, "
                         f"{fmt(mg.c('GFLOPs'), 1)} GFLOP/s, "
                         f"{mg.c('GFLOPs') / g.c('GFLOPs'):.2f}x Eigen's rate.")
            lines.append("")
            lines.append(note)
        lines.append("")
        if base and block:
            plot_blocks.append((f"B={B} T={T} D={D} H={H}", block))


def moa_section(runs, lines):
    moa = by_family(runs, "BM_MoA_Prefill")
    if not moa:
        return
    mha = {shape_key(r): r for r in by_family(runs, "BM_MHA_Prefill")}
    lines.append("## Prefill: MoA time vs number of experts (1 thread, non-causal)")
    lines.append("")
    lines.append("Sparse path, softmax top-k gating, one shared key/value head of size d. "
                 "`vs E=8` = time / time at E = 8 with the same k; `vs MHA` = time / dense MHA "
                 "time at the same shape.")
    lines.append("")
    groups = OrderedDict()
    for r in moa:
        groups.setdefault((*shape_key(r), r.p("head_dim"), r.p("top_k")), []).append(r)
    for (B, T, D, d, k), rs in groups.items():
        rs.sort(key=lambda r: r.p("experts"))
        ref = next((r for r in rs if r.p("experts") == 8), None)
        base = mha.get((B, T, D))
        rows = []
        for r in rs:
            rows.append([str(r.p("experts")), str(k), fmt(r.c("active_ratio"), 4), fmt(r.ms, 3),
                         fmt(r.ms / ref.ms) if ref else "n/a",
                         fmt(r.ms / base.ms) if base else "n/a",
                         fmt(r.c("GFLOPs"), 1), fmt(r.c("tokens_per_s"), 0)])
        lines.append(f"### {shape_title(rs[0])}, head_dim {d}, top_k {k}")
        lines.append("")
        lines += table(["experts E", "top_k", "k/E", "time ms (median)", "vs E=8", "vs MHA",
                        "GFLOP/s", "tokens/s"], rows)
        lines.append("")


def decode_section(runs, lines):
    mha = by_family(runs, "BM_MHA_Decode")
    moh = by_family(runs, "BM_MoH_Decode")
    copy = by_family(runs, "BM_MemCopy")
    all_reads = by_family(runs, "BM_MemRead")
    reads = [r for r in all_reads if (r.p("threads") or 1) == 1]
    pair = [r for r in all_reads if (r.p("threads") or 1) > 1]
    if not (mha or moh or copy or reads):
        return
    lines.append("## Decode: one causal step at context C (1 thread unless `threads` says otherwise)")
    lines.append("")
    rw = None
    read = reads[0].c("read_GBps") if reads else None
    read_on = {r.p("threads"): r.c("read_GBps") for r in pair}  # threads -> combined rate
    if reads:
        lines.append(f"read of {reads[0].p('bytes') / 2**20:.0f} MiB (BM_MemRead, a vectorised "
                     f"sum of 8 parts side by side on one core, huge pages where the system "
                     f"allows): "
                     f"{fmt(reads[0].ms, 2)} ms, {fmt(read, 2)} GB/s. `% of read` = total GB/s / "
                     "this rate: how close a step comes to streaming its bytes at the rate one "
                     "core reads memory.")
        for r in pair:
            # Google Benchmark reports a threaded row's time as the wall time over the
            # iterations of all its threads (half a share's read time on two threads), so the
            # combined rate is read_GBps (every thread's bytes over that wall time), not bytes
            # / time, which counts it twice.
            lines.append(f"On {r.p('threads')} threads (each reads its share of the bytes): "
                         f"{fmt(r.c('read_GBps'), 2)} GB/s together; `% of read` of a "
                         f"`threads:{r.p('threads')}` row is against this rate.")
        lines.append("")
    if copy:
        m = copy[0]
        bps = m.c("bytes_per_second")
        rw = m.c("rw_GBps")
        lines.append(f"memcpy of {m.p('bytes') / 2**20:.0f} MiB: {fmt(m.ms, 2)} ms, "
                     f"{fmt(bps / 1e9 if bps else None, 2)} GB/s copied = "
                     f"{fmt(rw, 2)} GB/s of read + write traffic. `% of memcpy` = total GB/s / "
                     "memcpy read + write GB/s; above 100% part of the step's data (small "
                     "caches, the weights) is served from the CPU caches.")
        lines.append("")
    if not (mha or moh):
        return
    lines.append("kv GB/s counts the key/value bytes the step reads (for MoH, the kv heads of "
                 "the active query heads); total GB/s adds the weight bytes it touches. "
                 "`vs MHA` = time / MHA time at the same shape.")
    lines.append("")

    def key(r):
        return (r.p("batch"), r.p("context"), r.p("d_model"), r.p("heads"), r.p("kv_heads"))

    def variant(r):  # rows compare with the MHA row of the same weights and threads
        return (key(r), r.p("bf16") or 0, r.p("threads") or 1, r.p("ragged") or 0,
                r.p("kv_bf16") or 0)

    def step_us(r):  # a threads:N row's time is its wall time per step
        return r.c("wall_us") if (r.p("threads") or 1) > 1 else r.ms * 1e3

    base = {variant(r): r for r in mha}
    keys = list(OrderedDict.fromkeys(key(r) for r in mha + moh))
    keys.sort(key=lambda k: (k[2], k[1]))
    rows = []
    for k in keys:
        members = sorted((r for r in mha + moh if key(r) == k),
                         key=lambda r: (r.p("bf16") or 0, r.p("kv_bf16") or 0,
                                        r.p("threads") or 1, r.p("ragged") or 0,
                                        r.family != "BM_MHA_Decode",
                                        r.p("active_pct") or 0))
        for r in members:
            b = base.get(variant(r))
            is_mha = r.family == "BM_MHA_Decode"
            tot = r.c("total_GBps")
            if (r.p("threads") or 1) > 1 and r.c("step_MB") and step_us(r):
                tot = r.c("step_MB") / step_us(r) * 1e3  # its rate counters use CPU time
            own_read = read_on.get(r.p("threads") or 1, read)  # the same cores' read rate
            rows.append([
                f"({', '.join(str(v) for v in k)})",
                ("MHA" if is_mha else "MoH") + (" bf16" if r.p("bf16") else "") +
                (f" {r.p('threads')} threads" if (r.p("threads") or 1) > 1 else "") +
                (" ragged" if r.p("ragged") else "") +
                (" bf16 cache" if r.p("kv_bf16") else ""),
                "100" if is_mha else str(r.p("active_pct")),
                "-" if is_mha else f"{fmt(r.c('shared_heads'), 0)}/{fmt(r.c('routed_k'), 0)}",
                fmt(step_us(r), 0), fmt(step_us(r) / step_us(b)) if b else "n/a",
                fmt(r.c("kv_heads_read"), 0), fmt(r.c("step_MB"), 1), fmt(r.c("kv_GBps"), 1),
                fmt(tot, 1), f"{100 * tot / own_read:.0f}%" if (tot and own_read) else "n/a",
                f"{100 * tot / rw:.0f}%" if (tot and rw) else "n/a",
                fmt(r.c("GFLOPs"), 1), fmt(r.c("tokens_per_s"), 0), r.label or "",
            ])
    threaded = [r for r in mha if (r.p("threads") or 1) > 1]
    lines += table(["(B, C, D, H, kv heads)", "layer", "active %", "S/K", "time us (median)",
                    "vs MHA", "kv heads read", "MB per step", "kv GB/s", "total GB/s",
                    "% of read", "% of memcpy", "GFLOP/s", "tokens/s", "settings"], rows,
                   ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:",
                    "---:", "---:", "---:", "---:", "---"])
    lines.append("")
    for r in threaded:
        one = base.get((key(r), r.p("bf16") or 0, 1, 0, 0))
        if one:
            lines.append(f"`{r.run_name}`: wall {fmt(step_us(r), 0)} us per step against "
                         f"{fmt(one.c('wall_us') or one.ms * 1e3, 0)} us on one thread: "
                         f"**{fmt((one.c('wall_us') or one.ms * 1e3) / step_us(r))}x** faster.")
            lines.append("")


def threads_section(runs, lines):
    fams = ["BM_MHA_Prefill_Threads", "BM_MoH_Prefill_Threads"]
    rs = [r for f in fams for r in by_family(runs, f)]
    if not rs:
        return
    lines.append("## Thread scaling: prefill batch 1, tokens 2048, d_model 1024, heads 16 "
                 "(moh::ThreadPool of N threads, wall time)")
    lines.append("")
    rows = []
    for f in fams:
        group = sorted(by_family(runs, f), key=lambda r: r.p("threads"))
        one = next((r for r in group if r.p("threads") == 1), None)
        for r in group:
            n = r.p("threads")
            sp = one.ms / r.ms if one else None
            layer = "MHA" if f.startswith("BM_MHA") else f"MoH {r.p('active_pct')}%"
            rows.append([layer, str(n), fmt(r.ms, 2), fmt(sp),
                         f"{100 * sp / n:.0f}%" if sp else "n/a", fmt(r.c("GFLOPs"), 1),
                         fmt(r.c("tokens_per_s"), 0)])
    lines += table(["layer", "threads", "time ms (median, wall)", "speedup vs 1 thread",
                    "efficiency", "GFLOP/s", "tokens/s"], rows)
    lines.append("")


def write_plot(out_dir, blocks):
    """Writes the .dat and .gp files; returns the .gp path (None without data)."""
    if not blocks:
        return None
    dat = os.path.join(out_dir, "moh_vs_active.dat")
    with open(dat, "w") as f:
        f.write("# active_ratio  time_vs_MHA  time_ms  active_pct  (one block per shape)\n")
        for title, pts in blocks:
            f.write(f"# {title}\n")
            for (a, ratio, ms, pct) in sorted(pts):
                f.write(f"{a:.6f} {ratio:.6f} {ms:.6f} {pct}\n")
            f.write("\n\n")
    gp = os.path.join(out_dir, "moh_vs_active.gp")
    png = os.path.join(out_dir, "moh_vs_active.png")
    plots = [f"'{os.path.basename(dat)}' index {i} using 1:2 with linespoints lw 2 pt 7 "
             f"title '{title}'" for i, (title, _) in enumerate(blocks)]
    plots.append("1 with lines lw 2 dt 2 lc rgb 'black' title 'MHA (dense, same run)'")
    plots.append("x with lines lw 1 dt 3 lc rgb 'gray40' title 'time proportional to active ratio'")
    with open(gp, "w") as f:
        f.write("# gnuplot script written by bench/report.py; run it from this folder.\n")
        f.write("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
                "  set terminal pngcairo size 960,640 enhanced font 'Sans,11'\n"
                "} else {\n  set terminal png size 960,640\n}\n")
        f.write(f"set output '{os.path.basename(png)}'\n")
        f.write("set title 'MoH prefill time relative to dense MHA (1 thread, medians)'\n")
        f.write("set xlabel 'active ratio (shared + K) / H'\n")
        f.write("set ylabel 'MoH time / MHA time'\n")
        f.write("set xrange [0:1.05]\nset yrange [0:*]\nset grid\n"
                "set key right bottom opaque box samplen 3\n")
        f.write("plot " + ", \\\n     ".join(plots) + "\n")
    return gp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results_json", nargs="+")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true", help="write the .gp file, do not run it")
    args = ap.parse_args()
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.results_json[0]))
    os.makedirs(out_dir, exist_ok=True)

    context, runs, errors = load_runs(args.results_json)
    if not runs:
        sys.exit(f"report.py: no benchmark runs in {' '.join(args.results_json)}")
    reps = sorted({r.reps for r in runs.values()})
    lines = ["# moh benchmark results", ""]
    lines.append(f"- date: {context.get('date', '?')}; host: {context.get('host_name', '?')}; "
                 f"CPU: {cpu_model()}, {context.get('num_cpus', '?')} logical CPUs at "
                 f"{context.get('mhz_per_cpu', '?')} MHz")
    caches = ", ".join(f"L{c['level']} {c['type'][0].lower()} {c['size'] // 1024} KiB"
                       + (f" x{c['num_sharing']}" if c.get("num_sharing", 0) > 1 else "")
                       for c in context.get("caches", []))
    if caches:
        lines.append(f"- caches: {caches}")
    load = context.get("load_avg")
    if load:
        lines.append(f"- load average at start: {', '.join(f'{x:.2f}' for x in load)} "
                     "(shared machine: expect noise)")
    lines.append(f"- threads: 1 (ForwardOptions::pool = nullptr) unless a table says otherwise; "
                 f"medians of {'/'.join(str(n) for n in reps)} repetitions")
    lines.append("- time basis: CPU time of the benchmark thread for single-threaded runs, wall "
                 "time for the thread-pool runs; GFLOP/s and tokens/s use the same basis")
    if context.get("library_build_type") == "debug":
        lines.append("- Google Benchmark reports its own library as a debug build (Debian's "
                     "package); moh_bench itself is built in Release")
    lines.append("")
    if errors:
        lines.append("**Benchmarks that failed:** " + "; ".join(errors))
        lines.append("")

    blocks = []
    prefill_section(runs, lines, blocks)
    moa_section(runs, lines)
    threads_section(runs, lines)
    decode_section(runs, lines)

    gp = write_plot(out_dir, blocks)
    png = os.path.join(out_dir, "moh_vs_active.png")
    if gp:
        if args.no_plot:
            lines.append(f"Chart script: `{gp}` (not run: --no-plot).")
        elif shutil.which("gnuplot") is None:
            msg = (f"gnuplot not found: chart not drawn; install gnuplot-nox and run "
                   f"`cd {out_dir} && gnuplot moh_vs_active.gp`")
            print(f"report.py: {msg}", file=sys.stderr)
            lines.append(f"Chart: {msg}.")
        else:
            res = subprocess.run(["gnuplot", os.path.basename(gp)], cwd=out_dir,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                print(f"report.py: gnuplot failed:\n{res.stderr}", file=sys.stderr)
                lines.append(f"Chart: gnuplot failed ({res.stderr.strip().splitlines()[-1:]}).")
            else:
                lines.append(f"Chart: `{png}` (MoH time / MHA time against the active ratio).")
        lines.append("")

    md = "\n".join(lines)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
