#!/usr/bin/env bash
# Profiles one benchmark shape (default: hdim 128, seqlen 4k, non-causal, bf16) with Nsight
# Compute, our kernel and PyTorch's FlashAttention-2 kernel on the same inputs, so the two can
# be compared metric by metric: instructions, stall reasons, pipe utilisation, bank
# conflicts, spills, and the executed instructions per SASS opcode. Forward by default; `bwd` profiles the backward's main kernels (ours:
# the key-parallel dK/dV kernel; FA2: its dq_dk_dv kernel); `dec` the decode kernel against
# cuDNN's (then the first two arguments are the batch and the cache length). Reports in $OUT
# (./gpu-results).
#   scripts/gpu_profile.sh [hdim] [seqlen] [causal] [fwd|bwd|dec]
set -uo pipefail
cd "$(dirname "$0")/.."
hdim=${1:-128}; seqlen=${2:-4096}; causal=${3:-no}; pass=${4:-fwd}
out=${OUT:-gpu-results}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
# PROFILE_LIB: profile another build of the library (the tuning build, say) instead of
# building the release one.
lib=${PROFILE_LIB:-build-gpu/src/libflashattn_c.so}
if [ ! -f "$lib" ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=OFF >/dev/null &&
    cmake --build build-gpu -j "$(nproc)" --target flashattn_c >"$out/build.log" 2>&1 || exit 1
fi
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis_Chart --section SourceCounters"
bench=bench/gpu_forward.py
[ "$pass" = bwd ] && bench=bench/gpu_backward.py
peer=flash
# dec: the decode kernel against cuDNN's; $hdim is then the batch and $seqlen the cache length
# (for example `gpu_profile.sh 8 32768 no dec`), 32 query / 8 kv heads, head dim 128.
[ "$pass" = dec ] && bench=bench/gpu_decode.py && peer=cudnn
for who in ours $peer; do
  if [ $who = ours ]; then peers=""; else peers=$peer; fi
  case "$pass-$who" in
    fwd-ours) regex=forward_kernel ;;
    fwd-flash) regex=flash_fwd ;;
    bwd-ours) regex=backward_dkdv_kernel ;;
    bwd-flash) regex=flash_bwd_dq_dk_dv ;;
    dec-ours) regex=kvcache_kernel ;;
    dec-cudnn) regex='sdpa|fmha|cudnn' ;;
  esac
  if [ "$pass" = dec ]; then
    args=(--shapes "${hdim}x${seqlen}" --no-graph --repeat 5 --target-s 0.01)
    [ $who = ours ] && args+=(--skip-peers) || args+=(--peers "$peers")
  else
    args=(--peers "$peers" --hdims "$hdim" --seqlens "$seqlen" --causal "$causal" --repeat 5)
  fi
  ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 3 --launch-count 1 $sections --import-source no \
    -o "$out/profile_${pass}_$who" \
    python3 "$bench" --lib "$lib" --out "/tmp/profile-$pass-$who" \
    "${args[@]}" >"$out/ncu_${pass}_$who.log" 2>&1
  ncu --import "$out/profile_${pass}_$who.ncu-rep" --page details --print-units base \
    >"$out/details_${pass}_$who.txt" 2>&1
  # Every collected metric (the L2 and fabric traffic of the memory chart included), and the
  # speed-of-light breakdowns: which unit's throughput is the one near its peak.
  ncu --import "$out/profile_${pass}_$who.ncu-rep" --page raw --print-units base >"$out/raw_${pass}_$who.txt" 2>&1
  ncu --import "$out/profile_${pass}_$who.ncu-rep" --page details --print-details all --section SpeedOfLight \
    --print-units base >"$out/sol_${pass}_$who.txt" 2>&1
  # Stall reasons per issued instruction (WarpStateStats' raw metrics), largest first: where
  # the issue slots go when the instruction counts are alike.
  ncu --import "$out/profile_${pass}_$who.ncu-rep" --page raw --print-units base 2>&1 |
    grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio" |
    awk '{print $NF, $1}' | sort -gr | head -12 >"$out/stalls_${pass}_$who.txt"
  # Executed instructions per SASS opcode (scripts/sass_mix.py), from the source counters.
  ncu --import "$out/profile_${pass}_$who.ncu-rep" --page source --csv --print-source sass \
    >"$out/sass_${pass}_$who.csv" 2>&1
  python3 scripts/sass_mix.py "$out/sass_${pass}_$who.csv" 25 >"$out/sass_mix_${pass}_$who.txt" 2>&1
  echo "== $pass $who ($regex)"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  |No Eligible|Local|Bank" \
    "$out/details_${pass}_$who.txt" | head -24
  echo "   stalls per issued instruction:"; sed 's/^/     /' "$out/stalls_${pass}_$who.txt" | head -8
  echo "   instruction mix:"; sed 's/^/     /' "$out/sass_mix_${pass}_$who.txt" | head -14
done
