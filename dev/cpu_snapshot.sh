#!/bin/bash
# dev/cpu_snapshot.sh NAME: copies this repository's working tree (no .git) to /tmp/cpu_ab/NAME/src
# and builds libflashattn_c.so there (CPU only), for A/B timing with dev/cpu_ab.cpp.
set -e
repo=$(cd "$(dirname "$0")/.." && pwd)
name=$1
dst=/tmp/cpu_ab/$name
mkdir -p $dst/src
rm -rf $dst/src; mkdir -p $dst/src
tar -C "$repo" --exclude=./.git --exclude=./build-fuzz --exclude=./upstream -cf - . | tar -C $dst/src -xf -
cmake -S $dst/src -B $dst/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=OFF \
  -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TOOLS=OFF \
  -DFLASHATTN_BUILD_PYTHON=OFF -DFLASHATTN_BUILD_FUZZ=OFF >/dev/null
cmake --build $dst/build -j2 --target flashattn_c | tail -1
ls -la $dst/build/src/libflashattn_c.so
