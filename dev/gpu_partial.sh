#!/usr/bin/env bash
# Scratch: a partial GPU check for when the device time is short: the package (CUDA) and some
# C++ test targets built side by side, the given ctest regex, pytest files, bench/overhead.py,
# and a sample of upstream's test file (dev/upstream_tests.sh). Results in $OUT.
#   dev/gpu_partial.sh "CTEST_REGEX" "TARGET ..." "PYTEST_FILES" UPSTREAM_N
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
regex=$1 targets=$2 pyfiles=$3 upstream_n=${4:-0}
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install --no-build-isolation --no-deps --no-index -C build-dir=build-py/gpu \
  -C cmake.define.FLASHATTN_CUDA=ON . >"$out/pip.log" 2>&1 & pip_pid=$!
if [ -n "$targets" ]; then
  # shellcheck disable=SC2086
  { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON &&
    cmake --build build-gpu -j 16 --target $targets; } >"$out/build.log" 2>&1
  stamp "build: $? ($(tail -1 "$out/build.log"))"
  ctest --test-dir build-gpu -R "$regex" -j 8 --output-on-failure --timeout 300 >"$out/ctest.log" 2>&1
  stamp "ctest: $? $(grep -E 'tests passed|tests failed' "$out/ctest.log")"
fi
wait $pip_pid; stamp "pip: $? $(tail -1 "$out/pip.log")"
(cd bench && timeout 120 python3 overhead.py --out "$out/overhead") >"$out/overhead.log" 2>&1
stamp "overhead: $?"; tail -6 "$out/overhead.log"
if [ -n "$pyfiles" ]; then
  # shellcheck disable=SC2086
  timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 $pyfiles >"$out/pytest.log" 2>&1
  stamp "pytest: $? $(tail -1 "$out/pytest.log")"
fi
if [ "$upstream_n" -gt 0 ]; then
  timeout 240 bash dev/upstream_tests.sh run "$upstream_n" 0 -n 8 --timeout 120 >"$out/upstream.log" 2>&1
  stamp "upstream: $?"; tail -25 "$out/upstream.log"
fi
