#!/usr/bin/env bash
# Profiles the forward kernel with Nsight Compute on one benchmark shape (default: hdim 128,
# seqlen 4k, non-causal, bf16): stall reasons, pipe utilisation, shared-memory bank conflicts,
# spills. Report in $OUT (or ./gpu-results).  scripts/gpu_profile.sh [hdim] [seqlen] [causal]
set -uo pipefail
cd "$(dirname "$0")/.."
hdim=${1:-128}; seqlen=${2:-4096}; causal=${3:-no}
out=${OUT:-gpu-results}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
  -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=OFF >/dev/null &&
  cmake --build build-gpu -j "$(nproc)" --target flashattn_c >"$out/build.log" 2>&1 || exit 1
ncu --kernel-name regex:forward_kernel --launch-skip 3 --launch-count 1 --set full \
  --import-source no -o "$out/profile" \
  python3 bench/gpu_forward.py --lib build-gpu/src/libflashattn_c.so --out /tmp/profile-bench \
  --skip-peers --hdims "$hdim" --seqlens "$seqlen" --causal "$causal" --repeat 5 \
  >"$out/ncu.log" 2>&1
ncu --import "$out/profile.ncu-rep" --page details --print-units base >"$out/details.txt" 2>&1
grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc|Warp Cycles Per Issued|Stall|Bank Conflicts|Shared Memory|L2 Hit|Local|Compute \(SM\) Throughput|Memory Throughput|Tensor|One or More|No Eligible|Theoretical Occupancy|Block Limit" \
  "$out/details.txt" | head -70
