#!/usr/bin/env bash
# The tuning build: the Python package with CUDA and -DFLASHATTN_SM80_TUNING=ON (the extra
# forward and kv-cache shapes that FLASHATTN_SM80_CONFIG / FLASHATTN_KVCACHE_CONFIG select),
# installed into build-tune/site rather than over the release package, for dev/gpu_tune.sh and
# dev/gpu_tune_kvcache.sh: run a benchmark with PYTHONPATH=build-tune/site to time it.
#   dev/build_tuning.sh LOG   (the build's output goes to LOG, its tail is shown on failure)
set -uo pipefail
cd "$(dirname "$0")/.." || exit
log=${1:?log file}
export PATH="/usr/local/cuda/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
"${PYTHON:-python3}" -m pip install --no-build-isolation --no-deps --no-index --upgrade -v \
  --target build-tune/site -C build-dir=build-tune/py -C cmake.define.FLASHATTN_CUDA=ON \
  -C cmake.define.FLASHATTN_SM80_TUNING=ON . >"$log" 2>&1 || { tail -30 "$log"; exit 1; }
