#!/usr/bin/env bash
# Scratch: one device call for the CPU engine on the GPU host's 16 cores (issue 32): the CPU
# decode benchmark (bench/cpu_decode.sh, with the host's read bandwidth) and bench/cpu.py's
# grid against torch SDPA on CPU tensors, fp32 then bf16, every point under a time budget.
# The package is built CPU-only into build-cpu16/site (wheels for the build from .deps/wheels).
#   CPU16_SEQLENS=512,1024,2048,4096 CPU16_BUDGET_S=70 bash dev/cpu16_session.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${OUT:-cpu16-results}; mkdir -p "$out"
threads=${THREADS:-$(nproc)}
py=${PYTHON:-python3}
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
# Both builds at once: the package (CPU only) and the decode benchmark's program.
( CMAKE_BUILD_PARALLEL_LEVEL=$threads "$py" -m pip install --no-build-isolation --no-deps --no-index --target build-cpu16/site \
    -C build-dir=build-cpu16/py -C cmake.define.FLASHATTN_CUDA=OFF . >"$out/pip.log" 2>&1; echo "pip: $?" ) &
cmake -S . -B build-cpu-decode -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=OFF \
  -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_TOOLS=OFF -DFLASHATTN_BUILD_PYTHON=OFF >/dev/null &&
  cmake --build build-cpu-decode --target flashattn_bench_cpu_decode -j "$threads" >"$out/decode_build.log" 2>&1
wait
stamp "builds done"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node|L3" | tr -s ' '
THREADS=$threads OUT=$out timeout "${CPU16_DECODE_S:-60}" bash bench/cpu_decode.sh --repeat 5 >"$out/decode.log" 2>&1
stamp "decode: $?"
cat "$out/decode.log" | tail -30
for dtype in fp32 bf16; do
  PYTHONPATH=build-cpu16/site timeout $(( ${CPU16_BUDGET_S:-70} + 30 )) "$py" bench/cpu.py --threads "$threads" \
    --dtype $dtype --heads 16 --seqlens "${CPU16_SEQLENS:-512,1024,2048,4096}" --repeat 2 --min-time-s 0.2 \
    --time-budget-s "${CPU16_BUDGET_S:-70}" --out "$out/cpu_$dtype" >"$out/cpu_$dtype.log" 2>&1
  stamp "cpu.py $dtype: $?"
  tail -40 "$out/cpu_$dtype.log"
done
