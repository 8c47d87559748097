#!/usr/bin/env python3
"""The table of an A/B run (scripts/gpu_pending.sh ab): ours' TFLOP/s per configuration for
the base and this build, each measured in two alternating rounds (side by side, they show the
run-to-run spread), and this / base, the ratio of the two rounds' means.

  scripts/ab_table.py OUT_DIR      (reads OUT_DIR/{fwd,bwd}_{base,this}_{1,2}/results.json)
"""
from __future__ import annotations

import json
import os
import sys

PASSES = (("fwd", "tflops", "forward"), ("bwd", "bwd_tflops", "backward"))


def read_round(path: str, key: str) -> dict:
    """(hdim, causal, seqlen) -> TFLOP/s of ours, from one results.json (missing: empty)."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["hdim"], r["causal"], r["seqlen"]): r[key]
            for r in rows if r.get("system") == "ours" and r.get(key)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = argv[0]
    print("| pass | hdim | causal | seqlen | base 1 | base 2 | this 1 | this 2 | this / base |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for short, key, name in PASSES:
        runs = {(who, r): read_round(os.path.join(out, f"{short}_{who}_{r}", "results.json"), key)
                for who in ("base", "this") for r in (1, 2)}
        configs = sorted(set().union(*(set(v) for v in runs.values())))
        for cfg in configs:
            values = [runs[(who, r)].get(cfg) for who in ("base", "this") for r in (1, 2)]
            cells = [f"{v:.1f}" if v else "-" for v in values]
            base = [v for v in values[:2] if v]
            this = [v for v in values[2:] if v]
            ratio = (f"{(sum(this) / len(this)) / (sum(base) / len(base)):.3f}"
                     if base and this else "-")
            hdim, causal, seqlen = cfg
            print(f"| {name} | {hdim} | {'yes' if causal else 'no'} | {seqlen} | "
                  + " | ".join(cells) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
