#!/usr/bin/env python3
"""The table of a dev/ab.sh run over bench/harness.py benchmarks: ours' eager TFLOP/s per shape
for every tree and round, and each tree's ratio to the base (means of its two rounds).

  dev/ab_harness_table.py AB_DIR [PASS ...]
      AB_DIR holds trees.txt (tree names, base first) and <pass>_<tree>_<round>/<pass>.json;
      PASS defaults to every pass found there.
"""
from __future__ import annotations

import json
import pathlib
import sys


def label(row: dict) -> str:
    if row.get("label"):
        return row["label"]
    return f"d{row['hdim']} {'causal' if row['causal'] else 'full'} {row['seqlen']}"


def eager_tflops(row: dict) -> float | None:
    t = (row.get("results", {}).get("ours") or {}).get("eager")
    return None if t is None else t.get("tflops")


def main() -> int:
    ab = pathlib.Path(sys.argv[1])
    trees = ab.joinpath("trees.txt").read_text().split()
    passes = sys.argv[2:] or sorted({p.name.rsplit("_", 2)[0] for p in ab.iterdir()
                                     if p.is_dir() and p.name.endswith(("_1", "_2"))})
    for name in passes:
        table: dict[str, dict[str, list[float]]] = {}
        for tree in trees:
            for round_ in (1, 2):
                path = ab / f"{name}_{tree}_{round_}" / f"{name}.json"
                if not path.exists():
                    continue
                for row in json.loads(path.read_text())["rows"]:
                    value = eager_tflops(row)
                    if value is not None:
                        table.setdefault(label(row), {}).setdefault(tree, []).append(value)
        print(f"== {name}: eager TFLOP/s per round, and mean / base mean")
        print(f"{'shape':<34}" + "".join(f"{t:>24}" for t in trees))
        for shape, by_tree in table.items():
            base = by_tree.get(trees[0])
            cells = []
            for tree in trees:
                values = by_tree.get(tree, [])
                text = " / ".join(f"{v:.0f}" for v in values)
                if base and values and tree != trees[0]:
                    text += f" ({sum(values) / len(values) / (sum(base) / len(base)):.3f})"
                cells.append(f"{text:>24}")
            print(f"{shape:<34}" + "".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
