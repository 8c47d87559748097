"""The framework-neutral path: NumPy arrays and any array with ``__dlpack__`` (forward only).

CPU inputs are viewed as NumPy arrays (``np.from_dlpack``: no copy) and the results are NumPy
arrays; CUDA inputs are viewed as CuPy arrays when CuPy is installed, with the results allocated
by CuPy and the call on CuPy's current stream. NumPy has no bfloat16 of its own: arrays of
``ml_dtypes.bfloat16`` are passed to the library as uint16 views of the same bits.
"""
import numpy as np

from . import _C

_FLOATS = ("float32", "float16", "bfloat16")


def _namespace(x):
    """(array module, converter) for the input's framework."""
    if isinstance(x, np.ndarray):
        return np, lambda a: a
    if hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type == _C.DLPACK_DEVICE_CPU:
            return np, lambda a: a if a is None or isinstance(a, np.ndarray) else np.from_dlpack(a)
        if device_type == _C.DLPACK_DEVICE_CUDA:
            try:
                import cupy
            except ImportError:
                raise TypeError("q: CUDA arrays other than torch tensors need CuPy installed "
                                "(the results are allocated as CuPy arrays)") from None
            return cupy, lambda a: a if a is None else cupy.from_dlpack(a)
        raise TypeError(f"q: expected a CPU or CUDA array, given DLPack device type {device_type}")
    raise TypeError(f"q: expected a torch.Tensor, a NumPy array or an array with __dlpack__, "
                    f"given {type(x).__name__}")


def _bits(a):
    """What _C receives: bfloat16 (ml_dtypes) as uint16 views of the same bits."""
    if a is not None and getattr(a.dtype, "name", "") == "bfloat16" and isinstance(a, np.ndarray):
        return a.view(np.uint16)
    return a


def _check_float(a, name):
    if getattr(a.dtype, "name", str(a.dtype)) not in _FLOATS:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, given {a.dtype}")


def _execution(xp) -> dict:
    if xp is np:
        return {}
    return {"stream": xp.cuda.get_current_stream().ptr}


def _dropout(dropout_p: float) -> dict:
    if dropout_p > 0.0:
        # NumPy's global generator, so np.random.seed governs it.
        return {"dropout_p": dropout_p, "seed": int(np.random.randint(0, 2**62)), "offset": 0}
    return {}


def forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            return_probs=False, block_table=None):
    """(out, lse, probs): probs is upstream's S_dmask when return_probs and dropout_p > 0
    (attention_probabilities with the forward's seed, so the same mask), else None. With
    block_table, k and v are paged (num_pages, page_size, Hk, D) (varlen only)."""
    xp, convert = _namespace(q)
    q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table = (
        convert(a) for a in (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table))
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_float(a, name)
    varlen = cu_seqlens_q is not None
    ndim = 3 if varlen else 4
    # Paged keys and values (block_table): (num_pages, page_size, Hk, D).
    for a, name, n in ((q, "q", ndim), (v, "v", ndim if block_table is None else 4)):
        if a.ndim != n:
            raise ValueError(f"{name}: expected {n} dimensions, given {a.ndim} "
                             f"(shape {tuple(a.shape)})")
    out = xp.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype)
    if varlen:
        lse = xp.empty((q.shape[1], q.shape[0]), dtype=xp.float32)
    else:
        lse = xp.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=xp.float32)
    options = dict(softmax_scale=softmax_scale, causal=bool(causal),
                   window_left=int(window_size[0]), window_right=int(window_size[1]),
                   softcap=float(softcap), alibi_slopes=alibi_slopes,
                   **_dropout(dropout_p), **_execution(xp))
    want_probs, probs = return_probs and dropout_p > 0.0, None
    if varlen:
        lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        _C.forward_varlen(_bits(q), _bits(k), _bits(v), _bits(out), lse, *lengths,
                          block_table=block_table, **options)
        if want_probs:
            probs = xp.empty((len(cu_seqlens_q) - 1, q.shape[1]) + lengths[2:], dtype=xp.float32)
            _C.attention_probabilities_varlen(_bits(q), _bits(k), probs, *lengths, **options)
    else:
        _C.forward(_bits(q), _bits(k), _bits(v), _bits(out), lse, **options)
        if want_probs:
            probs = xp.empty((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), dtype=xp.float32)
            _C.attention_probabilities(_bits(q), _bits(k), probs, **options)
    return out, lse, probs


def _cache_seqlens(xp, cache_seqlens, q, k_cache, k, block_table):
    """int32 (batch,) cache_seqlens from an int (broadcast) or None (every cache full)."""
    if cache_seqlens is not None and not isinstance(cache_seqlens, (int, np.integer)):
        if not hasattr(cache_seqlens, "shape"):
            raise TypeError(f"cache_seqlens: expected an int or an int32 (batch,) array, given "
                            f"{type(cache_seqlens).__name__}")
        return cache_seqlens
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: expected an int or an int32 (batch,) array when k "
                             "and v are appended, given None")
        cache_seqlens = k_cache.shape[1] * (block_table.shape[1] if block_table is not None
                                            else 1)
    return xp.full((q.shape[0],), int(cache_seqlens), dtype=xp.int32)


def forward_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                    window_size, softcap, rotary_interleaved, alibi_slopes, num_splits):
    xp, convert = _namespace(q)
    (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
     block_table, alibi_slopes) = (convert(a) for a in (
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
        block_table, alibi_slopes))
    if not isinstance(cache_seqlens, (type(None), int, np.integer)):
        cache_seqlens = convert(cache_seqlens)
    for a, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v")):
        if a is not None:
            _check_float(a, name)
    for a, name in ((q, "q"), (v_cache, "v_cache")):
        if a.ndim != 4:
            raise ValueError(f"{name}: expected 4 dimensions, given {a.ndim} "
                             f"(shape {tuple(a.shape)})")
    if k is not None:
        for a, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if xp is np and not a.flags.writeable:
                raise ValueError(f"{name}: expected a writable array (k and v are appended in "
                                 f"place), given a read-only one")
    cache_seqlens = _cache_seqlens(xp, cache_seqlens, q, k_cache, k, block_table)
    out = xp.empty(tuple(q.shape[:-1]) + (v_cache.shape[-1],), dtype=q.dtype)
    lse = xp.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=xp.float32)
    _C.forward_kvcache(
        _bits(q), _bits(k_cache), _bits(v_cache), cache_seqlens, _bits(out), lse,
        k=_bits(k), v=_bits(v), rotary_cos=_bits(rotary_cos), rotary_sin=_bits(rotary_sin),
        rotary_interleaved=bool(rotary_interleaved), cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, num_splits=int(num_splits),
        softmax_scale=softmax_scale, causal=bool(causal), window_left=int(window_size[0]),
        window_right=int(window_size[1]), softcap=float(softcap), alibi_slopes=alibi_slopes,
        **_execution(xp))
    return out, lse
