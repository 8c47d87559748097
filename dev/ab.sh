#!/usr/bin/env bash
# A/B on the GPU: this tree's speed against a base snapshot (and any further variants), ours
# only, through the Python package of each tree. Snapshots come from dev/device_snapshot.sh
# (`dev/device_snapshot.sh main .snap_base`, carried to the GPU machine); every tree's package
# is built at once into its own build-ab/site, then the benchmarks of THIS tree (one harness for
# all) run in two rounds that alternate base, this, the variants, with the SM clock and power
# sampled every 50 ms alongside (for dev/clock_windows.py):
#   dev/ab.sh BASE_DIR [VARIANT_DIR ...]
# AB_PASSES: the benchmarks (default "forward backward"; also decode); AB_ARGS: extra arguments
# of each (e.g. --quick), AB_ARGS_<pass>: of that one (e.g. AB_ARGS_backward="--softcap 30"). Results in $OUT/<pass>_<tree>_<round>/ and a table per run at the end.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
base=${1:?usage: dev/ab.sh BASE_DIR [VARIANT_DIR ...]}
shift
out=${OUT:-gpu-results}/ab
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH" PYTHONUNBUFFERED=1
trees=("$base" . "$@")
names=(base this)
for extra in "$@"; do names+=("$(basename "$extra" | tr -dc 'A-Za-z0-9_')"); done
printf '%s\n' "${names[@]}" >"$out/trees.txt"

# Runs the arguments while the SM clock and power (and the reasons the clock is held down,
# where the driver reports them) are sampled every 50 ms into $1.
with_clock_log() {  # LOG COMMAND...
  local log=$1 fields=timestamp,clocks.sm,power.draw
  shift
  nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv,noheader >/dev/null 2>&1 &&
    fields+=,clocks_event_reasons.active
  nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -lms 50 >"$log" 2>/dev/null &
  local sampler=$!
  "$@"
  local status=$?
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  return $status
}

export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / ${#trees[@]} > 0 ? $(nproc) / ${#trees[@]} : 1 ))
pids=()
for i in "${!trees[@]}"; do
  (cd "${trees[$i]}" && "${PYTHON:-python3}" -m pip install --no-build-isolation --no-deps --no-index \
    --upgrade --target build-ab/site -C build-dir=build-ab/py -C cmake.define.FLASHATTN_CUDA=ON .) \
    >"$out/build_${names[$i]}.log" 2>&1 &
  pids+=($!)
done
for i in "${!trees[@]}"; do
  wait "${pids[$i]}" || { tail -20 "$out/build_${names[$i]}.log"; exit 1; }
  echo "${names[$i]}: $(cat "${trees[$i]}/COMMIT" 2>/dev/null || echo "${trees[$i]}")"
done
for round in 1 2; do
  for i in "${!trees[@]}"; do
    site=$(cd "${trees[$i]}" && pwd)/build-ab/site
    for pass in ${AB_PASSES:-forward backward}; do
      run=${pass}_${names[$i]}_$round
      pass_args=AB_ARGS_$pass
      # shellcheck disable=SC2086  # AB_ARGS are lists of arguments
      with_clock_log "$out/clocks_$run.csv" env PYTHONPATH="$site" timeout 150 "${PYTHON:-python3}" "bench/$pass.py" \
        --out "$out/$run" ${AB_ARGS:-} ${!pass_args:-} >"$out/$run.log" 2>&1 || echo "$run: status $?"
    done
  done
done
for table in "$out"/*_[12]/*.md; do echo "== ${table#"$out"/}"; head -30 "$table"; done
