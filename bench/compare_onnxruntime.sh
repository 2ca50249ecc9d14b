#!/usr/bin/env bash
# Dense MHA in moh against ONNX Runtime's CPU execution provider, one thread each, side by side.
# Not part of CI: it installs packages (needs root and the Debian and npm registries).
#
#   bench/compare_onnxruntime.sh [--save] [build-dir]       (build-dir defaults to build)
#
# 1. Debian python3-torch (for /usr/bin/python3, not a pyenv/venv python3 on PATH) exports
#    torch.nn.MultiheadAttention(D, H, batch_first=True) self-attention at the three benchmark
#    shapes to ONNX (opset 17), with a reference output (bench/ort/export_mha.py).
# 2. onnxruntime-node from npm, into <build-dir>/ort, runs each model with intraOpNumThreads=1,
#    interOpNumThreads=1, sequential execution: warmup, then RUNS timed runs
#    (bench/ort/run_ort.js), after checking its output against torch's.
# 3. moh_bench --benchmark_filter=^BM_MHA_Prefill/ at the same shapes, in the same script run,
#    alternating with step 2 for ROUNDS rounds so that both see the same machine load.
# 4. bench/ort/compare_table.py prints a markdown table of medians over all rounds
#    (<build-dir>/ort/onnxruntime_comparison.md; with --save also
#    bench/results/onnxruntime_comparison.md).
#
# Environment: ROUNDS (default 3), RUNS (7 per round), WARMUP (3), MOH_REPS (3 per round),
# ORT_NODE_VERSION (1.30.0).
set -euo pipefail

save=0
build=build
for arg in "$@"; do
  case "$arg" in
    --save) save=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "compare_onnxruntime.sh: unknown option $arg" >&2; exit 2 ;;
    *) build="$arg" ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scratch="$build/ort"
rounds="${ROUNDS:-3}"
runs="${RUNS:-7}"
warmup="${WARMUP:-3}"
moh_reps="${MOH_REPS:-3}"
ort_version="${ORT_NODE_VERSION:-1.30.0}"
py=/usr/bin/python3
mkdir -p "$scratch"
scratch="$(cd "$scratch" && pwd)"

log() { echo "== $*" >&2; }

# --- 1. torch (Debian package) ---------------------------------------------------------------
if ! "$py" -c 'import torch' 2>/dev/null; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "compare_onnxruntime.sh: $py has no torch; run as root or apt-get install python3-torch" >&2
    exit 1
  fi
  log "installing python3-torch (Debian; several minutes)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y python3-torch || { apt-get update && apt-get install -y python3-torch; }
fi
torch_version="$("$py" -c 'import torch; print(torch.__version__)')"

# --- 2. onnxruntime-node (npm, scratch dir) --------------------------------------------------
if [[ ! -f "$scratch/node_modules/onnxruntime-node/package.json" ]]; then
  command -v npm >/dev/null || { echo "compare_onnxruntime.sh: npm not found" >&2; exit 1; }
  log "installing onnxruntime-node@$ort_version into $scratch"
  [[ -f "$scratch/package.json" ]] || (cd "$scratch" && npm init -y >/dev/null)
  # --ignore-scripts: the package's install script only downloads the CUDA execution provider
  # from outside the npm registry; the CPU runtime is bundled in the package itself.
  (cd "$scratch" && npm install --no-audit --no-fund --ignore-scripts "onnxruntime-node@$ort_version")
fi

# --- 3. moh_bench ---------------------------------------------------------------------------
if [[ ! -x "$build/bench/moh_bench" ]]; then
  log "building moh_bench in $build (Release)"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" --target moh_bench -j2

# --- 4. export, then ORT and moh alternately -------------------------------------------------
if [[ ! -f "$scratch/models/models.json" || bench/ort/export_mha.py -nt "$scratch/models/models.json" ]]; then
  log "exporting torch.nn.MultiheadAttention to ONNX (torch $torch_version)"
  "$py" bench/ort/export_mha.py "$scratch/models"
fi

# The machine is shared: alternating the two in rounds gives both the same background load.
ort_files=()
moh_files=()
for ((round = 1; round <= rounds; ++round)); do
  log "round $round/$rounds: onnxruntime-node, $runs runs per shape, one thread"
  NODE_PATH="$scratch/node_modules" node bench/ort/run_ort.js "$scratch/models" "$runs" "$warmup" \
    > "$scratch/ort.$round.jsonl"
  ort_files+=("$scratch/ort.$round.jsonl")
  log "round $round/$rounds: moh_bench BM_MHA_Prefill, $moh_reps repetitions"
  "$build/bench/moh_bench" --benchmark_filter='^BM_MHA_Prefill/' \
    --benchmark_repetitions="$moh_reps" --benchmark_report_aggregates_only=false \
    --benchmark_out="$scratch/moh.$round.json" --benchmark_out_format=json >&2
  moh_files+=("$scratch/moh.$round.json")
done

python3 bench/ort/compare_table.py --torch "$torch_version" --ort "${ort_files[@]}" \
  --moh "${moh_files[@]}" > "$scratch/onnxruntime_comparison.md"
if [[ $save -eq 1 ]]; then
  mkdir -p bench/results
  cp "$scratch/onnxruntime_comparison.md" bench/results/onnxruntime_comparison.md
  log "saved bench/results/onnxruntime_comparison.md"
fi
cat "$scratch/onnxruntime_comparison.md"
