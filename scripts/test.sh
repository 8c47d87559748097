#!/usr/bin/env bash
# Builds flashattn and runs every test: the full build (with CUDA when nvcc is present; GPU
# tests report themselves skipped without a GPU), then the CPU-only configuration, so that
# both sides of the FLASHATTN_CUDA switch are exercised.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh

echo "== build (CUDA: auto) =="
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
echo "== tests (CUDA: auto) =="
ctest --test-dir build --output-on-failure -j "$jobs"

echo "== build (CUDA: off) =="
cmake -S . -B build-cpu-only -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=OFF \
  -DFLASHATTN_BUILD_BENCH=OFF
cmake --build build-cpu-only -j "$jobs"
echo "== tests (CUDA: off) =="
ctest --test-dir build-cpu-only --output-on-failure -j "$jobs"
