#!/usr/bin/env bash
# The GPU machine's one entry point. Builds once, runs the stages given, in order, in one call:
#   scripts/gpu.sh STAGE [STAGE ...]      e.g. `scripts/gpu.sh test sanitize`, `scripts/gpu.sh bench`
#   test      the C++ build with CUDA (build-gpu/), `ctest -L gpu` (the whole GPU suite), the
#             Python package built with CUDA and installed, `pytest tests/python` (its CUDA tests
#             included), and the training comparison on the GPU (examples/train_swap.py)
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck on small forward, backward and
#             kv-cache sweeps, all at once (with `test`: beside it, unless GPU_SERIAL=1)
#   bench     the benchmarks through the installed package: bench/grid.py (forward and backward
#             over the grid, with the peers), bench/decode.py and bench/overhead.py (small calls'
#             eager cost); the grid's grid_latest.json is
#             copied to $OUT/h200_grid_latest.json (for docs/results/)
#   profile   Nsight Compute on one shape, ours against FlashAttention-2 (cuDNN for decode):
#             PROFILE_ARGS="fwd|bwd HDIM SEQLEN yes|no" (default "fwd 128 4096 no") or
#             "dec BATCH CACHE_LEN"
#   tune      tile-shape candidates (dev/gpu_tune.sh, dev/gpu_tune_kvcache.sh):
#             TUNE_ARGS="fwd CANDIDATE ..." or "kv [CANDIDATE ...]" (default "kv")
#   sweep     scripts/gpu_sweep.py through the installed package: SWEEP_CALLS (default 500)
#             seeded random hostile calls (odd shapes, every feature, bad index values, invalid
#             calls) under compute-sanitizer memcheck (SWEEP_TIMEOUT seconds, default 900),
#             then --huge (tensors past 2^31 elements, about 50 GB of GPU memory) without it;
#             `gpu_sweep.py --seed 1 --only I` reruns call I; its JSON in logs.tar.gz (sweep/)
# Environment: OUT (results, default ./gpu-results), FLASHATTN_CUDA_ARCHS (CUDA code to build on
# a first configure, e.g. sm_90a on an H200: half the build time), BENCH_ARGS (extra arguments
# of both benchmarks, e.g. --quick), PYTHON (default python3), GPU_SERIAL=1 (sanitizers after
# the test stage, not beside it), SANITIZE_TIMEOUT (seconds per run, default 520),
# SANITIZE_ONLY (an extended regex over "TOOL TEST", e.g. 'memcheck.*kvcache': only those runs).
# Results: $OUT/summary.txt (the machine, then a table of every step: status, seconds, outcome;
# printed last), the benchmarks' tables and JSON, and every log in $OUT/logs.tar.gz. The exit
# status is nonzero when any step failed. Build dependencies the machine lacks (it has no
# network) travel in .deps/: scripts/prepare_gpu_deps.sh.
set -uo pipefail
cd "$(dirname "$0")/.." || exit

usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; }
stages=()
for arg; do
  case $arg in
    -h|--help) usage; exit 0 ;;
    test|sanitize|bench|profile|tune|sweep) stages+=("$arg") ;;
    *) echo "gpu.sh: unknown stage '$arg' (stages: test, sanitize, bench, profile, tune, sweep; see --help)" >&2
       exit 2 ;;
  esac
done
if [ ${#stages[@]} -eq 0 ]; then usage >&2; exit 2; fi
wants() { [[ " ${stages[*]} " == *" $1 "* ]]; }
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu.sh: no GPU here (nvidia-smi -L fails); it runs on a GPU machine. Without one," \
    "scripts/test.sh builds everything (CUDA included) and runs the CPU tests." >&2
  exit 3
fi

export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
jobs=$(nproc)
export CMAKE_BUILD_PARALLEL_LEVEL=$jobs
py=${PYTHON:-python3}
out=${OUT:-gpu-results}
logs=$out/logs
rows=$logs/steps.tsv
# What an earlier call left in $OUT goes first: no stale result can pass for this call's.
(cd "$out" 2>/dev/null && rm -rf logs grid decode profile tune sweep summary.txt logs.tar.gz \
  h200_grid_latest.json grid_* decode_*)
mkdir -p "$logs"
: >"$rows"

# step NAME LOG COMMAND...: runs COMMAND with its output in $logs/LOG (also $step_log, for
# COMMAND to read back), then adds NAME's row to the table: PASS or FAIL (the exit status),
# seconds, and the log's outcome line.
step() {
  local name=$1 log=$2 start status=0
  shift 2
  start=$(date +%s)
  step_log=$logs/$log
  "$@" >"$step_log" 2>&1 || status=$?
  local verdict=PASS
  [ $status -eq 0 ] || verdict="FAIL ($status)"
  local row
  row=$(printf '%s\t%s\t%s\t%s\t%s' "$name" "$verdict" "$(( $(date +%s) - start ))" \
    "$(outcome_of "$logs/$log")" "$log")
  echo "$row" >>"$rows"
  # Also as it happens: a call cut short (a time limit) still shows every step that ended.
  echo "gpu.sh step: ${row%$'\t'*}" | tr '\t' ' '
  return $status
}
# A log's outcome: the last line the step printed as "outcome: ...", else ctest's or pytest's
# totals or compute-sanitizer's summary, else its last line.
outcome_of() {
  local line
  line=$(grep -h '^outcome: ' "$1" | tail -1)
  [ -n "$line" ] || line=$(grep -hE 'tests passed|tests failed|ERROR SUMMARY|RACECHECK SUMMARY|(passed|failed|error).* in [0-9.]+s' "$1" | tail -1)
  [ -n "$line" ] || line=$(grep -v '^ *$' "$1" | tail -1)
  echo "${line#outcome: }" | sed -E 's/={2,}//g; s/^ +//' | cut -c1-120
}

# ---- the C++ build (test, sanitize) and the Python package (test, bench, profile)
build_cxx() {  # [TARGET ...]: all by default (the benchmarks too: bench_capi_timing is a GPU test)
  local targets=()
  [ $# -eq 0 ] || targets=(--target "$@")
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
    -DFLASHATTN_BUILD_BENCH=ON &&
    cmake --build build-gpu -j "$jobs" "${targets[@]}"
}
install_package() {
  # A fixed build directory: a second call on a warm machine rebuilds only what changed.
  # FLASHATTN_CUDA=ON fails the build rather than quietly leaving CUDA out.
  "$py" -m pip install --no-build-isolation --no-deps --no-index -v \
    -C build-dir=build-py/gpu -C cmake.define.FLASHATTN_CUDA=ON . || return
  local cuda
  cuda=$(cd /tmp && "$py" -c 'import flashattn; print(flashattn.cuda_compiled())' 2>&1 | tail -1)
  echo "outcome: installed; flashattn.cuda_compiled() = $cuda"
  [ "$cuda" = True ]
}
package_ready=""
package() {  # once per call
  [ -n "$package_ready" ] && return 0
  step "pip install . (CUDA)" pip_install.log install_package && package_ready=1
}

# ---- test
ctest_gpu() {
  ctest --test-dir build-gpu -L gpu -j 8 --output-on-failure --timeout 300 --no-tests=error
  local status=$?
  # On a GPU machine a skipped GPU test means the suite did not run it: counted in the outcome.
  echo "outcome: $(grep -E 'tests passed|tests failed' "$step_log" | tail -1);" \
    "$(grep -cE '\*\*\*Skipped|Not Run' "$step_log") skipped or not run"
  return $status
}
pytest_all() {
  # From the repository root: `import flashattn` finds the installed package (the sources live
  # under python/, not on sys.path). -rA lists every outcome, so the CUDA tests can be counted.
  # Four workers where pytest-xdist is installed: the CPU-bound tests (torch.compile's
  # inductor build, the float64 references) then overlap instead of queueing.
  local workers=()
  "$py" -c 'import xdist' 2>/dev/null && workers=(-n 4)
  timeout 480 "$py" -m pytest tests/python -rA -q -p no:cacheprovider --durations=15 "${workers[@]}"
  local status=$? log=$step_log
  echo "outcome: $(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$log" | tail -1 | sed -E 's/=+ ?| ?=+$//g');" \
    "test_gpu.py: $(grep -c '^PASSED tests/python/test_gpu.py' "$log") passed," \
    "$(grep -cE '^(FAILED|ERROR) tests/python/test_gpu.py' "$log") failed," \
    "$(grep -cE '^SKIPPED .*test_gpu.py' "$log") skip lines"
  return $status
}
train_compare() {
  # The import-swap training loop (flashattn against the SDPA stand-in) on the GPU in bf16.
  timeout 240 "$py" examples/train_swap.py --compare --device cuda --dtype bf16 --steps 30 || return
  tail -1 "$step_log" | "$py" -c '
import json, sys
r = json.loads(sys.stdin.read())
print("outcome: final loss sdpa {:.5f}, flashattn {:.5f}; largest relative difference {:.2e} "
      "(rtol {:g})".format(r["sdpa"][-1], r["flashattn"][-1], r["max_relative_difference"], r["rtol"]))'
}
run_test() {
  # The package's build (the CPU's work) beside the GPU suite (the GPU's): a minute less.
  local package_pid="" package_status=0
  if [ -z "$package_ready" ]; then package & package_pid=$!; fi
  step "ctest -L gpu" ctest_gpu.log ctest_gpu
  if [ -n "$package_pid" ]; then
    wait "$package_pid" || package_status=$?
    [ "$package_status" -eq 0 ] || return 1
    package_ready=1  # set in the background subshell, which this shell does not see
  fi
  step "pytest tests/python" pytest.log pytest_all
  step "train_swap --compare cuda bf16" train_swap.log train_compare
}

# ---- sanitize
# The sweeps: odd shapes, every mask, GQA, varlen, softcap and ALiBi (forward); the backward's
# features (dropout and the deterministic mode among them), edge cases, the smallest and largest
# head-dim buckets, varlen with empty sequences, the stream test and the CUDA validation rules;
# the sm90 backward's plain calls at each bucket (64, 128, 256), ragged batches, long sequences;
# the kv-cache's plain decoding, every split count and a NaN kept in its row; and the padded
# copies of head dims that are not multiples of 8 (forward, ragged, backward, kv-cache); paged
# varlen keys and the varlen guards (bad page indices and cu_seqlens on the device); the
# kv-cache's guards (bad values of each int32 tensor, directly and from a CUDA graph: memcheck
# shows whether any reaches outside the tensors).
FWD_FILTER='*FeatureGrid*sliding_softcap*:*FeatureGrid*band_alibi*:EdgeCases.*:Varlen.EmptySequencesAndEveryFeature:Varlen.HeadDimsNotMultiplesOf8:Varlen.PagedEveryPageSizeAndFeature:Varlen.PagedEveryHeadDimBucket:CudaBackend.*:CudaVarlenGuards.*:*HeadDims*/40:*HeadDims*/256:*OddHeadDims*/1'
BWD_FILTER='*BackwardGrid*causal_softcap*:*BackwardGrid*band_alibiH_*:BackwardEdgeCases.*:*BackwardHeadDims*/0:*BackwardHeadDims*/11:*BackwardOddHeadDims*/1:BackwardVarlen.*:CudaBackward.RunsOnTheGivenStream*:CudaBackward.OddHeadDim*:CudaBackwardErrors.*'
SM90_BWD_FILTER='*BackwardPlainCalls*/1:*BackwardPlainCalls*/3:*BackwardPlainCalls*/5:*BackwardVarlen*/3:BackwardLong.*:BackwardEdgeCases.*'
KV_FILTER='KvCachePlain.*:KvCache.EverySplitCountMatchesTheReference:KvCache.NanInOneQueryRowStaysInThatRow:KvCache.AppendStraddlesPagesAndQueriesOutnumberKeys:KvCache.HeadDimsNotMultiplesOf8'
# attention_probabilities: ragged batches (device cu_seqlens, padding rows and columns) and a
# packed, causal call.
PROBS_FILTER='Probabilities.VarlenMatchTheReferenceTheForwardAndTheBackward:Probabilities.PackedQkvAndNegativeScale'
KV_GUARD_FILTER='KvCacheGuard.*'
# tool, test binary, environment (default: the dispatch's choice; else one VAR=value, e.g. the
# sm80 forward that GPUs before Hopper run, or the sm90 backward's cp.async kernel), filter.
# The sm90 backward's plain calls take its TMA kernel (named barriers and mbarriers: synccheck
# too) by default.
SANITIZER_RUNS=(
  "memcheck test_forward_cuda default $FWD_FILTER"
  "racecheck test_forward_cuda default $FWD_FILTER"
  "synccheck test_forward_cuda default $FWD_FILTER"
  "memcheck test_forward_cuda FLASHATTN_CUDA_FORWARD=sm80 $FWD_FILTER"
  "memcheck test_backward_cuda default $BWD_FILTER"
  "racecheck test_backward_cuda default $BWD_FILTER"
  "synccheck test_backward_cuda default $BWD_FILTER"
  "memcheck test_backward_cuda default $SM90_BWD_FILTER"
  "racecheck test_backward_cuda default $SM90_BWD_FILTER"
  "synccheck test_backward_cuda default $SM90_BWD_FILTER"
  "memcheck test_backward_cuda FLASHATTN_SM90_BACKWARD_LOADS=cp.async $SM90_BWD_FILTER"
  "memcheck test_kvcache_cuda default $KV_FILTER"
  "racecheck test_kvcache_cuda default $KV_FILTER"
  "synccheck test_kvcache_cuda default $KV_FILTER"
  "memcheck test_probabilities_cuda default $PROBS_FILTER"
  "racecheck test_probabilities_cuda default $PROBS_FILTER"
  "memcheck test_kvcache_cuda default $KV_GUARD_FILTER"
)
sanitize_one() {  # TOOL TEST ENVIRONMENT FILTER
  local forced=()
  [ "$3" = default ] || forced=("$3")
  env "${forced[@]}" timeout "${SANITIZE_TIMEOUT:-520}" compute-sanitizer --tool "$1" --error-exitcode 99 \
    "build-gpu/tests/$2" --gtest_filter="$4"
  local status=$? summary passed
  summary=$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$step_log" | tail -1 | sed 's/^=* *//')
  passed=$(grep -cE '^\[       OK \]' "$step_log")
  echo "outcome: ${summary:-no summary line}; $passed tests ok"
  # A filter that matches nothing would pass without checking anything.
  [ "$passed" -gt 0 ] || return 98
  return $status
}
run_sanitize() {
  local pids=() i tool test family filter label failed=0
  for i in "${!SANITIZER_RUNS[@]}"; do
    read -r tool test family filter <<<"${SANITIZER_RUNS[$i]}"
    label="$tool ${test%_cuda}"
    [ "$family" = default ] || label+=" ($family)"
    [ "$filter" = "$SM90_BWD_FILTER" ] && label+=" (sm90 calls)"
    [ "$filter" = "$KV_GUARD_FILTER" ] && label+=" (guards)"
    # SANITIZE_ONLY: an extended regex over "TOOL TEST": the runs a change concerns.
    if [ -n "${SANITIZE_ONLY:-}" ] && ! [[ "$tool $test" =~ $SANITIZE_ONLY ]]; then continue; fi
    step "$label" "sanitizer_$i.log" sanitize_one "$tool" "$test" "$family" "$filter" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || failed=1; done
  return $failed
}

# ---- bench
bench_one() {  # NAME: bench/NAME.py --out $out/NAME $BENCH_ARGS
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
  "$py" "bench/$1.py" --out "$out/$1" ${BENCH_ARGS:-}
}
run_bench() {
  package || return 1
  step "bench/grid.py ${BENCH_ARGS:-}" bench_grid.log bench_one grid
  step "bench/decode.py ${BENCH_ARGS:-}" bench_decode.log bench_one decode
  step "bench/overhead.py ${BENCH_ARGS:-}" bench_overhead.log bench_one overhead
  if [ -f "$out/grid/grid_latest.json" ]; then
    cp "$out/grid/grid_latest.json" "$out/h200_grid_latest.json"
  else
    printf 'copy grid_latest.json\tFAIL\t0\tbench/grid.py wrote no %s\t-\n' "$out/grid/grid_latest.json" >>"$rows"
    return 1
  fi
}

# ---- profile
profile_one() {  # PASS WHO KERNEL_REGEX ARGS...
  local pass=$1 who=$2 regex=$3 dir=$out/profile
  shift 3
  local report=$dir/${pass}_$who
  mkdir -p "$dir"
  ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis_Chart \
    --section SourceCounters --import-source no -f -o "$report" \
    "$py" scripts/profile_call.py "$pass" "$who" "$@" || return
  local rep=$report.ncu-rep
  ncu --import "$rep" --page details --print-units base >"$report.details.txt"
  # Every collected metric (the memory chart's L2 and fabric traffic included) and the
  # speed-of-light breakdowns: which unit's throughput is the one near its peak.
  ncu --import "$rep" --page raw --print-units base >"$report.raw.txt"
  ncu --import "$rep" --page details --print-details all --section SpeedOfLight --print-units base \
    >"$report.sol.txt"
  # Stall reasons per issued instruction, largest first: where the issue slots go when the
  # instruction counts are alike.
  grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio" "$report.raw.txt" |
    awk '{print $NF, $1}' | sort -gr | head -12 >"$report.stalls.txt"
  # Executed instructions per SASS opcode, from the source counters.
  ncu --import "$rep" --page source --csv --print-source sass >"$report.sass.csv"
  "$py" scripts/sass_mix.py "$report.sass.csv" 25 >"$report.sass_mix.txt"
  rm -f "$rep"  # large; what is read from it is kept
  echo "== $pass $who ($regex)"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  |No Eligible|Local|Bank" \
    "$report.details.txt" | head -24
  echo "   stalls per issued instruction:"; sed 's/^/     /' "$report.stalls.txt" | head -8
  echo "   instruction mix:"; sed 's/^/     /' "$report.sass_mix.txt" | head -14
  echo "outcome: $(grep -m1 -E '^ *Duration' "$report.details.txt" | tr -s ' ')"
}
run_profile() {
  package || return 1
  local args pass failed=0
  read -r -a args <<<"${PROFILE_ARGS:-fwd 128 4096 no}"
  pass=${args[0]}
  local ours peer peer_regex
  case $pass in
    fwd) ours='forward_(ws_)?kernel'; peer=flash; peer_regex=flash_fwd ;;
    bwd) ours='backward_(dkdv|ws)_kernel'; peer=flash; peer_regex=flash_bwd_dq_dk_dv ;;
    dec) ours=kvcache_kernel; peer=cudnn; peer_regex='sdpa|fmha|cudnn' ;;
    *) printf 'profile\tFAIL\t0\tPROFILE_ARGS: unknown pass %s (fwd, bwd or dec)\t-\n' "$pass" >>"$rows"; return 1 ;;
  esac
  step "ncu $pass ours ${args[*]:1}" "profile_${pass}_ours.log" profile_one "$pass" ours "$ours" "${args[@]:1}" || failed=1
  step "ncu $pass $peer ${args[*]:1}" "profile_${pass}_$peer.log" profile_one "$pass" "$peer" "$peer_regex" "${args[@]:1}" || failed=1
  return $failed
}

# ---- tune
run_tune() {
  local args
  read -r -a args <<<"${TUNE_ARGS:-kv}"
  case ${args[0]} in
    fwd) step "dev/gpu_tune.sh ${args[*]:1}" tune.log env OUT="$out/tune" bash dev/gpu_tune.sh "${args[@]:1}" ;;
    kv) step "dev/gpu_tune_kvcache.sh ${args[*]:1}" tune.log env OUT="$out/tune" bash dev/gpu_tune_kvcache.sh "${args[@]:1}" ;;
    *) printf 'tune\tFAIL\t0\tTUNE_ARGS: expected fwd or kv first, given %s\t-\n' "${args[0]}" >>"$rows"; return 1 ;;
  esac
}

# ---- sweep
sweep_memcheck() {
  # No caching allocator: every torch tensor is its own cudaMalloc, so memcheck sees an access
  # past any of them (inside a cached pool block it would not).
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SWEEP_TIMEOUT:-900}" compute-sanitizer \
    --tool memcheck --error-exitcode 99 "$py" scripts/gpu_sweep.py --device cuda \
    --calls "${SWEEP_CALLS:-500}" --seed 1 --out "$out/sweep"
  local status=$? summary
  summary=$(grep -hE 'ERROR SUMMARY' "$step_log" | tail -1 | sed 's/^=* *//')
  echo "outcome: $(grep -h '^outcome: ' "$step_log" | tail -1 | cut -c10-90); ${summary:-no summary line}"
  return $status
}
run_sweep() {
  package || return 1
  step "gpu_sweep memcheck (${SWEEP_CALLS:-500} calls)" sweep.log sweep_memcheck
  step "gpu_sweep --huge" sweep_huge.log timeout 900 "$py" scripts/gpu_sweep.py --device cuda \
    --huge --seed 1 --out "$out/sweep"
}

# ---- the call
machine() {
  echo "== scripts/gpu.sh ${stages[*]}: $(date -u '+%Y-%m-%d %H:%M UTC')," \
    "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "gpu (name, driver, memory, max SM clock, SM clock now): $(nvidia-smi \
    --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm --format=csv,noheader | head -1)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1); $(cmake --version | head -1); $jobs cores;" \
    "FLASHATTN_CUDA_ARCHS=${FLASHATTN_CUDA_ARCHS:-(default)}"
  "$py" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")' 2>&1 | tail -1
}
summary() {
  machine
  echo "gpu at the end (SM clock, temperature, power): $(nvidia-smi \
    --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader | head -1)"
  echo
  { printf 'step\tstatus\tseconds\toutcome\n'; cat "$rows"; } |
    awk -F'\t' '{printf "%-42s %-9s %7s  %s\n", $1, $2, $3, $4}'
  # The end of every failed step's log, for a first look.
  awk -F'\t' '$2 != "PASS" && $5 != "-" {print $5}' "$rows" | while read -r log; do
    echo; echo "-- $log (last lines):"; tail -8 "$logs/$log"
  done
}

sanitize_pid="" sanitize_started=""
built=0
if wants test || wants sanitize; then
  targets=()
  wants test || targets=(test_forward_cuda test_backward_cuda test_kvcache_cuda test_probabilities_cuda)
  step "build (CUDA, build-gpu)" build.log build_cxx "${targets[@]}" || built=$?
fi
if [ "$built" -ne 0 ]; then
  echo "gpu.sh: the build failed; nothing else runs" >>"$logs/build.log"
else
  # With both, the sanitizers (slow, GPU-bound, one small sweep each) run beside the test stage
  # (the suite, the package build on every core, pytest): the call takes about the longer of
  # the two, not their sum. Correctness only runs meanwhile; the benchmarks come after.
  if wants test && wants sanitize && [ "${GPU_SERIAL:-0}" != 1 ]; then
    sanitize_started=1
    run_sanitize & sanitize_pid=$!
  fi
  for stage in "${stages[@]}"; do
    case $stage in
      test) run_test
            [ -z "$sanitize_pid" ] || wait "$sanitize_pid" ;;
      sanitize) [ -n "$sanitize_started" ] || { sanitize_started=1; run_sanitize; } ;;
      bench) run_bench ;;
      profile) run_profile ;;
      tune) run_tune ;;
      sweep) run_sweep ;;
    esac
  done
fi

# What comes back is few files: the summary, the benchmarks' tables and JSON at the top, every
# log (and the profiles' and tuning runs' reports) in one archive.
# (grid_latest.json is there already, as h200_grid_latest.json.)
for dir in grid decode; do
  for f in "$out/$dir"/*.md "$out/$dir"/*.json; do
    name=$(basename "$f")
    [ -f "$f" ] && [ "$name" != grid_latest.json ] && cp "$f" "$out/${dir}_${name#"$dir"_}"
  done
done
summary >"$out/summary.txt" 2>&1
cp "$out/summary.txt" "$logs/"
failed=$(awk -F'\t' '$2 != "PASS"' "$rows" | wc -l)
packed=()
for dir in logs grid decode profile tune sweep; do [ -d "$out/$dir" ] && packed+=("$dir"); done
tar czf "$out/logs.tar.gz" -C "$out" "${packed[@]}" && (cd "$out" && rm -rf "${packed[@]}")
cat "$out/summary.txt"
[ "$failed" -eq 0 ]
