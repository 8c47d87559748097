#!/usr/bin/env bash
# Scratch: one GPU call for the TMA forward's clusters of two (K and V by TMA multicast,
# forward_ws_kernel.cuh), each stage started while the call's budget (CL_LIMIT_S, default
# 560 s) leaves room for it:
#   1. the package built for sm_90a with the C++ tests configured (ptxas: spills, serialised
#      wgmmas in any sm90 forward kernel);
#   2. test_forward_cuda's cluster, persistent-grid and feature cases, and the knob's error
#      case (CL_GTEST_FILTER), then the GPU file's forward cases (tests/python/test_gpu.py -k
#      forward); CL_TESTS=0: not;
#   3. compute-sanitizer memcheck, racecheck and synccheck on the cluster case
#      (CL_SANITIZE=0: not);
#   4. bench/forward.py at CL_BENCH_ARGS (default head dims 128 and 256 without a mask, with
#      cuDNN and FA2) with FLASHATTN_SM90_FORWARD_CLUSTER=1 and =2 in CL_ROUNDS (default 2)
#      alternating rounds; a table of ours per round and of the peers at the end.
# Results in $OUT (packed in one archive); a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
py=python3
out=${OUT:-gpu-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
limit=${CL_LIMIT_S:-560}
start=$SECONDS
left() { echo $((limit - (SECONDS - start))); }
rows=()
row() { rows+=("$(printf '%-34s %-5s %5ss  %s' "$1" "$2" "$3" "$4")"); }
finish() {
  (cd "$out" && tar czf gpu_cluster_results.tgz --exclude=gpu_cluster_results.tgz . 2>/dev/null)
  echo "== summary ($(( SECONDS - start )) s)"
  printf '%s\n' "${rows[@]}"
}
trap finish EXIT
echo "== dev/gpu_cluster.sh $(date -u '+%Y-%m-%d %H:%M UTC') $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -d .deps/wheels ] && "$py" -m pip install --no-index --find-links .deps/wheels -q scikit-build-core nanobind einops >/dev/null 2>&1
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

t=$SECONDS
"$py" -m pip install --no-build-isolation --no-deps --no-index -v -C build-dir=build-py/gpu \
  -C cmake.define.FLASHATTN_CUDA=ON -C cmake.define.FLASHATTN_CUDA_ARCHS=sm_90a \
  -C cmake.define.FLASHATTN_BUILD_TESTS=ON . >"$out/pip.log" 2>&1
rc=$?
row "package (sm_90a)" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
  "$(grep -c 'serializ' "$out/pip.log") serialisation lines, $(grep -E 'sm90.*forward.*spill|forward_ws.*spill' "$out/pip.log" | grep -vc ' 0 bytes spill') forward spill lines"
[ $rc = 0 ] || { tail -30 "$out/pip.log"; exit 1; }

if [ "${CL_TESTS:-1}" = 1 ]; then
  t=$SECONDS
  cmake --build build-py/gpu --target test_forward_cuda test_backward_cuda >"$out/gtest_build.log" 2>&1
  rc=$?
  row "gtest build" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) ""
  if [ $rc = 0 ]; then
    t=$SECONDS
    timeout 200 build-py/gpu/tests/test_forward_cuda \
      --gtest_filter="${CL_GTEST_FILTER:-EdgeCases.*:FeatureGrid*:LongSequences*:Dropout.*:HeadDims*}" >"$out/gtest_forward.log" 2>&1
    rc=$?
    row "test_forward_cuda" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
      "$(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_forward.log" | tr '\n' ' ' | cut -c1-70)"
    [ $rc = 0 ] || grep -E 'Failure|FAILED|Expected|Which is|error' "$out/gtest_forward.log" | head -30
    t=$SECONDS
    timeout 60 build-py/gpu/tests/test_backward_cuda --gtest_filter='CudaBackwardErrors.*' >"$out/gtest_errors.log" 2>&1
    rc=$?
    row "CudaBackwardErrors.*" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) \
      "$(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_errors.log" | tr '\n' ' ' | cut -c1-70)"
  fi
  t=$SECONDS
  (cd tests/python && timeout 150 "$py" -m pytest -q -x -p no:cacheprovider test_gpu.py -k forward) >"$out/pytest_forward.log" 2>&1
  rc=$?
  row "pytest test_gpu.py -k forward" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t)) "$(tail -1 "$out/pytest_forward.log" | cut -c1-60)"
fi

if [ "${CL_SANITIZE:-1}" = 1 ] && [ -x build-py/gpu/tests/test_forward_cuda ]; then
  for tool in memcheck racecheck synccheck; do
    [ "$(left)" -gt 120 ] || break
    t=$SECONDS
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 build-py/gpu/tests/test_forward_cuda \
      --gtest_filter='EdgeCases.ClustersOfTwo*' >"$out/sanitize_$tool.log" 2>&1
    rc=$?
    row "compute-sanitizer $tool" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) \
      "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$out/sanitize_$tool.log" | tail -1 | cut -c1-60)"
  done
fi

bench_args=${CL_BENCH_ARGS:---hdims 128 256 --causal no --peers cudnn,fa2 --target-s 0.25}
for round in $(seq 1 "${CL_ROUNDS:-2}"); do
  for ctas in 1 2; do
    [ "$(left)" -gt 70 ] || break 2
    t=$SECONDS
    # shellcheck disable=SC2086  # a list of arguments
    FLASHATTN_SM90_FORWARD_CLUSTER=$ctas timeout $(( $(left) - 10 )) "$py" bench/forward.py \
      --out "$out/bench_c${ctas}_r$round" $bench_args >"$out/bench_c${ctas}_r$round.log" 2>&1
    rc=$?
    row "forward.py cluster=$ctas round $round" "$([ $rc = 0 ] && echo ok || echo "rc$rc")" $((SECONDS - t)) ""
  done
done
"$py" - "$out" <<'PY' | tee "$out/ab_table.txt"
# Eager TFLOP/s per point: ours in each run, then each peer's range over the runs.
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = sorted(out.glob("bench_c*_r*/forward.json"), key=lambda p: p.parent.name[-1] + p.parent.name)
if not runs:
    sys.exit()
table = {}
for path in runs:
    for row in json.loads(path.read_text())["rows"]:
        key = (row["hdim"], "causal" if row["causal"] else "full", row["seqlen"])
        for system, result in row["results"].items():
            tflops = (result.get("eager") or {}).get("tflops")
            table.setdefault(key, {}).setdefault(system, []).append((path.parent.name, tflops))
print("== eager TFLOP/s: ours per run (" + ", ".join(p.parent.name for p in runs) + "); peers min-max")
for key, systems in sorted(table.items()):
    ours = " ".join(f"{t:.0f}" if t else "-" for _, t in systems.get("ours", []))
    c1 = [t for name, t in systems.get("ours", []) if name.startswith("bench_c1") and t]
    c2 = [t for name, t in systems.get("ours", []) if name.startswith("bench_c2") and t]
    ratio = f"{(sum(c2) / len(c2)) / (sum(c1) / len(c1)):.3f}" if c1 and c2 else "-"
    peers = "  ".join(f"{s} {min(v):.0f}-{max(v):.0f}" for s, l in systems.items() if s != "ours"
                      for v in [[t for _, t in l if t]] if v)
    print(f"{key[0]:>3} {key[1]:6} {key[2]:>5}  ours {ours}  c2/c1 {ratio}  {peers}")
PY
