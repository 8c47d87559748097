#!/usr/bin/env bash
# Scratch: one device call for issue 33: the package (sm_90a), the CUDA tests of the modules
# and the GPT example, then examples/gpt/benchmark.py (GPT_BENCH_ARGS) within the call's time
# (GPT_LIMIT_S, default 560 s). Results in $OUT/gpt-bench, logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( ${GPT_LIMIT_S:-560} - ($(date +%s) - t0) )); }
py=${PYTHON:-python3}
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
"$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
  -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/pip.log" 2>&1
stamp "pip install: $?"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(cd tests/python && timeout 120 "$py" -m pytest -q -p no:cacheprovider test_modules.py test_gpt_example.py >"$out/pytest.log" 2>&1)
stamp "pytest modules + gpt example: $? $(tail -1 "$out/pytest.log")"
grep -E "^FAILED|Error" "$out/pytest.log" | head -10
timeout $(( $(left) - 5 )) "$py" examples/gpt/benchmark.py --device cuda --out "$out/gpt-bench" ${GPT_BENCH_ARGS:-} \
  >"$out/gpt.log" 2>&1
stamp "benchmark: $?"
grep -E "^train|^generate" "$out/gpt.log"
tail -5 "$out/gpt.log"
