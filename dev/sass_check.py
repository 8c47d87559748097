#!/usr/bin/env python3
"""Reads the SASS of the sm90 forward kernels and of the TMA backward kernel and says, per
kernel, whether the exponentials overlap a matrix product inside a warpgroup: whether
MUFU.EX2 instructions sit between a `WARPGROUP.DEPBAR.LE gsb0, 0x1` (one group is done,
the next still runs: P V in the forward, dP^T in the backward) and the next
`WARPGROUP.DEPBAR` (that group is done). Also counts spill instructions (STL/LDL).

    python3 dev/sass_check.py OBJECT_OR_CUBIN [...]   (cuobjdump and nvdisasm on PATH; the
    PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm have them)

The TMA backward's general variant (backward_ws_kernel<..., kGeneral = true>: softcap, ALiBi,
dropout) computes P^T together with dS^T once dP^T is in, by design (softcap's derivative needs
the tanh beside P, 64 more floats a thread if P^T came first), so it is checked for spills only.

Exit status 1 when a kernel has no overlapped window or spills, so it can gate a change.
"""
import re
import subprocess
import sys

GENERAL_BACKWARD = re.compile(r"backward_ws_kernel.*ELb1EEEv")  # the bool after the config: kGeneral
DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")


def kernels(path):
    sass = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True, text=True).stdout
    name, lines = None, []
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                yield name, lines
            name, lines = m.group(1), []
        elif name:
            lines.append(line)
    if name:
        yield name, lines


def overlap_windows(lines):
    """(EX2 inside windows opened by a wait for 1 and closed by the next wait, windows seen)."""
    inside, ex2, windows = False, 0, 0
    for line in lines:
        m = DEPBAR.search(line)
        if m:
            inside = m.group(1) == "1"
            windows += inside
        elif inside and "MUFU.EX2" in line:
            ex2 += 1
    return ex2, windows


def main(paths):
    bad = 0
    for path in paths:
        for name, lines in kernels(path):
            if "sm90" not in name or ("forward" not in name and "backward_ws" not in name):
                continue
            ex2, windows = overlap_windows(lines)
            spills = sum(1 for line in lines if re.search(r"\b(STL|LDL)\b", line))
            general = GENERAL_BACKWARD.search(name) is not None
            ok = (ex2 > 0 or general) and spills == 0
            bad += not ok
            note = " (general variant: no overlap by design)" if general else ""
            print(f"{'ok  ' if ok else 'FAIL'} EX2 in overlap windows: {ex2:4d} (windows {windows}), "
                  f"spill instructions: {spills:4d}  {name[:110]}{note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
