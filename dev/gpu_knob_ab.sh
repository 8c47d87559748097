#!/usr/bin/env bash
# Scratch: an A/B of a runtime knob in one build (KNOB=NAME, values KNOB_VALUES, default "0 1"):
# the package built with CUDA (kept where it is already built: KNOB_BUILD=0), the GPU forward
# tests under the last value (KNOB_TEST_S=0: not; KNOB_PYTEST: other pytest arguments as a
# shell word list, absolute paths), then bench/$KNOB_BENCH.py (default forward;
# KNOB_BENCH_ARGS) under each value in two alternating rounds, ours only; the table by
# dev/ab_harness_table.py (eager, then kernel time; KNOB_SYSTEMS, default ours). Results in
# $OUT/knob_<KNOB_BENCH>.tgz.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
bench=${KNOB_BENCH:-forward}
out=${OUT:-gpu-results}/ab_$bench; mkdir -p "$out"
knob=${KNOB:?KNOB=the environment variable to vary}
read -ra values <<<"${KNOB_VALUES:-0 1}"
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
t0=$SECONDS
[ -d .deps/wheels ] && python3 -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
[ "${KNOB_BUILD:-1}" = 0 ] || CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps --no-index --upgrade \
  --target build-ab/site -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON \
  -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"
export PYTHONPATH=$PWD/build-ab/site
pytest_args=("$PWD/tests/python/test_gpu.py" -k "forward or varlen or paged")
[ -z "${KNOB_PYTEST:-}" ] || eval "pytest_args=($KNOB_PYTEST)"  # (a shell word list: quotes hold)
[ "${KNOB_TEST_S:-90}" = 0 ] || (cd /tmp && env "$knob=${values[-1]}" timeout "${KNOB_TEST_S:-90}" python3 -m pytest -q \
  -p no:cacheprovider --tb=short "${pytest_args[@]}") >"$out/pytest.log" 2>&1
if [ "${KNOB_TEST_S:-90}" != 0 ]; then
  echo "pytest ($knob=${values[-1]}): $(tail -1 "$out/pytest.log")"
  grep -E "^(FAILED|E  )" "$out/pytest.log" | head -10
fi
printf '%s\n' "${values[@]/#/v}" >"$out/trees.txt"
for round in 1 2; do
  for v in "${values[@]}"; do
    # shellcheck disable=SC2086
    env "$knob=$v" timeout 120 python3 "bench/$bench.py" --out "$out/${bench}_v${v}_$round" --peers= \
      ${KNOB_BENCH_ARGS:---hdims 128 256 --seqlens 512 2048 16384 --target-s 0.05} >"$out/${bench}_v${v}_$round.log" 2>&1 ||
      echo "$bench $knob=$v round $round: status $?"
  done
done
echo "total: $((SECONDS - t0)) s"
python3 dev/ab_harness_table.py "$out" "$bench" --systems="${KNOB_SYSTEMS:-ours}"
python3 dev/ab_harness_table.py "$out" "$bench" --kernel --systems="${KNOB_SYSTEMS:-ours}"
tar czf "${OUT:-gpu-results}/knob_$bench.tgz" -C "$out" . && rm -rf "$out"
