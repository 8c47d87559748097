"""Context parallelism: ring attention over torch.distributed (docs/CONTEXT_PARALLEL.md).

One sequence (or a packed batch of sequences) is split over the P ranks of a process group;
each rank passes its local slice of q, k and v and gets back the output of its queries over
the *whole* sequence, exactly (the same result as one flash_attn_func call over the whole
sequence, up to rounding), with gradients through torch.autograd.

How: the local K/V travel around the ring (rank r sends to r + 1 and receives from r - 1,
P - 1 times), and at step i rank r attends its queries to the K/V slice of rank r - i with
flashattn's own forward, which returns the log-sum-exp (LSE) of every row; the partial outputs
are merged exactly by their LSEs in float32. The transfer of step i + 1 is posted before the
compute of step i, so they overlap. The backward runs the ring again: each step calls
flashattn's backward with the rank's final output and final LSE (so every step's gradients are
those of the global softmax), dq accumulates locally, and dk/dv accumulate in float32 buffers
that travel with the K/V and arrive home after the last step.

Masks are exact for the global positions: for every (query piece, key piece) pair of a step,
the global causal/window mask restricted to the pair is either empty (skipped: no compute,
the ring still passes the buffers), or reproduced by flashattn's own bottom-right aligned
window arguments on one call, possibly over a trimmed rectangle (_plan). Splits: "contiguous"
(rank r holds the r-th of P equal slices) or "zigzag" (2P chunks, rank r holds chunks r and
2P - 1 - r, so that every rank does the same work under a causal mask); split_sequence /
unsplit_sequence and the zigzag_* helpers cut and reassemble tensors in either layout.

Dropout and ALiBi are those of the whole sequence: a call with either option runs one
flashattn call per (query piece, key piece) pair, each passing the global positions of its
first row and first key (flashattn's positions, docs/SPEC.md "Positions"), so that dropout
draws the keep bits of the global (row, key) and ALiBi measures |global row - global key|.
A varlen call then runs per sequence too, as sequence b of a call whose other sequences
are empty (dropout's batch index and the (B, H) slopes' row are the whole batch's). The
dropout seed is drawn as flash_attn_func draws it and rank 0's is used everywhere. Every
backend takes positions (the CPU engine and the CUDA kernels).

Communication is torch.distributed's: P2P isend/irecv (NCCL on GPUs, where it runs on its own
stream, ordered against the compute stream by torch; Gloo on CPUs), plus one small all_gather
per call that checks every rank passed the same shapes and options.
"""
import math
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import torch_ops

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "split_sequence",
    "unsplit_sequence",
    "zigzag_split",
    "zigzag_unsplit",
    "zigzag_split_varlen",
    "zigzag_unsplit_varlen",
]

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------- layouts

def _pieces(layout: str, rank: int, world_size: int, seqlen: int) -> Tuple[Tuple[int, ...], ...]:
    """The contiguous pieces of a sequence of `seqlen` positions that `rank` holds, in local
    order, as (local_row, global_position, length). The one definition of both layouts: the
    split helpers and the mask planner read it."""
    if layout == "contiguous":
        n = seqlen // world_size
        return ((0, rank * n, n),)
    c = seqlen // (2 * world_size)
    return ((0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c))


def _chunks(layout: str, world_size: int) -> int:
    """How many equal chunks a sequence is cut into: its length must be a multiple of this."""
    return world_size if layout == "contiguous" else 2 * world_size


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, given {layout!r}")


def _host_ints(x, name: str) -> list:
    """cu_seqlens as a host list (a CUDA tensor is copied once: the plan needs the lengths)."""
    try:
        values = x.tolist() if isinstance(x, Tensor) else [int(v) for v in x]
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a 1-D int tensor or a sequence of ints, given "
                        f"{type(x).__name__}") from None
    if isinstance(x, Tensor) and (x.dim() != 1 or x.is_floating_point()):
        raise ValueError(f"{name}: expected a 1-D integer tensor, given {x.dim()} dimensions "
                         f"of {x.dtype}")
    return [int(v) for v in values]


def _lengths(cu_seqlens, chunks: int, name: str = "cu_seqlens") -> list:
    """The sequence lengths of a global cu_seqlens, each checked to be a multiple of `chunks`."""
    cu = _host_ints(cu_seqlens, name)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name}: expected non-decreasing prefix sums starting at 0, given "
                         f"{cu[:8]}{' ...' if len(cu) > 8 else ''}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    for i, n in enumerate(lengths):
        if n % chunks:
            raise ValueError(f"{name}: expected every sequence length to be a multiple of "
                             f"{chunks} (the chunks of the split), given length {n} for "
                             f"sequence {i}")
    return lengths


def _split(x: Tensor, rank: int, world_size: int, layout: str, dim: int, lengths: list) -> Tensor:
    pieces, base = [], 0
    for n in lengths:
        for _, start, length in _pieces(layout, rank, world_size, n):
            pieces.append(x.narrow(dim, base + start, length))
        base += n
    return torch.cat(pieces, dim)


def _unsplit(parts: Sequence[Tensor], layout: str, dim: int, lengths: list) -> Tensor:
    world_size = len(parts)
    pieces, local_base = [], 0
    for n in lengths:
        # Every rank's pieces of this sequence, in global order.
        held = sorted((start, rank, row, length) for rank in range(world_size)
                      for row, start, length in _pieces(layout, rank, world_size, n))
        pieces += [parts[rank].narrow(dim, local_base + row, length)
                   for _, rank, row, length in held]
        local_base += n // world_size
    return torch.cat(pieces, dim)


def _check_rank(rank, world_size) -> None:
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size: expected an int >= 1, given {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank: expected an int in [0, {world_size}), given {rank!r}")


def split_sequence(x: Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1,
                   cu_seqlens=None) -> Tensor:
    """The slice of x that rank `rank` of `world_size` passes to the ring functions.

    Dense (cu_seqlens None): x's dimension `dim` is one sequence, cut into P (contiguous) or
    2P (zigzag) equal chunks; rank r holds chunk r, or chunks r and 2P - 1 - r in that order.
    Varlen (cu_seqlens given: the global prefix sums of a packed batch): every sequence is cut
    the same way, and rank r's slice is the concatenation of its pieces of each sequence in
    batch order (so its local cu_seqlens is cu_seqlens // P). Returns a new tensor."""
    _check_layout(layout)
    _check_rank(rank, world_size)
    chunks = _chunks(layout, world_size)
    if cu_seqlens is None:
        n = x.shape[dim]
        if n % chunks:
            raise ValueError(f"x: expected a length along dim {dim} that is a multiple of "
                             f"{chunks} ({layout} split over {world_size} ranks), given {n}")
        return _split(x, rank, world_size, layout, dim, [n])
    lengths = _lengths(cu_seqlens, chunks)
    if sum(lengths) != x.shape[dim]:
        raise ValueError(f"x: expected {sum(lengths)} rows along dim {dim} (cu_seqlens[-1]), "
                         f"given {x.shape[dim]}")
    return _split(x, rank, world_size, layout, dim, lengths)


def unsplit_sequence(parts: Sequence[Tensor], layout: str = "zigzag", dim: int = 1,
                     cu_seqlens=None) -> Tensor:
    """The inverse of split_sequence: parts[r] is rank r's slice; returns the whole tensor."""
    _check_layout(layout)
    world_size = len(parts)
    if world_size < 1:
        raise ValueError("parts: expected one slice per rank, given none")
    chunks = _chunks(layout, world_size)
    if cu_seqlens is None:
        local = parts[0].shape[dim]
        if any(p.shape[dim] != local for p in parts) or local % (chunks // world_size):
            raise ValueError(f"parts: expected {world_size} slices of one length (a multiple "
                             f"of {chunks // world_size}) along dim {dim}, given "
                             f"{[p.shape[dim] for p in parts]}")
        return _unsplit(parts, layout, dim, [local * world_size])
    lengths = _lengths(cu_seqlens, chunks)
    for r, p in enumerate(parts):
        if p.shape[dim] != sum(lengths) // world_size:
            raise ValueError(f"parts: expected {sum(lengths) // world_size} rows along dim "
                             f"{dim} in every slice (cu_seqlens[-1] / {world_size}), given "
                             f"{p.shape[dim]} in slice {r}")
    return _unsplit(parts, layout, dim, lengths)


def zigzag_split(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank `rank`'s zigzag slice of one sequence along `dim`: chunks r and 2P - 1 - r of 2P."""
    return split_sequence(x, rank, world_size, "zigzag", dim)


def zigzag_unsplit(parts: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence from every rank's zigzag slice (parts in rank order)."""
    return unsplit_sequence(parts, "zigzag", dim)


def zigzag_split_varlen(x: Tensor, cu_seqlens, rank: int, world_size: int, dim: int = 0) -> Tensor:
    """Rank `rank`'s zigzag slice of a packed batch: each sequence split as zigzag_split."""
    return split_sequence(x, rank, world_size, "zigzag", dim, cu_seqlens)


def zigzag_unsplit_varlen(parts: Sequence[Tensor], cu_seqlens, dim: int = 0) -> Tensor:
    """The packed batch from every rank's zigzag_split_varlen slice (parts in rank order)."""
    return unsplit_sequence(parts, "zigzag", dim, cu_seqlens)


# ---------------------------------------------------------------------------- the mask plan
#
# Coordinates: local rows of one sequence, r for the queries this rank holds, c for the keys
# of the visiting K/V slice. A piece pair (query piece, key piece) is a block; globally, key
# j is visible to query i iff -left <= j - i <= right (self-attention: Sq = Sk, so the
# bottom-right alignment is the diagonal), which in local rows is an interval of c - r.
# A flashattn call over rows [Q0, Q1) and keys [K0, K1) with window (L, R) shows
# K1 - Q1 - L <= c - r <= K1 - Q1 + R (its bottom-right alignment, in local rows). So both
# masks are intervals of the diagonal index c - r, and on any rectangle two such masks are
# equal iff their intervals clipped to the diagonals the rectangle has are equal (each
# diagonal index in range names a non-empty diagonal of the rectangle).

@dataclass(frozen=True)
class _Rect:
    """One call of a step over one sequence: query rows [q0, q1), key rows [k0, k1) (local),
    and the window (left, right) that reproduces the global mask on them (-1: unbounded)."""
    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int


def _clip(lo, hi, rows, cols):
    """The diagonals c - r in [lo, hi] that the rectangle rows x cols has, as a (lo, hi) pair,
    or None when it has none (nothing visible)."""
    lo = max(lo, cols[0] - (rows[1] - 1))
    hi = min(hi, (cols[1] - 1) - rows[0])
    return (lo, hi) if lo <= hi else None


def _overlap(a, b):
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _fit(blocks, rows, cols) -> Optional[_Rect]:
    """A call over rows x cols whose window reproduces every block's global mask there, or
    None. The candidates are the window values that make the call's interval meet one
    block's bound (and -1, tried first: no masking where none is needed); the check is exact,
    so a rectangle that no single window can express is refused, never approximated."""
    inside = []
    for brows, bcols, lo, hi in blocks:
        r, c = _overlap(brows, rows), _overlap(bcols, cols)
        if r and c:
            inside.append((r, c, _clip(lo, hi, r, c)))
    d = cols[1] - rows[1]
    rights = sorted({-1} | {hi - d for _, _, _, hi in blocks if hi != math.inf and hi - d >= 0})
    lefts = sorted({-1} | {d - lo for _, _, lo, _ in blocks if lo != -math.inf and d - lo >= 0})
    for right in rights:
        for left in lefts:
            lo = d - left if left >= 0 else -math.inf
            hi = d + right if right >= 0 else math.inf
            if all(_clip(lo, hi, r, c) == want for r, c, want in inside):
                return _Rect(rows[0], rows[1], cols[0], cols[1], left, right)
    return None


@lru_cache(maxsize=4096)
def _plan(q_pieces, k_pieces, left, right, per_block=False) -> Tuple[_Rect, ...]:
    """The calls of one ring step over one sequence: disjoint rectangles that together show
    exactly the global mask (left, right: the global window, -1 unbounded, causal folded into
    right = 0). Tried in order: the whole local block as one call; else per query piece, its
    visible key pieces as one call (merged with the previous query piece's call when one
    window covers both); else per block, the rectangle trimmed to the rows and columns that
    see anything, which one window always expresses (its first row sees its first column and
    its last row its last column, so the window values come out >= 0).
    per_block: only the last form, so that every call's rows lie in one query piece and its
    keys in one key piece (contiguous global positions: what dropout and ALiBi need)."""
    lo_g = -left if left >= 0 else -math.inf
    hi_g = right if right >= 0 else math.inf
    blocks = []  # (rows, cols, lo, hi): the global interval of c - r for each piece pair
    for qr, qg, lq in q_pieces:
        for kr, kg, lk in k_pieces:
            base = (qg - qr) - (kg - kr)
            blocks.append(((qr, qr + lq), (kr, kr + lk), base + lo_g, base + hi_g))
    visible = [b for b in blocks if _clip(b[2], b[3], b[0], b[1])]
    if not visible:
        return ()
    if per_block:
        return tuple(_trimmed(b) for b in visible)
    rows = (min(b[0][0] for b in visible), max(b[0][1] for b in visible))
    cols = (min(b[1][0] for b in visible), max(b[1][1] for b in visible))
    whole = _fit(blocks, rows, cols)
    if whole:
        return (whole,)
    calls = []
    for qrows in sorted({b[0] for b in visible}):
        row = [b for b in visible if b[0] == qrows]
        kcols = (min(b[1][0] for b in row), max(b[1][1] for b in row))
        call = _fit(blocks, qrows, kcols)
        if call is None:
            calls += [_trimmed(b) for b in row]
            continue
        prev = calls[-1] if calls else None
        if prev and (prev.k0, prev.k1) == kcols and prev.q1 == qrows[0]:
            merged = _fit(blocks, (prev.q0, qrows[1]), kcols)
            if merged:
                calls[-1] = merged
                continue
        calls.append(call)
    return tuple(calls)


def _trimmed(block) -> _Rect:
    (r0, r1), (c0, c1), lo, hi = block
    lo, hi = _clip(lo, hi, (r0, r1), (c0, c1))
    rows = (max(r0, c0 - hi), min(r1, c1 - lo))          # rows that see a key of the block
    cols = (max(c0, r0 + lo), min(c1, r1 + hi))          # keys that some row sees
    call = _fit([block], rows, cols)
    assert call is not None, "a trimmed block is always one window"  # see _plan
    return call


# ---------------------------------------------------------------------------- calls

@dataclass(frozen=True)
class _Options:
    softmax_scale: float
    softcap: float
    deterministic: bool
    dropout_p: float = 0.0
    rng_state: Optional[Tensor] = None  # (seed, offset): one draw, shared by every rank
    alibi_slopes: Optional[Tensor] = None

    @property
    def positional(self) -> bool:
        """Whether the calls must say where their rows and keys sit in the whole sequence
        (Options::positions): dropout's keep bits and ALiBi's distances are global."""
        return self.dropout_p > 0.0 or self.alibi_slopes is not None


@dataclass(frozen=True)
class _Call:
    """One flashattn call of a step: local query rows `rows`, local key rows `cols`, the
    window; `varlen` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for a varlen
    call over those rows, None for a dense call over the slices; `positions` = the global
    positions of the first row and first key (None when no option needs them)."""
    rows: Tuple[int, int]
    cols: Tuple[int, int]
    left: int
    right: int
    varlen: Optional[tuple] = None
    positions: Optional[Tuple[int, int]] = None

    def forward(self, q, k, v, o: _Options):
        args = (o.dropout_p, o.softmax_scale, False, self.left, self.right, o.softcap,
                o.alibi_slopes, o.deterministic, o.rng_state)
        if self.varlen is None:
            return torch_ops._fwd_impl(q, k, v, *args, positions=self.positions)
        return torch_ops._varlen_fwd_impl(q, k, v, *self.varlen, *args,
                                          positions=self.positions)

    def backward(self, dout, q, k, v, out, lse, o: _Options):
        args = (o.rng_state, o.dropout_p, o.softmax_scale, False, self.left, self.right,
                o.softcap, o.alibi_slopes, o.deterministic)
        if self.varlen is None:
            return torch_ops._bwd_impl(dout, q, k, v, out, lse, *args, positions=self.positions)
        return torch_ops._varlen_bwd_impl(dout, q, k, v, out, lse, *self.varlen, *args,
                                          positions=self.positions)


def _global_start(pieces, local0: int) -> int:
    """The global position of local row `local0`, which lies in one of `pieces`."""
    for row, start, length in pieces:
        if row <= local0 < row + length:
            return start + local0 - row
    raise AssertionError(f"local row {local0} is in no piece {pieces}")


def _dense_steps(layout, rank, world_size, seqlen, window, positional=False) -> list:
    """Per ring step, the dense calls (every batch row has the same geometry). positional:
    one call per piece pair, each with its global positions."""
    steps = []
    q_pieces = _pieces(layout, rank, world_size, seqlen)
    for step in range(world_size):
        k_pieces = _pieces(layout, (rank - step) % world_size, world_size, seqlen)
        rects = _plan(q_pieces, k_pieces, *window, positional)
        steps.append([_Call((r.q0, r.q1), (r.k0, r.k1), r.left, r.right, positions=(
            _global_start(q_pieces, r.q0), _global_start(k_pieces, r.k0)) if positional else None)
            for r in rects])
    return steps


def _positional_varlen_steps(layout, rank, world_size, lengths, window, device) -> list:
    """Per ring step, the varlen calls with positions: one per (sequence b, piece pair), each a
    varlen call over just its rows with the whole batch's B sequences, all empty but b, so
    that it is sequence b as in the whole batch (dropout's batch index, the row of (B, H)
    ALiBi slopes), with the global positions of its first row and key."""
    local = [n // world_size for n in lengths]
    bases = [sum(local[:b]) for b in range(len(local))]
    steps = []
    for step in range(world_size):
        source = (rank - step) % world_size
        calls = []
        for b, (n, base) in enumerate(zip(lengths, bases)):
            q_pieces = _pieces(layout, rank, world_size, n)
            k_pieces = _pieces(layout, source, world_size, n)
            for r in _plan(q_pieces, k_pieces, *window, True):
                rows, cols = r.q1 - r.q0, r.k1 - r.k0
                after = len(lengths) - b  # sequence b and the empty ones after it
                cu_q = torch.tensor([0] * (b + 1) + [rows] * after, dtype=torch.int32,
                                    device=device)
                cu_k = torch.tensor([0] * (b + 1) + [cols] * after, dtype=torch.int32,
                                    device=device)
                calls.append(_Call((base + r.q0, base + r.q1), (base + r.k0, base + r.k1),
                                   r.left, r.right, (cu_q, cu_k, rows, cols),
                                   (_global_start(q_pieces, r.q0), _global_start(k_pieces, r.k0))))
        steps.append(calls)
    return steps


def _varlen_steps(layout, rank, world_size, lengths, window, device) -> list:
    """Per ring step, the varlen calls. Each sequence has its own plan (the window is in
    tokens, the chunks differ in length); the rectangles of all sequences that share a window
    go into one call, at most one per sequence, as call-sequences whose queries and keys are
    those rows. The rows between them become call-sequences with no keys (their out is 0 and
    lse -inf: the merge leaves those rows alone) or no queries (their dk, dv are 0), so every
    call covers the whole local tensors, in order, and nothing is copied."""
    local = [n // world_size for n in lengths]
    bases = [sum(local[:b]) for b in range(len(local))]
    total = sum(local)
    steps, tables = [], []
    for step in range(world_size):
        source = (rank - step) % world_size
        groups = {}  # (left, right, round) -> [(base, rect)]
        for n, base in zip(lengths, bases):
            rects = _plan(_pieces(layout, rank, world_size, n),
                          _pieces(layout, source, world_size, n), *window)
            seen = {}
            for rect in rects:
                key = (rect.left, rect.right)
                seen[key] = seen.get(key, -1) + 1
                groups.setdefault(key + (seen[key],), []).append((base, rect))
        calls = []
        for (left, right, _), members in groups.items():
            cu_q, cu_k = [0], [0]

            def upto(q_end, k_end):  # the next call-sequence ends there (none if empty)
                if (q_end, k_end) != (cu_q[-1], cu_k[-1]):
                    cu_q.append(q_end)
                    cu_k.append(k_end)

            for base, rect in members:
                upto(base + rect.q0, cu_k[-1])         # the queries before it: no keys
                upto(cu_q[-1], base + rect.k0)         # the keys before it: no queries
                upto(base + rect.q1, base + rect.k1)   # the rectangle
            upto(total, cu_k[-1])
            upto(cu_q[-1], total)
            max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
            max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
            tables += [cu_q, cu_k]
            calls.append([(0, total), (0, total), left, right, max_q, max_k])
        steps.append(calls)
    # Every call's cu_seqlens in one int32 tensor, moved to the device once per call.
    flat = torch.tensor([x for t in tables for x in t], dtype=torch.int32).to(device)
    views, offset = [], 0
    for t in tables:
        views.append(flat[offset:offset + len(t)])
        offset += len(t)
    views = iter(views)
    return [[_Call(rows, cols, left, right, (next(views), next(views), max_q, max_k))
             for rows, cols, left, right, max_q, max_k in calls] for calls in steps]


# ---------------------------------------------------------------------------- the ring

class _Ring:
    """The ring of a process group: this rank sends to rank + 1 and receives from rank - 1
    (global ranks for P2POp). communicate=False (the benchmark's compute-only run) posts
    nothing: every step then computes on the rank's own buffers."""

    def __init__(self, group, communicate: bool = True):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        to_global = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        whole = group is None or group is dist.group.WORLD
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.send_to = nxt if whole else to_global(group, nxt)
        self.recv_from = prev if whole else to_global(group, prev)
        self.communicate = communicate and self.size > 1


class _Circulating:
    """A buffer that moves one rank along the ring per start()/finish(): start() posts the
    send of the current buffer and the receive into a spare one; finish() waits for both and
    swaps them, so a buffer is received into only after its own send has completed. On CUDA,
    NCCL runs them on its stream, which waits for the compute stream's work queued before
    start() (so a spare still being read by the last step's compute is not overwritten) and
    which the compute stream waits for in finish()."""

    def __init__(self, ring: _Ring, tensor: Tensor, tag: int):
        self.ring, self.tensor, self.tag = ring, tensor, tag
        self._spare = None
        self._works = None

    def start(self) -> None:
        if not self.ring.communicate:
            return
        if self._spare is None:
            self._spare = torch.empty_like(self.tensor)
        r = self.ring
        ops = [dist.P2POp(dist.isend, self.tensor, r.send_to, r.group, self.tag),
               dist.P2POp(dist.irecv, self._spare, r.recv_from, r.group, self.tag)]
        self._works = dist.batch_isend_irecv(ops)

    def finish(self) -> None:
        if self._works is None:
            return
        for work in self._works:
            work.wait()
        self._works = None
        self.tensor, self._spare = self._spare, self.tensor


def _merge(out: Tensor, lse: Tensor, out_part: Tensor, lse_part: Tensor) -> None:
    """out, lse (float32, updated in place; lse laid out as out's rows) become the attention
    over the union of their keys and the part's: softmax over a union is each side's softmax
    weighted by exp(its lse - the union's lse), the union's lse being logaddexp of the two.
    Rows that see no key on either side (both -inf) keep out = 0, lse = -inf."""
    new = torch.logaddexp(lse, lse_part)
    safe = new.masked_fill(new == -math.inf, 0.0)
    out.mul_((lse - safe).exp_().unsqueeze(-1))
    out.add_(out_part * (lse_part - safe).exp_().unsqueeze(-1))
    lse.copy_(new)


class _RingRun:
    """One ring attention call: its ring, its calls per step and its options. seq_dim is the
    sequence dimension of q, k, v and out (1 dense, 0 varlen); their lse is laid out (.., H,
    S) with the sequence at seq_dim + 1."""

    def __init__(self, ring: _Ring, steps: list, seq_dim: int, options: _Options):
        self.ring, self.steps, self.seq_dim, self.options = ring, steps, seq_dim, options

    def _rows(self, t: Tensor, span) -> Tensor:
        return t.narrow(self.seq_dim, span[0], span[1] - span[0])

    def forward(self, q: Tensor, k: Tensor, v: Tensor):
        sd = self.seq_dim
        # k and v in one buffer: one transfer per step; a copy of our own, so it can receive.
        kv = _Circulating(self.ring, torch.stack((k, v)), tag=0)
        out = q.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float32)
        lse_shape = q.shape[:sd] + (q.shape[sd + 1], q.shape[sd])
        lse = q.new_full(lse_shape, -math.inf, dtype=torch.float32)
        lse_rows = lse.transpose(sd, sd + 1)  # a view: merging into it writes lse
        for step, calls in enumerate(self.steps):
            if step + 1 < len(self.steps):
                kv.start()  # the next step's K/V travel while this step computes
            k_now, v_now = kv.tensor[0], kv.tensor[1]
            for call in calls:
                o, l = call.forward(self._rows(q, call.rows), self._rows(k_now, call.cols),
                                    self._rows(v_now, call.cols), self.options)
                _merge(self._rows(out, call.rows), self._rows(lse_rows, call.rows), o,
                       l.transpose(sd, sd + 1))
            kv.finish()
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse):
        sd = self.seq_dim
        kv = _Circulating(self.ring, torch.stack((k, v)), tag=0)
        # The dk/dv accumulator of the visiting K/V travels with it (float32), one step behind.
        dkv = _Circulating(self.ring, k.new_zeros((2,) + tuple(k.shape), dtype=torch.float32),
                           tag=1)
        dq = q.new_zeros(q.shape, dtype=torch.float32)
        lse_of = {}  # the final lse of a call's rows, contiguous as the backward takes it
        for step, calls in enumerate(self.steps):
            if step + 1 < len(self.steps):
                kv.start()
            k_now, v_now = kv.tensor[0], kv.tensor[1]
            parts = []
            for call in calls:
                rows, cols = call.rows, call.cols
                if rows not in lse_of:
                    lse_of[rows] = lse.narrow(sd + 1, rows[0], rows[1] - rows[0]).contiguous()
                dq_c, dk_c, dv_c = call.backward(
                    self._rows(dout, rows), self._rows(q, rows), self._rows(k_now, cols),
                    self._rows(v_now, cols), self._rows(out, rows), lse_of[rows], self.options)
                self._rows(dq, rows).add_(dq_c)
                parts.append((cols, dk_c, dv_c))
            dkv.finish()  # this K/V's accumulator has arrived (sent by the previous rank)
            for cols, dk_c, dv_c in parts:
                self._rows(dkv.tensor[0], cols).add_(dk_c)
                self._rows(dkv.tensor[1], cols).add_(dv_c)
            dkv.start()   # on with its K/V; after the last step this brings it home
            kv.finish()
        dkv.finish()
        return dq.to(q.dtype), dkv.tensor[0].to(k.dtype), dkv.tensor[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run):
        out, lse = run.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run = run
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.run.backward(dout, q, k, v, out, lse)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------- checks

# The arguments whose values every rank must share, in the order of the exchanged record.
_SHARED = ("q", "k", "v", "dtype", "device", "softmax_scale", "causal", "window_size",
           "softcap", "layout", "deterministic", "cu_seqlens", "max_seqlen", "requires_grad",
           "dropout_p", "alibi_slopes")
# The arguments a rank's own check can reject (their index travels in the record, so that
# every rank raises, naming it, rather than some waiting for the others forever).
_LOCAL = ("q", "k", "v", "dropout_p", "alibi_slopes", "window_size", "softcap", "layout",
          "cu_seqlens", "max_seqlen")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DIMS = 4  # slots for a shape in the record (dense tensors have 4 dimensions)
# Where each shared value sits in the record, after the two slots of a local error.
_SLOTS, _at = {}, 2
for _name in _SHARED:
    _width = _DIMS if _name in ("q", "k", "v") else 2 if _name == "window_size" else 1
    _SLOTS[_name], _at = slice(_at, _at + _width), _at + _width
del _name, _width, _at


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group "
                         "(dist.init_process_group), given none (torch.distributed is not "
                         "initialized)")
    group = group if group is not None else dist.group.WORLD
    try:
        rank = dist.get_rank(group)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"group: expected a torch.distributed process group, given "
                         f"{type(group).__name__} ({e})") from None
    if rank < 0:
        raise ValueError("group: expected a process group that this rank belongs to, given "
                         "one it is not a member of")
    return group


class _ArgumentError(Exception):
    def __init__(self, name, message):
        super().__init__(message)
        self.name = name


def _check_local(q, k, v, dims, dropout_p, alibi_slopes, window, window_text, softcap, layout,
                 lengths_check):
    """This rank's own checks; raises _ArgumentError(name, message)."""
    layout_text = "(batch, seqlen, nheads, headdim)" if dims == 4 else "(total, nheads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise _ArgumentError(name, f"{name}: expected a torch.Tensor, given "
                                       f"{type(t).__name__}")
        if t.dim() != dims:
            raise _ArgumentError(name, f"{name}: expected {dims} dimensions {layout_text}, "
                                       f"given {t.dim()} (shape {tuple(t.shape)})")
    if not 0.0 <= dropout_p < 1.0:
        raise _ArgumentError("dropout_p", f"dropout_p: expected a probability in [0, 1), "
                                          f"given {dropout_p}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
        raise _ArgumentError("alibi_slopes", f"alibi_slopes: expected None or a float32 "
                                             f"tensor (nheads) or (batch, nheads), given "
                                             f"{type(alibi_slopes).__name__}")
    if layout not in LAYOUTS:
        raise _ArgumentError("layout", f"layout: expected one of {LAYOUTS}, given {layout!r}")
    if min(window) < -1:
        raise _ArgumentError("window_size", f"window_size: expected (left, right), each -1 "
                             f"(unbounded) or an int >= 0, given {window_text}")
    if not softcap >= 0.0:
        raise _ArgumentError("softcap", f"softcap: expected a number >= 0, given {softcap}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise _ArgumentError(name, f"{name}: expected q's dtype and device ({q.dtype}, "
                                       f"{q.device}), given {t.dtype}, {t.device}")
    if q.dtype not in _DTYPES:
        raise _ArgumentError("q", f"q: expected float32, float16 or bfloat16, given {q.dtype}")
    if v.shape != k.shape:
        raise _ArgumentError("v", f"v: expected k's shape {tuple(k.shape)}, given "
                                  f"{tuple(v.shape)}")
    seq = dims - 3  # the sequence dimension: 1 dense, 0 varlen (the total of the batch)
    if k.shape[:seq + 1] != q.shape[:seq + 1] or k.shape[-1] != q.shape[-1]:
        raise _ArgumentError("k", f"k: expected q's local length, batch and head dim "
                                  f"(ring attention is self-attention over one split "
                                  f"sequence; q {tuple(q.shape)}), given {tuple(k.shape)}")
    if q.shape[-2] % k.shape[-2]:
        raise _ArgumentError("k", f"k: expected a head count that divides q's "
                                  f"{q.shape[-2]}, given {k.shape[-2]}")
    lengths_check()


def _exchange(group, rank_error, record, device) -> list:
    """Every rank's record (a fixed-length list of ints, the first two for a local error) is
    gathered; a mismatch or another rank's error raises ValueError naming the argument.
    Returns rank 0's record (its values past the shared ones are what every rank adopts)."""
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [t.tolist() for t in everyone]
    if rank_error is not None:
        raise ValueError(str(rank_error))
    for r, row in enumerate(rows):
        if row[0]:
            name = _LOCAL[row[1]]
            raise ValueError(f"{name}: rejected by rank {r} of the group (its error says "
                             f"why); every rank must pass valid arguments")
    for r, row in enumerate(rows[1:], start=1):
        for name, at in _SLOTS.items():
            if row[at] != rows[0][at]:
                raise ValueError(f"{name}: expected the same value on every rank of the group, "
                                 f"given {_show(name, rows[0][at])} on rank 0 and "
                                 f"{_show(name, row[at])} on rank {r}")
    return rows[0]


def _show(name, values):
    if name in ("q", "k", "v"):
        return "shape " + str(tuple(x for x in values if x >= 0))
    if name in ("softmax_scale", "softcap", "dropout_p"):
        return repr(struct.unpack("<d", struct.pack("<q", values[0]))[0])
    if name == "dtype":
        return str(_DTYPES[values[0]]) if 0 <= values[0] < len(_DTYPES) else "another dtype"
    if name == "layout":
        return repr(LAYOUTS[values[0]]) if 0 <= values[0] < len(LAYOUTS) else "another layout"
    if name == "cu_seqlens":
        return f"lengths with checksum {values[0]}"
    if name == "window_size":
        return str(tuple(values))
    if name == "alibi_slopes":
        return "a tensor" if values[0] else "None"
    return str(values[0])


def _record(q, k, v, scale, causal, window, softcap, layout, deterministic, lengths,
            max_seqlen, requires_grad, dropout_p, has_alibi):
    def shape(t):
        dims = list(t.shape)[:_DIMS] if isinstance(t, Tensor) else []
        return dims + [-1] * (_DIMS - len(dims))

    values = {
        "q": shape(q), "k": shape(k), "v": shape(v),
        "dtype": [_DTYPES.index(q.dtype) if getattr(q, "dtype", None) in _DTYPES else -1],
        "device": [1 if getattr(q, "is_cuda", False) else 0],
        "softmax_scale": [_float_bits(scale)],
        "causal": [int(causal)],
        "window_size": list(window),
        "softcap": [_float_bits(softcap)],
        "layout": [LAYOUTS.index(layout) if layout in LAYOUTS else -1],
        "deterministic": [int(deterministic)],
        "cu_seqlens": [zlib.crc32(struct.pack(f"<{len(lengths)}q", *lengths)) if lengths else -1],
        "max_seqlen": [max_seqlen],
        "requires_grad": [int(requires_grad)],
        "dropout_p": [_float_bits(dropout_p)],
        "alibi_slopes": [int(has_alibi)],
    }
    return [x for name in _SHARED for x in values[name]]


# ---------------------------------------------------------------------------- entry points

def _attention(q, k, v, group, dropout_p, softmax_scale, causal, window_size, softcap,
               alibi_slopes, deterministic, return_attn_probs, layout, cu_seqlens=None,
               max_seqlen=None, communicate=True):
    """Both public functions (cu_seqlens None: dense). communicate=False: the benchmark's
    compute-only run (every step's calls on the rank's own K/V, no transfer)."""
    group = _resolve_group(group)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    varlen = cu_seqlens is not None
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        left = right = -2  # refused by the checks below, naming window_size
    window = (left, 0 if causal else right)
    lengths, error = [], None

    def check_lengths():
        nonlocal lengths
        chunks = _chunks(layout, world_size)
        if not varlen:
            n = q.shape[1] * world_size
            if n % chunks:
                raise _ArgumentError("q", f"q: expected a local length that is a multiple of "
                                          f"{chunks // world_size} ({layout} split), given "
                                          f"{q.shape[1]}")
            lengths = [n]
            return
        try:
            lengths = _lengths(cu_seqlens, chunks)
        except (TypeError, ValueError) as e:
            raise _ArgumentError("cu_seqlens", str(e)) from None
        if sum(lengths) != q.shape[0] * world_size:
            raise _ArgumentError("q", f"q: expected {sum(lengths) // world_size} local rows "
                                      f"(cu_seqlens[-1] / {world_size}), given {q.shape[0]}")
        if max_seqlen is None or int(max_seqlen) < max(lengths, default=0):
            raise _ArgumentError("max_seqlen", f"max_seqlen: expected at least the longest "
                                               f"sequence, {max(lengths, default=0)}, given "
                                               f"{max_seqlen}")

    try:
        _check_local(q, k, v, 3 if varlen else 4, float(dropout_p), alibi_slopes,
                     (left, right), repr(window_size), float(softcap), layout, check_lengths)
    except _ArgumentError as e:
        error = e
    head_dim = q.shape[-1] if isinstance(q, Tensor) else 1
    scale = float(softmax_scale) if softmax_scale is not None else head_dim ** -0.5
    requires_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in (q, k, v))
    record = [int(error is not None), _LOCAL.index(error.name) if error else 0]
    p = float(dropout_p) if error is None else 0.0
    record += _record(q, k, v, scale, causal, window, float(softcap), layout, deterministic,
                      lengths, int(max_seqlen or 0), requires_grad, p, alibi_slopes is not None)
    # The dropout seed, drawn as flash_attn_func draws it (torch's generator: with the same
    # torch.manual_seed the ring and the whole-sequence call drop the same elements); rank 0's
    # draw is every rank's, so that a rank whose generator differs cannot split the mask.
    rng_state = torch_ops._draw_rng_state(p)
    record.append(int(rng_state[0]))
    # NCCL gathers CUDA tensors only (the current device: the rank's, by NCCL's rules).
    nccl = dist.get_backend(group) == "nccl"
    rank0 = _exchange(group, error, record, torch.device("cuda", torch.cuda.current_device())
                      if nccl else torch.device("cpu"))
    rng_state[0] = rank0[-1]

    options = _Options(scale, float(softcap), bool(deterministic), p, rng_state, alibi_slopes)
    if varlen and options.positional:
        steps = _positional_varlen_steps(layout, rank, world_size, lengths, window, q.device)
    elif varlen:
        steps = _varlen_steps(layout, rank, world_size, lengths, window, q.device)
    else:
        steps = _dense_steps(layout, rank, world_size, lengths[0], window, options.positional)
    run = _RingRun(_Ring(group, communicate), steps, 0 if varlen else 1, options)
    if requires_grad:
        out, lse = _RingAttention.apply(q, k, v, run)
    else:
        out, lse = run.forward(q, k, v)
    return (out, lse, None) if return_attn_probs else out


_ARGS_DOC = """\
        dropout_p: float. Dropout probability: the keep bits are exactly those of
            flash_attn_func over the whole sequence (each chunk call passes its global
            positions, docs/SPEC.md "Positions"); the seed is drawn from torch's generator as
            flash_attn_func draws it, rank 0's draw used by every rank.
        softmax_scale: float. Default 1 / sqrt(headdim).
        causal: bool. The causal mask over the *global* positions (query i sees key j <= i).
        window_size: (left, right), global: query i sees keys i - left .. i + right (-1:
            unbounded on that side); causal sets right = 0.
        softcap: float. > 0: scores become softcap * tanh(scores / softcap).
        alibi_slopes: (nheads) or (batch_size, nheads), fp32: the bias -slope * |i - j| of
            the whole sequence's global positions (each chunk call passes them). CPU backend
            only for now, like dropout.
        deterministic: bool. Passed to flashattn's backward; the ring adds its steps in a
            fixed order, so the result is as reproducible as that backward.
        return_attn_probs: bool. Also return the local rows' log-sum-exp over the whole
            sequence, and None (no S_dmask: it would be the whole sequence's).
        group: the torch.distributed process group whose ranks hold the slices (default: the
            world). Every rank of it must call with the same shapes and options (checked: a
            ValueError names the argument that differs), and every rank must backpropagate.
        layout: "contiguous" (rank r holds the r-th of P equal slices) or "zigzag" (2P
            chunks; rank r holds chunks r and 2P - 1 - r: equal work under a causal mask).
            It must be how the data was split (split_sequence / zigzag_split)."""


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=False, group=None, *,
                         layout="contiguous"):
    return _attention(q, k, v, group, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, layout)


ring_flash_attn_func.__doc__ = f"""Exact attention over a sequence split over the ranks of
    `group` (ring attention): each rank passes its local slice and gets its queries' output
    over the whole sequence, the same as flash_attn_func over the whole sequence (up to
    rounding), differentiable.

    Arguments:
        q: (batch_size, seqlen_local, nheads, headdim), this rank's slice of the queries.
        k: (batch_size, seqlen_local, nheads_k, headdim); v: like k. GQA/MQA: nheads a
            multiple of nheads_k (the smaller k, v are what travel around the ring).
            seqlen_local = seqlen / P, the same on every rank (even for zigzag).
{_ARGS_DOC}

    Return:
        out: (batch_size, seqlen_local, nheads, headdim).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_local), fp32.
        None [if return_attn_probs].
    """


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, layout="contiguous"):
    return _attention(q, k, v, group, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, layout, cu_seqlens,
                      max_seqlen)


ring_flash_attn_varlen_func.__doc__ = f"""Ring attention over a packed batch of sequences,
    every sequence split over the ranks of `group` (the layout of split_sequence with
    cu_seqlens): rank r's rows are its piece(s) of sequence 0, then of sequence 1, ...

    Arguments:
        q: (total_local, nheads, headdim), total_local = cu_seqlens[-1] / P.
        k, v: (total_local, nheads_k, headdim).
        cu_seqlens: (batch_size + 1,) int: the *global* prefix sums of the sequence lengths
            (the same on every rank); every length a multiple of P (contiguous) or 2P
            (zigzag). Read on the host once per call. This rank's local prefix sums are
            cu_seqlens // P.
        max_seqlen: int. At least the longest global sequence.
{_ARGS_DOC}

    Return:
        out: (total_local, nheads, headdim).
        softmax_lse [if return_attn_probs]: (nheads, total_local), fp32.
        None [if return_attn_probs].
    """
