"""The end-to-end comparison of issue 33: the same GPT (same initial weights, same batches)
trained with each attention in one process, then generation; tokens/s, model TFLOP/s and MFU,
and the loss curves overlaid.

    python examples/gpt/benchmark.py --device cuda --out gpt-bench        # 125m and 1.3b, 2k and 8k
    python examples/gpt/benchmark.py --sizes tiny --seqlens 64 --device cpu --dtype fp32 \\
        --attentions flashattn sdpa-math --steps 3 --gen-batches 1 --gen-tokens 8   # a smoke run

Training: --tokens-per-step tokens a step (batch = tokens / seqlen), AdamW, autocast in
--dtype, --warmup untimed steps then --steps timed ones (each synchronised), the attentions'
steps interleaved step by step so that clock changes touch all alike. Model FLOPs per token are
Config.flops_per_token (6 per weight, 6 L S d for causal attention); MFU divides by
--peak-tflops (the H200's dense bf16 datasheet figure by default: say which in any table).
Generation: a --prompt-tokens prefill, then --gen-tokens one-token steps, eager, per batch
size. Writes benchmark.json, benchmark.md and, with matplotlib, loss.png in --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from model import ATTENTIONS, GPT, SIZES, autocast  # noqa: E402
from train import DTYPES, batches, corpus  # noqa: E402


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_all(args, size, seqlen, data):
    """Every attention's model from one initial state on the same batches, step by step."""
    cfg = SIZES[size]
    batch = max(1, args.tokens_per_step // seqlen)
    torch.manual_seed(args.seed)
    models = {}
    for attention in args.attentions:
        model = GPT(cfg, attention)
        if models:
            model.load_state_dict(next(iter(models.values()))[0].state_dict())
        model = model.to(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        models[attention] = (model, opt)
    stream = batches(data, batch, seqlen, torch.Generator().manual_seed(args.seed))
    device_type = torch.device(args.device).type
    losses = {a: [] for a in args.attentions}
    seconds = {a: 0.0 for a in args.attentions}
    for step in range(args.warmup + args.steps):
        x, y = (t.to(args.device) for t in next(stream))
        for attention, (model, opt) in models.items():
            synchronize(args.device)
            start = time.perf_counter()
            with autocast(device_type, DTYPES[args.dtype]):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            synchronize(args.device)
            if step >= args.warmup:
                seconds[attention] += time.perf_counter() - start
            losses[attention].append(loss.item())
    rows = []
    for attention in args.attentions:
        rate = args.steps * batch * seqlen / seconds[attention]
        tflops = rate * cfg.flops_per_token(seqlen) / 1e12
        rows.append({"size": size, "seqlen": seqlen, "batch": batch, "attention": attention,
                     "parameters": cfg.parameters(), "tokens_per_s": rate, "model_tflops": tflops,
                     "mfu": tflops / args.peak_tflops, "losses": losses[attention]})
    return rows, {a: m for a, (m, _) in models.items()}


def generate_all(args, size, models):
    rows = []
    for gen_batch in args.gen_batches:
        prompt = torch.randint(0, 256, (gen_batch, args.prompt_tokens), device=args.device,
                               generator=torch.Generator(device=args.device).manual_seed(args.seed))
        for attention, model in models.items():
            model.eval()
            with autocast(torch.device(args.device).type, DTYPES[args.dtype]):
                model.generate(prompt, 4, temperature=0)  # warm-up
                synchronize(args.device)
                start = time.perf_counter()
                model.generate(prompt, args.gen_tokens, temperature=0)
                synchronize(args.device)
            seconds = time.perf_counter() - start
            rows.append({"size": size, "attention": attention, "batch": gen_batch,
                         "prompt_tokens": args.prompt_tokens, "new_tokens": args.gen_tokens,
                         "tokens_per_s": gen_batch * args.gen_tokens / seconds})
            model.train()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["125m", "1.3b"], choices=sorted(SIZES))
    p.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--attentions", nargs="+", default=["flashattn", "sdpa-cudnn", "sdpa-flash"], choices=ATTENTIONS)
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense peak for MFU (default: the H100/H200 SXM datasheet's bf16 figure)")
    p.add_argument("--gen-batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--corpus-mb", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpt-bench"))
    args = p.parse_args(argv)
    data = corpus(args.corpus_mb)
    training, generation = [], []
    for size in args.sizes:
        models = None
        for seqlen in args.seqlens:
            if seqlen > SIZES[size].max_seqlen:
                raise SystemExit(f"--seqlens: {seqlen} is past {size}'s max_seqlen {SIZES[size].max_seqlen}")
            rows, models = train_all(args, size, seqlen, data)
            training += rows
            for r in rows:
                print(f"train {size} s{seqlen} b{r['batch']} {r['attention']}: {r['tokens_per_s']:,.0f} tokens/s, "
                      f"{r['model_tflops']:.1f} TFLOP/s, MFU {r['mfu']:.3f}, loss {r['losses'][0]:.3f} -> "
                      f"{r['losses'][-1]:.3f}", flush=True)
        generation += generate_all(args, size, models)
        del models
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else args.device,
            "torch": torch.__version__, "dtype": args.dtype, "peak_tflops": args.peak_tflops,
            "command": " ".join(sys.argv)}
    (args.out / "benchmark.json").write_text(json.dumps({"meta": meta, "training": training,
                                                         "generation": generation}, indent=1) + "\n")
    lines = [f"# GPT end to end ({meta['device']}, {args.dtype}, peak {args.peak_tflops} TFLOP/s for MFU)", "",
             "| size | seqlen | batch | attention | tokens/s | model TFLOP/s | MFU | vs first |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in training:
        first = next(x for x in training if x["size"] == r["size"] and x["seqlen"] == r["seqlen"])
        lines.append(f"| {r['size']} | {r['seqlen']} | {r['batch']} | {r['attention']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['model_tflops']:.1f} | {r['mfu']:.3f} | {r['tokens_per_s'] / first['tokens_per_s']:.2f}x |")
    lines += ["", "| size | batch | attention | generated tokens/s |", "|---|---:|---|---:|"]
    lines += [f"| {r['size']} | {r['batch']} | {r['attention']} | {r['tokens_per_s']:,.1f} |" for r in generation]
    table = "\n".join(lines) + "\n"
    (args.out / "benchmark.md").write_text(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in training:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['size']} s{r['seqlen']} {r['attention']}")
        ax.set(xlabel="step", ylabel="training loss (nats / byte)", title="same initial weights, same batches")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out / "loss.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no loss.png", file=sys.stderr)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
