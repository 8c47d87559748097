#!/usr/bin/env bash
# Times candidate tile configurations of the sm80 forward through the tuning build of the
# package (dev/build_tuning.sh), one after the other in one GPU session, with the release
# configuration first as the baseline. Candidates are "headdim,keys,warps,mtiles,qregs" strings
# (FLASHATTN_SM80_CONFIG; src/cuda/sm80/forward_tuning.cu lists the compiled ones).
#   dev/gpu_tune.sh "128,64,8,1,1" ...      (or: TUNE_ARGS="fwd 128,64,8,1,1" scripts/gpu.sh tune)
# TUNE_BENCH_ARGS: extra arguments of bench/forward.py (e.g. --quick). Results in $OUT/tune_*.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${OUT:-gpu-results}
mkdir -p "$out"
bash dev/build_tuning.sh "$out/tune_build.log" || exit 1
failed=0
for candidate in release "$@"; do
  if [ "$candidate" = release ]; then unset FLASHATTN_SM80_CONFIG; else export FLASHATTN_SM80_CONFIG=$candidate; fi
  # shellcheck disable=SC2086  # TUNE_BENCH_ARGS is a list of arguments
  PYTHONPATH=build-tune/site PYTHONUNBUFFERED=1 "${PYTHON:-python3}" bench/forward.py --out "$out/tune_$candidate" \
    ${TUNE_BENCH_ARGS:-} >"$out/tune_$candidate.log" 2>&1
  status=$?
  [ $status -eq 0 ] || failed=1
  echo "== $candidate (status $status)"
  cat "$out/tune_$candidate"/*.md 2>/dev/null | head -40
done
exit $failed
