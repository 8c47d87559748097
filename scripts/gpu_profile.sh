#!/usr/bin/env bash
# Profiles one benchmark shape (default: hdim 128, seqlen 4k, non-causal, bf16) with Nsight
# Compute, our forward kernel and PyTorch's FlashAttention-2 kernel on the same inputs, so the
# two can be compared metric by metric: instructions, stall reasons, pipe utilisation, bank
# conflicts, spills. Reports in $OUT (or ./gpu-results).
#   scripts/gpu_profile.sh [hdim] [seqlen] [causal]
set -uo pipefail
cd "$(dirname "$0")/.."
hdim=${1:-128}; seqlen=${2:-4096}; causal=${3:-no}
out=${OUT:-gpu-results}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
if [ ! -f build-gpu/src/libflashattn_c.so ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=OFF >/dev/null &&
    cmake --build build-gpu -j "$(nproc)" --target flashattn_c >"$out/build.log" 2>&1 || exit 1
fi
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables"
for who in ours flash; do
  if [ $who = ours ]; then regex=forward_kernel; peers=""; else regex=flash_fwd; peers=flash; fi
  ncu --kernel-name "regex:$regex" --launch-skip 3 --launch-count 1 $sections --import-source no \
    -o "$out/profile_$who" \
    python3 bench/gpu_forward.py --lib build-gpu/src/libflashattn_c.so --out "/tmp/profile-$who" \
    --peers "$peers" --hdims "$hdim" --seqlens "$seqlen" --causal "$causal" --repeat 5 \
    >"$out/ncu_$who.log" 2>&1
  ncu --import "$out/profile_$who.ncu-rep" --page details --print-units base >"$out/details_$who.txt" 2>&1
  echo "== $who ($regex)"
  grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  |No Eligible|Local|Bank" \
    "$out/details_$who.txt" | head -20
done
