#!/usr/bin/env python3
"""Scratch: the backward of a ragged varlen batch on the kernels that can take it, ours only.

Autograd of flash_attn_varlen_func (bf16, heads = 2048 / hdim, lengths drawn from 128..8192
until 64k tokens, as bench/forward_features.py draws them), timed eagerly with CUDA events
over alternating rounds of three kernel choices, switched per call by the library's knobs:
  tma       the default (on Hopper the TMA kernel at buckets 64 and 128)
  cp.async  FLASHATTN_SM90_BACKWARD_LOADS=cp.async (the cp.async sm90 kernel, plain calls)
  sm80      FLASHATTN_CUDA_BACKWARD=sm80
--deterministic adds the same three in deterministic mode. Each choice's gradients are
compared with the first's (max abs difference over the largest magnitude) before timing;
correctness against float64 is the test suite's (BackwardVarlen).
  python3 dev/varlen_backward.py [--hdims 64 128] [--rounds 3] [--deterministic]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from forward_features import ragged_lengths  # noqa: E402

from flashattn import flash_attn_varlen_func  # noqa: E402

CHOICES = {"tma": {}, "cp.async": {"FLASHATTN_SM90_BACKWARD_LOADS": "cp.async"},
           "sm80": {"FLASHATTN_CUDA_BACKWARD": "sm80"}}


def with_env(env: dict, fn):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    lengths = ragged_lengths(args.tokens, 128, 8192, args.seed)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, {torch.cuda.get_device_name()}")
    rows = []
    for hdim in args.hdims:
        heads = 2048 // hdim
        for causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(args.seed)
            q, k, v, dout = (torch.randn(sum(lengths), heads, hdim, device="cuda", dtype=torch.bfloat16,
                                         generator=gen) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            modes = [False, True] if args.deterministic else [False]
            for deterministic in modes:
                out = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal,
                                             deterministic=deterministic)

                def grads():
                    return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                first = with_env(CHOICES["tma"], grads)
                largest = max(float(g.abs().max()) for g in first)
                agree = {}
                for name, env in CHOICES.items():
                    other = with_env(env, grads)
                    agree[name] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(first, other)) / largest
                times = {name: [] for name in CHOICES}
                for r in range(args.rounds):
                    order = list(CHOICES) if r % 2 == 0 else list(reversed(CHOICES))
                    for name in order:
                        def timed():
                            grads()
                            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            for _ in range(args.calls):
                                grads()
                            end.record()
                            torch.cuda.synchronize()
                            return start.elapsed_time(end) / args.calls * 1e-3
                        times[name].append(with_env(CHOICES[name], timed))
                flops = sum(4 * heads * n * n * hdim for n in lengths) * (0.5 if causal else 1.0) * 2.5
                tflops = {name: flops / sorted(t)[len(t) // 2] / 1e12 for name, t in times.items()}
                rows.append((hdim, causal, deterministic, tflops, agree))
    print("| hdim | causal | det | " + " | ".join(CHOICES) + " | tma/cp.async | tma/sm80 | agree (rel) |")
    print("|---:|---|---|" + "---:|" * (len(CHOICES) + 2) + "---|")
    for hdim, causal, det, tf, agree in rows:
        cells = " | ".join(f"{tf[n]:.0f}" for n in CHOICES)
        agreement = " ".join(f"{n} {a:.1e}" for n, a in agree.items() if n != "tma")
        print(f"| {hdim} | {'yes' if causal else 'no'} | {'yes' if det else 'no'} | {cells} | "
              f"{tf['tma'] / tf['cp.async']:.2f} | {tf['tma'] / tf['sm80']:.2f} | {agreement} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
