#!/usr/bin/env python3
"""The GPU's SM clock and power while each benchmark measurement ran.

A kernel that issues more instructions for the same work can draw more power and so run at a
lower clock under the card's power limit, which a profiler (clocks locked) does not show. This
joins a log sampled during a benchmark run with the timed windows in the benchmark's
results.json (`timed_windows`, the rounds of a system's timing, or `timed_window`; wall-clock
seconds) and prints, per configuration and system,
the mean SM clock and power draw over that window.

The log is what
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw[,clocks_event_reasons.active] \
    --format=csv,noheader,nounits -lms 50
writes (dev/ab.sh starts it around its benchmarks). With the fourth column (a
bit mask of why the clock is below its maximum), the table also gives the share of samples
held down by the software power cap (bit 0x4) and by anything else (thermal, hardware
slowdown: the other bits but idle, 0x1, and application clocks, 0x2).

  dev/clock_windows.py LOG RESULTS_JSON [RESULTS_JSON ...]
"""
from __future__ import annotations

import datetime
import json
import sys


POWER_CAP = 0x4           # clocks_event_reasons: software power cap
NOT_HELD = 0x1 | 0x2      # GPU idle, application clocks setting: the clock is not held down


def read_samples(path: str) -> list[tuple[float, float, float, int | None]]:
    """(unix time, SM MHz, watts, event-reason mask or None) per line; lines that do not
    parse are skipped."""
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 3:
                continue
            try:
                # nvidia-smi prints the host's local time; a naive datetime's timestamp() reads it so.
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                reasons = int(parts[3], 16) if len(parts) > 3 and parts[3].startswith("0x") else None
                samples.append((stamp, float(parts[1]), float(parts[2]), reasons))
            except ValueError:
                continue
    return samples


def window_means(samples, windows: list[list[float]]):
    """Over the samples inside any of the [start, end] windows: mean MHz, mean W, the count,
    and the shares held down by the power cap and by other reasons (None without the reasons
    column); or None when there are no samples."""
    inside = [s for s in samples if any(start <= s[0] <= end for start, end in windows)]
    if not inside:
        return None
    n = len(inside)
    masks = [s[3] for s in inside if s[3] is not None]
    capped = sum(1 for m in masks if m & POWER_CAP) / len(masks) if masks else None
    other = sum(1 for m in masks if m & ~(POWER_CAP | NOT_HELD)) / len(masks) if masks else None
    return (sum(s[1] for s in inside) / n, sum(s[2] for s in inside) / n, n, capped, other)


def share(value) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    samples = read_samples(argv[0])
    print(f"{len(samples)} samples from {argv[0]}")
    print("| results | hdim | causal | seqlen | system | SM MHz | W | samples | power-capped | other |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for path in argv[1:]:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for row in rows:
            # The rounds of an interleaved timing (timed_windows), or one window (older runs).
            windows = row.get("timed_windows") or ([row["timed_window"]] if row.get("timed_window") else [])
            if not windows:
                continue
            means = window_means(samples, windows)
            if means is None:
                continue
            print(f"| {path} | {row['hdim']} | {'yes' if row['causal'] else 'no'} | {row['seqlen']} "
                  f"| {row['system']} | {means[0]:.0f} | {means[1]:.0f} | {means[2]} "
                  f"| {share(means[3])} | {share(means[4])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
