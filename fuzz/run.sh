#!/usr/bin/env bash
# fuzz/run.sh [SECONDS]: builds safetensors_fuzz with clang into build-fuzz/ (or the folder in
# $MOH_FUZZ_BUILD_DIR; $MOH_FUZZ_CXX picks the compiler), replays the seed corpus and the saved
# findings, then fuzzes the safetensors reader for SECONDS (default 60). Exits non-zero if anything
# is found; the input that broke the reader is written to <build>/findings/ (copy it into
# fuzz/findings/ to keep it as a regression input).
# Needs clang and its libFuzzer runtime: on Debian 12, apt-get install clang libclang-rt-dev
# (libclang-rt-14-dev holds libFuzzer and the sanitizer runtimes of clang-14).
set -euo pipefail
seconds=${1:-60}
case $seconds in
  '' | *[!0-9]*)
    echo "usage: fuzz/run.sh [SECONDS]: expected a whole number of seconds, got '$seconds'" >&2
    exit 2
    ;;
esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${MOH_FUZZ_BUILD_DIR:-build-fuzz}
cxx=${MOH_FUZZ_CXX:-clang++}

cmake -S . -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMOH_BUILD_FUZZ=ON -DMOH_BUILD_TESTS=OFF -DMOH_BUILD_BENCHMARKS=OFF -DMOH_BUILD_EXAMPLES=OFF \
  -DMOH_BUILD_TOOLS=OFF -DMOH_INSTALL=OFF
cmake --build "$build" --target safetensors_fuzz -j2
ctest --test-dir "$build" --output-on-failure   # every seed and past finding, once

# New inputs go to a working corpus in the build folder; the checked-in seeds stay as they are.
# libFuzzer's progress (a line per new input) goes to <build>/fuzz.log.
mkdir -p "$build/corpus" "$build/findings"
echo "fuzz/run.sh: fuzzing for ${seconds} s, log in $build/fuzz.log"
status=0
"$build/fuzz/safetensors_fuzz" "$build/corpus" fuzz/corpus \
  -dict=fuzz/safetensors.dict -max_total_time="$seconds" -max_len=4096 -timeout=10 \
  -rss_limit_mb=2048 -artifact_prefix="$build/findings/" -print_funcs=0 -print_final_stats=1 \
  > "$build/fuzz.log" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 80 "$build/fuzz.log" >&2
  echo "fuzz/run.sh: safetensors_fuzz found a problem (exit $status); see $build/findings/:" >&2
  ls -l "$build/findings/" >&2
  exit 1
fi
grep -E '^(#[0-9]+[[:space:]]+DONE|Done|stat::)' "$build/fuzz.log" || true
echo "fuzz/run.sh: no findings in ${seconds} s"
