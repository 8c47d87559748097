#!/usr/bin/env bash
# The main job: builds the flashattn program and runs a real attention workload on the best
# backend available here, checked against the float64 reference, with its time and memory set
# against standard attention.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs" --target flashattn_cli
fa=build/tools/flashattn

"$fa" info
echo
# A GQA layer (16 query heads over 4 key/value heads) with a causal mask, bf16, checked.
"$fa" run --backend auto --batch 2 --seqlen-q 2048 --heads 16 --heads-k 4 --head-dim 128 \
  --dtype bf16 --causal --repeat 3 --check
echo
# A long sequence: the score matrix alone would take 2 GiB; the engine needs a few hundred KiB.
"$fa" run --backend auto --batch 1 --seqlen-q 8192 --heads 8 --head-dim 64 --dtype fp32 \
  --causal --repeat 1
