#!/usr/bin/env python3
"""The table of a dev/ab.sh run over bench/harness.py benchmarks: ours' TFLOP/s per shape
for every tree and round, and each tree's ratio to the base (means of its two rounds).

  dev/ab_harness_table.py AB_DIR [PASS ...] [--kernel] [--systems=ours,ours_bf16,...]
      AB_DIR holds trees.txt (tree names, base first) and <pass>_<tree>_<round>/<pass>.json;
      PASS defaults to every pass found there. --kernel: kernel time (CUDA-graph replay)
      instead of eager calls; --systems: the benchmark's systems to show (default ours; e.g.
      forward_fp8's ours_bf16 beside its FP8 call).
"""
from __future__ import annotations

import json
import pathlib
import sys


def label(row: dict) -> str:
    if row.get("label"):
        return row["label"]
    return f"d{row['hdim']} {'causal' if row['causal'] else 'full'} {row['seqlen']}"


def tflops(row: dict, system: str, metric: str) -> float | None:
    t = (row.get("results", {}).get(system) or {}).get(metric)
    return None if t is None else t.get("tflops")


def main() -> int:
    args = sys.argv[1:]
    metric, systems = "eager", ["ours"]
    for flag in [a for a in args if a.startswith("--")]:
        args.remove(flag)
        if flag == "--kernel":
            metric = "kernel"
        elif flag.startswith("--systems="):
            systems = flag.split("=", 1)[1].split(",")
        else:
            print(__doc__)
            return 2
    ab = pathlib.Path(args[0])
    trees = ab.joinpath("trees.txt").read_text().split()
    # A run's folder is <pass>_<tree>_<round>; tree names may hold underscores themselves.
    found = set()
    for p in ab.iterdir():
        for tree in trees:
            for round_ in (1, 2):
                if p.is_dir() and p.name.endswith(f"_{tree}_{round_}"):
                    found.add(p.name[: -len(f"_{tree}_{round_}")])
    passes = args[1:] or sorted(found)
    for name in passes:
        table: dict[str, dict[str, list[float]]] = {}
        for tree in trees:
            for round_ in (1, 2):
                path = ab / f"{name}_{tree}_{round_}" / f"{name}.json"
                if not path.exists():
                    continue
                for row in json.loads(path.read_text())["rows"]:
                    for system in systems:
                        value = tflops(row, system, metric)
                        if value is not None:
                            key = label(row) if systems == ["ours"] else f"{system} {label(row)}"
                            table.setdefault(key, {}).setdefault(tree, []).append(value)
        print(f"== {name}: {metric} TFLOP/s per round, and mean / base mean")
        print(f"{'shape':<40}" + "".join(f"{t:>24}" for t in trees))
        for shape, by_tree in table.items():
            base = by_tree.get(trees[0])
            cells = []
            for tree in trees:
                values = by_tree.get(tree, [])
                text = " / ".join(f"{v:.0f}" for v in values)
                if base and values and tree != trees[0]:
                    text += f" ({sum(values) / len(values) / (sum(base) / len(base)):.3f})"
                cells.append(f"{text:>24}")
            print(f"{shape:<40}" + "".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
