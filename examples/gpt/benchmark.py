"""The end-to-end comparison of issue 33: the same GPT (same initial weights, same batches)
trained with each attention in one process, then generation; tokens/s, model TFLOP/s and MFU,
and the loss curves overlaid.

    python examples/gpt/benchmark.py --device cuda --out gpt-bench        # 125m and 1.3b, 2k and 8k
    python examples/gpt/benchmark.py --sizes tiny --seqlens 64 --device cpu --dtype fp32 \\
        --attentions flashattn sdpa-math --steps 3 --gen-batches 1 --gen-tokens 8   # a smoke run

Training: --tokens-per-step tokens a step (batch = tokens / seqlen) in micro-batches of at
most --micro-tokens, AdamW, autocast in --dtype, --warmup untimed steps then --steps timed ones
(each synchronised). The attentions train one after the other from the same initial weights
on the same batches (one model resident at a time: 1.3B parameters with AdamW take 21 GB), in
--rounds rounds whose order rotates; --profile-kernels adds each one's kernel times; --compile
runs each model through torch.compile.
Model FLOPs per token are Config.flops_per_token (6 per weight, 6 L S d for causal attention);
MFU divides by --peak-tflops (the H100/H200 SXM dense bf16 datasheet figure by default: say
which in any table). Generation: greedy, from the initial weights, a --prompt-tokens prefill
then --gen-tokens one-token steps per batch size, eager for every attention and, on CUDA,
flashattn with each step replayed from a CUDA graph (its tokens checked against its eager
run). Writes benchmark.json, benchmark.md and, with matplotlib, loss.png in --out; --render
JSON writes the last two again from a benchmark.json.
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


def train_all(args, size, seqlen, data, initial):
    """Every attention's model from the same initial weights on the same batches, one after
    the other (only one model and its optimizer state are resident: the 1.3B one with AdamW
    holds 21 GB). A step of --tokens-per-step tokens runs as micro-batches of at most
    --micro-tokens (gradients accumulated), so that activations fit at every length. The
    attentions take turns in --rounds rounds whose order rotates (round r starts with the r-th),
    each round from the initial weights: a system's place in the process (the first model's
    allocations, clocks) then touches all alike; tokens/s is over every round's timed steps.
    With --profile-kernels, one more step of each attention in the first round runs under
    torch.profiler and its kernels' device time is recorded, largest first."""
    cfg = SIZES[size]
    batch = max(1, args.tokens_per_step // seqlen)
    micro = max(1, min(batch, args.micro_tokens // seqlen))
    device_type = torch.device(args.device).type
    rows = {a: {"size": size, "seqlen": seqlen, "batch": batch, "micro_batch": micro, "attention": a,
                "parameters": cfg.parameters(), "tokens_per_s_rounds": [], "places": []} for a in args.attentions}
    for round_index in range(args.rounds):
        shift = round_index % len(args.attentions)
        for place, attention in enumerate(args.attentions[shift:] + args.attentions[:shift]):
            model = load(cfg, attention, initial, args.device)
            step_model = torch.compile(model) if args.compile else model
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
            stream = batches(data, batch, seqlen, torch.Generator().manual_seed(args.seed))

            def step():
                x, y = (t.to(args.device) for t in next(stream))
                synchronize(args.device)
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), device=args.device)
                for xs, ys in zip(x.split(micro), y.split(micro)):
                    with autocast(device_type, DTYPES[args.dtype]):
                        logits = step_model(xs)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), ys.flatten()) * (len(xs) / batch)
                    loss.backward()
                    step_loss += loss.detach()
                opt.step()
                synchronize(args.device)
                return time.perf_counter() - start, step_loss.item()

            losses, seconds = [], 0.0
            for index in range(args.warmup + args.steps):
                took, loss = step()
                if index >= args.warmup:
                    seconds += took
                losses.append(loss)
            row = rows[attention]
            row["tokens_per_s_rounds"].append(args.steps * batch * seqlen / seconds)
            row["places"].append(place)  # its turn in this round, 0 = first
            if round_index == 0:
                row["losses"] = losses
                if args.profile_kernels:
                    row["kernels"] = profile_kernels(step, device_type)
            del model, opt
            free_memory(args.device)
    for row in rows.values():
        # The mean rate over the rounds' timed steps (total tokens / total seconds); compiled
        # models leave out the first round, whose steps (compilations and recompilations)
        # warm the compiler's cache up for the rounds after it.
        rates = row["tokens_per_s_rounds"][1:] if args.compile and args.rounds > 1 else row["tokens_per_s_rounds"]
        row["tokens_per_s"] = len(rates) / sum(1 / r for r in rates)
        row["model_tflops"] = row["tokens_per_s"] * cfg.flops_per_token(seqlen) / 1e12
        row["mfu"] = row["model_tflops"] / args.peak_tflops
    return list(rows.values())


def profile_kernels(step, device_type, top=15):
    """One training step under torch.profiler: the `top` operations by their own device time
    (CPU time on a CPU run), as [name, milliseconds, calls] rows, and the step's total."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device_type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()

    def own_time(e):  # microseconds (the attribute's name moved between torch versions)
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    ranked = sorted(events, key=own_time, reverse=True)
    return {"total_ms": sum(own_time(e) for e in events) / 1e3,
            "top": [[e.key, own_time(e) / 1e3, e.count] for e in ranked[:top] if own_time(e) > 0]}


def generate_all(args, size, initial):
    """Greedy generation from the initial weights (speed does not depend on training), each
    attention eagerly, and flashattn also with every step replayed from a CUDA graph (its
    tokens checked against its eager run)."""
    cfg = SIZES[size]
    device_type = torch.device(args.device).type
    modes = [(a, False) for a in args.attentions]
    if device_type == "cuda" and "flashattn" in args.attentions:
        modes.append(("flashattn", True))
    rows = []
    for gen_batch in args.gen_batches:
        prompt = torch.randint(0, cfg.vocab, (gen_batch, args.prompt_tokens),
                               generator=torch.Generator().manual_seed(args.seed)).to(args.device)
        eager_tokens = {}
        for attention, graphed in modes:
            model = load(cfg, attention, initial, args.device).eval()
            with autocast(device_type, DTYPES[args.dtype]):
                model.generate(prompt, 4, temperature=0, cuda_graph=graphed)  # warm-up
                synchronize(args.device)
                start = time.perf_counter()
                tokens = model.generate(prompt, args.gen_tokens, temperature=0, cuda_graph=graphed)
                synchronize(args.device)
            seconds = time.perf_counter() - start
            row = {"size": size, "attention": attention, "cuda_graph": graphed, "batch": gen_batch,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.gen_tokens,
                   "tokens_per_s": gen_batch * args.gen_tokens / seconds}
            if graphed:
                row["same_tokens_as_eager"] = bool(torch.equal(tokens, eager_tokens[attention]))
            else:
                eager_tokens[attention] = tokens
            rows.append(row)
            del model
            free_memory(args.device)
    return rows


def initial_weights(cfg, args):
    """One seeded initialisation, drawn on the device (fast for 1.3B) and kept on the host."""
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = GPT(cfg, "flashattn")
    initial = {k: v.cpu() for k, v in model.state_dict().items()}
    del model
    free_memory(args.device)
    return initial


def load(cfg, attention, initial, device):
    """The model for one attention on the device, with the shared initial weights."""
    with torch.device(device):
        model = GPT(cfg, attention)
    model.load_state_dict(initial)
    return model


def free_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def write_report(results: dict, out: pathlib.Path) -> str:
    """benchmark.md and, with matplotlib, loss.png in `out` from a benchmark.json's contents;
    returns the table."""
    meta, training, generation = results["meta"], results["training"], results["generation"]
    lines = [f"# GPT end to end ({meta['device']}, {meta['dtype']}, peak {meta['peak_tflops']} TFLOP/s for MFU)", "",
             "| size | seqlen | batch | attention | tokens/s | each round | model TFLOP/s | MFU | vs first |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in training:
        first = next(x for x in training if x["size"] == r["size"] and x["seqlen"] == r["seqlen"])
        rounds = ", ".join(f"{x:,.0f}" for x in r.get("tokens_per_s_rounds", []))
        lines.append(f"| {r['size']} | {r['seqlen']} | {r['batch']} | {r['attention']} | {r['tokens_per_s']:,.0f} | "
                     f"{rounds} | {r['model_tflops']:.1f} | {r['mfu']:.3f} | {r['tokens_per_s'] / first['tokens_per_s']:.2f}x |")
    for r in training:
        if r.get("kernels"):
            lines += ["", f"{r['size']} s{r['seqlen']} {r['attention']}: one step's operations by their own device time "
                      f"(total {r['kernels']['total_ms']:.1f} ms)", "", "| operation | ms | calls |", "|---|---:|---:|"]
            lines += [f"| {name[:90]} | {ms:.2f} | {calls} |" for name, ms, calls in r["kernels"]["top"]]
    lines += ["", "| size | batch | attention | decode | generated tokens/s |", "|---|---:|---|---|---:|"]
    lines += [f"| {r['size']} | {r['batch']} | {r['attention']} | "
              f"{'CUDA graph' + ('' if r['same_tokens_as_eager'] else ' (tokens differ from eager!)') if r['cuda_graph'] else 'eager'} | "
              f"{r['tokens_per_s']:,.1f} |" for r in generation]
    table = "\n".join(lines) + "\n"
    (out / "benchmark.md").write_text(table)
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
        fig.savefig(out / "loss.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no loss.png", file=sys.stderr)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["125m", "1.3b"], choices=sorted(SIZES))
    p.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--attentions", nargs="+", default=["flashattn", "sdpa-cudnn", "sdpa-flash"], choices=ATTENTIONS)
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--micro-tokens", type=int, default=16384,
                   help="tokens per forward/backward (the step accumulates its gradients)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of all attentions, each round's order rotated (tokens/s over all of them)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each model (ours stays one custom op in the graph); with --rounds 2 or "
                        "more, the first round warms the compiler up and is left out of tokens/s")
    p.add_argument("--profile-kernels", action="store_true",
                   help="record each attention's kernels (device time) over one extra step of the first round")
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
    p.add_argument("--render", type=pathlib.Path, default=None, metavar="JSON",
                   help="only write benchmark.md and loss.png into --out from an earlier run's benchmark.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.render is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        print(write_report(json.loads(args.render.read_text()), args.out))
        return 0
    data = corpus(args.corpus_mb)
    training, generation = [], []
    for size in args.sizes:
        for seqlen in args.seqlens:
            if seqlen > SIZES[size].max_seqlen:
                raise SystemExit(f"--seqlens: {seqlen} is past {size}'s max_seqlen {SIZES[size].max_seqlen}")
        initial = initial_weights(SIZES[size], args)
        for seqlen in args.seqlens:
            rows = train_all(args, size, seqlen, data, initial)
            training += rows
            for r in rows:
                print(f"train {size} s{seqlen} b{r['batch']} {r['attention']}: {r['tokens_per_s']:,.0f} tokens/s, "
                      f"{r['model_tflops']:.1f} TFLOP/s, MFU {r['mfu']:.3f}, loss {r['losses'][0]:.3f} -> "
                      f"{r['losses'][-1]:.3f}", flush=True)
        rows = generate_all(args, size, initial)
        generation += rows
        for r in rows:
            print(f"generate {size} b{r['batch']} {r['attention']}{' graph' if r['cuda_graph'] else ''}: "
                  f"{r['tokens_per_s']:,.1f} tokens/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else args.device,
            "torch": torch.__version__, "dtype": args.dtype, "peak_tflops": args.peak_tflops, "compile": args.compile,
            "command": " ".join(sys.argv)}
    results = {"meta": meta, "training": training, "generation": generation}
    (args.out / "benchmark.json").write_text(json.dumps(results, indent=1) + "\n")
    print(write_report(results, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
