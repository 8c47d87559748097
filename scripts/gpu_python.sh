#!/usr/bin/env bash
# The Python package on a GPU machine, from the repository root (after, or without, the C++
# build of scripts/gpu_check.sh: the package builds its own copy of the library):
#   1. pip install . into the machine's python3 (no network: --no-build-isolation --no-deps,
#      the build needs scikit-build-core, nanobind, CMake and Ninja installed), with the CUDA
#      backend forced on and only the extension's targets built (pyproject.toml), all cores;
#   2. pytest over tests/python (CUDA tests, PyTorch CPU tests, NumPy tests);
#   3. examples/train_swap.py --compare on CUDA in bf16 (flashattn vs the SDPA stand-in).
# Logs go to $OUT (default ./gpu-results) as python_*.log; a short summary is printed last
# and kept in python_summary.txt. Exit status: 0 when all three pass.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
summary="$out/python_summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary" >/dev/null; }
export PATH="/usr/local/cuda/bin:$PATH"
py=${PYTHON:-python3}
jobs=$(nproc 2>/dev/null || echo 4)
export CMAKE_BUILD_PARALLEL_LEVEL=$jobs
failed=0

note "== Python package on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)," \
  "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "$("$py" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()})")' 2>&1 | tail -1)"
note "nvcc: $(nvcc --version 2>/dev/null | tail -1); cmake: $(cmake --version 2>/dev/null | head -1)"

# 1. Build and install. A fixed build directory: a second run on the same machine rebuilds
# only what changed. FLASHATTN_CUDA=ON fails the build rather than quietly leaving CUDA out.
start=$(date +%s)
"$py" -m pip install --no-build-isolation --no-deps --no-index -v \
  -C build-dir=build-py/gpu-wheel -C cmake.define.FLASHATTN_CUDA=ON . >"$out/python_install.log" 2>&1
status=$?
seconds=$(( $(date +%s) - start ))
steps=$(grep -cE '^ *\[[0-9]+/[0-9]+\] ' "$out/python_install.log")
if [ $status -ne 0 ]; then
  note "install: FAILED (status $status, ${seconds} s); the end of python_install.log:"
  tail -30 "$out/python_install.log" | tee -a "$summary"
  echo; cat "$summary"
  exit 1
fi
cuda=$(cd /tmp && "$py" -c 'import flashattn; print(flashattn.cuda_compiled())' 2>&1 | tail -1)
note "install: ok in ${seconds} s ($steps build steps, $jobs cores); flashattn.cuda_compiled() = $cuda"
if [ "$cuda" != True ]; then
  note "install: the installed package has no CUDA backend"
  failed=1
fi
cupy=$("$py" -c 'import cupy; cupy.zeros(1); print("cupy", cupy.__version__)' 2>&1 | tail -1)
note "CuPy (DLPack CUDA path): $cupy"

# 2. pytest. From the repository root: `import flashattn` finds the installed package (the
# sources live under python/, which is not on sys.path). -rA lists every outcome, so the
# CUDA file's own counts can be read off the log.
start=$(date +%s)
timeout 480 "$py" -m pytest tests/python -rA -q -p no:cacheprovider --durations=15 \
  >"$out/python_pytest.log" 2>&1
status=$?
seconds=$(( $(date +%s) - start ))
log="$out/python_pytest.log"
counts=$(grep -E '^=*.*(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -1 | tr -d '=')
note "pytest tests/python: status $status in ${seconds} s:${counts:- no summary line (see python_pytest.log)}"
gpu_skipped=$(grep -E '^SKIPPED \[[0-9]+\] tests/python/test_gpu.py' "$log" |
  sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' | awk '{s += $1} END {print s + 0}')
note "  of which test_gpu.py: $(grep -c '^PASSED tests/python/test_gpu.py' "$log") passed," \
  "$(grep -cE '^(FAILED|ERROR) tests/python/test_gpu.py' "$log") failed, $gpu_skipped skipped"
[ "$status" -ne 0 ] && failed=1
grep -E '^(FAILED|ERROR) ' "$log" | head -30 | sed 's/^/  /' | tee -a "$summary" >/dev/null
grep -E '^SKIPPED ' "$log" | head -20 | sed 's/^/  /' | tee -a "$summary" >/dev/null

# 3. The import-swap training loop on the GPU.
start=$(date +%s)
timeout 240 "$py" examples/train_swap.py --compare --device cuda --dtype bf16 --steps 30 \
  >"$out/python_train_swap.log" 2>&1
status=$?
seconds=$(( $(date +%s) - start ))
[ "$status" -ne 0 ] && failed=1
result=$(tail -1 "$out/python_train_swap.log" | "$py" -c '
import json, sys
try:
    r = json.loads(sys.stdin.read())
    print("final loss sdpa {:.5f}, flashattn {:.5f}; largest relative difference {:.2e} "
          "(rtol {:g})".format(r["sdpa"][-1], r["flashattn"][-1], r["max_relative_difference"],
                               r["rtol"]))
except Exception as e:
    print("no result line ({})".format(type(e).__name__))
' 2>&1)
note "train_swap --compare cuda bf16 30 steps: status $status in ${seconds} s: $result"
[ "$status" -ne 0 ] && tail -15 "$out/python_train_swap.log" | tee -a "$summary" >/dev/null

note "python overall: $([ $failed -eq 0 ] && echo PASS || echo FAIL)"
echo
cat "$summary"
exit $failed
