"""One training loop, two attention imports: flashattn's flash_attn_func, or a stand-in with the
same signature built on torch's scaled_dot_product_attention. The import is the only thing
that changes, which is the porting promise: `from flash_attn import flash_attn_func` becomes
`from flashattn import flash_attn_func`.

    python examples/train_swap.py --compare              # both, same init and data; compare
    python examples/train_swap.py --impl flashattn --device cuda --dtype bf16 --steps 50

--compare prints both loss curves and exits 1 when they differ by more than --rtol.
"""
import argparse
import json
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


def train(impl, args):
    attn = load(impl)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    model = LM(attn, args.vocab, args.dim, args.heads, args.layers).to(args.device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seqlen + 1), generator=gen)
    losses = []
    for step in range(args.steps):
        tokens = data[step].to(args.device)
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


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
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest relative loss difference --compare accepts")
    args = p.parse_args(argv)
    if not args.compare:
        print(json.dumps({"impl": args.impl, "losses": train(args.impl, args)}))
        return 0
    ref, ours = train("sdpa", args), train("flashattn", args)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, ours))
    print(json.dumps({"sdpa": ref, "flashattn": ours, "max_relative_difference": worst}))
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
