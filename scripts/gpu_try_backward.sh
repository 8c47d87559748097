#!/usr/bin/env bash
# A backward change on a GPU in one go: the GPU tests (forward and backward suites, smaller-GPU
# tiers, compute-sanitizer on the backward sweep) via gpu_check.sh's test stage, then the
# backward benchmark on the grid of the last recorded table (hdim 128 and 64, or
# BWD_HDIMS; 1k, 4k, 16k; causal and not) side by side with FA2 and cuDNN. Logs in $OUT (./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
bash scripts/gpu_check.sh test
PYTHONUNBUFFERED=1 python3 bench/gpu_backward.py --lib build-gpu/src/libflashattn_c.so \
  --out "$out/backward" --hdims "${BWD_HDIMS:-128,64}" --seqlens 1k,4k,16k --time-budget-s 90 \
  >"$out/bench_backward.log" 2>&1
echo "bench backward: status $?"
tail -30 "$out/bench_backward.log"
