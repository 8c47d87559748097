"""flashattn.distributed (ring attention, docs/CONTEXT_PARALLEL.md) on one machine.

CPU: groups of 2 and 4 processes over Gloo, started once per world size (forked from a
forkserver that imported torch once; rendezvous through a FileStore in a fresh temporary
directory, so no port can collide) and reused by every test; a test sends a case to every
rank and waits for all answers with a timeout, so a failure or a hang never blocks CI (a group
that does not answer is killed and restarted). Every rank draws the same global inputs from the test's
seed (fresh each run, printed on failure), computes the float64 reference over the whole
sequence itself, runs ring attention on its own slice and checks its slice of the output,
the lse and the gradients (dq, dk, dv) under docs/SPEC.md's accuracy rule: fp32 within 1e-5
relative to the reference's scale (gradients: to the largest of the three); fp16/bf16 within
2x (gradients 3x) the error of a plain implementation in that dtype, plus a floor.

GPU: the same cases over NCCL, one process per GPU, when at least 2 CUDA devices are
visible and flashattn has its CUDA backend (skipped, with the reason shown, otherwise).

Also in this process, without torch.distributed: the split helpers, the mask planner against
the global mask written out (every geometry of a small grid), zigzag's equal causal work,
and the error for a call without a process group.
"""
import datetime
import multiprocessing
import os
import queue
import random
import shutil
import tempfile
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the ring attention "
                                            "tests need it")
import torch.distributed as dist  # noqa: E402

if not dist.is_available():
    pytest.skip("this PyTorch build has no torch.distributed: the ring attention tests need it",
                allow_module_level=True)

from flashattn import distributed as D  # noqa: E402
from flashattn import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashattn.distributed import (ring_flash_attn_func, ring_flash_attn_varlen_func,  # noqa: E402
                                   split_sequence, unsplit_sequence, zigzag_split,
                                   zigzag_split_varlen, zigzag_unsplit, zigzag_unsplit_varlen)
from torch_reference import attention_reference  # noqa: E402

GLOO = dist.is_gloo_available()
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 5e-4}
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TIMEOUT_S = 90  # per case, all ranks; a case takes well under a second here


# ---------------------------------------------------------------------------- process groups

def _worker(rank, world_size, init_file, backend, tasks, results):
    """One rank: joins the group, then runs the cases it is sent until it gets None."""
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60),
                                **({"device_id": device} if backend == "nccl" else {}))
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "ready", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        name, kwargs = task
        try:
            globals()[name](Rank(rank, world_size, device), **kwargs)
            results.put((rank, name, None))
        except BaseException:
            results.put((rank, name, traceback.format_exc()))
    dist.destroy_process_group()


class Rank:
    def __init__(self, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device


class Group:
    """world_size ranks that run the cases run() sends them. After a failure the group is
    closed (a rank may have left the others mid-ring); the next test starts a fresh one."""

    def __init__(self, world_size, backend):
        self.world_size, self.backend = world_size, backend
        self.dir = tempfile.mkdtemp(prefix="flashattn_ring_")
        # forkserver: one fresh process imports torch and this module once, then forks every
        # rank from that clean state (no threads, no CUDA context yet): a rank starts in
        # milliseconds instead of re-importing torch (seconds each on a small machine).
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        # One OpenMP thread per rank (2 cores here, up to 4 ranks): read when a child starts.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            self.procs = [ctx.Process(target=_worker, daemon=True,
                                      args=(r, world_size, os.path.join(self.dir, "store"),
                                            backend, self.tasks[r], self.results))
                          for r in range(world_size)]
            for p in self.procs:
                p.start()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self.broken = False
        self._collect("ready", timeout=180)

    def _collect(self, name, timeout):
        errors, answered = {}, set()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(answered) < self.world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, what, error = self.results.get(timeout=max(left, 0.01))
            except queue.Empty:
                self.close()
                silent = sorted(set(range(self.world_size)) - answered)
                raise AssertionError(f"{name}: ranks {silent} did not answer within {timeout} s "
                                     f"(the group was killed); errors so far: {errors}") from None
            if what != name:
                self.close()
                raise AssertionError(f"expected an answer to {name}, got one to {what}")
            answered.add(rank)
            if error:
                errors[rank] = error
        if errors:
            self.close()
            text = "\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(errors.items()))
            raise AssertionError(f"{name} failed on ranks {sorted(errors)}:\n{text}")

    def run(self, case, **kwargs):
        for q in self.tasks:
            q.put((case.__name__, kwargs))
        self._collect(case.__name__, TIMEOUT_S)

    def close(self):
        self.broken = True
        for q in self.tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_groups = {}


def group_of(world_size, backend):
    key = (world_size, backend)
    g = _groups.get(key)
    if g is None or g.broken:
        if backend == "nccl":  # one NCCL group at a time: no GPU shared by two ranks
            for other in [k for k in _groups if k[1] == "nccl"]:
                _groups.pop(other).close()
        g = _groups[key] = Group(world_size, backend)
    return g


@pytest.fixture(scope="module", autouse=True)
def _close_groups():
    yield
    for g in _groups.values():
        if not g.broken:
            g.close()
    _groups.clear()


@pytest.fixture
def seed():
    s = random.randrange(2 ** 31)
    print(f"seed {s}")  # shown with a failure's output
    return s


needs_gloo = pytest.mark.skipif(not GLOO, reason="this PyTorch build has no Gloo backend: the "
                                                 "CPU ring attention tests need it")


def cpu(world_size):
    return group_of(world_size, "gloo")


# ---------------------------------------------------------------------------- the rule

def check(name, got, ref64, low=None, magnitude=None):
    """docs/SPEC.md's rule; `magnitude`: the largest of the three gradients (for gradients)."""
    got, ref64 = got.detach().double().cpu(), ref64.detach().double().cpu()
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    err = (got - ref64).abs().max().item()
    scale = magnitude if magnitude is not None else ref64.abs().max().item()
    if low is None:
        bound = 1e-5 * max(scale, 1.0)
        rule = f"1e-5 x {max(scale, 1.0):.3g}"
    else:
        low_err = (low.detach().double().cpu() - ref64).abs().max().item()
        factor = 2 if magnitude is None else 3
        floor = FLOOR[low.dtype] if magnitude is None else max(FLOOR[low.dtype],
                                                              ULP[low.dtype] * magnitude)
        bound = factor * low_err + floor
        rule = f"{factor} x {low_err:.3g} (plain {low.dtype}) + {floor:.2g}"
    assert err <= bound, f"{name}: max error {err:.3g} > {rule}"  # NaN never passes


def check_lse(lse, lse64, exact):
    """fp32 inputs: within 1e-5 relative; fp16/bf16 inputs (the lse is still computed in
    fp32, from the rounded inputs the reference also reads): as tests/python/test_gpu.py."""
    assert lse.dtype == torch.float32
    lse, lse64 = lse.double().cpu(), lse64.double().cpu()
    err = (lse - lse64).abs().max().item()
    scale = max(lse64.abs().max().item(), 1.0)
    bound = 1e-5 * scale if exact else 1e-3 + 1e-4 * scale
    assert err <= bound, f"lse: max error {err:.3g} > {bound:.3g}"


def check_all(out, lse, grads, ref, split):
    """ref: (out64, lse64, grads64, out_low, grads_low) of the whole sequence; split(x, dim)
    cuts a whole-sequence tensor to this rank's slice."""
    out64, lse64, grads64, out_low, grads_low = ref
    check("out", out, split(out64), None if out_low is None else split(out_low))
    check_lse(lse, split(lse64, lse_dim=True), exact=out_low is None)
    magnitude = max(g.abs().max().item() for g in grads64)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert grads[i].dtype == out.dtype, f"{name}: dtype {grads[i].dtype}"
        check(name, grads[i], split(grads64[i]),
              None if grads_low is None else split(grads_low[i]), magnitude)


def references(attend, tensors, dout, dtype):
    """attend (returning out, lse) over the whole sequence: float64 (out, lse, grads), then
    the plain implementation in dtype (out, grads) for fp16/bf16, None for fp32."""
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    out64, lse64 = attend(*leaves)
    grads64 = torch.autograd.grad(out64, leaves, dout.double())
    if dtype == torch.float32:
        return out64.detach(), lse64.detach(), grads64, None, None
    leaves = [t.detach().requires_grad_() for t in tensors]
    out_low, _ = attend(*leaves)
    grads_low = torch.autograd.grad(out_low, leaves, dout)
    return out64.detach(), lse64.detach(), grads64, out_low.detach(), grads_low


def inputs(seed, shapes, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


def alibi_and_keep(seed, whole_call, shape, alibi, dropout_p, device):
    """The ALiBi slopes (shape, fp32, or None) and the dropout keep bits (B, H, Sq, Sk) of the
    single whole-sequence flashattn call (its S_dmask, negated where dropped), drawn with
    torch's generator at `seed`, which the ring's call then reuses. None without dropout."""
    slopes = None
    if alibi:
        slopes = torch.rand(shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    keep = None
    if dropout_p > 0:
        torch.manual_seed(seed)
        keep = ~torch.signbit(whole_call(slopes))
        assert 0 < keep.float().mean().item() < 1
    return slopes, keep


# ---------------------------------------------------------------------------- cases (per rank)

def case_dense(ctx, seed, dtype, b, s, h, hk, d, layout, causal=False, window=(-1, -1),
               softcap=0.0, scale=None, dropout_p=0.0, alibi=None):
    dtype = getattr(torch, dtype)
    q, k, v, dout = inputs(seed, [(b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)],
                           dtype, ctx.device)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    slopes, keep = alibi_and_keep(seed, lambda slopes: flash_attn_func(
        q, k, v, dropout_p=dropout_p, alibi_slopes=slopes, return_attn_probs=True, **kw)[2],
        (h,) if alibi == "h" else (b, h), alibi, dropout_p, ctx.device)
    ref_kw = dict(softmax_scale=scale, causal=causal, window=window, softcap=softcap,
                  alibi=slopes, keep=keep, dropout_p=dropout_p)
    ref = references(lambda q, k, v: attention_reference(q, k, v, **ref_kw), (q, k, v), dout,
                     dtype)

    def split(x, lse_dim=False):
        return split_sequence(x, ctx.rank, ctx.world_size, layout, dim=2 if lse_dim else 1)

    local = [split(x).requires_grad_() for x in (q, k, v)]
    torch.manual_seed(seed)  # the whole call's seed (alibi_and_keep)
    out, lse, probs = ring_flash_attn_func(*local, softmax_scale=scale, causal=causal,
                                           window_size=window, softcap=softcap,
                                           return_attn_probs=True, layout=layout,
                                           dropout_p=dropout_p, alibi_slopes=slopes)
    assert probs is None and out.dtype == dtype and lse.shape == (b, h, s // ctx.world_size)
    grads = torch.autograd.grad(out, local, split(dout))
    check_all(out, lse, grads, ref, split)
    # Without a gradient: the forward alone, the same output.
    torch.manual_seed(seed)
    with torch.no_grad():
        again = ring_flash_attn_func(*(x.detach() for x in local), softmax_scale=scale,
                                     causal=causal, window_size=window, softcap=softcap,
                                     layout=layout, dropout_p=dropout_p, alibi_slopes=slopes)
    assert torch.equal(again, out.detach())


def case_varlen(ctx, seed, dtype, lengths, h, hk, d, layout, causal=False, window=(-1, -1),
                softcap=0.0, dropout_p=0.0, alibi=None):
    dtype = getattr(torch, dtype)
    total = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q, k, v, dout = inputs(seed, [(total, h, d), (total, hk, d), (total, hk, d), (total, h, d)],
                           dtype, ctx.device)
    slopes, keep = alibi_and_keep(seed, lambda slopes: flash_attn_varlen_func(
        q, k, v, cu, cu, max(lengths), max(lengths), dropout_p=dropout_p, causal=causal,
        window_size=window, softcap=softcap, alibi_slopes=slopes, return_attn_probs=True)[2],
        (h,) if alibi == "h" else (len(lengths), h), alibi, dropout_p, ctx.device)
    ref_kw = dict(causal=causal, window=window, softcap=softcap, dropout_p=dropout_p)

    def attend(q, k, v):  # each sequence on its own, packed again
        outs, lses = [], []
        for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o, l = attention_reference(
                q[None, a:e], k[None, a:e], v[None, a:e], **ref_kw,
                alibi=None if slopes is None else slopes if slopes.dim() == 1 else slopes[n:n + 1],
                keep=None if keep is None else keep[n:n + 1, :, :e - a, :e - a])
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    ref = references(attend, (q, k, v), dout, dtype)

    def split(x, lse_dim=False):
        return split_sequence(x, ctx.rank, ctx.world_size, layout, dim=1 if lse_dim else 0,
                              cu_seqlens=cu)

    local = [split(x).requires_grad_() for x in (q, k, v)]
    cu_arg = cu.to(ctx.device)
    torch.manual_seed(seed)  # the whole call's seed (alibi_and_keep)
    out, lse, _ = ring_flash_attn_varlen_func(*local, cu_arg, max(lengths), causal=causal,
                                              window_size=window, softcap=softcap,
                                              return_attn_probs=True, layout=layout,
                                              dropout_p=dropout_p, alibi_slopes=slopes)
    assert lse.shape == (h, total // ctx.world_size)
    grads = torch.autograd.grad(out, local, split(dout))
    check_all(out, lse, grads, ref, split)


def raises(name, fn):
    """fn() must raise ValueError whose message starts with `name:`."""
    try:
        fn()
    except ValueError as e:
        assert str(e).startswith(f"{name}:"), f"expected an error naming {name}, got: {e}"
        return str(e)
    raise AssertionError(f"expected a ValueError naming {name}")


def case_errors(ctx, seed):
    r, p = ctx.rank, ctx.world_size
    q, k, v = inputs(seed, [(1, 4 * p, 4, 8), (1, 4 * p, 2, 8), (1, 4 * p, 2, 8)],
                     torch.float32, ctx.device)
    ql, kl, vl = (zigzag_split(x, r, p) for x in (q, k, v))
    msg = raises("dropout_p", lambda: ring_flash_attn_func(ql, kl, vl, dropout_p=1.5))
    assert "[0, 1)" in msg and "1.5" in msg
    raises("alibi_slopes", lambda: ring_flash_attn_func(ql, kl, vl, alibi_slopes=[1.0] * 4))
    raises("window_size", lambda: ring_flash_attn_func(ql, kl, vl, window_size=(-2, 0)))
    raises("layout", lambda: ring_flash_attn_func(ql, kl, vl, layout="striped"))
    raises("k", lambda: ring_flash_attn_func(ql, kl[:, :2], vl[:, :2]))
    raises("v", lambda: ring_flash_attn_func(ql, kl, vl[..., :4]))
    raises("q", lambda: ring_flash_attn_func(ql[0], kl, vl))
    raises("q", lambda: ring_flash_attn_func(ql[:, :3], kl[:, :3], vl[:, :3], layout="zigzag"))
    # Only one rank is wrong: every rank raises, naming the argument (none waits forever).
    bad = 1.5 if r == p - 1 else 0.0
    msg = raises("dropout_p", lambda: ring_flash_attn_func(ql, kl, vl, dropout_p=bad))
    assert r == p - 1 or f"rank {p - 1}" in msg, msg
    # Shapes or options that differ between ranks.
    n = 4 if r == 0 else 2
    msg = raises("q", lambda: ring_flash_attn_func(ql[:, :n], kl[:, :n], vl[:, :n]))
    assert "on rank 0" in msg and "every rank" in msg, msg
    raises("causal", lambda: ring_flash_attn_func(ql, kl, vl, causal=(r == 1)))
    raises("dropout_p", lambda: ring_flash_attn_func(ql, kl, vl, dropout_p=0.1 * (r == 1)))
    raises("alibi_slopes", lambda: ring_flash_attn_func(
        ql, kl, vl, alibi_slopes=torch.ones(4) if r == 1 else None))
    # A rank whose inputs require grad would run a backward ring the others never join.
    raises("requires_grad", lambda: ring_flash_attn_func(ql.requires_grad_(r == 0), kl, vl))
    ql.requires_grad_(False)
    raises("layout", lambda: ring_flash_attn_func(ql, kl, vl, layout=D.LAYOUTS[r % 2]))
    # Varlen: every length a multiple of the chunks; the local rows those of cu_seqlens.
    qv, kv_, vv = (x[0] for x in (ql, kl, vl))
    raises("cu_seqlens", lambda: ring_flash_attn_varlen_func(
        qv, kv_, vv, [0, 2 * p + 1, 4 * p * p], 4 * p * p, layout="zigzag"))
    raises("q", lambda: ring_flash_attn_varlen_func(qv, kv_, vv, [0, 2 * p], 2 * p,
                                                    layout="zigzag"))
    raises("max_seqlen", lambda: ring_flash_attn_varlen_func(qv, kv_, vv, [0, 4 * p], 3))
    # The group is still usable after all of that.
    out = ring_flash_attn_func(ql, kl, vl, causal=True, layout="zigzag")
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
    check("out", out, zigzag_split(ref, r, p))


def case_subgroup(ctx, seed):
    """A ring over a subgroup whose ranks are not 0..n-1 (P2P needs their global ranks); a
    rank outside it is refused, naming group."""
    members = [1, 3]
    sub = dist.new_group(members)  # every rank takes part in creating it
    q, k, v = inputs(seed, [(2, 16, 4, 8), (2, 16, 4, 8), (2, 16, 4, 8)], torch.float32,
                     ctx.device)
    if ctx.rank not in members:
        raises("group", lambda: ring_flash_attn_func(q[:, :8], k[:, :8], v[:, :8], group=sub))
        return
    r = members.index(ctx.rank)
    local = [zigzag_split(x, r, 2) for x in (q, k, v)]
    out = ring_flash_attn_func(*local, causal=True, group=sub, layout="zigzag")
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
    check("out", out, zigzag_split(ref, r, 2))


# ---------------------------------------------------------------------------- CPU tests

DENSE = [  # (world_size, layout, b, s, h, hk, d, features)
    (2, "contiguous", 2, 32, 4, 4, 16, dict()),
    (2, "contiguous", 2, 32, 4, 2, 16, dict(causal=True)),
    (2, "zigzag", 2, 32, 4, 2, 16, dict(causal=True)),
    (4, "zigzag", 1, 64, 4, 2, 16, dict(causal=True)),
    (4, "contiguous", 1, 64, 4, 1, 16, dict(causal=True)),
    (4, "zigzag", 1, 64, 4, 4, 16, dict()),
    # Windows, global: narrower and wider than a chunk, reaching into neighbours both ways.
    (2, "zigzag", 1, 48, 2, 1, 8, dict(window=(5, 3))),
    (2, "contiguous", 1, 48, 2, 2, 8, dict(causal=True, window=(7, -1))),
    (4, "zigzag", 1, 64, 4, 2, 8, dict(causal=True, window=(11, -1))),
    (4, "zigzag", 1, 64, 2, 2, 8, dict(window=(2, 13))),
    (4, "contiguous", 1, 64, 2, 1, 8, dict(window=(-1, 5))),
    (2, "zigzag", 1, 40, 2, 1, 8, dict(window=(0, 0))),
    # Softcap and a scale pass through; an odd head dim.
    (2, "zigzag", 2, 24, 3, 1, 13, dict(causal=True, softcap=2.5, scale=0.3)),
    (4, "contiguous", 1, 32, 2, 2, 37, dict(softcap=4.0)),
    # Dropout and ALiBi: the whole call's keep bits and distances (flashattn's positions).
    (2, "zigzag", 2, 32, 4, 2, 16, dict(causal=True, dropout_p=0.3)),
    (2, "contiguous", 2, 32, 4, 4, 16, dict(dropout_p=0.2, alibi="bh")),
    (4, "zigzag", 1, 64, 4, 2, 16, dict(causal=True, alibi="h")),
    (4, "contiguous", 1, 64, 4, 1, 16, dict(causal=True, dropout_p=0.25, alibi="h")),
    (4, "zigzag", 1, 64, 2, 2, 8, dict(window=(5, 13), dropout_p=0.3, alibi="bh")),
    (2, "zigzag", 1, 40, 2, 1, 8, dict(causal=True, window=(7, -1), dropout_p=0.5,
                                       softcap=2.0, alibi="h")),
]


@needs_gloo
@pytest.mark.parametrize("world,layout,b,s,h,hk,d,features", DENSE,
                         ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items())
                         if isinstance(x, dict) else str(x))
def test_dense_fp32_vs_float64(seed, world, layout, b, s, h, hk, d, features):
    cpu(world).run(case_dense, seed=seed, dtype="float32", b=b, s=s, h=h, hk=hk, d=d,
                   layout=layout, **features)


@needs_gloo
@pytest.mark.parametrize("world,layout,features", [
    (2, "zigzag", dict(causal=True)),
    (4, "contiguous", dict(window=(6, 2), softcap=3.0)),
])
def test_dense_bf16_vs_float64(seed, world, layout, features):
    """bf16 (the CPU engine takes it, computing in fp32): the partial outputs and gradients
    are rounded to bf16 by each call and merged or summed in fp32."""
    cpu(world).run(case_dense, seed=seed, dtype="bfloat16", b=2, s=64, h=4, hk=2, d=32,
                   layout=layout, **features)


VARLEN = [  # (world_size, layout, lengths, features): lengths multiples of the chunks
    (2, "zigzag", [16, 8, 0, 24], dict(causal=True)),
    (2, "contiguous", [6, 10, 2], dict()),
    (4, "zigzag", [16, 32, 8], dict(causal=True)),
    # The window is in tokens, the chunks differ per sequence: per-sequence plans.
    (2, "zigzag", [8, 32, 16], dict(window=(5, 3))),
    (4, "contiguous", [8, 32, 4, 20], dict(causal=True, window=(6, -1), softcap=3.0)),
    # Dropout and ALiBi: per-sequence positional calls, batch index and (B, H) slopes kept.
    (2, "zigzag", [16, 8, 0, 24], dict(causal=True, dropout_p=0.3, alibi="bh")),
    (4, "contiguous", [8, 32, 4, 20], dict(dropout_p=0.2)),
    (4, "zigzag", [8, 32, 16], dict(causal=True, window=(5, -1), alibi="h")),
]


@needs_gloo
@pytest.mark.parametrize("world,layout,lengths,features", VARLEN)
def test_varlen_fp32_vs_float64(seed, world, layout, lengths, features):
    cpu(world).run(case_varlen, seed=seed, dtype="float32", lengths=lengths, h=4, hk=2, d=16,
                   layout=layout, **features)


@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_errors_name_the_argument_on_every_rank(seed, world):
    cpu(world).run(case_errors, seed=seed)


@needs_gloo
def test_subgroup_and_a_rank_outside_it(seed):
    cpu(4).run(case_subgroup, seed=seed)


# ---------------------------------------------------------------------------- GPU (NCCL)

def _cuda_devices():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_skip(world):
    import flashattn
    if _cuda_devices() < world:
        return f"{_cuda_devices()} CUDA device(s) visible: the NCCL ring tests need {world}"
    if not dist.is_nccl_available():
        return "this PyTorch build has no NCCL backend"
    if not flashattn.cuda_compiled():
        return "flashattn was built without the CUDA backend"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout,features", [
    ("zigzag", dict(causal=True)),
    ("contiguous", dict()),
    ("zigzag", dict(causal=True, window=(100, -1), softcap=5.0)),
])
def test_gpu_dense_vs_float64(seed, world, dtype, layout, features):
    reason = _gpu_skip(world)
    if reason:
        pytest.skip(reason)
    group_of(world, "nccl").run(case_dense, seed=seed, dtype=dtype, b=2, s=512 * world, h=8,
                                hk=2, d=64, layout=layout, **features)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_varlen_and_errors(seed, world):
    reason = _gpu_skip(world)
    if reason:
        pytest.skip(reason)
    g = group_of(world, "nccl")
    g.run(case_varlen, seed=seed, dtype="bfloat16", lengths=[64 * world, 256 * world, 0, 8 * world],
          h=8, hk=2, d=128, layout="zigzag", causal=True)
    g.run(case_errors, seed=seed)


# ---------------------------------------------------------------------------- no group needed

def test_without_a_process_group_the_error_names_group():
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    q = torch.randn(1, 8, 2, 8)
    raises("group", lambda: ring_flash_attn_func(q, q, q))


def test_zigzag_split_holds_chunks_r_and_2p_minus_1_minus_r():
    x = torch.arange(16)[None, :]
    assert zigzag_split(x, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert zigzag_split(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert split_sequence(x, 1, 4, "contiguous").tolist() == [[4, 5, 6, 7]]
    for layout in D.LAYOUTS:
        for p in (1, 2, 4):
            parts = [split_sequence(x, r, p, layout) for r in range(p)]
            assert torch.equal(unsplit_sequence(parts, layout), x)
    assert torch.equal(zigzag_unsplit([zigzag_split(x, r, 4) for r in range(4)]), x)
    with pytest.raises(ValueError, match="^x: .*multiple of 6"):
        zigzag_split(torch.arange(16)[None], 0, 3)
    with pytest.raises(ValueError, match="^rank: "):
        zigzag_split(x, 2, 2)


def test_varlen_split_cuts_every_sequence():
    cu = [0, 8, 8, 12]
    x = torch.arange(12)
    assert zigzag_split_varlen(x, cu, 0, 2).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_split_varlen(x, cu, 1, 2).tolist() == [2, 3, 4, 5, 9, 10]
    assert split_sequence(x, 1, 2, "contiguous", dim=0,
                          cu_seqlens=cu).tolist() == [4, 5, 6, 7, 10, 11]
    for layout in D.LAYOUTS:
        parts = [split_sequence(x, r, 2, layout, dim=0, cu_seqlens=cu) for r in range(2)]
        assert torch.equal(unsplit_sequence(parts, layout, dim=0, cu_seqlens=cu), x)
    parts = [zigzag_split_varlen(x, cu, r, 2) for r in range(2)]
    assert torch.equal(zigzag_unsplit_varlen(parts, cu), x)
    with pytest.raises(ValueError, match="^cu_seqlens: .*multiple of 4.*length 6"):
        zigzag_split_varlen(torch.arange(14), [0, 8, 14], 0, 2)


def _call_mask(rect):
    """What flashattn shows for a call over the rectangle: the bottom-right aligned window."""
    lq, lk = rect.q1 - rect.q0, rect.k1 - rect.k0
    x, y = np.arange(lq)[:, None], np.arange(lk)[None, :]
    m = np.ones((lq, lk), dtype=bool)
    if rect.right >= 0:
        m &= y <= x + lk - lq + rect.right
    if rect.left >= 0:
        m &= y >= x + lk - lq - rect.left
    return m


def _positions(layout, rank, p, s):
    return np.concatenate([np.arange(g, g + n) for _, g, n in D._pieces(layout, rank, p, s)])


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (3, 0), (7, -1), (-1, 5), (2, 3), (0, -1),
           (11, 2), (4, 9), (30, -1), (0, 1), (5, 5)]


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_plan_shows_exactly_the_global_mask(layout):
    """Every (rank, visiting slice) pair of a grid of world sizes, lengths and windows: the
    calls' masks, placed at their rectangles, cover every globally visible (query, key) pair
    of the two slices once and nothing else; no window value below -1."""
    for p in (1, 2, 3, 4):
        for s in (2 * p, 6 * p, 10 * p):
            for left, right in WINDOWS:
                for rank in range(p):
                    qpos = _positions(layout, rank, p, s)
                    for source in range(p):
                        diff = _positions(layout, source, p, s)[None, :] - qpos[:, None]
                        want = np.ones(diff.shape, dtype=bool)
                        if left >= 0:
                            want &= diff >= -left
                        if right >= 0:
                            want &= diff <= right
                        shown = np.zeros(diff.shape, dtype=int)
                        for rect in D._plan(D._pieces(layout, rank, p, s),
                                            D._pieces(layout, source, p, s), left, right):
                            assert rect.left >= -1 and rect.right >= -1
                            shown[rect.q0:rect.q1, rect.k0:rect.k1] += _call_mask(rect)
                        assert (shown == want).all(), (layout, p, s, left, right, rank, source)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zigzag_balances_causal_work_with_one_call_per_step(p):
    s = 2 * p * 16
    for layout in D.LAYOUTS:
        work = []
        for rank in range(p):
            plans = [D._plan(D._pieces(layout, rank, p, s), D._pieces(layout, src, p, s), -1, 0)
                     for src in range(p)]
            # At most one call per step; zigzag skips none, contiguous the later slices.
            assert [len(calls) for calls in plans] == (
                [1] * p if layout == "zigzag" else [1] * (rank + 1) + [0] * (p - rank - 1))
            work.append(sum(_call_mask(c).sum() for calls in plans for c in calls))
        if layout == "zigzag":
            assert len(set(work)) == 1, work
        else:  # rank r of a contiguous split does r + 1/2 chunks' worth: unbalanced
            assert work[-1] > 2 * work[0], work


def test_the_benchmark_smoke_run(tmp_path):
    """bench/context_parallel.py --device cpu: two Gloo ranks, tiny sizes, its check passes
    and it writes its JSON and table."""
    if not GLOO:
        pytest.skip("this PyTorch build has no Gloo backend")
    import json
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "context_parallel.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--world-size", "2",
                           "--seqlens", "64,128", "--iters", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("|"), "the table comes last"
    document = json.loads((tmp_path / "context_parallel.json").read_text())
    assert all(c["ok"] for c in document["checks"].values()), document["checks"]
    assert {(r["mode"], r["seqlen"]) for r in document["rows"]} == {
        (m, s) for m in ("causal-zigzag", "full-contiguous") for s in (64, 128)}
    for row in document["rows"]:
        assert row["ring"]["ms"] > 0 and row["single"]["ms"] > 0 and row["efficiency"] > 0
