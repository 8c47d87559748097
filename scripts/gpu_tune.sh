#!/usr/bin/env bash
# Times candidate tile configurations of the sm80 forward (ours only, bf16) on the benchmark
# grid, one after the other in one GPU session, with the release configuration first as the
# baseline. Candidates are "headdim,keys,warps,mtiles,qregs" strings compiled into a tuning
# build (src/cuda/sm80/forward_tuning.cu).   scripts/gpu_tune.sh "128,64,8,1,1" ...
# TUNE_SEQLENS (default 512,1k,4k,16k) and TUNE_RELEASE_HDIMS (64,128,256) narrow the grid.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
bash scripts/build_tuning.sh "$out/tune_build.log" || exit 1
for candidate in release "$@"; do
  hdim=${candidate%%,*}
  [ "$candidate" = release ] && hdim=${TUNE_RELEASE_HDIMS:-64,128,256}
  if [ "$candidate" = release ]; then unset FLASHATTN_SM80_CONFIG; else export FLASHATTN_SM80_CONFIG=$candidate; fi
  python3 bench/gpu_forward.py --lib build-tune/src/libflashattn_c.so --out "/tmp/tune-$candidate" \
    --skip-peers --hdims "$hdim" --seqlens "${TUNE_SEQLENS:-512,1k,4k,16k}" --causal both --target-s 0.15 \
    >"$out/tune_$candidate.log" 2>&1
  echo "== $candidate"
  grep -E "^\| [0-9]+ \| (no|yes)" "/tmp/tune-$candidate/results.md" | awk -F'|' '$5 + 0 >= 1 {printf "  hdim %s causal %s seqlen %s: %s TFLOP/s\n", $2, $3, $4, $5}'
done
