"""One training loop, two attention imports: flashattn's flash_attn_func, or a stand-in with the
same signature built on torch's scaled_dot_product_attention. The import is the only thing
that changes, which is the porting promise: `from flash_attn import flash_attn_func` becomes
`from flashattn import flash_attn_func`.

    python examples/train_swap.py --compare              # both, same init and data; compare
    python examples/train_swap.py --compare --device cuda --dtype bf16 --steps 30
    python examples/train_swap.py --impl flashattn --device cuda --dtype bf16 --steps 50

--compare trains both from the same initial weights on the same batches, prints the two loss
curves step by step and, last, one JSON line with both curves; it exits 1 when they differ by
more than --rtol (relative, at any step; a NaN fails). --dtype fp16/bf16 is mixed precision:
fp32 weights and optimizer, the forward under torch.autocast, so attention sees that dtype.
The default tolerance follows the dtype: fp32 1e-4, fp16 1e-2, bf16 2e-2 (two low-precision
runs drift apart by rounding alone, since every step feeds the next; on the CPU they stay
within 1e-3). flashattn's CUDA kernels take fp16 and bf16; the CPU takes all three.
"""
import argparse
import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def sdpa_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func's signature over SDPA (its causal mask is top-left aligned, which equals
    the bottom-right one for the square self-attention used here)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         dropout_p=dropout_p, is_causal=causal,
                                         scale=softmax_scale)
    return out.transpose(1, 2)


def load(impl):
    if impl == "flashattn":
        from flashattn import flash_attn_func
    else:
        flash_attn_func = sdpa_flash_attn_func
    return flash_attn_func


class Block(nn.Module):
    def __init__(self, dim, heads, attn):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        x = x + self.proj(self.attn(q, k, v, causal=True).reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, attn, vocab, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attn) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(args):
    """(steps, batch, seqlen + 1) tokens from a fixed random Markov chain in which each token
    has 4 equally likely successors: a learnable stream (the loss falls from log(vocab)
    towards log(4)), so the two curves are compared while they move. Drawn on the CPU from
    its own generator, so both runs and every device see the same tokens."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    successors = torch.randint(0, args.vocab, (args.vocab, 4), generator=gen)
    choices = torch.randint(0, 4, (args.steps, args.batch, args.seqlen + 1), generator=gen)
    tokens = torch.empty_like(choices)
    tokens[..., 0] = torch.randint(0, args.vocab, (args.steps, args.batch), generator=gen)
    for t in range(1, args.seqlen + 1):
        tokens[..., t] = successors[tokens[..., t - 1], choices[..., t]]
    return tokens


def train(impl, args):
    """The loss of each step. Weights and optimizer state stay fp32; with --dtype fp16/bf16 the
    forward runs under autocast, so attention (and every matmul) sees that dtype, as in
    ordinary mixed-precision training."""
    attn = load(impl)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    model = LM(attn, args.vocab, args.dim, args.heads, args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args)
    losses = []
    for step in range(args.steps):
        tokens = data[step].to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


DEFAULT_RTOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 2e-2}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["flashattn", "sdpa"], default="flashattn")
    p.add_argument("--compare", action="store_true", help="run both and compare the losses")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None,
                   help="largest relative loss difference --compare accepts (default: by "
                        "dtype, fp32 1e-4, fp16 1e-2, bf16 2e-2)")
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and args.dtype == "fp32":
        p.error("flashattn's CUDA kernels take fp16 and bf16: use --dtype bf16 or fp16")
    rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[args.dtype]
    if not args.compare:
        print(json.dumps({"impl": args.impl, "losses": train(args.impl, args)}))
        return 0
    ref, ours = train("sdpa", args), train("flashattn", args)
    differences = [abs(a - b) / abs(a) for a, b in zip(ref, ours)]
    # A NaN anywhere fails the comparison (max() would let it slip through).
    worst = max(differences) if all(math.isfinite(d) for d in differences) else math.inf
    print(f"{'step':>4} {'sdpa':>10} {'flashattn':>10} {'rel.diff':>9}")
    for step, (a, b, d) in enumerate(zip(ref, ours, differences)):
        print(f"{step:>4} {a:>10.5f} {b:>10.5f} {d:>9.2e}")
    verdict = "same curve" if worst <= rtol else "DIFFERENT curves"
    print(f"{verdict}: largest relative difference {worst:.2e} (rtol {rtol:g}) over "
          f"{args.steps} steps, {args.device} {args.dtype}")
    print(json.dumps({"device": args.device, "dtype": args.dtype, "sdpa": ref, "flashattn": ours,
                      "max_relative_difference": worst, "rtol": rtol}))
    return 0 if worst <= rtol else 1


if __name__ == "__main__":
    sys.exit(main())
