#!/usr/bin/env bash
# One device call for the head-dim-256 backward (dev/backward_split_tma.patch applied to a snapshot:
# `dev/device_snapshot.sh main .snap dev/backward_split_tma.patch`, carry [".snap"], then
# `cd .snap && bash dev/gpu_backward256.sh`). Stages in order of need, each result packed into
# $OUT/bwd256.tgz as it comes (a call cut short keeps what finished):
#   1. the package (sm_90a) and, unless BWD256_SUITE=0, the CUDA backward suite beside it;
#   2. dev/check_backward256.py (float64 autograd references);
#   3. bench/backward.py at head dim 256 with FA2 and cuDNN (BWD256_SEQLENS, default 1024 4096
#      16384), then ours alone with FLASHATTN_SM90_BACKWARD_LOADS=cp.async (the kernel the
#      unpatched tree runs there): the A/B in one call;
#   4. the suite (every case), memcheck and racecheck on the check's quick cases, and the
#      suite's 232/256 plain cases on the cp.async kernel.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" FLASHATTN_CUDA_ARCHS=sm_90a PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
R=$(mktemp -d)
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
pack() { tar -czf "$out/bwd256.tgz" -C "$R" . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader; date -u
echo "tree: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"
[ -d .deps/wheels ] && python3 -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
suite=${BWD256_SUITE:-1}
jobs=$(nproc)
[ "$suite" = 1 ] && jobs=8  # the suite builds beside the package
if [ "$suite" = 1 ]; then
  { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
      -DFLASHATTN_BUILD_BENCH=OFF && cmake --build build-gpu -j "$jobs" --target test_backward_cuda; } >"$R/suite_build.log" 2>&1 &
  suite_build=$!
fi
CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install --no-build-isolation --no-deps --no-index --upgrade \
  --target build-ab/site -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON . >"$R/pip.log" 2>&1
stamp "package: $? ($(grep -cE 'spilled|serialized' "$R/pip.log") spill/serialisation lines)"
export PYTHONPATH=$PWD/build-ab/site
timeout 150 python3 dev/check_backward256.py full cuda >"$R/check.log" 2>&1
stamp "check_backward256: $?"; grep -E "FAIL|check_backward256" "$R/check.log" | head -12
pack
for run in tma cpasync; do
  args=() env=()
  [ $run = cpasync ] && args=(--peers=) env=(FLASHATTN_SM90_BACKWARD_LOADS=cp.async)
  # shellcheck disable=SC2086  # a list of seqlens
  (cd bench && env "${env[@]}" timeout 150 python3 backward.py --hdims 256 --seqlens ${BWD256_SEQLENS:-1024 4096 16384} \
     --target-s 0.1 "${args[@]}" --out "$R/bench_$run" >"$R/bench_$run.log" 2>&1)
  stamp "bench/backward.py d256 ($run): $?"
  grep -E "^\| *d256" "$R/bench_$run.log" | cut -c1-170
  pack
done
if [ "$suite" = 1 ]; then
  wait "$suite_build"; stamp "suite build: $? ($(grep -cE 'spilled|serialized' "$R/suite_build.log") spill/serialisation lines)"
  timeout 280 build-gpu/tests/test_backward_cuda --gtest_brief=1 >"$R/suite.log" 2>&1 &
  suite_run=$!
fi
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 python3 dev/check_backward256.py quick cuda >"$R/san_$tool.log" 2>&1
  stamp "$tool: $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$R/san_$tool.log" | tail -1)"
  grep -E -A4 'Race reported|Invalid|Barrier error' "$R/san_$tool.log" | cut -c1-200 | head -10
done
if [ "$suite" = 1 ]; then
  wait "$suite_run"; stamp "suite: $? $(grep -E '^\[  PASSED|^\[  FAILED' "$R/suite.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$R/suite.log" | head -12
  # The cp.async split kernel (its operands and products now shared with the TMA one) at 232 and 256.
  FLASHATTN_SM90_BACKWARD_LOADS=cp.async timeout 120 build-gpu/tests/test_backward_cuda --gtest_brief=1 \
    --gtest_filter='HopperBuckets/BackwardPlainCalls.*/4:HopperBuckets/BackwardPlainCalls.*/5' >"$R/suite_cpasync.log" 2>&1
  stamp "suite, cp.async kernel at 232/256: $? $(grep -E '^\[  PASSED|^\[  FAILED' "$R/suite_cpasync.log" | tr '\n' ' ')"
fi
pack
