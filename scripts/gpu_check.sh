#!/usr/bin/env bash
# One run on a GPU machine: build (with CUDA), run the GPU tests, compute-sanitizer on a small
# sweep (forward and backward), and the GPU benchmarks (forward, then forward+backward). Full logs go to $OUT (or ./gpu-results); a short summary is
# printed last.
#   scripts/gpu_check.sh [all|test|bench|quick]   (default all; quick = tests + a small bench)
# Build dependencies that the GPU machine lacks travel in .deps/ (scripts/prepare_gpu_deps.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
out=${OUT:-gpu-results}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
export PATH="/usr/local/cuda/bin:$PATH"

note "== $(date -u '+%Y-%m-%d %H:%M UTC') stage=$stage"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$summary"
note "nvcc: $(nvcc --version | tail -1); cmake: $(cmake --version | head -1)"

start=$(date +%s)
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_BUILD_BENCH=OFF \
  && cmake --build build-gpu -j "$(nproc)"; } >"$out/build.log" 2>&1
build_status=$?
note "build: status $build_status in $(( $(date +%s) - start )) s on $(nproc) cores"
if [ $build_status -ne 0 ]; then tail -40 "$out/build.log"; exit 1; fi

if [ "$stage" = all ] || [ "$stage" = test ] || [ "$stage" = quick ]; then
  start=$(date +%s)
  ctest --test-dir build-gpu -L gpu -j 8 --output-on-failure --timeout 300 >"$out/tests_gpu.log" 2>&1
  note "gpu tests: $(grep -E 'tests passed|tests failed' "$out/tests_gpu.log" | tail -1) ($(( $(date +%s) - start )) s)"
  grep -E '\*\*\*Failed|Skipped' "$out/tests_gpu.log" | head -20 | tee -a "$summary"
  ctest --test-dir build-gpu -L cpu -j 16 >"$out/tests_cpu.log" 2>&1
  note "cpu tests: $(grep -E 'tests passed|tests failed' "$out/tests_cpu.log" | tail -1)"
  # compute-sanitizer on a small sweep: odd shapes, every mask, GQA, varlen, softcap/ALiBi.
  filter='*FeatureGrid*sliding_softcap*:*FeatureGrid*band_alibi*:EdgeCases.*:Varlen.EmptySequencesAndEveryFeature:CudaBackend.*:*HeadDims*/40:*HeadDims*/256'
  for tool in memcheck racecheck; do
    start=$(date +%s)
    compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_forward_cuda \
      --gtest_filter="$filter" >"$out/sanitizer_$tool.log" 2>&1
    note "compute-sanitizer $tool: status $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_$tool.log" | tail -1)) $(( $(date +%s) - start )) s"
  done
  # The backward on a small sweep: causal+softcap and band+ALiBi grid points (dropout and the
  # deterministic mode among them), edge cases, the smallest and largest head-dim buckets,
  # varlen with empty sequences, the stream test and the CUDA validation rules.
  filter='*BackwardGrid*causal_softcap*:*BackwardGrid*band_alibiH_*:BackwardEdgeCases.*:*BackwardHeadDims*/0:*BackwardHeadDims*/11:BackwardVarlen.*:CudaBackward.RunsOnTheGivenStream*:CudaBackwardErrors.*'
  for tool in memcheck racecheck; do
    start=$(date +%s)
    compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_backward_cuda \
      --gtest_filter="$filter" >"$out/sanitizer_backward_$tool.log" 2>&1
    note "compute-sanitizer $tool (backward): status $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer_backward_$tool.log" | tail -1)) $(( $(date +%s) - start )) s"
  done
fi

if [ "$stage" = all ] || [ "$stage" = bench ] || [ "$stage" = quick ]; then
  start=$(date +%s)
  quick=""
  [ "$stage" = quick ] && quick="--quick"
  PYTHONUNBUFFERED=1 python3 bench/gpu_forward.py --lib build-gpu/src/libflashattn_c.so \
    --out "$out" $quick >"$out/bench.log" 2>&1
  note "bench: status $? ($(( $(date +%s) - start )) s)"
  tail -60 "$out/bench.log"
  start=$(date +%s)
  PYTHONUNBUFFERED=1 python3 bench/gpu_backward.py --lib build-gpu/src/libflashattn_c.so \
    --out "$out/backward" $quick >"$out/bench_backward.log" 2>&1
  note "bench backward: status $? ($(( $(date +%s) - start )) s)"
  tail -60 "$out/bench_backward.log"
fi
echo
cat "$summary"
