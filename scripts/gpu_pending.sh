#!/usr/bin/env bash
# GPU stages, one per device call, each fitting the 600-second limit and printing a short
# summary when done (the full logs go to $OUT/<stage>/, packed into $OUT/<stage>.tgz, since
# the device returns few files). Run from a clean snapshot: scripts/device_snapshot.sh [ref].
#   scripts/gpu_pending.sh backward   GPU tests + sanitizers (gpu_check.sh test) and the
#                                     backward benchmark against FA2 and cuDNN (~6 min)
#   scripts/gpu_pending.sh both       backward (hdim 256, 128, 64), then the kv-cache suite,
#                                     sanitizers and decode benchmark on the same build (~7 min)
#   scripts/gpu_pending.sh kvcache    the CUDA kv-cache suite, sanitizers, decode benchmark,
#                                     then a split-count sweep at batch 1 (~3 min)
#   scripts/gpu_pending.sh kvtune     kv-cache shapes at head dim 128 (gpu_tune_kvcache.sh)
#   scripts/gpu_pending.sh profiles   Nsight Compute with stall reasons and instruction mix:
#                                     the backward's dK/dV kernel against FA2's (hdim 128, 4k),
#                                     the forward against FA2's (hdim 256, 4k) and the decode
#                                     kernel against cuDNN's at 1 x 8k (~5 min)
#   scripts/gpu_pending.sh power      ours and flash at hdim 256 with long windows and the clock
#                                     log: is our forward held at a lower clock? (~2 min)
#   scripts/gpu_pending.sh kvprofile  Nsight Compute: the decode kernel against cuDNN's at
#                                     8 x 32k and 1 x 8k (gpu_profile.sh ... dec)
#   scripts/gpu_pending.sh order      what `both` runs for the backward (GPU tests, sanitizers,
#                                     backward benchmark at hdim 256, 128, 64), then the forward
#                                     benchmark with the peers (512..16k without 8k; ~9 min)
#   scripts/gpu_pending.sh final      a session's last call: GPU suite, sanitizers, backward and
#                                     forward benchmarks against flash and cuDNN (~7 min)
#   scripts/gpu_pending.sh bwdcheck   the backward suite, memcheck and racecheck on the sm90
#                                     backward's tests (~3 min)
#   scripts/gpu_pending.sh kvtraffic [TREE...]  Nsight Compute at decode 8 x 32k per tree: DRAM
#                                     bytes, L2-to-SM bytes, L2 requests, duration (~30 s each)
#   scripts/gpu_pending.sh kvrelease [CANDIDATE...]  the kv-cache suite and sanitizers on
#                                     the release, its L2-to-SM bytes, decode with the peers,
#                                     then ours on the release and each shape candidate (~6 min)
#   scripts/gpu_pending.sh kvcheck    the kv-cache suite, memcheck and racecheck on the plain
#                                     decoding and split-count tests (~3 min)
#   scripts/gpu_pending.sh quickbwd   the library alone, then ours' backward at 4k (~75 s)
#   scripts/gpu_pending.sh ptx        a build of compute_80 PTX only (what a GPU after Hopper
#                                     runs, JIT-compiled), then the GPU suite on it
#   scripts/gpu_pending.sh stream     the decode cache streamed without the attention
#                                     (bench/gpu_stream_read.cu): TB/s per copy schedule, then
#                                     Nsight Compute durations at 8 x 32k of every schedule,
#                                     our split kernel and cuDNN's (~2 min)
#   scripts/gpu_pending.sh sm90       the sm90 (wgmma) forward: the CUDA forward suite on it and
#                                     on the sm80 kernel, memcheck, the forward benchmark with
#                                     flash and cuDNN (~5 min)
#   scripts/gpu_pending.sh sm90final  the whole GPU suite, the backward over the standard grid
#                                     and the forward (1k/4k/16k) with flash and cuDNN (~9 min)
#   scripts/gpu_pending.sh sm90race   racecheck on the sm90 forward, a test per bucket (~6 min)
#   scripts/gpu_pending.sh sm90all    the sm90 forward (every call on it) and backward suites and
#                                     the kv-cache suite, backward sanitizers, the backward
#                                     benchmark against flash and cuDNN (~7 min)
#   scripts/gpu_pending.sh grids      the backward and forward over the whole grid with flash and
#                                     cuDNN, the library alone (~6 min)
#   scripts/gpu_pending.sh suite      the whole GPU suite (~5 min)
#   scripts/gpu_pending.sh sanitize   memcheck and racecheck on the forward and backward sweeps,
#                                     seven runs at once (~8 min)
#   scripts/gpu_pending.sh parts [VARIANT...]  Nsight Compute durations of every kernel of a
#                                     backward call, ours (and each snapshot given) and flash's,
#                                     at the 512 shapes; FLASHATTN_FWD_GRID=1 adds the forward grid
#   scripts/gpu_pending.sh ab BASE [VARIANT...]  this tree's speed (and each further
#                                     snapshot's) against the snapshot in BASE, ours only,
#                                     forward and backward, or decode with AB_PASSES=dec
#                                     (device_snapshot.sh REF .snap_base)
# On the H200, `FLASHATTN_CUDA_ARCHS=sm_90a bash scripts/gpu_pending.sh STAGE` builds its
# machine code only (CMakeLists.txt reads the variable on a first configure): about half the
# build time of the default sm_80 + sm_90a.
# Stages of finished experiments were removed; PERFORMANCE.md names the commit that ran each.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage: backward, both, kvcache, kvtune, profiles, kvprofile, power, order, final, quickbwd, ptx, stream, sm90, sm90final, sm90race, sm90all, grids, suite, sanitize, parts, bwdcheck, kvcheck, kvtraffic, kvrelease or ab}
top=${OUT:-gpu-results}
# Runs the arguments while the SM clock and power (and, where the driver reports them, the
# reasons the clock is held down) are sampled every 50 ms into $1, for scripts/clock_windows.py
# (the benchmarks record each measurement's wall-clock window).
with_clock_log() {
  local log=$1; shift
  local fields=timestamp,clocks.sm,power.draw
  nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv,noheader >/dev/null 2>&1 &&
    fields+=,clocks_event_reasons.active
  nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -lms 50 >"$log" 2>/dev/null &
  local sampler=$!
  "$@"; local status=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  return $status
}
# The release build of the C library alone (what the benchmarks load) in DIR/build-gpu, with
# JOBS parallel jobs (default: every core).
build_library() {  # DIR [JOBS]
  PATH="/usr/local/cuda/bin:$PATH" cmake -S "$1" -B "$1/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFLASHATTN_CUDA=ON -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_TOOLS=OFF &&
    PATH="/usr/local/cuda/bin:$PATH" cmake --build "$1/build-gpu" -j "${2:-$(nproc)}" --target flashattn_c
}
# The whole release build with the tests (or one TARGET) in ./build-gpu, its log in
# $OUT/build.log; on failure the errors are printed and the status is 1.
build_all() {  # [TARGET]
  { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TESTS=ON -DFLASHATTN_BUILD_TOOLS=ON \
    && cmake --build build-gpu -j "$(nproc)" ${1:+--target "$1"}; } >"$OUT/build.log" 2>&1 ||
    { grep -B2 -A12 -m5 error "$OUT/build.log" | head -60; tail -5 "$OUT/build.log"; return 1; }
}
# A stage's start: the clock (t0) and the release build with the tests (or one TARGET), its
# time and the commit first in the summary; the stage ends here if the build fails.
build_stage() {  # [TARGET]
  t0=$(date +%s)
  export PATH="/usr/local/cuda/bin:$PATH"
  build_all "$@" || exit 1
  echo "build: $(( $(date +%s) - t0 )) s; commit $(cat COMMIT 2>/dev/null)" | tee "$OUT/summary.txt"
}
# A GoogleTest log's outcome (its PASSED / FAILED lines), and a compute-sanitizer log's summary.
gtest_result() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]' "$1" | tr '\n' ' '; }
sanitizer_result() { grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$1" | tail -1; }
# Nsight Compute on one decode launch at 8 x 32k with the library LIB: DRAM bytes read, the
# bytes L2 sends the SMs (the cache is 1 GiB: more than that is read twice), L2 read
# requests, DRAM throughput and duration, printed under NAME.
decode_traffic() {  # NAME LIB
  local file
  file="$OUT/ncu_traffic_$(echo "$1" | tr -c 'A-Za-z0-9_\n' _).csv"
  timeout 90 ncu --clock-control none --kernel-name regex:kvcache_kernel --launch-skip 3 --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum,lts__t_requests_srcunit_tex_op_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --csv python3 bench/gpu_decode.py --lib "$2" --shapes 8x32768 --no-graph --repeat 5 --target-s 0.01 \
    --skip-peers --out /tmp/traffic >"$file" 2>"$file.err"
  echo "== $1"
  grep -E '"(gpu__time|dram__|l1tex__|lts__)' "$file" | awk -F'","' '{print "  " $(NF-2) " " $(NF-1) " " $NF}' | tr -d '"'
}
# The sm90 backward's tests under the sanitizers: plain calls at each bucket (64, 128, 256),
# ragged batches, long sequences and the edge cases.
SM90_BACKWARD_FILTER='*BackwardPlainCalls*/1:*BackwardPlainCalls*/3:*BackwardPlainCalls*/5:*BackwardVarlen*/3:BackwardLong.*:BackwardEdgeCases.*'
export OUT="$top/$stage"
mkdir -p "$OUT"
case "$stage" in
  backward)
    bash scripts/gpu_try_backward.sh 2>&1 | tee "$OUT/pending.txt" | tail -45 ;;
  both)
    BWD_HDIMS=256,128,64 bash scripts/gpu_try_backward.sh >"$OUT/pending.txt" 2>&1
    bash scripts/gpu_kvcache.sh kernel >"$OUT/pending_kv.txt" 2>&1
    grep -E "status|passed|min ours" "$OUT/pending.txt" | head -20
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/pending.txt" | head -20
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
  order)
    BWD_HDIMS=256,128,64 bash scripts/gpu_try_backward.sh >"$OUT/pending.txt" 2>&1
    with_clock_log "$OUT/clocks_forward.csv" env PYTHONUNBUFFERED=1 timeout 230 python3 bench/gpu_forward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --seqlens 512,1k,2k,4k,16k --time-budget-s 180 \
      >"$OUT/bench_forward.log" 2>&1
    echo "bench forward: status $?"
    python3 scripts/clock_windows.py "$OUT/clocks_forward.csv" "$OUT/forward/results.json" >"$OUT/clocks_forward.md" 2>&1
    grep -E "status|passed|min ours" "$OUT/pending.txt" | head -20
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/pending.txt" | head -20
    grep -A32 "^| hdim | causal | seqlen | ours |" "$OUT/forward/results.md" | head -32
    grep "min ours" "$OUT/forward/results.md" ;;
  profiles)
    { OUT="$OUT/bwd" bash scripts/gpu_profile.sh 128 4096 no bwd; OUT="$OUT/fwd256" bash scripts/gpu_profile.sh 256 4096 no fwd;
      OUT="$OUT/dec" bash scripts/gpu_profile.sh 1 8192 no dec; } 2>&1 | tee "$OUT/pending.txt" | tail -120
    rm -f "$OUT"/*/*.ncu-rep ;;  # the reports are large; the details and stalls are kept
  power)
    # Whether the card holds our hdim-256 forward at a lower SM clock than FA2's: under the
    # profiler's locked clocks ours is the faster, in the benchmark 5 % slower at 16k, and the
    # 100 ms clock samples of the final stage put ours at 1755-1780 MHz against 1885-1890.
    # Ours and flash at hdim 256 (4k, 16k) with windows of ~2 s, the clock and its event
    # reasons sampled every 50 ms (~2 min with the build).
    build_library . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    with_clock_log "$OUT/clocks.csv" env PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu_forward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --peers flash --hdims 256 --seqlens 4k,16k \
      --target-s 2 --repeat 400 >"$OUT/bench.log" 2>&1
    python3 scripts/clock_windows.py "$OUT/clocks.csv" "$OUT/forward/results.json" | tee "$OUT/clocks.md"
    grep -A8 "^| hdim | causal | seqlen | ours |" "$OUT/forward/results.md" | head -8 ;;
  ptx)
    # The PTX fallback, as a GPU after Hopper meets it: a build of compute_80 PTX only, which
    # the driver compiles on first use here too; then the GPU suite on it (the host must keep
    # sm_90-only paths off for this code: kernel_code.cuh). Run without FLASHATTN_CUDA_ARCHS.
    t0=$(date +%s)
    export PATH="/usr/local/cuda/bin:$PATH" CUDA_CACHE_MAXSIZE=4294967296
    { cmake -S . -B build-ptx -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=compute_80 \
        -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TOOLS=OFF && cmake --build build-ptx -j "$(nproc)"; } \
      >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    echo "build (compute_80 only): $(( $(date +%s) - t0 )) s; commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)" | tee "$OUT/summary.txt"
    echo "machine code in the library: $(cuobjdump --list-elf build-ptx/src/libflashattn_c.so 2>/dev/null | wc -l) cubins; PTX: $(cuobjdump --list-ptx build-ptx/src/libflashattn_c.so 2>/dev/null | wc -l) entries" | tee -a "$OUT/summary.txt"
    timeout 520 ctest --test-dir build-ptx -L gpu -j 16 --output-on-failure --timeout 500 >"$OUT/tests_gpu.log" 2>&1
    echo "gpu tests on JIT-compiled compute_80: $(grep -E 'tests passed|tests failed' "$OUT/tests_gpu.log" | tail -1) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '\*\*\*Failed|Timeout|Not Run' "$OUT/tests_gpu.log" | head -10 ;;
  stream)
    # The 2026-11-30 22:24 UTC call's commands (docs/results/h200_stream_read_2026-11-30.md),
    # except that the library is built after the event-timed table (that call built it
    # meanwhile, and event timing includes each call's launch). Nsight Compute's durations
    # (with --clock-control none since 2026-12-01; that call's at its locked clocks) compare
    # across the kernels of one call only.
    export PATH="/usr/local/cuda/bin:$PATH"
    nvcc -O3 -std=c++17 -arch=sm_90a -I src bench/gpu_stream_read.cu -o /tmp/stream_read || exit 1
    /tmp/stream_read >"$OUT/stream_read.txt" 2>&1
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv \
      /tmp/stream_read profile >"$OUT/stream_read_ncu.csv" 2>&1
    build_library . >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
    for who in ours cudnn; do
      if [ $who = ours ]; then peers=(--skip-peers); kernels=kvcache_kernel; else peers=(--peers cudnn); kernels=cudnn; fi
      ncu --clock-control none --kernel-name "regex:$kernels" --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        --csv python3 bench/gpu_decode.py --lib build-gpu/src/libflashattn_c.so --out /tmp/stream-dec-$who \
        --shapes 8x32k "${peers[@]}" --no-graph --repeat 3 --target-s 0.001 --copy-mib 64 >"$OUT/decode_ncu_$who.csv" 2>&1
    done
    sed -n '/round 2/,$p' "$OUT/stream_read.txt" | cut -c1-110
    echo "Nsight Compute, 8 x 32k:"
    python3 scripts/ncu_durations.py "$OUT/stream_read_ncu.csv" --every 4 --phase 3
    for who in ours cudnn; do python3 scripts/ncu_durations.py "$OUT/decode_ncu_$who.csv" --last 2; done ;;
  kvprofile)
    { bash scripts/gpu_profile.sh 8 32768 no dec; OUT="$OUT/b1" bash scripts/gpu_profile.sh 1 8192 no dec; } \
      2>&1 | tee "$OUT/pending.txt" | tail -60 ;;
  final)
    # A session's last call, within one 600-second call: the GPU suite, memcheck on the
    # forward and backward filters and racecheck on the backward's (gpu_check.sh's filters),
    # the backward and forward benchmarks against flash and cuDNN (1k, 4k, 16k), then the
    # forward racecheck if the time is left. The CPU tests are left to CI.
    build_stage
    ctest --test-dir build-gpu -L gpu -j 8 --output-on-failure --timeout 300 >"$OUT/tests_gpu.log" 2>&1
    echo "gpu tests: $(grep -E 'tests passed|tests failed' "$OUT/tests_gpu.log" | tail -1) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '\*\*\*Failed' "$OUT/tests_gpu.log" | head -10
    fwd_filter=$(sed -n "s/^  filter='\(\*FeatureGrid[^']*\)'.*/\1/p" scripts/gpu_check.sh)
    bwd_filter=$(sed -n "s/^  filter='\(\*BackwardGrid[^']*\)'.*/\1/p" scripts/gpu_check.sh)
    sanitize() {  # tool test filter
      compute-sanitizer --tool "$1" --error-exitcode 99 "build-gpu/tests/$2" --gtest_filter="$3" >"$OUT/sanitizer_$2_$1.log" 2>&1
      echo "compute-sanitizer $1 $2: status $? ($(sanitizer_result "$OUT/sanitizer_$2_$1.log")) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    }
    sanitize memcheck test_forward_cuda "$fwd_filter"
    sanitize memcheck test_backward_cuda "$bwd_filter"
    sanitize racecheck test_backward_cuda "$bwd_filter"
    with_clock_log "$OUT/clocks_backward.csv" env PYTHONUNBUFFERED=1 timeout 120 python3 bench/gpu_backward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/backward" --peers flash,cudnn --seqlens 1k,4k,16k \
      --time-budget-s 90 >"$OUT/bench_backward.log" 2>&1
    echo "bench backward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    with_clock_log "$OUT/clocks_forward.csv" env PYTHONUNBUFFERED=1 timeout 130 python3 bench/gpu_forward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --peers flash,cudnn --seqlens 1k,4k,16k \
      --time-budget-s 100 >"$OUT/bench_forward.log" 2>&1
    echo "bench forward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    for pass in backward forward; do
      python3 scripts/clock_windows.py "$OUT/clocks_$pass.csv" "$OUT/$pass/results.json" >"$OUT/clocks_$pass.md" 2>&1
    done
    left=$(( 560 - ($(date +%s) - t0) ))
    if [ $left -gt 60 ]; then
      timeout $left compute-sanitizer --tool racecheck --error-exitcode 99 build-gpu/tests/test_forward_cuda \
        --gtest_filter="$fwd_filter" >"$OUT/sanitizer_forward_racecheck.log" 2>&1
      echo "compute-sanitizer racecheck test_forward_cuda: status $? ($(grep -E 'RACECHECK SUMMARY' "$OUT/sanitizer_forward_racecheck.log" | tail -1)) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    fi
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/backward/results.md" | head -20
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/forward/results.md" | head -20
    grep -h "min ours" "$OUT/backward/results.md" "$OUT/forward/results.md" ;;
  sm90)
    # The sm90 (wgmma) forward: the CUDA forward suite on it (FLASHATTN_CUDA_FORWARD=sm90: every
    # head dim) and on the sm80 kernel (=sm80), memcheck on the sanitizer filter, then the
    # forward benchmark (the default dispatch) against flash and cuDNN.
    build_stage
    FLASHATTN_CUDA_FORWARD=sm90 timeout 240 build-gpu/tests/test_forward_cuda >"$OUT/test_forward_sm90.log" 2>&1
    echo "test_forward_cuda (sm90 wherever it covers the call): status $? $(gtest_result "$OUT/test_forward_sm90.log") (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '^\[  FAILED' "$OUT/test_forward_sm90.log" | head -12
    grep -m3 -B3 -A12 'Failure' "$OUT/test_forward_sm90.log" | head -60
    FLASHATTN_CUDA_FORWARD=sm80 timeout 200 build-gpu/tests/test_forward_cuda >"$OUT/test_forward_sm80.log" 2>&1
    echo "test_forward_cuda (sm80 forced): status $? $(gtest_result "$OUT/test_forward_sm80.log") (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    fwd_filter=$(sed -n "s/^  filter='\(\*FeatureGrid[^']*\)'.*/\1/p" scripts/gpu_check.sh)
    FLASHATTN_CUDA_FORWARD=sm90 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 build-gpu/tests/test_forward_cuda \
      --gtest_filter="$fwd_filter" >"$OUT/sanitizer_memcheck.log" 2>&1
    echo "memcheck (sm90): status $? ($(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_memcheck.log" | tail -1)) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    left=$(( 570 - ($(date +%s) - t0) ))
    with_clock_log "$OUT/clocks_forward.csv" env PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu_forward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --peers flash,cudnn --seqlens ${SM90_SEQLENS:-1k,4k,16k} \
      --time-budget-s $(( left - 30 )) >"$OUT/bench_forward.log" 2>&1
    echo "bench forward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/forward/results.md" | head -20
    grep -h "min ours" "$OUT/forward/results.md"; tail -3 "$OUT/bench_forward.log" ;;
  sm90final)
    # The release with the sm90 kernels: the whole GPU suite, then the backward over the
    # standard grid with flash and cuDNN (the README's backward figures), then the forward
    # with both at FINAL_FWD_SEQLENS (default 1k,4k,16k) in the time left (~9 min).
    build_stage
    timeout 300 ctest --test-dir build-gpu -L gpu -j 8 --output-on-failure --timeout 300 >"$OUT/tests_gpu.log" 2>&1
    echo "gpu tests: status $? $(grep -E 'tests passed|tests failed' "$OUT/tests_gpu.log" | tail -1) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '\*\*\*Failed' "$OUT/tests_gpu.log" | head -10
    with_clock_log "$OUT/clocks_backward.csv" env PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu_backward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/backward" --peers flash,cudnn --time-budget-s 170 \
      >"$OUT/bench_backward.log" 2>&1
    echo "bench backward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    left=$(( 585 - ($(date +%s) - t0) ))
    with_clock_log "$OUT/clocks_forward.csv" env PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu_forward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --peers flash,cudnn \
      --seqlens ${FINAL_FWD_SEQLENS:-1k,4k,16k} --time-budget-s $(( left - 25 )) >"$OUT/bench_forward.log" 2>&1
    echo "bench forward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    for pass in backward forward; do
      python3 scripts/clock_windows.py "$OUT/clocks_$pass.csv" "$OUT/$pass/results.json" >"$OUT/clocks_$pass.md" 2>&1
    done
    grep -A38 "^| hdim | causal | seqlen | ours |" "$OUT/backward/results.md" | head -38
    grep -A20 "^| hdim | causal | seqlen | ours |" "$OUT/forward/results.md" | head -20
    grep -h "min ours" "$OUT/backward/results.md" "$OUT/forward/results.md" ;;
  sm90race)
    # racecheck on the sm90 forward (it is slow there: a few head dims and masks, each bucket).
    build_stage test_forward_cuda
    # RACE_FILTER replaces the default filter (e.g. the general variant's softcap/ALiBi tests).
    filter=${RACE_FILTER:-'*HeadDims*/7:*HeadDims*/14:*HeadDims*/15:*HeadDims*/23:*HeadDims*/31:*FeatureGrid*causal_bf16*:*FeatureGrid*sliding_fp16*:EdgeCases.FullyMaskedRowsGiveZeroOutputAndMinusInfinityLse'}
    FLASHATTN_CUDA_FORWARD=sm90 timeout ${RACE_S:-330} compute-sanitizer --tool racecheck --error-exitcode 99 \
      build-gpu/tests/test_forward_cuda --gtest_filter="$filter" >"$OUT/racecheck.log" 2>&1
    echo "racecheck (sm90 forward): status $? ($(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -1)) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '^\[ +(OK|FAILED) ' "$OUT/racecheck.log" | head -12 ;;
  sm90all)
    # The sm90 forward and backward kernels and the kv-cache kernel on one build: the CUDA
    # forward suite with every call on the sm90 kernel (FLASHATTN_CUDA_FORWARD=sm90), the
    # backward suite (the sm90 backward is the default on Hopper) and the kv-cache suite run
    # side by side, memcheck and racecheck on the backward's plain calls, then the backward
    # benchmark against flash and cuDNN (head dims SM90ALL_HDIMS, default 64,128,256, at
    # SM90ALL_SEQLENS, default 1k,4k,16k; ~7 min).
    build_stage
    FLASHATTN_CUDA_FORWARD=sm90 timeout 240 build-gpu/tests/test_forward_cuda >"$OUT/test_forward_sm90.log" 2>&1 & fwd=$!
    timeout 240 build-gpu/tests/test_backward_cuda >"$OUT/test_backward.log" 2>&1 & bwd=$!
    timeout 240 build-gpu/tests/test_kvcache_cuda >"$OUT/test_kvcache.log" 2>&1 & kv=$!
    for run in "fwd test_forward_sm90" "bwd test_backward" "kv test_kvcache"; do
      set -- $run; wait "${!1}"; status=$?
      echo "$2: status $status $(gtest_result "$OUT/$2.log") (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
      grep -E '^\[  FAILED' "$OUT/$2.log" | head -8
      grep -m2 -B3 -A10 'Failure' "$OUT/$2.log" | head -30
    done
    # The sm90 backward's plain calls at each bucket (64, 128, 256), masks and edge cases.
    filter=$SM90_BACKWARD_FILTER
    for tool in memcheck racecheck; do
      timeout 120 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_backward_cuda \
        --gtest_filter="$filter" >"$OUT/sanitizer_$tool.log" 2>&1
      echo "$tool (backward): status $? ($(sanitizer_result "$OUT/sanitizer_$tool.log")) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    done
    left=$(( 570 - ($(date +%s) - t0) ))
    PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu_backward.py --lib build-gpu/src/libflashattn_c.so \
      --out "$OUT/backward" --peers flash,cudnn --hdims ${SM90ALL_HDIMS:-64,128,256} --seqlens ${SM90ALL_SEQLENS:-1k,4k,16k} \
      --time-budget-s $(( left - 20 )) >"$OUT/bench_backward.log" 2>&1
    echo "bench backward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -A14 "^| hdim | causal | seqlen | ours |" "$OUT/backward/results.md" | head -14 ;;
  bwdcheck)
    # The backward suite alone, then memcheck and racecheck on the sm90 backward's plain calls
    # (each bucket), ragged batches and edge cases (~3 min): a kernel variant's check after an A/B.
    build_stage test_backward_cuda
    timeout 240 build-gpu/tests/test_backward_cuda >"$OUT/test_backward.log" 2>&1
    echo "test_backward: status $? $(gtest_result "$OUT/test_backward.log") (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '^\[  FAILED' "$OUT/test_backward.log" | head -8
    filter=$SM90_BACKWARD_FILTER
    for tool in memcheck racecheck; do
      timeout 120 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_backward_cuda \
        --gtest_filter="$filter" >"$OUT/sanitizer_$tool.log" 2>&1
      echo "$tool (backward): status $? ($(sanitizer_result "$OUT/sanitizer_$tool.log")) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    done ;;
  kvtraffic)
    # What the decode kernel moves at 8 x 32k, one launch per tree (each tree's library built
    # if missing; decode_traffic).
    shift
    export PATH="/usr/local/cuda/bin:$PATH"
    for tree in "${@:-.}"; do
      [ -f "$tree/build-gpu/src/libflashattn_c.so" ] || build_library "$tree" >"$OUT/build.log" 2>&1
      decode_traffic "$(basename "$(cd "$tree" && pwd)") ($(cat "$tree/COMMIT" 2>/dev/null))" \
        "$tree/build-gpu/src/libflashattn_c.so"
    done ;;
  kvrelease)
    # The kv-cache release and the shape candidates given (FLASHATTN_KVCACHE_CONFIG at head
    # dim 128, src/cuda/kvcache.cu; none: the release alone): the kv-cache suite,
    # memcheck and racecheck on the release, the bytes L2 sends the SMs at 8 x 32k, the decode
    # benchmark with flash and cuDNN (issue 7's bar), then ours alone on the release and each
    # candidate, two rounds (~6 min; FLASHATTN_CUDA_ARCHS=sm_90a for a shorter build).
    shift
    t0=$(date +%s)
    export PATH="/usr/local/cuda/bin:$PATH"
    unset FLASHATTN_KVCACHE_CONFIG
    bash scripts/build_tuning.sh "$OUT/build.log" test_kvcache_cuda || exit 1
    echo "build: $(( $(date +%s) - t0 )) s; commit $(cat COMMIT 2>/dev/null)" | tee "$OUT/summary.txt"
    timeout 200 build-tune/tests/test_kvcache_cuda >"$OUT/test_kvcache.log" 2>&1
    echo "test_kvcache: status $? $(gtest_result "$OUT/test_kvcache.log") (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 build-tune/tests/test_kvcache_cuda \
        --gtest_filter='KvCachePlain.*:KvCache.EverySplitCountMatchesTheReference:KvCache.AppendStraddlesPagesAndQueriesOutnumberKeys' \
        >"$OUT/sanitizer_$tool.log" 2>&1
      echo "$tool: status $? ($(sanitizer_result "$OUT/sanitizer_$tool.log")) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    done
    decode_traffic release build-tune/src/libflashattn_c.so | tee -a "$OUT/summary.txt"
    PYTHONUNBUFFERED=1 timeout 100 python3 bench/gpu_decode.py --lib build-tune/src/libflashattn_c.so \
      --page-size 256 --copy-mib 1024 --out "$OUT/decode" >"$OUT/decode.log" 2>&1
    echo "decode with the peers: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -A6 "^| batch | cache len" "$OUT/decode/results.md" | head -6 | tee -a "$OUT/summary.txt"
    if [ $# -gt 0 ]; then
      for round in 1 2; do
        OUT=$OUT/round$round bash scripts/gpu_tune_kvcache.sh "$@" >"$OUT/tune_round$round.txt" 2>&1
      done
      paste -d' ' "$OUT/tune_round1.txt" "$OUT/tune_round2.txt" | tee -a "$OUT/summary.txt"
    fi ;;
  kvcheck)
    # The kv-cache suite alone, then memcheck and racecheck on the plain-decoding tests and the
    # split-count sweep (~3 min): a decode-kernel variant's check after an A/B.
    build_stage test_kvcache_cuda
    timeout 240 build-gpu/tests/test_kvcache_cuda >"$OUT/test_kvcache.log" 2>&1
    echo "test_kvcache: status $? $(gtest_result "$OUT/test_kvcache.log") (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '^\[  FAILED' "$OUT/test_kvcache.log" | head -8
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_kvcache_cuda \
        --gtest_filter='KvCachePlain.*:KvCache.EverySplitCountMatchesTheReference:KvCache.NanInOneQueryRowStaysInThatRow' \
        >"$OUT/sanitizer_$tool.log" 2>&1
      echo "$tool (kv-cache): status $? ($(sanitizer_result "$OUT/sanitizer_$tool.log")) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    done ;;
  quickbwd)
    # The library only, then ours alone: the backward at 4k for hdim 64/128/256, causal and not.
    build_library . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    PYTHONUNBUFFERED=1 timeout 60 python3 bench/gpu_backward.py --lib build-gpu/src/libflashattn_c.so \
      --out "$OUT/backward" --skip-peers --hdims 64,128,256 --seqlens 4k --time-budget-s 40 >"$OUT/bench_backward.log" 2>&1
    grep -A8 "^| hdim | causal | seqlen | ours |" "$OUT/backward/results.md" | head -8 ;;
  grids)
    # The closing figures of issues 3 and 5: the library alone, then the backward and the
    # forward over the whole standard grid with flash and cuDNN (each shape's systems timed side
    # by side), with the clock log (~6 min). --repeat lifts the call cap so that the short
    # shapes, too, are timed for about --target-s (0.3 s) per system, not 10-30 ms.
    t0=$(date +%s)
    build_library . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s; commit $(cat COMMIT 2>/dev/null)" | tee "$OUT/summary.txt"
    with_clock_log "$OUT/clocks_backward.csv" env PYTHONUNBUFFERED=1 timeout 270 python3 bench/gpu_backward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/backward" --peers flash,cudnn --time-budget-s 240 \
      --repeat 600 >"$OUT/bench_backward.log" 2>&1
    echo "bench backward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    left=$(( 585 - ($(date +%s) - t0) ))
    with_clock_log "$OUT/clocks_forward.csv" env PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu_forward.py \
      --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --peers flash,cudnn \
      --time-budget-s $(( left - 30 )) --repeat 3000 >"$OUT/bench_forward.log" 2>&1
    echo "bench forward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    for pass in backward forward; do
      python3 scripts/clock_windows.py "$OUT/clocks_$pass.csv" "$OUT/$pass/results.json" >"$OUT/clocks_$pass.md" 2>&1
    done
    grep -h "min ours" "$OUT/backward/results.md" "$OUT/forward/results.md" ;;
  suite)
    # The whole GPU suite on a full build (~5 min).
    build_stage
    timeout 500 ctest --test-dir build-gpu -L gpu -j 8 --output-on-failure --timeout 300 >"$OUT/tests_gpu.log" 2>&1
    echo "gpu tests: status $? $(grep -E 'tests passed|tests failed' "$OUT/tests_gpu.log" | tail -1) (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -E '\*\*\*Failed|Not Run|Timeout' "$OUT/tests_gpu.log" | head -10 ;;
  sanitize)
    # compute-sanitizer memcheck and racecheck, all at once on the one GPU: the forward on
    # gpu_check.sh's sweep (the default dispatch: sm90 above head dim 64 on Hopper, sm80 below;
    # memcheck with the sm80 kernel forced too, what GPUs before Hopper run), the backward on
    # gpu_check.sh's sweep (the sm80 kernels' features) and on sm90all's (the sm90 kernels'
    # plain calls at each bucket); ~8 min (racecheck on the sm90 forward is the slow one).
    build_stage
    fwd_filter=$(sed -n "s/^  filter='\(\*FeatureGrid[^']*\)'.*/\1/p" scripts/gpu_check.sh)
    bwd_filter=$(sed -n "s/^  filter='\(\*BackwardGrid[^']*\)'.*/\1/p" scripts/gpu_check.sh)
    runs=("memcheck test_forward_cuda default $fwd_filter" "racecheck test_forward_cuda default $fwd_filter"
          "memcheck test_forward_cuda sm80 $fwd_filter"
          "memcheck test_backward_cuda default $bwd_filter" "racecheck test_backward_cuda default $bwd_filter"
          "memcheck test_backward_cuda default $SM90_BACKWARD_FILTER" "racecheck test_backward_cuda default $SM90_BACKWARD_FILTER")
    pids=()
    for i in "${!runs[@]}"; do
      read -r tool test family filter <<<"${runs[$i]}"
      forced=()  # the forward's kernel family, where one is forced
      [ "$family" = default ] || forced=("FLASHATTN_CUDA_FORWARD=$family")
      env "${forced[@]}" timeout 520 compute-sanitizer --tool "$tool" --error-exitcode 99 "build-gpu/tests/$test" \
        --gtest_filter="$filter" >"$OUT/sanitizer_$i.log" 2>&1 & pids[$i]=$!
    done
    for i in "${!runs[@]}"; do
      wait "${pids[$i]}"; status=$?
      read -r tool test family filter <<<"${runs[$i]}"
      echo "$tool $test ($family forward; ${filter:0:50}...): status $status ($(sanitizer_result "$OUT/sanitizer_$i.log")) $(grep -cE '^\[       OK' "$OUT/sanitizer_$i.log") tests ok" | tee -a "$OUT/summary.txt"
    done
    echo "done at $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt" ;;
  parts)
    # Where a backward call's time goes: Nsight Compute durations (the card's own clocks:
    # --clock-control none, as METHOD.md asks; runs before that locked them) of every
    # kernel of the timed calls, ours and FlashAttention-2's, at PARTS_SHAPES (hdim-causal-seqlen,
    # default the 512 points below flash), then, with FLASHATTN_FWD_GRID=1, the forward over the
    # standard grid with flash and cuDNN in the time left. Further snapshot directories given
    # are profiled too (ablations: the same call with one part of the kernel removed).
    t0=$(date +%s)
    shift
    trees=(. "$@")
    for i in "${!trees[@]}"; do
      build_library "${trees[$i]}" $(( $(nproc) / ${#trees[@]} )) >"$OUT/build_$i.log" 2>&1 & builds[$i]=$!
    done
    for i in "${!trees[@]}"; do wait "${builds[$i]}" || { tail -20 "$OUT/build_$i.log"; exit 1; }; done
    echo "build: $(( $(date +%s) - t0 )) s; commit $(cat COMMIT 2>/dev/null)" | tee "$OUT/summary.txt"
    export PATH="/usr/local/cuda/bin:$PATH"
    for shape in ${PARTS_SHAPES:-256-no-512 64-yes-512}; do
      IFS=- read -r hdim causal seqlen <<<"$shape"
      runs=("flash|--peers flash|$(cat COMMIT 2>/dev/null)")
      for i in "${!trees[@]}"; do
        runs+=("ours$i|--skip-peers --lib ${trees[$i]}/build-gpu/src/libflashattn_c.so|$(cat "${trees[$i]}/COMMIT" 2>/dev/null)")
      done
      for run in "${runs[@]}"; do
        IFS='|' read -r who args commit <<<"$run"
        # Every kernel of the run: the timed calls are the last ones (5 backward, then 5
        # forward + backward; --repeat 5).
        timeout 75 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 600 \
          python3 bench/gpu_backward.py $args --hdims "$hdim" --causal "$causal" --seqlens "$seqlen" \
          --repeat 5 --target-s 0.001 --out "/tmp/parts-$shape-$who" >"$OUT/ncu_${shape}_$who.csv" 2>"$OUT/ncu_${shape}_$who.err"
        echo "== $shape $who ($commit): the last 30 launches (us)" | tee -a "$OUT/summary.txt"
        python3 scripts/ncu_durations.py "$OUT/ncu_${shape}_$who.csv" --last 30 | tee -a "$OUT/summary.txt" | tail -6
      done
    done
    if [ "${FLASHATTN_FWD_GRID:-0}" = 1 ]; then
      left=$(( 585 - ($(date +%s) - t0) ))
      with_clock_log "$OUT/clocks_forward.csv" env PYTHONUNBUFFERED=1 timeout $left python3 bench/gpu_forward.py \
        --lib build-gpu/src/libflashattn_c.so --out "$OUT/forward" --peers flash,cudnn \
        --time-budget-s $(( left - 30 )) >"$OUT/bench_forward.log" 2>&1
      echo "bench forward: status $? (at $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
      python3 scripts/clock_windows.py "$OUT/clocks_forward.csv" "$OUT/forward/results.json" >"$OUT/clocks_forward.md" 2>&1
      grep -h "min ours" "$OUT/forward/results.md"
    fi ;;
  ab)
    # This tree against another snapshot carried along (scripts/device_snapshot.sh REF
    # .snap_base), and optionally more variants (further snapshot directories): all libraries
    # built at once, then ours alone, forward (1k/4k/16k) and backward (4k/16k) at hdim
    # 64/128/256, causal and not, in two rounds that alternate base, this, the variants;
    # scripts/ab_table.py prints each configuration's TFLOP/s and the ratios (~5 min for
    # two trees); $OUT/clocks.md has the SM clock in each measurement's window. AB_PASSES="bwd"
    # (or "fwd") times one pass only; "dec" (not in the default) times decoding, dense and
    # paged, at ANCHORS.md's shapes. AB_FWD_ARGS adds options to the forward runs (the last
    # of a repeated option wins): "--hdims 256 --target-s 2 --repeat 400" times the hdim-256
    # forward in windows long enough for the power cap to settle (without --repeat the
    # benchmark's cap of 100 timed calls ends them at 0.05-0.75 s). AB_BWD_ARGS likewise for
    # the backward ("--seqlens 512,4k" replaces 4k,16k).
    base=${2:?ab needs the base snapshot directory, e.g. ../.snap_base}
    shift 2
    trees=("$base" . "$@")
    names=(base this)
    for extra in "$@"; do names+=("$(basename "$extra" | tr -dc 'A-Za-z0-9_')"); done
    passes=${AB_PASSES:-fwd bwd}
    AB_FWD_ARGS=${AB_FWD_ARGS:-}
    AB_BWD_ARGS=${AB_BWD_ARGS:-}
    jobs=$(( $(nproc) / ${#trees[@]} )); [ "$jobs" -ge 1 ] || jobs=1
    builds=()
    for i in "${!trees[@]}"; do
      build_library "${trees[$i]}" "$jobs" >"$OUT/build_${names[$i]}.log" 2>&1 & builds+=($!)
    done
    for i in "${!trees[@]}"; do
      wait "${builds[$i]}" || { tail -20 "$OUT/build_${names[$i]}.log"; exit 1; }
    done
    printf '%s\n' "${names[@]}" >"$OUT/trees.txt"
    for i in "${!trees[@]}"; do echo "${names[$i]}: $(cat "${trees[$i]}/COMMIT" 2>/dev/null)"; done
    for round in 1 2; do
      for i in "${!trees[@]}"; do
        who=${names[$i]}; lib="${trees[$i]}/build-gpu/src/libflashattn_c.so"
        if [[ " $passes " == *" fwd "* ]]; then
          with_clock_log "$OUT/clocks_fwd_${who}_$round.csv" env PYTHONUNBUFFERED=1 timeout 100 \
            python3 bench/gpu_forward.py --lib "$lib" --skip-peers --seqlens 1k,4k,16k --target-s 0.15 \
            $AB_FWD_ARGS --out "$OUT/fwd_${who}_$round" >"$OUT/fwd_${who}_$round.log" 2>&1
        fi
        if [[ " $passes " == *" dec "* ]]; then
          with_clock_log "$OUT/clocks_dec_${who}_$round.csv" env PYTHONUNBUFFERED=1 timeout 100 \
            python3 bench/gpu_decode.py --lib "$lib" --skip-peers --page-size 256 --target-s 0.1 \
            --copy-mib 1024 --out "$OUT/dec_${who}_$round" >"$OUT/dec_${who}_$round.log" 2>&1
        fi
        if [[ " $passes " == *" bwd "* ]]; then
          with_clock_log "$OUT/clocks_bwd_${who}_$round.csv" env PYTHONUNBUFFERED=1 timeout 100 \
            python3 bench/gpu_backward.py --lib "$lib" --skip-peers --hdims 64,128,256 --seqlens 4k,16k \
            --time-budget-s 45 $AB_BWD_ARGS --out "$OUT/bwd_${who}_$round" >"$OUT/bwd_${who}_$round.log" 2>&1
        fi
      done
    done
    # The SM clock (and why it was held down) in each measurement's window, per tree and round.
    for log in "$OUT"/clocks_*.csv; do
      run=$(basename "$log" .csv); run=${run#clocks_}
      [ -f "$OUT/$run/results.json" ] && python3 scripts/clock_windows.py "$log" "$OUT/$run/results.json"
    done >"$OUT/clocks.md" 2>&1
    python3 scripts/ab_table.py "$OUT" | tee "$OUT/ab.md" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
tar czf "$top/$stage.tgz" -C "$top" "$stage" 2>/dev/null
rm -rf "$OUT"
