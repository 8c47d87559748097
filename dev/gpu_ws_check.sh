#!/usr/bin/env bash
# Scratch: the TMA (warp-specialised) sm90 forward on the H200 in one short call: the forward
# suite (default dispatch = TMA kernel; cp.async kernel beside it), compute-sanitizer on small
# forward sweeps and the kv-cache guards, then eager timings of both kernels through the CLI.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH"
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
    -DFLASHATTN_BUILD_BENCH=OFF &&
  cmake --build build-gpu -j 16 --target test_forward_cuda test_kvcache_cuda flashattn_cli; } >"$out/build.log" 2>&1
stamp "build: $? $(grep -c 'C7520\|serialized' "$out/build.log") serialisation lines, $(grep -c 'spilled' "$out/build.log") spill lines"
grep -E "spilled|serialized" "$out/build.log" | sed 's/_ZN9flashattn6detail4cuda4sm90//' | cut -c1-200 | head -20
run_tests() {  # LABEL ENV...
  local label=$1; shift
  env "$@" timeout 200 build-gpu/tests/test_forward_cuda --gtest_brief=1 >"$out/fwd_$label.log" 2>&1
  stamp "forward suite ($label): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/fwd_$label.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure|expected|max' "$out/fwd_$label.log" | head -12
}
run_tests tma
run_tests tma_hdim64 FLASHATTN_CUDA_FORWARD=sm90
FWD='*FeatureGrid*sliding_softcap*:*FeatureGrid*band_alibi*:EdgeCases.*:*HeadDims*/40:*HeadDims*/256:*OddHeadDims*/1:CudaBackend.*'
for tool in memcheck racecheck synccheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_forward_cuda \
    --gtest_filter="$FWD" >"$out/san_fwd_$tool.log" 2>&1
  stamp "$tool forward: $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_fwd_$tool.log" | tail -1) $(grep -c '^\[       OK' "$out/san_fwd_$tool.log") ok"
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 build-gpu/tests/test_kvcache_cuda \
  --gtest_filter='KvCacheGuard.*' >"$out/san_kvguard.log" 2>&1
stamp "memcheck kvcache guards: $? $(grep -hE 'ERROR SUMMARY' "$out/san_kvguard.log" | tail -1) $(grep -c '^\[       OK' "$out/san_kvguard.log") ok"
cli=build-gpu/tools/flashattn
echo "hdim causal seqlen | sm90 TFLOP/s | sm80 TFLOP/s"
for shape in "128 no 512" "128 no 2048" "128 no 8192" "128 no 16384" "128 yes 2048" "128 yes 8192" "64 no 8192" "256 no 8192" "256 yes 8192"; do
  read -r d c n <<<"$shape"
  args=(run --backend cuda --dtype bf16 --head-dim "$d" --seqlen-q "$n" --batch $((16384 / n)) --heads $((2048 / d)) --repeat 20 --json)
  [ "$c" = yes ] && args+=(--causal)
  a=$(FLASHATTN_CUDA_FORWARD=sm90 timeout 60 "$cli" "${args[@]}" 2>&1 | tr -d '\n')
  b=$(FLASHATTN_CUDA_FORWARD=sm80 timeout 60 "$cli" "${args[@]}" 2>&1 | tr -d '\n')
  echo "$d $c $n | $a" >>"$out/timing.log"; echo "$d $c $n | $b" >>"$out/timing.log"
  ta=$(echo "$a" | grep -oE '"tflops": *[0-9.]+' | head -1 | grep -oE '[0-9.]+$'); tb=$(echo "$b" | grep -oE '"tflops": *[0-9.]+' | head -1 | grep -oE '[0-9.]+$')
  echo "$d $c $n | ${ta:-?} | ${tb:-?}"
done
