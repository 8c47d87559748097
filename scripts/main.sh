#!/usr/bin/env bash
# The main job: builds the flashattn program and runs a real attention workload on the best
# backend available here, checked against the float64 reference, with its time and memory set
# against standard attention.
#
# CUDA is compiled only where a GPU can run it (`nvidia-smi -L` succeeds) or when asked
# (FLASHATTN_CUDA=ON in the environment; OFF or AUTO are passed on too): on a machine without
# a GPU the kernels could only be compiled, which is most of a build's time and scripts/test.sh's
# job. Its own build directory (build-main) never reconfigures test.sh's, and only the program
# is built (no tests, no benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh
cuda=${FLASHATTN_CUDA:-}
if [ -z "$cuda" ]; then
  if nvidia-smi -L >/dev/null 2>&1; then cuda=ON; else cuda=OFF; fi
fi
echo "main.sh: CUDA backend $cuda (build-main/)"
cmake -S . -B build-main -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA="$cuda" \
  -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_BENCH=OFF >/dev/null
cmake --build build-main -j "$jobs" --target flashattn_cli
fa=build-main/tools/flashattn

"$fa" info
echo
# A GQA layer (16 query heads over 4 key/value heads) with a causal mask, bf16, checked.
"$fa" run --backend auto --batch 2 --seqlen-q 2048 --heads 16 --heads-k 4 --head-dim 128 \
  --dtype bf16 --causal --repeat 3 --check
echo
# A long sequence: the score matrix alone would take 2 GiB; the engine needs a few hundred KiB.
"$fa" run --backend auto --batch 1 --seqlen-q 8192 --heads 8 --head-dim 64 --dtype fp32 \
  --causal --repeat 1
