#!/usr/bin/env python3
"""The backward through the installed package and autograd, as users train with it:

    out = flashattn.flash_attn_func(q, k, v, causal=causal)   # q, k, v require grad
    out.backward(dout)

against PyTorch SDPA forced to FlashAttention-2 ("fa2") and cuDNN ("cudnn") through autograd
too, over the grid (as bench/forward.py). TFLOP/s count the backward alone, 2.5x the forward's
FLOPs (five matmuls to its two), EAGER and KERNEL (bench/harness.py).

What is timed: the backward alone. The forward of each input set runs once, outside the
timing, and its autograd graph is kept; each timed call is then

    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

which runs what out.backward(dout) runs (the autograd engine, the registered backward of
flashattn's op, its kernels) and nothing of the forward. It returns the gradients instead of
accumulating them into q.grad, k.grad, v.grad: every call is the same work (no growing
.grad to add to) and no system pays for an accumulation the others skip. Re-running the
forward between timed backwards would need a synchronisation per call, which the back-to-back
samples of the eager time cannot have. The forwards ran on the run's side stream, so the
backward's kernels (which run on their forward's stream) are on the stream the CUDA-graph
capture records.

--softcap CAP and --alibi time ours with those features (the ALiBi paper's slopes per head);
SDPA has neither, so the peers then run the plain call of the same shape (their figure is an
upper bound), and ours is checked against float64 alone. --deterministic times ours in that
mode (the peers as they are). --dropout P times every system with dropout probability P (SDPA
takes it too; each draws its own bits, so ours is checked against float64 alone, with the
keep mask its forward returned in S_dmask's signs).

Correctness before timing: ours's dq, dk, dv on poisoned memory against float64 gradients of
a slice (some rows of dq, some rows of dk and dv, of two (batch, head) pairs) and against the
first peer's gradients. Writes backward.json, backward.md, backward.png in --out; prints the
table last. Exit status 1 when a check of ours failed.
"""
from __future__ import annotations

import harness as h

CHUNK_ROWS = 1024  # query rows per float64 block of the reference (S x CHUNK_ROWS scores)
# A gradient of ours passes within GRAD_FACTOR x the peer's float64 error plus GRAD_SLACK x
# the largest reference gradient of its slices (docs/SPEC.md's accuracy rule for gradients, 3x,
# the peer standing for the plain low-precision implementation).
GRAD_FACTOR, GRAD_SLACK = 3.0, 1e-3


def make_sets(shape: h.Shape, args) -> list[tuple]:
    """Input sets (q, k, v, dout); q, k, v require grad. Together beyond --rotate-mib."""
    dtype = h.torch_dtype(args.dtype)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.hdim)
    # q, k, v, dout, and out, dq, dk, dv that each call reads or writes
    per_set = 8 * shape.batch * shape.seqlen * shape.heads * shape.hdim * dtype.itemsize
    gen = h.generator(args.device, args.seed)
    sets = []
    for _ in range(h.set_count(per_set, args.rotate_mib * h.MIB)):
        q, k, v, dout = h.random_tensors([dims] * 4, dtype, args.device, gen)
        sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout))
    return sets


def reference_grads(q, k, v, dout, b: int, hh: int, rows, cols, causal: bool,
                    softcap: float = 0.0, slope: float | None = None, keep=None,
                    dropout_p: float = 0.0):
    """Float64 dq of the query rows `rows` and dk, dv of the key rows `cols` of one
    (batch, head), from the whole head's softmax (blocks of CHUNK_ROWS query rows); scores
    capped (softcap * tanh(s / softcap)) and less slope * |i - j| as flash_attn_func takes them;
    with dropout, `keep` the (S, S) mask of the kept probabilities of this (batch, head)."""
    import torch
    Q, K, V, dO = (t[b, :, hh].detach().double() for t in (q, k, v, dout))
    seqlen, scale = Q.shape[0], Q.shape[1] ** -0.5
    keys = torch.arange(seqlen, device=Q.device)

    def dropped(x, qrows, kcols):
        """x (probabilities, or dO V^T) where kept, scaled by 1 / (1 - p); 0 where dropped."""
        if keep is None:
            return x
        mask = keep.index_select(0, qrows).index_select(1, kcols)
        return x * mask.double() / (1.0 - dropout_p)

    def scores(qi, kj, qrows, kcols):
        """The scores and their derivative by the scaled dot products (1 - tanh^2, or 1)."""
        s = (qi @ kj.T) * scale
        grad = torch.ones_like(s)
        if softcap > 0:
            t = torch.tanh(s / softcap)
            s, grad = softcap * t, 1 - t * t
        if slope is not None:
            s = s - slope * (qrows[:, None] - kcols[None, :]).abs()
        if causal:  # square: query i sees keys j <= i
            s.masked_fill_(kcols[None, :] > qrows[:, None], float("-inf"))
        return s, grad

    lse = torch.empty(seqlen, dtype=torch.float64, device=Q.device)
    delta = torch.empty_like(lse)  # rowsum(dO * O)
    for r0 in range(0, seqlen, CHUNK_ROWS):
        r = keys[r0:r0 + CHUNK_ROWS]
        s, _ = scores(Q[r], K, r, keys)
        lse[r] = torch.logsumexp(s, dim=-1)
        delta[r] = (dO[r] * (dropped(torch.exp(s - lse[r, None]), r, keys) @ V)).sum(-1)
    rows, cols = rows.to(Q.device), cols.to(Q.device)
    s, grad = scores(Q[rows], K, rows, keys)
    p = torch.exp(s - lse[rows, None])
    dq = (p * (dropped(dO[rows] @ V.T, rows, keys) - delta[rows, None]) * grad) @ K * scale
    s, grad = scores(Q, K[cols], keys, cols)
    p = torch.exp(s - lse[:, None])
    dv = dropped(p, keys, cols).T @ dO
    dk = (p * (dropped(dO @ V[cols].T, keys, cols) - delta[:, None]) * grad).T @ Q * scale
    return dq, dk, dv


def feature_options(args) -> tuple:
    """(softcap, alibi, deterministic) of the options add_feature_args adds; their defaults
    where a caller's parser lacks them (bench/grid.py runs measure with its own)."""
    return (getattr(args, "softcap", 0.0), getattr(args, "alibi", False),
            getattr(args, "deterministic", False))


def dropout_of(args) -> float:
    """--dropout's probability (0 where a caller's parser lacks it)."""
    return getattr(args, "dropout", 0.0)


def features(shape: h.Shape, args, device) -> dict:
    """flash_attn_func's keyword arguments of --softcap, --alibi, --deterministic, --dropout."""
    import torch
    softcap, alibi, deterministic = feature_options(args)
    extra = {"deterministic": True} if deterministic else {}
    if dropout_of(args) > 0:
        extra["dropout_p"] = dropout_of(args)
    if softcap > 0:
        extra["softcap"] = softcap
    if alibi:
        extra["alibi_slopes"] = torch.tensor(h.alibi_slopes(shape.heads), dtype=torch.float32,
                                             device=device)
    return extra


def check(shape: h.Shape, sets: list[tuple], args) -> dict:
    """Ours's gradients of the first set (on poisoned memory) against float64 on slices and
    against the first peer that takes the shape, each gradient on its own scale."""
    import torch
    from flashattn import flash_attn_func
    q, k, v, dout = sets[0]
    extra = features(shape, args, q.device)
    dropout = dropout_of(args)
    keep_of = None
    if dropout > 0:  # the keep mask of this forward's bits: S_dmask's non-negative entries
        out, _, probs = flash_attn_func(q, k, v, causal=shape.causal, return_attn_probs=True, **extra)
        keep_of = lambda b, hh: probs[b, hh, :shape.seqlen, :shape.seqlen] >= 0  # noqa: E731
    else:
        out = flash_attn_func(q, k, v, causal=shape.causal, **extra)
    with h.poisoned_allocations(args.device, [(q.shape, q.dtype)] * 3) as addresses:
        grads = torch.autograd.grad(out, (q, k, v), dout)
    poisoned = all(g.data_ptr() in addresses for g in grads)
    peer, peer_grads = None, None
    softcap, alibi, _ = feature_options(args)
    if not (softcap > 0 or alibi or dropout > 0):  # else the peers compute another function
        peer, peer_grads = h.first_working_peer(args, lambda: torch.autograd.grad(
            h.sdpa_call(q, k, v, shape.causal), (q, k, v), dout))
    rows = h.sample_rows(shape.seqlen)
    pairs = sorted({(0, 0), (shape.batch - 1, shape.heads - 1)})
    slopes = extra.get("alibi_slopes")
    refs = [reference_grads(q, k, v, dout, b, hh, rows, rows, shape.causal, softcap,
                            None if slopes is None else float(slopes[hh]),
                            None if keep_of is None else keep_of(b, hh), dropout)
            for b, hh in pairs]
    keep_of = probs = None  # S_dmask, (B, H, S, S): freed before the timing
    index = rows.to(q.device)
    result = {"peer": peer, "poisoned": poisoned, "slices": [list(p) for p in pairs],
              "rows_per_slice": int(rows.numel()), "finite": True, "ok": True}
    for i, name in enumerate(("dq", "dk", "dv")):
        ours = [grads[i][b, index, hh] for b, hh in pairs]
        ref = [r[i] for r in refs]
        ours_err = max(h.max_abs(x, y) for x, y in zip(ours, ref))
        scale = max(float(y.abs().max()) for y in ref)
        peer_err = diff = None
        if peer_grads is not None:
            peer_err = max(h.max_abs(peer_grads[i][b, index, hh], y)
                           for (b, hh), y in zip(pairs, ref))
            diff = h.max_beyond_ulp(grads[i], peer_grads[i], args.dtype)
        ok, figures = h.verdict(ours_err, scale, args.dtype, peer_err, diff,
                                factor=GRAD_FACTOR, slack=GRAD_SLACK)
        finite = bool(grads[i].isfinite().all())
        result[name] = figures | {"ok": ok and finite, "finite": finite}
        result["ok"] = result["ok"] and ok and finite
        result["finite"] = result["finite"] and finite
    return result


def measure(shape: h.Shape, args, target_s: float) -> dict:
    """One row: the check and every system's eager and kernel TFLOP/s of the backward."""
    import torch
    from flashattn import flash_attn_func
    sets = make_sets(shape, args)
    softcap, alibi, deterministic = feature_options(args)
    dropout = dropout_of(args)
    row = shape.fields() | {"softcap": softcap, "alibi": alibi, "deterministic": deterministic,
                            "dropout": dropout, "check": check(shape, sets, args)}
    extra = features(shape, args, sets[0][0].device)

    def backward_of(out, q, k, v, dout):
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def calls(forward):
        return [backward_of(forward(q, k, v), q, k, v, dout) for q, k, v, dout in sets]

    def peer_calls(name):
        with h.sdpa_context(name)():  # the forward picks the backend of its backward
            return calls(lambda q, k, v: h.sdpa_call(q, k, v, shape.causal, dropout_p=dropout))

    systems = [h.System("ours", calls(lambda q, k, v: flash_attn_func(
        q, k, v, causal=shape.causal, **extra)))]
    systems += h.peer_systems(args, peer_calls)
    return h.time_row(row, systems, args, target_s, flops=shape.flops(backward=True))


def add_feature_args(p) -> None:
    p.add_argument("--softcap", type=float, default=0.0,
                   help="ours with this softcap (the peers run the plain call)")
    p.add_argument("--alibi", action="store_true",
                   help="ours with ALiBi slopes per head (the peers run the plain call)")
    p.add_argument("--deterministic", action="store_true", help="ours in deterministic mode")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="every system with this dropout probability (ours checked against "
                        "float64 with its own keep mask)")


if __name__ == "__main__":
    raise SystemExit(h.main_over_grid(__doc__, "flashattn backward (autograd of flash_attn_func)",
                                      "backward", measure, add_feature_args))
