#!/usr/bin/env bash
# Scratch: one device call of checks through the installed package, each time-boxed within
# SESSION_LIMIT_S (default 570 s): does racecheck model bulk copies on an mbarrier
# (dev/racecheck_bulk_copy.cu, three kernels); the GPT example's and the modules' CUDA tests;
# examples/gpt/benchmark.py (GPT_BENCH_ARGS); the stratified sample of upstream's test file
# (dev/upstream_tests.sh, carry upstream/; UPSTREAM_IDS_FILE: another list of case ids);
# scripts/gpu_sweep.py under memcheck (SWEEP_CALLS, default 150) in the time left.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( ${SESSION_LIMIT_S:-570} - ($(date +%s) - t0) )); }
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
( "$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
    -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/pip.log" 2>&1; echo $? >"$out/pip.rc" ) &
pip_pid=$!
nvcc -arch=sm_90a -O2 -o /tmp/racecheck_bulk dev/racecheck_bulk_copy.cu >"$out/rc_build.log" 2>&1
for k in 0 1 2; do
  timeout 60 compute-sanitizer --tool racecheck /tmp/racecheck_bulk $k >"$out/rc_$k.log" 2>&1
  stamp "racecheck kernel $k: rc $? | $(grep -h 'sums wrong' "$out/rc_$k.log") | $(grep -h 'RACECHECK SUMMARY' "$out/rc_$k.log")"
done
wait $pip_pid
stamp "pip install: $(cat "$out/pip.rc")"
(cd tests/python && timeout 120 "$py" -m pytest -q -p no:cacheprovider test_gpt_example.py test_modules.py >"$out/pytest.log" 2>&1)
stamp "pytest gpt example + modules: $? $(tail -1 "$out/pytest.log")"
grep -E "^FAILED|Error" "$out/pytest.log" | head -8
timeout $(( $(left) - ${RESERVE_S:-230} )) "$py" examples/gpt/benchmark.py --device cuda --out "$out/gpt-bench" ${GPT_BENCH_ARGS:-} >"$out/gpt.log" 2>&1
stamp "gpt benchmark: $?"
grep -E "^train|^generate" "$out/gpt.log"; grep -E "Error" "$out/gpt.log" | tail -2
UPSTREAM_IDS=${UPSTREAM_IDS_FILE:-upstream/sample_ids.txt} timeout $(( $(left) - ${SWEEP_S:-110} )) bash dev/upstream_tests.sh run 0 0 >"$out/upstream.txt" 2>&1
stamp "upstream sample: $?"
tail -20 "$out/upstream.txt"
timeout $(( $(left) - 10 )) compute-sanitizer --tool memcheck --error-exitcode 99 "$py" scripts/gpu_sweep.py --device cuda \
  --calls "${SWEEP_CALLS:-150}" --seed 1 --out "$out/sweep" >"$out/sweep.log" 2>&1
stamp "sweep under memcheck: $? $(grep -h 'ERROR SUMMARY' "$out/sweep.log" | tail -1) $(tail -2 "$out/sweep.log" | head -1)"
(cd "$out" && tar czf logs.tar.gz --remove-files pip.log pytest.log rc_*.log upstream_pytest.log sweep.log 2>/dev/null)
