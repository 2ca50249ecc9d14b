#!/usr/bin/env python3
"""moh through Python against PyTorch, one process, one thread, no autograd.

    /usr/bin/python3 python/bench_vs_torch.py [--quick] [--repeats N] [--out PATH]
                                             [--moh-bench PATH] [--no-cpp] [--shapes ...]

Contenders, timed at the prefill shapes of bench/moh_bench.cpp (non-causal self-attention):

  (a) tools/moh_modules.MoHAttention, the stand-in for the authors' MoH code: every head
      computed, the [B, H, T, T] score matrix materialised, then the gates applied;
  (b) torch.nn.MultiheadAttention(batch_first=True), eval(), need_weights=False;
  (c) moh.MultiHeadAttention and moh.MoHAttention called from Python (threads=1), built with
      moh.from_torch from those same torch modules; their outputs are checked against torch's
      once (max abs diff < 1e-3);
  (d) the C++ benchmark rows of the same shapes (build/bench/moh_bench: BM_MHA_Prefill,
      BM_MoH_Prefill/.../active_pct:P), for the binding overhead (moh through Python / C++).

MoH head split: the suite's rule (bench/bench_common.hpp moh_split): active heads
A = round(P H / 100), shared S = H / 4 (max(1, H / 8) at P = 25), routed K = A - S.

Repetitions are interleaved (a, b, c, a, b, c, ...) after one untimed warm-up call of each;
every number is a median. Times are CPU time of the calling thread (time.thread_time, the basis
of moh_bench's one-thread rows; every contender computes on the calling thread) with wall-clock
medians beside them. Each moh call is timed twice in a row: the first (after the torch calls,
cold caches) gives the speed-ups, the second (warm, like moh_bench's back-to-back iterations)
the Python / C++ ratios. Writes a Markdown table to --out and prints it. Exits non-zero on errors
(including a moh output that does not match torch's), never on a missed target.

A full run takes about 8 minutes on one core of a 2.6 GHz EPYC with Debian's PyTorch (reference
BLAS: about 12 s per torch call at the main shape), most of it in the torch contenders.

  --quick       small shapes, 2 repetitions, the C++ rows only if the binary exists (< 60 s);
                default --out build/bench-results/python-vs-torch-quick.md
  --repeats N   timed repetitions per contender (default 5)
  --out PATH    the Markdown file (default bench/results/python-vs-torch.md)
  --moh-bench   the moh_bench binary (default build/bench/moh_bench)
  --no-cpp      skip the C++ rows
  --cpp-interleave  run moh_bench with --benchmark_repetitions=1 after each Python repetition
                instead of once with --benchmark_repetitions=N after the shape's repetitions
                (spreads the C++ samples over the same minutes as the Python ones)
  --shapes      BxTxDxH,... (default: the suite's prefill shapes; --quick: small ones)
  --ratios      active head percentages (default 50,75,100)
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The suite's prefill shapes (bench/moh_bench.cpp kShapes): ViT-B/16 at 224 px, a batched
# mid-size encoder, one long sequence (the main target shape).
SUITE_SHAPES = [(1, 197, 768, 12), (8, 256, 512, 8), (1, 2048, 1024, 16)]
MAIN_SHAPE = (1, 2048, 1024, 16)
QUICK_SHAPES = [(2, 64, 256, 8), (1, 197, 768, 12)]
RATIOS = [50, 75, 100]
TOLERANCE = 1e-3
TARGET_MOH_VS_AUTHORS = 8.0   # moh MoH at 50 % through Python vs the authors' stand-in
TARGET_MHA_VS_TORCH = 3.0     # moh MHA through Python vs torch.nn.MultiheadAttention
TARGET_BINDING = 1.05         # moh MHA through Python / BM_MHA_Prefill


def import_moh():
    try:
        import moh
    except ImportError:
        for build in ("build", "build-py"):
            path = os.path.join(ROOT, build, "python")
            if os.path.isdir(os.path.join(path, "moh")):
                sys.path.insert(0, path)
                break
        import moh
    return moh


def moh_split(heads, active_pct):
    """bench_common.hpp moh_split: (shared S, routed K) for `active_pct` % of `heads`."""
    active = int(math.floor(active_pct * heads / 100.0 + 0.5))  # std::llround, positive
    active = min(max(active, 1), heads)
    shared = max(1, heads // 8) if active_pct == 25 else heads // 4
    shared = min(shared, active)
    return shared, active - shared


# ---- environment ------------------------------------------------------------------------------


def cpu_model():
    """The CPU's model name, as the suite's report (bench/report.py) reads it."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import report
    finally:
        sys.path.pop(0)
    return report.cpu_model()


def torch_blas(torch):
    """torch's BLAS: the build's BLAS_INFO and the BLAS / LAPACK libraries actually loaded."""
    info = "?"
    for part in torch.__config__.show().replace(",", "\n").splitlines():
        if "BLAS_INFO=" in part:
            info = part.split("BLAS_INFO=", 1)[1].strip()
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = os.path.basename(path).lower()
                if any(k in name for k in ("blas", "mkl", "lapack", "blis")):
                    libs.add(os.path.realpath(path))
    except OSError:
        pass
    return info, sorted(libs)


def build_type(cache_dir):
    try:
        with open(os.path.join(cache_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_BUILD_TYPE:"):
                    return line.split("=", 1)[1].strip() or "unset"
    except OSError:
        pass
    return "unknown"


def load_average():
    try:
        return ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


# ---- timing ----------------------------------------------------------------------------------


class Contender:
    """One callable and its timings: `cpu_ms` / `wall_ms` of the interleaved calls and, for moh
    (hot=True), `hot_ms`: a second call right after the first, with the caches warm as in
    moh_bench's back-to-back iterations (the basis of the Python / C++ ratios)."""

    def __init__(self, key, label, fn, hot=False):
        self.key, self.label, self.fn, self.hot = key, label, fn, hot
        self.cpu_ms, self.wall_ms, self.hot_ms = [], [], []

    def _time(self):
        w0, c0 = time.perf_counter(), time.thread_time()
        self.fn()
        c1, w1 = time.thread_time(), time.perf_counter()
        return (c1 - c0) * 1e3, (w1 - w0) * 1e3

    def once(self):
        gc.collect()  # (walks every object: the caches are cold after it, as after torch)
        gc.disable()
        try:
            cpu, wall = self._time()
            self.cpu_ms.append(cpu)
            self.wall_ms.append(wall)
            if self.hot:  # straight after, nothing in between
                self.hot_ms.append(self._time()[0])
        finally:
            gc.enable()

    @property
    def cpu(self):
        return statistics.median(self.cpu_ms)

    @property
    def wall(self):
        return statistics.median(self.wall_ms)

    @property
    def hot_cpu(self):
        return statistics.median(self.hot_ms) if self.hot_ms else None


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def bench_shape(moh, torch, mm, shape, ratios, repeats, after_rep=None, seed=0):
    """Builds the contenders of one shape, checks moh against torch, times them interleaved
    (calling after_rep() after each repetition). Returns {key: Contender},
    [(what, max abs diff, active fraction)]."""
    B, T, D, H = shape
    torch.manual_seed(seed)
    x = torch.rand(B, T, D) * 2 - 1  # uniform [-1, 1), as moh_bench's inputs
    xn = x.numpy()                   # shares x's memory: C-contiguous float32, read in place
    contenders, checks = [], []

    with torch.no_grad():
        mha = torch.nn.MultiheadAttention(D, H, batch_first=True).eval()
        moh_mha = moh.from_torch(mha)
        y_ref = mha(x, x, x, need_weights=False)[0]
        y = moh_mha(xn, threads=1)
        checks.append(("MHA", float(abs(y - y_ref.numpy()).max()), 1.0))
        contenders.append(Contender("torch_mha", "torch.nn.MultiheadAttention",
                                    lambda: mha(x, x, x, need_weights=False)))
        contenders.append(Contender("moh_mha", "moh.MultiHeadAttention (Python)",
                                    lambda: moh_mha(xn, threads=1), hot=True))
        for pct in ratios:
            S, K = moh_split(H, pct)
            authors = mm.MoHAttention(D, H, shared_heads=S, active_routed_heads=K,
                                      qkv_bias=True).eval()
            layer = moh.from_torch(authors)
            routing = moh.MoHRouting()
            y_ref = authors(x).y
            y = layer(xn, threads=1, routing=routing)
            checks.append((f"MoH {pct}% (S={S}, K={K})", float(abs(y - y_ref.numpy()).max()),
                           routing.active_fraction()))
            contenders.append(Contender(f"authors_{pct}", f"authors' MoH stand-in {pct}%",
                                        (lambda m: lambda: m(x))(authors)))
            contenders.append(Contender(f"moh_moh_{pct}", f"moh.MoHAttention {pct}% (Python)",
                                        (lambda l: lambda: l(xn, threads=1))(layer), hot=True))
        # Order of each repetition: (a) the authors' stand-ins, (b) torch MHA, (c) moh.
        order = ([c for c in contenders if c.key.startswith("authors_")] +
                 [c for c in contenders if c.key == "torch_mha"] +
                 [c for c in contenders if c.key.startswith("moh_")])
        for c in order:  # one untimed warm-up each
            c.fn()
        for rep in range(repeats):
            t0 = time.perf_counter()
            for c in order:
                c.once()
            log(f"   repetition {rep + 1}/{repeats}: {time.perf_counter() - t0:.1f} s")
            if after_rep:
                after_rep()
    return {c.key: c for c in order}, checks


# ---- the C++ rows ----------------------------------------------------------------------------


def cpp_names(shape, ratios):
    B, T, D, H = shape
    base = f"batch:{B}/tokens:{T}/d_model:{D}/heads:{H}"
    names = {"mha": f"BM_MHA_Prefill/{base}"}
    for pct in ratios:
        names[pct] = f"BM_MoH_Prefill/{base}/active_pct:{pct}"
    return names


def run_cpp(binary, shape, ratios, repeats):
    """{benchmark name: [CPU ms of each repetition]} of the rows of `shape` that `binary` has,
    and the command line run (None when no row matched)."""
    listed = subprocess.run([binary, "--benchmark_list_tests=true"], capture_output=True,
                            text=True, check=True).stdout.split()
    wanted = [n for n in cpp_names(shape, ratios).values() if n in listed]
    if not wanted:
        return {}, None
    cmd = [binary, "--benchmark_filter=" + "|".join(f"^{n}$" for n in wanted),
           f"--benchmark_repetitions={repeats}", "--benchmark_format=json",
           "--benchmark_enable_random_interleaving=true"]
    log(f"== C++: {shlex.join(cmd)}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
    times = {}
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
            continue
        times.setdefault(b.get("run_name", b["name"]), []).append(
            b["cpu_time"] * unit[b.get("time_unit", "ns")])
    return times, shlex.join(cmd)


# ---- report ----------------------------------------------------------------------------------


def fmt(v, digits=2):
    return "n/a" if v is None else f"{v:,.{digits}f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def table(header, rows, left=1):
    """A Markdown table, the first `left` columns left-aligned, the rest right-aligned."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def shape_str(s):
    return "(" + ", ".join(str(v) for v in s) + ")"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions (< 60 s)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 5)")
    ap.add_argument("--out", default=None, help="Markdown output file")
    ap.add_argument("--moh-bench", default=None, help="moh_bench binary (build/bench/moh_bench)")
    ap.add_argument("--no-cpp", action="store_true", help="skip the C++ rows")
    ap.add_argument("--cpp-interleave", action="store_true",
                    help="run moh_bench once per repetition (--benchmark_repetitions=1), "
                         "between the Python repetitions, instead of once per shape")
    ap.add_argument("--shapes", default=None, help="BxTxDxH,... (default: the suite's)")
    ap.add_argument("--ratios", default=None, help="active head %% list (default 50,75,100)")
    args = ap.parse_args()

    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    if repeats < 1:
        ap.error("--repeats: expected >= 1")
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
            assert all(len(s) == 4 and min(s) > 0 for s in shapes)
        except (ValueError, AssertionError):
            ap.error(f"--shapes: expected BxTxDxH[,BxTxDxH...], got {args.shapes!r}")
    else:
        shapes = QUICK_SHAPES if args.quick else SUITE_SHAPES
    try:
        ratios = [int(r) for r in args.ratios.split(",")] if args.ratios else RATIOS
        assert ratios and all(1 <= r <= 100 for r in ratios)
    except (ValueError, AssertionError):
        ap.error(f"--ratios: expected percentages in 1..100, got {args.ratios!r}")
    out_path = args.out or os.path.join(
        ROOT, "build/bench-results/python-vs-torch-quick.md" if args.quick
        else "bench/results/python-vs-torch.md")
    binary = args.moh_bench or os.path.join(ROOT, "build/bench/moh_bench")
    use_cpp = not args.no_cpp
    if use_cpp and not os.access(binary, os.X_OK):
        if args.quick and args.moh_bench is None:
            use_cpp = False
            log(f"== no {binary}: no C++ comparison (quick run)")
        else:
            sys.exit(f"bench_vs_torch.py: {binary} not found or not executable: build it "
                     "(cmake --build build --target moh_bench) or pass --moh-bench / --no-cpp")

    moh = import_moh()
    import numpy
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import moh_modules as mm

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    command = shlex.join([sys.executable] + sys.argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = load_average()
    t_start = time.perf_counter()

    results, errors = [], []
    samples, cpp_cmds, cpp_state = {}, [], {"error": None}

    def cpp_run(shape, n):  # n repetitions of the C++ rows of `shape` into `samples`
        if not use_cpp or cpp_state["error"]:
            return
        try:
            rows, cmd = run_cpp(binary, shape, ratios, n)
        except (OSError, subprocess.CalledProcessError, ValueError) as e:
            cpp_state["error"] = f"{binary} failed: {e}"
            errors.append(cpp_state["error"])
            return
        for name, v in rows.items():
            samples.setdefault(name, []).extend(v)
        if cmd and cmd not in cpp_cmds:
            cpp_cmds.append(cmd)

    for shape in shapes:
        log(f"== shape (B, T, D, H) = {shape_str(shape)}, ratios {ratios}, {repeats} repetitions")
        after = (lambda s=shape: cpp_run(s, 1)) if args.cpp_interleave else None
        timed, checks = bench_shape(moh, torch, mm, shape, ratios, repeats, after)
        for what, diff, frac in checks:
            ok = diff < TOLERANCE
            log(f"   check {what}: max |moh - torch| = {diff:.3g} "
                f"({'ok' if ok else 'MISMATCH'}), active fraction {frac:.3f}")
            if not ok:
                errors.append(f"{shape_str(shape)} {what}: max abs diff {diff:.3g} >= {TOLERANCE}")
        results.append((shape, timed, checks))
        if not args.cpp_interleave:  # the C++ rows of this shape, right after its Python ones
            cpp_run(shape, repeats)
    cpp = {name: statistics.median(v) for name, v in samples.items()}
    cpp_error = cpp_state["error"]
    blas_info, blas_libs = torch_blas(torch)
    elapsed = time.perf_counter() - t_start

    # ---- the Markdown ----
    L = ["# moh through Python vs PyTorch (one thread, prefill, non-causal)", ""]
    if args.quick:
        L += ["**Quick run** (small shapes, few repetitions): checks that the script works; "
              "the targets are read at a shape that is not the target shape.", ""]
    mod_build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(moh.__file__))))
    L += [
        f"- date: {started.isoformat(timespec='seconds')}; run time {elapsed:.0f} s; "
        f"load average at start {load_start}, at end {load_average()}",
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical CPUs (shared machine: expect noise)",
        f"- Python {platform.python_version()} ({sys.executable}); NumPy {numpy.__version__}; "
        f"PyTorch {torch.__version__} (BLAS_INFO={blas_info}; loaded: "
        f"{', '.join(blas_libs) or 'none found'})",
        f"- threads: 1 (torch.set_num_threads(1), torch.get_num_threads() = "
        f"{torch.get_num_threads()}; moh calls with threads=1); torch.no_grad(); "
        f"modules in eval()",
        f"- moh: {os.path.dirname(os.path.abspath(moh.__file__))} (build type "
        f"{build_type(mod_build)}); C++ rows: "
        + (f"{'; '.join(f'`{c}`' for c in cpp_cmds)} (build type "
           f"{build_type(os.path.dirname(os.path.dirname(binary)))}"
           + ("; run once per repetition, between the Python repetitions)"
              if args.cpp_interleave else ", run after the shape's Python repetitions)")
           if cpp_cmds else (cpp_error or "not run")),
        f"- command: `{command}`",
        f"- {repeats} timed repetitions per contender after one warm-up each, interleaved "
        "(authors' stand-ins, torch MHA, moh MHA, moh MoH, then again); times are medians of "
        "the calling thread's CPU time (time.thread_time; moh_bench's one-thread rows report "
        "CPU time too), wall-clock medians in the last table. Each moh call is followed by a "
        "second, back-to-back one (`b2b`): the interleaved call runs after the torch calls "
        "have flushed the caches, the back-to-back one with warm caches like moh_bench's "
        "iterations, so the speed-ups use the interleaved times and `Python / C++` the "
        "back-to-back ones",
        "- MoH head split (bench/bench_common.hpp): A = round(P H / 100) active heads, "
        "S = H / 4 shared (max(1, H / 8) at 25 %), K = A - S routed per token; learned router, "
        "qkv and proj biases",
        "- authors' MoH stand-in: tools/moh_modules.MoHAttention (computes every head and the "
        "full score matrix, then applies the gates); moh layers built with moh.from_torch "
        f"from the same modules, outputs checked against torch's (max abs diff < {TOLERANCE})",
    ]
    if any("/blas/libblas" in lib or "netlib" in lib for lib in blas_libs):
        L.append("- **note**: this PyTorch build does its matrix products with the reference "
                 "(netlib) BLAS it loaded above, not MKL or OpenBLAS: its times, and the ratios "
                 "against torch, describe this PyTorch install, not an optimised one")
    L.append("")

    def cpp_ms(shape, key):
        return cpp.get(cpp_names(shape, ratios)[key])

    L += ["## Dense MHA", "",
          "`moh vs torch` = torch time / moh time (> 1: moh faster); `Python / C++` = moh "
          "through Python (back-to-back) / BM_MHA_Prefill: the binding overhead.", ""]
    rows = []
    for shape, timed, checks in results:
        t, m, c = timed["torch_mha"].cpu, timed["moh_mha"].cpu, cpp_ms(shape, "mha")
        rows.append([shape_str(shape), fmt(t), fmt(m), fmt(timed["moh_mha"].hot_cpu), fmt(c),
                     fmt(ratio(t, m)) + "x", fmt(ratio(timed["moh_mha"].hot_cpu, c), 3),
                     f"{checks[0][1]:.1e}"])
    L += table(["shape (B, T, D, H)", "torch MHA ms", "moh MHA (Python) ms", "b2b ms",
                "BM_MHA_Prefill ms", "moh vs torch", "Python / C++", "max abs diff"], rows)
    L += ["", "## MoH", "",
          "`vs stand-in` = authors' stand-in time / moh time (> 1: moh faster); `vs moh MHA` = "
          "moh MoH time / moh MHA time; `Python / C++` = moh through Python (back-to-back) / "
          "BM_MoH_Prefill at the same active %.", ""]
    rows = []
    for shape, timed, checks in results:
        for i, pct in enumerate(ratios):
            S, K = moh_split(shape[3], pct)
            a, mc = timed[f"authors_{pct}"].cpu, timed[f"moh_moh_{pct}"]
            c = cpp_ms(shape, pct)
            rows.append([shape_str(shape), pct, S, K, f"{checks[i + 1][2]:.3f}", fmt(a),
                         fmt(mc.cpu), fmt(mc.hot_cpu), fmt(c), fmt(ratio(a, mc.cpu)) + "x",
                         fmt(ratio(mc.cpu, timed["moh_mha"].cpu)), fmt(ratio(mc.hot_cpu, c), 3),
                         f"{checks[i + 1][1]:.1e}"])
    L += table(["shape (B, T, D, H)", "active %", "S", "K", "active fraction",
                "stand-in ms", "moh MoH (Python) ms", "b2b ms", "BM_MoH_Prefill ms",
                "vs stand-in", "vs moh MHA", "Python / C++", "max abs diff"], rows)

    # ---- targets ----
    target = next((r for r in results if r[0] == MAIN_SHAPE), None)
    note = ""
    if target is None:  # a quick run: the largest shape that ran
        target = max(results, key=lambda r: r[0][0] * r[0][1] * r[0][2])
        note = f" (at {shape_str(target[0])}, not the target shape {shape_str(MAIN_SHAPE)})"
    shape, timed, _ = target

    def verdict(value, goal, higher):
        if value is None:
            return "n/a"
        return "PASS" if (value >= goal if higher else value <= goal) else "MISS"

    targets = []
    if 50 in ratios:
        v = ratio(timed["authors_50"].cpu, timed["moh_moh_50"].cpu)
        targets.append(["moh MoH 50% (Python) vs authors' stand-in 50%",
                        f">= {TARGET_MOH_VS_AUTHORS:g}x", fmt(v) + "x",
                        verdict(v, TARGET_MOH_VS_AUTHORS, True)])
    v = ratio(timed["torch_mha"].cpu, timed["moh_mha"].cpu)
    targets.append(["moh MHA (Python) vs torch.nn.MultiheadAttention",
                    f">= {TARGET_MHA_VS_TORCH:g}x", fmt(v) + "x",
                    verdict(v, TARGET_MHA_VS_TORCH, True)])
    v = ratio(timed["moh_mha"].hot_cpu, cpp_ms(shape, "mha"))
    targets.append(["moh MHA (Python, back-to-back) / BM_MHA_Prefill", f"<= {TARGET_BINDING:g}",
                    fmt(v, 3),
                    verdict(v, TARGET_BINDING, False)])
    if 50 in ratios:
        v = ratio(timed["moh_moh_50"].hot_cpu, cpp_ms(shape, 50))
        targets.append(["moh MoH 50% (Python, back-to-back) / BM_MoH_Prefill 50% (no target)", "-",
                        fmt(v, 3), "-"])
    L += ["", f"## Targets{note}", ""]
    L += table(["target", "goal", "measured", "result"], targets, left=2)

    # ---- every median, CPU and wall ----
    L += ["", "## Every contender: medians and spread", ""]
    rows = []
    for shape, timed, _ in results:
        for c in timed.values():
            rows.append([shape_str(shape), c.label, len(c.cpu_ms), fmt(c.cpu),
                         f"{min(c.cpu_ms):,.2f} .. {max(c.cpu_ms):,.2f}", fmt(c.wall)])
            if c.hot:
                rows.append([shape_str(shape), c.label + ", back-to-back", len(c.hot_ms),
                             fmt(c.hot_cpu), f"{min(c.hot_ms):,.2f} .. {max(c.hot_ms):,.2f}",
                             "-"])
        for key, name in cpp_names(shape, ratios).items():
            if name in cpp:
                v = samples[name]
                rows.append([shape_str(shape), f"`{name}` (C++)", len(v), fmt(cpp[name]),
                             f"{min(v):,.2f} .. {max(v):,.2f}", "-"])
    L += table(["shape (B, T, D, H)", "contender", "reps", "CPU ms (median)", "CPU ms min .. max",
                "wall ms (median)"], rows, left=2)
    if errors:
        L += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    text = "\n".join(L) + "\n"

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        f.write(text)
    print(text)
    for t in targets:
        log(f"== target: {t[0]}: {t[2]} (goal {t[1]}): {t[3]}{note}")
    log(f"== wrote {out_path} ({elapsed:.0f} s)")
    if errors:
        log("bench_vs_torch.py: errors:\n  " + "\n  ".join(errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
