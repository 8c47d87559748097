#!/usr/bin/env python3
"""The forward's features through the installed package, as users call them:

    out = flashattn.flash_attn_func(q, k, v, causal=..., window_size=..., softcap=...,
                                    alibi_slopes=...)        # q (B, S, H, D), k, v (B, S, Hk, D)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen,
                                           max_seqlen, causal=...)   # (total, H, D) each

against PyTorch SDPA forced to FlashAttention-2 ("fa2") and to cuDNN ("cudnn") in the same run,
bf16 by default, hdim 128. The rows (--features picks some):

  gqa      32 query heads over 8 key/value heads, seqlen 2048 and 8192, batch 16384 / seqlen,
           causal and not. Peers: SDPA with enable_gqa=True.
  window   window_size=(4096, 0) (causal, 4096 keys to the left) at seqlen 16384, 16 heads,
           batch 1. SDPA takes no window (a dense boolean mask would leave both fused
           backends), so fa2 is torch.ops.aten._flash_attention_forward with
           window_size_left/right, the FlashAttention-2 kernel that SDPA's flash backend calls
           (a private op), used only when its output passes the float64 check; cudnn is n/a.
  varlen   a ragged batch: lengths uniform in 128..8192 (seeded by --seed) until 65536 tokens
           (the last one cut), 16 heads, causal and not. Peers: SDPA on nested jagged tensors
           (B, H, j, D) over the same buffers, built once per input set. Torch's cuDNN path
           for nested tensors is experimental: some builds take it only with
           TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 (--cudnn-nested sets it; torch 2.11 on an
           H100 ran it without, eagerly only: its CUDA-graph capture failed); a peer that
           refuses or fails says why in its row.
  paged    the varlen batch with its keys and values in pages of --page-size rows (default
           256) in a random order, flash_attn_varlen_func(..., block_table=...): the peers as
           for varlen, on the dense copies of the same keys (SDPA takes no block table).
  softcap  softcap=30, seqlen 2048 and 8192, batch 16384 / seqlen, 16 heads, causal and not;
           q scaled so that the scores have standard deviation 10, where the cap bends them.
  alibi    ALiBi with the standard geometric slopes of 16 heads (fp32), the same shapes.
           SDPA has neither softcap nor ALiBi: the peers run the PLAIN call of the same shape,
           their columns say so, and their rate is an upper bound on what they would reach.

TFLOP/s, EAGER and KERNEL (CUDA-graph replay), as bench/forward.py (bench/harness.py gives the
method), over one FLOP count per row that every system shares: 4*B*H*S*S*D, halved when
causal; for the window row 4*D*B*H times the visible (query, key) pairs (visible_pairs); for
varlen (and paged) the sum over the sequences of 4*H*L*L*D, halved when causal.

Correctness before timing: ours's out and lse (on poisoned memory) against the float64
reference with the feature on (two (batch, head) slices; for varlen, slices of the first, the
longest and the last sequence), and against the first peer that computes the same function
(none for softcap and ALiBi); a peer's output that misses the float64 bound is not used and
that peer is not timed. Writes forward_features.json and forward_features.md in --out and
prints the tables last. Exit status 1 when a check of ours failed.
"""
from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass
from typing import Callable

import harness as h

FEATURES = ("gqa", "window", "varlen", "paged", "softcap", "alibi")
RAGGED = ("varlen", "paged")  # flash_attn_varlen_func over the ragged batch
PLAIN_PEERS = ("softcap", "alibi")  # SDPA lacks the feature: the peers time the plain call
SOFTCAP = 30.0
CUDNN_NESTED_ENV = "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED"
NO_WINDOW = "SDPA has no sliding-window option (a dense boolean mask leaves the fused " \
            "backends); only FlashAttention-2's own op takes a window"
PEERS_RUN = {
    "gqa": "SDPA, enable_gqa=True",
    "window": "fa2: torch.ops.aten._flash_attention_forward(window_size_left, "
              "window_size_right), the FA2 kernel behind SDPA's flash backend; cudnn: n/a",
    "varlen": "SDPA on nested jagged tensors (B, H, j, D) over the same buffers",
    "paged": "SDPA on nested jagged tensors over the dense copies of the paged keys and values",
    "softcap": "plain SDPA of the same shape (no softcap): an upper bound on the peers' rate",
    "alibi": "plain SDPA of the same shape (no ALiBi): an upper bound on the peers' rate",
}


@dataclass(frozen=True)
class Sizes:
    """The shapes of a run: the GPU's, or tiny ones for the CPU smoke test."""
    hdim: int
    heads: int
    seqlens: tuple
    quick_seqlens: tuple
    tokens: int              # batch * seqlen of the dense rows
    gqa_heads: tuple         # (query heads, key/value heads)
    window_seqlen: int
    window: tuple
    varlen_tokens: int
    varlen_range: tuple      # (shortest, longest) drawn length


GPU = Sizes(hdim=128, heads=16, seqlens=(2048, 8192), quick_seqlens=(2048,), tokens=16384,
            gqa_heads=(32, 8), window_seqlen=16384, window=(4096, 0), varlen_tokens=65536,
            varlen_range=(128, 8192))
CPU = Sizes(hdim=32, heads=2, seqlens=(64, 128), quick_seqlens=(64,), tokens=128,
            gqa_heads=(4, 2), window_seqlen=128, window=(32, 0), varlen_tokens=256,
            varlen_range=(8, 64))


@dataclass(frozen=True)
class Case:
    """One row: a feature at one shape."""
    feature: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int              # varlen: the longest sequence
    hdim: int
    causal: bool
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    lengths: tuple = ()      # varlen, paged: the sequences' lengths
    page_size: int = 0       # paged: rows per page

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.feature in RAGGED:
            tokens = h.seqlen_label(sum(self.lengths))
            pages = f" pages of {self.page_size}" if self.feature == "paged" else ""
            return f"varlen {len(self.lengths)} seqs {tokens} tok{pages} d{self.hdim} {mask} " \
                   f"h{self.heads}"
        what = {"gqa": f"gqa {self.heads}q/{self.kv_heads}kv", "window": f"window {self.window}",
                "softcap": f"softcap {self.softcap:g}", "alibi": "alibi"}[self.feature]
        return f"{what} d{self.hdim} {mask} s{h.seqlen_label(self.seqlen)} " \
               f"b{self.batch}h{self.heads}"

    def fields(self) -> dict:
        return {"label": self.label(), "feature": self.feature, "hdim": self.hdim,
                "causal": self.causal, "seqlen": self.seqlen, "batch": self.batch,
                "heads": self.heads, "kv_heads": self.kv_heads,
                "window": list(self.window) if self.feature == "window" else None,
                "softcap": self.softcap or None, "alibi": self.alibi,
                "lengths": list(self.lengths) or None, "page_size": self.page_size or None,
                "peers_run": PEERS_RUN[self.feature]}

    def flops(self) -> float:
        if self.feature == "window":
            return window_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.hdim,
                                self.window, self.causal)
        if self.feature in RAGGED:
            return sum(h.forward_flops(1, self.heads, n, n, self.hdim, self.causal)
                       for n in self.lengths)
        return h.forward_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.hdim,
                               self.causal)

    @property
    def check_peers(self) -> tuple:
        """The peers whose output is this row's function (the others time something else)."""
        if self.feature in PLAIN_PEERS:
            return ()
        return ("fa2",) if self.feature == "window" else tuple(h.PEERS)


# --- counts and inputs -----------------------------------------------------------------------

def visible_pairs(seqlen_q: int, seqlen_k: int, window: tuple = (-1, -1),
                  causal: bool = False) -> int:
    """The (query, key) pairs a mask leaves visible, exactly. Query i's diagonal is key
    d_i = i + Sk - Sq (bottom-right alignment); with window (left, right) it sees keys
    lo_i = max(0, d_i - left) (0 when left = -1) to hi_i = min(Sk - 1, d_i + right) (Sk - 1
    when right = -1; causal sets right = 0), so

        pairs = sum over i = 0 .. Sq-1 of max(0, hi_i - lo_i + 1).

    E.g. Sq = Sk = 5, window (2, 0): 1 + 2 + 3 + 3 + 3 = 12."""
    left, right = window
    right = 0 if causal else right
    pairs = 0
    for i in range(seqlen_q):
        diagonal = i + seqlen_k - seqlen_q
        lo = 0 if left < 0 else max(0, diagonal - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diagonal + right)
        pairs += max(0, hi - lo + 1)
    return pairs


def window_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, hdim: int,
                 window: tuple, causal: bool) -> float:
    """Two matmuls of 2*D FLOPs per visible (query, key) pair, per (batch, head)."""
    return 4.0 * hdim * batch * heads * visible_pairs(seqlen_q, seqlen_k, window, causal)


def ragged_lengths(tokens: int, shortest: int, longest: int, seed: int) -> tuple:
    """Lengths drawn uniformly from shortest..longest until they hold `tokens`, the last one
    cut to fit."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(shortest, longest), tokens - sum(lengths)))
    return tuple(lengths)


def cases(features: list[str], args) -> list[Case]:
    size = CPU if args.device == "cpu" else GPU
    seqlens = size.quick_seqlens if args.quick else size.seqlens
    dense = [(max(1, size.tokens // s), s, causal) for s in seqlens for causal in (False, True)]
    out = []
    for feature in features:
        if feature == "gqa":
            heads, kv_heads = size.gqa_heads
            out += [Case("gqa", b, heads, kv_heads, s, size.hdim, c) for b, s, c in dense]
        elif feature == "window":
            out.append(Case("window", 1, size.heads, size.heads, size.window_seqlen, size.hdim,
                            True, window=size.window))
        elif feature in RAGGED:
            lengths = ragged_lengths(size.varlen_tokens, *size.varlen_range, args.seed)
            page_size = args.page_size if feature == "paged" else 0
            out += [Case(feature, len(lengths), size.heads, size.heads, max(lengths),
                         size.hdim, c, lengths=lengths, page_size=page_size)
                    for c in (False, True)]
        elif feature == "softcap":
            out += [Case("softcap", b, size.heads, size.heads, s, size.hdim, c, softcap=SOFTCAP)
                    for b, s, c in dense]
        elif feature == "alibi":
            out += [Case("alibi", b, size.heads, size.heads, s, size.hdim, c, alibi=True)
                    for b, s, c in dense]
    return out


def make_sets(case: Case, args) -> list[dict]:
    """Input sets {q, k, v} (varlen: (total, H, D) and the shared cu_seqlens and offsets),
    together beyond --rotate-mib."""
    import torch
    dtype = h.torch_dtype(args.dtype)
    if case.feature in RAGGED:
        q_dims, kv_dims = [(sum(case.lengths), n, case.hdim) for n in (case.heads, case.kv_heads)]
    else:
        q_dims, kv_dims = [(case.batch, case.seqlen, n, case.hdim)
                           for n in (case.heads, case.kv_heads)]
    # q and out, k and v: what each call reads or writes
    per_set = 2 * (math.prod(q_dims) + math.prod(kv_dims)) * dtype.itemsize
    shared = {}
    if case.feature in RAGGED:
        offsets = torch.tensor([0, *case.lengths], device=args.device).cumsum(0)
        shared = {"offsets": offsets, "cu_seqlens": offsets.to(torch.int32)}
    gen = h.generator(args.device, args.seed)
    sets = []
    for _ in range(h.set_count(per_set, args.rotate_mib * h.MIB)):
        q, k, v = h.random_tensors([q_dims, kv_dims, kv_dims], dtype, args.device, gen)
        if case.softcap:
            # Scores of standard deviation softcap / 3, where the cap bends them: on the unit
            # scores of unit inputs softcap 30 changes almost nothing, and the check could not
            # tell whether it was applied. (The values do not change the work timed.)
            q.mul_(case.softcap / 3)
        sets.append({"q": q, "k": k, "v": v} | shared)
        if case.feature == "paged":
            sets[-1] |= paged_copies(case, k, v, gen)
    return sets


def paged_copies(case: Case, k, v, gen) -> dict:
    """k and v (total, Hk, D) as pages of case.page_size rows in a random order, and the
    block table (B, max pages) of the ragged batch; page rows past a sequence are NaN."""
    import torch
    size = case.page_size
    pages_of = [-(-n // size) for n in case.lengths]
    order = torch.randperm(sum(pages_of), device=k.device, generator=gen)
    table = torch.zeros(len(case.lengths), max(pages_of), dtype=torch.int32, device=k.device)
    k_pages = torch.full((sum(pages_of), size, *k.shape[1:]), float("nan"), dtype=k.dtype,
                         device=k.device)
    v_pages = torch.full_like(k_pages, float("nan"))
    start, used = 0, 0
    for b, n in enumerate(case.lengths):
        for p in range(pages_of[b]):
            page = int(order[used + p])
            table[b, p] = page
            rows = min(size, n - p * size)
            k_pages[page, :rows] = k[start + p * size:start + p * size + rows]
            v_pages[page, :rows] = v[start + p * size:start + p * size + rows]
        start, used = start + n, used + pages_of[b]
    return {"k_pages": k_pages, "v_pages": v_pages, "block_table": table}


# --- the calls -------------------------------------------------------------------------------

def ours_call(case: Case, x: dict, slopes) -> Callable:
    from flashattn import flash_attn_func, flash_attn_varlen_func
    if case.feature == "varlen":
        return lambda **extra: flash_attn_varlen_func(
            x["q"], x["k"], x["v"], x["cu_seqlens"], x["cu_seqlens"], case.seqlen, case.seqlen,
            causal=case.causal, **extra)
    if case.feature == "paged":
        return lambda **extra: flash_attn_varlen_func(
            x["q"], x["k_pages"], x["v_pages"], x["cu_seqlens"], x["cu_seqlens"], case.seqlen,
            case.seqlen, causal=case.causal, block_table=x["block_table"], **extra)
    return lambda **extra: flash_attn_func(x["q"], x["k"], x["v"], causal=case.causal,
                                           window_size=case.window, softcap=case.softcap,
                                           alibi_slopes=slopes, **extra)


def peer_call(case: Case, x: dict) -> Callable:
    """The peers' call on input set x; the SDPA context it runs in picks the backend. Its
    output has ours's layout: (B, S, H, D), or for varlen a nested (B, H, j, D) tensor."""
    import torch
    import torch.nn.functional as F
    q, k, v = x["q"], x["k"], x["v"]
    if case.feature == "window":
        left, right = case.window
        return lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, case.seqlen, case.seqlen, 0.0, case.causal, False,
            window_size_left=left, window_size_right=right)[0]
    if case.feature in RAGGED:
        # Built once here, not in the timed call: nested (B, j, H, D) views of the same
        # buffers, sharing one offsets tensor (so one ragged dimension j), their longest and
        # shortest lengths given (else torch computes them, a synchronisation, on each call),
        # transposed to the (B, H, j, D) that SDPA takes.
        def nested(t):
            return torch.nested.nested_tensor_from_jagged(
                t, x["offsets"], min_seqlen=min(case.lengths),
                max_seqlen=max(case.lengths)).transpose(1, 2)
        qn, kn, vn = nested(q), nested(k), nested(v)
        return lambda: F.scaled_dot_product_attention(qn, kn, vn, is_causal=case.causal)
    return lambda: h.sdpa_call(q, k, v, case.causal, enable_gqa=case.kv_heads != case.heads)


def peer_calls(case: Case, sets: list[dict], peer: str) -> list:
    if case.feature == "window" and peer != "fa2":
        raise NotImplementedError(NO_WINDOW)
    return [peer_call(case, x) for x in sets]


# --- correctness -----------------------------------------------------------------------------

def compare(case: Case, x: dict, out, lse, slopes, dtype: str, peer, peer_out,
            poisoned: bool) -> dict:
    """h.check_attention of out (and lse, unless None) against float64 with the feature on,
    and against peer_out: dense, on two (batch, head) slices; varlen, on the first, the
    longest and the last sequence (each a batch of one), all of which must pass."""
    q, k, v = x["q"], x["k"], x["v"]
    features = {"window": case.window, "softcap": case.softcap, "alibi_slopes": slopes}
    if case.feature not in RAGGED:
        group = case.heads // case.kv_heads
        pairs = sorted({(0, 0), (case.batch - 1, case.heads - 1)})
        return h.check_attention(out, lse, q, lambda b, hh: (k[b, :, hh // group],
                                                             v[b, :, hh // group]),
                                 case.causal, dtype, pairs, peer, peer_out, poisoned, **features)
    starts = x["cu_seqlens"].tolist()
    picked = sorted({0, case.lengths.index(max(case.lengths)), len(case.lengths) - 1})
    sequences = []
    for i in picked:
        a, b = starts[i], starts[i + 1]

        def one(t):
            return None if t is None else t[a:b].unsqueeze(0)  # (1, L, H, D)

        result = h.check_attention(
            one(out), None if lse is None else lse[:, a:b].unsqueeze(0), one(q),
            lambda _, hh: (k[a:b, hh], v[a:b, hh]), case.causal, dtype,
            [(0, 0), (0, case.heads - 1)], peer, one(peer_out), poisoned, **features)
        sequences.append({"sequence": i, "length": b - a} | result)
    finite = bool(out.isfinite().all()) and (lse is None or bool(lse.isfinite().all()))
    return {"ok": finite and all(s["ok"] for s in sequences), "finite": finite,
            "poisoned": poisoned, "peer": peer, "sequences": sequences}


def check(case: Case, sets: list[dict], slopes, args) -> tuple[dict, dict]:
    """Ours's out and lse of the first set (on poisoned memory) against float64 and the first
    peer that computes the same function. That peer's own output must pass the float64 bound
    ours has with no peer (a window the op ignored, say): else it is neither compared nor
    timed. Returns the check and {peer: why it is not timed}."""
    import torch
    x = sets[0]
    q = x["q"]
    lse_shape = (case.heads, q.shape[0]) if case.feature in RAGGED else \
        (case.batch, case.heads, case.seqlen)
    blocks = [(q.shape, q.dtype), (lse_shape, torch.float32)]
    with h.poisoned_allocations(args.device, blocks) as addresses:
        out, lse, _ = ours_call(case, x, slopes)(return_attn_probs=True)
    poisoned = out.data_ptr() in addresses and lse.data_ptr() in addresses

    def peer_output():
        result = peer_call(case, x)()
        return result.transpose(1, 2).values() if case.feature in RAGGED else result

    peer, peer_out = h.first_working_peer(args, peer_output, peers=case.check_peers)
    refused = {}
    if peer is not None:
        own = compare(case, x, peer_out, None, slopes, args.dtype, None, None, True)
        if not own["ok"]:
            worst = max(own.get("sequences", [own]),
                        key=lambda f: f["max_abs_vs_fp64"] / max(f["bound_vs_fp64"], 1e-30))
            refused[peer] = "its output is not this function: max abs vs float64 " \
                            f"{worst['max_abs_vs_fp64']:.3g} against a bound of " \
                            f"{worst['bound_vs_fp64']:.3g}, finite: {own['finite']}"
            peer, peer_out = None, None
    result = compare(case, x, out, lse, slopes, args.dtype, peer, peer_out, poisoned)
    return result | ({"peers_refused": refused} if refused else {}), refused


# --- the run ---------------------------------------------------------------------------------

def measure(case: Case, args) -> dict:
    """One row: the check and every system's eager and kernel TFLOP/s."""
    import torch
    sets = make_sets(case, args)
    slopes = torch.tensor(h.alibi_slopes(case.heads), dtype=torch.float32,
                          device=args.device) if case.alibi else None
    result, refused = check(case, sets, slopes, args)
    row = case.fields() | {"check": result}
    systems = [h.System("ours", [ours_call(case, x, slopes) for x in sets])]
    peers = h.peer_systems(args, lambda name: peer_calls(case, sets, name))
    systems += [h.System(s.name, [], error=refused[s.name]) if s.name in refused else s
                for s in peers]
    return h.time_row(row, systems, args, args.target_s, flops=case.flops())


def tables(rows: list[dict]) -> str:
    """One table per feature, under a line saying what its peers ran; the peers' columns of
    softcap and ALiBi are named as the plain calls they are."""
    parts = []
    for feature in dict.fromkeys(r["feature"] for r in rows):
        mine = [r for r in rows if r["feature"] == feature]
        shown = {s: s if s == "ours" or feature not in PLAIN_PEERS
                 else f"{s} plain (no softcap/ALiBi)" for s in mine[0]["results"]}
        renamed = [r | {"results": {shown[s]: res for s, res in r["results"].items()}}
                   for r in mine]
        parts.append(f"**{feature}** (peers: {PEERS_RUN[feature]})\n\n"
                     + h.rate_table(renamed, lambda r: r["label"], list(shown.values()),
                                    "tflops", "TFLOP/s"))
    return "\n\n".join(parts)


def main() -> int:
    p = h.parser(__doc__)
    p.add_argument("--features", default=",".join(FEATURES),
                   help="comma-separated rows among " + ", ".join(FEATURES) + " (default all)")
    p.add_argument("--page-size", type=int, default=256,
                   help="rows per page of the paged row (default 256)")
    p.add_argument("--cudnn-nested", action="store_true",
                   help=f"set {CUDNN_NESTED_ENV}=1: torch's experimental cuDNN path for nested "
                        "tensors (varlen's cudnn peer)")
    args = p.parse_args()
    features = [f for f in args.features.split(",") if f]
    unknown = [f for f in features if f not in FEATURES]
    if unknown or not features:
        sys.exit(f"--features: unknown {unknown} or none; known: {list(FEATURES)}")
    if args.cudnn_nested:
        os.environ[CUDNN_NESTED_ENV] = "1"  # read by torch at the first nested cuDNN call
    args = h.finish_args(args)
    meta = h.run_metadata("flashattn forward features (flash_attn_func, flash_attn_varlen_func)",
                          args)
    meta |= {"features": features, CUDNN_NESTED_ENV: os.environ.get(CUDNN_NESTED_ENV)}
    rows = []
    with h.on_side_stream(args.device):
        for case in cases(features, args):
            rows.append(h.measure_safely(measure, case.fields(), args, case, args))
            h.progress(rows[-1], "tflops")
    notes = "\n".join(n for n in (h.check_notes(rows, h.shape_label),
                                  h.failure_notes(rows, h.shape_label)) if n)
    return h.report(args, "forward_features", meta, rows, tables(rows), notes)


if __name__ == "__main__":
    raise SystemExit(main())
