#!/usr/bin/env bash
# Scratch: the device work prepared without a GPU on 2026-12-08, on one build of main +
# dev/forward_stale_max.patch + dev/fp8_copy_threshold.patch. From the main checkout:
#   dev/device_snapshot.sh main .snap dev/forward_stale_max.patch dev/fp8_copy_threshold.patch
# carry [".snap"], then `cd .snap && bash dev/gpu_pending.sh`. PENDING_STAGES picks stages
# (default all, in this order; each starts only while PENDING_LIMIT_S, default 570, leaves it
# room; a second call on a fresh machine rebuilds, so split them as "stale fp8stale sanitize"
# and "threshold gpt sweep642 bwdprofile" where one call cannot hold them all):
#   stale       the GPU tests (test_gpu.py's forward, varlen, paged and cuda cases; test_fp8.py's
#               CUDA cases) with the stale max on, then bf16 forward under FLASHATTN_DEV_STALE_MAX
#               0 and 1, two rounds (dev/gpu_knob_ab.sh; issue 29)
#   fp8stale    the same A/B on bench/forward_fp8.py at head dim 128 (issue 31)
#   sanitize    compute-sanitizer racecheck and synccheck on dev/sanitize_forward_calls.py
#   threshold   the FP8 copy's threshold, FLASHATTN_DEV_FP8_COPY_MIN 2048 against 256, head dim
#               256 at 512 and 1k (issue 31)
#   gpt         examples/gpt/benchmark.py, the 125M model at 2k and 8k, --rounds 2
#               --profile-kernels, the stale max off (main's arithmetic; issue 33's 0.90x FA2)
#   sweep642    call 642 of the GPU sweep again, verbose (issue 34: an lse off by 1.5e-3)
#   bwdprofile  Nsight Compute's samples per SASS instruction on one causal backward launch each
#               at head dims 128 (TMA kernel) and 256 (cp.async kernel), 8k (issue 30)
# Results in $OUT; a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
limit=${PENDING_LIMIT_S:-570}
stages=" ${PENDING_STAGES:-stale fp8stale sanitize threshold gpt sweep642 bwdprofile} "
left() { echo $((limit - SECONDS)); }
wants() { [[ $stages == *" $1 "* ]] && [ "$(left)" -gt "$2" ]; }
rows=()
row() { rows+=("$(printf '%-36s %-5s %5ss  %s' "$1" "$2" "$3" "$4")"); }
echo "== dev/gpu_pending.sh $(date -u '+%Y-%m-%d %H:%M UTC') on $(cat COMMIT 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/build-ab/site

t=$SECONDS
[ -d .deps/wheels ] && python3 -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps --no-index --upgrade \
  --target build-ab/site -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON \
  -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/build.log" 2>&1
rc=$?
row "package (sm_90a)" "rc$rc" $((SECONDS - t)) ""
[ $rc = 0 ] || { tail -20 "$out/build.log"; exit 1; }

knob_ab() {  # STAGE-NAME, then environment assignments for dev/gpu_knob_ab.sh
  local name=$1 t=$SECONDS
  shift
  env OUT="$out" KNOB_BUILD=0 "$@" bash dev/gpu_knob_ab.sh 2>&1 | tail -34
  row "$name" "rc${PIPESTATUS[0]}" $((SECONDS - t)) ""
}
wants stale 200 && knob_ab "stale max: tests, bf16 A/B" KNOB=FLASHATTN_DEV_STALE_MAX KNOB_TEST_S=150 \
  KNOB_PYTEST="$PWD/tests/python/test_gpu.py $PWD/tests/python/test_fp8.py -k 'forward or varlen or paged or cuda'"
wants fp8stale 120 && knob_ab "stale max: fp8 A/B" KNOB=FLASHATTN_DEV_STALE_MAX KNOB_TEST_S=0 KNOB_BENCH=forward_fp8 \
  KNOB_SYSTEMS=ours,ours_vt KNOB_BENCH_ARGS="--hdims 128 --seqlens 2048 8192 --target-s 0.05"

for tool in racecheck synccheck; do
  wants sanitize 60 || break
  t=$SECONDS
  FLASHATTN_DEV_STALE_MAX=1 timeout 120 compute-sanitizer --tool $tool --error-exitcode 99 python3 dev/sanitize_forward_calls.py \
    >"$out/sanitize_$tool.log" 2>&1
  rc=$?
  row "compute-sanitizer $tool" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) \
    "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1 | sed 's/^=* *//')"
  [ $rc = 0 ] || grep -E -A4 'Race reported|Error:|Invalid|Barrier' "$out/sanitize_$tool.log" | cut -c1-200 | head -12
done

wants threshold 100 && knob_ab "fp8 copy threshold A/B" KNOB=FLASHATTN_DEV_FP8_COPY_MIN KNOB_VALUES="2048 256" \
  KNOB_TEST_S=0 KNOB_BENCH=forward_fp8 KNOB_SYSTEMS=ours,ours_vt KNOB_BENCH_ARGS="--hdims 256 --seqlens 512 1024 --target-s 0.05"

if wants gpt 150; then
  t=$SECONDS
  FLASHATTN_DEV_STALE_MAX=0 timeout $(($(left) - 40)) python3 examples/gpt/benchmark.py --device cuda --sizes 125m \
    --seqlens 2048 8192 --rounds 2 --steps 6 --profile-kernels --gen-batches 1 --gen-tokens 32 --out "$out/gpt" \
    >"$out/gpt.log" 2>&1
  row "GPT 125M, rounds 2, kernels" "rc$?" $((SECONDS - t)) ""
  sed -n '/^| size | seqlen/,/^| size | batch/p' "$out/gpt/benchmark.md" 2>/dev/null | head -12
  grep -A12 "one step's operations" "$out/gpt/benchmark.md" 2>/dev/null | head -60
fi

if wants sweep642 40; then
  t=$SECONDS
  timeout 60 python3 scripts/gpu_sweep.py --device cuda --seed 2 --only 642 --verbose >"$out/sweep_642.log" 2>&1
  row "gpu_sweep.py --seed 2 --only 642" "rc$?" $((SECONDS - t)) "$(tail -1 "$out/sweep_642.log" | cut -c1-60)"
  tail -6 "$out/sweep_642.log" | cut -c1-400
fi

cat >"$out/backward_call.py" <<'PY'
import sys, torch, flashattn
d, s = int(sys.argv[1]), int(sys.argv[2])
q, k, v = (torch.randn(16384 // s, s, 2048 // d, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flashattn.flash_attn_func(q, k, v, causal=True)
dout = torch.randn_like(out)
for _ in range(2):
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
torch.cuda.synchronize()
PY
for shape in "128 8192" "256 8192"; do
  wants bwdprofile 40 || break
  read -r d n <<<"$shape"
  t=$SECONDS
  rep="$out/bwd_src_${d}_$n"
  bash dev/ncu_source.sh "$rep" 'backward_(ws|dkdv)' $(($(left) - 10 < 120 ? $(left) - 10 : 120)) \
    python3 "$out/backward_call.py" "$d" "$n"
  rc=$?
  row "ncu backward d$d s$n causal" "rc$rc" $((SECONDS - t)) ""
  tail -16 "$rep.stalls"
done

tar czf /tmp/pending_results.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/pending_results.tgz "$out/"
echo
printf '%s\n' "${rows[@]}"
