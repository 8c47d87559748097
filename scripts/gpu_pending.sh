#!/usr/bin/env bash
# The changes waiting for a GPU (compile-checked only; on the gpu-pending branch: the
# backward's bulk dQ reductions on sm_90, the kv-cache kernel's plain variant and smaller
# body), one stage per GPU call so that each fits the 600-second limit and prints its
# summary as soon as it is done:
#   scripts/gpu_pending.sh backward   GPU tests + sanitizers (gpu_check.sh test) and the
#                                     backward benchmark against FA2 and cuDNN (~6 min)
#   scripts/gpu_pending.sh both       backward, then the kv-cache suite, sanitizers and decode
#                                     benchmark on the same build (~7 min)
#   scripts/gpu_pending.sh kvcache    the CUDA kv-cache suite, sanitizers, decode benchmark,
#                                     then a split-count sweep at batch 1 (~3 min)
#   scripts/gpu_pending.sh kvtune     kv-cache shapes at head dim 128 (gpu_tune_kvcache.sh)
#   scripts/gpu_pending.sh profiles   Nsight Compute with stall reasons: the backward's dK/dV
#                                     kernel against FA2's (hdim 128, 4k) and the decode
#                                     kernel against cuDNN's at 1 x 8k (~3.5 min)
#   scripts/gpu_pending.sh dqcompare  build, then the backward (ours only, hdim 64 and 128) with
#                                     bulk dQ reductions against atomics (FLASHATTN_CUDA_DQ_ATOMICS),
#                                     then the profiles stage on the same build (~8 min)
#   scripts/gpu_pending.sh fwd256dq   the tuning build once, the backward at head dim 256 with bulk
#                                     dQ against atomics (ours only), then the fwd256 stage
#   scripts/gpu_pending.sh prefetch   L2 prefetch hints on the K/V copies: the tuning build with
#                                     the CUDA kv-cache suite (its release kernel now asks for
#                                     256-byte prefetches), memcheck, the decode benchmark with
#                                     the peers, then ours only with 0/128 bytes and the
#                                     forward at hdim 64/128 with 256 against none (~6 min)
#   scripts/gpu_pending.sh bwd64      the backward at head dim 64 with FA2's shape (128 query rows
#                                     per step; FLASHATTN_SM80_BWD_CONFIG=64,128,128,8 in the
#                                     tuning build): the CUDA backward suite with it, memcheck and
#                                     racecheck, then ours (release and candidate) against the
#                                     peers at hdim 64 (~6 min)
#   scripts/gpu_pending.sh kvprofile  Nsight Compute: the decode kernel against cuDNN's at
#                                     8 x 32k and 1 x 8k (gpu_profile.sh ... dec)
#   scripts/gpu_pending.sh fwd256     the forward at head dim 256, short sequences: the
#                                     release 128-row shape against 64-row 4-warp CTAs (two
#                                     per SM, FA2's choice), where the gap to FA2 is largest
# Logs go to $OUT/<stage>/ and are packed into $OUT/<stage>.tgz (the device returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage: backward, both, profiles, kvcache, kvtune, kvprofile or fwd256}
top=${OUT:-gpu-results}
export OUT="$top/$stage"
mkdir -p "$OUT"
case "$stage" in
  backward)
    bash scripts/gpu_try_backward.sh 2>&1 | tee "$OUT/pending.txt" | tail -45 ;;
  both)
    BWD_HDIMS=256,128,64 bash scripts/gpu_try_backward.sh >"$OUT/pending.txt" 2>&1
    # hdim 256 with the previous 64 x 32 tiles (a lowered shared-memory limit skips the new
    # 64 x 64 shape), ours only, to compare the two shapes in the same run.
    FLASHATTN_CUDA_SMEM_LIMIT=190000 PYTHONUNBUFFERED=1 timeout 120 python3 bench/gpu_backward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/backward_256_64x32" --hdims 256 \
      --seqlens 1k,4k,16k --skip-peers --time-budget-s 40 >"$OUT/backward_256_64x32.log" 2>&1
    bash scripts/gpu_kvcache.sh kernel >"$OUT/pending_kv.txt" 2>&1
    grep -E "status|passed|min ours" "$OUT/pending.txt" | head -20
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/pending.txt" | head -20
    echo "== hdim 256 with 64 x 32 tiles (ours only)"; grep -E "^\| 256 \|" "$OUT/backward_256_64x32/results.md" | head -6
    tail -9 "$OUT/pending_kv.txt"; grep -B1 -A6 "^| batch | cache len | ours TB/s" "$OUT/pending_kv.txt" | tail -7 ;;
  kvcache)
    bash scripts/gpu_kvcache.sh kernel >"$OUT/pending.txt" 2>&1
    tail -30 "$OUT/pending.txt"
    for splits in 8 16 24 48; do
      PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu_decode.py --lib build-gpu/src/libflashattn_c.so \
        --shapes 1x8k,1x128k --num-splits "$splits" --skip-peers --out "$OUT/splits_$splits" \
        >"$OUT/splits_$splits.log" 2>&1
      echo "== num_splits $splits"; grep -E '^\| 1 \| [0-9]+k \|' "$OUT/splits_$splits.log" | head -2
    done ;;
  kvtune)
    bash scripts/gpu_tune_kvcache.sh 2>&1 | tee "$OUT/pending.txt" | tail -40 ;;
  fwd256dq)
    bash scripts/build_tuning.sh "$OUT/tune_build.log" || exit 1
    for mode in bulk atomics; do
      env $([ $mode = atomics ] && echo FLASHATTN_CUDA_DQ_ATOMICS=1) PYTHONUNBUFFERED=1 timeout 90 \
        python3 bench/gpu_backward.py --lib build-tune/src/libflashattn_c.so --out "$OUT/dq_$mode" \
        --hdims 256 --seqlens 1k,4k,16k --skip-peers --time-budget-s 25 >"$OUT/dq_$mode.log" 2>&1
      echo "== dQ by $mode (ours only)"; grep -E "^\| 256 \|" "$OUT/dq_$mode/results.md" | head -6
    done
    TUNE_RELEASE_HDIMS=256 TUNE_SEQLENS=512,1k,2k bash scripts/gpu_tune.sh 256,32,4,1,0 256,64,4,1,0 \
      2>&1 | tee "$OUT/fwd256.txt" | tail -40 ;;
  bwd64)
    bash scripts/build_tuning.sh "$OUT/tune_build.log" test_backward_cuda || exit 1
    export FLASHATTN_SM80_BWD_CONFIG=64,128,128,8
    timeout 240 build-tune/tests/test_backward_cuda >"$OUT/bwd_tests.log" 2>&1
    echo "test_backward_cuda with $FLASHATTN_SM80_BWD_CONFIG: status $? ($(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/bwd_tests.log" | tr '\n' ' '))"
    grep -E '^\[  FAILED  \]' "$OUT/bwd_tests.log" | head -10
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 build-tune/tests/test_backward_cuda \
        --gtest_filter='BackwardLong.*:*BackwardGrid*causal*' >"$OUT/bwd_$tool.log" 2>&1
      echo "$tool: status $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/bwd_$tool.log" | tail -1))"
    done
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu_backward.py --lib build-tune/src/libflashattn_c.so \
      --out "$OUT/candidate" --hdims 64 --seqlens 1k,4k,16k --time-budget-s 120 >"$OUT/candidate.log" 2>&1
    unset FLASHATTN_SM80_BWD_CONFIG
    PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu_backward.py --lib build-tune/src/libflashattn_c.so \
      --out "$OUT/release" --hdims 64 --seqlens 1k,4k,16k --skip-peers --time-budget-s 40 >"$OUT/release.log" 2>&1
    echo "== hdim 64, 128 x 128 tiles, with the peers"; grep -E "^\| (hdim|64) \|" "$OUT/candidate/results.md" | head -7
    echo "== hdim 64, release 64 x 128 tiles (ours only)"; grep -E "^\| 64 \|" "$OUT/release/results.md" | head -6 ;;
  prefetch)
    bash scripts/build_tuning.sh "$OUT/tune_build.log" test_kvcache_cuda || exit 1
    timeout 200 build-tune/tests/test_kvcache_cuda >"$OUT/kv_tests.log" 2>&1
    echo "test_kvcache_cuda: status $? ($(grep -E '^\[  (PASSED|FAILED)  \]' "$OUT/kv_tests.log" | tr '\n' ' '))"
    grep -E '^\[  FAILED  \]' "$OUT/kv_tests.log" | head -10
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 build-tune/tests/test_kvcache_cuda \
      --gtest_filter='KvCache.*:*KvCacheGrid*/2?' >"$OUT/kv_memcheck.log" 2>&1
    echo "memcheck: status $? ($(grep -E 'ERROR SUMMARY' "$OUT/kv_memcheck.log" | tail -1))"
    PYTHONUNBUFFERED=1 timeout 90 python3 bench/gpu_decode.py --lib build-tune/src/libflashattn_c.so \
      --page-size 256 --out "$OUT/decode" >"$OUT/decode.log" 2>&1
    echo "== decode with the peers (release: 256-byte prefetch)"; grep -A6 "^| batch | cache len | ours TB/s" "$OUT/decode.log" | head -7
    OUT="$OUT" bash scripts/gpu_tune_kvcache.sh 4,3,0 4,3,128 2>&1 | tee "$OUT/kvtune.txt"
    TUNE_RELEASE_HDIMS=64,128 TUNE_SEQLENS=1k,4k,16k OUT="$OUT" bash scripts/gpu_tune.sh 128,64,4,2,0,256 \
      64,128,4,2,0,256 2>&1 | tee "$OUT/fwdtune.txt" ;;
  fwd256)
    TUNE_RELEASE_HDIMS=256 TUNE_SEQLENS=512,1k,2k bash scripts/gpu_tune.sh 256,32,4,1,0 256,64,4,1,0 \
      2>&1 | tee "$OUT/pending.txt" | tail -40 ;;
  dqcompare)
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
      -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=OFF >"$OUT/build.log" 2>&1 &&
      cmake --build build-gpu -j "$(nproc)" --target flashattn_c >>"$OUT/build.log" 2>&1 || exit 1
    for mode in bulk atomics; do
      env $([ $mode = atomics ] && echo FLASHATTN_CUDA_DQ_ATOMICS=1) PYTHONUNBUFFERED=1 timeout 100 \
        python3 bench/gpu_backward.py --lib build-gpu/src/libflashattn_c.so --out "$OUT/dq_$mode" \
        --hdims 128,64 --seqlens 1k,4k,16k --skip-peers --time-budget-s 30 >"$OUT/dq_$mode.log" 2>&1
      echo "== dQ by $mode (ours only)"; grep -E "^\| (64|128) \|" "$OUT/dq_$mode/results.md" | head -12
    done
    { OUT="$OUT/bwd" bash scripts/gpu_profile.sh 128 4096 no bwd; OUT="$OUT/dec" bash scripts/gpu_profile.sh 1 8192 no dec; } \
      >"$OUT/profiles.txt" 2>&1
    grep -iE "duration|stall|instructions" "$OUT/profiles.txt" | head -60
    rm -f "$OUT"/*/*.ncu-rep ;;
  profiles)
    { OUT="$OUT/bwd" bash scripts/gpu_profile.sh 128 4096 no bwd; OUT="$OUT/dec" bash scripts/gpu_profile.sh 1 8192 no dec; } \
      2>&1 | tee "$OUT/pending.txt" | tail -70
    rm -f "$OUT"/*/*.ncu-rep ;;  # the reports are large; the details and stalls are kept
  kvprofile)
    { bash scripts/gpu_profile.sh 8 32768 no dec; OUT="$OUT/b1" bash scripts/gpu_profile.sh 1 8192 no dec; } \
      2>&1 | tee "$OUT/pending.txt" | tail -60 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
tar czf "$top/$stage.tgz" -C "$top" "$stage" 2>/dev/null
rm -rf "$OUT"
