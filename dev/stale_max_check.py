#!/usr/bin/env python3
"""The stale-max softmax of dev/forward_stale_max.patch restated in NumPy and compared with the
kernel's exact online softmax on the CPU: per query row, 128-key blocks, p = 2^(s c - m c) in
float32, P rounded to bf16 for P V (fp32 accumulation), the running sum of the unrounded p; the
exact variant takes each block's max, the stale one keeps the running max unless some p of the
block passes the limit (4096), where it redoes the block exactly. Prints, per input kind, the
largest error of each against float64 attention and how often the stale variant redid a block.

    python3 dev/stale_max_check.py [ROWS]

Random scores, scores growing from block to block (gently and in steps), and shrinking ones."""
import sys

import numpy as np


def bf16(x):
    """Rounds float32 to bfloat16 (to nearest, ties to even), returned as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.view(np.float32)


def attend(s, v, c, stale, limit=4096.0, block=128):
    """One row: scores s (keys,), values v (keys, d); c = scale log2 e. Returns (out, redone)."""
    m, l = -np.inf, np.float32(0)
    o = np.zeros(v.shape[1], dtype=np.float32)
    redone = 0
    for j in range(0, len(s), block):
        sb, vb = s[j:j + block], v[j:j + block]
        exact = not stale or j == 0
        if not exact:
            with np.errstate(over="ignore", invalid="ignore"):
                p = np.exp2(np.float32(sb * c - np.float32(m * c)), dtype=np.float32)
            if not (p.sum(dtype=np.float32) <= limit):
                exact, redone = True, redone + 1
            else:
                scale = np.float32(1)
        if exact:
            new = max(m, float(sb.max()))
            scale = np.float32(1) if new == m else np.exp2(np.float32((m - new) * c), dtype=np.float32)
            m = new
            p = np.exp2(np.float32(sb * c - np.float32(m * c)), dtype=np.float32)
        l = l * scale + p.sum(dtype=np.float32)
        o = o * scale + bf16(p) @ vb
    return o / l, redone


def main(rows=64):
    rng = np.random.default_rng(0)
    d, keys = 128, 1024
    c = np.float32(1 / np.sqrt(d) * np.log2(np.e))
    kinds = {
        "random": lambda j: 1.0,
        "gentle growth": lambda j: 1.0 + j / keys,
        "steps of 4x": lambda j: 4.0 ** (j // 128),
        "shrinking": lambda j: 4.0 ** -(j // 128),
    }
    for name, growth in kinds.items():
        g = np.array([growth(j) for j in range(keys)])[:, None]
        worst = {False: 0.0, True: 0.0}
        redone = 0
        for _ in range(rows):
            q = bf16(rng.standard_normal(d).astype(np.float32))
            k = bf16((rng.standard_normal((keys, d)) * g).astype(np.float32))
            v = bf16(rng.standard_normal((keys, d)).astype(np.float32))
            s = (k.astype(np.float64) @ q.astype(np.float64)).astype(np.float32)  # the wgmma's fp32 S
            e = np.exp((s.astype(np.float64) - s.max()) / np.sqrt(d))
            exact64 = (e / e.sum()) @ v.astype(np.float64)
            for stale in (False, True):
                out, r = attend(s, v, c, stale)
                worst[stale] = max(worst[stale], float(np.abs(out - exact64).max() / np.abs(exact64).max()))
                redone += r if stale else 0
        print(f"{name:14}: largest error / largest |out|, exact max {worst[False]:.3g}, stale max "
              f"{worst[True]:.3g}; blocks redone {redone} of {rows * (keys // 128 - 1)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
