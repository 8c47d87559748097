#!/usr/bin/env python3
"""Instruction mix of a profiled kernel, from Nsight Compute's source page in CSV
(`ncu --import R --page source --csv --print-source sass`): executed instructions per opcode,
largest first, so that two kernels doing the same work can be compared by where their extra
instructions go. Columns are found by name, since their order differs between ncu versions.
    scripts/sass_mix.py sass.csv [top]"""
import csv
import re
import sys
from collections import Counter


def main() -> int:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if any("Source" in c for c in r)), None)
    if header_at is None:
        print(f"{path}: no header with a Source column")
        return 1
    header = rows[header_at]
    source = next(i for i, c in enumerate(header) if c.strip() == "Source" or "Source" in c)
    executed = next((i for i, c in enumerate(header)
                     if "Instructions Executed" in c or "inst_executed" in c), None)
    if executed is None:
        print(f"{path}: no executed-instructions column in {header}")
        return 1
    mix, total = Counter(), 0
    for r in rows[header_at + 1:]:
        if len(r) <= max(source, executed):
            continue
        try:
            count = float(r[executed].replace(",", ""))
        except ValueError:
            continue
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", r[source].strip())
        if not text:
            continue
        mix[text.split()[0].split(".")[0]] += count
        total += count
    print(f"{total:,.0f} executed instructions (warp level)")
    for op, count in mix.most_common(top):
        print(f"  {op:12s} {count:14,.0f}  {100 * count / total:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
