#!/usr/bin/env bash
# Scratch: one device call for forward experiments kept as dev/*.patch, applied together to one
# tree and run against main. From the main checkout:
#   dev/device_snapshot.sh main .snap dev/A.patch dev/B.patch ... && dev/device_snapshot.sh main .snap_base
# carry [".snap", ".snap_base"], then `cd .snap && bash dev/gpu_patches_session.sh`. (Its run of
# 2026-12-07 took the patches of f3d39c8: `git show f3d39c8:dev/forward_k_ahead.patch`, ...) Stages
# (PATCHES_STAGES, default "ab tests sanitize"; each starts only while PATCHES_LIMIT_S leaves
# room for it; the device keeps no uncarried folder between calls, so a later call rebuilds):
#   ab        dev/ab.sh: both trees' packages, then bf16 forward (head dims 128, 256 at 512, 1k,
#             16k, causal or not) and bench/forward_fp8.py (512, 2k, 8k; v row-major and
#             (d, seqlen)-major), ours only, two alternating rounds
#   tests     on the patched package: tests/python/test_gpu.py's forward, varlen and paged cases,
#             tests/python/test_fp8.py's CUDA cases
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck on dense and varlen bf16 calls
#             (two and three consumers, causal, GQA) and an fp8 call whose v is copied
#   profile   Nsight Compute on the base tree's bf16 forward (PATCHES_PROFILE_SHAPES, "hdim seqlen"
#             pairs, default 128 x 16k and 128 x 512): pipes, warp states, samples per SASS
#             instruction summarised by dev/ncu_source_stalls.py
#   cpu       bench/cpu.py on the host's threads, forward only at 512 and 1k, fp32 and bf16
# Logs in $OUT (packed in one archive); a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
py=python3
out=${OUT:-gpu-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
limit=${PATCHES_LIMIT_S:-570}
start=$SECONDS
left() { echo $((limit - (SECONDS - start))); }
rows=()
row() { rows+=("$(printf '%-34s %-5s %5ss  %s' "$1" "$2" "$3" "$4")"); }
echo "== dev/gpu_patches_session.sh $(date -u '+%Y-%m-%d %H:%M UTC') on $(cat COMMIT 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
site=$PWD/build-ab/site
stages=" ${PATCHES_STAGES:-ab tests sanitize} "

if [[ $stages == *" ab "* ]]; then
  t=$SECONDS
  OUT=$out AB_PASSES="forward forward_fp8" \
    AB_ARGS_forward="--hdims 128 256 --seqlens 512 1024 16384 --peers= --target-s 0.1" \
    AB_ARGS_forward_fp8="--hdims 128 256 --seqlens 512 2048 8192 --peers= --target-s 0.1" \
    timeout $(($(left) - 150)) bash dev/ab.sh ../.snap_base >"$out/ab.log" 2>&1
  rc=$?
  row "ab.sh forward + forward_fp8" "rc$rc" $((SECONDS - t)) ""
  grep -E "serializ|spill" "$out"/ab/build_this.log | grep -v " 0 bytes spill" | cut -c1-160 | head -5
  for metric in "" --kernel; do
    "$py" dev/ab_harness_table.py "$out/ab" forward forward_fp8 $metric --systems=ours,ours_vt
  done
fi

if [[ $stages == *" tests "* ]] && [ "$(left)" -gt 90 ]; then
  t=$SECONDS
  (cd /tmp && PYTHONPATH=$site timeout $(($(left) / 2)) "$py" -m pytest -q -x -p no:cacheprovider --tb=short \
     "$OLDPWD/tests/python/test_gpu.py" -k "forward or varlen or paged") >"$out/pytest_gpu.log" 2>&1
  rc=$?
  row "pytest test_gpu.py forward|varlen|paged" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pytest_gpu.log" | cut -c1-60)"
  [ $rc = 0 ] || grep -E "^(FAILED|E  )" "$out/pytest_gpu.log" | cut -c1-200 | head -20
  t=$SECONDS
  (cd /tmp && PYTHONPATH=$site timeout $(($(left) - 60)) "$py" -m pytest -q -p no:cacheprovider --tb=short \
     "$OLDPWD/tests/python/test_fp8.py" -k cuda) >"$out/pytest_fp8.log" 2>&1
  rc=$?
  row "pytest test_fp8.py -k cuda" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pytest_fp8.log" | cut -c1-60)"
  [ $rc = 0 ] || grep -E "^(FAILED|E  )" "$out/pytest_fp8.log" | cut -c1-200 | head -20
fi

if [[ $stages == *" sanitize "* ]] && [ "$(left)" -gt 60 ]; then
  for tool in memcheck racecheck synccheck; do
    [ "$(left)" -gt 40 ] || break
    t=$SECONDS
    PYTHONPATH=$site timeout $(($(left) - 20 < 150 ? $(left) - 20 : 150)) compute-sanitizer --tool $tool --error-exitcode 99 \
      "$py" dev/sanitize_forward_calls.py >"$out/sanitize_$tool.log" 2>&1
    rc=$?
    row "compute-sanitizer $tool" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1 | sed 's/^=* *//')"
    [ $rc = 0 ] || grep -E -A4 'Race reported|Error:|Invalid|Barrier' "$out/sanitize_$tool.log" |
      sed 's/^=* *//; s/_ZN9flashattn6detail4cuda//g' | cut -c1-220 | head -16
  done
fi

if [[ $stages == *" profile "* ]] && [ "$(left)" -gt 90 ]; then
  # Nsight Compute on one bf16 forward launch per shape of the base tree's package: the pipes,
  # the warp states, and the samples per SASS instruction (where the consumers wait, for what).
  cat >"$out/ncu_call.py" <<'PY'
import sys, torch, flashattn
d, s = int(sys.argv[1]), int(sys.argv[2])
x = [torch.randn(16384 // s, s, 2048 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
for _ in range(2):
    flashattn.flash_attn_func(*x, causal=len(sys.argv) > 3)
torch.cuda.synchronize()
PY
  metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_active,gpu__time_duration.sum
  # shellcheck disable=SC2086
  set -- ${PATCHES_PROFILE_SHAPES:-128 16384 128 512}
  while [ $# -ge 2 ] && [ "$(left)" -gt 60 ]; do
    t=$SECONDS
    rep="$out/src_$1_$2"
    PYTHONPATH=$PWD/../.snap_base/build-ab/site NCU_METRICS=$metrics bash dev/ncu_source.sh "$rep" forward_ws 120 \
      "$py" "$out/ncu_call.py" "$1" "$2"
    rc=$?
    row "ncu source d$1 s$2" "rc$rc" $((SECONDS - t)) ""
    echo "== ncu d$1 s$2"
    grep -E "pct_of_peak|per_cycle|duration|Stall|Warp Cycles Per Issued" "$rep.txt" | sed 's/  */ /g' | head -20
    head -70 "$rep.stalls"
    shift 2
  done
fi

if [[ $stages == *" cpu "* ]] && [ "$(left)" -gt 60 ]; then
  for dtype in fp32 bf16; do
    [ "$(left)" -gt 40 ] || break
    t=$SECONDS
    PYTHONPATH=$site timeout $(($(left) / 2)) "$py" bench/cpu.py --threads "$(nproc)" --dtype $dtype --heads 16 \
      --seqlens 512,1024 --modes fwd --repeat 3 --min-time-s 0.3 --out "$out/cpu_$dtype" >"$out/cpu_$dtype.log" 2>&1
    row "bench/cpu.py $dtype 512,1k fwd" "rc$?" $((SECONDS - t)) ""
    tail -14 "$out/cpu_$dtype.log"
  done
fi

tar czf /tmp/patches_results.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/patches_results.tgz "$out/"
echo
printf '%s\n' "${rows[@]}"
