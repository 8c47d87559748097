#!/usr/bin/env bash
# The tuning build (-DFLASHATTN_SM80_TUNING=ON: the extra forward and kv-cache shapes that
# FLASHATTN_SM80_CONFIG / FLASHATTN_KVCACHE_CONFIG select) of the C library in build-tune/,
# for scripts/gpu_tune.sh and scripts/gpu_tune_kvcache.sh.
#   scripts/build_tuning.sh LOG [TARGET ...]   (the build's output goes to LOG, its tail is
#   shown on failure; extra targets such as test_kvcache_cuda are built with the library)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:?log file}
shift
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B build-tune -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
  -DFLASHATTN_SM80_TUNING=ON -DFLASHATTN_BUILD_TESTS=ON -DFLASHATTN_BUILD_BENCH=OFF \
  -DFLASHATTN_BUILD_TOOLS=OFF >/dev/null &&
  cmake --build build-tune -j "$(nproc)" --target flashattn_c "$@" >"$log" 2>&1 ||
  { tail -30 "$log"; exit 1; }
