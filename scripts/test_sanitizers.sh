#!/usr/bin/env bash
# The CPU test suite and the CLI's error paths under AddressSanitizer (with leak detection)
# and UndefinedBehaviorSanitizer: nothing may crash, leak or invoke undefined behaviour, on
# good input or bad. CPU-only build (the CUDA code is checked with compute-sanitizer on a GPU,
# scripts/gpu.sh sanitize).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHATTN_CUDA=OFF \
  -DFLASHATTN_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build build-sanitize -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
# Not the suites' second run with FLASHATTN_CPU_AMX=0 (*_no_amx.*): the fp32 products it
# takes for bf16 are those every fp32 case here runs, and it would add a third to this stage.
ctest --test-dir build-sanitize --output-on-failure -j "$jobs" --timeout 900 -E '_no_amx\.'
# The CLI on a good call and on rejected ones (exit 2 is the expected answer there).
fa=build-sanitize/tools/flashattn
"$fa" run --backend cpu --backward --dropout 0.1 --seed 7 --causal --batch 2 --heads 6 \
  --heads-k 2 --head-dim 64 --seqlen-q 257 --seqlen-k 391 --dtype bf16 --check --repeat 1 >/dev/null
for bad in "--backend cpu --heads 6 --heads-k 4" "--backend cpu --dropout 1.5" \
           "--backend cpu --head-dim 257" "--backend cpu --window -3,0" "--backend cuda"; do
  set +e
  # shellcheck disable=SC2086  # $bad is a list of arguments
  "$fa" run --seqlen-q 64 $bad >/dev/null 2>/tmp/flashattn_sanitize_err.txt
  status=$?
  set -e
  [ $status -eq 2 ] || { echo "flashattn run $bad: expected exit 2, got $status"; cat /tmp/flashattn_sanitize_err.txt; exit 1; }
done
echo "sanitizers: CPU tests and CLI error paths clean"
