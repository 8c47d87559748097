#!/usr/bin/env python3
"""Where the warps of one kernel wait, per SASS instruction: the CSV of Nsight Compute's source
page (`ncu --import REP --page source --print-source sass --csv`, after a collection with
`--section SourceCounters`; dev/gpu_ws_profile.sh with WS_PROFILE_SOURCE=1 makes both).

    python3 dev/ncu_source_stalls.py SOURCE.csv [TOP]

Prints the TOP instructions (default 40) by warp-state samples with their share of all samples
and, where the CSV has per-reason columns, the two largest reasons of each; then the samples
summed by opcode. Column names differ between Nsight Compute versions: the samples are the
first column whose name contains "Sampling" (else "Samples"), the instruction the one named
"Source"; the per-reason columns are those starting with "stall_" or containing "Stall".
"""
import collections
import csv
import sys


def number(text):
    try:
        return float(str(text).replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def main(path, top=40):
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip()]
    start = next(i for i, line in enumerate(lines) if "Source" in line)  # the header row
    rows = list(csv.DictReader(lines[start:]))
    header = list(rows[0].keys()) if rows else []
    samples = next((c for c in header if "Sampling" in c), None) or next((c for c in header if "Samples" in c), None)
    if samples is None:
        sys.exit(f"no sampling column among {header}")
    reasons = [c for c in header if c != samples and (c.startswith("stall_") or "Stall" in c) and "Sampling" not in c]
    total = sum(number(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples in '{samples}'")
    ranked = sorted(rows, key=lambda r: -number(r[samples]))
    for r in ranked[:top]:
        share = number(r[samples]) / total
        why = sorted(((number(r[c]), c) for c in reasons), reverse=True)[:2]
        why_text = ", ".join(f"{c} {v:.0f}" for v, c in why if v > 0)
        print(f"{share:6.1%}  {r.get('Address', ''):>8}  {r.get('Source', '')[:70]:70}  {why_text}")
    by_opcode = collections.Counter()
    for r in rows:
        source = r.get("Source", "").strip()
        opcode = source.split()[0] if source else "?"
        if opcode.startswith("@") and len(source.split()) > 1:
            opcode = source.split()[1]
        by_opcode[opcode.split(".")[0]] += number(r[samples])
    print("\nby opcode:")
    for opcode, count in by_opcode.most_common(15):
        print(f"{count / total:6.1%}  {opcode}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
