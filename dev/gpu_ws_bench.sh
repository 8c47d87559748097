#!/usr/bin/env bash
# Scratch: one H200 call for a TMA-forward change: the package (sm_90a) and the C++ forward
# suite built side by side, the suite run (default dispatch; WS_FORCED_SM90=1: again with
# FLASHATTN_CUDA_FORWARD=sm90), compute-sanitizer on a forward sweep (WS_SANITIZERS, default
# memcheck racecheck synccheck), then bench/forward.py over the grid with the peers, and the
# causal points again on FLASHATTN_SM90_FORWARD_GRID=persistent (WS_SKIP_GRID_AB=1: not);
# WS_EXTRA=1: bench/overhead.py and a sample of upstream's tests (dev/upstream_tests.sh).
# WS_PYTEST=1: tests/python (CUDA cases included) on the installed package.
# WS_SKIP_TESTS=1: the package and the benchmarks only. WS_BENCH_ARGS: extra bench/forward.py arguments (e.g. "--hdims 128 --seqlens 8192 16384").
# WS_TEST_ENVS="VAR=value ...": the forward suite again under each setting. WS_AB="VAR=value ...":
# bench/forward.py (ours alone, WS_AB_ARGS) again under each setting. WS_SKIP_GRID=1: no peer
# grid. WS_UPSTREAM_K: upstream's -k filter (none by default; UPSTREAM_IDS passes through). WS_EXTRA also runs
# dev/overhead_breakdown.py. WS_SANITIZER_ENV="VAR=value": the sanitizer runs under it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH"
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
py=${PYTHON:-python3}
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
( "$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
    -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/pip.log" 2>&1; echo $? >"$out/pip.rc" ) &
pip_pid=$!
if [ -z "${WS_SKIP_TESTS:-}" ]; then
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
    -DFLASHATTN_BUILD_BENCH=OFF &&
  cmake --build build-gpu -j 10 --target test_forward_cuda; } >"$out/build.log" 2>&1
stamp "build: $? $(grep -c 'C7520\|serialized' "$out/build.log") serialisation lines, $(grep -c 'spilled' "$out/build.log") spill lines"
grep -E "spilled|serialized" "$out/build.log" | sed 's/_ZN9flashattn6detail4cuda4sm90//' | cut -c1-200 | head -20
run_tests() {  # LABEL ENV...
  local label=$1; shift
  env "$@" timeout 200 build-gpu/tests/test_forward_cuda --gtest_brief=1 >"$out/fwd_$label.log" 2>&1
  stamp "forward suite ($label): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/fwd_$label.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure|expected|max' "$out/fwd_$label.log" | head -12
}
run_tests default
[ -n "${WS_FORCED_SM90:-}" ] && run_tests forced_sm90 FLASHATTN_CUDA_FORWARD=sm90
for setting in ${WS_TEST_ENVS:-}; do run_tests "${setting//[^A-Za-z0-9]/_}" "$setting"; done
FWD='*FeatureGrid*sliding_softcap*:*FeatureGrid*band_alibi*:EdgeCases.*:*HeadDims*/40:*HeadDims*/256:*OddHeadDims*/1:CudaBackend.*'
for tool in ${WS_SANITIZERS:-memcheck racecheck synccheck}; do
  env ${WS_SANITIZER_ENV:-WS_NONE=} timeout 150 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_forward_cuda \
    --gtest_filter="$FWD" >"$out/san_fwd_$tool.log" 2>&1
  stamp "$tool forward: $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_fwd_$tool.log" | tail -1) $(grep -c '^\[       OK' "$out/san_fwd_$tool.log") ok"
done
fi  # WS_SKIP_TESTS
wait $pip_pid
stamp "pip install: $(cat "$out/pip.rc")"; tail -3 "$out/pip.log"
if [ -n "${WS_PYTEST:-}" ]; then  # the Python package's tests, its CUDA cases included
  (cd tests/python && timeout "${WS_PYTEST_TIMEOUT:-200}" "$py" -m pytest -q -p no:cacheprovider >"$out/pytest.log" 2>&1)
  stamp "pytest tests/python: $? $(tail -1 "$out/pytest.log")"
  grep -E "^FAILED|^ERROR" "$out/pytest.log" | head -10
fi
cd bench || exit
if [ -z "${WS_SKIP_GRID:-}" ]; then
  timeout 300 "$py" forward.py --out "$out/grid" ${WS_BENCH_ARGS:-} >"$out/bench.log" 2>&1
  stamp "bench/forward.py: $?"
  cp "$out/grid/forward.json" "$out/forward.json" 2>/dev/null
fi
for setting in ${WS_AB:-}; do
  tag=${setting//[^A-Za-z0-9]/_}
  env "$setting" timeout 200 "$py" forward.py --out "$out/ab_$tag" --peers '' ${WS_AB_ARGS:-} >"$out/ab_$tag.log" 2>&1
  stamp "bench/forward.py ours, $setting: $?"
done
if [ -z "${WS_SKIP_GRID_AB:-}" ]; then  # the causal points again on the persistent grid
  FLASHATTN_SM90_FORWARD_GRID=persistent timeout 150 "$py" forward.py --out "$out/persistent" --causal yes \
    --peers '' >"$out/bench_persistent.log" 2>&1
  stamp "bench/forward.py causal, FLASHATTN_SM90_FORWARD_GRID=persistent: $?"
fi
if [ -n "${WS_EXTRA:-}" ]; then  # issue 28's figures: small calls' cost, upstream's test file
  timeout 100 "$py" overhead.py --out "$out/overhead" >"$out/overhead.log" 2>&1
  stamp "bench/overhead.py: $?"
  timeout 120 "$py" ../dev/overhead_breakdown.py --out "$out/breakdown" >"$out/breakdown.log" 2>&1
  stamp "dev/overhead_breakdown.py: $?"
  (cd .. && [ -d upstream ] && OUT="$out/upstream" timeout "${WS_UPSTREAM_TIMEOUT:-120}" bash dev/upstream_tests.sh run "${WS_UPSTREAM_N:-200}" 1 \
    ${WS_UPSTREAM_K:+-k "$WS_UPSTREAM_K"} >"$out/upstream.log" 2>&1)
  stamp "upstream tests: $? $(tail -1 "$out/upstream/upstream_pytest.log" 2>/dev/null)"
fi
[ -f "$out/bench.log" ] && tail -38 "$out/bench.log"
for setting in ${WS_AB:-}; do echo "== ours, $setting"; tail -16 "$out/ab_${setting//[^A-Za-z0-9]/_}.log"; done
[ -f "$out/breakdown.log" ] && { echo "== breakdown"; tail -24 "$out/breakdown.log"; }
[ -f "$out/overhead.log" ] && { echo "== overhead"; tail -14 "$out/overhead.log"; }
[ -f "$out/upstream/upstream_failures.txt" ] && { echo "== upstream failures"; head -12 "$out/upstream/upstream_failures.txt"; }
[ -f "$out/bench_persistent.log" ] && { echo "== causal, persistent grid"; tail -20 "$out/bench_persistent.log"; }
# A call brings back at most 8 files: everything but forward.json travels in one tarball.
(cd "$out" && find . -mindepth 1 -maxdepth 1 ! -name forward.json ! -name logs.tar.gz -print0 |
  tar czf logs.tar.gz --null -T - --remove-files)
