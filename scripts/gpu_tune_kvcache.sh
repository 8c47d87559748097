#!/usr/bin/env bash
# Times candidate shapes of the kv-cache kernel at head dim 128 (warps, stages, L2 prefetch
# bytes, and a variant: pad16; src/cuda/kvcache.cu) on the decode
# benchmark (ours only, dense and paged), against the release shape, in one GPU call:
#   scripts/gpu_tune_kvcache.sh [warps,stages,prefetch[,variant] ...]   (default: all compiled candidates)
# Logs in $OUT (./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
candidates=("$@")
[ ${#candidates[@]} -eq 0 ] && candidates=(4,3,128 4,3,256 4,2,0 2,3,0 2,4,0 8,3,0 4,3,256,pad16)
bash scripts/build_tuning.sh "$out/kvtune_build.log" || exit 1
for candidate in release "${candidates[@]}"; do
  if [ "$candidate" = release ]; then unset FLASHATTN_KVCACHE_CONFIG; else export FLASHATTN_KVCACHE_CONFIG=$candidate; fi
  PYTHONUNBUFFERED=1 timeout 120 python3 bench/gpu_decode.py --lib build-tune/src/libflashattn_c.so \
    --skip-peers --page-size 256 --out "$out/kvtune_$candidate" >"$out/kvtune_$candidate.log" 2>&1
  echo "== $candidate (status $?)"; grep -E '^\| [0-9]+ \| [0-9]+k \|' "$out/kvtune_$candidate.log" | head -4
done
