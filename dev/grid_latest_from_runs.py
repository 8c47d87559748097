#!/usr/bin/env python3
"""docs/results/h200_grid_latest.json (the stable schema bench/grid.py writes) assembled from a
bench/forward.py and a bench/backward.py run of the same package on one card, for when the two
ran as separate calls instead of bench/grid.py:

    python3 dev/grid_latest_from_runs.py FORWARD_JSON BACKWARD_JSON > docs/results/h200_grid_latest.json

Every row takes the eager and kernel TFLOP/s of each system ("fwd", "fwd_kernel", "bwd",
"bwd_kernel"; null where a system has no time); "meta" is the forward run's, with the
backward run's command, date and commit beside it.
"""
import json
import sys


def rates(row, method):
    return {name: (r.get(method) or {}).get("tflops") for name, r in row["results"].items()}


def main(forward_path, backward_path):
    forward, backward = (json.load(open(p)) for p in (forward_path, backward_path))
    key = lambda r: (r["hdim"], r["causal"], r["seqlen"], r["batch"], r["heads"])
    backward_rows = {key(r): r for r in backward["rows"]}
    rows = []
    for f in forward["rows"]:
        b = backward_rows.get(key(f))
        rows.append({"hdim": f["hdim"], "causal": f["causal"], "seqlen": f["seqlen"], "batch": f["batch"],
                     "heads": f["heads"], "fwd": rates(f, "eager"), "bwd": rates(b, "eager") if b else None,
                     "fwd_kernel": rates(f, "kernel"), "bwd_kernel": rates(b, "kernel") if b else None})
    meta = dict(forward["meta"])
    meta["benchmark"] = "flashattn grid: forward and backward (Python path), from two runs"
    meta["backward"] = {k: backward["meta"].get(k) for k in ("benchmark", "date", "command", "commit")}
    json.dump({"meta": meta, "rows": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
