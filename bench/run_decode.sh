#!/usr/bin/env bash
# The decode rows that the decoding targets compare, in interleaved rounds, pooled into one table.
#
#   bench/run_decode.sh [ROUNDS] [build-dir]      (ROUNDS defaults to 5, build-dir to build)
#
# Builds moh_bench (Release) in <build-dir>, then runs ROUNDS rounds of the decode rows below, 3
# repetitions each in random order, and pools every round's repetitions with bench/report.py
# into <build-dir>/bench-results/decode.md (the rounds' JSON beside it, decode-rN.json). Each
# row steps through copies of its layer that together exceed 256 MiB (bench_common.hpp), so a
# step reads from memory as a model's stack of layers does. About 90 s a round on 2 cores.
set -euo pipefail
rounds=${1:-5}
build=${2:-build}
case $rounds in
  '' | *[!0-9]* | 0) echo "run_decode.sh: ROUNDS must be a positive whole number, got '$rounds'" >&2
                     exit 2 ;;
esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ -f "$build/CMakeCache.txt" ]] || cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" --target moh_bench -j2
out="$build/bench-results"
mkdir -p "$out"
llama='BM_MHA_Decode/batch:1/context:4096/d_model:4096/heads:32/kv_heads:8(/bf16:1|/bf16:1/kv_bf16:1|/threads:2)?(/real_time)?'
llama_moh='BM_MoH_Decode/batch:1/context:4096/d_model:4096/heads:32/kv_heads:8/active_pct:75(/bf16:1)?'
small='BM_MHA_Decode/batch:[18]/context:4096/d_model:1024/heads:16/kv_heads:16(/ragged:1)?'
small_moh='BM_MoH_Decode/batch:[18]/context:4096/d_model:1024/heads:16/kv_heads:16/active_pct:50(/ragged:1)?'
filter="^($llama|$llama_moh|$small|$small_moh|BM_MemRead/bytes:268435456)\$"
files=()
for ((n = 1; n <= rounds; ++n)); do
  echo "run_decode.sh: round $n of $rounds" >&2
  "$build/bench/moh_bench" --benchmark_filter="$filter" --benchmark_repetitions=3 \
    --benchmark_enable_random_interleaving=true --benchmark_format=json \
    --benchmark_out="$out/decode-r$n.json" > /dev/null
  files+=("$out/decode-r$n.json")
done
python3 bench/report.py --no-plot "${files[@]}" > "$out/decode.md"
echo "run_decode.sh: wrote $out/decode.md" >&2
