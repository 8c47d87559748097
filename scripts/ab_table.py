#!/usr/bin/env python3
"""The table of an A/B run (scripts/gpu_pending.sh ab): ours' TFLOP/s per configuration for
the base, this build and any further variants, each measured in two alternating rounds (side
by side, they show the run-to-run spread), and each tree's ratio to the base (of the two
rounds' means).

  scripts/ab_table.py OUT_DIR
      reads OUT_DIR/trees.txt (the tree names, base first; "base" and "this" without it)
      and OUT_DIR/{fwd,bwd}_<tree>_{1,2}/results.json
"""
from __future__ import annotations

import json
import os
import sys

PASSES = (("fwd", "tflops", "forward"), ("bwd", "bwd_tflops", "backward"))
ROUNDS = (1, 2)


def read_round(path: str, key: str) -> dict:
    """(hdim, causal, seqlen) -> TFLOP/s of ours, from one results.json (missing: empty)."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["hdim"], r["causal"], r["seqlen"]): r[key]
            for r in rows if r.get("system") == "ours" and r.get(key)}


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
    for short, key, pass_name in PASSES:
        runs = {(name, r): read_round(os.path.join(out, f"{short}_{name}_{r}", "results.json"), key)
                for name in names for r in ROUNDS}
        configs = sorted(set().union(*(set(v) for v in runs.values())))
        for cfg in configs:
            values = {name: [runs[(name, r)].get(cfg) for r in ROUNDS] for name in names}
            cells = [f"{v:.1f}" if v else "-" for name in names for v in values[name]]
            base = mean(values[names[0]])
            for name in names[1:]:
                this = mean(values[name])
                cells.append(f"{this / base:.3f}" if base and this else "-")
            hdim, causal, seqlen = cfg
            print(f"| {pass_name} | {hdim} | {'yes' if causal else 'no'} | {seqlen} | "
                  + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
