#!/usr/bin/env bash
# Scratch: Nsight Compute on the TMA forward through the CLI, one launch per shape: the
# pipes' utilisation (tensor, MUFU = xu, FMA, ALU) and the warp stall reasons, to see what
# bounds a head dim. WS_PROFILE_SHAPES: "hdim seqlen causal(yes|no) ..." triples.
# WS_PROFILE_SOURCE=1: also the warp-state samples per SASS instruction (SourceCounters), the
# report in $OUT/src_<shape>.ncu-rep and its source page as CSV, summarised by
# dev/ncu_source_stalls.py (which instructions the warps wait at, and for what).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH"
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
    -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=OFF && cmake --build build-gpu -j 16 --target flashattn_cli; } \
  >"$out/build.log" 2>&1
stamp "build: $?"
metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
set -- ${WS_PROFILE_SHAPES:-64 8192 no 128 8192 no}
while [ $# -ge 3 ]; do
  d=$1 n=$2 c=$3; shift 3
  args=(run --backend cuda --dtype bf16 --head-dim "$d" --seqlen-q "$n" --batch $((16384 / n)) --heads $((2048 / d)) --repeat 3)
  [ "$c" = yes ] && args+=(--causal)
  timeout 90 ncu --kernel-name regex:forward_ws --launch-skip 1 --launch-count 1 --metrics "$metrics" \
    --section WarpStateStats build-gpu/tools/flashattn "${args[@]}" >"$out/ncu_${d}_${n}_${c}.txt" 2>&1
  stamp "ncu hdim $d seqlen $n causal $c: $?"
  grep -E "pct_of_peak|duration|per_second|Stall|Warp Cycles Per Issued|Issued Warp" "$out/ncu_${d}_${n}_${c}.txt" | sed 's/  */ /g' | head -24
  if [ -n "${WS_PROFILE_SOURCE:-}" ]; then
    rep="$out/src_${d}_${n}_${c}"
    timeout 150 ncu --kernel-name regex:forward_ws --launch-skip 1 --launch-count 1 --section SourceCounters \
      --section WarpStateStats -f -o "$rep" build-gpu/tools/flashattn "${args[@]}" >"$rep.log" 2>&1
    ncu --import "$rep.ncu-rep" --page source --print-source sass --csv >"$rep.csv" 2>>"$rep.log"
    stamp "ncu source hdim $d seqlen $n causal $c: $?"
    python3 dev/ncu_source_stalls.py "$rep.csv" | head -60
  fi
done
