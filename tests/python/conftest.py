"""Shared helpers: float64 references that materialise the scores (docs/SPEC.md) and the
accuracy rule."""
import numpy as np
import pytest


def mask(sq, sk, causal, window):
    """Visible (i, j) as a bool (sq, sk) matrix: the bottom-right aligned rule of docs/SPEC.md."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    d = i + sk - sq
    visible = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        visible &= j >= d - left
    if right >= 0:
        visible &= j <= d + right
    return visible


def reference(q, k, v, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
              alibi=None, dtype=np.float64):
    """Attention over (B, S, H, D) arrays with the scores materialised, computed in `dtype`
    (float64: the oracle; float16: the 'plain low-precision implementation' of the rule).
    Returns out (B, Sq, H, Dv) and lse (B, H, Sq) as float64."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = dtype(softmax_scale if softmax_scale is not None else 1.0 / np.sqrt(d))
    group = h // hk
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k).astype(dtype) * scale
    if softcap > 0:
        s = (dtype(softcap) * np.tanh(s / dtype(softcap))).astype(dtype)
    if alibi is not None:
        slopes = np.asarray(alibi, dtype=np.float64)
        slopes = np.broadcast_to(slopes, (b, h)) if slopes.ndim == 2 else np.broadcast_to(slopes, (b, h))
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        dist = np.abs(i + sk - sq - j)
        s = (s - slopes[:, :, None, None] * dist).astype(dtype)
    visible = mask(sq, sk, causal, window)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe).astype(dtype)
    l = p.sum(axis=-1, keepdims=True)
    lse = (np.log(l.astype(np.float64)) + m_safe)[..., 0]
    p = np.where(l > 0, p / np.where(l > 0, l, 1), 0).astype(dtype)
    out = np.einsum("bhqk,bkhd->bqhd", p, v).astype(np.float64)
    return out, lse


def assert_accurate(got, ref64, low=None, factor=2.0, rel=1e-5, floor=1e-6):
    """docs/SPEC.md's rule: fp32 within `rel` of the reference's scale; fp16/bf16 within `factor`
    times the error of the plain low-precision implementation `low`, plus a floor."""
    got = np.asarray(got, dtype=np.float64)
    err = np.max(np.abs(got - ref64)) if got.size else 0.0
    if low is None:
        bound = rel * max(np.max(np.abs(ref64)) if ref64.size else 0.0, 1.0) + floor
    else:
        bound = factor * np.max(np.abs(low - ref64)) + floor
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


@pytest.fixture
def rng():
    return np.random.default_rng()


def page_keys(k, v, cu_k, page_size, rng):
    """Varlen keys and values (total_k, Hk, D) paged as flash_attn_varlen_func's block_table
    takes them: sequence b's key j in row j % page_size of its page j // page_size, the pages
    in a random order among two spare ones, NaN in every page row that holds no key, and an
    index outside the pages in every block-table slot past a sequence's keys (a call that reads
    either gives NaN). Returns (k_pages, v_pages, block_table int32 (B, max_pages))."""
    cu_k = [int(x) for x in cu_k]
    lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    counts = [-(-n // page_size) for n in lens]
    max_pages = max(counts, default=0) + 1
    num_pages = sum(counts) + 2
    order = iter(rng.permutation(num_pages))
    shape = (num_pages, page_size) + tuple(k.shape[1:])
    k_pages, v_pages = np.full(shape, np.nan, k.dtype), np.full(shape, np.nan, v.dtype)
    table = np.full((len(lens), max_pages), num_pages + 7, np.int32)
    table[:, ::2] = -3
    for b, n in enumerate(lens):
        for slot in range(counts[b]):
            page = next(order)
            table[b, slot] = page
            rows = slice(cu_k[b] + slot * page_size, cu_k[b] + min(n, (slot + 1) * page_size))
            count = rows.stop - rows.start
            k_pages[page, :count], v_pages[page, :count] = k[rows], v[rows]
    return k_pages, v_pages, table
