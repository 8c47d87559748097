#!/usr/bin/env bash
# Times candidate shapes of the kv-cache kernel at head dim 128 (warps, stages, L2 prefetch
# bytes, and a variant: pad16; src/cuda/kvcache.cu) on the decode benchmark through the tuning
# build of the package (dev/build_tuning.sh), against the release shape, in one GPU call:
#   dev/gpu_tune_kvcache.sh [warps,stages,prefetch[,variant] ...]   (default: all compiled candidates)
#   (or: TUNE_ARGS="kv ..." scripts/gpu.sh tune)
# TUNE_BENCH_ARGS: extra arguments of bench/decode.py. Results in $OUT/kvtune_*.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${OUT:-gpu-results}
mkdir -p "$out"
candidates=("$@")
[ ${#candidates[@]} -eq 0 ] && candidates=("4,3,128" "4,3,256" "4,2,0" "2,3,0" "2,4,0" "8,3,0" "4,3,256,pad16")
bash dev/build_tuning.sh "$out/kvtune_build.log" || exit 1
failed=0
for candidate in release "${candidates[@]}"; do
  if [ "$candidate" = release ]; then unset FLASHATTN_KVCACHE_CONFIG; else export FLASHATTN_KVCACHE_CONFIG=$candidate; fi
  # shellcheck disable=SC2086  # TUNE_BENCH_ARGS is a list of arguments
  PYTHONPATH=build-tune/site PYTHONUNBUFFERED=1 timeout 120 "${PYTHON:-python3}" bench/decode.py \
    --out "$out/kvtune_$candidate" ${TUNE_BENCH_ARGS:-} >"$out/kvtune_$candidate.log" 2>&1
  status=$?
  [ $status -eq 0 ] || failed=1
  echo "== $candidate (status $status)"
  cat "$out/kvtune_$candidate"/*.md 2>/dev/null | head -20
done
exit $failed
