#!/usr/bin/env python3
"""Forward and backward over the grid, through the installed package, with the peers:
bf16, hdim 64/128/256, causal no/yes, seqlen 512 .. 16k, batch = 16384 / seqlen,
heads = 2048 / hdim (36 points; bench/forward.py and bench/backward.py say what is called and
timed, bench/harness.py how).

Writes in --out:
  grid_latest.json  {"meta": {...}, "rows": [{"hdim", "causal", "seqlen", "batch", "heads",
                    "fwd": {"ours", "fa2", "cudnn"}, "bwd": {...}, "fwd_kernel": {...},
                    "bwd_kernel": {...}}]}: TFLOP/s, "fwd"/"bwd" of eager calls (the Python
                    path as users call it), "*_kernel" of CUDA-graph replays; null where a
                    system has no time (meta["failures"] says why). scripts/gpu.sh bench
                    copies it to docs/results/h200_grid_latest.json.
  grid_full.json    every figure: timings, samples, checks, reasons.
  grid.md           the tables; grid_forward.png, grid_backward.png the charts.

--time-budget-s (default 420) is shared out over the points as the run goes: each
direction of a point gets an equal share of what is left, of which about half goes to its
timed samples (the rest to inputs, checks, warm-ups and captures), never more than
--target-s per system and method. The whole grid then fits a 10-minute device call with
margin. Exit status 1 when a check of ours failed or ours has no time somewhere.
"""
from __future__ import annotations

import sys
import time

import backward
import forward
import harness as h

SYSTEMS = ("ours",) + tuple(h.PEERS)
MIN_TARGET_S = 0.02
TIMED_SHARE = 0.5  # of each direction's budget share, the part its timed samples get
DIRECTIONS = (("fwd", forward.measure), ("bwd", backward.measure))


def target_for(args, began: float, tasks_left: int, systems: int) -> float:
    """Seconds of samples per system and method for the next direction of a point."""
    left = args.time_budget_s - (time.monotonic() - began)
    share = max(left, 0.0) / max(tasks_left, 1) * TIMED_SHARE / (systems * len(h.METHODS))
    return max(MIN_TARGET_S, min(args.target_s, share))


def grid_row(shape: h.Shape, measured: dict[str, dict]) -> dict:
    """The schema's row: TFLOP/s per direction and system, eager and kernel."""
    row = shape.fields()
    for key, method, suffix in (("fwd", "eager", ""), ("bwd", "eager", ""),
                                ("fwd", "kernel", "_kernel"), ("bwd", "kernel", "_kernel")):
        results = measured[key]["results"]
        row[key + suffix] = {s: h.rate(results.get(s), method, "tflops") for s in SYSTEMS}
    return row


def main() -> int:
    p = h.parser(__doc__)
    h.add_grid_args(p)
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="seconds for the whole grid, forward and backward (default 420)")
    args = h.finish_args(p.parse_args())
    meta = h.run_metadata("flashattn grid: forward and backward (Python path)", args)
    meta |= {"units": "TFLOP/s; fwd 4*B*H*S*S*D (halved when causal), bwd 2.5x fwd",
             "fwd/bwd": "eager: per call as users make them, launch and Python included",
             "fwd_kernel/bwd_kernel": "CUDA-graph replay of the same calls",
             "time_budget_s": args.time_budget_s}
    shapes = h.grid_shapes(args)
    systems = 1 + len(args.peer_list)
    began = time.monotonic()
    full = {"fwd": [], "bwd": []}
    rows = []
    with h.on_side_stream(args.device):
        for i, shape in enumerate(shapes):
            measured = {}
            for j, (key, measure) in enumerate(DIRECTIONS):
                tasks_left = (len(shapes) - i) * len(DIRECTIONS) - j
                target = target_for(args, began, tasks_left, systems)
                measured[key] = h.measure_safely(measure, shape.fields(), args, shape, args,
                                                 target) | {"target_s": target}
                full[key].append(measured[key])
                print(f"[{time.monotonic() - began:5.0f} s] {key} ", end="", file=sys.stderr)
                h.progress(measured[key], "tflops")
            rows.append(grid_row(shape, measured))
    meta["elapsed_s"] = round(time.monotonic() - began, 1)
    all_rows = full["fwd"] + full["bwd"]
    failures = h.failure_notes(all_rows, h.shape_label)
    checks = h.check_notes(all_rows, h.shape_label)
    meta["checks_passed"] = not checks
    meta["failures"] = failures.splitlines()
    meta["check_failures"] = checks.splitlines()
    tables = []
    for key, title in (("fwd", "Forward"), ("bwd", "Backward")):
        name = "forward" if key == "fwd" else "backward"
        why = h.line_chart(args.out / f"grid_{name}.png",
                           f"{title}, eager TFLOP/s, {meta.get('gpu', meta.get('cpu'))}",
                           h.grid_panels(full[key], "tflops", "eager"), "seqlen", "TFLOP/s")
        meta[f"chart_{key}"] = why or f"grid_{name}.png"
        tables.append(f"## {title}\n\n" + h.rate_table(full[key], h.shape_label,
                                                       list(full[key][0]["results"]),
                                                       "tflops", "TFLOP/s"))
    h.write_json(args.out / "grid_latest.json", {"meta": meta, "rows": rows})
    h.write_json(args.out / "grid_full.json", {"meta": meta} | full)
    failed = bool(checks) or any(r["results"]["ours"]["eager"] is None for r in all_rows)
    return h.report_text(args, "grid", meta, "\n\n".join(tables),
                         "\n".join(n for n in (checks, failures) if n), failed,
                         printed=summary(rows))


def summary(rows: list[dict]) -> str:
    """The short table printed last: eager TFLOP/s per point, forward and backward."""
    header = ["hdim", "causal", "seqlen"] + [f"{key} {s}" for key in ("fwd", "bwd")
                                             for s in SYSTEMS] + ["fwd ours/fa2", "bwd ours/fa2"]
    body = []
    for r in rows:
        cells = [r["hdim"], "yes" if r["causal"] else "no", h.seqlen_label(r["seqlen"])]
        cells += [h.fmt(r[key][s]) for key in ("fwd", "bwd") for s in SYSTEMS]
        cells += [h.ratio(r[key]["ours"], r[key]["fa2"]) for key in ("fwd", "bwd")]
        body.append(cells)
    return h.markdown_table(header, body)


if __name__ == "__main__":
    raise SystemExit(main())
