#!/usr/bin/env python3
"""Scratch (dev/): where the sm90 TMA forward's time goes inside a CTA, from clock stamps.

The package built with `-DFLASHATTN_DEV_TIMELINE` (dev/forward_timeline.patch on the kernel)
records clock64() at fixed points of the producer warp and of each consumer warpgroup's thread
0 in the first 8 CTAs, and writes them to $FLASHATTN_DEV_TIMELINE_FILE after each launch.

  [TL_FLAGS="0 1"] dev/forward_timeline.py run OUT_DIR [hdim:seqlen[:causal] ...]
      (GPU: one file per shape and $FLASHATTN_DEV_FLAGS value; their speeds, alternating)
  dev/forward_timeline.py show FILE ...                             (the table per file)

Per consumer and tile: the waits (Q, K, the turn, S, V, P V), the softmax, the last P V and
the epilogue, in SM clock cycles, means over the CTAs' tiles but their first; and a tile's cost
beyond its blocks at the steady block period ("boundary"), in those blocks' units.
"""
from __future__ import annotations

import os
import statistics
import struct
import sys

HEADER = ("hdim", "block_m", "block_n", "consumers", "stages", "batch", "heads", "seqlen_q", "seqlen_k",
          "window_right", "ctas", "slots")


def run(out_dir: str, shapes: list[str]) -> None:
    """Per shape and dev flag value ($TL_FLAGS, default "0"): the stamps of the last of three
    calls, then ours' time with the stamps off, the flag values alternating over three rounds."""
    import torch
    import flashattn
    os.makedirs(out_dir, exist_ok=True)
    flag_values = os.environ.get("TL_FLAGS", "0").split()
    for shape in shapes:
        parts = shape.split(":")
        d, s = int(parts[0]), int(parts[1])
        causal = len(parts) > 2 and parts[2] == "causal"
        b, h = max(1, 16384 // s), 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for flags in flag_values:
            os.environ["FLASHATTN_DEV_FLAGS"] = flags
            path = os.path.join(out_dir, f"timeline_d{d}_s{s}{'_causal' if causal else ''}_f{flags}.bin")
            for _ in range(3):  # the file holds the last call's stamps
                os.environ["FLASHATTN_DEV_TIMELINE_FILE"] = path
                flashattn.flash_attn_func(q, k, v, causal=causal)
            os.environ.pop("FLASHATTN_DEV_TIMELINE_FILE")
        torch.cuda.synchronize()
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        times = {f: [] for f in flag_values}
        for _ in range(3):
            for flags in flag_values:
                os.environ["FLASHATTN_DEV_FLAGS"] = flags
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    flashattn.flash_attn_func(q, k, v, causal=causal)
                end.record()
                torch.cuda.synchronize()
                times[flags].append(start.elapsed_time(end) / 20)
        base = statistics.median(times[flag_values[0]])
        print(f"{shape}: " + "  ".join(
            f"flags {f}: {flops / statistics.median(t) / 1e9:.0f} TFLOP/s ({base / statistics.median(t):.3f}x)"
            for f, t in times.items()))


def events(words: list[int]) -> list[tuple[int, int]]:
    stamps = [(w >> 56, w & ((1 << 56) - 1)) for w in words if w]
    stamps.sort(key=lambda e: e[1])
    return stamps


def consumer_tiles(stamps: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    tiles, current = [], None
    for ev, t in stamps:
        if ev == 1:
            current = []
            tiles.append(current)
        if current is not None:
            current.append((ev, t))
    return tiles


def tile_parts(tile: list[tuple[int, int]], next_start: int | None) -> dict[str, float]:
    first = {}
    for ev, t in tile:
        first.setdefault(ev, t)
    parts: dict[str, float] = {}

    def span(name, a, b):
        if a in first and b in first:
            parts[name] = first[b] - first[a]

    span("q wait", 1, 2)
    span("K0 wait", 2, 3)
    span("turn0 wait", 3, 4)
    span("S0", 4, 5)
    span("softmax0", 5, 6)
    span("V0 wait", 6, 7)
    blocks = {k: 0.0 for k in ("K wait", "turn wait", "S wait", "softmax", "V wait", "PV wait")}
    starts = [t for ev, t in tile if ev == 8]
    pairs = {8: 9, 9: 10, 10: 11, 11: 12, 12: 13, 13: 14}
    names = {8: "K wait", 9: "turn wait", 10: "S wait", 11: "softmax", 12: "V wait", 13: "PV wait"}
    last = {}
    for ev, t in tile:
        if ev in pairs.values() and (ev - 1) in last:
            blocks[names[ev - 1]] += t - last[ev - 1]
        last[ev] = t
    n_loop = len(starts)
    for k, val in blocks.items():
        parts["blk " + k] = val / n_loop if n_loop else 0.0
    parts["blocks"] = n_loop + 1
    if len(starts) >= 2:
        parts["block period"] = (starts[-1] - starts[0]) / (len(starts) - 1)
    span("last turn wait", 15, 16)
    span("last PV", 16, 17)
    span("epilogue", 17, 18)
    if next_start is not None:
        parts["tile"] = next_start - first[1]
        if 18 in first:
            parts["setup (next tile)"] = next_start - first[18]
        if 8 in first and 15 in first:
            parts["loop"] = first[15] - first[8]
    return parts


def show(path: str) -> None:
    raw = open(path, "rb").read()
    header = dict(zip(HEADER, struct.unpack("<12q", raw[:96])))
    slots = header["slots"]
    words = struct.unpack(f"<{(len(raw) - 96) // 8}Q", raw[96:])
    print(f"== {os.path.basename(path)}: " + ", ".join(f"{k} {v}" for k, v in header.items()))
    rows: dict[str, list[float]] = {}
    periods = []
    for cta in range(8):
        for role in (1, 2, 3):
            base = (cta * 4 + role) * slots
            tiles = consumer_tiles(events(list(words[base:base + slots])))
            for i, tile in enumerate(tiles[1:-1], start=1):  # not the first (start-up) nor the last
                parts = tile_parts(tile, tiles[i + 1][0][1])
                for k, v in parts.items():
                    rows.setdefault(f"c{role - 1} {k}", []).append(v)
                if "block period" in parts:
                    periods.append(parts["block period"])
    if not rows:
        print("  no tiles")
        return
    period = statistics.median(periods) if periods else float("nan")
    for k in sorted(rows, key=lambda k: (k[:2], list(rows).index(k))):
        vals = rows[k]
        print(f"  {k:22s} mean {statistics.mean(vals):9.0f}  median {statistics.median(vals):9.0f}  n {len(vals)}")
    for c in ("c0", "c1"):
        tile, blocks = rows.get(f"{c} tile"), rows.get(f"{c} blocks")
        if tile and blocks:
            boundary = statistics.mean(t - b * period for t, b in zip(tile, blocks))
            print(f"  {c}: steady block period {period:.0f} cycles; tile {statistics.mean(tile):.0f} = "
                  f"{statistics.mean(blocks):.1f} blocks + boundary {boundary:.0f} ({boundary / period:.2f} blocks)")
    # The producer: when each Q was issued against the consumers' need of it.
    prod = events(list(words[0:slots]))
    q_issue = [t for ev, t in prod if ev == 21]
    c0 = consumer_tiles(events(list(words[slots:2 * slots])))
    lags = []
    for i, tile in enumerate(c0[1:], start=1):
        if i < len(q_issue):
            lags.append(tile[0][1] - q_issue[i])
    if lags:
        print(f"  CTA 0: Q(t) issued {statistics.mean(lags):.0f} cycles before consumer 0 asks for it (mean)")
    # CTA 0's third and fourth tiles, every role's stamps in time order (cycles from the start).
    if len(c0) > 4:
        t0, t1 = c0[2][0][1], c0[4][0][1]
        merged = []
        for role in range(4):
            for ev, t in events(list(words[role * slots:(role + 1) * slots])):
                if t0 <= t < t1:
                    merged.append((t, role, ev))
        merged.sort()
        names = {1: "q?", 2: "Q", 3: "K0", 4: "T0", 5: "S0", 6: "sm0", 7: "V0", 8: "k?", 9: "K", 10: "T", 11: "S",
                 12: "sm", 13: "V", 14: "PV", 15: "t?", 16: "Tl", 17: "PVl", 18: "epi", 20: "q_empty?", 21: "Q>",
                 22: "K>", 23: "V>"}
        line = {0: [], 1: [], 2: [], 3: []}
        print("  CTA 0, tiles 2-3 (cycles from tile 2's start; producer 'X>' = X issued):")
        for t, role, ev in merged:
            line[role].append(f"{names.get(ev, ev)}@{t - t0}")
        for role, label in ((0, "producer"), (1, "consumer 0"), (2, "consumer 1")):
            text = " ".join(line[role])
            for i in range(0, len(text), 140):
                print(f"    {label if i == 0 else '':10s} {text[i:i + 140]}")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:] or ["128:512", "128:1024", "128:16384", "256:512", "256:16384"])
    elif len(sys.argv) >= 3 and sys.argv[1] == "show":
        for path in sys.argv[2:]:
            show(path)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
