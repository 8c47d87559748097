"""The FlashAttention functions: the established names, argument orders and defaults.

Each function takes PyTorch tensors (CPU or CUDA, differentiable; see flashattn.torch_ops) or,
forward only, NumPy arrays / DLPack arrays (see flashattn._array).
"""

from . import _array

_COMMON_ARGS = """\
        dropout_p: float. Dropout probability in [0, 1); pass 0.0 at evaluation time. Each
            probability is kept with probability 1 - dropout_p and scaled by 1/(1 - dropout_p);
            the mask comes from a Philox4x32-10 stream whose seed is drawn from torch's default
            generator (torch.manual_seed governs it; NumPy inputs: np.random). The CPU and
            CUDA backends drop the same elements for the same seed.
        softmax_scale: float. The scaling of QK^T before the softmax. Default 1 / sqrt(headdim).
        causal: bool. Whether to apply the causal mask (bottom-right aligned; see below).
        window_size: (left, right). Sliding-window local attention when not (-1, -1); -1 means
            unbounded on that side. causal=True sets right to 0 and keeps left.
        softcap: float. Anything > 0 activates softcapping: scores become
            softcap * tanh(scores / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads), fp32. A bias of
            -alibi_slope * |i + seqlen_k - seqlen_q - j| is added to the score of query i and
            key j.
        deterministic: bool. Whether the backward is bitwise reproducible run to run. The
            CPU backward always is; the CUDA backward by default adds dq with atomics (faster,
            last bits vary run to run) and with deterministic=True computes dq in a fixed
            order instead.
        return_attn_probs: bool. Also return the log-sum-exp and, when dropout_p > 0, the
            probabilities with the dropout mask in their signs (S_dmask, below). For testing
            only: S_dmask costs O(batch * nheads * seqlen_q * seqlen_k) memory and time.
        q_descale, k_descale, v_descale: keyword only, for torch.float8_e4m3fn q, k, v (a
            forward only, no dropout; out is bf16). fp32 factors that turn each stored value
            into the value it stands for (None: 1): (batch_size, nheads_k), or
            (batch_size, nheads_k, ceil(seqlen / flashattn.FP8_SCALE_BLOCK_ROWS)) for one
            factor per block of 128 rows of a sequence (seqlen: seqlen_q for q, seqlen_k for k
            and v; varlen: max_seqlen_q/k). flashattn.quantize_fp8 makes them. On CUDA, the
            Hopper kernel (H100/H200; rows of 16-byte multiples); other GPUs refuse fp8
            (NotImplementedError)."""

_MASKS = """\
    Masks (1 = attend, 0 = masked out). With causal=True the mask is aligned to the bottom-right
    corner of the seqlen_q x seqlen_k score matrix: query i sees key j iff
    j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:
        1 1 1 1 0
        1 1 1 1 1
    For seqlen_q = 5, seqlen_k = 2:
        0 0
        0 0
        0 0
        1 0
        1 1
    A query row that sees no key gives an output of 0 (and a log-sum-exp of -inf).

    With window_size = (left, right), query i sees the keys j in
    [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] (inclusive; a bound of -1
    is dropped). For seqlen_q = seqlen_k = 5, window_size = (1, 1):
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1
        0 0 0 1 1
    and causal=True with window_size = (2, -1) (a causal sliding window of 3 keys):
        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1"""

_RETURNS = """\
    Return:
        out: {out_shape}.
        softmax_lse [optional, if return_attn_probs=True]: {lse_shape}, fp32. The log-sum-exp
            (natural log) of each row of the scaled, masked scores.
        S_dmask [optional, if return_attn_probs=True]: None when dropout_p == 0. With dropout,
            {s_shape} fp32, indexed by the positions within each sequence, as upstream
            returns it for its tests: exp(s_ij - max_j s_ij) where query i sees key j (s the
            scaled, softcapped, biased score; the max over the keys row i sees), 0 where
            masked or outside the sequence, negated where dropout dropped the element (the
            forward's mask: S_dmask >= 0 reads it). So the probability is
            |S_dmask| * exp(max - softmax_lse). Upstream's test helper normalises it by key
            blocks of _get_block_size_n (flashattn.flash_attn_interface has it), which
            returns one block covering every key."""


def _is_torch(x) -> bool:
    # By the class alone: torch.compile traces this function, and a sys.modules lookup while
    # tracing made dynamo iterate that dict as imports changed it ("dictionary changed size
    # during iteration", seen on the H200 run). Tensor subclasses (Parameter, ...) count too.
    cls = type(x)
    if cls.__name__ == "Tensor" and cls.__module__ == "torch":  # the common case, without the loop
        return True
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in cls.__mro__)


def _window(window_size):
    left, right = (int(x) for x in window_size)
    # The library takes int32 key counts; past them the binding could not even say which
    # argument it refused.
    if max(left, right) >= 2 ** 31:
        raise ValueError(f"window_size: expected -1 or a key count below 2^31 on each side, "
                         f"given {tuple(window_size)}")
    return left, right


def _dropout(dropout_p) -> float:
    """dropout_p as a float, refused unless in [0, 1): the calls below take dropout only when
    dropout_p > 0, so a negative or NaN value would otherwise pass as "no dropout"."""
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), given {dropout_p}")
    return p


def _fp8_call(q, dropout_p, descales):
    """Whether a call is an FP8 forward (docs/SPEC.md, "FP8 inputs"): fp8 e4m3 torch inputs,
    or descales given (which the library then refuses for other dtypes, naming them)."""
    is_fp8 = _is_torch(q) and str(q.dtype) == "torch.float8_e4m3fn"
    if not (is_fp8 or any(d is not None for d in descales)):
        return False
    if not _is_torch(q):
        raise TypeError("q_descale: expected torch tensors for an fp8 forward "
                        f"(q torch.float8_e4m3fn), given q of type {type(q).__name__}")
    if is_fp8 and dropout_p > 0:
        raise ValueError("dropout_p: expected 0 for fp8_e4m3 inputs (forward only: no backward, "
                         f"no training), given {dropout_p}")
    return True


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           deterministic, return_attn_probs, descales=(None, None, None)):
    probs = None
    dropout_p, (left, right) = _dropout(dropout_p), _window(window_size)
    if _fp8_call(q, dropout_p, descales):
        from . import torch_ops

        out, lse = torch_ops.fwd_fp8(q, k, v, *descales, softmax_scale, bool(causal), left,
                                     right, float(softcap), alibi_slopes)
        return (out, lse, None) if return_attn_probs else out
    if _is_torch(q):
        from . import torch_ops

        options = (float(dropout_p), softmax_scale, bool(causal), left, right, float(softcap),
                   alibi_slopes)
        out, lse, rng_state = torch_ops.forward(q, k, v, *options, bool(deterministic),
                                                want_lse=bool(return_attn_probs))
        if return_attn_probs and dropout_p > 0:
            probs = torch_ops.attn_probs(q.detach(), k.detach(), rng_state, *options)
    else:
        out, lse, probs = _array.forward(q, k, v, dropout_p, softmax_scale, causal,
                                         window_size, softcap, alibi_slopes,
                                         return_probs=return_attn_probs)
    return (out, lse, probs) if return_attn_probs else out


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table, descales=(None, None, None)):
    probs = None
    dropout_p, (left, right) = _dropout(dropout_p), _window(window_size)
    if _fp8_call(q, dropout_p, descales):
        from . import torch_ops

        out, lse = torch_ops.varlen_fwd_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                            int(max_seqlen_q), int(max_seqlen_k), None,
                                            block_table, *descales, softmax_scale, bool(causal),
                                            left, right, float(softcap), alibi_slopes)
        return (out, lse, None) if return_attn_probs else out
    if block_table is not None and return_attn_probs and dropout_p > 0:
        # S_dmask is a testing aid for dense keys; paged keys would need their own kernel.
        raise ValueError("return_attn_probs: expected False with block_table and dropout_p > 0 "
                         "(the probabilities are computed for unpaged keys only), given True")
    if _is_torch(q):
        from . import torch_ops

        lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        options = (float(dropout_p), softmax_scale, bool(causal), left, right, float(softcap),
                   alibi_slopes)
        out, lse, rng_state = torch_ops.varlen_forward(q, k, v, *lengths, *options,
                                                       bool(deterministic), block_table)
        if return_attn_probs and dropout_p > 0:
            probs = torch_ops.varlen_attn_probs(q.detach(), k.detach(), *lengths, rng_state,
                                                *options)
    else:
        out, lse, probs = _array.forward(q, k, v, dropout_p, softmax_scale, causal,
                                         window_size, softcap, alibi_slopes, cu_seqlens_q,
                                         cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         return_probs=return_attn_probs,
                                         block_table=block_table)
    return (out, lse, probs) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None, v_descale=None):
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs,
                  (q_descale, k_descale, v_descale))


flash_attn_func.__doc__ = f"""Exact attention, dense batch.

    Multi-query and grouped-query attention (MQA/GQA) by passing k, v with fewer heads than q:
    nheads must be a multiple of nheads_k, and query head h reads key/value head
    h // (nheads // nheads_k). E.g. with 6 query heads and 2 key/value heads, query heads
    0, 1, 2 read head 0 and query heads 3, 4, 5 read head 1.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v)
            Only the last dimension needs unit stride; any other strides are used as given.
            fp16/bf16 on CUDA; fp32/fp16/bf16 on the CPU. headdim: any from 1 to 256.
{_COMMON_ARGS}

{_MASKS}

{_RETURNS.format(out_shape="(batch_size, seqlen_q, nheads, headdim_v)",
                 lse_shape="(batch_size, nheads, seqlen_q)",
                 s_shape="(batch_size, nheads, seqlen_q, seqlen_k)")}
    """


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    return _dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


flash_attn_qkvpacked_func.__doc__ = f"""Exact attention with q, k, v packed in one tensor.

    q, k and v are strided views of qkv (qkv[:, :, 0], [:, :, 1], [:, :, 2]): nothing is copied,
    and the gradient comes back as one (batch_size, seqlen, 3, nheads, headdim) tensor.
    For GQA/MQA use flash_attn_kvpacked_func or flash_attn_func.

    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim)
{_COMMON_ARGS}

{_MASKS}

{_RETURNS.format(out_shape="(batch_size, seqlen, nheads, headdim)",
                 lse_shape="(batch_size, nheads, seqlen)",
                 s_shape="(batch_size, nheads, seqlen, seqlen)")}
    """


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    return _dense(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


flash_attn_kvpacked_func.__doc__ = f"""Exact attention with k and v packed in one tensor.

    k and v are strided views of kv (kv[:, :, 0], kv[:, :, 1]): nothing is copied. GQA/MQA:
    nheads must be a multiple of nheads_k (see flash_attn_func).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim)
{_COMMON_ARGS}

{_MASKS}

{_RETURNS.format(out_shape="(batch_size, seqlen_q, nheads, headdim)",
                 lse_shape="(batch_size, nheads, seqlen_q)",
                 s_shape="(batch_size, nheads, seqlen_q, seqlen_k)")}
    """


_VARLEN_NOTE = """\
    Ragged batch: the sequences are concatenated along the first dimension; sequence b holds
    rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. The masks apply within each sequence, with
    that sequence's own seqlen_q and seqlen_k (so causal is bottom-right aligned per
    sequence). Empty sequences are allowed."""


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           q_descale=None, k_descale=None, v_descale=None):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table, (q_descale, k_descale, v_descale))


flash_attn_varlen_func.__doc__ = f"""Exact attention over a ragged batch.

{_VARLEN_NOTE}

    Arguments:
        q: (total_q, nheads, headdim), total_q = the total number of queries in the batch.
        k: (total_k, nheads_k, headdim), total_k = the total number of keys in the batch;
            with block_table, (num_blocks, page_block_size, nheads_k, headdim).
        v: (total_k, nheads_k, headdim_v); with block_table, like k.
        cu_seqlens_q: (batch_size + 1,), int32. Prefix sums of the query lengths, from 0.
        cu_seqlens_k: (batch_size + 1,), int32. Prefix sums of the key lengths, from 0.
        max_seqlen_q: int. The longest query sequence.
        max_seqlen_k: int. The longest key sequence.
{_COMMON_ARGS}
        block_table: (batch_size, max_num_blocks_per_seq), int32, optional: paged keys and
            values. Key position p of sequence b lives in block block_table[b, p //
            page_block_size], row p % page_block_size (any page_block_size >= 1); sequence
            b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions of its
            blocks. Forward only: the call runs whether or not the inputs require grad, and a
            backward through its output raises NotImplementedError.

{_MASKS}

{_RETURNS.format(out_shape="(total_q, nheads, headdim_v)", lse_shape="(nheads, total_q)",
                 s_shape="(batch_size, nheads, max_seqlen_q, max_seqlen_k)")}
    """


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                   max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, None)


flash_attn_varlen_qkvpacked_func.__doc__ = f"""Exact attention over a ragged batch, q, k, v
    packed in one tensor (strided views, never copied).

{_VARLEN_NOTE}

    Arguments:
        qkv: (total, 3, nheads, headdim), total = the total number of tokens in the batch.
        cu_seqlens: (batch_size + 1,), int32. Prefix sums of the sequence lengths, from 0.
        max_seqlen: int. The longest sequence.
{_COMMON_ARGS}

{_MASKS}

{_RETURNS.format(out_shape="(total, nheads, headdim)", lse_shape="(nheads, total)",
                 s_shape="(batch_size, nheads, max_seqlen, max_seqlen)")}
    """


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, None)


flash_attn_varlen_kvpacked_func.__doc__ = f"""Exact attention over a ragged batch, k and v
    packed in one tensor (strided views, never copied).

{_VARLEN_NOTE}

    Arguments:
        q: (total_q, nheads, headdim)
        kv: (total_k, 2, nheads_k, headdim)
        cu_seqlens_q: (batch_size + 1,), int32. Prefix sums of the query lengths, from 0.
        cu_seqlens_k: (batch_size + 1,), int32. Prefix sums of the key lengths, from 0.
        max_seqlen_q: int. The longest query sequence.
        max_seqlen_k: int. The longest key sequence.
{_COMMON_ARGS}

{_MASKS}

{_RETURNS.format(out_shape="(total_q, nheads, headdim)", lse_shape="(nheads, total_q)",
                 s_shape="(batch_size, nheads, max_seqlen_q, max_seqlen_k)")}
    """


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, k_descale=None, v_descale=None):
    left, right = _window(window_size)
    if _is_torch(q):
        from . import torch_ops

        seqlens = torch_ops.cache_seqlens_tensor(cache_seqlens, q, k_cache, k, block_table)
        out, lse = torch_ops.forward_kvcache(q, k_cache, v_cache, seqlens, k, v, rotary_cos,
                                             rotary_sin, bool(rotary_interleaved),
                                             cache_batch_idx, cache_leftpad, block_table,
                                             softmax_scale, bool(causal), left, right,
                                             float(softcap), alibi_slopes, int(num_splits),
                                             k_descale, v_descale,
                                             want_lse=bool(return_softmax_lse))
    else:
        if k_descale is not None or v_descale is not None:
            raise TypeError("k_descale: expected torch tensors for fp8 caches (the NumPy path "
                            "takes no fp8), given a descale with a NumPy q")
        out, lse = _array.forward_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                          cache_seqlens, cache_batch_idx, cache_leftpad,
                                          block_table, softmax_scale, causal, (left, right),
                                          softcap, rotary_interleaved, alibi_slopes, num_splits)
    return (out, lse) if return_softmax_lse else out


flash_attn_with_kvcache.__doc__ = f"""Attention of new queries to a key/value cache (inference:
    decoding and chunked prefill), appending new keys and values to the cache first.

    When k and v are given they are written into k_cache and v_cache *in place*, at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b (rotated first when
    rotary_cos/rotary_sin are given), and q then attends to the updated cache: sequence b's
    keys are its positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1, and q's rows
    are the last seqlen_q of them, so causal and window masks are aligned to the bottom-right
    corner as in flash_attn_func. The caller keeps track of the lengths (pass
    cache_seqlens + seqlen_new at the next step) and allocates caches large enough for the
    appended rows. Inference only: there is no backward.

    Rotary embedding (when rotary_cos and rotary_sin are given): k is rotated at its cache
    positions cache_seqlens[b] + t. q is rotated at positions cache_seqlens[b] + t when causal
    or windowed, and at cache_seqlens[b] for every row otherwise (all of q then counts as one
    position). Only the first rotary_dim = 2 * rotary_cos.shape[1] features are rotated.

    GQA/MQA: nheads must be a multiple of nheads_k; query head h reads key/value head
    h // (nheads // nheads_k).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) without block_table;
            (num_blocks, page_block_size, nheads_k, headdim) with block_table (a paged cache;
            any page_block_size >= 1). Its last dimension must have unit stride (it is written
            in place, so it is never copied).
        v_cache: the same shape as k_cache.
        k: (batch_size, seqlen_new, nheads_k, headdim), optional: appended to k_cache.
        v: (batch_size, seqlen_new, nheads_k, headdim), optional: appended to v_cache. k and v
            are given together or not at all.
        rotary_cos: (seqlen_rotary, rotary_dim / 2), q's dtype, optional. rotary_dim is even
            and at most headdim; seqlen_rotary covers every rotated position.
        rotary_sin: (seqlen_rotary, rotary_dim / 2), like rotary_cos.
        cache_seqlens: int, or (batch_size,) int32: the positions of each sequence already in
            the cache (cache_leftpad included). An int applies to every sequence. None: every
            sequence fills the whole cache (only without k and v).
        cache_batch_idx: (batch_size,) int32, optional: the cache row of sequence b (dense
            cache only). Default: row b. Rows that repeat with k and v given make the written
            values those of one of the duplicates.
        cache_leftpad: (batch_size,) int32, optional: the first cache position of sequence b
            (left padding). Default: 0.
        block_table: (batch_size, max_num_blocks_per_seq) int32, optional: position p of
            sequence b lives in block block_table[b, p // page_block_size], row
            p % page_block_size.
        softmax_scale: float. The scaling of QK^T before the softmax. Default 1 / sqrt(headdim).
        causal: bool. Whether to apply the causal mask (bottom-right aligned; see below).
        window_size: (left, right). Sliding-window local attention when not (-1, -1).
        softcap: float. Anything > 0 activates softcapping.
        rotary_interleaved: bool. True: rotate the feature pairs (0, 1), (2, 3), ...; False:
            rotate (i, i + rotary_dim / 2) (GPT-NeoX style).
        alibi_slopes: (nheads,) or (batch_size, nheads), fp32. A bias of
            -alibi_slope * |i + seqlen_k - seqlen_q - j| is added to the score of query i and
            key j (seqlen_k and j counted from the sequence's first position).
        num_splits: int. 0: choose automatically; 1: one pass over the keys; n > 1: split the
            keys into n chunks whose partial results are merged exactly. The result is the
            same up to rounding whatever the choice.
        return_softmax_lse: bool. Also return the log-sum-exp.
        k_descale, v_descale: keyword only, for torch.float8_e4m3fn caches (q stays fp16,
            bf16 or fp32, and so does out): (batch_size, nheads_k) fp32, contiguous, each
            optional (None: 1); a stored value x stands for x * descale[b, h // (nheads //
            nheads_k)]. Appended k and v are stored as e4m3(x / descale) (k after rotary,
            rounded to q's dtype), saturating at +-448. The CPU backend only, so far.

    Tensors: PyTorch tensors (CPU or CUDA, the call on the current stream; also under
    torch.no_grad, torch.inference_mode, CUDA-graph capture and torch.compile, where it is one
    node that updates the caches in place) or NumPy/DLPack arrays (the caches are updated
    through the same memory). fp16/bf16 on CUDA; fp32/fp16/bf16 on the CPU.

{_MASKS}

    Return:
        out: (batch_size, seqlen_q, nheads, headdim).
        softmax_lse [optional, if return_softmax_lse=True]: (batch_size, nheads, seqlen_q),
            fp32. The log-sum-exp (natural log) of each row of the scaled, masked scores.
    """
