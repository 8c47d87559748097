#!/usr/bin/env bash
# Scratch: one H200 call for a TMA-backward change (issue 30): the package (sm_90a) and the
# C++ backward suite built side by side; the suite on the default dispatch (dense plain calls
# at buckets 64 and 128 on the TMA kernel) and its plain-call cases again with
# FLASHATTN_SM90_BACKWARD_LOADS=cp.async; compute-sanitizer (BWD_SANITIZERS, default memcheck
# racecheck synccheck) on a backward sweep; then, only if every test passed, bench/backward.py
# over the grid with the peers (BWD_BENCH_ARGS), and ours alone on the cp.async kernel
# (BWD_SKIP_AB=1: not; BWD_SKIP_CPASYNC=1: no cp.async suite run; BWD_AB_ARGS: its bench arguments). BWD_SKIP_GRID=1: no peer grid;
# BWD_SKIP_SUITE=1: only the smoke cases of the suite.
# Each stage starts only while the call has time for it (BWD_LIMIT_S, default 560 s). Logs
# come back in logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH"
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( ${BWD_LIMIT_S:-560} - ($(date +%s) - t0) )); }  # seconds left in the call
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # a benchmark cut off by its timeout still leaves its rows in the log
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
( "$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
    -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/pip.log" 2>&1; echo $? >"$out/pip.rc" ) &
pip_pid=$!
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
    -DFLASHATTN_BUILD_BENCH=OFF &&
  cmake --build build-gpu -j 10 --target test_backward_cuda; } >"$out/build.log" 2>&1
stamp "build: $? $(grep -c 'C7509\|C7511\|C7515\|serialized' "$out/build.log") serialisation lines, $(grep -c 'spilled' "$out/build.log") spill lines ($(grep 'spilled' "$out/build.log" | grep -c 'sm90') sm90)"
failed=0
run_tests() {  # LABEL SECONDS FILTER ENV...
  local label=$1 seconds=$2 filter=$3; shift 3
  env "$@" timeout "$seconds" build-gpu/tests/test_backward_cuda --gtest_brief=1 --gtest_filter="$filter" >"$out/bwd_$label.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && failed=1
  stamp "backward suite ($label): $rc $(grep -E '^\[  PASSED|^\[  FAILED' "$out/bwd_$label.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure|max abs' "$out/bwd_$label.log" | head -12
}
run_tests smoke 60 '*BackwardPlainCalls*:CudaBackward.RunsOnTheGivenStream*'
[ $failed -eq 0 ] && [ -z "${BWD_SKIP_SUITE:-}" ] && run_tests default 150 '*'
[ $failed -eq 0 ] && [ -z "${BWD_SKIP_CPASYNC:-}" ] && run_tests cpasync 90 '*BackwardPlainCalls*:*BackwardHeadDims*:CudaBackward.*' FLASHATTN_SM90_BACKWARD_LOADS=cp.async
# Test names carry their instantiation's prefix (HopperBuckets/BackwardPlainCalls...): hence the
# leading '*'. Plain calls at head dims 64 and 128 (the TMA kernel), and the head-dim sweep.
BWD='*BackwardPlainCalls*/1:*BackwardPlainCalls*/3:*BackwardHeadDims*'
if [ $failed -eq 0 ]; then
  for tool in ${BWD_SANITIZERS:-memcheck racecheck synccheck}; do
    timeout 60 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_backward_cuda \
      --gtest_filter="$BWD" >"$out/san_bwd_$tool.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && failed=1
    stamp "$tool backward: $rc $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_bwd_$tool.log" | tail -1) $(grep -c '^\[       OK' "$out/san_bwd_$tool.log") ok"
  done
fi
wait $pip_pid
stamp "pip install: $(cat "$out/pip.rc")"; tail -2 "$out/pip.log"
cd bench || exit
if [ $failed -eq 0 ] && [ -z "${BWD_SKIP_GRID:-}" ] && [ "$(left)" -gt 150 ]; then
  timeout $(( $(left) - 40 )) "$py" backward.py --out "$out/grid" ${BWD_BENCH_ARGS:-} >"$out/bench.log" 2>&1
  stamp "bench/backward.py: $?"
  cp "$out/grid/backward.json" "$out/backward.json" 2>/dev/null
fi
if [ $failed -eq 0 ] && [ -z "${BWD_SKIP_AB:-}" ] && [ "$(left)" -gt 30 ]; then
  FLASHATTN_SM90_BACKWARD_LOADS=cp.async timeout $(( $(left) - 10 )) "$py" backward.py --out "$out/cpasync" --peers '' \
    ${BWD_AB_ARGS:-${BWD_BENCH_ARGS:-}} >"$out/bench_cpasync.log" 2>&1
  stamp "bench/backward.py ours, cp.async kernel: $?"
fi
[ -f "$out/bench.log" ] && tail -40 "$out/bench.log"
[ -f "$out/bench_cpasync.log" ] && { echo "== ours, cp.async kernel"; tail -22 "$out/bench_cpasync.log"; }
(cd "$out" && find . -mindepth 1 -maxdepth 1 ! -name backward.json ! -name logs.tar.gz -print0 |
  tar czf logs.tar.gz --null -T - --remove-files)
