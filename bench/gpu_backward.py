#!/usr/bin/env python3
"""flashattn GPU backward benchmark: ours against PyTorch SDPA's backward, one card.

The grid, dtype, input rotation and timing method are bench/gpu_forward.py's (its helpers are
imported from there; the systems of a config are timed side by side, in rotating rounds: first
the backward alone, then forward + backward): hdim 64/128/256 x seqlen 512..16k x causal, batch = 16384/seqlen,
heads = 2048/hdim, bf16, q/k/v/dout (B, S, H, D) standard normal. For every config:

  ours       bwd:     fa_backward (libflashattn_c.so, CUDA backend, default mode) given the
                      out and lse of our forward; dq/dk/dv preallocated.
             fwd+bwd: fa_forward then fa_backward.
  flash      torch SDPA forced to SDPBackend.FLASH_ATTENTION (PyTorch's vendored FA2),
  cudnn      ... CUDNN_ATTENTION,
  efficient  ... EFFICIENT_ATTENTION, each through torch autograd on the same inputs
             (requires_grad leaves, transposed (B, H, S, D) views):
             bwd:     torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) on the
                      output of one untimed forward;
             fwd+bwd: the forward and that backward.

TFLOP/s: fwd = 4*B*H*S*S*D (halved when causal), bwd = 2.5 fwd, fwd+bwd = 3.5 fwd.

Correctness: on the first seqlen of every (hdim, causal) group ours runs once on NaN-poisoned
gradients; dq, dk, dv of three (batch, head) slices (for dk/dv the key/value heads) are
compared with float64 autograd of the same slice, and the same for the first peer that runs;
ours fails when it has a non-finite element or an error above 3x the peer's plus a floor of
1e-3 x the slice's largest gradient (SPEC.md's gradient rule, with the peer as the plain
low-precision implementation).

Memory: at hdim 128 and --memory-seqlens (4k), the extra device memory of one forward +
backward per system: torch's peak allocation during it minus the allocation before (inputs
q, k, v and dout excluded; out, lse, gradients, autograd's saved tensors and the peers'
workspaces included); for ours plus fa_run_info.workspace_bytes of the backward (allocated
stream-ordered outside torch's allocator, freed before the call returns). Naive attention
(autograd through bf16 matmuls and softmax) is measured too.

Outputs in --out: results.json, results.md, backward_tflops.png (solid: bwd; dashed: fwd+bwd).
Exit status as gpu_forward.py: 0 ok, 1 a row of ours failed or was marked, 2 nothing ran.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_forward as fw  # noqa: E402  (the shared binding, grid, timing and output helpers)

PEERS = ("flash", "cudnn", "efficient")
BWD_FACTOR = 2.5
MEMORY_SYSTEMS = ("ours", "flash", "cudnn", "efficient", "naive")
DEFAULT_MEMORY_SEQLENS = (4096,)


def declare_backward(lib: fw.FlashAttnLib) -> None:
    t = ctypes.POINTER(fw.FaTensor)
    lib.dll.fa_backward.argtypes = [t] * 9 + [ctypes.POINTER(fw.FaOptions),
                                              ctypes.POINTER(fw.FaExecution),
                                              ctypes.POINTER(fw.FaRunInfo)]
    lib.dll.fa_backward.restype = ctypes.c_int


class BackwardCall:
    """One prepared fa_backward call (argument structs built once)."""

    def __init__(self, lib: fw.FlashAttnLib, tensors: Sequence[fw.FaTensor], causal: bool,
                 stream: int | None, deterministic: bool = False, keepalive: tuple = ()):
        self._lib = lib
        self._tensors = tuple(tensors)
        self.options = fw.FaOptions()
        lib.dll.fa_options_init(ctypes.byref(self.options))
        self.options.causal = int(bool(causal))
        self.options.deterministic = int(bool(deterministic))
        self.execution = fw.FaExecution()
        lib.dll.fa_execution_init(ctypes.byref(self.execution))
        self.execution.backend = fw.FA_BACKEND_CUDA
        self.execution.stream = ctypes.c_void_p(stream) if stream else None
        self.info = fw.FaRunInfo()
        lib.dll.fa_run_info_init(ctypes.byref(self.info))
        self._keepalive = keepalive
        self._args = tuple(ctypes.byref(x) for x in self._tensors) + (
            ctypes.byref(self.options), ctypes.byref(self.execution), ctypes.byref(self.info))

    def __call__(self) -> None:
        status = self._lib.dll.fa_backward(*self._args)
        if status != fw.FA_OK:
            raise fw.FlashAttnError(status, self._lib.last_error())


class Prepared:
    """A system ready on a config: per input set a backward-only and a forward+backward call,
    the gradients of the first set (for the check), and what the memory figure adds."""

    def __init__(self, bwd: list[Callable], fwdbwd: list[Callable],
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 grads: Callable[[], tuple] | None = None, workspace: Callable[[], int] | None = None):
        self.bwd, self.fwdbwd, self.context = bwd, fwdbwd, context
        self.grads, self.workspace = grads, workspace


def make_sets(cfg: fw.Config, dtype: str, rotate_bytes: int, seed: int) -> list[tuple]:
    """(q, k, v, dout) sets, (B, S, H, D) standard normal, rotating past L2 like the forward."""
    import torch
    dt = fw.torch_dtype(dtype)
    set_bytes = 4 * math.prod(cfg.shape) * torch.empty((), dtype=dt).element_size()
    n = min(fw.MAX_INPUT_SETS, max(2, math.ceil(rotate_bytes / set_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [tuple(torch.randn(cfg.shape, device="cuda", dtype=dt, generator=gen)
                  for _ in range(4)) for _ in range(n)]


def prepare_ours(lib: fw.FlashAttnLib | None, sets: list[tuple], causal: bool,
                 deterministic: bool = False) -> Prepared:
    import torch
    if lib is None:
        raise RuntimeError("the library could not be loaded (see the run's metadata)")
    if not lib.cuda_compiled():
        raise fw.NotAvailable("the library was built without the CUDA backend")
    stream = torch.cuda.current_stream().cuda_stream
    T = fw.fa_tensor_from_torch
    q0 = sets[0][0]
    b, s, h, _ = q0.shape
    dq, dk, dv = (torch.empty_like(q0) for _ in range(3))
    bwd, fwdbwd, calls = [], [], []
    for q, k, v, dout in sets:
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), device=q.device, dtype=torch.float32)
        forward = lib.prepare_forward(T(q), T(k), T(v), T(out), T(lse), causal,
                                      fw.FA_BACKEND_CUDA, stream, keepalive=(q, k, v, out, lse))
        backward = BackwardCall(lib, [T(x) for x in (q, k, v, out, dout, lse, dq, dk, dv)],
                                causal, stream, deterministic=deterministic,
                                keepalive=(q, k, v, out, dout, lse, dq, dk, dv))
        forward()  # out and lse for the backward-only timing
        calls.append(backward)
        bwd.append(backward)
        fwdbwd.append(lambda f=forward, g=backward: (f(), g()))
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        raise RuntimeError(f"our forward failed: {e}") from e

    def grads():
        for g in (dq, dk, dv):
            g.fill_(float("nan"))
        calls[0]()
        torch.cuda.synchronize()
        return dq, dk, dv
    return Prepared(bwd, fwdbwd, grads=grads, workspace=lambda: int(calls[0].info.workspace_bytes))


def prepare_peer(system: str, sets: list[tuple], causal: bool) -> Prepared:
    """SDPA with one backend forced, through autograd on (B, H, S, D) views of leaves."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, fw.SDPA_BACKENDS[system])
    context = lambda: sdpa_kernel([backend])  # noqa: E731
    bwd, fwdbwd, outputs = [], [], []
    for q, k, v, dout in sets:
        ql, kl, vl = (t.detach().requires_grad_(True) for t in (q, k, v))
        douth = dout.transpose(1, 2)

        def forward(ql=ql, kl=kl, vl=vl):
            return F.scaled_dot_product_attention(ql.transpose(1, 2), kl.transpose(1, 2),
                                                  vl.transpose(1, 2), is_causal=causal)
        with context():
            out = forward()
        bwd.append(functools.partial(torch.autograd.grad, out, (ql, kl, vl), douth,
                                     retain_graph=True))
        fwdbwd.append(lambda forward=forward, ql=ql, kl=kl, vl=vl, douth=douth:
                      torch.autograd.grad(forward(), (ql, kl, vl), douth))
        outputs.append(out)  # the graph the backward-only calls reuse

    def grads():
        with context():
            g = bwd[0]()
        torch.cuda.synchronize()
        return g
    return Prepared(bwd, fwdbwd, context=context, grads=grads)


def first_calls(system: str, prepared: Prepared) -> None:
    """The first backward and forward+backward, turning a refusal into NotAvailable."""
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with prepared.context():
                prepared.bwd[0]()
                prepared.fwdbwd[0]()
            torch.cuda.synchronize()
        except fw.FlashAttnError as e:
            if e.status == fw.FA_ERROR_UNSUPPORTED:
                raise fw.NotAvailable(e.message) from e
            raise
        except RuntimeError as e:
            if system == "ours" or "out of memory" in str(e).lower() or "CUDA error" in str(e):
                raise
            reasons = [str(w.message).strip().splitlines()[0] for w in caught]
            reasons = [r for r in reasons if r] or [str(e).strip().splitlines()[0]]
            raise fw.NotAvailable("; ".join(dict.fromkeys(reasons))[:400]) from e


# --- correctness -----------------------------------------------------------------------------

def reference_grads(q, k, v, dout, b: int, h: int, causal: bool):
    """Float64 autograd (dq, dk, dv) of query head h of batch b (dk/dv of its key head)."""
    import torch
    qs, ks, vs = (t[b, :, h, :].double().requires_grad_(True) for t in (q, k, v))
    scores = (qs @ ks.T) * (q.shape[-1] ** -0.5)
    if causal:
        s = scores.shape[0]
        scores = scores.masked_fill(torch.ones((s, s), dtype=torch.bool,
                                               device=q.device).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vs
    return torch.autograd.grad(out, (qs, ks, vs), dout[b, :, h, :].double())


def check(grads_ours: tuple, grads_peer: tuple | None, peer: str | None, sets: list[tuple],
          causal: bool) -> dict:
    q, k, v, dout = sets[0]
    B, _, H, _ = q.shape
    result: dict[str, Any] = {"nonfinite": int(sum((~g.isfinite()).sum() for g in grads_ours)),
                              "peer": peer}
    failed = []
    worst_ratio = 0.0
    for b, h in sorted({(0, 0), (B // 2, H // 2), (B - 1, H - 1)}):
        ref = reference_grads(q, k, v, dout, b, h, causal)
        for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
            r = ref[i]
            ours = grads_ours[i][b, :, h, :].double()
            err = float((ours - r).abs().max())
            floor = 1e-3 * float(r.abs().max())
            result[f"max_abs_{name}_vs_fp64"] = max(result.get(f"max_abs_{name}_vs_fp64", 0.0), err)
            if grads_peer is not None:
                # peers' grads are (B, H, S, D) views' gradients, i.e. (B, S, H, D) tensors
                peer_err = float((grads_peer[i][b, :, h, :].double() - r).abs().max())
                result[f"peer_max_abs_{name}_vs_fp64"] = max(
                    result.get(f"peer_max_abs_{name}_vs_fp64", 0.0), peer_err)
                allowed = 3 * peer_err + floor
                worst_ratio = max(worst_ratio, err / allowed)
                if not err <= allowed:
                    failed.append(f"{name} (b={b}, h={h}): max|ours-fp64| {err:.3g} > 3 x "
                                  f"{peer}'s {peer_err:.3g} + {floor:.3g}")
        del ref
    if result["nonfinite"]:
        failed.append(f"{result['nonfinite']} non-finite gradient elements")
    result["worst_error_over_allowed"] = worst_ratio
    result["ok"] = not failed
    result["failed"] = "; ".join(failed)
    return result


# --- memory ------------------------------------------------------------------------------------

def measure_memory(system: str, lib, inputs: tuple, causal: bool) -> dict:
    """Extra device memory of one forward + backward (see the module docstring)."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    workspace = 0
    if system == "ours":
        prepared = prepare_ours(lib, [inputs], causal)  # out, lse, dq, dk, dv + one forward
        prepared.fwdbwd[0]()
        torch.cuda.synchronize()
        workspace = prepared.workspace()
        del prepared
    elif system == "naive":
        q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(inputs))
        s, d = q.shape[1], q.shape[3]
        mask = (torch.ones((s, s), dtype=torch.bool, device=q.device).triu_(1) if causal
                else None)
        out = fw.naive_attention(q, k, v, mask, d ** -0.5)
        grads = torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))
        torch.cuda.synchronize()
        del out, grads, mask
    else:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k, v = (t.detach().requires_grad_(True) for t in inputs[:3])
        with sdpa_kernel([getattr(SDPBackend, fw.SDPA_BACKENDS[system])]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal)
            grads = torch.autograd.grad(out, (q, k, v), inputs[3].transpose(1, 2))
        torch.cuda.synchronize()
        del out, grads
    peak = torch.cuda.max_memory_allocated()
    return {"extra_bytes": int(peak - base + workspace), "torch_peak_minus_baseline":
            int(peak - base), "workspace_bytes": workspace}


# --- the run -------------------------------------------------------------------------------------

def base_row(cfg: fw.Config, system: str, dtype: str) -> dict:
    return {"system": system, "hdim": cfg.hdim, "causal": cfg.causal, "seqlen": cfg.seqlen,
            "batch": cfg.batch, "heads": cfg.heads, "dtype": dtype, "status": "ok",
            "reason": None, "bwd_ms": None, "bwd_tflops": None, "fwdbwd_ms": None,
            "fwdbwd_tflops": None, "check": None, "memory": None}


def prepare_row(system: str, cfg: fw.Config, sets: list[tuple], lib, args,
                reference_grads_of: dict | None) -> tuple[dict, Prepared | None]:
    """One row up to its timing: prepare, first calls, the gradients of the first set for the
    check (when reference_grads_of is given). Returns the row and the prepared system (None
    where it failed or was refused: the row says what happened)."""
    row = base_row(cfg, system, args.dtype)
    try:
        prepared = (prepare_ours(lib, sets, cfg.causal, args.deterministic) if system == "ours"
                    else prepare_peer(system, sets, cfg.causal))
        first_calls(system, prepared)
        if reference_grads_of is not None:
            with prepared.context():
                grads = prepared.grads()
            reference_grads_of[system] = tuple(g.detach().clone() for g in grads)
        if system == "ours":
            row["workspace_bytes"] = prepared.workspace()
        return row, prepared
    except Exception as e:
        fw.record_failure(row, e)
        return row, None


def time_rows(ready: dict[str, Prepared], config_rows: dict[str, dict], cfg: fw.Config,
              args) -> None:
    """The backward alone, then forward + backward, of every prepared system side by side
    (fw.time_interleaved), into their rows."""
    timed_bwd = fw.time_interleaved({s: (p.bwd, p.context) for s, p in ready.items()},
                                    args.target_s, args.repeat)
    timed_all = fw.time_interleaved({s: (p.fwdbwd, p.context) for s, p in ready.items()
                                     if timed_bwd[s].error is None}, args.target_s, args.repeat)
    for system, bwd in timed_bwd.items():
        row = config_rows[system]
        both = timed_all.get(system)
        error = bwd.error or (both.error if both else None)
        if error is not None:
            fw.record_failure(row, error)
            continue
        t_bwd, t_all = bwd.timing, both.timing
        row.update(bwd_ms=t_bwd.ms, bwd_ms_min=t_bwd.ms_min, bwd_ms_max=t_bwd.ms_max,
                   bwd_reps=t_bwd.reps, timed_windows=bwd.windows,  # the backward's
                   bwd_tflops=BWD_FACTOR * cfg.flops / (t_bwd.ms * 1e-3) / 1e12,
                   fwdbwd_ms=t_all.ms, fwdbwd_reps=t_all.reps,
                   fwdbwd_tflops=(1 + BWD_FACTOR) * cfg.flops / (t_all.ms * 1e-3) / 1e12)


def run_benchmark(args, meta: dict, lib) -> list[dict]:
    import torch
    systems = ["ours"] + ([] if args.skip_peers else list(args.peers))
    grid = fw.build_grid(args)
    checked: set[tuple[int, bool]] = set()
    rows: list[dict] = []
    started = time.monotonic()
    healthy = True
    for index, cfg in enumerate(grid):
        if time.monotonic() - started > args.time_budget_s or not healthy:
            reason = ("time budget (--time-budget-s) spent" if healthy
                      else "CUDA context lost earlier in the run")
            rows += [{**base_row(cfg, s, args.dtype), "status": "skipped", "reason": reason}
                     for s in systems]
            continue
        try:
            sets = make_sets(cfg, args.dtype, args.rotate_mib * fw.MIB, args.seed + index)
        except Exception as e:
            rows += [{**base_row(cfg, s, args.dtype), "status": "error",
                      "reason": "inputs: " + fw.first_line(e)} for s in systems]
            continue
        do_check = (cfg.hdim, cfg.causal) not in checked
        grads: dict | None = {} if do_check else None
        config_rows = {}
        ready: dict[str, Prepared] = {}
        for system in systems:
            row, prepared = prepare_row(system, cfg, sets, lib, args, grads)
            config_rows[system] = row
            rows.append(row)
            if prepared is not None:
                ready[system] = prepared
            if row["status"] == "error" and not fw.cuda_healthy():
                healthy = False
                break
        if healthy and ready:
            time_rows(ready, config_rows, cfg, args)
            if any(r["status"] == "error" for r in config_rows.values()):
                healthy = fw.cuda_healthy()
        del ready
        if do_check and healthy and grads and "ours" in grads:
            checked.add((cfg.hdim, cfg.causal))
            peer = next((p for p in PEERS if p in grads), None)
            try:
                config_rows["ours"]["check"] = check(grads["ours"], grads.get(peer), peer, sets,
                                                     cfg.causal)
            except Exception as e:
                config_rows["ours"]["check"] = {"ok": False,
                                                "failed": "the check raised " + fw.first_line(e)}
        del grads
        if healthy and cfg.hdim == fw.MEMORY_HDIM and cfg.seqlen in args.memory_seqlens:
            for system in MEMORY_SYSTEMS:
                if system == "naive":
                    if fw.naive_bytes(cfg, 2) * 2 > args.naive_budget_gib * fw.GIB:
                        continue
                    row = {**base_row(cfg, "naive", args.dtype), "status": "memory only"}
                    rows.append(row)
                else:
                    row = config_rows.get(system)
                    if row is None or row["status"] != "ok":
                        continue
                try:
                    row["memory"] = measure_memory(system, lib, sets[0], cfg.causal)
                except Exception as e:
                    row["memory"] = {"error": fw.first_line(e)}
                torch.cuda.empty_cache()
        del sets
        torch.cuda.empty_cache()
        print_progress(cfg, config_rows)
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        write_outputs(args.out, meta, rows, chart=False)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    return rows


def print_progress(cfg: fw.Config, config_rows: dict) -> None:
    cells = [f"{s} {r['bwd_tflops']:6.1f}/{r['fwdbwd_tflops']:6.1f}" if r["status"] == "ok"
             else f"{s} {r['status']}" for s, r in config_rows.items()]
    print(f"{cfg.label()}: " + "  ".join(cells) + "  TFLOP/s bwd/fwd+bwd", flush=True)
    for s, r in config_rows.items():
        if r["status"] in ("error", "n/a") and r["reason"]:
            print(f"    {s}: {r['status']}: {r['reason'][:200]}", flush=True)
        if r.get("check"):
            c = r["check"]
            print(f"    check {'ok' if c['ok'] else 'FAILED: ' + c['failed']}: max|dq,dk,dv-fp64| "
                  f"{fw.fmt_e(c.get('max_abs_dq_vs_fp64'))}, {fw.fmt_e(c.get('max_abs_dk_vs_fp64'))}, "
                  f"{fw.fmt_e(c.get('max_abs_dv_vs_fp64'))} (peer {c.get('peer')})", flush=True)


# --- outputs -------------------------------------------------------------------------------------

def cell(row: dict | None, key: str) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return {"n/a": "n/a", "skipped": "skip", "error": "err"}.get(row["status"], "")
    mark = " (!)" if row.get("check") and not row["check"]["ok"] else ""
    return f"{row[key]:.1f}{mark}"


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if a and b and a["status"] == "ok" and b["status"] == "ok":
        return a[key] / b[key]
    return None


def performance_table(rows: list[dict], key: str) -> str:
    by = {(r["hdim"], r["causal"], r["seqlen"], r["system"]): r for r in rows}
    configs = sorted({(r["hdim"], r["causal"], r["seqlen"]) for r in rows})
    lines = ["| hdim | causal | seqlen | ours | flash | cudnn | efficient | ours/flash | "
             "ours/cudnn |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for h, c, s in configs:
        cells = {x: by.get((h, c, s, x)) for x in ("ours",) + PEERS}
        ratios = [ratio(cells["ours"], cells[p], key) for p in ("flash", "cudnn")]
        lines.append(f"| {h} | {'yes' if c else 'no'} | {fw.seqlen_label(s)} | " +
                     " | ".join(cell(x, key) for x in cells.values()) + " | " +
                     " | ".join("" if r is None else f"{r:.2f}" for r in ratios) + " |")
    return "\n".join(lines)


def min_ratio_line(rows: list[dict], peer: str, key: str) -> str:
    by = {(r["hdim"], r["causal"], r["seqlen"], r["system"]): r for r in rows}
    found = [(ratio(r, by.get((h, c, s, peer)), key), h, c, s)
             for (h, c, s, system), r in by.items() if system == "ours"]
    found = [f for f in found if f[0] is not None]
    if not found:
        return f"min ours/{peer} {key} ratio: n/a"
    r, h, c, s = min(found)
    return (f"min ours/{peer} {key} ratio over the grid: {r:.3f} (hdim {h}, "
            f"{'causal' if c else 'non-causal'}, seqlen {fw.seqlen_label(s)}; {len(found)} configs)")


def memory_table(rows: list[dict]) -> str:
    measured = [r for r in rows if r.get("memory") and "extra_bytes" in r["memory"]]
    if not measured:
        return ""
    lines = ["| hdim | causal | seqlen | system | fwd+bwd extra MiB | of which workspace MiB |",
             "|---:|---|---:|---|---:|---:|"]
    for r in sorted(measured, key=lambda r: (r["hdim"], r["causal"], r["seqlen"],
                                             MEMORY_SYSTEMS.index(r["system"]))):
        m = r["memory"]
        lines.append(f"| {r['hdim']} | {'yes' if r['causal'] else 'no'} | "
                     f"{fw.seqlen_label(r['seqlen'])} | {r['system']} | "
                     f"{m['extra_bytes'] / fw.MIB:,.1f} | {m['workspace_bytes'] / fw.MIB:,.1f} |")
    return "\n".join(lines)


def checks_table(rows: list[dict]) -> str:
    checked = [r for r in rows if r.get("check")]
    if not checked:
        return ""
    lines = ["| hdim | causal | seqlen | dq vs fp64 | dk vs fp64 | dv vs fp64 | peer | "
             "worst error / allowed | result |", "|---:|---|---:|---:|---:|---:|---|---:|---|"]
    for r in checked:
        c = r["check"]
        lines.append(f"| {r['hdim']} | {'yes' if r['causal'] else 'no'} | "
                     f"{fw.seqlen_label(r['seqlen'])} | {fw.fmt_e(c.get('max_abs_dq_vs_fp64'))} | "
                     f"{fw.fmt_e(c.get('max_abs_dk_vs_fp64'))} | "
                     f"{fw.fmt_e(c.get('max_abs_dv_vs_fp64'))} | {c.get('peer') or '-'} | "
                     f"{c.get('worst_error_over_allowed', 0):.2f} | "
                     f"{'ok' if c['ok'] else 'FAILED: ' + c['failed']} |")
    return "\n".join(lines)


def render_markdown(meta: dict, rows: list[dict]) -> str:
    head = (f"# flashattn backward, {meta['dtype']}, {meta['device']}\n\n"
            f"{meta['date']}; torch {meta['torch']} (CUDA {meta['torch_cuda']}, cuDNN "
            f"{meta['cudnn']}); flashattn {meta['library_version']}; batch = {fw.TOKENS}/seqlen, "
            f"heads = {fw.MODEL_WIDTH}/hdim. TFLOP/s with fwd = 4*B*H*S*S*D (halved when "
            f"causal), bwd = 2.5 fwd; median of CUDA-event-timed calls over rotating inputs. "
            f"`(!)`: ours failed its correctness check on that config.\n\n`{meta['command']}`\n")
    parts = [head, "## Backward TFLOP/s\n", performance_table(rows, "bwd_tflops"), "",
             min_ratio_line(rows, "flash", "bwd_tflops"), "",
             min_ratio_line(rows, "cudnn", "bwd_tflops"), "",
             "## Forward + backward TFLOP/s\n", performance_table(rows, "fwdbwd_tflops"), "",
             min_ratio_line(rows, "flash", "fwdbwd_tflops"), ""]
    for title, table in (("## Correctness of ours", checks_table(rows)),
                         ("## Forward + backward extra memory", memory_table(rows))):
        if table:
            parts += [title + "\n", table, ""]
    notes = fw.notes_list([r for r in rows if r["status"] != "memory only"])
    if notes:
        parts += ["## Notes\n", notes, ""]
    return "\n".join(parts)


def plot_chart(path: str, meta: dict, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r["system"] in ("ours",) + PEERS]
    hdims = sorted({r["hdim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    colors = {"ours": "#d62728", "flash": "#1f77b4", "cudnn": "#2ca02c", "efficient": "#9467bd"}
    by = {(r["hdim"], r["causal"], r["seqlen"], r["system"]): r for r in rows}
    fig, axes = plt.subplots(len(causals), len(hdims), squeeze=False, sharex=True,
                             figsize=(4.6 * len(hdims), 3.6 * len(causals)))
    for i, causal in enumerate(causals):
        for j, hdim in enumerate(hdims):
            ax = axes[i][j]
            for system in ("ours",) + PEERS:
                for key, ls, label in (("bwd_tflops", "-", system),
                                       ("fwdbwd_tflops", "--", f"{system} fwd+bwd")):
                    pts = [(s, by[(hdim, causal, s, system)][key]) for s in seqlens
                           if by.get((hdim, causal, s, system), {}).get("status") == "ok"]
                    if pts:
                        ax.plot(*zip(*pts), ls=ls, color=colors[system], marker="o",
                                ms=6 if system == "ours" else 3,
                                lw=2.5 if system == "ours" else 1.3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([fw.seqlen_label(s) for s in seqlens])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"hdim {hdim}, {'causal' if causal else 'non-causal'}")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(causals) - 1:
                ax.set_xlabel("sequence length")
    handles, labels = [], []
    for ax in axes.flat:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(hnd)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False)
    fig.suptitle(f"Attention backward (solid) and forward+backward (dashed), {meta['dtype']}, "
                 f"{meta['device']}")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_outputs(out_dir: str, meta: dict, rows: list[dict], chart: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(fw.json_safe({"meta": meta, "rows": rows}), f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(render_markdown(meta, rows))
    if chart and rows:
        plot_chart(os.path.join(out_dir, "backward_tflops.png"), meta, rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="flashattn GPU backward benchmark against torch SDPA (flash, cudnn, "
                    "efficient) backward through autograd.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lib", default="build-gpu/src/libflashattn_c.so")
    p.add_argument("--out", default="bench-gpu-backward", help="output folder")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--hdims", type=fw.int_list(int), default=list(fw.DEFAULT_HDIMS))
    p.add_argument("--seqlens", type=fw.int_list(fw.parse_seqlen),
                   default=list(fw.DEFAULT_SEQLENS))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--target-s", type=float, default=0.3)
    p.add_argument("--rotate-mib", type=int, default=256)
    p.add_argument("--naive-budget-gib", type=float, default=40.0,
                   help="skip naive's memory figure where its fwd+bwd would exceed this")
    p.add_argument("--memory-seqlens", type=fw.int_list(fw.parse_seqlen),
                   default=list(DEFAULT_MEMORY_SEQLENS))
    p.add_argument("--time-budget-s", type=float, default=480.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--peers", type=fw.peer_list_of(PEERS), default=list(PEERS),
                   help="comma-separated subset of " + ",".join(PEERS) + " (default: all)")
    p.add_argument("--deterministic", action="store_true",
                   help="run ours in deterministic mode (fixed-order dQ, no atomics)")
    p.add_argument("--skip-peers", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.hdims = [h for h in args.hdims if h in fw.QUICK_HDIMS] or list(fw.QUICK_HDIMS)
        args.seqlens = [s for s in args.seqlens if s in fw.QUICK_SEQLENS] or list(fw.QUICK_SEQLENS)
        args.repeat = min(args.repeat, 10)
        args.target_s = min(args.target_s, 0.1)
        if not set(args.memory_seqlens) & set(args.seqlens):
            args.memory_seqlens = [max(args.seqlens)]
    for s in args.seqlens:
        if s <= 0 or fw.TOKENS % s:
            p.error(f"seqlen {s}: must divide {fw.TOKENS}")
    for h in args.hdims:
        if h <= 0 or fw.MODEL_WIDTH % h:
            p.error(f"hdim {h}: must divide {fw.MODEL_WIDTH}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to benchmark", file=sys.stderr)
        return 2
    lib, lib_error = None, None
    try:
        lib = fw.FlashAttnLib(args.lib)
        declare_backward(lib)
    except Exception as e:
        lib_error = fw.first_line(e)
        print(f"ours: cannot load {args.lib}: {lib_error}", file=sys.stderr)
    meta = fw.run_metadata(args, lib, lib_error)
    meta["benchmark"] = "flashattn GPU backward"
    meta["ours_mode"] = "deterministic" if args.deterministic else "default (dQ by atomics)"
    meta["flops"] = "fwd 4*B*H*S*S*D (halved when causal), bwd 2.5 fwd, fwd+bwd 3.5 fwd"
    meta["memory"] = ("extra_bytes = peak torch allocation during one forward + backward minus "
                      "the allocation before (inputs and dout excluded), plus, for ours, the "
                      "backward's reported workspace_bytes (stream-ordered, outside torch)")
    meta.pop("naive", None)
    print(f"{meta['device']}, torch {meta['torch']}, flashattn {meta['library_version']}, "
          f"{args.dtype}", flush=True)
    torch.manual_seed(args.seed)
    rows: list[dict] = []
    try:
        rows = run_benchmark(args, meta, lib)
    finally:
        try:
            write_outputs(args.out, meta, rows, chart=True)
        except Exception as e:
            print(f"writing the outputs failed: {fw.first_line(e)}", file=sys.stderr)
    print()
    print(performance_table(rows, "bwd_tflops"))
    print(min_ratio_line(rows, "flash", "bwd_tflops"))
    print(min_ratio_line(rows, "cudnn", "bwd_tflops"))
    print(memory_table(rows))
    bad = [r for r in rows if r["system"] == "ours" and (
        r["status"] == "error" or (r.get("check") and not r["check"]["ok"]))]
    if bad:
        print(f"ours: {len(bad)} config(s) failed or were marked (see results.md)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
