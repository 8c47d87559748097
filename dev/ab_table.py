#!/usr/bin/env python3
"""The table of an A/B run: ours' speed per configuration for the base, this build and any
further variants, each measured in two alternating rounds (side by side, they show the
run-to-run spread), and each tree's ratio to the base (of the two rounds' means). Forward and
backward rows are TFLOP/s; decode rows (dense and paged caches) are TB/s of K and V read, with
the batch in the causal column. It reads the results.json rows that the benchmarks wrote before
bench/harness.py (system, hdim, causal, seqlen and tflops, bwd_tflops or tbps) under the
directory names of the old A/B stage; dev/ab.sh's runs (forward_<tree>_<round>, ...) need it
adapted to the harness's JSON first.

  dev/ab_table.py OUT_DIR
      reads OUT_DIR/trees.txt (the tree names, base first; "base" and "this" without it)
      and OUT_DIR/{fwd,bwd,dec}_<tree>_{1,2}/results.json
"""
from __future__ import annotations

import json
import os
import sys

# (directory prefix, metric, digits shown, our systems and the row label each gets)
PASSES = (("fwd", "tflops", 1, {"ours": "forward"}),
          ("bwd", "bwd_tflops", 1, {"ours": "backward"}),
          ("dec", "tbps", 2, {"ours": "decode", "ours-paged": "decode paged"}))
ROUNDS = (1, 2)


def config_of(row: dict) -> tuple:
    """A row's sort key (hdim, causal or batch, seqlen) and its middle cell: decode rows have
    a batch and no mask."""
    if "causal" in row:
        return (row["hdim"], int(row["causal"]), row["seqlen"]), "yes" if row["causal"] else "no"
    return (row["hdim"], row["batch"], row["seqlen"]), f"batch {row['batch']}"


def read_round(path: str, metric: str, systems: dict) -> dict:
    """(label, sort key) -> (middle cell, value) for our systems' rows of one results.json
    (missing: empty)."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    found = {}
    for r in rows:
        if r.get("system") in systems and r.get(metric):
            key, middle = config_of(r)
            found[(systems[r["system"]], key)] = (middle, r[metric])
    return found


def tree_names(out: str) -> list[str]:
    try:
        with open(os.path.join(out, "trees.txt")) as f:
            names = [line.strip() for line in f if line.strip()]
    except OSError:
        names = []
    return names or ["base", "this"]


def mean(values: list) -> float | None:
    present = [v for v in values if v]
    return sum(present) / len(present) if present else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = argv[0]
    names = tree_names(out)
    header = ["pass", "hdim", "causal", "seqlen"]
    header += [f"{name} {r}" for name in names for r in ROUNDS]
    header += [f"{name} / {names[0]}" for name in names[1:]]
    print("| " + " | ".join(header) + " |")
    print("|---|---:|---|---:|" + "---:|" * (len(header) - 4))
    for short, metric, digits, systems in PASSES:
        runs = {(name, r): read_round(os.path.join(out, f"{short}_{name}_{r}", "results.json"),
                                      metric, systems)
                for name in names for r in ROUNDS}
        configs = sorted(set().union(*(set(v) for v in runs.values())),
                         key=lambda c: (list(systems.values()).index(c[0]), c[1]))
        for cfg in configs:
            middle = next(run[cfg][0] for run in runs.values() if cfg in run)
            values = {name: [runs[(name, r)].get(cfg, (None, None))[1] for r in ROUNDS] for name in names}
            cells = [f"{v:.{digits}f}" if v else "-" for name in names for v in values[name]]
            base = mean(values[names[0]])
            for name in names[1:]:
                this = mean(values[name])
                cells.append(f"{this / base:.3f}" if base and this else "-")
            label, (hdim, _, seqlen) = cfg
            print(f"| {label} | {hdim} | {middle} | {seqlen} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
