#!/usr/bin/env bash
# Scratch: the varlen backward on the TMA kernel in one device call: this tree's package (in
# the background) beside the CUDA backward suite; the suite's varlen and workspace cases;
# compute-sanitizer on the varlen cases; dev/varlen_backward.py (TMA against the cp.async and
# sm80 kernels, both modes); bench/backward.py once per ';'-separated argument list in
# VARLEN_BACKWARD_RUNS; the whole suite if VARLEN_SUITE_TIMEOUT (seconds) is set.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" FLASHATTN_CUDA_ARCHS=sm_90a
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
py=${PYTHON:-python3}
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
( CMAKE_BUILD_PARALLEL_LEVEL=6 "$py" -m pip install --no-build-isolation --no-deps --no-index --upgrade --target build-ab/site \
    -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON . >"$out/pip.log" 2>&1; echo $? >"$out/pip.rc" ) &
pip_pid=$!
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
    -DFLASHATTN_BUILD_BENCH=OFF && cmake --build build-gpu -j 10 --target test_backward_cuda; } >"$out/build.log" 2>&1
stamp "suite build: $? $(grep -c 'spilled' "$out/build.log") spill lines"
grep -E "spilled|serialized" "$out/build.log" | grep sm90 | cut -c1-200 | head
suite() {  # NAME TIMEOUT FILTER [ENV...]
  local name=$1 limit=$2 filter=$3
  shift 3
  env "$@" timeout "$limit" build-gpu/tests/test_backward_cuda --gtest_brief=1 --gtest_filter="$filter" >"$out/$name.log" 2>&1
  stamp "$name ($filter $*): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/$name.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$out/$name.log" | head -8
}
suite varlen 120 '*BackwardVarlen*:CudaBackward.*'
suite varlen_cpasync 120 '*BackwardVarlen*' FLASHATTN_SM90_BACKWARD_LOADS=cp.async
for tool in memcheck racecheck synccheck; do
  filter='HeadDims/BackwardVarlen.*'
  [ $tool = memcheck ] || filter='HeadDims/BackwardVarlen.*/2'
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_backward_cuda \
    --gtest_filter="$filter" >"$out/san_$tool.log" 2>&1
  stamp "$tool $filter: $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_$tool.log" | tail -1)"
done
wait $pip_pid
stamp "package: $(cat "$out/pip.rc")"; tail -3 "$out/pip.log"
PYTHONPATH=build-ab/site timeout 150 "$py" dev/varlen_backward.py --deterministic >"$out/varlen_bench.log" 2>&1
stamp "dev/varlen_backward.py: $?"
IFS=';' read -ra runs <<<"${VARLEN_BACKWARD_RUNS:-}"  # bench/backward.py argument lists
for i in "${!runs[@]}"; do
  # shellcheck disable=SC2086  # a list of arguments
  (cd bench && PYTHONPATH=../build-ab/site timeout 200 "$py" backward.py --out "$out/backward_$i" ${runs[$i]} \
    >"$out/backward_$i.log" 2>&1)
  stamp "bench/backward.py ${runs[$i]}: $?"
  grep -E "^\| d|FAIL|rror" "$out/backward_$i.log" | cut -c1-160 | head -12
done
[ -n "${VARLEN_SUITE_TIMEOUT:-}" ] && suite whole "$VARLEN_SUITE_TIMEOUT" '*'
cat "$out/varlen_bench.log"
