#!/usr/bin/env python3
"""The GPU's SM clock and power while each benchmark measurement ran.

A kernel that issues more instructions for the same work can draw more power and so run at a
lower clock under the card's power limit, which a profiler (clocks locked) does not show. This
joins a log sampled during a benchmark run with the timed windows in the benchmark's
results.json (`timed_window`, wall-clock seconds) and prints, per configuration and system,
the mean SM clock and power draw over that window.

The log is what
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits -lms 100
writes (scripts/gpu_pending.sh starts it around its benchmarks).

  scripts/clock_windows.py LOG RESULTS_JSON [RESULTS_JSON ...]
"""
from __future__ import annotations

import datetime
import json
import sys


def read_samples(path: str) -> list[tuple[float, float, float]]:
    """(unix time, SM MHz, watts) per line; lines that do not parse are skipped."""
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 3:
                continue
            try:
                # nvidia-smi prints the host's local time; a naive datetime's timestamp() reads it so.
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((stamp, float(parts[1]), float(parts[2])))
            except ValueError:
                continue
    return samples


def window_means(samples, start: float, end: float):
    """Mean (MHz, W) of the samples inside [start, end], or None when there are none."""
    inside = [(mhz, watts) for t, mhz, watts in samples if start <= t <= end]
    if not inside:
        return None
    return (sum(m for m, _ in inside) / len(inside), sum(w for _, w in inside) / len(inside),
            len(inside))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    samples = read_samples(argv[0])
    print(f"{len(samples)} samples from {argv[0]}")
    print("| results | hdim | causal | seqlen | system | SM MHz | W | samples |")
    print("|---|---:|---|---:|---|---:|---:|---:|")
    for path in argv[1:]:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for row in rows:
            window = row.get("timed_window")
            if not window:
                continue
            means = window_means(samples, window[0], window[1])
            if means is None:
                continue
            print(f"| {path} | {row['hdim']} | {'yes' if row['causal'] else 'no'} | {row['seqlen']} "
                  f"| {row['system']} | {means[0]:.0f} | {means[1]:.0f} | {means[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
