"""flash_attn_with_kvcache: in-place append, rotary, paged caches, split keys (docs/SPEC.md,
"Decoding with a KV cache").

Every call is checked against a literal float64 implementation of the contract that shares no
code with the library: rotate the new keys and the queries, write the new rows into a float64
copy of the caches through the cache's addressing (dense row, cache_batch_idx, block_table),
gather each sequence's keys from cache_leftpad[b] to its end, and attend with the scores
materialised and the bottom-right aligned mask (conftest.reference). The caches are checked
after every call: the appended rows hold the rotated new keys (to the cache dtype's rounding),
every other element is bit for bit what it was.

CPU (CI): NumPy arrays and, when torch is installed, torch CPU tensors. CUDA: the tests at the
end (marked `gpu`, skipped with the reason shown without a CUDA device or a CUDA build): fp16
and bf16 under docs/SPEC.md's accuracy rule, long caches that the split heuristic divides, paged
caches of page sizes 1, 16, odd and 256, a decoding loop, SDPA as a second oracle, the current
stream, CUDA-graph capture and torch.compile.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import flashattn
from flashattn import _C, flash_attn_with_kvcache
from conftest import assert_accurate, reference

try:
    import torch
except ImportError:  # the NumPy half runs without torch
    torch = None

FRAMEWORKS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    torch is None, reason="PyTorch is not installed: the torch CPU variant is skipped"))]


# ---------------------------------------------------------------------------- the reference

def rotate(x, cos, sin, positions, interleaved):
    """x (S, heads, D) float64 rotated at positions (S,) by the tables (S_rotary, rotary_dim/2):
    pairs (2i, 2i+1) when interleaved, else (i, i + rotary_dim/2); features past rotary_dim
    are left alone."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x = x.copy()
    if interleaved:
        first, second = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = first * c - second * s
        x[..., 1:2 * half:2] = first * s + second * c
    else:
        first, second = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = first * c - second * s
        x[..., half:2 * half] = first * s + second * c
    return x


@dataclass
class Expected:
    out: np.ndarray        # (B, Sq, H, D) float64
    lse: np.ndarray        # (B, H, Sq) float64
    k_cache: np.ndarray    # the caches after the call, float64
    v_cache: np.ndarray
    written: np.ndarray    # bool, the cache rows (first two dims) the append wrote
    inputs: list           # per sequence: (q rotated, keys, values) float64, for other oracles


def kvcache_reference(c: dict, store=None) -> Expected:
    """The contract, on the float64 values of the call's arrays `c` (flash_attn_with_kvcache's
    keyword names). `store` rounds a rotated new key to the cache's dtype before it enters the
    cache, as the library must (default: the dtype of c["k_cache"] when NumPy has it)."""
    if store is None:
        dtype = np.asarray(c["k_cache"]).dtype
        dtype = dtype if dtype in (np.float16, np.float32) else np.float64
        store = lambda x: np.asarray(x, dtype=dtype)  # noqa: E731
    f = {name: (None if a is None else np.asarray(a, dtype=np.float64))
         for name, a in c.items() if name in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos",
                                              "rotary_sin", "alibi_slopes")}
    q, k_cache, v_cache = f["q"], f["k_cache"].copy(), f["v_cache"].copy()
    b_, sq, h, d = q.shape
    seqlens = np.broadcast_to(np.asarray(c["cache_seqlens"]), (b_,)).astype(np.int64)
    snew = 0 if c.get("k") is None else c["k"].shape[1]
    leftpad = c.get("cache_leftpad")
    batch_idx = c.get("cache_batch_idx")
    table = c.get("block_table")
    page = k_cache.shape[1]
    causal = c.get("causal", False)
    left, right = c.get("window_size", (-1, -1))
    per_row = causal or left >= 0 or right >= 0
    rotary = f.get("rotary_cos") is not None
    interleaved = c.get("rotary_interleaved", True)

    def slot(b, pos):
        if table is not None:
            return int(table[b, pos // page]), int(pos % page)
        return (int(batch_idx[b]) if batch_idx is not None else b), int(pos)

    written = np.zeros(k_cache.shape[:2], dtype=bool)
    for b in range(b_):
        if snew == 0:
            break
        positions = seqlens[b] + np.arange(snew)
        knew, vnew = f["k"][b], f["v"][b]
        if rotary:
            knew = rotate(knew, f["rotary_cos"], f["rotary_sin"], positions, interleaved)
        for t, pos in enumerate(positions):
            row = slot(b, pos)
            k_cache[row] = store(knew[t])
            v_cache[row] = vnew[t]
            written[row] = True

    outs, lses, inputs = [], [], []
    for b in range(b_):
        begin = int(leftpad[b]) if leftpad is not None else 0
        end = int(seqlens[b]) + snew
        rows = [slot(b, p) for p in range(begin, end)]
        keys = np.stack([k_cache[r] for r in rows]) if rows else np.zeros((0,) + k_cache.shape[2:])
        values = np.stack([v_cache[r] for r in rows]) if rows else np.zeros((0,) + v_cache.shape[2:])
        qb = q[b]
        if rotary:
            positions = seqlens[b] + (np.arange(sq) if per_row else np.zeros(sq, dtype=np.int64))
            qb = rotate(qb, f["rotary_cos"], f["rotary_sin"], positions, interleaved)
        inputs.append((qb, keys, values))
        alibi = f.get("alibi_slopes")
        if alibi is not None and alibi.ndim == 2:
            alibi = alibi[b]
        with np.errstate(divide="ignore", invalid="ignore"):
            o, l = reference(qb[None], keys[None], values[None], c.get("softmax_scale"), causal,
                             (left, right), c.get("softcap", 0.0), alibi)
        outs.append(o[0])
        lses.append(l[0])
    return Expected(np.stack(outs), np.stack(lses), k_cache, v_cache, written, inputs)


# ---------------------------------------------------------------------------- inputs

def make_case(rng, *, b=3, sq=1, snew=None, h=6, hk=2, d=32, cache_len=40, page_size=None,
              batch_idx=False, leftpad=False, rotary=None, rotary_dim=None, causal=False,
              window_size=(-1, -1), softcap=0.0, alibi=None, num_splits=0, append=True,
              softmax_scale=None, dtype=np.float32, seqlens=None):
    """flash_attn_with_kvcache's keyword arguments as NumPy arrays (fp32 values, stored in
    `dtype`). cache_len: the positions a sequence can hold (dense: the cache's second
    dimension; paged: pages x page_size, rounded up)."""
    snew = (sq if snew is None else snew) if append else 0

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    if seqlens is None:
        seqlens = rng.integers(0, cache_len - snew + 1, size=b)
        seqlens[0] = cache_len - snew  # one sequence ends exactly at the cache's end
    seqlens = np.asarray(seqlens, dtype=np.int32)
    c = dict(q=randn(b, sq, h, d), cache_seqlens=seqlens, causal=causal,
             window_size=window_size, softcap=softcap, num_splits=num_splits,
             softmax_scale=softmax_scale)
    if page_size is None:
        rows = b + 2 if batch_idx else b
        c["k_cache"], c["v_cache"] = randn(rows, cache_len, hk, d), randn(rows, cache_len, hk, d)
        if batch_idx:
            c["cache_batch_idx"] = rng.permutation(rows)[:b].astype(np.int32)
    else:
        pages = -(-cache_len // page_size)
        num_blocks = b * pages + 3  # spare pages the table never names: must stay untouched
        c["k_cache"] = randn(num_blocks, page_size, hk, d)
        c["v_cache"] = randn(num_blocks, page_size, hk, d)
        c["block_table"] = rng.permutation(num_blocks)[:b * pages].reshape(b, pages).astype(
            np.int32)
    if leftpad:
        c["cache_leftpad"] = np.array([rng.integers(0, s + 1) for s in seqlens], dtype=np.int32)
    if append:
        c["k"], c["v"] = randn(b, snew, hk, d), randn(b, snew, hk, d)
    if rotary is not None:
        rd = rotary_dim or d
        # Real frequency tables (RoFormer's), over every position a sequence can reach.
        inv_freq = 1.0 / 10000 ** (np.arange(0, rd, 2) / rd)
        angles = np.arange(cache_len + sq)[:, None] * inv_freq[None, :]
        c["rotary_cos"] = np.cos(angles).astype(np.float32).astype(dtype)
        c["rotary_sin"] = np.sin(angles).astype(np.float32).astype(dtype)
        c["rotary_interleaved"] = rotary == "interleaved"
    if alibi == "h":
        c["alibi_slopes"] = rng.uniform(0.02, 0.5, size=h).astype(np.float32)
    elif alibi == "bh":
        c["alibi_slopes"] = rng.uniform(0.02, 0.5, size=(b, h)).astype(np.float32)
    return c


def as_framework(c: dict, framework: str, dtype=None) -> dict:
    """The call's arguments for `framework`: NumPy arrays as they are, or torch CPU tensors
    (copies in `dtype` when given, else sharing the NumPy memory)."""
    if framework == "numpy":
        return dict(c)
    out = dict(c)
    for name, a in c.items():
        if isinstance(a, np.ndarray):
            out[name] = torch.from_numpy(a)
            if dtype is not None and a.dtype == np.float32 and name != "alibi_slopes":
                out[name] = out[name].to(dtype)
    return out


def torch_store(dtype):
    """Rounds float64 values to a torch dtype (bf16 included) and back."""
    return lambda x: torch.from_numpy(np.asarray(x, np.float64)).to(dtype).double().numpy()


def as_float64(args: dict) -> dict:
    """The call's arguments as float64 NumPy arrays (integers as they are)."""
    out = dict(args)
    for name, t in args.items():
        if isinstance(t, torch.Tensor):
            out[name] = t.cpu().numpy() if not t.is_floating_point() else to64(t)
    return out


def poison_written(args: dict, expected: Expected):
    """NaN into the cache rows the call must write: an append that misses one shows up."""
    for name in ("k_cache", "v_cache"):
        args[name][expected.written] = float("nan")


def to64(x) -> np.ndarray:
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def call(args: dict, **extra):
    return flash_attn_with_kvcache(**{**args, **extra})


def check_caches(args: dict, expected: Expected, ulp: float = 2.0 ** -20):
    """Appended rows within `ulp` (relative) of the rotated new keys / the new values; every
    other row bit for bit unchanged."""
    for name, want in (("k_cache", expected.k_cache), ("v_cache", expected.v_cache)):
        got = to64(args[name])
        w = expected.written
        err = np.abs(got[w] - want[w]).max(initial=0.0)
        bound = ulp * max(np.abs(want[w]).max(initial=0.0), 1.0)
        assert err <= bound, f"{name}: appended rows off by {err:.3g} > {bound:.3g}"
        assert np.array_equal(got[~w], want[~w]), f"{name}: rows outside the append changed"


def run_and_check(c: dict, framework: str, check_lse=True):
    """One fp32 call in `framework` against the reference; returns (out, lse) as float64."""
    expected = kvcache_reference(c)
    args = as_framework(c, framework)
    poison_written(args, expected)
    out, lse = call(args, return_softmax_lse=True)
    if framework == "numpy":
        assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    else:
        assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    b, sq, h, d = c["q"].shape
    assert tuple(out.shape) == (b, sq, h, c["v_cache"].shape[-1])
    assert tuple(lse.shape) == (b, h, sq) and str(lse.dtype).endswith("float32")
    assert_accurate(to64(out), expected.out)
    if check_lse:
        lse64 = to64(lse)
        finite = np.isfinite(expected.lse)
        assert np.array_equal(np.isfinite(lse64), finite), "lse: -inf exactly for empty rows"
        assert_accurate(lse64[finite], expected.lse[finite])
    check_caches(args, expected)
    return to64(out), to64(lse)


# ---------------------------------------------------------------------------- CPU: features

FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(7, 2)),
    "causal-window": dict(causal=True, window_size=(9, -1)),
    "softcap": dict(softcap=4.0, softmax_scale=0.4),
    "alibi-h": dict(alibi="h", causal=True),
    "alibi-bh": dict(alibi="bh"),
    "rotary-interleaved-causal": dict(rotary="interleaved", causal=True),
    "rotary-neox": dict(rotary="neox"),
    "rotary-partial-interleaved": dict(rotary="interleaved", rotary_dim=16, window_size=(-1, 3)),
    "rotary-partial-neox-causal": dict(rotary="neox", rotary_dim=8, causal=True),
    "batch-idx-leftpad": dict(batch_idx=True, leftpad=True, causal=True),
    "no-append": dict(append=False, causal=True),
    "mqa": dict(h=4, hk=1),
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("feature", FEATURES, ids=str)
@pytest.mark.parametrize("sq,snew", [(1, 1), (5, 5), (4, 2)], ids=["decode", "chunk", "sq>snew"])
def test_dense_cache_vs_reference(rng, framework, feature, sq, snew):
    kw = dict(FEATURES[feature])
    if not kw.get("append", True):
        snew = None
    run_and_check(make_case(rng, sq=sq, snew=snew, **kw), framework)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("page_size", [1, 16, 7], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("feature", ["causal", "rotary-neox", "batch-idx-leftpad", "alibi-bh",
                                     "no-append"], ids=str)
def test_paged_cache_vs_reference(rng, framework, page_size, feature):
    kw = dict(FEATURES[feature])
    kw.pop("batch_idx", None)  # cache_batch_idx names dense cache rows only
    run_and_check(make_case(rng, sq=3, page_size=page_size, cache_len=45, **kw), framework)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("d", [1, 5, 59, 111, 250])
@pytest.mark.parametrize("layout", [dict(leftpad=True), dict(batch_idx=True), dict(page_size=7)],
                         ids=["dense-leftpad", "batch-idx", "page7"])
def test_head_dims_not_multiples_of_8(rng, framework, d, layout):
    """Any head dim in [1, 256]: appended, rotated (an even rotary_dim below d), causal."""
    rotary = dict(rotary="neox", rotary_dim=d // 2 * 2) if d >= 2 else {}
    run_and_check(make_case(rng, sq=3, d=d, causal=True, cache_len=45, **rotary, **layout),
                  framework)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_num_splits_give_the_same_result(rng, framework, num_splits, paged):
    """Splitting the keys changes the summation order only."""
    c = make_case(rng, b=2, sq=2, cache_len=300, page_size=16 if paged else None, causal=True,
                  rotary="interleaved", num_splits=num_splits)
    run_and_check(c, framework)


@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 5])
def test_num_splits_reported_by_the_library(rng, num_splits):
    c = make_case(rng, b=1, sq=1, cache_len=1000, causal=True)
    b, sq, h, d = c["q"].shape
    out = np.empty_like(c["q"])
    lse = np.empty((b, h, sq), np.float32)
    backend, ran = _C.forward_kvcache(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                      out, lse, k=c["k"], v=c["v"], causal=True,
                                      num_splits=num_splits)
    assert backend == _C.BACKEND_CPU
    assert ran >= 1 and (num_splits == 0 or ran <= num_splits), (num_splits, ran)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_decoding_loop_appends_step_by_step(rng, framework):
    """A prompt written by one call (chunked prefill), then tokens one at a time with
    cache_seqlens advanced by the caller: equal to one attention over the whole sequence."""
    b, h, hk, d, total, prompt = 2, 4, 2, 32, 23, 9
    q = rng.standard_normal((b, total, h, d)).astype(np.float32)
    k = rng.standard_normal((b, total, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, total, hk, d)).astype(np.float32)
    caches = [np.full((b, 32, hk, d), np.nan, np.float32) for _ in range(2)]
    c = as_framework(dict(q=q, k=k, v=v, k_cache=caches[0], v_cache=caches[1]), framework)
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, total)]
    outs = []
    for start, stop in steps:
        outs.append(to64(flash_attn_with_kvcache(
            c["q"][:, start:stop], c["k_cache"], c["v_cache"], c["k"][:, start:stop],
            c["v"][:, start:stop], cache_seqlens=start, causal=True)))
    want, _ = reference(q, k, v, causal=True)
    assert_accurate(np.concatenate(outs, axis=1), want)
    assert np.array_equal(to64(c["k_cache"])[:, :total], k.astype(np.float64))
    assert np.isnan(to64(c["v_cache"])[:, total:]).all()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_int_cache_seqlens_and_defaults(rng, framework):
    c = make_case(rng, b=3, sq=2, cache_len=20, causal=True, seqlens=[11, 11, 11])
    as_int = dict(c, cache_seqlens=11)
    run_and_check(as_int, framework)
    # Without k/v and cache_seqlens, every sequence is its whole cache.
    c = make_case(rng, b=2, sq=3, cache_len=17, append=False, seqlens=[17, 17])
    expected = kvcache_reference(c)
    args = as_framework(dict(c, cache_seqlens=None), framework)
    assert_accurate(to64(call(args)), expected.out)
    # The return: out alone by default.
    out = call(as_framework(dict(c), framework))
    assert not isinstance(out, tuple) and tuple(out.shape) == c["q"].shape


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_empty_sequences(rng, framework):
    """A sequence with no key (cache_seqlens 0, nothing appended; or all of it left padding)
    gives out 0 and lse -inf."""
    c = make_case(rng, b=3, sq=2, cache_len=10, append=False, seqlens=[0, 6, 4], leftpad=True)
    c["cache_leftpad"] = np.array([0, 2, 4], np.int32)
    out, lse = run_and_check(c, framework)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()


def test_fp16_accuracy_rule(rng):
    """fp16 on the CPU against docs/SPEC.md's rule: at most 2x the error of attention computed in
    fp16 (the new keys rotated and rounded into the fp16 cache, as the library stores them)."""
    c = make_case(rng, b=2, sq=3, cache_len=70, causal=True, rotary="neox", page_size=16,
                  dtype=np.float16)
    expected = kvcache_reference(c)
    poison_written(c, expected)
    out = call(dict(c))
    assert out.dtype == np.float16
    lows = []
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for qb, keys, values in expected.inputs:
            low, _ = reference(qb[None].astype(np.float16), keys[None], values[None], causal=True,
                               dtype=np.float16)
            lows.append(low[0])
    assert_accurate(out, expected.out, low=np.stack(lows), factor=2.0, floor=1e-3)
    check_caches(c, expected, ulp=2.0 ** -10)


def test_bf16_numpy_via_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 NumPy arrays need ml_dtypes")
    c = make_case(rng, b=2, sq=2, cache_len=33, causal=True, dtype=ml_dtypes.bfloat16)
    expected = kvcache_reference(c)  # no rotary: the appended rows are copies
    poison_written(c, expected)
    out = call(dict(c))
    assert out.dtype == ml_dtypes.bfloat16
    # Exact bf16 inputs, fp32 arithmetic, one rounding of the result to bf16.
    assert_accurate(to64(out), expected.out, rel=2.0 ** -8, floor=1e-5)
    check_caches(c, expected, ulp=0.0)


# ---------------------------------------------------------------------------- CPU: torch

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_low_precision_accuracy_rule(rng, dtype):
    from torch_reference import attention_reference

    dt = getattr(torch, dtype)
    c = make_case(rng, b=2, sq=2, cache_len=50, causal=True, page_size=5, rotary="interleaved")
    args = as_framework(c, "torch", dtype=dt)
    expected = kvcache_reference(as_float64(args), store=torch_store(dt))
    poison_written(args, expected)
    out = call(args)
    assert out.dtype == dt
    lows = []
    for qb, keys, values in expected.inputs:
        low, _ = attention_reference(*(torch.from_numpy(x[None]).to(dt)
                                       for x in (qb, keys, values)), causal=True)
        lows.append(low[0].double().numpy())
    assert_accurate(to64(out), expected.out, low=np.stack(lows), factor=2.0,
                    floor=1e-3 if dtype == "float16" else 5e-3)
    check_caches(args, expected, ulp=2.0 ** -10 if dtype == "float16" else 2.0 ** -7)


def fp8_cache_case(rng, dtype, **kw):
    """An fp8 e4m3 dense cache (values N(0, 64^2), some saturating) with k/v descales
    (B, Hk) drawn per sequence and head, and a bf16/fp16 q, k, v (make_case's other
    arguments)."""
    c = make_case(rng, **kw)
    a = as_framework(c, "torch", dtype=dtype)
    for name in ("k_cache", "v_cache"):
        a[name] = (a[name].float() * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    b, hk = c["q"].shape[0], c["k_cache"].shape[2]
    a["k_descale"] = torch.from_numpy(rng.uniform(1 / 128, 1 / 16, (b, hk)).astype(np.float32))
    a["v_descale"] = torch.from_numpy(rng.uniform(1 / 128, 1 / 16, (b, hk)).astype(np.float32))
    return a


def check_fp8_cache_call(a: dict):
    """One call with fp8 caches (fp8_cache_case's arguments, on any device): the append stores
    e4m3(x / descale) bitwise (torch's own fp32 division and saturating conversion), and out
    is the float64 attention over the caches as stored times their (sequence, head) factors,
    within one rounding of out to q's dtype and fp32 arithmetic."""
    before = {n: a[n].clone() for n in ("k_cache", "v_cache")}
    out, lse = call(a, return_softmax_lse=True)
    assert out.dtype == a["q"].dtype and lse.dtype == torch.float32 and out.device == a["q"].device
    seqlens = torch.as_tensor(a["cache_seqlens"]).long().cpu()
    table = a.get("block_table")
    table = None if table is None else torch.as_tensor(table).long().cpu()
    page = a["k_cache"].shape[1]
    b_, snew = a["k"].shape[:2]

    def slot(b, pos):  # (row, position within it) of sequence b's cache position pos
        return (int(table[b, pos // page]), pos % page) if table is not None else (b, pos)

    for name, new, factor in (("k_cache", a["k"], a["k_descale"]), ("v_cache", a["v"], a["v_descale"])):
        want = before[name].clone()
        for b in range(b_):
            for t in range(snew):
                want[slot(b, int(seqlens[b]) + t)] = (new[b, t].float() / factor[b][:, None]).clamp(
                    -448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(a[name].view(torch.uint8), want.view(torch.uint8)), f"{name} after the append"
    # Each sequence's keys and values as stored times its factors, as a dense float64 cache.
    length = int(seqlens.max()) + snew
    deq = {}
    for n, f in (("k_cache", "k_descale"), ("v_cache", "v_descale")):
        cache, factor = a[n].double().cpu(), a[f].double().cpu()
        dense = torch.zeros((b_, length) + tuple(cache.shape[2:]), dtype=torch.float64)
        for b in range(b_):
            for pos in range(int(seqlens[b]) + snew):
                dense[b, pos] = cache[slot(b, pos)] * factor[b][:, None]
        deq[n] = dense.numpy()
    ref = dict(q=a["q"].double().cpu().numpy(), cache_seqlens=(seqlens + snew).numpy(), **deq,
               **{k: v for k, v in a.items() if k in ("causal", "window_size", "softcap",
                                                      "softmax_scale")})
    if a.get("alibi_slopes") is not None:
        ref["alibi_slopes"] = np.asarray(torch.as_tensor(a["alibi_slopes"]).cpu())
    expected = kvcache_reference(ref)
    largest = np.abs(expected.out).max()
    err = np.abs(to64(out) - expected.out).max()
    assert err <= (2.0 ** -8 + 1e-5) * largest, f"out off by {err:.3g} (largest {largest:.3g})"
    lse64, finite = to64(lse), np.isfinite(expected.lse)
    assert np.array_equal(np.isfinite(lse64), finite), "lse: -inf exactly for rows without keys"
    assert np.abs(lse64[finite] - expected.lse[finite]).max(initial=0.0) <= \
        1e-4 * max(1.0, np.abs(expected.lse[finite]).max(initial=0.0))


FP8_CACHE_FEATURES = ["plain", "causal", "alibi-h", "mqa"]


@needs_torch
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if torch else [], ids=str)
@pytest.mark.parametrize("feature", FP8_CACHE_FEATURES)
def test_fp8_cache_vs_reference(rng, dtype, feature):
    """fp8 e4m3 caches under a 16-bit q on the CPU (docs/SPEC.md, "Decoding with a KV
    cache"): check_fp8_cache_call."""
    check_fp8_cache_call(fp8_cache_case(rng, dtype, sq=3, snew=2, **FEATURES[feature]))


@needs_torch
def test_fp8_cache_refusals(rng):
    """Descales without fp8 caches, fp8 caches of mismatched dtypes, per-block factors and a
    NumPy q with descales are errors naming the argument, with the caches untouched."""
    a = fp8_cache_case(rng, torch.bfloat16, sq=1, snew=1)
    before = a["k_cache"].clone()
    with pytest.raises(ValueError, match="v_descale: expected shape .*\\(B, Hk\\).*no per-block"):
        call({**a, "v_descale": a["v_descale"][:, :, None]})
    with pytest.raises(TypeError, match="v_cache: expected dtype fp8_e4m3, given dtype bf16"):
        call({**a, "v_cache": a["v_cache"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="k_descale: expected none: descales go with fp8_e4m3 caches"):
        call({**a, "k_cache": a["k_cache"].to(torch.bfloat16), "v_cache": a["v_cache"].to(torch.bfloat16)})
    with pytest.raises(TypeError, match="k_descale: expected torch tensors"):
        call({**{n: (t.float().numpy() if isinstance(t, torch.Tensor) and n in ("q", "k", "v") else t)
                 for n, t in a.items()}})
    assert torch.equal(a["k_cache"].view(torch.uint8), before.view(torch.uint8))


@needs_torch
def test_torch_no_grad_inference_mode_and_autograd(rng):
    c = make_case(rng, b=2, sq=1, cache_len=12, causal=True, seqlens=[3, 5])
    expected = kvcache_reference(c)
    for context in (torch.no_grad, torch.inference_mode):
        args = as_framework({n: a.copy() if isinstance(a, np.ndarray) else a
                             for n, a in c.items()}, "torch")
        with context():
            if context is torch.inference_mode:
                args = {n: t.clone() if isinstance(t, torch.Tensor) else t
                        for n, t in args.items()}  # inference tensors, caches included
            out = call(args)
        assert_accurate(to64(out), expected.out)
        check_caches(args, expected)
    # Under grad mode with q requiring grad: the forward runs, the caches are updated, and
    # the output carries no gradient formula that could silently be wrong.
    args = as_framework({n: a.copy() if isinstance(a, np.ndarray) else a
                         for n, a in c.items()}, "torch")
    args["q"] = args["q"].clone().requires_grad_()
    out = call(args)
    assert_accurate(to64(out), expected.out)
    check_caches(args, expected)
    if out.requires_grad:
        with pytest.raises(RuntimeError):
            out.sum().backward()


@needs_torch
def test_torch_strided_views_and_int64_refused(rng):
    """q and the new k/v may be strided views (only the last dimension must be unit-stride);
    the caches are written in place, so a view of a larger buffer is updated through it."""
    c = make_case(rng, b=2, sq=2, cache_len=16, causal=True, seqlens=[4, 9])
    expected = kvcache_reference(c)
    args = as_framework(c, "torch")
    big = torch.zeros(2, 16, 3, 2, 32)  # the caches as slices of one packed buffer
    big[:, :, 0], big[:, :, 2] = args["k_cache"], args["v_cache"]
    args["k_cache"], args["v_cache"] = big[:, :, 0], big[:, :, 2]
    qkv = torch.stack([args["q"], args["q"]], dim=2)
    args["q"] = qkv[:, :, 1]
    out = call(args)
    assert_accurate(to64(out), expected.out)
    check_caches(args, expected)
    assert (big[:, :, 1] == 0).all()
    with pytest.raises(TypeError, match="^cache_seqlens: expected dtype"):
        call(dict(args, cache_seqlens=torch.tensor([4, 9])))


@needs_torch
def test_opcheck():
    """Schema (the caches declared mutated), fake implementation and AOT dispatch."""
    rng = np.random.default_rng(0)
    c = make_case(rng, b=2, sq=2, cache_len=16, causal=True, page_size=4, rotary="neox",
                  seqlens=[3, 8])
    a = as_framework(c, "torch")
    torch.library.opcheck(torch.ops.flashattn.fwd_kvcache.default, (
        a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["k"], a["v"], a["rotary_cos"],
        a["rotary_sin"], False, None, None, a["block_table"], None, True, -1, -1, 0.0, None, 0,
        None, None))


@needs_torch
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_updates_the_caches(rng, backend):
    """torch.compile(fullgraph=True): one node, the append reaches the caller's caches (module
    buffers here, the usual home of a KV cache), the output equals eager mode's."""
    torch._dynamo.reset()
    b, h, hk, d, length = 2, 4, 2, 32, 24

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k_cache", torch.zeros(b, length, hk, d))
            self.register_buffer("v_cache", torch.zeros(b, length, hk, d))

        def forward(self, q, k, v, seqlens):
            return flash_attn_with_kvcache(q, self.k_cache, self.v_cache, k, v,
                                           cache_seqlens=seqlens, causal=True)

    eager, compiled_module = Decoder(), Decoder()
    compiled = torch.compile(compiled_module, fullgraph=True, backend=backend)
    with torch.inference_mode():
        for step in range(3):
            seqlens = torch.tensor([step, 2 * step], dtype=torch.int32)
            q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32))
                       for s in ((b, 1, h, d), (b, 1, hk, d), (b, 1, hk, d)))
            want = eager(q, k, v, seqlens)
            got = compiled(q, k, v, seqlens)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(compiled_module.k_cache, eager.k_cache, rtol=0, atol=0)
            torch.testing.assert_close(compiled_module.v_cache, eager.v_cache, rtol=0, atol=0)
    assert (eager.k_cache[1, 4]).abs().sum() > 0


def test_upstream_module_path():
    from flashattn.flash_attn_interface import flash_attn_with_kvcache as upstream_path

    assert upstream_path is flash_attn_with_kvcache is flashattn.flash_attn_with_kvcache
    import inspect

    params = inspect.signature(flash_attn_with_kvcache).parameters
    # Upstream's arguments, positional as there; the fp8 caches' descales keyword only.
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["k_descale", "v_descale"]
    assert [n for n in params if n not in keyword_only] == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
        "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
        "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
        "return_softmax_lse"]
    assert params["rotary_interleaved"].default is True
    assert params["window_size"].default == (-1, -1)
    assert params["num_splits"].default == 0


# ---------------------------------------------------------------------------- CPU: errors

# name: (the call's changes, given the valid call c; the exception; its message's pattern)
ERRORS = {
    "v-missing": (lambda c: dict(v=None), ValueError, r"^v"),
    "k-heads": (lambda c: dict(k=c["k"][:, :, :1], v=c["v"][:, :, :1]), ValueError, r"^k"),
    "cache-shapes": (lambda c: dict(k_cache=c["k_cache"][:, :, :1]), ValueError, r"^v_cache"),
    "cache-heads": (lambda c: dict(k_cache=c["k_cache"][:, :, :1], v_cache=c["v_cache"][:, :, :1]),
                    ValueError, r"^(k_new|k_cache|q)\b"),
    "q-dims": (lambda c: dict(q=c["q"][0]), ValueError, r"^q: expected 4 dimensions"),
    "gqa-ratio": (lambda c: dict(q=np.ones(c["q"].shape[:2] + (5, c["q"].shape[3]),
                                           np.float32)), ValueError, r"^(q|k_cache)"),
    "seqlens-int64": (lambda c: dict(cache_seqlens=c["cache_seqlens"].astype(np.int64)),
                      TypeError, r"^cache_seqlens"),
    "seqlens-shape": (lambda c: dict(cache_seqlens=c["cache_seqlens"][:1]), ValueError,
                      r"^cache_seqlens"),
    "seqlens-float": (lambda c: dict(cache_seqlens=2.0), TypeError, r"^cache_seqlens"),
    "seqlens-none": (lambda c: dict(cache_seqlens=None), ValueError, r"^cache_seqlens"),
    "past-the-cache": (lambda c: dict(cache_seqlens=np.full(len(c["q"]), c["k_cache"].shape[1],
                                                            np.int32)),
                       ValueError, r"^cache_seqlens"),
    "negative-seqlens": (lambda c: dict(cache_seqlens=np.full(len(c["q"]), -1, np.int32)),
                         ValueError, r"^cache_seqlens"),
    "batch-idx-range": (lambda c: dict(cache_batch_idx=np.full(len(c["q"]), 99, np.int32)),
                        ValueError, r"^cache_batch_idx"),
    "leftpad-past-the-end": (lambda c: dict(cache_leftpad=c["cache_seqlens"] + 7), ValueError,
                             r"^cache_leftpad"),
    "rotary-one-table": (lambda c: dict(rotary_cos=np.ones((64, 4), np.float32)), ValueError,
                         r"^rotary_"),
    "rotary-too-wide": (lambda c: dict(rotary_cos=np.ones((64, 32), np.float32),
                                       rotary_sin=np.ones((64, 32), np.float32)), ValueError,
                        r"^rotary_"),
    "rotary-too-short": (lambda c: dict(rotary_cos=np.ones((2, 4), np.float32),
                                        rotary_sin=np.ones((2, 4), np.float32)), ValueError,
                         r"^rotary_"),
    "cache-dtype": (lambda c: dict(v_cache=c["v_cache"].astype(np.float16)), TypeError,
                    r"^v_cache"),
    "float64": (lambda c: dict(q=c["q"].astype(np.float64)), TypeError, r"float64"),
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case", ERRORS, ids=str)
def test_bad_input_raises_and_writes_nothing(rng, framework, case):
    c = make_case(rng, b=2, sq=2, h=4, hk=2, d=32, cache_len=16, seqlens=[3, 6],
                  batch_idx=True)
    changes, error, pattern = ERRORS[case]
    args = as_framework(dict(c, **changes(c)), framework)
    before = [to64(args["k_cache"]).copy(), to64(args["v_cache"]).copy()]
    with pytest.raises(error, match=pattern):
        call(args)
    assert np.array_equal(to64(args["k_cache"]), before[0]), "k_cache written"
    assert np.array_equal(to64(args["v_cache"]), before[1]), "v_cache written"


def test_paged_errors(rng):
    c = make_case(rng, b=2, sq=1, cache_len=16, page_size=4, seqlens=[3, 6])
    before = c["k_cache"].copy()
    table = c["block_table"]
    for changes, pattern in (
            (dict(block_table=np.full_like(table, c["k_cache"].shape[0])), r"^block_table"),
            (dict(block_table=table.astype(np.int64)), r"^block_table"),
            (dict(block_table=table[:, :1]), r"^(block_table|cache_seqlens)"),
            (dict(cache_batch_idx=np.array([0, 1], np.int32)), r"^cache_batch_idx")):
        with pytest.raises((ValueError, TypeError), match=pattern):
            call(dict(c, **changes))
        assert np.array_equal(c["k_cache"], before)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_paged_cache_too_small_raises_runtime_error(rng, framework):
    """Upstream FlashAttention's refusal, as its tests expect it: a block table of max_pages x
    page_size positions that cannot take cache_seqlens + S_new is a RuntimeError naming
    block_table (flashattn.BlockTableError: a ValueError too, like every argument error), and
    nothing is written."""
    c = make_case(rng, b=2, sq=1, cache_len=16, page_size=4, seqlens=[3, 6])
    c["cache_seqlens"] = np.array([3, 16], np.int32)  # 16 + 1 appended > 4 pages of 4
    args = as_framework(c, framework)
    before = [to64(args["k_cache"]).copy(), to64(args["v_cache"]).copy()]
    with pytest.raises(RuntimeError, match="^block_table: .*cache_seqlens\\[1\\] = 16") as error:
        call(args)
    assert isinstance(error.value, ValueError) and isinstance(error.value, flashattn.BlockTableError)
    assert np.array_equal(to64(args["k_cache"]), before[0]), "k_cache written"
    assert np.array_equal(to64(args["v_cache"]), before[1]), "v_cache written"
    # Filled to exactly the block table's capacity, without an append: accepted.
    call(dict(args, k=None, v=None))


def test_read_only_cache_refused(rng):
    c = make_case(rng, b=1, sq=1, cache_len=8, seqlens=[2])
    c["k_cache"].flags.writeable = False
    with pytest.raises(ValueError, match=r"^k_cache: expected a writable array"):
        call(c)


# ---------------------------------------------------------------------------- CUDA

def cuda(test):
    """Marks a CUDA test: `gpu`, skipped with the reason shown without a device or backend."""
    for mark in (
            pytest.mark.skipif(not flashattn.cuda_compiled(),
                               reason="flashattn was built without the CUDA backend (no nvcc, or no GPU at test.sh time)"),
            pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                               reason="no CUDA device: GPU tests skipped"),
            pytest.mark.gpu):
        test = mark(test)
    return test

GPU_DTYPES = ["float16", "bfloat16"]
FLOOR = {"float16": 1e-4, "bfloat16": 5e-4}
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def gpu_call_and_check(c: dict, dtype: str, sdpa=False):
    """c on the GPU in `dtype`: the output under the accuracy rule (2x the error of attention
    computed in `dtype` from the same rounded, rotated inputs, plus a floor), the lse, and the
    caches. Returns (out, lse) as float64."""
    from torch_reference import attention_reference

    dt = getattr(torch, dtype)
    args = as_framework(c, "torch", dtype=dt)
    expected = kvcache_reference(as_float64(args), store=torch_store(dt))
    poison_written(args, expected)
    args = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    out, lse = call(args, return_softmax_lse=True)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == dt and lse.dtype == torch.float32
    lows, rounded_lses = [], []
    causal = c.get("causal", False)
    options = dict(softmax_scale=c.get("softmax_scale"), causal=causal,
                   window=c.get("window_size", (-1, -1)), softcap=c.get("softcap", 0.0))
    slopes = c.get("alibi_slopes")
    for b, (qb, keys, values) in enumerate(expected.inputs):
        alibi = None
        if slopes is not None:
            alibi = torch.from_numpy(np.asarray(slopes[b] if slopes.ndim == 2 else slopes, dtype=np.float64))
        low, _ = attention_reference(*(torch.from_numpy(x[None]).to(dt).cuda()
                                       for x in (qb, keys, values)),
                                     alibi=None if alibi is None else alibi.cuda(), **options)
        lows.append(low[0].double().cpu().numpy())
        # The lse in float64 of the query as the kernel multiplies it: rotated, then rounded
        # to `dtype` (the keys are already the cache's values).
        _, rounded = attention_reference(torch.from_numpy(qb[None]).to(dt).double(),
                                         torch.from_numpy(keys[None]), torch.from_numpy(values[None]),
                                         alibi=alibi, **options)
        rounded_lses.append(rounded[0].numpy())
    assert_accurate(to64(out), expected.out, low=np.stack(lows), factor=2.0, floor=FLOOR[dtype])
    lse64 = to64(lse)
    finite = np.isfinite(expected.lse)
    assert np.array_equal(np.isfinite(lse64), finite)
    # fp32 accumulation's tolerance, plus what rounding the rotated query to `dtype` moves the
    # exact lse by (up to ~3e-3 in bf16 at head dim 64: a fixed bound failed now and then).
    query_rounding = np.abs(np.stack(rounded_lses)[finite] - expected.lse[finite]).max(initial=0)
    assert np.abs(lse64[finite] - expected.lse[finite]).max(initial=0) <= 1e-3 + 1e-4 * np.abs(
        expected.lse[finite]).max(initial=0) + query_rounding
    check_caches(args, expected, ulp=ULP[dtype])
    if sdpa:
        import torch.nn.functional as F

        for b, (qb, keys, values) in enumerate(expected.inputs):
            qt, kt, vt = (torch.from_numpy(x).to(dt).cuda().transpose(0, 1)[None]
                          for x in (qb, keys, values))
            mask = None
            if causal:  # SDPA's is_causal is top-left aligned: pass ours as a boolean mask
                i = torch.arange(qt.shape[2], device="cuda")[:, None]
                j = torch.arange(kt.shape[2], device="cuda")[None, :]
                mask = j <= i + kt.shape[2] - qt.shape[2]
            ref = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                 scale=c.get("softmax_scale"),
                                                 enable_gqa=qt.shape[1] != kt.shape[1])
            diff = (out[b].double() - ref[0].transpose(0, 1).double()).abs().max().item()
            assert diff <= 4 * ULP[dtype] * max(1.0, ref.abs().max().item()), (b, diff)
    return to64(out), lse64


GPU_CASES = {
    "decode-gqa": dict(b=4, sq=1, h=32, hk=8, d=128, cache_len=2000, causal=True),
    "decode-long-splits": dict(b=1, sq=1, h=16, hk=2, d=128, cache_len=20000),
    "chunk-rotary-interleaved": dict(b=2, sq=7, h=8, hk=2, d=64, cache_len=300, causal=True,
                                     rotary="interleaved"),
    "rotary-neox-partial": dict(b=2, sq=3, h=8, hk=8, d=96, cache_len=129, rotary="neox",
                                rotary_dim=32),
    "window-softcap-alibi": dict(b=3, sq=4, h=6, hk=3, d=64, cache_len=400, causal=True,
                                 window_size=(100, -1), softcap=10.0, alibi="bh"),
    "batch-idx-leftpad": dict(b=3, sq=2, h=8, hk=4, d=128, cache_len=513, batch_idx=True,
                              leftpad=True, causal=True),
    "hdim256-mqa": dict(b=2, sq=1, h=8, hk=1, d=256, cache_len=777),
    "no-append": dict(b=2, sq=1, h=8, hk=2, d=128, cache_len=1025, append=False),
    # Head dims that are not multiples of 8: the call runs on padded copies of its tensors
    # (only the positions the sequences hold, and only the appended rows written back).
    "hdim59-rotary-leftpad": dict(b=3, sq=2, h=8, hk=2, d=59, cache_len=300, causal=True,
                                  rotary="neox", rotary_dim=58, leftpad=True),
    "hdim5-rotary-interleaved": dict(b=2, sq=1, h=4, hk=1, d=5, cache_len=129,
                                     rotary="interleaved", rotary_dim=4),
    "hdim250-batch-idx": dict(b=2, sq=3, h=4, hk=2, d=250, cache_len=200, batch_idx=True,
                              causal=True),
    "hdim111-no-append": dict(b=2, sq=1, h=8, hk=2, d=111, cache_len=333, append=False),
}


@cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("paged", [None, 1, 16, 13, 256], ids=lambda p: f"page{p}" if p else
                         "dense")
def test_cuda_vs_reference(rng, dtype, case, paged):
    kw = dict(GPU_CASES[case])
    if paged:
        kw.pop("batch_idx", None)  # cache_batch_idx names dense cache rows only
    if paged == 1 and kw["cache_len"] > 2000:
        kw["cache_len"] = 2000  # page size 1 at 20k keys makes the table, not the kernel, slow
    gpu_call_and_check(make_case(rng, page_size=paged, **kw), dtype)


@cuda
@pytest.mark.parametrize("num_splits", [0, 1, 3, 16])
def test_cuda_num_splits(rng, num_splits):
    c = make_case(rng, b=2, sq=1, h=32, hk=8, d=128, cache_len=9000, causal=True,
                  rotary="neox", num_splits=num_splits)
    gpu_call_and_check(c, "bfloat16")


@cuda
@pytest.mark.parametrize("case", ["decode-gqa", "batch-idx-leftpad"])
def test_cuda_vs_sdpa(rng, case):
    """SDPA (any backend, float inputs of the same rounding) as a second oracle on the
    gathered keys."""
    gpu_call_and_check(make_case(rng, **GPU_CASES[case]), "bfloat16", sdpa=True)


def cuda_decoder(b=2, h=8, hk=2, d=128, length=256, dtype=None):
    dtype = dtype or torch.bfloat16
    k_cache = torch.zeros(b, length, hk, d, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    return k_cache, v_cache


@cuda
def test_cuda_decoding_loop_matches_one_attention():
    from torch_reference import attention_reference

    b, h, hk, d, total, prompt = 2, 8, 2, 128, 70, 31
    dt = torch.bfloat16
    q, k, v = (torch.randn(b, total, n, d, device="cuda").to(dt) for n in (h, hk, hk))
    k_cache, v_cache = cuda_decoder(b, h, hk, d, 128, dt)
    seqlens = torch.zeros(b, dtype=torch.int32, device="cuda")
    outs = []
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, total)]
    with torch.inference_mode():
        for start, stop in steps:
            outs.append(flash_attn_with_kvcache(q[:, start:stop], k_cache, v_cache,
                                                k[:, start:stop], v[:, start:stop],
                                                cache_seqlens=seqlens, causal=True))
            seqlens += stop - start
    got = torch.cat(outs, 1)
    want, _ = attention_reference(q.double(), k.double(), v.double(), causal=True)
    low, _ = attention_reference(q, k, v, causal=True)
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (low.double() - want).abs().max().item() + FLOOR["bfloat16"]
    assert torch.equal(k_cache[:, :total], k) and torch.equal(v_cache[:, :total], v)
    assert (k_cache[:, total:] == 0).all()


@cuda
@pytest.mark.parametrize("d", [128, 59])
def test_cuda_current_stream_and_graph_capture(d):
    """A decoding step captured in a CUDA graph: replays append at the positions the
    cache_seqlens tensor holds at replay time, on the capturing stream (d = 59: with the
    padded copies, stream-ordered too)."""
    b, h, hk = 2, 8, 2
    dt = torch.float16
    k_cache, v_cache = cuda_decoder(b, h, hk, d, 64, dt)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dt)
    k, v = torch.randn(b, 1, hk, d, device="cuda", dtype=dt), torch.randn(b, 1, hk, d,
                                                                         device="cuda", dtype=dt)
    seqlens = torch.zeros(b, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    for step in range(1, 4):
        seqlens.fill_(step)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache[:, step], k[:, 0]) and torch.equal(v_cache[:, step], v[:, 0])
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        want = flash_attn_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=seqlens)
        torch.testing.assert_close(out, want, rtol=0, atol=0)

    # The current stream: inputs written on a side stream behind a long sleep.
    pending = torch.full_like(k, float("nan"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        pending.copy_(k)
        flash_attn_with_kvcache(q, k_cache, v_cache, pending, v, cache_seqlens=10)
    side.synchronize()
    assert torch.equal(k_cache[:, 10], k[:, 0])


@cuda
def test_cuda_paged_capacity_refused_directly_and_guarded_in_a_graph():
    """Directly, a paged cache too small for cache_seqlens + S_new is refused (cache_seqlens is
    copied to the host for the check, as upstream does). Captured in a CUDA graph no host check
    can run: replayed with such a value, the kernels' guard applies (docs/SPEC.md): that
    sequence appends nothing and its out and lse rows are NaN; the other one is unaffected
    (bit for bit what a call of its own gives, with the same single split)."""
    b, h, hk, d, page = 2, 8, 2, 128, 256
    dt = torch.float16
    k_cache = torch.randn(3, page, hk, d, device="cuda", dtype=dt)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.tensor([[0], [1]], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=dt) for _ in range(2))
    seqlens = torch.tensor([page, 10], dtype=torch.int32, device="cuda")  # 256 + 1 > one page
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match="^block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                block_table=block_table, num_splits=1)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])

    seqlens.fill_(7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, on copies of the caches
        flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=seqlens,
                                block_table=block_table, num_splits=1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                           block_table=block_table, return_softmax_lse=True,
                                           num_splits=1)
    seqlens.copy_(torch.tensor([page, 10], dtype=torch.int32))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert torch.equal(k_cache[0], ref_k[0]) and torch.equal(v_cache[0], ref_v[0]), "appended"
    want = flash_attn_with_kvcache(q[1:], ref_k, ref_v, k[1:], v[1:], cache_seqlens=seqlens[1:],
                                   block_table=block_table[1:], num_splits=1)
    torch.testing.assert_close(out[1:], want, rtol=0, atol=0)
    # Both appended sequence 1 at row 10 of page 1; neither touched anything else.
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@cuda
def test_cuda_torch_compile():
    pytest.importorskip("triton", reason="Inductor's CUDA code generation needs Triton")
    torch._dynamo.reset()
    b, h, hk, d = 2, 8, 2, 128
    dt = torch.bfloat16
    k_cache, v_cache = cuda_decoder(b, h, hk, d, 64, dt)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()

    def step(q, k, v, k_cache, v_cache, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                       causal=True) * 2

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    with torch.inference_mode():
        for s in range(3):
            q = torch.randn(b, 1, h, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=dt) for _ in range(2))
            seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
            got = compiled(q, k, v, k_cache, v_cache, seqlens)
            want = step(q, k, v, ref_k, ref_v, seqlens)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("feature", FP8_CACHE_FEATURES)
@pytest.mark.parametrize("d,paged", [(128, False), (64, False), (256, False), (128, True)],
                         ids=["d128", "d64", "d256", "d128-paged"])
def test_gpu_fp8_cache(rng, dtype, feature, d, paged):
    """fp8 e4m3 caches on CUDA: the decode kernel against float64 (check_fp8_cache_call), a
    long cache that the heuristic splits."""
    kw = dict(FEATURES[feature], d=d, sq=1, snew=1, cache_len=700)
    if paged:
        kw["page_size"] = 64
    a = fp8_cache_case(rng, getattr(torch, dtype), **kw)
    check_fp8_cache_call({n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in a.items()})
