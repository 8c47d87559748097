#!/usr/bin/env bash
# Scratch: one device call when calls are scarce: the package and the C++ backward suite built
# side by side (sm_90a); compute-sanitizer memcheck and racecheck (SESSION_SANITIZERS) on the
# TMA backward's plain calls; the CUDA tests of the GPT example (CUDA-graph decode); then
# examples/gpt/benchmark.py (GPT_BENCH_ARGS) in the time left (SESSION_LIMIT_S, default 560 s).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( ${SESSION_LIMIT_S:-560} - ($(date +%s) - t0) )); }
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
( "$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
    -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/pip.log" 2>&1; echo $? >"$out/pip.rc" ) &
pip_pid=$!
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
    -DFLASHATTN_BUILD_BENCH=OFF && cmake --build build-gpu -j 10 --target test_backward_cuda; } >"$out/build.log" 2>&1
stamp "build test_backward_cuda: $? ($(grep -c 'spilled' "$out/build.log") spill lines, $(grep -c 'serialized' "$out/build.log") serialisation lines)"
# The TMA kernel's cases: plain calls at head dims 64 and 128 (instantiations /1 and /3).
BWD='*BackwardPlainCalls*/1:*BackwardPlainCalls*/3'
for tool in ${SESSION_SANITIZERS:-memcheck racecheck}; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_backward_cuda \
    --gtest_filter="$BWD" >"$out/san_bwd_$tool.log" 2>&1
  stamp "$tool backward (TMA kernel): $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_bwd_$tool.log" | tail -1) $(grep -c '^\[       OK' "$out/san_bwd_$tool.log") ok, $(grep -c 'FAILED  \]' "$out/san_bwd_$tool.log") failed"
done
wait $pip_pid
stamp "pip install: $(cat "$out/pip.rc")"
(cd tests/python && timeout 90 "$py" -m pytest -q -p no:cacheprovider test_gpt_example.py test_modules.py >"$out/pytest.log" 2>&1)
stamp "pytest gpt example + modules: $? $(tail -1 "$out/pytest.log")"
grep -E "^FAILED|Error" "$out/pytest.log" | head -8
timeout $(( $(left) - 5 )) "$py" examples/gpt/benchmark.py --device cuda --out "$out/gpt-bench" ${GPT_BENCH_ARGS:-} >"$out/gpt.log" 2>&1
stamp "benchmark: $?"
grep -E "^train|^generate" "$out/gpt.log"
tail -3 "$out/gpt.log"
(cd "$out" && tar czf logs.tar.gz --remove-files pip.log build.log san_bwd_*.log pytest.log 2>/dev/null)
