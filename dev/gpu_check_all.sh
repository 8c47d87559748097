#!/usr/bin/env bash
# Scratch: one device call that checks a tree after kernel work: this tree's package (in the
# background) beside the CUDA forward and backward suites; then, side by side, the whole
# forward suite, the whole backward suite, the CHECK_SM80_FILTER cases of both on the sm80
# kernels, and compute-sanitizer (memcheck on CHECK_MEMCHECK_FILTER, racecheck and synccheck on
# CHECK_RACECHECK_FILTER, both of the backward suite); then, alone on the GPU,
# bench/backward.py once per ';'-separated argument list in CHECK_BACKWARD_RUNS.
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
    -DFLASHATTN_BUILD_BENCH=OFF && cmake --build build-gpu -j 10 --target test_forward_cuda test_backward_cuda; } >"$out/build.log" 2>&1
stamp "suites build: $? $(grep -c 'spilled' "$out/build.log") spill lines"
grep -E "spilled|serialized" "$out/build.log" | grep sm90 | cut -c1-200 | head
suite() {  # LOG BINARY TIMEOUT FILTER [ENV...]
  local name=$1 binary=$2 limit=$3 filter=$4
  shift 4
  env "$@" timeout "$limit" "build-gpu/tests/$binary" --gtest_brief=1 --gtest_filter="$filter" >"$out/$name.log" 2>&1
  echo "$name ($filter $*): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/$name.log" | tr '\n' ' ')" >"$out/$name.summary"
  grep -E '^\[  FAILED|Failure' "$out/$name.log" | head -8 >>"$out/$name.summary"
}
sanitize() {  # TOOL FILTER
  timeout 240 compute-sanitizer --tool "$1" --error-exitcode 99 build-gpu/tests/test_backward_cuda --gtest_filter="$2" \
    >"$out/san_$1.log" 2>&1
  echo "$1 $2: $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$out/san_$1.log" | tail -2 | tr '\n' ' ')" >"$out/san_$1.summary"
}
jobs=()
suite fwd test_forward_cuda 300 '*' & jobs+=($!)
suite bwd test_backward_cuda 300 '*' & jobs+=($!)
if [ -n "${CHECK_SM80_FILTER:-}" ]; then
  suite fwd_sm80 test_forward_cuda 300 "$CHECK_SM80_FILTER" FLASHATTN_CUDA_FORWARD=sm80 & jobs+=($!)
  suite bwd_sm80 test_backward_cuda 300 "$CHECK_SM80_FILTER" FLASHATTN_CUDA_BACKWARD=sm80 & jobs+=($!)
fi
sanitize memcheck "${CHECK_MEMCHECK_FILTER:-HeadDims/BackwardVarlen.*}" & jobs+=($!)
for tool in racecheck synccheck; do sanitize $tool "${CHECK_RACECHECK_FILTER:-HeadDims/BackwardVarlen.*/2}"; done & jobs+=($!)
wait "${jobs[@]}"
stamp "suites and sanitizers:"
cat "$out"/*.summary
wait $pip_pid
stamp "package: $(cat "$out/pip.rc")"
IFS=';' read -ra runs <<<"${CHECK_BACKWARD_RUNS:-}"
for i in "${!runs[@]}"; do
  # shellcheck disable=SC2086  # a list of arguments
  (cd bench && PYTHONPATH=../build-ab/site timeout 200 "$py" backward.py --out "$out/backward_$i" ${runs[$i]} \
    >"$out/backward_$i.log" 2>&1)
  stamp "bench/backward.py ${runs[$i]}: $?"
  grep -E "^\| d|FAIL|rror" "$out/backward_$i.log" | cut -c1-160 | head -12
done
