"""Trains the GPT of model.py on real text that needs no download: the bytes of this Python's
standard library sources (a byte-level vocabulary), with AdamW, mixed precision and, where
asked, torch.compile on the blocks' other parts. Prints a progress line per step (loss,
tokens/s, model TFLOP/s); writes the loss curve (CSV, and PNG when matplotlib is there) and
a checkpoint that generate.py samples from.

    python examples/gpt/train.py                                   # small, CPU, minutes
    python examples/gpt/train.py --size 125m --seqlen 2048 --batch 16 --device cuda --dtype bf16
    python examples/gpt/train.py --attention sdpa-cudnn ...        # the same model on SDPA

Model TFLOP/s count 6 FLOPs per weight per token plus causal attention's 6 L S d
(Config.flops_per_token); --peak-tflops turns them into MFU.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from model import ATTENTIONS, GPT, SIZES, autocast  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def corpus(megabytes: float) -> torch.Tensor:
    """Up to `megabytes` of the standard library's .py files as one byte tensor, in a fixed
    (sorted) order so that every run reads the same text."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    limit, chunks, size = int(megabytes * 2 ** 20), [], 0
    for path in sorted(root.rglob("*.py")):
        if size >= limit:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
    if size == 0:
        raise SystemExit(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, seqlen: int, generator: torch.Generator):
    """Random windows of seqlen + 1 bytes: inputs and next-byte targets."""
    while True:
        starts = torch.randint(0, len(data) - seqlen - 1, (batch,), generator=generator)
        window = torch.stack([data[s:s + seqlen + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--attention", default="flashattn", choices=ATTENTIONS)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up, then cosine decay")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--compile", action="store_true", help="torch.compile the model (attention stays one op)")
    p.add_argument("--corpus-mb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense peak, for MFU")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpt-run"))
    p.add_argument("--quiet", action="store_true", help="no progress line per step")
    args = p.parse_args(argv)
    cfg = SIZES[args.size]
    if args.seqlen > cfg.max_seqlen:
        raise SystemExit(f"--seqlen: expected at most {cfg.max_seqlen} for --size {args.size}, given {args.seqlen}")

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    data = corpus(args.corpus_mb)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    model = GPT(cfg, args.attention).to(args.device)
    step_model = torch.compile(model) if args.compile else model
    dtype = DTYPES[args.dtype]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))))
    device_type = torch.device(args.device).type
    print(f"GPT {args.size}: {cfg.parameters() / 1e6:.1f}M parameters, {args.attention}, {args.dtype}, "
          f"batch {args.batch} x {args.seqlen}, {len(train) / 2 ** 20:.1f} MiB of text", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    losses, stream, tokens_per_step = [], batches(train, args.batch, args.seqlen, generator), args.batch * args.seqlen
    timed_tokens, timed_seconds = 0, 0.0
    for step in range(args.steps):
        x, y = (t.to(args.device, non_blocking=True) for t in next(stream))
        start = time.perf_counter()
        with autocast(device_type, dtype):
            logits = step_model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        value = loss.item()  # also waits for the step's device work
        seconds = time.perf_counter() - start
        if step >= min(3, args.steps - 1):  # the first steps compile and warm up
            timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + seconds
        losses.append(value)
        if not math.isfinite(value):
            print(f"\nstep {step}: loss {value}: stopping", file=sys.stderr)
            return 1
        if not args.quiet:
            print(f"\rstep {step + 1}/{args.steps} loss {value:.4f} "
                  f"{tokens_per_step / seconds:,.0f} tokens/s", end="", flush=True)
    print()
    rate = timed_tokens / timed_seconds if timed_seconds > 0 else float("nan")
    tflops = rate * cfg.flops_per_token(args.seqlen) / 1e12
    with torch.no_grad(), autocast(device_type, dtype):
        vx, vy = (t.to(args.device) for t in next(batches(val, args.batch, args.seqlen, generator)))
        val_loss = F.cross_entropy(model(vx).float().flatten(0, 1), vy.flatten()).item()
    summary = {"size": args.size, "attention": args.attention, "dtype": args.dtype, "device": args.device,
               "batch": args.batch, "seqlen": args.seqlen, "steps": args.steps,
               "parameters": cfg.parameters(), "first_loss": losses[0], "last_loss": losses[-1],
               "val_loss": val_loss, "tokens_per_s": rate, "model_tflops": tflops,
               "mfu": tflops / args.peak_tflops if args.peak_tflops > 0 else None}
    print(json.dumps(summary))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "loss.csv").write_text("step,loss\n" + "".join(f"{i + 1},{v}\n" for i, v in enumerate(losses)))
    torch.save({"config": cfg.__dict__, "size": args.size, "model": model.state_dict()}, args.out / "model.pt")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(losses) + 1), losses, label=args.attention)
        ax.set(xlabel="step", ylabel="training loss (nats / byte)", title=f"GPT {args.size}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "loss.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: loss.csv only", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
