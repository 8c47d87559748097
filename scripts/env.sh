# shellcheck shell=bash
# Sourced by the scripts: puts an installed CUDA toolkit's nvcc on the PATH so that CMake
# finds it (the CUDA backend is built whenever nvcc is available).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# shellcheck disable=SC2034  # read by the scripts that source this file
jobs=$(nproc 2>/dev/null || echo 2)
