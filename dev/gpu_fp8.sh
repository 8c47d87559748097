#!/usr/bin/env bash
# Scratch: one GPU call for the FP8 forward (issue 31), each stage started while the call's
# budget (FP8_LIMIT_S, default 560 s) leaves room for it:
#   (FP8_GTEST_S: the limit of each C++ suite, FP8_PYTEST_S of each pytest run, in seconds.)
#   1. the package built with CUDA for sm_90a and installed (its ptxas lines on the FP8
#      kernels: spills, serialised wgmmas), or with FP8_SITE=DIR the one installed there (as
#      dev/gpu_backward256.sh leaves it in build-ab/site; no C++ suites then); unless
#      FP8_GTEST=0, the C++ FP8 suites on CUDA (test_fp8_cuda, test_kvcache_cuda) built in
#      the package's build tree and run;
#   2. dev/fp8_diagnose.py (GPU against the CPU path on inputs that isolate the key order,
#      the sums and the descales), tests/python/test_fp8.py (the Hopper kernel against its
#      float64 emulation, varlen, paged; FP8_PYTEST_ARGS, default -x --tb=short) and, unless
#      FP8_FULL_PYTEST=0, the whole tests/python GPU file's forward cases;
#      Then (FP8_ACCURACY=0: not) bench/fp8_accuracy.py --cuda: the RMSE on outlier-heavy inputs;
#   3. compute-sanitizer memcheck, racecheck and synccheck on a few FP8 calls
#      (FP8_SANITIZE=0: not);
#   4. bench/forward_fp8.py (FP8_BENCH_ARGS, default the head dims 128 and 256 at 512 .. 16k,
#      causal or not, with cuDNN; FP8_BENCH=0: not);
#   5. FP8 KV caches (FP8_CACHE=0: not): test_kvcache_cuda's Fp8 cases, the GPU fp8-cache
#      tests of tests/python/test_kvcache.py, and bench/decode.py --fp8 (FP8_DECODE_ARGS,
#      default the dense shapes; FP8_DECODE_BENCH=0: not);
#   6. with FP8_NCU=1, Nsight Compute on one forward launch each of e4m3 and bf16 at
#      FP8_NCU_SHAPES ("hdim seqlen" pairs, default 128 16384 256 16384; batch x heads as the
#      grid's): the pipes' utilisation, shared-memory bank conflicts and the warp stall
#      reasons, to see what the FP8 kernel spends beyond the bf16 one (issue 31's speed).
# Results in $OUT (packed in one archive); a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
py=python3
out=${OUT:-gpu-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
limit=${FP8_LIMIT_S:-560}
start=$SECONDS
left() { echo $((limit - (SECONDS - start))); }
rows=()
row() { rows+=("$(printf '%-40s %-5s %5ss  %s' "$1" "$2" "$3" "$4")"); }
echo "== dev/gpu_fp8.sh $(date -u '+%Y-%m-%d %H:%M UTC')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

t=$SECONDS
if [ -n "${FP8_SITE:-}" ]; then
  export PYTHONPATH=$PWD/$FP8_SITE FP8_GTEST=0
  row "package (FP8_SITE=$FP8_SITE)" "$("$py" -c 'import flashattn' && echo ok || echo FAIL)" 0 ""
else
# With FP8_GTEST the package's build also configures the C++ tests, which then link the
# library it compiled (one build of the kernels, not two).
tests_on=$([ "${FP8_GTEST:-1}" = 1 ] && echo ON || echo OFF)
"$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
  -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a \
  -C cmake.define.FLASHATTN_BUILD_TESTS=$tests_on . >"$out/pip.log" 2>&1
rc=$?
row "package (sm_90a)" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
  "$(grep -c 'fp8.*serializ\|serializ.*fp8' "$out/pip.log") fp8 serialisation lines"
grep -E "nv_fp8.*(spill|serializ)|(spill|serializ).*nv_fp8" "$out/pip.log" | sed 's/_ZN9flashattn6detail4cuda4sm90//' | cut -c1-160 | head
[ $rc = 0 ] || { tail -30 "$out/pip.log"; exit 1; }
fi
if [ "${FP8_GTEST:-1}" = 1 ]; then
  cmake --build build-py/gpu --target test_fp8_cuda test_kvcache_cuda >"$out/gtest_build.log" 2>&1 &&
    t=$SECONDS && timeout "${FP8_GTEST_S:-200}" build-py/gpu/tests/test_fp8_cuda >"$out/gtest_fp8.log" 2>&1
  rc=$?
  row "test_fp8_cuda" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
    "$(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_fp8.log" | tr '\n' ' ' | cut -c1-70)"
  [ $rc = 0 ] || { tail -5 "$out/gtest_build.log"; grep -E 'Failure|error|FAILED|Expected|Which is|out error' "$out/gtest_fp8.log" | head -30; }
fi

t=$SECONDS
timeout 90 "$py" dev/fp8_diagnose.py >"$out/diagnose.log" 2>&1
row "dev/fp8_diagnose.py" "rc$?" $((SECONDS - t)) ""
t=$SECONDS
# shellcheck disable=SC2086
(cd /tmp && timeout "${FP8_PYTEST_S:-200}" "$py" -m pytest -q -rs -p no:cacheprovider ${FP8_PYTEST_ARGS:--x --tb=short} \
   "$OLDPWD/tests/python/test_fp8.py") >"$out/pytest_fp8.log" 2>&1
rc=$?
row "pytest test_fp8.py" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pytest_fp8.log" | cut -c1-70)"
[ $rc = 0 ] || grep -E "^(FAILED|E  |>|test_fp8.py:[0-9]+)" "$out/pytest_fp8.log" | cut -c1-200 | head -30
fp8_ok=$rc
if [ "${FP8_ACCURACY:-1}" = 1 ] && [ "$(left)" -gt 200 ]; then
  t=$SECONDS
  (cd bench && timeout 150 "$py" fp8_accuracy.py --cuda --out "$out/accuracy") >"$out/accuracy.log" 2>&1
  rc=$?
  row "bench/fp8_accuracy.py --cuda" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) \
    "$(grep -E '^\| per-block \+ Hadamard' "$out/accuracy.log" | cut -c1-60)"
fi

if [ "${FP8_FULL_PYTEST:-1}" = 1 ] && [ "$(left)" -gt 300 ]; then
  t=$SECONDS
  (cd /tmp && timeout $(($(left) - 240)) "$py" -m pytest -q -x -p no:cacheprovider "$OLDPWD/tests/python/test_gpu.py" -k "forward or varlen or paged") >"$out/pytest_gpu.log" 2>&1
  rc=$?
  row "pytest test_gpu.py -k forward|varlen|paged" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pytest_gpu.log" | cut -c1-70)"
  [ $rc = 0 ] || grep -E "^(FAILED|E  )" "$out/pytest_gpu.log" | head -20
fi

if [ "${FP8_SANITIZE:-1}" = 1 ] && [ "$(left)" -gt 200 ]; then
  cat >"$out/fp8_calls.py" <<'PY'
import torch, flashattn
g = torch.Generator(device="cuda").manual_seed(0)
# (the last: 2100 query rows per key, which the library runs on a (d, seqlen)-major copy of v)
for d, causal, block, sq, sk in ((128, False, False, 200, 333), (128, True, True, 257, 257), (256, True, False, 130, 400),
                                 (96, False, True, 64, 129), (128, True, False, 2100, 333)):
    x = [torch.randn(2, s, 2, d, device="cuda", generator=g) for s in (sq, sk, sk)]
    (q8, qd), (k8, kd), (v8, vd) = (flashattn.quantize_fp8(t, block_scaling=block) for t in x)
    out = flashattn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    # v (d, seqlen)-major (kSeqlenMajorValues), its columns padded to 16-byte multiples
    store = torch.zeros(2, 2, d, -(-sk // 16) * 16, device="cuda").to(v8.dtype)
    store[..., :sk] = v8.permute(0, 2, 3, 1)
    vt = store[..., :sk].permute(0, 3, 1, 2)
    out_t = flashattn.flash_attn_func(q8, k8, vt, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    torch.cuda.synchronize()
    print(d, causal, block, bool(out.isfinite().all()), bool(out_t.isfinite().all()))
PY
  for tool in memcheck racecheck synccheck; do
    t=$SECONDS
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 "$py" "$out/fp8_calls.py" >"$out/sanitize_$tool.log" 2>&1
    rc=$?
    row "compute-sanitizer $tool (fp8 calls)" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) \
      "$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1 | sed 's/^=* *//')"
    # What a finding was (kernel, access, offset), shortened: the logs come back only packed.
    [ $rc = 0 ] || grep -E -A4 'Race reported|Error:|Invalid|Barrier' "$out/sanitize_$tool.log" |
      sed 's/^=* *//; s/_ZN9flashattn6detail4cuda//g' | cut -c1-220 | head -24
  done
fi

if [ "${FP8_CACHE:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then
  t=$SECONDS
  if [ "${FP8_GTEST:-1}" = 1 ]; then
    timeout "${FP8_GTEST_S:-150}" build-py/gpu/tests/test_kvcache_cuda --gtest_filter='*Fp8*' >"$out/gtest_kvcache_fp8.log" 2>&1
    rc=$?
    row "test_kvcache_cuda *Fp8*" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
      "$(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_kvcache_fp8.log" | tr '\n' ' ' | cut -c1-70)"
    [ $rc = 0 ] || grep -E 'Failure|FAILED|Expected|Which is|max abs|off by' "$out/gtest_kvcache_fp8.log" | head -20
  fi
  t=$SECONDS
  (cd /tmp && timeout 150 "$py" -m pytest -q -x --tb=short -p no:cacheprovider "$OLDPWD/tests/python/test_kvcache.py" -k gpu_fp8_cache) \
    >"$out/pytest_kvcache_fp8.log" 2>&1
  rc=$?
  row "pytest test_kvcache.py -k gpu_fp8_cache" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pytest_kvcache_fp8.log" | cut -c1-70)"
  [ $rc = 0 ] || grep -E "^(FAILED|E  )" "$out/pytest_kvcache_fp8.log" | cut -c1-200 | head -20
  if [ "${FP8_DECODE_BENCH:-1}" = 1 ] && [ "$(left)" -gt 80 ]; then
    t=$SECONDS
    # shellcheck disable=SC2086
    timeout $(($(left) - 20)) "$py" bench/decode.py --out "$out/decode" --fp8 ${FP8_DECODE_ARGS:---dense-only --peers cudnn --target-s 0.3} \
      >"$out/decode.log" 2>&1
    rc=$?
    row "bench/decode.py --fp8" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) "${FP8_DECODE_ARGS:-}"
  fi
fi

if [ "${FP8_BENCH:-1}" = 1 ] && [ "$fp8_ok" = 0 ] && [ "$(left)" -gt 90 ]; then
  t=$SECONDS
  # shellcheck disable=SC2086
  timeout $(($(left) - 20)) "$py" bench/forward_fp8.py --out "$out/bench" ${FP8_BENCH_ARGS:---hdims 128 256 --peers cudnn --target-s 0.3} \
    >"$out/bench.log" 2>&1
  rc=$?
  row "bench/forward_fp8.py" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) "${FP8_BENCH_ARGS:-}"
fi

if [ "${FP8_NCU:-0}" = 1 ] && [ "$(left)" -gt 60 ]; then
  cat >"$out/ncu_call.py" <<'PY'
import sys, torch, flashattn
d, s, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
x = [torch.randn(16384 // s, s, 2048 // d, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
if kind == "fp8":
    (q, qd), (k, kd), (v, vd) = (flashattn.quantize_fp8(t) for t in x)
    options = dict(q_descale=qd, k_descale=kd, v_descale=vd)
else:
    (q, k, v), options = x, {}
for _ in range(2):
    flashattn.flash_attn_func(q, k, v, **options)
torch.cuda.synchronize()
PY
  metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,gpu__time_duration.sum
  # shellcheck disable=SC2086
  set -- ${FP8_NCU_SHAPES:-128 16384 256 16384}
  while [ $# -ge 2 ] && [ "$(left)" -gt 40 ]; do
    for kind in fp8 bf16; do
      t=$SECONDS
      timeout 90 ncu --kernel-name regex:forward_ws --launch-skip 1 --launch-count 1 --metrics "$metrics" \
        --section WarpStateStats "$py" "$out/ncu_call.py" "$1" "$2" $kind >"$out/ncu_${1}_${2}_$kind.txt" 2>&1
      row "ncu d$1 s$2 $kind" "rc$?" $((SECONDS - t)) ""
      echo "== ncu d$1 s$2 $kind"
      grep -E "pct_of_peak|bank_conflicts|op_shared|duration|Stall|Warp Cycles Per Issued" "$out/ncu_${1}_${2}_$kind.txt" |
        sed 's/  */ /g' | head -24
    done
    shift 2
  done
fi

echo
cat "$out/diagnose.log"
[ -f "$out/bench/forward_fp8.md" ] && sed -n '/^| shape/,$p' "$out/bench/forward_fp8.md" | cut -d'|' -f1-6,10-12 | head -40
grep -E "fp8 caches|copy bandwidth" "$out/decode.log" 2>/dev/null
# At most 8 files come back from the device: everything in one archive.
tar czf /tmp/gpu_fp8_results.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/gpu_fp8_results.tgz "$out/"
echo
printf '%s\n' "${rows[@]}"
