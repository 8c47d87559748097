#!/usr/bin/env python3
"""A seeded random sweep of hostile calls through the public Python functions (issue 34).

    python3 scripts/gpu_sweep.py --device cuda|cpu --calls N --seed S [--only I] [--huge]
                                 [--out DIR] [--verbose]

Each call i draws its parameters from a generator seeded by (S, i) alone, so a failure is
reproduced by `--seed S --only I` (every failure prints the call's index and parameters).
The calls (flashattn's torch functions, on torch tensors of --device):

- dense   flash_attn_func; about a third also run the backward through autograd
- varlen  flash_attn_varlen_func with empty sequences and NaN rows past cu_seqlens[B] (never
          to be read); a third with the backward
- paged   flash_attn_varlen_func with block_table: NaN in every page row that holds no key,
          out-of-range indices in the table slots past each sequence; some with inputs that
          require grad, whose backward must raise NotImplementedError
- dropout dense or varlen with dropout_p > 0: shapes, finiteness and the lse (undropped) only
- kvcache flash_attn_with_kvcache, dense or paged cache, append, rotary, cache_batch_idx,
          cache_leftpad, num_splits: out, lse and the caches afterwards (appended rows, every
          other element bit for bit)
- kvbad   flash_attn_with_kvcache with a bad cache_seqlens / cache_leftpad / cache_batch_idx /
          block_table value: the CPU refuses it (an error naming the argument, caches
          untouched); on CUDA (docs/SPEC.md, "What each backend supports and checks") the bad
          sequence's out and lse rows are all NaN and it appends nothing, a page that is only
          read acts as keys of NaN, the other sequences are exact (a paged cache's
          cache_seqlens is checked on the host: an error naming it is accepted there too)
- invalid wrong dtypes, ranks, shapes, head dims > 256, heads, windows, dropout, scale,
          softcap, ALiBi, index tensors...: must raise ValueError, TypeError,
          NotImplementedError or RuntimeError with a message "<argument>: ..." naming one of
          the call's arguments, and leave the caches untouched

Shapes are hostile but valid: Sq, Sk in 0..300 (0 and 1 often), head dims 1..256, GQA/MQA,
windows from -1 to past the sequence, causal, softcap, ALiBi (H) or (B, H), scales of either
sign; fp16/bf16 (and fp32 on the CPU); non-contiguous inputs (slices of larger NaN-filled
tensors with padded strides, head-major storage permuted). Every accepted call is checked
against tests/python/torch_reference.py in float64 on the same device with docs/SPEC.md's
accuracy rule: fp16/bf16 within 2x (gradients 3x) the error of the same reference computed in
the input dtype plus a floor (fp16 1e-4, bf16 5e-4; gradients at least one ulp of the largest
gradient); fp32 within 1e-5 of the reference's scale plus 1e-6. lse: -inf exactly where the
reference's is, else within 1e-4 relative + 1e-3.

--huge (CUDA only): tensors past 2^31 elements (about 50 GB of GPU memory at the peak: fits an
80 GB H100; about a minute, see huge_sweep): a forward with a causal sliding window of 64 keys
and its backward at B=1, S=1.1M, H=16, D=128 bf16 (2.25e9 elements a tensor), and a kv-cache
call (append and attend) over caches of 2.29e9 elements, checked against the float64 reference
on sampled rows at the end of the tensors (past element 2^31), in the middle and at the start.

Exit status: 0 when every call behaved, 1 on any wrong answer or unexpected exception.
A summary (calls by kind; accepted and checked; refused as expected; failures) is printed and,
with --out DIR, written to DIR/gpu_sweep.json.

Cost: every call is small (B*H*Sq*Sk*D bounded by 2^21; the references materialise the scores).
"""
import argparse
import json
import math
import os
import random
import re
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests", "python"))
from torch_reference import attention_reference  # noqa: E402

import flashattn  # noqa: E402
from flashattn import (flash_attn_func, flash_attn_varlen_func,  # noqa: E402
                       flash_attn_with_kvcache)

F64 = torch.float64
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 5e-4}
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}
WORK = 1 << 21           # B * H * Sq * Sk * D of one call, at most
ERRORS = (ValueError, TypeError, NotImplementedError, RuntimeError)
ARG_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])*:")
ARGUMENTS = {  # the names an error may start with (the C ABI's names for the Python ones)
    "q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "softmax_scale", "window_left",
    "window_right", "window_size", "softcap", "alibi_slopes", "dropout_p", "causal",
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "block_table", "k_cache",
    "v_cache", "k_new", "v_new", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
    "rotary_cos", "rotary_sin", "num_splits", "return_attn_probs", "seqused_k"}


class Failure(Exception):
    pass


# Findings of this sweep not fixed yet: (kind of exception, a pattern of its message, what it
# is). A call that fails with one counts as "known", not as a failure, unless --strict.
KNOWN = []  # (exception class, message pattern, what it is): findings not fixed yet


class Known(Exception):
    """A known finding that is not an exception of the library's (an invalid call accepted)."""


def known(e):
    for cls, pattern, what in KNOWN:
        if isinstance(e, cls) and pattern.search(str(e)):
            return what
    return None


def check(cond, message):
    if not cond:
        raise Failure(message)


# ---------------------------------------------------------------------------- drawing

LENGTHS = [0, 1, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 191, 255,
           256, 257, 300]
HEAD_DIMS = [1, 2, 3, 5, 7, 8, 16, 24, 31, 32, 40, 48, 59, 63, 64, 72, 80, 96, 100, 104, 127,
             128, 160, 192, 200, 224, 232, 250, 255, 256]


def draw_len(r, top=300):
    v = r.choice(LENGTHS) if r.random() < 0.6 else r.randint(0, top)
    return min(v, top)


def draw_heads(r):
    hk = r.choice([1, 1, 2, 3, 4])
    return hk * r.choice([1, 1, 2, 3, 4, 8]) if hk * 8 <= 16 else hk, hk


def draw_window(r, sk):
    def side():
        x = r.random()
        if x < 0.45:
            return -1
        if x < 0.6:
            return r.choice([0, 1])
        if x < 0.9:
            return r.randint(0, sk + 2)
        return r.randint(sk, sk + 1000)  # past the sequence
    return (side(), side()) if r.random() < 0.5 else (-1, -1)


def draw_common(r, dtypes, b, h, sk):
    causal = r.random() < 0.4
    window = draw_window(r, sk)
    softcap = 0.0 if r.random() < 0.75 else r.choice([0.5, 1.0, 5.0, 30.0, r.uniform(0.1, 50)])
    alibi = r.choice([None, None, None, "h", "bh"])
    scale = None if r.random() < 0.7 else r.choice([0.0, -0.3, 1.0, r.uniform(-1, 2),
                                                    r.uniform(0.01, 0.2)])
    return dict(dtype=r.choice(dtypes), causal=causal, window=window, softcap=softcap,
                alibi=alibi, scale=scale)


def shrink(r, b, h, d, lens_q, lens_k):
    """Halves the longest lengths until the call's work fits WORK."""
    while b * h * d * max(1, sum(a * c for a, c in zip(lens_q, lens_k))) > WORK:
        i = max(range(len(lens_q)), key=lambda j: lens_q[j] * lens_k[j])
        if lens_q[i] >= lens_k[i]:
            lens_q[i] //= 2
        else:
            lens_k[i] //= 2
    return lens_q, lens_k


class Maker:
    """Random tensors of one call: drawn on the CPU from a seeded generator, then moved."""

    def __init__(self, r, device):
        self.r, self.device = r, device
        self.gen = torch.Generator().manual_seed(r.getrandbits(62))

    def randn(self, shape, dtype, scale=1.0):
        return (torch.randn(shape, generator=self.gen) * scale).to(dtype).to(self.device)

    def layout(self):
        return self.r.choice(["contig", "contig", "padded", "headmajor"])

    def tensor(self, shape, dtype, layout, scale=1.0):
        """`shape` (.., S, H, D) in `layout`: contiguous, a slice of a larger NaN-filled tensor
        (padded strides, an offset), or head-major storage (.., H, S, D) permuted."""
        x = self.randn(shape, dtype, scale)
        if layout == "contig" or 0 in shape:
            return x
        if layout == "headmajor":
            perm = list(range(len(shape) - 3)) + [len(shape) - 2, len(shape) - 3, len(shape) - 1]
            store = torch.empty([shape[p] for p in perm], dtype=dtype, device=self.device)
            store.copy_(x.permute(perm))
            return store.permute(perm)
        d = shape[-1]
        pad_d = (8 * self.r.randint(1, 2)) if d % 8 == 0 else self.r.randint(1, 9)
        extra = [self.r.randint(0, 2) for _ in shape[:-1]] + [pad_d]
        big = torch.full([n + e for n, e in zip(shape, extra)], float("nan"), dtype=dtype,
                         device=self.device)
        starts = [self.r.randint(0, e) for e in extra[:-1]] + [0]
        view = big[tuple(slice(s, s + n) for s, n in zip(starts, shape))]
        view.copy_(x)
        return view

    def alibi(self, kind, b, h):
        if kind is None:
            return None
        shape = (h,) if kind == "h" else (b, h)
        return (torch.rand(shape, generator=self.gen) * 0.5).to(self.device)


def leaf(x):
    """x as a leaf that requires grad, with x's strides and storage (detach keeps both)."""
    return x.detach().requires_grad_()


# ---------------------------------------------------------------------------- the rule

def low_dtype(dtype):
    return dtype


def assert_rule(name, got, exact, low, dtype, factor, floor=None, scale_of=None):
    got, exact = got.detach().to(F64), exact.detach().to(F64)
    check(tuple(got.shape) == tuple(exact.shape),
          f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}")
    if got.numel() == 0:
        return
    # NaN where the reference has NaN (a key of NaN), exactly.
    nan = torch.isnan(exact)
    check(torch.equal(torch.isnan(got), nan),
          f"{name}: NaN at {int((torch.isnan(got) != nan).sum())} elements where the "
          f"reference has {'none' if not nan.any() else 'others'}")
    got, exact = got[~nan], exact[~nan]
    if got.numel() == 0:
        return
    err = (got - exact).abs().max().item()
    if dtype == torch.float32:
        scale = scale_of if scale_of is not None else exact.abs().max().item()
        bound = 1e-5 * max(scale, 1.0) + 1e-6
        if low is not None and err > bound:
            # Large logits (|softmax_scale| sqrt(D) >> 1): fp32 itself cannot reach 1e-5;
            # then the plain fp32 implementation's error, times factor, bounds it instead.
            low_err = (low.detach().to(F64)[~nan] - exact).abs().max().item()
            bound = max(bound, factor * low_err + 1e-6)
        check(err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (fp32: 1e-5 relative, "
                            f"or {factor}x the plain fp32 implementation's error)")
        return
    low = low.detach().to(F64)[~nan]
    low_err = (low - exact).abs().max().item()
    floor = FLOOR[dtype] if floor is None else floor
    bound = factor * low_err + floor
    check(err <= bound, f"{name}: max error {err:.3g} > {factor} x {low_err:.3g} (the plain "
                        f"{str(dtype)[6:]} implementation's) + {floor:.2g}")


def assert_lse(got, exact, low=None):
    """-inf and NaN exactly where the reference has them; else within 1e-3 + 1e-4 |lse|, or,
    for fp16/bf16, within 2x the plain low-precision implementation's lse error + 1e-3 where
    that is larger (a query rounded to the dtype after a rotation moves the lse that much)."""
    got, exact = got.detach().to(F64), exact.detach().to(F64)
    check(got.dtype == F64 and tuple(got.shape) == tuple(exact.shape),
          f"lse: shape {tuple(got.shape)} != {tuple(exact.shape)}")
    nan = torch.isnan(exact)
    check(torch.equal(torch.isnan(got), nan), "lse: NaN exactly where the reference's is")
    empty = torch.isneginf(exact)
    check(torch.equal(torch.isneginf(got), empty), "lse: -inf exactly for the rows that see no key")
    keep = ~(nan | empty)
    if keep.any():
        err = (got[keep] - exact[keep]).abs()
        bound = 1e-3 + 1e-4 * exact[keep].abs()
        if low is not None:
            low = low.detach().to(F64)[keep]
            low_err = (low - exact[keep]).abs().nan_to_num(0.0).max().item()
            bound = bound.clamp(min=2 * low_err + 1e-3)
        check(bool((err <= bound).all()), f"lse: max error {err.max().item():.3g} "
                                          f"(bound 1e-3 + 1e-4 |lse|, or 2x the plain "
                                          f"implementation's error + 1e-3)")


def references(attend, tensors, dout, dtype):
    """float64 and plain low-precision (None for fp32) results of attend(q, k, v) -> (out, lse):
    [(out64, lse64, grads64), (out_low, lse_low, grads_low)]."""
    results = []
    for dt in (F64, low_dtype(dtype)):
        if dt is None:
            results.append((None, None, (None,) * len(tensors)))
            continue
        leaves = [t.detach().to(dt).requires_grad_(dout is not None) for t in tensors]
        out, lse = attend(*leaves)
        grads = (None,) * len(tensors)
        if dout is not None:
            grads = torch.autograd.grad(out, leaves, dout.to(dt), allow_unused=True)
            grads = tuple(torch.zeros_like(x) if g is None else g
                          for g, x in zip(grads, leaves))
        results.append((out.detach(), lse.detach(), grads))
    return results


def floor_scale(softmax_scale, d):
    """docs/SPEC.md's growth of dq's and dk's floor with the softmax scale: max(1, |scale| sqrt(D))
    (reference::floor_scale)."""
    if softmax_scale is None or d <= 0 or not math.isfinite(softmax_scale):
        return 1.0
    return max(1.0, abs(softmax_scale) * math.sqrt(d))


def check_grads(grads, grads64, grads_low, dtype, scale_factor=1.0):
    """scale_factor: floor_scale() of the call; dq's and dk's floors grow by it, dv's does not."""
    magnitude = max((g.abs().max().item() for g in grads64 if g.numel()), default=0.0)
    for name, g, g64, glow in zip(("dq", "dk", "dv"), grads, grads64, grads_low):
        check(g is not None, f"{name}: no gradient")
        check(g.dtype == dtype, f"{name}: dtype {g.dtype}, expected {dtype}")
        grows = scale_factor if name != "dv" else 1.0
        floor = max(FLOOR.get(dtype, 0.0), ULP[dtype] * magnitude * grows)
        assert_rule(name, g, g64, glow, dtype, 3, floor, scale_of=magnitude)


# ---------------------------------------------------------------------------- dense and varlen

def draw_dense(r, dtypes):
    b = r.randint(0, 3) if r.random() < 0.05 else r.randint(1, 3)
    h, hk = draw_heads(r)
    d = r.choice(HEAD_DIMS) if r.random() < 0.6 else r.randint(1, 256)
    sq, sk = draw_len(r), draw_len(r)
    (sq,), (sk,) = shrink(r, max(b, 1), h, d, [sq], [sk])
    p = dict(b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, **draw_common(r, dtypes, b, h, sk))
    return p


def run_dense(r, device, dtypes, kind):
    p = draw_dense(r, dtypes)
    p["backward"] = kind == "dense" and r.random() < 0.35
    p["dropout"] = r.choice([0.1, 0.3, 0.5]) if kind == "dropout" else 0.0
    m = Maker(r, device)
    p["layouts"] = [m.layout() for _ in range(3)]
    yield p
    b, sq, sk, h, hk, d, dtype = (p[x] for x in ("b", "sq", "sk", "h", "hk", "d", "dtype"))
    q = m.tensor((b, sq, h, d), dtype, p["layouts"][0])
    k = m.tensor((b, sk, hk, d), dtype, p["layouts"][1])
    v = m.tensor((b, sk, hk, d), dtype, p["layouts"][2])
    alibi = m.alibi(p["alibi"], b, h)
    grad = p["backward"] or (p["dropout"] > 0 and r.random() < 0.5)
    if grad:
        q, k, v = leaf(q), leaf(k), leaf(v)
    out, lse, _ = flash_attn_func(q, k, v, dropout_p=p["dropout"], softmax_scale=p["scale"],
                                  causal=p["causal"], window_size=p["window"],
                                  softcap=p["softcap"], alibi_slopes=alibi,
                                  return_attn_probs=True)
    check(tuple(out.shape) == (b, sq, h, d) and out.dtype == dtype, f"out: {out.shape} {out.dtype}")
    check(tuple(lse.shape) == (b, h, sq) and lse.dtype == torch.float32, f"lse: {lse.shape}")
    dout = m.randn(out.shape, dtype) if grad else None
    grads = torch.autograd.grad(out, (q, k, v), dout) if grad else None

    def attend(q_, k_, v_):
        return attention_reference(q_, k_, v_, p["scale"], p["causal"], p["window"],
                                   p["softcap"], alibi)
    if p["dropout"] > 0:
        (_, lse64, _), = references(attend, (q, k, v), None, torch.float32)[:1]
        assert_lse(lse, lse64)
        check(bool(torch.isfinite(out).all()), "out: not finite (dropout)")
        if grads is not None:
            check(all(bool(torch.isfinite(g).all()) for g in grads), "grads: not finite (dropout)")
        return "checked"
    (o64, l64, g64), (olow, llow, glow) = references(attend, (q, k, v), dout, dtype)
    assert_rule("out", out, o64, olow, dtype, 2)
    assert_lse(lse, l64, llow if dtype != torch.float32 else None)
    if grads is not None:
        check_grads(grads, g64, glow, dtype, floor_scale(p["scale"], p["d"]))
    return "checked"


def draw_varlen(r, dtypes):
    b = r.randint(1, 5)
    h, hk = draw_heads(r)
    d = r.choice(HEAD_DIMS) if r.random() < 0.6 else r.randint(1, 256)
    top = r.choice([8, 40, 150, 300])
    lens_q = [0 if r.random() < 0.2 else draw_len(r, top) for _ in range(b)]
    lens_k = [0 if r.random() < 0.2 else draw_len(r, top) for _ in range(b)]
    lens_q, lens_k = shrink(r, 1, h, d, lens_q, lens_k)
    return dict(b=b, h=h, hk=hk, d=d, lens_q=lens_q, lens_k=lens_k,
                **draw_common(r, dtypes, b, h, max(lens_k)))


def cu(lens, device):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device=device)


def page_keys(r, m, lens, hk, d, dtype):
    """Paged keys as flash_attn_varlen_func's block_table takes them (conftest.page_keys, in
    torch): NaN in page rows that hold no key, out-of-range indices past each sequence."""
    page = r.choice([1, 2, 3, 5, 7, 8, 16, 17, 32, 64, 100])
    counts = [-(-n // page) for n in lens]
    max_pages = max(counts, default=0) + r.randint(0, 2)
    max_pages = max(max_pages, 1)
    num_pages = sum(counts) + r.randint(0, 3)
    order = list(range(num_pages))
    r.shuffle(order)
    order = iter(order)
    # Built on the CPU and moved once (one copy, not a kernel per page).
    kp = torch.full((num_pages, page, hk, d), float("nan"), dtype=dtype)
    vp = kp.clone()
    table = torch.full((len(lens), max_pages), num_pages + 7, dtype=torch.int32)
    table[:, ::2] = -3
    keys, values = [], []
    for b, n in enumerate(lens):
        kb = (torch.randn((n, hk, d), generator=m.gen)).to(dtype)
        vb = (torch.randn((n, hk, d), generator=m.gen)).to(dtype)
        keys.append(kb.to(m.device))
        values.append(vb.to(m.device))
        for slot in range(counts[b]):
            pg = next(order)
            table[b, slot] = pg
            rows = slice(slot * page, min(n, (slot + 1) * page))
            kp[pg, :rows.stop - rows.start] = kb[rows]
            vp[pg, :rows.stop - rows.start] = vb[rows]
    return kp.to(m.device), vp.to(m.device), table.to(m.device), keys, values, page


def run_varlen(r, device, dtypes, kind):
    p = draw_varlen(r, dtypes)
    p["paged"] = kind == "paged"
    p["backward"] = kind == "varlen" and r.random() < 0.35
    p["paged_grad"] = p["paged"] and r.random() < 0.25
    p["dropout"] = r.choice([0.1, 0.3]) if kind == "dropout" else 0.0
    p["trailing"] = [r.randint(0, 3), r.randint(0, 3)]
    p["max_extra"] = [r.choice([0, 0, 0, 1, 5]), r.choice([0, 0, 0, 1, 5])]
    m = Maker(r, device)
    p["layouts"] = [m.layout() for _ in range(3)]
    yield p
    b, h, hk, d, dtype = (p[x] for x in ("b", "h", "hk", "d", "dtype"))
    lq, lk = p["lens_q"], p["lens_k"]
    tq, tk = sum(lq) + p["trailing"][0], sum(lk) + p["trailing"][1]
    q = m.tensor((tq, h, d), dtype, p["layouts"][0])
    q[sum(lq):] = float("nan")  # rows past cu_seqlens_q[B]: never read
    cu_q, cu_k = cu(lq, device), cu(lk, device)
    alibi = m.alibi(p["alibi"], b, h)
    if p["paged"]:
        k, v, table, keys, values, p["page_size"] = page_keys(r, m, lk, hk, d, dtype)
    else:
        table = None
        k = m.tensor((tk, hk, d), dtype, p["layouts"][1])
        v = m.tensor((tk, hk, d), dtype, p["layouts"][2])
        k[sum(lk):] = float("nan")
        v[sum(lk):] = float("nan")
        keys = [k[a:a + n] for a, n in zip(cu_k.tolist(), lk)]
        values = [v[a:a + n] for a, n in zip(cu_k.tolist(), lk)]
    grad = p["backward"] or p["paged_grad"] or (p["dropout"] > 0 and r.random() < 0.5)
    if grad:
        q, k, v = leaf(q), leaf(k), leaf(v)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lq) + p["max_extra"][0], max(lk) + p["max_extra"][1],
        dropout_p=p["dropout"], softmax_scale=p["scale"], causal=p["causal"],
        window_size=p["window"], softcap=p["softcap"], alibi_slopes=alibi,
        return_attn_probs=True, block_table=table)
    check(tuple(out.shape) == (tq, h, d) and out.dtype == dtype, f"out: {out.shape} {out.dtype}")
    check(tuple(lse.shape) == (h, tq) and lse.dtype == torch.float32, f"lse: {lse.shape}")
    dout = m.randn(out.shape, dtype) if grad else None
    if dout is not None:
        dout[sum(lq):] = float("nan")  # rows past cu_seqlens_q[B]
    grads = None
    if p["paged_grad"]:
        try:
            torch.autograd.grad(out, (q, k, v), dout)
        except NotImplementedError as e:
            check(ARG_RE.match(str(e)) and str(e).startswith("block_table"),
                  f"paged backward: message {str(e)[:100]!r}")
        else:
            raise Failure("paged backward: expected NotImplementedError")
    elif grad:
        grads = torch.autograd.grad(out, (q, k, v), dout)
    starts_q = cu_q.tolist()
    for i in range(b):
        rows = slice(starts_q[i], starts_q[i] + lq[i])
        a = alibi[i] if alibi is not None and alibi.dim() == 2 else alibi

        def attend(q_, k_, v_, a=a):
            o, l_ = attention_reference(q_[None], k_[None], v_[None], p["scale"], p["causal"],
                                        p["window"], p["softcap"], a)
            return o[0], l_[0]
        dout_i = dout[rows] if grads is not None else None
        tensors = (q[rows], keys[i], values[i])
        if p["dropout"] > 0:
            (_, l64, _), = references(attend, tensors, None, torch.float32)[:1]
            assert_lse(lse[:, rows], l64)
            continue
        (o64, l64, g64), (olow, llow, glow) = references(attend, tensors, dout_i, dtype)
        assert_rule(f"out (sequence {i})", out[rows], o64, olow, dtype, 2)
        assert_lse(lse[:, rows], l64, llow if dtype != torch.float32 else None)
        if grads is not None:
            # dk, dv of sequence i: its rows of the packed gradients.
            a_k = cu_k[i].item()
            mine = (grads[0][rows], grads[1][a_k:a_k + lk[i]], grads[2][a_k:a_k + lk[i]])
            try:
                check_grads(mine, g64, glow, dtype, floor_scale(p["scale"], p["d"]))
            except Failure as e:
                raise Failure(f"sequence {i}: {e}") from None
    if p["dropout"] > 0:
        n = sum(lq)
        check(bool(torch.isfinite(out[:n]).all()), "out: not finite (dropout)")
        if grads is not None:
            check(bool(torch.isfinite(grads[0][:n]).all()), "dq: not finite (dropout)")
    return "checked"


# ---------------------------------------------------------------------------- kv cache

def rotate(x, cos, sin, pos, interleaved):
    half = cos.shape[1]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    x = x.clone()
    if interleaved:
        a, b = x[..., 0:2 * half:2].clone(), x[..., 1:2 * half:2].clone()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half].clone(), x[..., half:2 * half].clone()
        x[..., :half], x[..., half:2 * half] = a * c - b * s, a * s + b * c
    return x


BAD = ["seqlens_negative", "seqlens_past", "leftpad_negative", "leftpad_past", "batch_idx",
       "page_append", "page_read"]


def draw_kv(r, dtypes, bad):
    b = r.randint(1, 4)
    h, hk = draw_heads(r)
    d = r.choice(HEAD_DIMS) if r.random() < 0.6 else r.randint(1, 256)
    sq = r.choice([1, 1, 1, 2, 3, 5, 8, 16, 33])
    while b * h * d * sq * sq > WORK // 4:  # snew <= sq below: the capacity can shrink to it
        sq = max(1, sq // 2)
    append = r.random() < 0.6
    snew = (sq if r.random() < 0.7 else r.randint(1, min(8, sq))) if append else 0
    paged = r.random() < 0.4
    page = r.choice([1, 3, 8, 16, 17, 64]) if paged else None
    capacity = max(snew, r.choice([1, 5, 16, 40, 100, 257, 300]))
    if paged:
        capacity = -(-capacity // page) * page
    while b * h * d * sq * capacity > WORK and capacity > max(snew, 1):
        capacity = max(snew, 1, capacity // 2)
    if paged:
        capacity = -(-capacity // page) * page
    seqlens = [r.randint(0, capacity - snew) for _ in range(b)]
    seqlens[0] = capacity - snew if r.random() < 0.5 else seqlens[0]
    leftpad = [r.randint(0, s) if r.random() < 0.5 else 0 for s in seqlens] \
        if r.random() < 0.3 else None
    batch_idx = (not paged) and r.random() < 0.3
    rotary = None
    if r.random() < 0.3 and d >= 2:
        rotary = dict(dim=2 * r.randint(1, d // 2), interleaved=r.random() < 0.5)
    p = dict(b=b, h=h, hk=hk, d=d, sq=sq, snew=snew, paged=paged, page=page, capacity=capacity,
             seqlens=seqlens, leftpad=leftpad, batch_idx=batch_idx, rotary=rotary,
             num_splits=r.choice([0, 0, 0, 1, 2, 3, 7, 64]),
             **draw_common(r, dtypes, b, h, capacity))
    if bad:
        choices = [x for x in BAD if (x != "batch_idx" or not paged)
                   and (not x.startswith("page") or paged)]
        p["bad"] = r.choice(choices)
        p["bad_seq"] = r.randrange(b)
        p["bad_by"] = r.choice([1, 2, 5, 1000, 2 ** 30])
    return p


def run_kvcache(r, device, dtypes, kind):
    p = draw_kv(r, dtypes, kind == "kvbad")
    m = Maker(r, device)
    p["layout"] = m.layout()
    yield p
    b, h, hk, d, sq, snew, dtype = (p[x] for x in ("b", "h", "hk", "d", "sq", "snew", "dtype"))
    cap = p["capacity"]
    seqlens, leftpad = list(p["seqlens"]), list(p["leftpad"] or [0] * b)
    q = m.tensor((b, sq, h, d), dtype, p["layout"])
    if p["paged"]:
        pages_per = cap // p["page"]
        num_pages = b * pages_per + r.randint(0, 3)
        kc = m.randn((num_pages, p["page"], hk, d), dtype)
        vc = m.randn((num_pages, p["page"], hk, d), dtype)
        perm = list(range(num_pages))
        r.shuffle(perm)
        table = torch.tensor(perm[:b * pages_per], dtype=torch.int32).reshape(b, pages_per)
        rows_cache = num_pages
    else:
        rows_cache = b + (r.randint(0, 2) if p["batch_idx"] else 0)
        kc = m.tensor((rows_cache, cap, hk, d), dtype, r.choice(["contig", "padded"]))
        vc = m.tensor((rows_cache, cap, hk, d), dtype, r.choice(["contig", "padded"]))
        table = None
    bidx = None
    if p["batch_idx"]:
        perm = list(range(rows_cache))
        r.shuffle(perm)
        bidx = perm[:b]
    knew = m.tensor((b, snew, hk, d), dtype, m.layout()) if snew else None
    vnew = m.tensor((b, snew, hk, d), dtype, m.layout()) if snew else None
    cos = sin = None
    if p["rotary"]:
        rd = p["rotary"]["dim"]
        inv = 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=F64) / rd)
        ang = torch.arange(cap + sq + 1, dtype=F64)[:, None] * inv[None, :]
        cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
    alibi = m.alibi(p["alibi"], b, h)

    # The bad value (kvbad), and what the CUDA guard makes of it.
    out_of_range, nan_pos, names = set(), {}, set()
    if "bad" in p:
        bs, by, what = p["bad_seq"], p["bad_by"], p["bad"]
        out_of_range.add(bs)
        if what == "seqlens_negative":
            seqlens[bs] = -by
            names = {"cache_seqlens", "cache_leftpad", "block_table"}
        elif what == "seqlens_past":
            seqlens[bs] = min(cap - snew + by, 2 ** 31 - 1 - snew)
            names = {"cache_seqlens", "block_table", "rotary_cos", "rotary_sin"}
        elif what == "leftpad_negative":
            leftpad[bs] = -by
            names = {"cache_leftpad"}
        elif what == "leftpad_past":
            leftpad[bs] = min(seqlens[bs] + by, 2 ** 31 - 1)
            names = {"cache_leftpad"}
        elif what == "batch_idx":
            bidx = bidx or list(range(b))
            bidx[bs] = r.choice([rows_cache + by - 1, -by])
            names = {"cache_batch_idx"}
        else:
            names = {"block_table"}
            end = seqlens[bs] + snew
            if what == "page_append" and snew:
                slot = r.randint(seqlens[bs] // p["page"], (end - 1) // p["page"])
            else:
                # a page of positions before the append only, holding at least one key
                full = [s for s in range(seqlens[bs] // p["page"])
                        if (s + 1) * p["page"] > leftpad[bs]]
                if not full:  # nothing such: a page the append writes into, or none at all
                    if not snew:
                        out_of_range.clear()
                        names = set()
                    else:
                        slot = r.randint(seqlens[bs] // p["page"], (end - 1) // p["page"])
                    full = None
                if full:
                    slot = r.choice(full)
                    out_of_range.clear()
                    nan_pos[bs] = range(max(slot * p["page"], leftpad[bs]),
                                        (slot + 1) * p["page"])
            if names:
                table[bs, slot] = r.choice([num_pages + by - 1, -by])
    p["cache_values"] = dict(seqlens=seqlens, leftpad=leftpad if p["leftpad"] or "leftpad"
                             in p.get("bad", "") else None, batch_idx=bidx,
                             table=None if table is None else table.tolist()
                             if table.numel() <= 64 else "(large)")
    before = (kc.clone(), vc.clone())
    kw = dict(k=knew, v=vnew, rotary_cos=cos, rotary_sin=sin,
              cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
              cache_batch_idx=None if bidx is None else torch.tensor(bidx, dtype=torch.int32,
                                                                      device=device),
              cache_leftpad=None if p["leftpad"] is None and "leftpad" not in p.get("bad", "")
              else torch.tensor(leftpad, dtype=torch.int32, device=device),
              block_table=None if table is None else table.to(device),
              softmax_scale=p["scale"], causal=p["causal"], window_size=p["window"],
              softcap=p["softcap"], rotary_interleaved=bool(p["rotary"] and
                                                            p["rotary"]["interleaved"]),
              alibi_slopes=alibi, num_splits=p["num_splits"], return_softmax_lse=True)
    if names and (device == "cpu" or (p["paged"] and p["bad"].startswith("seqlens"))):
        try:
            out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
        except ERRORS as e:
            name = ARG_RE.match(str(e))
            check(name and name.group(1) in names,
                  f"refused with a message not naming {sorted(names)}: {type(e).__name__}: "
                  f"{str(e)[:160]}")
            check(torch.equal(kc.nan_to_num(7.0), before[0].nan_to_num(7.0))
                  and torch.equal(vc.nan_to_num(7.0), before[1].nan_to_num(7.0)),
                  "the caches changed in a refused call")
            return "refused"
        check(device != "cpu", "a bad index value accepted on the CPU")
    else:
        out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
    check(tuple(out.shape) == (b, sq, h, d) and out.dtype == dtype, f"out: {out.shape}")
    check(tuple(lse.shape) == (b, h, sq) and lse.dtype == torch.float32, f"lse: {lse.shape}")

    def cpu_backend_beside(i, lse64, got):
        """For a CUDA call that failed: the CPU backend's lse on the same inputs and caches, its
        error and ours against the float64 reference (which of the kernel or the rule is off)."""
        if device == "cpu":
            return ""
        try:
            cpu_kw = {name: (x.cpu() if torch.is_tensor(x) else x) for name, x in kw.items()}
            _, cpu_lse = flash_attn_with_kvcache(q.cpu(), before[0].cpu().clone(), before[1].cpu().clone(), **cpu_kw)
        except ERRORS as e:  # (the CPU backend refused it: say so)
            return f"; the CPU backend refused it: {str(e)[:120]}"
        keep = torch.isfinite(lse64)
        ours = (got[i].double().cpu() - lse64.cpu())[keep.cpu()].abs()
        cpu = (cpu_lse[i].double() - lse64.cpu())[keep.cpu()].abs()
        return (f"; beside it the CPU backend's lse is off by {cpu.max().item():.3g} (ours "
                f"{ours.max().item():.3g}, worst row {int(ours.argmax())}: ours "
                f"{got[i].double().cpu()[keep.cpu()][ours.argmax()].item():.6f}, CPU "
                f"{cpu_lse[i].double()[keep.cpu()][ours.argmax()].item():.6f}, float64 "
                f"{lse64.cpu()[keep.cpu()][ours.argmax()].item():.6f})")

    # The reference: append (rotated, rounded to the cache dtype) into float64 copies.
    k64, v64 = before[0].to(F64), before[1].to(F64)
    written = torch.zeros(k64.shape[:2], dtype=torch.bool, device=device)
    tbl = None if table is None else table.tolist()

    def slot_of(i, pos):
        if tbl is not None:
            return tbl[i][pos // p["page"]], pos % p["page"]
        return (bidx[i] if bidx is not None else i), pos
    per_row = p["causal"] or p["window"][0] >= 0 or p["window"][1] >= 0
    cos64 = None if cos is None else cos.to(F64)
    sin64 = None if sin is None else sin.to(F64)
    def index(i, positions):
        """(first, second) index tensors of sequence i's positions in the cache."""
        rows = [slot_of(i, ps) for ps in positions]
        return (torch.tensor([x[0] for x in rows], dtype=torch.long, device=device),
                torch.tensor([x[1] for x in rows], dtype=torch.long, device=device))
    for i in range(b):
        if i in out_of_range or not snew:
            continue
        pos = torch.arange(seqlens[i], seqlens[i] + snew, device=device)
        kn = knew[i].to(F64)
        if cos is not None:
            kn = rotate(kn, cos64, sin64, pos, p["rotary"]["interleaved"])
        kn = kn.to(dtype).to(F64)
        at = index(i, range(seqlens[i], seqlens[i] + snew))
        k64[at], v64[at] = kn, vnew[i].to(F64)
        written[at] = True
    for i in range(b):
        if i in out_of_range:
            check(bool(torch.isnan(out[i]).all()) and bool(torch.isnan(lse[i]).all()),
                  f"sequence {i} ({p['bad']}): out/lse rows not all NaN "
                  f"({int(torch.isnan(out[i]).sum())} of {out[i].numel()} NaN)")
            continue
        span = range(leftpad[i], seqlens[i] + snew)
        if i in nan_pos:  # a page out of range that is only read: keys of NaN, values 0
            bad_rows = [ps for ps in nan_pos[i] if ps in span]
            for ps in bad_rows:
                tbl[i][ps // p["page"]] = 0  # any page: these rows are replaced below
        at = index(i, span)
        keys, vals = k64[at], v64[at]
        if i in nan_pos:
            lo_, hi_ = bad_rows[0] - leftpad[i], bad_rows[-1] + 1 - leftpad[i]
            keys[lo_:hi_], vals[lo_:hi_] = float("nan"), 0.0
        qi = q[i].to(F64)
        if cos is not None:
            pos = seqlens[i] + (torch.arange(sq, device=device) if per_row
                                else torch.zeros(sq, dtype=torch.long, device=device))
            qi = rotate(qi, cos64, sin64, pos, p["rotary"]["interleaved"])
        a = alibi[i] if alibi is not None and alibi.dim() == 2 else alibi
        res = []
        for dt in (F64, low_dtype(dtype)):
            if dt is None:
                res.append((None, None))
                continue
            o, l_ = attention_reference(qi.to(dt)[None], keys.to(dt)[None], vals.to(dt)[None],
                                        p["scale"], p["causal"], p["window"], p["softcap"], a)
            res.append((o[0], l_[0]))
        (o64, l64), (olow, llow) = res
        try:
            assert_rule("out", out[i], o64, olow, dtype, 2)
            assert_lse(lse[i], l64, llow if dtype != torch.float32 else None)
        except Failure as e:
            raise Failure(f"sequence {i}: {e}{cpu_backend_beside(i, l64, lse)}") from None
    # The caches: appended rows within a unit of rounding, every other element bit for bit.
    for name, got, want in (("k_cache", kc, k64), ("v_cache", vc, v64)):
        got = got.to(F64)
        if written.any():
            err = (got[written] - want[written]).abs().max().item()
            bound = (2 * ULP[dtype] if cos is not None else 0.0) * max(
                want[written].abs().max().item(), 1.0)
            check(err <= bound, f"{name}: appended rows off by {err:.3g} > {bound:.3g}")
        check(torch.equal(got[~written].nan_to_num(7.0), want[~written].nan_to_num(7.0)),
              f"{name}: rows outside the append changed")
    return "checked"


# ---------------------------------------------------------------------------- invalid calls

def run_invalid(r, device, dtypes, kind):
    fn = r.choice(["dense", "dense", "varlen", "kvcache"])
    dtype = r.choice(dtypes)
    other = r.choice([t for t in (torch.float16, torch.bfloat16, torch.float32) if t != dtype])
    b, h, hk, d = r.randint(1, 3), 4, 2, r.choice([8, 32, 64, 5])
    sq, sk = r.randint(1, 9), r.randint(1, 9)
    common = ["dtype_f64", "dtype_mix", "dtype_int", "head_dim", "head_dim_mismatch",
              "heads_not_divisible", "rank", "batch_mismatch", "window", "scale", "softcap",
              "alibi_shape", "alibi_dtype"]
    if device == "cuda":
        common += ["fp32_cuda", "device_mismatch"]
    per = {"dense": ["sk_mismatch", "dropout"],
           "varlen": ["cu_int64", "cu_count", "max_seqlen_negative", "dropout", "paged_int64"]
           + (["cu_decreasing", "cu_past_rows", "max_seqlen_small", "page_range"]
              if device == "cpu" else []),
           "kvcache": ["k_without_v", "batch_idx_and_table", "num_splits", "rotary_width",
                       "cache_dtype", "seqlens_int64", "seqlens_shape"]}
    what = r.choice(common + per[fn] * 2)
    p = dict(fn=fn, what=what, dtype=dtype, b=b, h=h, hk=hk, d=d, sq=sq, sk=sk)
    yield p
    m = Maker(r, device)
    kw = {}
    names = None  # None: any argument name
    if what == "head_dim":
        d = r.randint(257, 320)
        names = {"q", "k", "k_cache"}
    if what == "heads_not_divisible":
        hk = r.choice([3, 5])
        names = {"k", "q", "k_cache", "k_new"}
    if what == "fp32_cuda":
        dtype = torch.float32
    qs, ks = (b, sq, h, d), (b, sk, hk, d)
    if fn == "varlen":
        qs, ks = (b * sq, h, d), (b * sk, hk, d)
    q, k, v = m.randn(qs, dtype), m.randn(ks, dtype), m.randn(ks, dtype)
    if what == "dtype_f64":
        q = q.double()
        names = {"q"}
    elif what == "dtype_mix":
        k = k.to(other)
        names = {"k", "k_cache"}
    elif what == "dtype_int":
        v = v.to(torch.int32)
        names = {"v", "v_cache"}
    elif what == "head_dim_mismatch":
        k = m.randn(ks[:-1] + (d + r.randint(1, 8),), dtype)
        names = {"k", "v", "k_cache", "v_cache", "q"}
    elif what == "rank":
        q = q[0] if fn != "varlen" else q[None]
        names = {"q"}
    elif what == "batch_mismatch" and fn == "kvcache":
        q = m.randn((b + 1,) + qs[1:], dtype)  # more sequences than cache rows (B > B_cache)
        names = {"k_cache", "v_cache", "q", "cache_seqlens"}
    elif what == "batch_mismatch" and fn == "dense":
        k = m.randn((b + 1,) + ks[1:], dtype)
        v = m.randn((b + 1,) + ks[1:], dtype)
        names = {"k", "v", "k_cache", "v_cache", "q", "cache_seqlens"}
    elif what == "batch_mismatch":
        what = p["what"] = "cu_count"
    elif what == "window":
        kw["window_size"] = r.choice([(r.randint(-100, -2), -1), (3, r.randint(-100, -2))])
        names = {"window_left", "window_right", "window_size"}
    elif what == "scale":
        kw["softmax_scale"] = r.choice([float("inf"), float("-inf"), float("nan")])
        names = {"softmax_scale"}
    elif what == "softcap":
        kw["softcap"] = r.choice([-1.0, float("inf"), float("nan")])
        names = {"softcap"}
    elif what == "alibi_shape":
        kw["alibi_slopes"] = m.randn(r.choice([(h + 1,), (b + 1, h), (b, h, 1)]), torch.float32)
        names = {"alibi_slopes"}
    elif what == "alibi_dtype":
        kw["alibi_slopes"] = m.randn((h,), r.choice([torch.float16, torch.float64]))
        names = {"alibi_slopes"}
    elif what == "fp32_cuda":
        names = {"q", "k", "v", "k_cache"}
    elif what == "device_mismatch":
        k = k.cpu()
        names = {"k", "k_cache"}
    elif what == "sk_mismatch":
        v = v[:, :-1] if sk > 1 else m.randn((b, 2, hk, d), dtype)
        names = {"v"}
    elif what == "dropout":
        kw["dropout_p"] = r.choice([1.0, 1.5, -0.1, float("nan")])
        names = {"dropout_p"}
    if fn == "dense":
        call = lambda: flash_attn_func(q, k, v, **kw)  # noqa: E731
    elif fn == "varlen":
        cq = cu([sq] * b, device)
        ck = cu([sk] * b, device)
        mq, mk = sq, sk
        table = None
        if what == "cu_int64":
            cq = cq.long()
            names = {"cu_seqlens_q"}
        elif what == "cu_count":
            ck = ck[:-1] if b > 1 else cu([sk, 0], device)
            names = {"cu_seqlens_k", "cu_seqlens_q"}
        elif what == "max_seqlen_negative":
            mq = -r.randint(1, 5)
            names = {"max_seqlen_q"}
        elif what == "cu_decreasing":
            ck = ck.clone()
            ck[1] = -1 if b == 1 else ck[2] + 1
            names = {"cu_seqlens_k", "max_seqlen_k"}  # sequence 0 then exceeds max_seqlen_k
        elif what == "cu_past_rows":
            cq = cq.clone()
            cq[-1] += r.randint(1, 5)
            mq += 5
            names = {"cu_seqlens_q"}
        elif what == "max_seqlen_small":
            mk = sk - 1
            names = {"max_seqlen_k"}
        elif what in ("paged_int64", "page_range"):
            k, v = m.randn((b + 1, sk, hk, d), dtype), m.randn((b + 1, sk, hk, d), dtype)
            table = torch.arange(b, dtype=torch.int32, device=device)[:, None]
            if what == "paged_int64":
                table = table.long()
            else:
                table[-1, 0] = r.choice([-1, b + 1, 2 ** 31 - 1])
            names = {"block_table"}
        call = lambda: flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, block_table=table,  # noqa
                                              **kw)
    else:
        kc, vc = k, v
        kw.pop("dropout_p", None)
        kvkw = dict(cache_seqlens=torch.full((b,), sk // 2, dtype=torch.int32, device=device))
        kn = m.randn((b, 1, kc.shape[2] if kc.dim() == 4 else hk, q.shape[-1]), dtype)
        if what == "k_without_v":
            kvkw.update(k=kn)
            names = {"v", "v_new", "k", "k_new"}
        elif what == "batch_idx_and_table":
            kvkw.update(cache_batch_idx=torch.arange(b, dtype=torch.int32, device=device),
                        block_table=torch.arange(b, dtype=torch.int32, device=device)[:, None])
            names = {"cache_batch_idx", "block_table"}
        elif what == "num_splits":
            kvkw.update(num_splits=r.choice([-1, 1025, 10 ** 6]))
            names = {"num_splits"}
        elif what == "rotary_width":
            t = m.randn((sk + 2, d // 2 + 1), dtype)
            kvkw.update(rotary_cos=t, rotary_sin=t.clone())
            names = {"rotary_cos", "rotary_sin"}
        elif what == "cache_dtype":
            vc = vc.to(other)
            names = {"v_cache"}
        elif what == "seqlens_int64":
            kvkw["cache_seqlens"] = kvkw["cache_seqlens"].long()
            names = {"cache_seqlens"}
        elif what == "seqlens_shape":
            kvkw["cache_seqlens"] = torch.zeros((b + 1,), dtype=torch.int32, device=device)
            names = {"cache_seqlens"}
        if names and "k_cache" in names:
            names |= {"k_cache", "v_cache", "k", "v"}
        before = (kc.clone(), vc.clone())

        def call():
            try:
                return flash_attn_with_kvcache(q, kc, vc, **kvkw, **kw)
            finally:
                check(torch.equal(kc.nan_to_num(7.0), before[0].nan_to_num(7.0))
                      and torch.equal(vc.nan_to_num(7.0), before[1].nan_to_num(7.0)),
                      "the caches changed in a refused call")
    try:
        call()
    except ERRORS as e:
        msg = str(e)
        name = ARG_RE.match(msg)
        check(name is not None and name.group(1) in ARGUMENTS,
              f"{type(e).__name__} without '<argument>: ...': {msg[:200]!r}")
        check(names is None or name.group(1) in names,
              f"{type(e).__name__} names {name.group(1)!r}, expected one of {sorted(names)}: "
              f"{msg[:160]!r}")
        if what.startswith(("dtype", "alibi_dtype", "cache_dtype", "cu_int64", "seqlens_int64",
                            "paged_int64")):
            check(isinstance(e, TypeError), f"expected a TypeError, got {type(e).__name__}: "
                                            f"{msg[:120]}")
        return "refused"
    raise Failure("an invalid call was accepted")


# ---------------------------------------------------------------------------- the driver

KINDS = [("dense", run_dense, 30), ("varlen", run_varlen, 20), ("paged", run_varlen, 10),
         ("dropout", None, 5), ("kvcache", run_kvcache, 15), ("kvbad", run_kvcache, 8),
         ("invalid", run_invalid, 12)]


def pick(seed, i):
    """Call i's generator, kind and function: a pure function of (seed, i)."""
    r = random.Random(f"flashattn-sweep:{seed}:{i}")
    total = sum(w for _, _, w in KINDS)
    x, kind, fn = r.uniform(0, total), None, None
    for kind, fn, w in KINDS:
        if x < w:
            break
        x -= w
    if kind == "dropout":
        fn = run_dense if r.random() < 0.5 else run_varlen
    return r, kind, fn


def one_call(seed, i, device, dtypes):
    r, kind, fn = pick(seed, i)
    gen = fn(r, device, dtypes, kind)
    params = next(gen)
    try:
        next(gen)
    except StopIteration as stop:
        return params, stop.value
    raise RuntimeError("generator did not stop")


def fmt(params):
    return " ".join(f"{k}={v}" if not isinstance(v, torch.dtype) else f"{k}={str(v)[6:]}"
                    for k, v in params.items())


def sweep(args):
    device = args.device
    dtypes = [torch.float16, torch.bfloat16] + ([torch.float32] if device == "cpu" else [])
    indices = [args.only] if args.only is not None else range(args.calls)
    stats = {"by_kind": {}, "checked": 0, "refused": 0, "known": 0, "failures": [],
             "known_findings": []}
    start = time.time()
    for i in indices:
        kind = pick(args.seed, i)[1]
        try:
            params, outcome = one_call(args.seed, i, device, dtypes)
            if device == "cuda":
                torch.cuda.synchronize()
            stats[outcome] += 1
            if args.verbose:
                print(f"[{i}] {kind} {outcome}: {fmt(params)}", flush=True)
        except Exception as e:  # noqa: BLE001: every exception is a finding, reported
            if known(e) and not args.strict:
                stats["known"] += 1
                stats["known_findings"].append(dict(index=i, message=str(e)[:300]))
                print(f"known [{i}]: {str(e)[:160]} ({known(e)[:60]}...)", flush=True)
                stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + 1
                continue
            # The parameters again (a fresh draw of the same call), for the report.
            params = {}
            try:
                r, _, fn = pick(args.seed, i)
                params = next(fn(r, device, dtypes, kind))
            except Exception:  # noqa: BLE001
                pass
            what = ("WRONG" if isinstance(e, Failure) else "UNEXPECTED " + type(e).__name__)
            detail = str(e) if isinstance(e, Failure) else traceback.format_exc(limit=4)
            print(f"FAIL [{i}] {kind} {what}: {str(e)[:300]}\n  rerun: --seed {args.seed} "
                  f"--only {i} --device {device}\n  params: {fmt(params)}", flush=True)
            if not isinstance(e, Failure):
                print("  " + detail.replace("\n", "\n  "), flush=True)
            stats["failures"].append(dict(index=i, kind=kind, error=what,
                                          message=str(e)[:500], params=fmt(params)))
        stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + 1
    stats["seconds"] = round(time.time() - start, 1)
    return stats


# ---------------------------------------------------------------------------- --huge

def huge_sweep(args):
    """Tensors past 2^31 elements on CUDA, checked on rows past element 2^31.

    Memory: q, k, v (1, 1.1M, 16, 128) bf16 are 4.5 GB each; with out, dout and dq, dk, dv
    nine such tensors (40.5 GB) plus the CUDA backward's fp32 dQ accumulator (9 GB) and its
    small per-row buffers: about 50 GB at the backward's peak. They are freed before the
    kv-cache part: k_cache, v_cache (2, 560k, 16, 128) bf16, 4.6 GB each. Fits an 80 GB H100.
    Time: the windowed forward is about 1.1M x 16 x 65 x 128 x 4 = 0.6 TFLOP and the backward
    about 2.5x that (milliseconds to a second with the mask's block overhead); the random
    fills, the allocations and the float64 references on a few dozen rows dominate: about a
    minute in all.
    """
    dev = "cuda"
    results = {}
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16
    S, H, D, W = 1_100_000, 16, 128, 64
    assert S * H * D > 2 ** 31
    t0 = time.time()

    def rnd(shape):
        x = torch.empty(shape, dtype=dtype, device=dev)
        x.normal_()
        return x
    q, k, v = rnd((1, S, H, D)), rnd((1, S, H, D)), rnd((1, S, H, D))
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=True, window_size=(W, 0),
                                  return_attn_probs=True)
    dout = rnd(out.shape)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    # Sampled query rows: the last ones (past element 2^31), some in the middle, the first.
    first_past = (2 ** 31) // (H * D) + 1
    rows = sorted({0, 1, 2, W, first_past, first_past + 7, S // 2, S - 1 - W, S - 2, S - 1}
                  | set(range(S - 5, S)))
    failures = []
    for i in rows:
        lo = max(0, i - W)
        qi = q[:, i:i + 1].detach()
        ks, vs = k[:, lo:i + 1].detach(), v[:, lo:i + 1].detach()
        for dt in (F64, dtype):
            o, l_ = attention_reference(qi.to(dt), ks.to(dt), vs.to(dt), causal=True,
                                        window=(W, 0))
            if dt == F64:
                o64, l64 = o, l_
            else:
                olow, llow = o, l_
        try:
            assert_rule(f"out row {i}", out[:, i:i + 1], o64, olow, dtype, 2)
            assert_lse(lse[:, :, i:i + 1], l64, llow)
        except Failure as e:
            failures.append(str(e))
    # Gradients: dq of a row needs that row alone; dk/dv of key j need the queries j..j+W.
    for j in (0, first_past, S - W - 3, S - 2, S - 1):
        qlo, qhi = j, min(S, j + W + 1)   # the queries that see key j
        klo = max(0, qlo - W)
        sub = [t[:, lo:hi].detach().to(F64).requires_grad_()
               for t, lo, hi in ((q, qlo, qhi), (k, klo, qhi), (v, klo, qhi))]
        sub_low = [t.detach().to(dtype).requires_grad_() for t in sub]
        # Offsets: query r of the slice is global row qlo + r, key c global klo + c; the
        # window in the slice is then exactly the global one (bottom-right aligned).
        grads = []
        for leaves in (sub, sub_low):
            o, _ = attention_reference(*leaves, causal=True, window=(W, 0))
            grads.append(torch.autograd.grad(o, leaves, dout[:, qlo:qhi].to(o.dtype)))
        kj = j - klo
        try:
            check_grads((dq[:, j:j + 1], dk[:, j:j + 1], dv[:, j:j + 1]),
                        [grads[0][0][:, :1], grads[0][1][:, kj:kj + 1], grads[0][2][:, kj:kj + 1]],
                        [grads[1][0][:, :1], grads[1][1][:, kj:kj + 1], grads[1][2][:, kj:kj + 1]],
                        dtype)
        except Failure as e:
            failures.append(f"grad row {j}: {e}")
    results["forward_backward"] = dict(rows=len(rows), failures=failures,
                                       seconds=round(time.time() - t0, 1))
    del q, k, v, out, lse, dout, dq, dk, dv
    torch.cuda.empty_cache()

    # The kv cache: (2, 560k, 16, 128) bf16 per cache = 2.29e9 elements (4.6 GB each).
    t0 = time.time()
    B, C = 2, 560_000
    kc, vc = rnd((B, C, H, D)), rnd((B, C, H, D))
    assert kc.numel() > 2 ** 31
    seqlens = torch.tensor([C // 3, C - 4], dtype=torch.int32, device=dev)
    qn, kn, vn = rnd((B, 3, H, D)), rnd((B, 3, H, D)), rnd((B, 3, H, D))
    out, lse = flash_attn_with_kvcache(qn, kc, vc, k=kn, v=vn, cache_seqlens=seqlens, causal=True,
                                       window_size=(500, 0), return_softmax_lse=True)
    failures = []
    for i, s in enumerate(seqlens.tolist()):
        end = s + 3
        lo = max(0, end - 3 - 500)
        check_rows = kc[i, s:end].to(F64)
        if not torch.equal(check_rows, kn[i].to(F64)):
            failures.append(f"k_cache: sequence {i} appended rows differ")
        ks, vs = kc[i:i + 1, lo:end], vc[i:i + 1, lo:end]
        res = []
        for dt in (F64, dtype):
            # The window of 500 keys left of each query: slicing from `lo` keeps the
            # bottom-right alignment, and (500, 0) masks the same keys.
            res.append(attention_reference(qn[i:i + 1].to(dt), ks.to(dt), vs.to(dt),
                                           causal=True, window=(500, 0)))
        try:
            assert_rule(f"kv out sequence {i}", out[i:i + 1], res[0][0], res[1][0], dtype, 2)
            assert_lse(lse[i:i + 1], res[0][1], res[1][1])
        except Failure as e:
            failures.append(str(e))
    results["kvcache"] = dict(failures=failures, seconds=round(time.time() - t0, 1))
    del kc, vc
    torch.cuda.empty_cache()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", type=int, default=None, help="rerun call I alone")
    ap.add_argument("--huge", action="store_true", help="the > 2^31-element calls (CUDA only)")
    ap.add_argument("--out", default=None, help="write gpu_sweep.json here")
    ap.add_argument("--verbose", action="store_true", help="print every call")
    ap.add_argument("--strict", action="store_true",
                    help="count the known findings (KNOWN) as failures too")
    args = ap.parse_args()
    if args.device == "cuda" and not (torch.cuda.is_available() and flashattn.cuda_compiled()):
        print("gpu_sweep: --device cuda needs a CUDA device and flashattn built with CUDA",
              file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    summary = dict(device=args.device, seed=args.seed, calls=args.calls, only=args.only,
                   torch=torch.__version__)
    failed = False
    if args.huge:
        if args.device != "cuda":
            print("gpu_sweep: --huge runs on CUDA only", file=sys.stderr)
            return 2
        huge = huge_sweep(args)
        summary["huge"] = huge
        n = sum(len(x["failures"]) for x in huge.values())
        failed = n > 0
        for name, x in huge.items():
            print(f"huge {name}: {len(x['failures'])} failures, {x['seconds']} s")
            for f in x["failures"]:
                print(f"  FAIL {f}")
        print(f"outcome: huge: {n} failures")
    else:
        stats = sweep(args)
        summary.update(stats)
        failed = bool(stats["failures"])
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(stats["by_kind"].items()))
        print(f"calls by kind: {kinds}")
        if stats["known"]:
            print(f"known findings (not counted as failures; --strict counts them): "
                  f"{stats['known']} calls")
            for cls, _, what in KNOWN:
                print(f"  {cls.__name__}: {what}")
        print(f"outcome: {sum(stats['by_kind'].values())} calls (seed {args.seed}, "
              f"{args.device}): {stats['checked']} accepted and checked, {stats['refused']} "
              f"refused as expected, {stats['known']} known findings, "
              f"{len(stats['failures'])} failures; {stats['seconds']} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "gpu_sweep_huge.json" if args.huge else "gpu_sweep.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
