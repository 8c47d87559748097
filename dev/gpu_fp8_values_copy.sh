#!/usr/bin/env bash
# One device call for dev/fp8_values_copy.patch (issue 31: a row-major fp8 v that a dense call
# reads often runs on a (d, seqlen)-major copy). From the main checkout:
#   dev/device_snapshot.sh main .snap dev/fp8_values_copy.patch && dev/device_snapshot.sh main .snap_base
# then carry [".snap", ".snap_base"] and run `cd .snap && bash dev/gpu_fp8_values_copy.sh`:
#   1. dev/gpu_fp8.sh on the patched tree: the package, test_fp8_cuda (its
#      ValuesReadOftenRunOnASeqlenMajorCopyOnCuda checks the copy's workspace), the Hopper cases
#      of tests/python/test_fp8.py, the sanitizers on FP8 calls (one of them copied);
#   2. dev/ab.sh against main: bench/forward_fp8.py at head dims 128 and 256, 512, 2k, 8k ("ours"
#      is the row-major call: copied from 2k here, not at 512 where batch x heads are 32 x 16 and
#      each key serves 512 rows); results packed into $OUT/ab.tgz.
# Predicted: the row-major call 1.6-2.0x at head dim 256 and 1.25-1.4x at 128 from 2k, 1.00x at 512.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
FP8_GTEST=1 FP8_FULL_PYTEST=0 FP8_CACHE=0 FP8_BENCH=0 FP8_ACCURACY=0 FP8_LIMIT_S=300 \
  FP8_PYTEST_ARGS="--tb=short -k cuda" bash dev/gpu_fp8.sh 2>&1 | tail -12
ab=$(mktemp -d)
OUT=$ab AB_PASSES=forward_fp8 AB_ARGS_forward_fp8="--hdims 128 256 --seqlens 512 2048 8192 --peers= --target-s 0.1" \
  timeout 280 bash dev/ab.sh ../.snap_base 2>&1 | tail -30
tar -czf "${OUT:-gpu-results}/ab.tgz" -C "$ab" .
