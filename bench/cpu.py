#!/usr/bin/env python3
"""flashattn's CPU backend against PyTorch's own CPU attention, in one process, through the
public functions as users call them:

    ours   out = flashattn.flash_attn_func(q, k, v, causal=causal)      # (B, S, H, D)
    torch  out = torch.nn.functional.scaled_dot_product_attention(
                     qt, kt, vt, is_causal=causal)                      # (B, H, S, D)

torch's inputs are the same values made contiguous in its native (B, H, S, D) layout before
anything is timed, so that each system gets its own layout without a copy in the timed call
(SDPA on CPU picks its flash-attention kernel for these inputs; meta and rows record its
choice). flashattn's causal mask is bottom-right aligned, SDPA's is_causal top-left: the same
mask here, where every shape is square (Sq == Sk).

Grid: dtype fp32 and bf16, causal and full, hdim 64 and 128, seqlen 512 ... 8192, batch 1,
8 heads, each point in two modes: "fwd" (the call above, on inputs that need no grad) and
"fwd+bwd" (the call on inputs that need grad, then torch.autograd.grad(out, (q, k, v), dout)
with one fixed dout; both systems the same way). Points run small to large, so that when
--time-budget-s runs out the big ones are the ones skipped (recorded as skipped, with why).

Threads: both systems get --threads (default os.cpu_count()). OMP_NUM_THREADS is set to it
before torch or flashattn is imported (flashattn's CPU backend runs OpenMP's default team)
and torch.set_num_threads(threads); meta records both counts as the libraries report them.

Method, per point:
- Check (before timing): the float64 reference (softmax(q k^T / sqrt(D)) v in float64 on the
  inputs upcast, autograd for the grads) where seqlen <= 1024, torch SDPA's output beyond;
  ours' output (and dq, dk, dv in fwd+bwd) must be within a bound of it: max |ours - ref| over
  max |ref|, at most 1e-4 (fp32) or 2e-2 (bf16); against the float64 reference the bound is
  also at least twice torch's own error, against torch the grads get twice the bound (both
  sides carry error). The check's own call of each system is that system's warm-up call.
- Timing: rounds of one call each, ours then torch, so that a clock or thermal drift touches
  both, each call timed alone with time.perf_counter; rounds go on until each system has at
  least --repeat calls and --min-time-s seconds of them. Median and min seconds per call.
- GFLOP/s: fwd 4*B*H*S*S*D (halved when causal); fwd+bwd 3.5 times that (the backward is
  2.5 forwards). ours/torch is the ratio of the rates (torch's time over ours).

Writes cpu.json ({"meta", "rows"}) and cpu.md in --out and prints the markdown table last.
Exit status 1 when a check of ours failed (or ours raised), else 0.

    python3 bench/cpu.py --threads 16 --out cpu-results
    python3 bench/cpu.py --quick --out /tmp/cpu      # the CI smoke test: seconds on 2 cores
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

import harness as h  # the standard library only at import; nothing CUDA is touched here

MODES = ("fwd", "fwd+bwd")
DTYPES = ("fp32", "bf16")
SEQLENS = (512, 1024, 2048, 4096, 8192)
HDIMS = (64, 128)
QUICK_SEQLENS, QUICK_HDIMS, QUICK_HEADS, QUICK_MIN_TIME_S = (128, 256), (64,), 2, 0.1
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
REFERENCE_MAX_SEQLEN = 1024  # float64 reference up to here, torch SDPA beyond
BACKWARD_FACTOR = 3.5        # fwd+bwd FLOPs over fwd FLOPs
MAX_CALLS = 10000            # per system and point, whatever the minimum time says


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("cpu-results"),
                   help="directory for cpu.json and cpu.md (created; default ./cpu-results)")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny grid: seqlen {list(QUICK_SEQLENS)}, hdim {list(QUICK_HDIMS)}, "
                        f"fp32 (unless --dtype), {QUICK_HEADS} heads, --min-time-s "
                        f"{QUICK_MIN_TIME_S} at most (the CI smoke test)")
    p.add_argument("--dtype", choices=DTYPES, help="only this dtype (default: both)")
    p.add_argument("--seqlens", type=int_list, help=f"comma-separated; default "
                   f"{','.join(map(str, SEQLENS))}")
    p.add_argument("--hdims", type=int_list, help=f"comma-separated; default "
                   f"{','.join(map(str, HDIMS))}")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated among "
                   + ", ".join(MODES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="default 8 (--quick: 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of both systems (default os.cpu_count())")
    p.add_argument("--min-time-s", type=float, default=1.0,
                   help="seconds of timed calls per system and point, at least")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per system, at least")
    p.add_argument("--time-budget-s", type=float, default=600.0,
                   help="points not begun within this many seconds are skipped")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    if args.threads < 1:
        p.error("--threads: at least 1")
    args.dtypes = [args.dtype] if args.dtype else (["fp32"] if args.quick else list(DTYPES))
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    args.hdims = args.hdims or list(QUICK_HDIMS if args.quick else HDIMS)
    args.heads = args.heads or (QUICK_HEADS if args.quick else 8)
    if args.quick:
        args.min_time_s = min(args.min_time_s, QUICK_MIN_TIME_S)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


# --- the grid --------------------------------------------------------------------------------

def points(args) -> list[dict]:
    """Every (shape, dtype, mode), smallest work first: seqlen, then hdim, then the rest."""
    causals = {"no": (False,), "yes": (True,), "both": (True, False)}[args.causal]
    out = []
    for seqlen in sorted(args.seqlens):
        for hdim in sorted(args.hdims):
            for causal in causals:
                for dtype in args.dtypes:
                    for mode in args.modes:
                        shape = h.Shape(args.batch, args.heads, seqlen, hdim, causal)
                        out.append({"dtype": dtype, "mode": mode} | shape.fields())
    return out


def shape_of(point: dict) -> h.Shape:
    return h.Shape(*(point[k] for k in ("batch", "heads", "seqlen", "hdim", "causal")))


def flops_of(point: dict) -> float:
    fwd = shape_of(point).flops(backward=False)
    return fwd * BACKWARD_FACTOR if point["mode"] == "fwd+bwd" else fwd


def label(row: dict) -> str:
    return f"{row['dtype']} {row['mode']} {shape_of(row).label()}"


# --- the systems -----------------------------------------------------------------------------

def make_calls(point: dict, seed: int):
    """The inputs of both systems (the same values, each in its own layout) and one call of
    each, returning (out, grads or None) in ours' (B, S, H, D) layout."""
    import torch
    import torch.nn.functional as F
    from flashattn import flash_attn_func
    dtype = h.torch_dtype(point["dtype"])
    causal, backward = point["causal"], point["mode"] == "fwd+bwd"
    dims = (point["batch"], point["seqlen"], point["heads"], point["hdim"])
    gen = h.generator("cpu", seed)
    q, k, v, dout = h.random_tensors([dims] * 4, dtype, "cpu", gen)
    qt, kt, vt, doutt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    for x in (q, k, v, qt, kt, vt):
        x.requires_grad_(backward)

    def ours():
        out = flash_attn_func(q, k, v, causal=causal)
        return out, (torch.autograd.grad(out, (q, k, v), dout) if backward else None)

    def theirs():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        grads = torch.autograd.grad(out, (qt, kt, vt), doutt) if backward else None
        return out.transpose(1, 2), (tuple(g.transpose(1, 2) for g in grads)
                                     if backward else None)

    backend = torch_backend(qt, kt, vt, causal)
    return (q, k, v, dout), {"ours": ours, "torch": theirs}, backend


def torch_backend(q, k, v, causal: bool) -> str | None:
    """The kernel SDPA picks for these inputs (a private torch function; None without it)."""
    import torch
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=causal)).name
    except Exception:
        return None


def reference(q, k, v, dout, causal: bool, backward: bool):
    """softmax(q k^T / sqrt(D)) v in float64 (B, S, H, D), and its grads in fwd+bwd."""
    import torch
    q64, k64, v64 = (x.detach().double().requires_grad_(backward) for x in (q, k, v))
    scores = q64.transpose(1, 2) @ k64.permute(0, 2, 3, 1) / q.shape[-1] ** 0.5
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v64.transpose(1, 2)).transpose(1, 2)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double()) if backward else None
    return out.detach(), grads


def rel_err(a, b) -> float:
    """max |a - b| over max |b|, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def errors(result, ref) -> dict:
    out, grads = result
    ref_out, ref_grads = ref
    errs = {"out": rel_err(out, ref_out)}
    if grads is not None:
        errs |= {name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
    return errs


def check(point: dict, inputs, calls) -> dict:
    """Ours (and torch) once each, the warm-up call, against the float64 reference up to
    REFERENCE_MAX_SEQLEN, else ours against torch; see the docstring for the bound."""
    import torch
    backward = point["mode"] == "fwd+bwd"
    tol = TOLERANCE[point["dtype"]]
    ref = reference(*inputs, point["causal"], backward) \
        if point["seqlen"] <= REFERENCE_MAX_SEQLEN else None
    mine = calls["ours"]()
    theirs = calls["torch"]()
    finite = all(bool(torch.isfinite(x).all()) for x in (mine[0], *(mine[1] or ())))
    if ref is not None:
        ours_err, torch_err = errors(mine, ref), errors(theirs, ref)
        bounds = {key: max(tol, 2 * torch_err[key]) for key in ours_err}
        against = "float64"
    else:
        ours_err, torch_err = errors(mine, theirs), None
        bounds = {key: tol if key == "out" else 2 * tol for key in ours_err}
        against = "torch"
    ok = finite and all(ours_err[key] <= bounds[key] for key in ours_err)
    return {"ok": ok, "finite": finite, "against": against, "ours_err": ours_err,
            "torch_err": torch_err, "bound": bounds}


def time_alternating(calls: dict, min_time_s: float, repeat: int) -> dict:
    """Rounds of one timed call per system (in the order of calls) until every system has
    at least `repeat` calls and min_time_s seconds of them; median and min per call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    while True:
        for name, call in calls.items():
            began = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - began)
        if all(len(t) >= repeat and sum(t) >= min_time_s for t in times.values()) \
                or any(len(t) >= MAX_CALLS for t in times.values()):
            break
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "calls": len(t)}
            for name, t in times.items()}


def measure(point: dict, args) -> dict:
    row = dict(point, flops=flops_of(point))
    inputs, calls, backend = make_calls(point, args.seed)
    row["torch_backend"] = backend
    row["check"] = check(point, inputs, calls)
    row["results"] = time_alternating(calls, args.min_time_s, args.repeat)
    for result in row["results"].values():
        result["gflops"] = row["flops"] / result["median_s"] / 1e9
    row["ratio"] = row["results"]["torch"]["median_s"] / row["results"]["ours"]["median_s"]
    return row


# --- run facts -------------------------------------------------------------------------------

def cpu_facts() -> dict:
    model, flags = None, set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": model or platform.processor() or platform.machine(),
            "isa": {f: f in flags for f in wanted}}


def omp_max_threads() -> int | None:
    """omp_get_max_threads() of the libgomp flashattn's extension links (libgomp.so.1)."""
    import ctypes
    try:
        return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())
    except (OSError, AttributeError):
        return None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine shows here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def metadata(args, omp_env_before: str | None) -> dict:
    import flashattn
    import torch
    return {
        "benchmark": "flashattn CPU backend vs torch SDPA on CPU",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
        "commit": h.git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flashattn": flashattn.__version__,
        "flashattn_file": flashattn.__file__,
        "device": "cpu",
        **cpu_facts(),
        "logical_cpus": os.cpu_count(),
        "loadavg_start": load_average(),
        "threads": args.threads,
        "threads_torch": torch.get_num_threads(),
        "threads_flashattn_omp": omp_max_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "omp_num_threads_env_before": omp_env_before,
        "dtypes": args.dtypes,
        "layouts": {"ours": "(B, S, H, D)", "torch": "(B, H, S, D), contiguous"},
        "timing": {"method": "wall clock (time.perf_counter) around each call; rounds of "
                             "ours then torch; the check's call is the warm-up",
                   "min_time_s": args.min_time_s, "min_calls": args.repeat,
                   "max_calls": MAX_CALLS, "stat": "median and min seconds per call"},
        "flops": f"fwd 4*B*H*S*S*D (halved when causal); fwd+bwd {BACKWARD_FACTOR}x fwd",
        "check": {"tolerance": TOLERANCE, "reference_max_seqlen": REFERENCE_MAX_SEQLEN},
        "time_budget_s": args.time_budget_s,
    }


def table(rows: list[dict]) -> str:
    header = ["dtype", "mode", "shape", "ours GFLOP/s", "torch GFLOP/s", "ours/torch",
              "ours ms", "torch ms", "check"]
    body = []
    for row in rows:
        res = row.get("results") or {}
        ours, theirs = res.get("ours"), res.get("torch")
        if row.get("skipped"):
            state = "skipped"
        elif not row["check"].get("ok"):
            state = "FAILED"
        else:
            state = f"ok ({row['check']['against']})"
        ms = [h.fmt(r["median_s"] * 1e3, 2) if r else "n/a" for r in (ours, theirs)]
        body.append([row["dtype"], row["mode"], shape_of(row).label(),
                     h.fmt(ours and ours["gflops"]), h.fmt(theirs and theirs["gflops"]),
                     f"{row['ratio']:.2f}x" if row.get("ratio") else "", *ms, state])
    return h.markdown_table(header, body)


def main() -> int:
    args = parse_args()
    # Before torch and flashattn load their OpenMP runtimes, which read it once.
    omp_env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import flashattn  # noqa: F401  (loads the CPU backend's OpenMP with the count above)
    torch.set_num_threads(args.threads)
    meta = metadata(args, omp_env_before)
    print(f"{meta['cpu']}, {args.threads} threads (torch {meta['threads_torch']}, flashattn "
          f"OpenMP {meta['threads_flashattn_omp']}), torch {meta['torch']}, flashattn "
          f"{meta['flashattn']}", file=sys.stderr)

    began = time.monotonic()
    rows = []
    for point in points(args):
        elapsed = time.monotonic() - began
        if elapsed > args.time_budget_s:
            rows.append(dict(point, flops=flops_of(point), skipped=
                             f"time budget: {elapsed:.0f} s of --time-budget-s "
                             f"{args.time_budget_s:g} spent before this point"))
            continue
        try:
            row = measure(point, args)
        except Exception as e:  # ours (or torch) refusing a shape ends the row, not the run
            row = dict(point, flops=flops_of(point), check={"ok": False,
                                                            "error": h.first_line(e)})
        rows.append(row)
        res = row.get("results")
        print(f"{label(row)}: " + (f"ours {res['ours']['gflops']:.1f}, torch "
                                   f"{res['torch']['gflops']:.1f} GFLOP/s, ratio "
                                   f"{row['ratio']:.2f}" if res else "no time")
              + f", check {'ok' if row['check']['ok'] else 'FAILED ' + str(row['check'])}",
              file=sys.stderr, flush=True)

    failed = [r for r in rows if not r.get("skipped") and not r["check"]["ok"]]
    meta |= {"elapsed_s": round(time.monotonic() - began, 1), "loadavg_end": load_average(),
             "skipped": sum(1 for r in rows if r.get("skipped")),
             "checks_passed": not failed}
    h.write_json(args.out / "cpu.json", {"meta": meta, "rows": rows})
    text = table(rows)
    notes = "\n".join([f"- {label(r)}: check FAILED {r['check']}" for r in failed]
                      + ([f"- {meta['skipped']} points skipped: over --time-budget-s "
                          f"{args.time_budget_s:g}"] if meta["skipped"] else []))
    isa = ", ".join(f for f, present in meta["isa"].items() if present) or "none listed"
    head = (f"# {meta['benchmark']}\n\n{meta['date']}, commit {meta['commit']}, {meta['cpu']} "
            f"({isa}), {args.threads} threads (load average {meta['loadavg_start']} at the "
            f"start, {meta['loadavg_end']} at the end), torch {meta['torch']}, flashattn "
            f"{meta['flashattn']}; command: `{meta['command']}`\n\n")
    (args.out / "cpu.md").write_text(head + text + "\n" + (f"\n{notes}\n" if notes else ""))
    print(f"wrote cpu.json and cpu.md in {args.out}", file=sys.stderr)
    if notes:
        print(notes + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
