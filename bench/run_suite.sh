#!/usr/bin/env bash
# The benchmark suite: build (if needed), run the demo, run moh_bench, write tables and a chart.
#
#   bench/run_suite.sh [--full] [build-dir]        (build-dir defaults to build)
#
# 1. Configures <build-dir> in Release when it has no CMakeCache.txt yet, and builds the targets
#    moh_bench and moh_demo only.
# 2. Builds (when examples/moh_demo.cpp exists) and runs <build-dir>/examples/moh_demo; a demo
#    that fails is reported and the benchmarks run anyway.
# 3. Runs moh_bench. Quick run (default, a few minutes on 2 cores): the ViT-B shape prefill (MHA,
#    MoH at every active %, MoA with E = 8, 16, 32 and k = 2), the projection GEMM (Eigen's and
#    moh's) at the ViT-B and long shapes, the long shape (MHA, MoH 50 % and 100 %, 1 and 2
#    threads), decode at
#    context 4096 with d_model 1024 (MHA, MoH 50 %) and memcpy; 5 repetitions.
#    --full: every benchmark, 5 repetitions (tens of minutes).
#    Repetitions of different benchmarks run interleaved in random order, so that a slow spell
#    of a shared machine spreads over all of them instead of skewing the ratios between them.
#    Output: <build-dir>/bench-results/results.json (+ console.txt).
# 4. bench/report.py writes <build-dir>/bench-results/results.md and moh_vs_active.png (gnuplot)
#    and prints the tables.
#
# Environment: MOH_BENCH_MIN_TIME (seconds per benchmark, Google Benchmark's default when unset),
# MOH_BENCH_ARGS (extra moh_bench arguments).
set -euo pipefail

full=0
build=build
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "run_suite.sh: unknown option '$arg' (usage: bench/run_suite.sh [--full] [build-dir])" >&2
        exit 2 ;;
    *) build="$arg" ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { echo "== $*" >&2; }
start=$SECONDS

for tool in cmake python3; do
  command -v "$tool" >/dev/null || { echo "run_suite.sh: $tool not found" >&2; exit 1; }
done

# --- 1. build ---------------------------------------------------------------------------------
bench_bin="$build/bench/moh_bench"
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  log "configuring $build (Release)"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
fi
build_type="$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)"
if [[ "$build_type" != "Release" ]]; then
  echo "run_suite.sh: warning: $build is configured as '${build_type:-unset}', not Release:" \
       "timings will not be representative" >&2
fi
# Only what the suite runs: the tests are built by the README's test command.
log "building moh_bench in $build"
cmake --build "$build" --target moh_bench -j2
if [[ ! -x "$bench_bin" ]]; then
  echo "run_suite.sh: $bench_bin was not built (is Google Benchmark installed? libbenchmark-dev)" >&2
  exit 1
fi

# --- 2. demo ----------------------------------------------------------------------------------
demo="$build/examples/moh_demo"
if [[ -f examples/moh_demo.cpp ]]; then
  cmake --build "$build" --target moh_demo -j2 >&2 ||
    echo "run_suite.sh: warning: moh_demo does not build; running the benchmarks anyway" >&2
fi
if [[ -x "$demo" ]]; then
  log "running $demo"
  "$demo" || echo "run_suite.sh: warning: $demo failed (exit $?); running the benchmarks anyway" >&2
else
  log "no $demo: skipping the demo"
fi

# --- 3. benchmarks ----------------------------------------------------------------------------
out_dir="$build/bench-results"
mkdir -p "$out_dir"
if [[ $full -eq 1 ]]; then
  filter='.'
  reps=5
else
  quick=(
    '^BM_MHA_Prefill/batch:1/tokens:197/d_model:768/heads:12$'
    '^BM_MHA_Prefill/batch:1/tokens:2048/d_model:1024/heads:16$'
    '^BM_MoH_Prefill/batch:1/tokens:2048/d_model:1024/heads:16/active_pct:(50|100)$'
    '^BM_(MHA|MoH)_Prefill_Threads/'
    '^BM_MoH_Prefill/batch:1/tokens:197/d_model:768/heads:12/'
    '^BM_MoA_Prefill/batch:1/tokens:197/d_model:768/experts:(8|16|32)/top_k:2/'
    '^BM_(Moh)?GEMM/rows:(197/in:768/out:2304|2048/in:1024/out:3072)$'
    '^BM_MHA_Decode/batch:1/context:4096/d_model:1024/heads:16/kv_heads:16$'
    '^BM_MoH_Decode/batch:1/context:4096/d_model:1024/heads:16/kv_heads:16/active_pct:50$'
    '^BM_Mem(Read|Copy)/'
  )
  filter="$(IFS='|'; echo "${quick[*]}")"
  reps=5
fi
args=(
  "--benchmark_filter=$filter"
  "--benchmark_repetitions=$reps"
  "--benchmark_enable_random_interleaving=true"
  "--benchmark_report_aggregates_only=false"
  "--benchmark_display_aggregates_only=false"
  "--benchmark_out=$out_dir/results.json"
  "--benchmark_out_format=json"
)
if [[ -n "${MOH_BENCH_MIN_TIME:-}" ]]; then
  args+=("--benchmark_min_time=$MOH_BENCH_MIN_TIME")
fi
if [[ -n "${MOH_BENCH_ARGS:-}" ]]; then
  # shellcheck disable=SC2206  # splitting MOH_BENCH_ARGS into words is intended
  args+=(${MOH_BENCH_ARGS})
fi
log "running moh_bench ($([[ $full -eq 1 ]] && echo full || echo quick), $reps repetitions)"
"$bench_bin" "${args[@]}" | tee "$out_dir/console.txt"

# --- 4. report --------------------------------------------------------------------------------
if ! command -v gnuplot >/dev/null; then
  echo "run_suite.sh: gnuplot not found (apt-get install gnuplot-nox): writing the tables" \
       "without the chart" >&2
fi
log "writing $out_dir/results.md"
python3 bench/report.py "$out_dir/results.json" --out-dir "$out_dir"
log "suite finished in $((SECONDS - start)) s; results in $out_dir"
