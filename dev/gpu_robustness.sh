#!/usr/bin/env bash
# One GPU call for the robustness items (issues 28 and 34), each stage started only while the
# call's budget (ROBUST_LIMIT_S, default 560 s) leaves room for it:
#   1. the package built with CUDA (sm_90a) and installed; beside it, where ROBUST_GTESTS names
#      test binaries with gtest filters ("test_backward_cuda=CudaPositions.*
#      test_forward_cuda=*Dropout*"; ROBUST_GTESTS_MORE adds to it, by default the varlen and
#      paged forward cases), those built in build-gpu and run after it;
#   1b. upstream's test file on the ids in upstream/sample_ids.txt (dev/upstream_tests.sh; carry
#      upstream/), at most ROBUST_UPSTREAM_S seconds (default 150);
#   2. scripts/gpu_sweep.py without the sanitizer: ROBUST_FAST_CALLS calls (default 3000, seed 2),
#      the answers checked against float64;
#   3. scripts/gpu_sweep.py --huge (tensors past 2^31 elements);
#   3b. bench/forward_features.py --features varlen,paged (pages of 256, again with
#      FLASHATTN_CUDA_FORWARD=sm80, the kernel paged calls took before, then pages of 16),
#      unless ROBUST_BENCH=0;
#   4. the sweep under compute-sanitizer memcheck in chunks of ROBUST_CHUNK calls (default 250),
#      seeds 1, 2, 3, ... while time is left: every chunk that finishes counts.
# Results in $OUT (logs, the sweeps' JSON, upstream_failures.txt); a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
py=python3
out=${OUT:-gpu-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
limit=${ROBUST_LIMIT_S:-560}
start=$SECONDS
left() { echo $((limit - (SECONDS - start))); }
rows=()
row() { rows+=("$(printf '%-34s %-5s %5ss  %s' "$1" "$2" "$3" "$4")"); }

echo "== dev/gpu_robustness.sh $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || cat COMMIT 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

t=$SECONDS
read -r -a gtests <<<"${ROBUST_GTESTS:-} ${ROBUST_GTESTS_MORE-test_forward_cuda=*Varlen*:*Paged*}"
if [ ${#gtests[@]} -gt 0 ]; then
  (cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a &&
     cmake --build build-gpu --target "${gtests[@]%%=*}") >"$out/gtest_build.log" 2>&1 &
  gtest_build=$!
fi
"$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
  -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a . >"$out/pip.log" 2>&1
rc=$?
row "package (sm_90a)" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pip.log" | cut -c1-60)"
if [ ${#gtests[@]} -gt 0 ]; then
  wait "$gtest_build"
  brc=$?
  row "build ${gtests[*]%%=*}" "$([ $brc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
    "$(grep -ciE 'spill|serializ' "$out/gtest_build.log") spill/serialisation lines"
  [ $brc = 0 ] || tail -30 "$out/gtest_build.log"
  for g in "${gtests[@]}"; do
    [ $brc = 0 ] || break
    t=$SECONDS
    timeout 300 "build-gpu/tests/${g%%=*}" --gtest_filter="${g#*=}" >"$out/gtest_${g%%=*}.log" 2>&1
    rc2=$?
    row "${g%%=*} ${g#*=}" "$([ $rc2 = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
      "$(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_${g%%=*}.log" | tr '\n' ' ' | cut -c1-70)"
    [ $rc2 = 0 ] || grep -E 'Failure|error|FAILED' "$out/gtest_${g%%=*}.log" | head -20
  done
fi
if [ $rc != 0 ]; then tail -30 "$out/pip.log"; printf '%s\n' "${rows[@]}"; exit 1; fi

# ROBUST_EXTRA: a command run here (after the builds), at most ROBUST_EXTRA_S seconds (default
# 200), its output in $OUT/extra.log and its last lines printed.
if [ -n "${ROBUST_EXTRA:-}" ]; then
  t=$SECONDS
  OUT="$out" timeout "${ROBUST_EXTRA_S:-200}" bash -c "$ROBUST_EXTRA" >"$out/extra.log" 2>&1
  xrc=$?
  row "extra" "$([ $xrc = 0 ] && echo ok || echo "rc$xrc")" $((SECONDS - t)) "${ROBUST_EXTRA:0:60}"
  tail -25 "$out/extra.log"
fi

if [ -f upstream/sample_ids.txt ] && [ "${ROBUST_UPSTREAM_S:-150}" -gt 0 ] && [ "$(left)" -gt 120 ]; then
  t=$SECONDS
  UPSTREAM_IDS=upstream/sample_ids.txt OUT="$out/upstream" timeout "${ROBUST_UPSTREAM_S:-150}" \
    bash dev/upstream_tests.sh run 0 0 >"$out/upstream.log" 2>&1
  rc=$?
  row "upstream sample" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
    "$(grep -E 'passed|failed' "$out/upstream.log" | tail -1 | cut -c1-80)"
fi


if [ "$(left)" -gt 120 ]; then
  t=$SECONDS
  timeout $(($(left) - 60)) "$py" scripts/gpu_sweep.py --device cuda --calls "${ROBUST_FAST_CALLS:-3000}" \
    --seed 2 --out "$out/sweep_fast" >"$out/sweep_fast.log" 2>&1
  rc=$?
  row "sweep, no sanitizer (seed 2)" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
    "$(grep '^outcome' "$out/sweep_fast.log" | cut -c10-110)"
fi

if [ "$(left)" -gt 150 ]; then
  t=$SECONDS
  timeout 240 "$py" scripts/gpu_sweep.py --device cuda --huge --seed 1 --out "$out/sweep_huge" \
    >"$out/sweep_huge.log" 2>&1
  rc=$?
  row "sweep --huge" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
    "$(grep '^outcome' "$out/sweep_huge.log" | cut -c10-110)"
fi


if [ "${ROBUST_BENCH:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
  for run in "paged256 --features varlen,paged" "sm80_paged256 --features paged" \
             "paged16 --features paged --page-size 16"; do
    [ "$(left)" -gt 100 ] || break
    read -r name bench_args <<<"$run"
    t=$SECONDS
    # shellcheck disable=SC2086  # the arguments word by word
    env $([ "${name#sm80}" != "$name" ] && echo FLASHATTN_CUDA_FORWARD=sm80) timeout 80 \
      "$py" bench/forward_features.py $bench_args --out "$out/bench_$name" >"$out/bench_$name.log" 2>&1
    brc=$?
    row "forward_features $name" "$([ $brc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
      "$(grep -E '^\| varlen' "$out/bench_$name.log" | awk -F'|' '{printf "%s;", $3}' | cut -c1-60)"
    grep -E '^\| varlen' "$out/bench_$name.log" | cut -c1-160
  done
fi

chunk=${ROBUST_CHUNK:-250}
seed=1
while [ "$(left)" -gt 45 ]; do
  t=$SECONDS
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $(($(left) - 10)) compute-sanitizer --tool memcheck \
    --error-exitcode 99 "$py" scripts/gpu_sweep.py --device cuda --calls "$chunk" --seed "$seed" \
    --out "$out/memcheck_$seed" >"$out/memcheck_$seed.log" 2>&1
  rc=$?
  row "memcheck sweep seed $seed ($chunk)" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) \
    "$(grep -hE 'ERROR SUMMARY' "$out/memcheck_$seed.log" | tail -1 | sed 's/^=* *//') $(grep '^outcome' "$out/memcheck_$seed.log" | cut -c10-60)"
  [ $rc = 0 ] || break
  seed=$((seed + 1))
done

tail -5 "$out/upstream/upstream_failures.txt" 2>/dev/null
grep -E '^(FAIL|finding)' "$out"/sweep_*.log "$out"/memcheck_*.log 2>/dev/null | head -20
printf '%s\n' "${rows[@]}"
