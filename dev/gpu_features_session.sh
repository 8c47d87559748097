#!/usr/bin/env bash
# Scratch: two back-to-back device calls for the forward's feature work (varlen on the TMA
# kernel, softcap/ALiBi cost, a stage-count variant). Trees: build-snap-base (the base commit,
# `git archive`), this working tree, and optional variants (build-snap-*), all carried.
#   phase build: every tree's package (dev/ab.sh, no benchmarks) beside the CUDA forward and
#     backward suites; then the forward suite, the backward suite's BWD_FILTER cases (if set),
#     compute-sanitizer on the varlen tests (unless FEATURES_NO_SANITIZERS), and
#     bench/forward_features.py (FEATURES_CHECK: which features) with the peers on this tree's
#     package, and bench/backward.py once per ';'-separated argument list in FEATURES_BACKWARD_ARGS.
#   phase check: this tree alone (forward suite or its FWD_FILTER cases, sm80 varlen/softcap
#     cases unless FEATURES_SKIP_SM80, backward BWD_FILTER cases, forward_features with the peers).
#   phase ab: dev/ab.sh's alternating rounds (AB_PASSES/AB_ARGS as there) over the trees
#     (FEATURES_AB_TREES, default: the base and the variants); FEATURES_UPSTREAM=1 then runs
#     upstream's test file (dev/upstream_tests.sh, UPSTREAM_IDS) on this tree's package.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
export PATH="/usr/local/cuda/bin:$PATH" FLASHATTN_CUDA_ARCHS=sm_90a
out=${OUT:-gpu-results}; mkdir -p "$out"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
py=${PYTHON:-python3}
variants=(${FEATURES_VARIANTS:-})
case ${1:?usage: gpu_features_session.sh build|check|ab} in
build)
  [ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
  ( AB_PASSES=" " OUT="$out" bash dev/ab.sh build-snap-base "${variants[@]}" >"$out/ab_build.log" 2>&1; echo $? >"$out/ab_build.rc" ) &
  builds=$!
  { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
      -DFLASHATTN_BUILD_BENCH=OFF && cmake --build build-gpu -j 8 --target test_forward_cuda test_backward_cuda; } >"$out/build.log" 2>&1
  stamp "suite build: $? $(grep -c 'spilled' "$out/build.log") spill lines"
  grep -E "spilled|serialized" "$out/build.log" | grep sm90 | cut -c1-200 | head
  timeout 240 build-gpu/tests/test_forward_cuda --gtest_brief=1 >"$out/fwd_suite.log" 2>&1
  stamp "forward suite: $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/fwd_suite.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$out/fwd_suite.log" | head -12
  if [ -n "${BWD_FILTER:-}" ]; then
    timeout "${BWD_TIMEOUT:-150}" build-gpu/tests/test_backward_cuda --gtest_brief=1 --gtest_filter="$BWD_FILTER" >"$out/bwd.log" 2>&1
    stamp "backward suite ($BWD_FILTER): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/bwd.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED|Failure' "$out/bwd.log" | head -8
  fi
  [ -n "${FEATURES_NO_SANITIZERS:-}" ] || for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 99 build-gpu/tests/test_forward_cuda \
      --gtest_filter='Varlen.*:*FeatureGrid*sliding_softcap*' >"$out/san_varlen_$tool.log" 2>&1
    stamp "$tool varlen: $? $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/san_varlen_$tool.log" | tail -1)"
  done
  wait $builds
  stamp "packages: $(cat "$out/ab_build.rc")"; tail -4 "$out/ab_build.log"
  [ -n "${FEATURES_SKIP_BENCH:-}" ] && exit 0
  (cd bench && PYTHONPATH=../build-ab/site timeout 150 "$py" forward_features.py --out "$out/features" \
    ${FEATURES_CHECK:+--features "$FEATURES_CHECK"} >"$out/features.log" 2>&1)
  stamp "bench/forward_features.py: $?"
  tail -45 "$out/features.log"
  IFS=';' read -ra backward_runs <<<"${FEATURES_BACKWARD_ARGS:-}"  # e.g. "--softcap 30;--alibi"
  for i in "${!backward_runs[@]}"; do
    # shellcheck disable=SC2086  # a list of arguments
    (cd bench && PYTHONPATH=../build-ab/site timeout 150 "$py" backward.py --out "$out/backward_$i" \
      ${backward_runs[$i]} >"$out/backward_$i.log" 2>&1)
    stamp "bench/backward.py ${backward_runs[$i]}: $?"
    tail -8 "$out/backward_$i.log"
  done
  ;;
check)  # this tree alone: the package, the forward suite and the backward suite's BWD_FILTER cases, features
  [ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind >/dev/null 2>&1
  ( "$py" -m pip install --no-build-isolation --no-deps --no-index --upgrade --target build-ab/site \
      -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON . >"$out/pip.log" 2>&1; echo $? >"$out/pip.rc" ) &
  pip_pid=$!
  { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=sm_90a \
      -DFLASHATTN_BUILD_BENCH=OFF && cmake --build build-gpu -j 10 --target test_forward_cuda test_backward_cuda; } >"$out/build.log" 2>&1
  stamp "suites build: $? $(grep -c 'spilled' "$out/build.log") spill lines, $(grep -c 'sm9017forward_ws.*spilled\|spilled.*sm9017forward_ws' "$out/build.log") in the sm90 forward"
  timeout 200 build-gpu/tests/test_forward_cuda --gtest_brief=1 --gtest_filter="${FWD_FILTER:-*}" >"$out/fwd_suite.log" 2>&1
  stamp "forward suite (${FWD_FILTER:-all}): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/fwd_suite.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$out/fwd_suite.log" | head -12
  [ -n "${FEATURES_SKIP_SM80:-}" ] || FLASHATTN_CUDA_FORWARD=sm80 timeout 150 build-gpu/tests/test_forward_cuda --gtest_brief=1 --gtest_filter='Varlen.*:*FeatureGrid*softcap*' >"$out/fwd_sm80.log" 2>&1
  stamp "forward suite on sm80, varlen and softcap: $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/fwd_sm80.log" | tr '\n' ' ')"
  timeout "${BWD_TIMEOUT:-150}" build-gpu/tests/test_backward_cuda --gtest_brief=1 --gtest_filter="${BWD_FILTER:-*oftcap*:*Alibi*:*ALiBi*}" >"$out/bwd.log" 2>&1
  stamp "backward suite (${BWD_FILTER:-softcap/ALiBi}): $? $(grep -E '^\[  PASSED|^\[  FAILED' "$out/bwd.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' "$out/bwd.log" | head -8
  wait $pip_pid
  stamp "package: $(cat "$out/pip.rc")"
  (cd bench && PYTHONPATH=../build-ab/site timeout 120 "$py" forward_features.py --out "$out/features" \
    --features "${FEATURES_CHECK:-softcap,alibi,varlen}" >"$out/features.log" 2>&1)
  stamp "bench/forward_features.py: $?"
  tail -30 "$out/features.log"
  ;;
ab)
  trees=(${FEATURES_AB_TREES:-build-snap-base "${variants[@]}"})
  OUT="$out" timeout 560 bash dev/ab.sh "${trees[@]}" >"$out/ab.log" 2>&1
  stamp "dev/ab.sh: $?"
  "$py" dev/ab_harness_table.py "$out/ab" || tail -60 "$out/ab.log"
  if [ -n "${FEATURES_UPSTREAM:-}" ] && [ -d upstream ]; then  # upstream's test file, this tree's package
    PYTHONPATH="$PWD/build-ab/site" OUT="$out/upstream" timeout "${FEATURES_UPSTREAM_TIMEOUT:-150}" \
      bash dev/upstream_tests.sh run 0 0 >"$out/upstream.log" 2>&1
    stamp "upstream tests ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)): $? $(tail -1 "$out/upstream/upstream_pytest.log" 2>/dev/null)"
    head -8 "$out/upstream/upstream_failures.txt" 2>/dev/null
  fi
  ;;
esac
