#!/usr/bin/env bash
# The C ABI's libFuzzer targets (fuzz/), CPU backend, under AddressSanitizer and
# UndefinedBehaviorSanitizer: builds them with clang (installed, with its fuzzer runtime, when
# missing) and runs each from its seed corpus fuzz/corpus/NAME (the inputs it finds go to
# build-fuzz/corpus/NAME, not into the repository). A crash, a sanitizer report, a leak or a
# failed check stops the run, with the input saved as build-fuzz/crash-* (replay:
# build-fuzz/fuzz/fuzz_NAME build-fuzz/crash-...).
#
#   bash scripts/fuzz.sh                    # CI: FUZZ_RUNS (default 20000) inputs from a fixed
#                                           # seed, the same ones on every run
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh   # 10 minutes each, a new random seed
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
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DFLASHATTN_CUDA=OFF -DFLASHATTN_BUILD_TESTS=OFF -DFLASHATTN_BUILD_BENCH=OFF -DFLASHATTN_BUILD_TOOLS=OFF \
  -DFLASHATTN_BUILD_FUZZ=ON -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build build-fuzz -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
for target in build-fuzz/fuzz/fuzz_*; do
  name=${target##*/fuzz_}
  mkdir -p "build-fuzz/corpus/$name"
  if [ -n "${FUZZ_SECONDS:-}" ]; then
    budget=(-max_total_time="$FUZZ_SECONDS")
    echo "== fuzz_$name: $FUZZ_SECONDS s"
  else
    budget=(-seed=1 -runs="${FUZZ_RUNS:-20000}")
    echo "== fuzz_$name: ${FUZZ_RUNS:-20000} inputs from seed 1"
  fi
  log="build-fuzz/fuzz_$name.log"
  status=0
  FUZZ_STATS=1 "$target" "${budget[@]}" -max_len=512 -timeout=20 -rss_limit_mb=4096 \
    -artifact_prefix=build-fuzz/ -print_final_stats=1 "build-fuzz/corpus/$name" "fuzz/corpus/$name" >"$log" 2>&1 ||
    status=$?
  grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss|fuzz_$name: .* accepted)" "$log" || true
  [ "$status" -eq 0 ] || { tail -40 "$log"; echo "fuzz.sh: fuzz_$name failed (input saved under build-fuzz/)"; exit 1; }
done
echo "fuzz.sh: no finding"
