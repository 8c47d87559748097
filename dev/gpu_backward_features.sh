#!/usr/bin/env bash
# Scratch: the backward's features on this tree's package (build-ab/site, built by
# dev/gpu_features_session.sh or dev/ab.sh): bench/backward.py with each argument list of
# BWD_FEATURE_RUNS (';'-separated; default softcap 30, ALiBi, deterministic), once as the
# dispatcher picks (on Hopper the TMA kernel) with the FA2 peer, once with
# FLASHATTN_CUDA_BACKWARD=sm80 (the kernels those calls took before), ours only.
set -uo pipefail
cd "$(dirname "$0")/../bench" || exit
out=${OUT:-gpu-results}; mkdir -p "$out"
py=${PYTHON:-python3}
shape=${BWD_SHAPE:---hdims 128 --seqlens 2048 8192}
IFS=';' read -ra runs <<<"${BWD_FEATURE_RUNS:---softcap 30;--alibi;--deterministic}"
for i in "${!runs[@]}"; do
  for family in default sm80; do
    peers=--peers=fa2 forced=
    [ $family = sm80 ] && peers=--peers= forced=sm80
    # shellcheck disable=SC2086  # argument lists
    FLASHATTN_CUDA_BACKWARD=$forced PYTHONPATH=../build-ab/site \
      timeout 120 "$py" backward.py $shape $peers ${runs[$i]} --out "$out/bwd_${i}_$family" \
      >"$out/bwd_${i}_$family.log" 2>&1
    echo "== backward ${runs[$i]} ($family): $?"
    grep -E "^\| d" "$out/bwd_${i}_$family.log" | cut -c1-120
  done
done
