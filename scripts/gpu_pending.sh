#!/usr/bin/env bash
# The changes waiting for a GPU, in one call (each was compile-checked only):
#   1. the lean backward loop: GPU tests + sanitizers (gpu_check.sh test) and the backward
#      benchmark against FA2 and cuDNN (gpu_try_backward.sh);
#   2. the kv-cache latency changes: the CUDA kv-cache suite, sanitizers and the decode
#      benchmark (gpu_kvcache.sh kernel), then a split-count sweep at batch 1.
# Logs in $OUT (./gpu-results); summaries printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
bash scripts/gpu_try_backward.sh >"$out/pending_backward.txt" 2>&1
bash scripts/gpu_kvcache.sh kernel >"$out/pending_kvcache.txt" 2>&1
for splits in 8 16 24 48; do
  PYTHONUNBUFFERED=1 timeout 120 python3 bench/gpu_decode.py --lib build-gpu/src/libflashattn_c.so \
    --shapes 1x8k,1x128k --num-splits "$splits" --skip-peers --out "$out/splits_$splits" \
    >"$out/splits_$splits.log" 2>&1
  echo "== num_splits $splits"; grep -E '^\| 1 \|' "$out/splits_$splits.log" | head -2
done
echo; echo "== backward"; tail -25 "$out/pending_backward.txt"
echo; echo "== kv cache"; tail -30 "$out/pending_kvcache.txt"
