"""Upstream's module path: `from flash_attn.flash_attn_interface import flash_attn_func` ports as
`from flashattn.flash_attn_interface import flash_attn_func`."""
from .interface import _dropout, _window
from .interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)


def _get_block_size_n(device, head_dim, is_dropout, causal):
    """The key-block width upstream's tests normalise S_dmask with (their
    normalize_flash_attn_S scales block j of the keys by exp(m_j - lse), m_j the max of the
    scores over blocks j..last, because FlashAttention 2's kernel writes each probability
    relative to the running max of its backwards walk over the key blocks). flashattn's
    S_dmask is relative to the max over all of a row's keys (docs/SPEC.md, "Attention
    probabilities"), which is that rule with a single block: so the block covers every key
    (keys per sequence are fewer than 2^31), whatever the device, head dim, dropout or mask."""
    del device, head_dim, is_dropout, causal  # one block for every call
    return 2**31


# Upstream's internal entry points, which libraries (ring attention, context parallelism)
# import from this module and call inside their own autograd functions. Same names, argument
# order and results as upstream FlashAttention 2's; no autograd of their own, PyTorch only.
# Differences: rng_state lives on the CPU; softmax_d is (B, H, Sq) / (H, total_q), not padded
# to a multiple of 128 rows; S_dmask comes back only with dropout (None otherwise);
# leftpad_k is not supported (NotImplementedError); num_splits 0 or 1 (the varlen forward does
# not split keys: both give the same bits), above 1 refused as upstream refuses it.

def _rng_or_zeros(rng_state, dropout_p):
    import torch
    if rng_state is None:
        if dropout_p > 0:
            raise ValueError("rng_state: expected the forward's rng_state with dropout_p > 0, "
                             "given None")
        return torch.zeros(2, dtype=torch.int64)
    return rng_state


def _softmax_d(dout, out, varlen):
    """rowsum(dout * out) in fp32: (B, H, Sq), or (H, total_q) for varlen."""
    d = (dout.float() * out.float()).sum(-1)
    return (d.t() if varlen else d.transpose(1, 2)).contiguous()


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """out, softmax_lse (B, H, Sq) fp32, S_dmask (with return_softmax and dropout) or None,
    rng_state (2,) int64."""
    import torch
    from . import torch_ops
    dropout_p = _dropout(dropout_p)
    left, right = _window((window_size_left, window_size_right))
    options = (dropout_p, softmax_scale, bool(causal), left, right, float(softcap), alibi_slopes)
    with torch.no_grad():
        out, lse, rng_state = torch_ops.fwd(q, k, v, *options, False)
        probs = (torch_ops.attn_probs(q, k, rng_state, *options)
                 if return_softmax and dropout_p > 0 else None)
    return out, lse, probs, rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """out (total_q, H, Dv), softmax_lse (H, total_q) fp32, S_dmask or None, rng_state.
    seqused_k (B,) int32: sequence b's keys are its first seqused_k[b]; with block_table, k and
    v are paged (num_pages, page_size, Hk, D)."""
    import torch
    from . import torch_ops
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k: expected None (not supported by the varlen "
                                  "forward; flash_attn_with_kvcache takes cache_leftpad), given "
                                  "a tensor")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0, given {num_splits!r}")
    if num_splits > 1:  # NotImplementedError is a RuntimeError, which upstream raises
        raise NotImplementedError(f"num_splits: expected 0 or 1 (num_splits > 1 is not supported "
                                  f"by the varlen forward, as upstream), given {num_splits}")
    dropout_p = _dropout(dropout_p)
    left, right = _window((window_size_left, window_size_right))
    options = (dropout_p, softmax_scale, bool(causal), left, right, float(softcap), alibi_slopes)
    lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    probs = None
    with torch.no_grad():
        out, lse, rng_state = torch_ops.varlen_fwd_seqused(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q), int(max_seqlen_k),
            *options, block_table)
        if return_softmax and dropout_p > 0:
            if block_table is not None or seqused_k is not None:
                raise ValueError("return_softmax: expected False with block_table or seqused_k "
                                 "and dropout_p > 0 (the probabilities are computed for whole, "
                                 "unpaged key sequences only), given True")
            probs = torch_ops.varlen_attn_probs(q, k, *lengths, rng_state, *options)
        if zero_tensors:  # rows past the last sequence: zeros and lse -inf, as upstream
            end = int(cu_seqlens_q[-1])
            out[end:] = 0
            lse[:, end:] = float("-inf")
    return out, lse, probs, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None):
    """Writes dq, dk, dv (the shapes and dtypes of q, k, v; None: not kept) and returns
    softmax_d = rowsum(dout * out), (B, H, Sq) fp32."""
    import torch
    from . import torch_ops
    dropout_p = _dropout(dropout_p)
    left, right = _window((window_size_left, window_size_right))
    dq, dk, dv = (torch.empty_like(t) if g is None else g for g, t in ((dq, q), (dk, k), (dv, v)))
    with torch.no_grad():
        torch_ops.bwd_into(dout, q, k, v, out, softmax_lse, dq, dk, dv,
                           _rng_or_zeros(rng_state, dropout_p), dropout_p, softmax_scale,
                           bool(causal), left, right, float(softcap), alibi_slopes,
                           bool(deterministic))
        return _softmax_d(dout, out, varlen=False)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """As _flash_attn_backward over a ragged batch; softmax_d (H, total_q) fp32."""
    import torch
    from . import torch_ops
    dropout_p = _dropout(dropout_p)
    left, right = _window((window_size_left, window_size_right))
    dq, dk, dv = (torch.empty_like(t) if g is None else g for g, t in ((dq, q), (dk, k), (dv, v)))
    with torch.no_grad():
        torch_ops.varlen_bwd_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                  cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                  _rng_or_zeros(rng_state, dropout_p), dropout_p, softmax_scale,
                                  bool(causal), left, right, float(softcap), alibi_slopes,
                                  bool(deterministic))
        if zero_tensors:  # rows past the last sequence, which the call does not write
            dq[int(cu_seqlens_q[-1]):] = 0
            dk[int(cu_seqlens_k[-1]):] = 0
            dv[int(cu_seqlens_k[-1]):] = 0
        return _softmax_d(dout, out, varlen=True)
