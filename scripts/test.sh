#!/usr/bin/env bash
# Builds flashattn and runs every test: the full build (with CUDA when nvcc is present; GPU
# tests report themselves skipped without a GPU), then the CPU-only configuration, so that
# both sides of the FLASHATTN_CUDA switch are exercised. Then the Python package: a venv,
# `pip install .` (scikit-build-core + nanobind from PyPI; CUDA when nvcc and a GPU are
# present) and pytest over tests/python (NumPy tests always; PyTorch CPU tests with
# torch==2.11.0, which FLASHATTN_TEST_TORCH=0 leaves out; GPU tests skip, with the reason
# shown, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh

# Without a GPU the CUDA code can only be compiled, not run: Hopper's PTX alone (compute_90a:
# every kernel, the sm80 ones included, through the front end and optimiser, without ptxas)
# checks that it compiles in about a third of the time of a release build's three targets.
# FLASHATTN_CUDA_ARCHS set by the caller wins.
if ! nvidia-smi -L >/dev/null 2>&1 && [ -z "${FLASHATTN_CUDA_ARCHS:-}" ]; then
  export FLASHATTN_CUDA_ARCHS=compute_90a
fi
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

echo "== Python package: pip install . into a venv =="
# No wheel cache: torch with its CUDA libraries is 4.6 GB installed and its cache would add
# about 3 GB more, which ran a CI machine's disk out of space.
export PIP_NO_CACHE_DIR=1
venv=build-py/venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q pytest numpy ml_dtypes
if [ "${FLASHATTN_TEST_TORCH:-1}" != 0 ]; then
  "$venv/bin/python" -m pip install -q torch==2.11.0
fi
# A fixed build directory: a second run rebuilds only what changed. Without a GPU the
# package's CUDA code could only be compiled, which the full build above already did, so the
# package is built CPU-only there (on a 2-core machine about 15 minutes less).
cuda_switch=AUTO
nvidia-smi -L >/dev/null 2>&1 || cuda_switch=OFF
"$venv/bin/python" -m pip install -q -C build-dir=build-py/wheel -C cmake.define.FLASHATTN_CUDA=$cuda_switch .

echo "== Python tests =="
# From tests/python, so that `import flashattn` finds the installed package, not the sources.
status=0
(cd tests/python && "../../$venv/bin/python" -m pytest -q) || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests (exit 5): the Python tests did not run" >&2
  exit 1
fi
exit "$status"
