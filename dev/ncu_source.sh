#!/usr/bin/env bash
# Scratch: Nsight Compute's warp states and samples per SASS instruction on one launch of the
# kernels matching a regex (the second such launch: the first warms up), as four files beside
# REP: REP.ncu-rep, REP.txt (the details page), REP.csv (the source page), REP.stalls
# (dev/ncu_source_stalls.py's ranking); the collection's status is the exit status.
#   dev/ncu_source.sh REP KERNEL_REGEX TIMEOUT_S COMMAND...
# NCU_METRICS: also collect these metrics (comma-separated).
set -uo pipefail
rep=$1 regex=$2 limit=$3
shift 3
here=$(dirname "$0")
timeout "$limit" ncu --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 \
  ${NCU_METRICS:+--metrics "$NCU_METRICS"} --section WarpStateStats --section SourceCounters -f -o "$rep" "$@" \
  >"$rep.log" 2>&1
rc=$?
ncu --import "$rep.ncu-rep" --page details >"$rep.txt" 2>&1
ncu --import "$rep.ncu-rep" --page source --print-source sass --csv >"$rep.csv" 2>>"$rep.log"
python3 "$here/ncu_source_stalls.py" "$rep.csv" 50 >"$rep.stalls" 2>&1
exit $rc
