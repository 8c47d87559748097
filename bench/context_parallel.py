#!/usr/bin/env python3
"""Context parallelism: forward + backward of flashattn.distributed's ring attention over P
GPUs (one process per GPU, NCCL), against one GPU running flash_attn_func on S / P tokens.

For each mode (causal with the zigzag split, non-causal with the contiguous split) and each
total sequence length S (default 128k, 256k, 512k, 1M; bf16, head dim 128, 2048 / hdim heads,
batch 1), four timings of one training step of attention (the forward, then the backward of
sum(out * dout) through autograd), each the median over --iters iterations after --warmup:

  ring          ring_flash_attn_func on the S / P local tokens of every rank; an iteration's
                time is the slowest rank's (all ranks start together after a barrier).
  compute-only  the same calls (every step's masks, sizes and merges) on the rank's own K/V,
                no transfer: what the ring would cost if communication were free.
  comm-only     the ring's transfers alone, same buffers and order: (P - 1) K/V shifts in the
                forward, (P - 1) K/V shifts and P float32 dK/dV shifts in the backward.
  1 GPU         rank 0 alone (the others wait): flash_attn_func fwd + bwd on S / P tokens,
                same heads, head dim and mask.

Derived, per row:

  efficiency    = P x t(1 GPU, S / P) / t(ring, S). A rank of the ring does 1 / P of the
                  attention FLOPs of S, and attention FLOPs grow as S^2, so that is exactly P
                  times the FLOPs of one GPU at S / P (causal or not): the numerator is the
                  time the rank's work takes at the single-GPU rate. 1.0 is perfect scaling
                  (the ring's splitting, merging and communication cost nothing); a long
                  single call can be a little faster per FLOP than the ring's chunk calls.
  comm hidden   = 1 - max(0, t(ring) - t(compute-only)) / t(comm-only), clipped to [0, 1]:
                  the share of the transfers' own time that the compute covered.
  tokens/s      = batch x S / t(ring) for the ring, batch x S / P / t(1 GPU) for one GPU.
  TFLOP/s/GPU   the step's attention FLOPs (forward 4 S^2 H D, halved when causal, backward
                  2.5x that) / P / t(ring); for one GPU those of S / P / t(1 GPU).

Before timing, a check: the ring's output at a small length (--check-seqlen) against
flash_attn_func over the whole sequence on rank 0 (the same inputs, gathered).

Writes context_parallel.json (rows + metadata) and context_parallel.md in --out; prints the
table last. Exit status 1 when the check failed or a row could not run.

`--device cpu --world-size 2`: a smoke test of the whole path with Gloo on the CPU backend,
tiny sizes, in seconds (no measurement worth reading).

The full default sweep on 2 H100/H200 takes of the order of 10-15 minutes (the 1M causal
rows alone several minutes); pick lengths with --seqlens.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import traceback

import harness as h

MODES = {  # name -> (causal, layout)
    "causal-zigzag": (True, "zigzag"),
    "full-contiguous": (False, "contiguous"),
}
CUDA_SEQLENS = "131072,262144,524288,1048576"
CPU_SEQLENS = "256,512"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (head of this file) for the "
                                       "method and the definitions.")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: one process per GPU over NCCL; cpu: Gloo smoke test")
    p.add_argument("--world-size", type=int, default=2, help="ranks (GPUs); default 2")
    p.add_argument("--seqlens", default=None,
                   help=f"total sequence lengths, comma separated (default cuda {CUDA_SEQLENS}, "
                        f"cpu {CPU_SEQLENS})")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {list(MODES)}")
    p.add_argument("--hdim", type=int, default=None, help="head dim (default cuda 128, cpu 32)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 2048 // hdim "
                                                           "on cuda, 2 on cpu)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default cuda 3, cpu 2)")
    p.add_argument("--check-seqlen", type=int, default=None,
                   help="total length of the correctness check (default cuda 16384, cpu the "
                        "smallest of --seqlens)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu-results"))
    p.add_argument("--timeout-min", type=float, default=30.0,
                   help="the process group's timeout: a rank stuck this long raises")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    seqlens = args.seqlens or (CUDA_SEQLENS if cuda else CPU_SEQLENS)
    args.seqlens = [int(s) for s in seqlens.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; known {list(MODES)}")
    args.hdim = args.hdim or (128 if cuda else 32)
    args.heads = args.heads or (2048 // args.hdim if cuda else 2)
    args.kv_heads = args.kv_heads or args.heads
    args.iters = args.iters or (3 if cuda else 2)
    args.check_seqlen = args.check_seqlen or (16384 if cuda else min(args.seqlens))
    chunks = 2 * args.world_size
    for s in args.seqlens + [args.check_seqlen]:
        if s % chunks:
            p.error(f"sequence length {s}: expected a multiple of {chunks} (2 x --world-size: "
                    f"the zigzag split's chunks)")
    if cuda and args.dtype == "fp32":
        p.error("--dtype fp32: the CUDA backend takes fp16 and bf16")
    return args


# ---------------------------------------------------------------------------- one rank

def step_flops(args, seqlen: int, causal: bool) -> float:
    """Attention FLOPs of one forward + backward over `seqlen` tokens."""
    f = h.forward_flops(args.batch, args.heads, seqlen, seqlen, args.hdim, causal)
    return f + h.backward_flops(args.batch, args.heads, seqlen, seqlen, args.hdim, causal)


class Rank:
    def __init__(self, rank, args):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.args, self.rank = torch, dist, args, rank
        self.world = args.world_size
        self.cuda = args.device == "cuda"
        self.device = torch.device(f"cuda:{rank}") if self.cuda else torch.device("cpu")
        self.dtype = h.torch_dtype(args.dtype)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds`."""
        t = self.torch.tensor([seconds], dtype=self.torch.float64,
                              device=self.device if self.cuda else "cpu")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def timed(self, fn, alone=False) -> dict:
        """Median over --iters of fn()'s time (every rank's slowest unless `alone`)."""
        times = []
        for i in range(self.args.warmup + self.args.iters):
            if not alone:
                self.dist.barrier()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            dt = time.perf_counter() - t0
            if not alone:
                dt = self.slowest(dt)
            if i >= self.args.warmup:
                times.append(dt * 1e3)
        return {"ms": statistics.median(times), "samples_ms": times}

    def local(self, seqlen: int, seed: int):
        """This rank's q, k, v (requiring grad) and dout for a total length seqlen."""
        torch, a = self.torch, self.args
        g = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        n = seqlen // self.world

        def rand(heads):
            return torch.randn((a.batch, n, heads, a.hdim), generator=g, device=self.device,
                               dtype=self.dtype)

        q, k, v = rand(a.heads).requires_grad_(), rand(a.kv_heads).requires_grad_(), \
            rand(a.kv_heads).requires_grad_()
        return q, k, v, rand(a.heads)

    def ring_step(self, tensors, causal, layout, communicate=True):
        from flashattn import distributed as D
        q, k, v, dout = tensors

        def step():
            out = D._attention(q, k, v, None, 0.0, None, causal, (-1, -1), 0.0, None, False,
                               False, layout, communicate=communicate)
            self.torch.autograd.grad(out, (q, k, v), dout)
        return step

    def comm_step(self, tensors):
        """The ring's transfers of one forward + backward, without the compute."""
        from flashattn import distributed as D
        torch = self.torch
        q, k, v, _ = tensors
        ring = D._Ring(self.dist.group.WORLD)
        kv = D._Circulating(ring, torch.stack((k.detach(), v.detach())), tag=0)
        dkv = D._Circulating(ring, torch.zeros((2,) + tuple(k.shape), dtype=torch.float32,
                                               device=self.device), tag=1)

        def step():
            for _ in range(self.world - 1):  # forward
                kv.start()
                kv.finish()
            for i in range(self.world):      # backward
                if i + 1 < self.world:
                    kv.start()
                dkv.finish()
                dkv.start()
                kv.finish()
            dkv.finish()
        return step

    def single_step(self, seqlen_local, causal):
        """flash_attn_func fwd + bwd on one GPU over seqlen_local tokens."""
        import flashattn
        torch, a = self.torch, self.args
        g = torch.Generator(device=self.device).manual_seed(7)
        q, k, v, dout = (torch.randn((a.batch, seqlen_local, heads, a.hdim), generator=g,
                                     device=self.device, dtype=self.dtype)
                         for heads in (a.heads, a.kv_heads, a.kv_heads, a.heads))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():
            out = flashattn.flash_attn_func(q, k, v, causal=causal)
            torch.autograd.grad(out, (q, k, v), dout)
        return step

    def check(self, causal, layout) -> dict:
        """The ring's output against flash_attn_func over the whole sequence (rank 0)."""
        import flashattn
        from flashattn import distributed as D
        torch, a, s = self.torch, self.args, self.args.check_seqlen
        g = torch.Generator(device=self.device).manual_seed(1234)
        # The same generator on every rank: the same whole sequence everywhere.
        q, k, v = (torch.randn((a.batch, s, heads, a.hdim), generator=g, device=self.device,
                               dtype=self.dtype) for heads in (a.heads, a.kv_heads, a.kv_heads))
        local = [D.split_sequence(t, self.rank, self.world, layout) for t in (q, k, v)]
        out = D.ring_flash_attn_func(*local, causal=causal, layout=layout)
        parts = [torch.empty_like(out) for _ in range(self.world)]
        self.dist.all_gather(parts, out.contiguous())
        if self.rank != 0:
            return {}
        whole = D.unsplit_sequence(parts, layout)
        ref = flashattn.flash_attn_func(q, k, v, causal=causal)
        err = (whole.double() - ref.double()).abs().max().item()
        scale = ref.double().abs().max().item()
        bound = h.REFERENCE_TOLERANCE[a.dtype] * max(scale, 1.0)
        return {"seqlen": s, "max_abs_error": err, "bound": bound,
                "ok": bool(err <= bound), "against": "flash_attn_func over the whole sequence"}

    def row(self, mode, seqlen, seed) -> dict:
        causal, layout = MODES[mode]
        a = self.args
        row = {"mode": mode, "causal": causal, "layout": layout, "seqlen": seqlen,
               "world_size": self.world, "batch": a.batch, "heads": a.heads,
               "kv_heads": a.kv_heads, "hdim": a.hdim, "dtype": a.dtype}
        tensors = self.local(seqlen, seed)
        row["ring"] = self.timed(self.ring_step(tensors, causal, layout))
        row["compute_only"] = self.timed(self.ring_step(tensors, causal, layout, communicate=False))
        row["comm_only"] = self.timed(self.comm_step(tensors))
        del tensors
        self.release()
        self.dist.barrier()
        if self.rank == 0:
            row["single"] = self.timed(self.single_step(seqlen // self.world, causal), alone=True)
            self.release()
        self.dist.barrier()
        if self.rank == 0:
            derive(row, a)
        return row

    def release(self):
        import gc
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def derive(row: dict, args) -> None:
    p, s, causal = row["world_size"], row["seqlen"], row["causal"]
    ring, compute, comm = row["ring"]["ms"], row["compute_only"]["ms"], row["comm_only"]["ms"]
    single = row["single"]["ms"]
    flops = step_flops(args, s, causal)
    row["efficiency"] = p * single / ring
    exposed = max(0.0, ring - compute)
    row["exposed_comm_ms"] = exposed
    row["comm_hidden"] = min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else None
    row["tokens_per_s"] = args.batch * s / (ring / 1e3)
    row["single_tokens_per_s"] = args.batch * (s // p) / (single / 1e3)
    row["tflops_per_gpu"] = flops / p / (ring / 1e3) / 1e12
    row["single_tflops"] = step_flops(args, s // p, causal) / (single / 1e3) / 1e12


def rank_main(rank, args, init_file):
    import torch
    import torch.distributed as dist
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world_size))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(minutes=args.timeout_min),
                            **({"device_id": torch.device(f"cuda:{rank}")} if cuda else {}))
    me = Rank(rank, args)
    checks, rows, failed = {}, [], False
    try:
        for mode in args.modes:
            checks[mode] = me.check(*MODES[mode])
            for i, s in enumerate(args.seqlens):
                try:
                    row = me.row(mode, s, seed=i)
                except torch.cuda.OutOfMemoryError as e:  # every rank allocates alike
                    row = {"mode": mode, "seqlen": s, "error": h.first_line(e)}
                    me.release()
                rows.append(row)
                if rank == 0:
                    print(f"{mode} S={h.seqlen_label(s)}: "
                          + (f"ring {row['ring']['ms']:.1f} ms, efficiency {row['efficiency']:.2f}"
                             if "error" not in row else row["error"]), flush=True)
    except BaseException:
        traceback.print_exc()
        failed = True
    if rank == 0 and not failed:
        write_results(args, rows, checks)
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


# ---------------------------------------------------------------------------- output

def meta(args) -> dict:
    import flashattn
    import torch
    m = {"benchmark": "context_parallel",
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
         "commit": h.git_commit(), "host": platform.node(), "python": platform.python_version(),
         "torch": torch.__version__, "flashattn": flashattn.__version__,
         "device": args.device, "world_size": args.world_size, "dtype": args.dtype,
         "backend": "nccl" if args.device == "cuda" else "gloo",
         "timing": f"wall clock around one forward + backward after a barrier, the slowest "
                   f"rank's; median of {args.iters} after {args.warmup} warm-up",
         "definitions": {
             "efficiency": "world_size x t(1 GPU, S / world_size) / t(ring, S)",
             "comm_hidden": "1 - max(0, t(ring) - t(compute-only)) / t(comm-only), in [0, 1]",
             "tflops_per_gpu": "(forward 4 S^2 H D (/2 causal) + backward 2.5x) / world_size "
                               "/ t(ring)"}}
    if args.device == "cuda":
        m["gpu"] = torch.cuda.get_device_name(0)
        m["gpus"] = torch.cuda.device_count()
    return m


def table(rows: list[dict]) -> str:
    header = ["mode", "S", "ring ms", "tokens/s", "TFLOP/s/GPU", "1 GPU S/P ms",
              "1 GPU TFLOP/s", "efficiency", "compute-only ms", "comm-only ms", "comm hidden"]
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["mode"], h.seqlen_label(r["seqlen"]), r["error"]] + [""] * 8)
            continue
        hidden = "n/a" if r["comm_hidden"] is None else f"{100 * r['comm_hidden']:.0f}%"
        lines.append([r["mode"], h.seqlen_label(r["seqlen"]), h.fmt(r["ring"]["ms"]),
                      f"{r['tokens_per_s']:.4g}", h.fmt(r["tflops_per_gpu"]),
                      h.fmt(r["single"]["ms"]), h.fmt(r["single_tflops"]),
                      f"{r['efficiency']:.2f}", h.fmt(r["compute_only"]["ms"]),
                      h.fmt(r["comm_only"]["ms"]), hidden])
    return h.markdown_table(header, lines)


def write_results(args, rows, checks):
    document = {"meta": meta(args), "checks": checks, "rows": rows}
    h.write_json(args.out / "context_parallel.json", document)
    text = [f"# Context parallelism: ring attention over {args.world_size} "
            f"{'GPUs' if args.device == 'cuda' else 'CPU ranks'}", "",
            f"{args.dtype}, batch {args.batch}, {args.heads} heads ({args.kv_heads} K/V), "
            f"head dim {args.hdim}; {document['meta']['timing']}.", "",
            "efficiency = P x t(1 GPU, S/P) / t(ring, S) (equal FLOPs: 1.0 is perfect "
            "scaling); comm hidden = 1 - max(0, ring - compute-only) / comm-only.", ""]
    for mode, c in checks.items():
        text.append(f"Check {mode} at S = {c['seqlen']}: max |ring - whole| = "
                    f"{c['max_abs_error']:.3g} (bound {c['bound']:.3g}): "
                    f"{'ok' if c['ok'] else 'FAILED'}")
    text += ["", table(rows), ""]
    (args.out / "context_parallel.md").write_text("\n".join(text))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    if args.device == "cuda":
        import flashattn
        if torch.cuda.device_count() < args.world_size:
            sys.exit(f"--world-size {args.world_size}: torch sees {torch.cuda.device_count()} "
                     f"CUDA device(s) (--device cpu for the Gloo smoke test)")
        if not flashattn.cuda_compiled():
            sys.exit("--device cuda: the installed flashattn was built without CUDA")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_parallel.json").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="flashattn_cp_") as tmp:
        context = mp.spawn(rank_main, args=(args, os.path.join(tmp, "store")),
                           nprocs=args.world_size, join=False)
        try:
            while not context.join():
                pass
        except Exception as e:  # a rank failed: its traceback is above
            print(f"context_parallel: {h.first_line(e)}", file=sys.stderr)
            return 1
    document = json.loads((args.out / "context_parallel.json").read_text())
    failed = any(not c["ok"] for c in document["checks"].values()) or any(
        "error" in r for r in document["rows"])
    print(f"wrote {args.out / 'context_parallel.json'} and {args.out / 'context_parallel.md'}")
    print(table(document["rows"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
