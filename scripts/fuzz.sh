#!/usr/bin/env bash
# The C ABI's libFuzzer targets (fuzz/), CPU backend, under AddressSanitizer and
# UndefinedBehaviorSanitizer: builds them with clang (installed, with its fuzzer runtime, when
# missing) and runs each from its seed corpus fuzz/corpus/NAME (the inputs it finds go to
# BUILD/corpus/NAME, not into the repository). A crash, a sanitizer report, a leak or a
# failed check stops the run, with the input saved as BUILD/crash-* (replay:
# BUILD/fuzz/fuzz_NAME BUILD/crash-...). BUILD is build-fuzz unless FUZZ_BUILD_DIR says.
# Targets: forward (fa_forward), backward (fa_backward after fa_forward), varlen
# (fa_forward_varlen and fa_forward_varlen_paged), kvcache (fa_forward_kvcache).
#
#   bash scripts/fuzz.sh                    # CI: a fixed number of inputs per target from a
#                                           # fixed seed, the same ones on every run (about 5
#                                           # minutes in all on 2 cores); FUZZ_RUNS=N: N each
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh   # 10 minutes each, a new random seed
#   FUZZ_TARGETS="backward varlen" ...      # only these targets
#   FUZZ_JOBS=1 ...                         # build jobs (default: every core)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
if ! command -v clang++ >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "fuzz.sh: installing clang and its fuzzer runtime"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-dev >/dev/null
fi
source scripts/env.sh
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
build=${FUZZ_BUILD_DIR:-build-fuzz}
jobs=${FUZZ_JOBS:-$jobs}
# CI's inputs per target, each from seed 1: about 5 minutes in all on the 2-core CI VM. The
# targets' speeds differ: fuzz_forward draws larger shapes, fuzz_backward runs a forward, a
# backward and the reference backward, and the CPU engine's larger tiles (2026-12-06) made
# both slower under the sanitizers (20000 forward inputs took 229-304 s, 10000 backward ones
# 58-284 s; varlen 24-41 s, kvcache 40-58 s), so CI gives those two fewer inputs: the
# 10-minute runs (FUZZ_SECONDS=600) are what explores.
declare -A ci_runs=([forward]=8000 [backward]=4000 [varlen]=25000 [kvcache]=25000)
# shellcheck disable=SC2206  # FUZZ_TARGETS is a list of words
targets=(${FUZZ_TARGETS:-forward backward varlen kvcache})
for name in "${targets[@]}"; do
  [ -n "${ci_runs[$name]:-}" ] || { echo "fuzz.sh: no target '$name' (forward backward varlen kvcache)"; exit 2; }
done
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DFLASHATTN_CUDA=OFF -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TOOLS=OFF \
  -DFLASHATTN_BUILD_FUZZ=ON -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build "$build" -j "$jobs" --target "${targets[@]/#/fuzz_}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
for name in "${targets[@]}"; do
  target="$build/fuzz/fuzz_$name"
  mkdir -p "$build/corpus/$name"
  if [ -n "${FUZZ_SECONDS:-}" ]; then
    budget=(-max_total_time="$FUZZ_SECONDS")
    echo "== fuzz_$name: $FUZZ_SECONDS s"
  else
    runs=${FUZZ_RUNS:-${ci_runs[$name]}}
    budget=(-seed=1 -runs="$runs")
    echo "== fuzz_$name: $runs inputs from seed 1"
  fi
  log="$build/fuzz_$name.log"
  status=0
  start=$SECONDS
  FUZZ_STATS=1 "$target" "${budget[@]}" -max_len=512 -timeout=20 -rss_limit_mb=4096 \
    -artifact_prefix="$build/" -print_final_stats=1 "$build/corpus/$name" "fuzz/corpus/$name" >"$log" 2>&1 ||
    status=$?
  grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss|fuzz_$name: .* accepted)" "$log" || true
  echo "fuzz_$name: $((SECONDS - start)) s"
  [ "$status" -eq 0 ] || { tail -40 "$log"; echo "fuzz.sh: fuzz_$name failed (input saved under $build/)"; exit 1; }
done
echo "fuzz.sh: no finding"
