#!/usr/bin/env bash
# Scratch: an A/B of a runtime knob in one build (KNOB=NAME, values KNOB_VALUES, default "0 1"):
# the package built with CUDA, the GPU forward tests under the last value, then
# bench/forward.py (KNOB_BENCH_ARGS) under each value in two alternating rounds, ours only;
# the table by dev/ab_harness_table.py (eager, then kernel time).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
out=${OUT:-gpu-results}/ab; mkdir -p "$out"
knob=${KNOB:?KNOB=the environment variable to vary}
read -ra values <<<"${KNOB_VALUES:-0 1}"
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
t0=$SECONDS
[ -d .deps/wheels ] && python3 -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps --no-index --upgrade \
  --target build-ab/site -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON \
  -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"
export PYTHONPATH=$PWD/build-ab/site
(cd /tmp && env "$knob=${values[-1]}" timeout "${KNOB_TEST_S:-90}" python3 -m pytest -q -x -p no:cacheprovider --tb=short \
  "$OLDPWD/tests/python/test_gpu.py" -k "forward or varlen or paged") >"$out/pytest.log" 2>&1
echo "pytest ($knob=${values[-1]}): rc $? $(tail -1 "$out/pytest.log")"
grep -E "^(FAILED|E  )" "$out/pytest.log" | head -10
printf '%s\n' "${values[@]/#/v}" >"$out/trees.txt"
for round in 1 2; do
  for v in "${values[@]}"; do
    # shellcheck disable=SC2086
    env "$knob=$v" timeout 120 python3 bench/forward.py --out "$out/forward_v${v}_$round" --peers= \
      ${KNOB_BENCH_ARGS:---hdims 128 256 --seqlens 512 2048 16384 --target-s 0.05} >"$out/forward_v${v}_$round.log" 2>&1 ||
      echo "forward $knob=$v round $round: status $?"
  done
done
echo "total: $((SECONDS - t0)) s"
python3 dev/ab_harness_table.py "$out" forward
python3 dev/ab_harness_table.py "$out" forward --kernel
tar czf "${OUT:-gpu-results}/knob_ab.tgz" -C "$out" . && rm -rf "$out"
