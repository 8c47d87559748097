#!/usr/bin/env bash
# The KV-cache path on a GPU machine, in one run: build the library and the CUDA kv-cache
# suite, run it, compute-sanitizer (memcheck, racecheck) on a subset, the Python package's
# kv-cache tests on CUDA, then the decode benchmark against PyTorch's SDPA backends.
# Full logs go to $OUT (or ./gpu-results) as kv_*.log; a short summary is printed last.
#   scripts/gpu_kvcache.sh [test|bench|all|kernel]   (default all; kernel = all but the Python
#   package, whose build takes as long as the rest)
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
out=${OUT:-gpu-results}
mkdir -p "$out"
summary="$out/kv_summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary" >/dev/null; }
export PATH="/usr/local/cuda/bin:$PATH"
py=${PYTHON:-python3}

note "== kv cache on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)," \
  "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?')"
start=$(date +%s)
{ cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_BUILD_BENCH=OFF \
  && cmake --build build-gpu -j "$(nproc)" --target flashattn_c test_kvcache_cuda; } >"$out/kv_build.log" 2>&1
status=$?
note "build: status $status in $(( $(date +%s) - start )) s"
if [ $status -ne 0 ]; then tail -40 "$out/kv_build.log"; cat "$summary"; exit 1; fi

if [ "$stage" = all ] || [ "$stage" = test ] || [ "$stage" = kernel ]; then
  start=$(date +%s)
  timeout 300 build-gpu/tests/test_kvcache_cuda >"$out/kv_tests.log" 2>&1
  note "test_kvcache_cuda: status $? ($(grep -E '^\[  (PASSED|FAILED)  \]' "$out/kv_tests.log" | tr '\n' ' ')) $(( $(date +%s) - start )) s"
  grep -E '^\[  FAILED  \]' "$out/kv_tests.log" | head -20 | tee -a "$summary" >/dev/null
  # Every failure's first lines, for a quick read.
  grep -B2 -A8 -m5 'Failure' "$out/kv_tests.log" | head -60 >"$out/kv_failures.txt"
  # The grid cases numbered 20-29 (their names go on after the number).
  filter='KvCache.*:KvCachePlain.*:*KvCacheGrid*/2?_*'
  for tool in memcheck racecheck; do
    start=$(date +%s)
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_kvcache_cuda \
      --gtest_filter="$filter" >"$out/kv_sanitizer_$tool.log" 2>&1
    note "compute-sanitizer $tool: status $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/kv_sanitizer_$tool.log" | tail -1)) $(( $(date +%s) - start )) s"
  done
fi
if [ "$stage" = all ] || [ "$stage" = test ]; then
  # The Python package (its own build of the library) and its kv-cache tests on CUDA.
  start=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$py" -m pip install --no-build-isolation --no-deps --no-index -v \
    -C build-dir=build-py/gpu-wheel -C cmake.define.FLASHATTN_CUDA=ON . >"$out/kv_python_install.log" 2>&1
  note "python install: status $? ($(( $(date +%s) - start )) s)"
  start=$(date +%s)
  timeout 240 "$py" -m pytest tests/python/test_kvcache.py -rA -q -p no:cacheprovider >"$out/kv_pytest.log" 2>&1
  note "pytest test_kvcache.py: status $? ($(grep -E '(passed|failed)' "$out/kv_pytest.log" | tail -1)) $(( $(date +%s) - start )) s"
  grep -E '^(FAILED|ERROR) ' "$out/kv_pytest.log" | head -20 | tee -a "$summary" >/dev/null
fi

if [ "$stage" = all ] || [ "$stage" = bench ] || [ "$stage" = kernel ]; then
  start=$(date +%s)
  PYTHONUNBUFFERED=1 timeout 300 "$py" bench/gpu_decode.py --lib build-gpu/src/libflashattn_c.so \
    --page-size 256 --out "$out" >"$out/kv_bench.log" 2>&1
  note "decode bench: status $? ($(( $(date +%s) - start )) s)"
  tail -40 "$out/kv_bench.log"
fi
echo
cat "$summary"
