#!/usr/bin/env bash
# The GPU machine has no network: this copies the build dependencies that are not installed
# there (GoogleTest sources, CLI11 and nlohmann-json headers) from this machine's Debian
# packages into .deps/ (ignored by git), which the device call carries and CMake falls back to.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
rm -rf .deps && mkdir -p .deps/include
cp -r /usr/src/googletest .deps/googletest
cp -r /usr/include/CLI /usr/include/nlohmann .deps/include/
du -sh .deps
