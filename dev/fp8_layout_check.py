#!/usr/bin/env python3
"""Scratch: the FP8 forward's index arithmetic restated in Python and checked on the CPU.

1. P's A fragments: s_to_p packs the S accumulators (wgmma's C layout: d[4 t + e] of lane l
   at row l / 4 + 8 (e / 2), column 8 t + 2 (l % 4) + e % 2) four to a register; read back
   through wgmma's 8-bit A layout (register v1 + 2 v2, byte v0: row l / 4 + 8 v1, k
   4 (l % 4) + v0 + 16 v2; CUTLASS's ALayout_64x32), P lands at the key slots that
   transpose_values fills with the matching keys, so A . Vt equals P . V.
2. transpose_values, byte for byte: V as TMA lays it out (128-byte rows, the 128-byte
   swizzle), each warp's units, lanes, loads, byte permutes and stores, then Vt read back
   through the swizzle at every (column, slot): the key the slot should hold; and the most
   lanes of one warp instruction that share a bank at different addresses, loads and stores
   (2-way loads at a411230, as Nsight Compute counted; --swap-pairs: the 1-way order tried on
   2026-12-07, measured slower on an H100 and dropped; the patch is in git history at 4fbaf4f).

3. (d, seqlen)-major V (kSeqlenMajorValues): no transposed slots, so s_to_p's two quad
   shuffles and byte permutes must leave register v1 + 2 v2 of lane l holding keys
   4 (l % 4) + 16 v2 .. + 3 in order, rows l / 4 + 8 v1, for every lane.

Both for 64- and 128-key blocks and head dims 128 and 256. Run: python3 dev/fp8_layout_check.py
"""
import sys

import numpy as np


def fragments_match(block_keys, rng):
    p = rng.random((16, block_keys))  # one warp's 16 rows
    v = rng.integers(-8, 8, (block_keys, 64)).astype(float)
    a = np.full((16, block_keys), np.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        s = np.zeros(block_keys // 2)
        for t in range(block_keys // 8):
            for e in range(4):
                s[4 * t + e] = p[g + 8 * (e // 2), 8 * t + 2 * q + e % 2]
        for kk in range(block_keys // 32):
            x = s[16 * kk:16 * kk + 16]
            registers = [[x[0], x[1], x[4], x[5]], [x[2], x[3], x[6], x[7]],
                         [x[8], x[9], x[12], x[13]], [x[10], x[11], x[14], x[15]]]
            for reg, values in enumerate(registers):
                v1, v2 = reg % 2, reg // 2
                for v0, value in enumerate(values):
                    a[g + 8 * v1, 32 * kk + 4 * q + v0 + 16 * v2] = value
    vt = np.full((64, block_keys), np.nan)
    for lane in range(block_keys // 4):
        key0 = 32 * (lane // 8) + 16 * (lane // 4 % 2) + 2 * (lane % 4)
        for i in range(4):
            vt[:, 4 * lane + i] = v[key0 + (i & 1) + 8 * (i >> 1)]
    return not np.isnan(a).any() and np.allclose(a @ vt.T, p @ v)


def byte_perm(x, y, selector):
    b = list(x.to_bytes(4, "little")) + list(y.to_bytes(4, "little"))
    return int.from_bytes(bytes(b[(selector >> (4 * i)) & 7] for i in range(4)), "little")


def seqlen_major_fragments_match():
    """s_to_p's (d, seqlen)-major branch on bytes that name their (row half, key): each lane's
    T and U words, what each gives in the two shuffles, what it takes, and its two registers
    per 16 keys, against the A layout's keys in order."""
    def acc(lane, tile, e):  # the accumulator byte: row half e // 2, key 8 tile + 2 q + e % 2
        return 128 * (e // 2) + 8 * tile + 2 * (lane % 4) + e % 2
    given = {}
    for lane in range(32):
        q = lane % 4
        t = int.from_bytes(bytes(acc(lane, 0, e) for e in range(4)), "little")
        u = int.from_bytes(bytes(acc(lane, 1, e) for e in range(4)), "little")
        give_first = 0x3210 if q % 2 == 0 else 0x7654
        given[lane] = (byte_perm(t, u, give_first), byte_perm(t, u, give_first ^ 0x4444))
    for lane in range(32):
        q, quad = lane % 4, lane - lane % 4
        first = given[quad + (2 * q if q < 2 else 2 * q - 3)][0]
        second = given[quad + (2 * q + 1 if q < 2 else 2 * q - 4)][1]
        row_r = 0x5410 if q < 2 else 0x1054
        for v1, selector in ((0, row_r), (1, row_r + 0x2222)):
            want = bytes(128 * v1 + 4 * q + v0 for v0 in range(4))
            if byte_perm(first, second, selector).to_bytes(4, "little") != want:
                return False
    return True


def transpose_matches(block_keys, head_dim, rng, warps=3, swap_pairs=False):
    """transpose_values byte for byte; also the most lanes of one warp instruction that share a
    shared-memory bank at different addresses (1: no conflict), for its loads and its stores.
    swap_pairs: the upper half-warp loads each key pair in the other order
    (the order tried on 2026-12-07 and dropped)."""
    panels = head_dim // 128
    v = rng.integers(0, 256, (block_keys, head_dim)).astype(np.uint8)
    raw = np.zeros(panels * block_keys * 128, np.uint8)
    for p in range(panels):
        for r in range(block_keys):
            for c in range(8):
                raw[(p * block_keys + r) * 128 + ((c ^ (r % 8)) << 4):][:16] = v[r, p * 128 + c * 16:][:16]
    vt = np.zeros(head_dim * 128, np.uint8)
    groups = block_keys // 4          # lanes per unit
    at_once = 32 // groups            # units per warp step
    accesses = {}                     # (warp, step, load i or store j) -> [(lane, address)]
    for warp in range(warps):
        for lane in range(32):
            group = lane % groups
            swapped = lane // 16 if swap_pairs else 0
            low, high = (0x1504, 0x3726) if swapped else (0x5140, 0x7362)
            key0 = 32 * (group // 8) + 16 * (group // 4 % 2) + 2 * (group % 4)
            slot_chunk, slot_word = group // 4, group % 4
            for step, unit in enumerate(range(warp * at_once + lane // groups, panels * 32, warps * at_once)):
                panel, chunk, word = unit // 32, unit // 4 % 8, (slot_chunk + unit) % 4
                x = []
                for i in range(4):
                    key = key0 + ((i & 1) ^ swapped) + 8 * (i >> 1)
                    at = (panel * block_keys + key) * 128 + ((chunk ^ (key % 8)) << 4) + word * 4
                    accesses.setdefault((warp, step, "load", i), []).append(at)
                    x.append(int.from_bytes(raw[at:at + 4].tobytes(), "little"))
                ab01, cd01 = byte_perm(x[0], x[1], low), byte_perm(x[2], x[3], low)
                ab23, cd23 = byte_perm(x[0], x[1], high), byte_perm(x[2], x[3], high)
                columns = [byte_perm(ab01, cd01, 0x5410), byte_perm(ab01, cd01, 0x7632),
                           byte_perm(ab23, cd23, 0x5410), byte_perm(ab23, cd23, 0x7632)]
                for j, word_value in enumerate(columns):
                    row = panel * 128 + chunk * 16 + word * 4 + j
                    at = row * 128 + ((slot_chunk ^ (row % 8)) << 4) + slot_word * 4
                    accesses.setdefault((warp, step, "store", j), []).append(at)
                    vt[at:at + 4] = np.frombuffer(word_value.to_bytes(4, "little"), np.uint8)
    ways = {"load": 1, "store": 1}
    for (_, _, kind, _), addresses in accesses.items():
        banks = {}
        for at in addresses:
            banks.setdefault(at // 4 % 32, set()).add(at)
        ways[kind] = max(ways[kind], max(len(a) for a in banks.values()))
    for lane in range(block_keys // 4):
        key0 = 32 * (lane // 8) + 16 * (lane // 4 % 2) + 2 * (lane % 4)
        for i in range(4):
            key, slot = key0 + (i & 1) + 8 * (i >> 1), 4 * lane + i
            for d in range(head_dim):
                if vt[d * 128 + (((slot // 16) ^ (d % 8)) << 4) + slot % 16] != v[key, d]:
                    return False, ways
    return True, ways


def main():
    swap_pairs = "--swap-pairs" in sys.argv[1:]
    rng = np.random.default_rng(0)
    ok = True
    for block_keys in (64, 128):
        good = fragments_match(block_keys, rng)
        print(f"{block_keys}-key blocks: P's fragments against the transposed slots: {'ok' if good else 'WRONG'}")
        ok &= good
        for head_dim in (128, 256):
            good, ways = transpose_matches(block_keys, head_dim, rng, swap_pairs=swap_pairs)
            print(f"{block_keys}-key blocks, head dim {head_dim}: transposed V: {'ok' if good else 'WRONG'}; "
                  f"lanes per bank: loads {ways['load']}-way, stores {ways['store']}-way")
            ok &= good
    good = seqlen_major_fragments_match()
    print(f"(d, seqlen)-major V: P's registers in key order: {'ok' if good else 'WRONG'}")
    ok &= good
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
