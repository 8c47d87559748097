#!/usr/bin/env bash
# Installs the Debian packages flashattn builds with, when any is missing. CUDA is optional:
# with nvcc on the PATH (or in /usr/local/cuda/bin) the CUDA backend builds too.
set -euo pipefail

# python3-venv and python3-dev: the Python package's venv and its extension's headers.
packages=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev python3-venv python3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
