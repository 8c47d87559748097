#!/usr/bin/env python3
"""Kernel durations from an Nsight Compute CSV, one line per profiled launch.

Reads what
  ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv ...
writes (other metrics, if collected, are printed too) and prints, per launch, the kernel's
name (shortened), its duration in microseconds and the other metrics. --every N --phase K
keeps launch IDs with ID % N == K (dev/gpu_stream_read.cu's profile mode launches every
schedule four times: --every 4 --phase 3 keeps the last of each); --last N keeps the last N.

  dev/ncu_durations.py FILE.csv [--every N --phase K] [--last N]
"""
from __future__ import annotations

import argparse
import csv
import sys

DURATION = "gpu__time_duration.sum"


def launches(path: str) -> list[tuple[int, str, dict[str, str]]]:
    """(launch ID, kernel name, {metric: value}) per profiled launch, in launch order."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]  # ncu's own log lines are shorter
    if not rows:
        return []
    header = rows[0]
    col = {name: header.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
    by_id: dict[int, tuple[str, dict[str, str]]] = {}
    for r in rows[1:]:
        launch = int(r[col["ID"]])
        name, metrics = by_id.setdefault(launch, (r[col["Kernel Name"]], {}))
        metrics[r[col["Metric Name"]]] = r[col["Metric Value"]]
    return [(launch, name, metrics) for launch, (name, metrics) in sorted(by_id.items())]


def short_name(name: str) -> str:
    """The kernel's name without `void`, namespaces of anonymous scope and its parameter list."""
    name = name.removeprefix("void ").replace("<unnamed>::", "")
    depth = 0
    for i, ch in enumerate(name):  # cut at the parameter list: the first '(' outside <...>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i]
    return name


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--phase", type=int, default=0)
    p.add_argument("--last", type=int, default=0)
    args = p.parse_args(argv)
    rows = [x for x in launches(args.csv) if x[0] % args.every == args.phase]
    if args.last:
        rows = rows[-args.last:]
    for _, name, metrics in rows:
        us = float(metrics.get(DURATION, "nan").replace(",", "")) / 1000.0
        others = " ".join(f"{k}={v}" for k, v in metrics.items() if k != DURATION)
        print(f"{us:9.1f} us  {short_name(name)[:70]:70s} {others}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
