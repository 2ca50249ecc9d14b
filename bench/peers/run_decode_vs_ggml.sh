#!/usr/bin/env bash
# One decode step of attention, moh against llama.cpp's ggml, one thread each, interleaved rounds;
# writes bench/results/decode-vs-ggml.md.
#
#   GGML_DIR=/path/to/ggml-source bench/peers/run_decode_vs_ggml.sh
#
# Environment (defaults in brackets):
#   GGML_DIR     a ggml source tree (github.com/ggml-org/ggml, or llama.cpp's ggml/)   [required]
#   GGML_BUILD   ggml's CPU-only build; configured and built when it has no libggml-cpu.a
#                (Release, -DGGML_NATIVE=ON -DGGML_LLAMAFILE=ON, no BLAS, no GPU, no OpenMP)
#                                                                           [/tmp/gg-build]
#   PEER_BUILD   build of bench/peers/ggml_decode                           [/tmp/gp-build]
#   MOH_BUILD    moh's Release build of the target moh_bench (bench/CMakeLists.txt builds every
#                bench/*.cpp, the decode rows included, into that one binary) [/tmp/gm-build]
#   ROUNDS       rounds; each runs every row on both sides, the order alternating [5]
#   MIN_TIME     seconds each measurement runs (moh: --benchmark_min_time; ggml: --seconds) [1]
#   GGML_COMMIT  the ggml commit, printed in the results when GGML_DIR is not a git checkout
#   OUT          the results file                           [bench/results/decode-vs-ggml.md]
#
# Rows: moh's BM_MHA_Decode rows at batch 1, context 4096 (bench/moh_bench_decode.cpp), and the
# same step in ggml (bench/peers/ggml_decode.cpp) twice: with one layer repeated, as moh's rows
# run it, and cycling through copies of the layer that together exceed 256 MiB.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
: "${GGML_DIR:?set GGML_DIR to a ggml source tree}"
GGML_BUILD="${GGML_BUILD:-/tmp/gg-build}"
PEER_BUILD="${PEER_BUILD:-/tmp/gp-build}"
MOH_BUILD="${MOH_BUILD:-/tmp/gm-build}"
ROUNDS="${ROUNDS:-5}"
MIN_TIME="${MIN_TIME:-1}"
OUT="${OUT:-bench/results/decode-vs-ggml.md}"
log() { echo "== $*" >&2; }

# --- builds ------------------------------------------------------------------------------------
if [[ ! -f "$GGML_BUILD/src/libggml-cpu.a" ]]; then
  log "building ggml (CPU backend only) in $GGML_BUILD"
  cmake -S "$GGML_DIR" -B "$GGML_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_LLAMAFILE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DGGML_OPENMP=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$GGML_BUILD" -j2
fi
log "building bench/peers/ggml_decode in $PEER_BUILD"
cmake -S bench/peers -B "$PEER_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_DIR="$GGML_DIR" \
  -DGGML_BUILD_DIR="$GGML_BUILD" >/dev/null
cmake --build "$PEER_BUILD" -j2
log "building moh_bench in $MOH_BUILD"
if [[ ! -f "$MOH_BUILD/CMakeCache.txt" ]]; then
  cmake -S . -B "$MOH_BUILD" -DCMAKE_BUILD_TYPE=Release -DMOH_BUILD_TESTS=OFF \
    -DMOH_BUILD_EXAMPLES=OFF -DMOH_BUILD_TOOLS=OFF -DMOH_BUILD_PYTHON=OFF -DMOH_INSTALL=OFF
fi
cmake --build "$MOH_BUILD" --target moh_bench -j2
MOH_BIN="$MOH_BUILD/bench/moh_bench"
GGML_BIN="$PEER_BUILD/ggml_decode"

# --- rows: id | label | weights | cache | moh benchmark name | ggml arguments ------------------
base=BM_MHA_Decode/batch:1/context:4096
rows=(
  "a|MHA D 1024, 16 heads, 16 kv heads, d 64, bias, no RoPE|f32|f32|$base/d_model:1024/heads:16/kv_heads:16|--d-model 1024 --heads 16 --kv-heads 16 --context 4096 --bias 1 --rope 0 --wtype f32 --kvtype f32"
  "b|LLaMA3-8B: D 4096, 32 heads, 8 kv heads, d 128, no bias, RoPE|f32|f32|$base/d_model:4096/heads:32/kv_heads:8|--d-model 4096 --heads 32 --kv-heads 8 --context 4096 --bias 0 --rope 1 --wtype f32 --kvtype f32"
  "c|LLaMA3-8B|bf16|f32|$base/d_model:4096/heads:32/kv_heads:8/bf16:1|--d-model 4096 --heads 32 --kv-heads 8 --context 4096 --bias 0 --rope 1 --wtype bf16 --kvtype f32"
  "d|LLaMA3-8B|bf16|bf16|$base/d_model:4096/heads:32/kv_heads:8/bf16:1/kv_bf16:1|--d-model 4096 --heads 32 --kv-heads 8 --context 4096 --bias 0 --rope 1 --wtype bf16 --kvtype bf16"
)

raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
load_start="$(cut -d' ' -f1-3 /proc/loadavg)"

run_moh() {  # $1 id, $2 benchmark name, $3 round -> "wall cpu", ms per step
  local json="$raw/moh-$1-$3.json"
  "$MOH_BIN" --benchmark_filter="^${2}\$" --benchmark_min_time="$MIN_TIME" \
    --benchmark_format=json --benchmark_out="$json" --benchmark_out_format=json >/dev/null
  python3 - "$json" "$2" <<'EOF'
import json, sys
runs = [b for b in json.load(open(sys.argv[1]))["benchmarks"] if b["name"] == sys.argv[2]]
if len(runs) != 1:
    sys.exit(f"moh_bench: expected one run of {sys.argv[2]}, got {len(runs)}")
b = runs[0]
assert b["time_unit"] == "us", b["time_unit"]
print(b["wall_us"] / 1000.0, b["cpu_time"] / 1000.0)
EOF
}
run_ggml() {  # $1 id, $2 memory mode (one|cycled), $3 round, rest: arguments -> "wall cpu"
  local id=$1 mode=$2 round=$3
  shift 3
  local mem=(--copies 1)
  [[ "$mode" == cycled ]] && mem=(--min-mib 256)
  "$GGML_BIN" "$@" "${mem[@]}" --threads 1 --seconds "$MIN_TIME" | tee "$raw/ggml-$id-$mode-$round.txt" |
    sed -n 's/.* ms_per_step=\([0-9.]*\) cpu_ms_per_step=\([0-9.]*\) .*/\1 \2/p'
}

: >"$raw/times.tsv"
for ((r = 1; r <= ROUNDS; ++r)); do
  log "round $r of $ROUNDS (load $(cut -d' ' -f1-3 /proc/loadavg))"
  for row in "${rows[@]}"; do
    IFS='|' read -r id label wt kt name gargs <<<"$row"
    read -r -a gv <<<"$gargs"
    # Alternate which side goes first from round to round.
    if ((r % 2)); then order=(moh one cycled); else order=(cycled one moh); fi
    for side in "${order[@]}"; do
      case $side in
        moh) t=$(run_moh "$id" "$name" "$r") ;;
        *) t=$(run_ggml "$id" "$side" "$r" "${gv[@]}") ;;
      esac
      [[ "$t" =~ ^[0-9.]+\ [0-9.]+$ ]] || { echo "run_decode_vs_ggml.sh: $id $side gave '$t'" >&2; exit 1; }
      printf '%s\t%s\t%s\t%s\t%s\n' "$id" "$side" "$r" ${t} >>"$raw/times.tsv"
      log "  $id $side: wall, cpu $t ms"
    done
  done
done
load_end="$(cut -d' ' -f1-3 /proc/loadavg)"

# --- the results file --------------------------------------------------------------------------
cpu="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
cpu="$cpu (CPU family $(lscpu | sed -n 's/^CPU family:[[:space:]]*//p' | head -1), model $(lscpu | sed -n 's/^Model:[[:space:]]*//p' | head -1))"
cores="$(nproc)"
moh_commit="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- include bench || echo '+local changes')"
ggml_commit="${GGML_COMMIT:-$(git -C "$GGML_DIR" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
cat "$raw"/ggml-*-1.txt >"$raw/ggml-lines.txt"
python3 - "$raw/times.tsv" "$raw/ggml-lines.txt" "$OUT" "$ROUNDS" "$MIN_TIME" "$cpu" "$cores" \
  "$moh_commit" "$ggml_commit" "$load_start" "$load_end" "${rows[@]}" <<'EOF'
import statistics, sys
times, ggml_lines, out, rounds, min_time, cpu, cores, moh_c, ggml_c, load0, load1 = sys.argv[1:12]
rows = [r.split("|") for r in sys.argv[12:]]
t = {}  # (row, side, clock) -> {round: ms}
for line in open(times):
    i, side, r, wall, cputime = line.split()
    t.setdefault((i, side, "wall"), {})[int(r)] = float(wall)
    t.setdefault((i, side, "cpu"), {})[int(r)] = float(cputime)
info = {}  # (wtype, kvtype, D) -> copies of the cycled run, error of the f32 check
for line in open(ggml_lines):
    kv = dict(p.split("=", 1) for p in line.split())
    e = info.setdefault((kv["wtype"], kv["kvtype"], kv["D"]), {})
    if kv["copies"] != "1":
        e["copies"] = f"{kv['copies']} x {float(kv['layer_MiB']):.0f} MiB"
    e["err"] = float(kv["rel_err"])

def stat(xs):
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
def rstat(xs):
    return f"**{statistics.median(xs):.2f}** ({min(xs):.2f}-{max(xs):.2f})"
def ratio(a, b):
    return [a[r] / b[r] for r in sorted(a) if r in b]

L = []
L.append("# Decode step: moh against llama.cpp's ggml")
L.append("")
L.append("One decode step of an attention layer, batch 1, context 4096: project one token's q, k and v,")
L.append("append k and v to the KV cache, attend over the 4097 cached keys, project the output. One")
L.append(f"thread on each side; {rounds} interleaved rounds, each running every row on both sides (the")
L.append("order alternating from round to round). Each figure is the median over the rounds with the")
L.append("range over the rounds in brackets; a ratio is taken within each round, then its median.")
L.append("moh/ggml below 1: moh is faster.")
L.append("")
L.append("- **moh**: the `BM_MHA_Decode` row of `bench/moh_bench_decode.cpp` named below, which steps")
L.append("  through copies of its layer (weights and cache) that together exceed 256 MiB.")
L.append("- **ggml, one layer**: `bench/peers/ggml_decode.cpp`, the same step as one ggml graph")
L.append("  (`ggml_mul_mat` projections, `ggml_rope_ext`, `ggml_cpy` into a KV cache laid out as")
L.append("  llama.cpp's, `ggml_flash_attn_ext`, the path llama.cpp takes for decode on the CPU), on the")
L.append("  CPU backend, one layer repeated.")
L.append("- **ggml, cycled**: the same, cycling through copies of the layer (weights and cache) that")
L.append("  together exceed 256 MiB, so that each step reads its bytes from memory as in a model's")
L.append("  stack of layers, as moh's rows do: the like-for-like comparison.")
L.append("")

def table(clock, title):
    L.append(f"## {title}")
    L.append("")
    L.append("| row | shape | weights | cache | moh ms/step | ggml ms/step, one layer | moh/ggml | "
             "ggml ms/step, cycled | copies | moh/ggml cycled |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for i, label, wt, kt, name, gargs in rows:
        m, g1, gc = (t[(i, s, clock)] for s in ("moh", "one", "cycled"))
        e = info.get((wt, kt, gargs.split()[1]), {})
        L.append(f"| {i} | {label} | {wt} | {kt} | {stat(list(m.values()))} | "
                 f"{stat(list(g1.values()))} | {rstat(ratio(m, g1))} | {stat(list(gc.values()))} | "
                 f"{e.get('copies', '?')} | {stat(ratio(m, gc))} |")
    L.append("")

table("cpu", "Thread CPU time per step")
L.append("The calling thread's CPU time (moh: Google Benchmark's `cpu_time`; ggml:")
L.append("`CLOCK_THREAD_CPUTIME_ID` around the timed steps): on a shared machine it leaves out the")
L.append("time the thread waits for a core. Both sides run the step on the calling thread alone.")
L.append("")
table("wall", "Wall time per step")
L.append("moh: the row's `wall_us` counter; ggml: the mean of `steady_clock` per step.")
L.append("")
L.append("## Rows")
L.append("")
for i, label, wt, kt, name, gargs in rows:
    e = info.get((wt, kt, gargs.split()[1]), {})
    chk = (f"; ggml's output against the step in plain double arithmetic: max error "
           f"{e['err']:.1e} of max |y|") if e.get("err", -1) >= 0 else ""
    L.append(f"- {i}: moh `{name}`; ggml `ggml_decode {gargs}` with `--copies 1` (one layer) or "
             f"`--min-mib 256` (cycled){chk}")
L.append("")
L.append("## Not equal between the two sides")
L.append("")
L.append("- Memory: moh's rows repeat one layer (row a's 48 MiB of weights and cache partly fit the 32")
L.append("  MiB L3; the LLaMA3-8B rows' 96-192 MiB do not); the \"one layer\" ggml columns do the same,")
L.append("  the \"cycled\" ones read every step from memory.")
L.append("- bf16 arithmetic (rows c, d): moh widens bf16 weights and cache entries to float and computes")
L.append("  in float on float activations; ggml's `ggml_mul_mat` rounds the input vector to bf16 and")
L.append("  takes bf16 dot products, and `ggml_flash_attn_ext` with a bf16 cache rounds q to bf16 for")
L.append("  the scores and widens each value row to float. The f32 rows are float on both sides.")
L.append("- Grouped-query attention (rows b-d, 4 query heads per kv head): moh reads each kv head's")
L.append("  keys and values once for its group of query heads; ggml's `ggml_flash_attn_ext` runs each")
L.append("  query head on its own, reading its kv head's keys and values once per query head (the")
L.append("  repeats mostly from the caches).")
L.append("- ggml passes no attention mask (every cached key is visible to the one query; llama.cpp")
L.append("  passes an all-visible f16 mask here). Cache contents: moh's are a real prefill of random")
L.append("  tokens, ggml's are random values; neither changes the work.")
L.append("- Build: moh `-O3 -march=native` (its Release flags); ggml Release, `GGML_NATIVE=ON`,")
L.append("  `GGML_LLAMAFILE=ON` (llama.cpp's default), no BLAS, no OpenMP.")
L.append("")
L.append(f"Machine: {cpu}, {cores} cores, shared with other jobs: load average (1, 5, 15 min) {load0}"
         f" at the start of the run, {load1} at the end. moh {moh_c}; ggml {ggml_c}. Each measurement"
         f" runs for {min_time} s after its warm-up.")
L.append("")
L.append("Reproduce: `GGML_DIR=<ggml source> bench/peers/run_decode_vs_ggml.sh`; bench/peers/README.md")
L.append("says how the ggml side is built.")
open(out, "w").write("\n".join(L) + "\n")
print("\n".join(L))
EOF
log "wrote $OUT"
