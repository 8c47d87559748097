#!/usr/bin/env bash
# The CPU decode benchmark in one command (issue 32): a CPU-only Release build of
# flashattn_bench_cpu_decode alone (in $BUILD_DIR, default build-cpu-decode; the build
# dependencies from the system or .deps/, as every build), then its default grid (bf16 and
# fp32 caches, batch 1, 4, 8, caches of 4k, 16k, 32k: 32/8 heads, head dim 128) on $THREADS
# threads (default: every processor the OS shows), with the machine's read bandwidth measured
# on the same threads. The table goes to stdout and to $OUT/cpu_decode.md (default
# ./cpu-decode-results), the figures to $OUT/cpu_decode.json; further arguments go to the
# program (`--help`-less: see the top of bench/cpu_decode.cpp).
#   bash bench/cpu_decode.sh
#   THREADS=16 OUT=results bash bench/cpu_decode.sh --repeat 15
# Exit status: the program's (1 when a check against double precision failed).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${THREADS:-$(nproc)}
out=${OUT:-cpu-decode-results}
build=${BUILD_DIR:-build-cpu-decode}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=OFF \
  -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_TOOLS=OFF -DFLASHATTN_BUILD_PYTHON=OFF >/dev/null
cmake --build "$build" --target flashattn_bench_cpu_decode -j "${JOBS:-$threads}"
mkdir -p "$out"
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), $(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -n)"
  echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1); $(nproc) processors online; OMP_PROC_BIND=${OMP_PROC_BIND:-unset} OMP_PLACES=${OMP_PLACES:-unset}"
  "$build/bench/flashattn_bench_cpu_decode" --threads "$threads" --json "$out/cpu_decode.json" "$@"
} | tee "$out/cpu_decode.md"
