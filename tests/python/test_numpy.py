"""The framework-neutral path on the CPU: NumPy arrays (and DLPack producers) into the library.

Runs everywhere (CI included): no torch needed."""
import numpy as np
import pytest

import flashattn
from flashattn import (_C, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)
from conftest import assert_accurate, page_keys, reference

FEATURES = [
    dict(),
    dict(causal=True),
    dict(window_size=(7, 3)),
    dict(causal=True, window_size=(5, -1)),
    dict(softcap=5.0),
    dict(alibi=True),
    dict(softmax_scale=0.3, causal=True, softcap=3.0, alibi=True),
]


def randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def call_args(f, h, b, rng):
    kw = dict(f)
    alibi = None
    if kw.pop("alibi", False):
        alibi = rng.uniform(0.01, 0.5, size=(h,)).astype(np.float32)
    return kw, alibi


def ref_kwargs(kw, alibi):
    return dict(softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                alibi=alibi)


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("sq,sk", [(37, 37), (13, 61), (61, 13), (1, 1), (5, 0)])
@pytest.mark.parametrize("h,hk,d", [(4, 4, 32), (6, 2, 40)])
def test_forward_fp32(rng, features, sq, sk, h, hk, d):
    b = 2
    q, k, v = randn(rng, (b, sq, h, d)), randn(rng, (b, sk, hk, d)), randn(rng, (b, sk, hk, d))
    kw, alibi = call_args(features, h, b, rng)
    out, lse, probs = flash_attn_func(q, k, v, alibi_slopes=alibi, return_attn_probs=True, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (b, sq, h, d)
    assert lse.dtype == np.float32 and lse.shape == (b, h, sq) and probs is None
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_out, ref_lse = reference(q, k, v, **ref_kwargs(kw, alibi))
    assert_accurate(out, ref_out)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert_accurate(lse[finite], ref_lse[finite])


@pytest.mark.parametrize("features", [dict(), dict(causal=True, softcap=4.0)],
                         ids=["plain", "causal-softcap"])
def test_forward_fp16_accuracy_rule(rng, features):
    b, sq, sk, h, d = 2, 70, 93, 4, 64
    q, k, v = (randn(rng, s, np.float16) for s in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d)))
    kw, alibi = call_args(features, h, b, rng)
    out = flash_attn_func(q, k, v, **kw)
    assert out.dtype == np.float16
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ref_out, _ = reference(q, k, v, **ref_kwargs(kw, alibi))
        low, _ = reference(q, k, v, dtype=np.float16, **ref_kwargs(kw, alibi))
    assert_accurate(out, ref_out, low=low, factor=2.0, floor=1e-3)


def test_forward_bf16_via_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 NumPy arrays need ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    b, sq, sk, h, d = 2, 33, 47, 4, 64
    q, k, v = (randn(rng, s).astype(bf16) for s in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d)))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == bf16
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_out, _ = reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                               causal=True)
    # Plain bf16 attention: scores, softmax and the product rounded to bf16.
    err = np.max(np.abs(out.astype(np.float64) - ref_out))
    assert err <= 2 * 2.0**-8 * np.max(np.abs(ref_out)) + 1e-3, err


def test_qkvpacked_is_views_and_matches(rng, monkeypatch):
    b, s, h, d = 2, 29, 3, 16
    qkv = randn(rng, (b, s, 3, h, d))
    expected = flash_attn_func(qkv[:, :, 0].copy(), qkv[:, :, 1].copy(), qkv[:, :, 2].copy(),
                               causal=True)
    seen = {}
    real = _C.forward

    def spy(q, k, v, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(_C, "forward", spy)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    np.testing.assert_array_equal(out, expected)
    for name in "qkv":
        assert np.shares_memory(seen[name], qkv), f"{name} was copied"
        assert not seen[name].flags.c_contiguous


def test_kvpacked_gqa_matches(rng):
    b, sq, sk, h, hk, d = 2, 17, 40, 6, 3, 24
    q, kv = randn(rng, (b, sq, h, d)), randn(rng, (b, sk, 2, hk, d))
    out = flash_attn_kvpacked_func(q, kv, window_size=(4, 4))
    ref, _ = reference(q, kv[:, :, 0], kv[:, :, 1], window=(4, 4))
    assert_accurate(out, ref)


def varlen_batch(rng, lens_q, lens_k, h, hk, d):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(rng, (cu_q[-1], h, d))
    k = randn(rng, (cu_k[-1], hk, d))
    v = randn(rng, (cu_k[-1], hk, d))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence(rng, causal):
    lens_q, lens_k = [5, 0, 31, 12], [9, 4, 31, 0]
    h, hk, d = 4, 2, 32
    q, k, v, cu_q, cu_k = varlen_batch(rng, lens_q, lens_k, h, hk, d)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    for bi in range(len(lens_q)):
        qs, ks = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        if lens_q[bi] == 0:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            ref, ref_lse = reference(q[None, qs], k[None, ks], v[None, ks], causal=causal)
        assert_accurate(out[qs], ref[0])
        np.testing.assert_array_equal(np.isfinite(lse[:, qs]), np.isfinite(ref_lse[0]))


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(window_size=(6, 2)),
                                      dict(softcap=4.0, alibi=True)], ids=str)
def test_varlen_paged_equals_dense_and_matches_per_sequence(rng, page_size, features):
    """flash_attn_varlen_func with block_table: the same keys paged (random page order, NaN
    wherever no key is) give the dense call's bits on the CPU (the engine loads the same key
    tiles) and each sequence matches the float64 reference."""
    lens_q, lens_k = [5, 0, 31, 12, 1], [9, 4, 31, 0, 40]
    h, hk, d = 4, 2, 32
    q, k, v, cu_q, cu_k = varlen_batch(rng, lens_q, lens_k, h, hk, d)
    k_pages, v_pages, table = page_keys(k, v, cu_k, page_size, rng)
    kw = dict(features)
    alibi = (rng.random(h) * 0.4 + 0.05).astype(np.float32) if kw.pop("alibi", False) else None
    dense = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                   alibi_slopes=alibi, **kw)
    out, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q),
                                         max(lens_k), alibi_slopes=alibi, block_table=table,
                                         return_attn_probs=True, **kw)
    np.testing.assert_array_equal(out, dense)
    window = kw.pop("window_size", (-1, -1))
    for bi in range(len(lens_q)):
        qs, ks = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        if lens_q[bi] == 0:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            ref, _ = reference(q[None, qs], k[None, ks], v[None, ks], window=window, alibi=alibi,
                               **kw)
        assert_accurate(out[qs], ref[0])


def test_varlen_packed_variants_are_views(rng, monkeypatch):
    lens = [7, 19, 1]
    h, d = 2, 16
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    qkv = randn(rng, (cu[-1], 3, h, d))
    expected = flash_attn_varlen_func(qkv[:, 0].copy(), qkv[:, 1].copy(), qkv[:, 2].copy(), cu,
                                      cu, max(lens), max(lens), causal=True)
    seen = {}
    real = _C.forward_varlen

    def spy(q, k, v, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(_C, "forward_varlen", spy)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    np.testing.assert_array_equal(out, expected)
    assert all(np.shares_memory(seen[n], qkv) for n in "qkv")
    out_kv = flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, max(lens), max(lens),
                                             causal=True)
    np.testing.assert_array_equal(out_kv, expected)


def test_dropout_is_seeded_by_numpy(rng):
    q, k, v = (randn(rng, (1, 16, 2, 8)) for _ in range(3))
    np.random.seed(3)
    a = flash_attn_func(q, k, v, dropout_p=0.5)
    np.random.seed(3)
    b = flash_attn_func(q, k, v, dropout_p=0.5)
    c = flash_attn_func(q, k, v, dropout_p=0.5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.allclose(a, flash_attn_func(q, k, v))


def test_dlpack_producer_without_numpy_type(rng):
    class Wrapped:  # a foreign array that only speaks DLPack
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    q, k, v = (randn(rng, (1, 9, 2, 16)) for _ in range(3))
    out = flash_attn_func(Wrapped(q), Wrapped(k), Wrapped(v))
    np.testing.assert_array_equal(out, flash_attn_func(q, k, v))


# ----------------------------------------------------------------------------- errors

def test_shape_error_is_value_error_with_the_message(rng):
    q, k, v = randn(rng, (2, 8, 4, 32)), randn(rng, (2, 8, 3, 32)), randn(rng, (2, 8, 3, 32))
    with pytest.raises(ValueError, match=r"^k: expected .*given"):
        flash_attn_func(q, k, v)


def test_dtype_mismatch_is_type_error(rng):
    q, k, v = randn(rng, (1, 8, 2, 32)), randn(rng, (1, 8, 2, 32), np.float16), randn(rng, (1, 8, 2, 32))
    with pytest.raises(TypeError, match=r"^k: expected dtype fp32, given dtype fp16"):
        flash_attn_func(q, k, v)
    with pytest.raises(TypeError, match=r"q: expected dtype float32, float16 or bfloat16, given float64"):
        flash_attn_func(q.astype(np.float64), k, v)


def test_bad_window_and_dropout_are_value_errors(rng):
    q, k, v = (randn(rng, (1, 8, 2, 32)) for _ in range(3))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="window"):
        flash_attn_func(q, k, v, window_size=(-3, 0))


def test_paged_block_table_out_of_range_is_a_value_error(rng):
    q, k, v, cu_q, cu_k = varlen_batch(rng, [3, 4], [5, 2], 2, 2, 8)
    k_pages, v_pages, table = page_keys(k, v, cu_k, 2, rng)
    table[1, 0] = k_pages.shape[0]
    with pytest.raises(ValueError, match=r"^block_table: expected page indices in \[0, num_pages"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 5, block_table=table)
    with pytest.raises(ValueError, match=r"^v: expected 4 dimensions"):
        flash_attn_varlen_func(q, k_pages, v, cu_q, cu_k, 4, 5, block_table=table)


def test_low_level_error_leaves_outputs_untouched(rng):
    q, k, v = (randn(rng, (1, 8, 2, 32)) for _ in range(3))
    out = np.full((1, 8, 2, 16), np.nan, np.float32)  # wrong head dim
    lse = np.full((1, 2, 8), np.nan, np.float32)
    with pytest.raises(ValueError, match="out: expected"):
        _C.forward(q, k, v, out, lse)
    assert np.isnan(out).all() and np.isnan(lse).all()


def test_cuda_backend_request_names_the_backend(rng):
    q, k, v = (randn(rng, (1, 8, 2, 32)) for _ in range(3))
    out, lse = np.empty_like(q), np.empty((1, 2, 8), np.float32)
    with pytest.raises((ValueError, NotImplementedError), match="backend"):
        _C.forward(q, k, v, out, lse, backend=_C.BACKEND_CUDA)


def test_low_level_backward_fp32(rng):
    """fa_backward through _C against the analytic float64 gradients (no mask features)."""
    b, s, h, d = 1, 23, 2, 16
    q, k, v, dout = (randn(rng, (b, s, h, d)) for _ in range(4))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    dq, dk, dv = (np.full_like(x, np.nan) for x in (q, k, v))
    _C.backward(q, k, v, out, dout, lse, dq, dk, dv)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(d)
    sc = np.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v64)
    dp = np.einsum("bqhd,bkhd->bhqk", do64, v64)
    ds = p * (dp - np.einsum("bqhd,bqhd->bhq", do64, o)[..., None])
    ref = {"dq": np.einsum("bhqk,bkhd->bqhd", ds, k64) * scale,
           "dk": np.einsum("bhqk,bqhd->bkhd", ds, q64) * scale,
           "dv": np.einsum("bhqk,bqhd->bkhd", p, do64)}
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_accurate(got, ref[name])


def test_version_and_build_flags():
    assert flashattn.__version__ == _C.version()
    assert isinstance(flashattn.cuda_compiled(), bool)
