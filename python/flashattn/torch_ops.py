"""PyTorch integration: custom ops (torch.library) with fake implementations and autograd.

Five ops, ``flashattn::fwd``, ``flashattn::bwd``, ``flashattn::varlen_fwd``,
``flashattn::varlen_bwd`` and ``flashattn::fwd_kvcache``, each a thin call into the C ABI with
outputs allocated by torch on the input's device (so the caching allocator and CUDA-graph
capture see every allocation; the library allocates nothing on the GPU for the forward). The
forward ops have autograd registered on them, so ``torch.compile(fullgraph=True)`` traces them
as single nodes, forward and backward, with no graph break.

``flashattn::fwd_kvcache`` is inference only: it declares ``mutates_args=("k_cache",
"v_cache")`` (the new keys and values are written into the caches in place), so eager mode,
``torch.no_grad`` and ``torch.inference_mode`` see an in-place op, and ``torch.compile``
traces it as one node that it functionalises and re-inplaces (the caches are updated in
place, not copied, when they are graph inputs or module buffers). It has no autograd formula:
its outputs carry no gradient to q, and a backward through them raises.

Dropout: the forward op draws a seed from torch's default (CPU) generator, so
``torch.manual_seed`` governs it, and returns it as ``rng_state = [seed, offset]`` (int64,
CPU), which the backward replays: forward and backward drop the same elements (Philox4x32-10,
a pure function of seed, offset and the element's coordinates, the same on both backends).
Both backends have dropout in the forward and the backward. The seed is drawn on the host when the op runs, so a CUDA graph captures one seed: every replay of
that graph drops the same elements.

Eager calls skip the op's dispatch: a call on plain tensors, outside torch.compile's tracing,
dispatch and function modes and functorch transforms, runs the op's implementation directly
(through ``torch.autograd.Function`` when a gradient is wanted; the kv-cache's version counters
bumped as the op would). That keeps the per-call cost at SDPA's; anything that needs the op
(tracing, FakeTensor, FlopCounterMode, vmap, ...) gets the op, with the same implementation.

``flashattn::attn_probs`` and ``flashattn::varlen_attn_probs`` materialise upstream's S_dmask
for ``return_attn_probs=True`` with dropout (a testing aid: O(B H Sq Sk) memory), from the
forward's rng_state so that their mask is the forward's.

Tensors reach the library as raw descriptors (pointer, dtype, device, sizes, strides): no
DLPack round trip and no stream synchronisation, so a call on the current CUDA stream is
capturable. Only the last dimension needs unit stride; other strides pass through, so packed
qkv/kv views are never copied.
"""
import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C

# The C ABI's codes come from the extension (flashattn.h's enums), never written here.
_DTYPES = {torch.float32: _C.DTYPE_FLOAT32, torch.float16: _C.DTYPE_FLOAT16,
           torch.bfloat16: _C.DTYPE_BFLOAT16, torch.int32: _C.DTYPE_INT32,
           torch.float8_e4m3fn: _C.DTYPE_FLOAT8_E4M3}


def _desc(t: Optional[Tensor], name: str):
    """The raw descriptor _C takes: (data_ptr, fa_dtype, fa_device_type, index, sizes, strides)."""
    if t is None:
        return None
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16 (float8_e4m3fn "
                        f"for an fp8 forward, int32 for sequence offsets), given {t.dtype}")
    if t.is_cuda:
        return (t.data_ptr(), dtype, _C.DEVICE_CUDA, t.get_device(), t.shape, t.stride())
    if t.is_cpu:
        return (t.data_ptr(), dtype, _C.DEVICE_CPU, 0, t.shape, t.stride())
    raise TypeError(f"{name}: expected a CPU or CUDA tensor, given device {t.device}")


# The raw handle of a device's current stream, without building a torch.cuda.Stream (a few
# microseconds a call); the public spelling where this private one is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _execution(t: Tensor) -> dict:
    # The library makes the tensors' GPU current for the call itself (cuda/common/per_device.hpp),
    # so no device guard is needed here; the stream is that GPU's current one. A torch tensor's
    # device is where its memory lives, so the library's per-pointer check (a CUDA query of
    # about 1 us per tensor) is skipped: trust_devices.
    if not t.is_cuda:
        return {"trust_devices": True}
    stream = (_raw_stream(t.get_device()) if _raw_stream is not None
              else torch.cuda.current_stream(t.device).cuda_stream)
    return {"stream": stream, "trust_devices": True}


def _contiguous_last(t: Optional[Tensor]) -> Optional[Tensor]:
    """The library needs unit stride in the last dimension only (and no zero strides in
    gradients that autograd expands from a scalar)."""
    if t is None:
        return None
    if t.stride(-1) != 1 or 0 in t.stride():
        return t.contiguous()
    return t


def _fp8_values(v: Tensor, block_table: Optional[Tensor] = None) -> Tensor:
    """fp8 v as the library takes it: with a contiguous last dimension, or (d, seqlen)-major
    as given (its sequence dimension contiguous; dense or varlen, not paged), uncopied."""
    seqlen_dim = v.dim() - 3
    if block_table is None and v.stride(seqlen_dim) == 1 and 0 not in v.stride():
        return v
    return _contiguous_last(v)


def _new_out(q: Tensor, head_dim_v: int) -> Tensor:
    """out: q's shape with head dim head_dim_v, contiguous (empty_like where that is q's
    shape: a third less host time than new_empty)."""
    if q.shape[-1] == head_dim_v:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return q.new_empty(q.shape[:-1] + (head_dim_v,))


def _check_dim(t: Tensor, name: str, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {layout}, given {t.dim()} "
                         f"(shape {tuple(t.shape)})")


def _draw_rng_state(dropout_p: float) -> Tensor:
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        return torch.cat([seed, torch.zeros(1, dtype=torch.int64)])
    return torch.zeros(2, dtype=torch.int64)


def _rng_args(dropout_p: float, rng_state: Tensor) -> dict:
    if dropout_p > 0.0:
        seed, offset = rng_state.tolist()
        return {"dropout_p": dropout_p, "seed": seed, "offset": offset}
    return {}


def _options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
             deterministic, positions=None) -> dict:
    """positions: None, or (query, key), the tokens of the call's first query row and first key
    in a longer self-attention (Options::positions: ALiBi and dropout of the whole sequence;
    ring attention's chunk calls pass them)."""
    return {
        "positions": positions,
        "softmax_scale": softmax_scale,
        "causal": causal,
        "window_left": window_left,
        "window_right": window_right,
        "softcap": softcap,
        "alibi_slopes": _desc(alibi_slopes, "alibi_slopes"),
        "deterministic": deterministic,
    }


def _plain_eager(*tensors: Optional[Tensor]) -> bool:
    """Whether a call can run its op's implementation directly (module docstring): eager, on
    plain tensors, with nothing that has to see the op (tracing, a dispatch or function mode,
    a functorch transform)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()):
        return False
    for t in tensors:  # other arguments (None, numbers) pass
        if type(t) not in _PLAIN_TYPES and isinstance(t, Tensor):
            return False
    return True


# What _plain_eager passes without an isinstance call: plain tensors and the other arguments.
_PLAIN_TYPES = frozenset((Tensor, torch.nn.Parameter, type(None), bool, int, float))


def _wants_grad(*tensors: Optional[Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any(generator): this runs on every eager call
        if t is not None and t.requires_grad:
            return True
    return False


# ---------------------------------------------------------------------------- dense

def _fwd_impl(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
              alibi_slopes, deterministic, rng_state, want_lse=True, positions=None):
    _check_dim(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    _check_dim(v, "v", 4, "(batch, seqlen_k, nheads_k, headdim_v)")
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    batch, seqlen_q, nheads, _ = q.shape
    out = _new_out(q, v.shape[-1])
    # Without a gradient or a caller that reads it, the library skips the lse: no allocation.
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32) if want_lse else None
    _C.forward(_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(out, "out"),
               _desc(lse, "lse"),
               **_options(softmax_scale, causal, window_left, window_right, softcap,
                          alibi_slopes, deterministic, positions),
               **_rng_args(dropout_p, rng_state), **_execution(q))
    return out, lse


def _bwd_impl(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale, causal,
              window_left, window_right, softcap, alibi_slopes, deterministic, grads=None,
              positions=None):
    """dq, dk, dv: new tensors, or written into `grads` (dq, dk, dv) when given."""
    dout, q, k, v, out = (_contiguous_last(t) for t in (dout, q, k, v, out))
    # empty_like: a third of torch.empty(shape, dtype=, device=)'s host time.
    dq, dk, dv = grads if grads is not None else (
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    _C.backward(_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(out, "out"),
                _desc(dout, "dout"), _desc(lse, "lse"), _desc(dq, "dq"), _desc(dk, "dk"),
                _desc(dv, "dv"),
                **_options(softmax_scale, causal, window_left, window_right, softcap,
                           alibi_slopes, deterministic, positions),
                **_rng_args(dropout_p, rng_state), **_execution(q))
    return dq, dk, dv


@torch.library.custom_op("flashattn::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: Optional[float],
        causal: bool, window_left: int, window_right: int, softcap: float,
        alibi_slopes: Optional[Tensor], deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """out (B, Sq, H, Dv), lse (B, H, Sq) fp32, rng_state (2,) int64 on the CPU."""
    rng_state = _draw_rng_state(dropout_p)
    out, lse = _fwd_impl(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right,
                         softcap, alibi_slopes, deterministic, rng_state)
    return out, lse, rng_state


@fwd.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
      alibi_slopes, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v.shape[-1]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("flashattn::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        rng_state: Tensor, dropout_p: float, softmax_scale: Optional[float], causal: bool,
        window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv with the shapes and dtypes of q, k, v (contiguous)."""
    return _bwd_impl(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, deterministic)


@bwd.register_fake
def _(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes, deterministic):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
     alibi_slopes, deterministic) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes)
    ctx.args = (dropout_p, softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = deterministic


def _fwd_backward(ctx, dout, dlse, drng_state):
    q, k, v, out, lse, rng_state, alibi_slopes = ctx.saved_tensors
    (dropout_p, softmax_scale, causal, window_left, window_right, softcap) = ctx.args
    dq, dk, dv = bwd(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale, causal,
                     window_left, window_right, softcap, alibi_slopes, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 8


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path's autograd for forward() and varlen_forward(): `impls` is the pair of
    implementations (forward, backward) and `extra` the tensors and ints between the inputs
    and the options (cu_seqlens and max_seqlen for varlen, empty for dense)."""

    @staticmethod
    def forward(ctx, impls, q, k, v, extra, rng_state, dropout_p, softmax_scale, causal,
                window_left, window_right, softcap, alibi_slopes, deterministic):
        out, lse = impls[0](q, k, v, *extra, dropout_p, softmax_scale, causal, window_left,
                            window_right, softcap, alibi_slopes, deterministic, rng_state)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.impls, ctx.extra, ctx.rng_state = impls, extra, rng_state
        ctx.args = (dropout_p, softmax_scale, causal, window_left, window_right, softcap)
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        # No zero-filled gradient for lse (a kernel and an allocation per backward): the
        # backward reads dout alone, and a dout that is None means a zero gradient.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 14
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        dq, dk, dv = ctx.impls[1](dout, q, k, v, out, lse, *ctx.extra, ctx.rng_state,
                                  *ctx.args, alibi_slopes, ctx.deterministic)
        return (None, dq, dk, dv) + (None,) * 10


def forward(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
            alibi_slopes, deterministic, want_lse=True) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """out, lse, rng_state (None without dropout on the eager path) of flash_attn_func: the op,
    or its implementation when the call is plainly eager (module docstring). want_lse=False:
    the caller does not read lse, which the eager path then leaves out (None) unless autograd
    needs it."""
    if not _plain_eager(q, k, v, alibi_slopes):
        return fwd(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right,
                   softcap, alibi_slopes, deterministic)
    rng_state = _draw_rng_state(dropout_p) if dropout_p > 0.0 else None
    if _wants_grad(q, k, v):
        out, lse = _EagerAttention.apply((_fwd_impl, _bwd_impl), q, k, v, (), rng_state,
                                         dropout_p, softmax_scale, causal, window_left,
                                         window_right, softcap, alibi_slopes, deterministic)
    else:
        out, lse = _fwd_impl(q, k, v, dropout_p, softmax_scale, causal, window_left,
                             window_right, softcap, alibi_slopes, deterministic, rng_state,
                             want_lse)
    return out, lse, rng_state


# ---------------------------------------------------------------------------- varlen

def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                     alibi_slopes, deterministic, rng_state, block_table=None, seqused_k=None,
                     positions=None):
    _check_dim(q, "q", 3, "(total_q, nheads, headdim)")
    if block_table is None:
        _check_dim(v, "v", 3, "(total_k, nheads_k, headdim_v)")
    else:
        _check_dim(v, "v", 4, "(num_pages, page_size, nheads_k, headdim_v) with block_table")
    q, k, v, block_table = (_contiguous_last(t) for t in (q, k, v, block_table))
    total_q, nheads, _ = q.shape
    out = q.new_empty((total_q, nheads, v.shape[-1]))
    lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    _C.forward_varlen(_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(out, "out"),
                      _desc(lse, "lse"), _desc(cu_seqlens_q, "cu_seqlens_q"),
                      _desc(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k,
                      seqused_k=_desc(seqused_k, "seqused_k"),
                      block_table=_desc(block_table, "block_table"),
                      **_options(softmax_scale, causal, window_left, window_right, softcap,
                                 alibi_slopes, deterministic, positions),
                      **_rng_args(dropout_p, rng_state), **_execution(q))
    return out, lse


def _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, rng_state, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, alibi_slopes, deterministic, grads=None,
                     seqused_k=None, positions=None):
    dout, q, k, v, out = (_contiguous_last(t) for t in (dout, q, k, v, out))
    dq, dk, dv = grads if grads is not None else (
        torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _C.backward_varlen(_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(out, "out"),
                       _desc(dout, "dout"), _desc(lse, "lse"), _desc(dq, "dq"),
                       _desc(dk, "dk"), _desc(dv, "dv"),
                       _desc(cu_seqlens_q, "cu_seqlens_q"),
                       _desc(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k,
                       seqused_k=_desc(seqused_k, "seqused_k"),
                       **_options(softmax_scale, causal, window_left, window_right,
                                  softcap, alibi_slopes, deterministic, positions),
                       **_rng_args(dropout_p, rng_state), **_execution(q))
    return dq, dk, dv


@torch.library.custom_op("flashattn::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
               softmax_scale: Optional[float], causal: bool, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               deterministic: bool, block_table: Optional[Tensor] = None
               ) -> Tuple[Tensor, Tensor, Tensor]:
    """out (total_q, H, Dv), lse (H, total_q) fp32, rng_state (2,) int64 on the CPU. With
    block_table (B, max_pages) int32, k and v are paged: (num_pages, page_size, Hk, D)."""
    rng_state = _draw_rng_state(dropout_p)
    out, lse = _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                                window_right, softcap, alibi_slopes, deterministic, rng_state,
                                block_table)
    return out, lse, rng_state


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
      block_table=None):
    total_q, nheads, _ = q.shape
    out = q.new_empty((total_q, nheads, v.shape[-1]))
    lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("flashattn::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, rng_state: Tensor, dropout_p: float,
               softmax_scale: Optional[float], causal: bool, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, rng_state, dropout_p, softmax_scale, causal,
                            window_left, window_right, softcap, alibi_slopes, deterministic)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
      alibi_slopes, deterministic):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _varlen_fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
     softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
     deterministic, block_table) = inputs
    out, lse, rng_state = output
    ctx.paged = block_table is not None
    if ctx.paged:  # nothing to save: the backward refuses
        return
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                          alibi_slopes)
    ctx.args = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                window_right, softcap)
    ctx.deterministic = deterministic


def _varlen_fwd_backward(ctx, dout, dlse, drng_state):
    if ctx.paged:
        # Upstream FlashAttention has no paged backward either; the forward runs whether or
        # not its inputs require grad, and a backward through it stops here.
        raise NotImplementedError("block_table: expected None for a backward (paged keys and "
                                  "values are forward only), given a tensor")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, alibi_slopes = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
     softcap) = ctx.args
    dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, rng_state, dropout_p, softmax_scale, causal,
                            window_left, window_right, softcap, alibi_slopes,
                            ctx.deterministic)
    return (dq, dk, dv) + (None,) * 13


varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   deterministic, block_table=None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """out, lse, rng_state of flash_attn_varlen_func: the op, or its implementation when
    plainly eager (as forward()). A paged call that autograd would differentiate takes the op,
    whose backward refuses it (paged keys and values are forward only, as upstream)."""
    paged_grad = block_table is not None and _wants_grad(q, k, v)
    if paged_grad or not _plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                      block_table):
        return varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                          alibi_slopes, deterministic, block_table)
    extra = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    rng_state = _draw_rng_state(dropout_p) if dropout_p > 0.0 else None
    if _wants_grad(q, k, v):
        out, lse = _EagerAttention.apply((_varlen_fwd_impl, _varlen_bwd_impl), q, k, v, extra,
                                         rng_state, dropout_p, softmax_scale, causal,
                                         window_left, window_right, softcap, alibi_slopes,
                                         deterministic)
    else:
        out, lse = _varlen_fwd_impl(q, k, v, *extra, dropout_p, softmax_scale, causal,
                                    window_left, window_right, softcap, alibi_slopes,
                                    deterministic, rng_state, block_table)
    return out, lse, rng_state


# ---------------------------------------------------------------------------- upstream's internals
#
# flash_attn_interface's _flash_attn_forward / _backward and their varlen forms (the calls
# that libraries such as ring attention make inside their own autograd functions) need a
# varlen forward with seqused_k and backwards that write into the caller's gradients. Ops of
# their own so that torch.compile traces them; no autograd, as upstream's.

@torch.library.custom_op("flashattn::varlen_fwd_seqused", mutates_args=())
def varlen_fwd_seqused(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                       cu_seqlens_k: Tensor, seqused_k: Optional[Tensor], max_seqlen_q: int,
                       max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float],
                       causal: bool, window_left: int, window_right: int, softcap: float,
                       alibi_slopes: Optional[Tensor], block_table: Optional[Tensor]
                       ) -> Tuple[Tensor, Tensor, Tensor]:
    """varlen_fwd with seqused_k (B,) int32: sequence b's keys are the first seqused_k[b]."""
    rng_state = _draw_rng_state(dropout_p)
    out, lse = _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal, window_left,
                                window_right, softcap, alibi_slopes, False, rng_state,
                                block_table, seqused_k)
    return out, lse, rng_state


@varlen_fwd_seqused.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, block_table):
    total_q, nheads, _ = q.shape
    out = q.new_empty((total_q, nheads, v.shape[-1]))
    lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("flashattn::bwd_into", mutates_args=("dq", "dk", "dv"))
def bwd_into(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             dq: Tensor, dk: Tensor, dv: Tensor, rng_state: Tensor, dropout_p: float,
             softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
             softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> None:
    """bwd writing into the given dq, dk, dv (the shapes and dtypes of q, k, v)."""
    _bwd_impl(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale, causal,
              window_left, window_right, softcap, alibi_slopes, deterministic, (dq, dk, dv))


@bwd_into.register_fake
def _(dout, q, k, v, out, lse, dq, dk, dv, rng_state, dropout_p, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, deterministic):
    return None


@torch.library.custom_op("flashattn::varlen_bwd_into", mutates_args=("dq", "dk", "dv"))
def varlen_bwd_into(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    dq: Tensor, dk: Tensor, dv: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    rng_state: Tensor, dropout_p: float, softmax_scale: Optional[float],
                    causal: bool, window_left: int, window_right: int, softcap: float,
                    alibi_slopes: Optional[Tensor], deterministic: bool) -> None:
    _varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, rng_state, dropout_p, softmax_scale, causal, window_left,
                     window_right, softcap, alibi_slopes, deterministic, (dq, dk, dv))


@varlen_bwd_into.register_fake
def _(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, rng_state, dropout_p, softmax_scale, causal, window_left, window_right,
      softcap, alibi_slopes, deterministic):
    return None


# ---------------------------------------------------------------------------- probabilities
#
# return_attn_probs with dropout: upstream's S_dmask, a testing aid (docs/SPEC.md, "Attention
# probabilities"). Ops of their own, with fake implementations, so that torch.compile traces
# them as single nodes; they take the rng_state the forward op drew, so their sign bits are
# the mask that forward (and its backward) applied. No autograd: the callers pass detached
# q and k, and the probabilities are not differentiable.

@torch.library.custom_op("flashattn::attn_probs", mutates_args=())
def attn_probs(q: Tensor, k: Tensor, rng_state: Tensor, dropout_p: float,
               softmax_scale: Optional[float], causal: bool, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor]) -> Tensor:
    """(B, H, Sq, Sk) fp32: exp(s - row max) where visible, 0 elsewhere, negated where dropped."""
    q, k = (_contiguous_last(t) for t in (q, k))
    probs = _new_probs(q, q.shape[0], q.shape[1], k.shape[1])
    _C.attention_probabilities(_desc(q, "q"), _desc(k, "k"), _desc(probs, "probs"),
                               **_options(softmax_scale, causal, window_left, window_right,
                                          softcap, alibi_slopes, False),
                               **_rng_args(dropout_p, rng_state), **_execution(q))
    return probs


def _new_probs(q: Tensor, batch, seqlen_q, seqlen_k) -> Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) fp32 on q's device; q is (.., nheads, headdim)."""
    return q.new_empty((batch, q.shape[-2], seqlen_q, seqlen_k), dtype=torch.float32)


@attn_probs.register_fake
def _(q, k, rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
      alibi_slopes):
    return _new_probs(q, q.shape[0], q.shape[1], k.shape[1])


@torch.library.custom_op("flashattn::varlen_attn_probs", mutates_args=())
def varlen_attn_probs(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, rng_state: Tensor,
                      dropout_p: float, softmax_scale: Optional[float], causal: bool,
                      window_left: int, window_right: int, softcap: float,
                      alibi_slopes: Optional[Tensor]) -> Tensor:
    """(B, H, max_seqlen_q, max_seqlen_k) fp32, indexed by the position within each sequence."""
    q, k = (_contiguous_last(t) for t in (q, k))
    probs = _new_probs(q, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)
    _C.attention_probabilities_varlen(
        _desc(q, "q"), _desc(k, "k"), _desc(probs, "probs"),
        _desc(cu_seqlens_q, "cu_seqlens_q"), _desc(cu_seqlens_k, "cu_seqlens_k"),
        max_seqlen_q, max_seqlen_k,
        **_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   False),
        **_rng_args(dropout_p, rng_state), **_execution(q))
    return probs


@varlen_attn_probs.register_fake
def _(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng_state, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
    return _new_probs(q, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k)


# ---------------------------------------------------------------------------- kv cache

def _fwd_kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin,
                      rotary_interleaved, cache_batch_idx, cache_leftpad, block_table,
                      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                      num_splits, k_descale=None, v_descale=None, want_lse=True):
    _check_dim(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    _check_dim(v_cache, "v_cache", 4, "(batch_cache, seqlen_cache, nheads_k, headdim_v) or "
               "(num_blocks, page_block_size, nheads_k, headdim_v)")
    # The caches are written in place, so they are never copied: a cache whose last dimension
    # is strided is the library's error, not a silent copy that the append would miss.
    q, cache_seqlens = _contiguous_last(q), _contiguous_last(cache_seqlens)
    # The optional tensors that are given, by keyword (a decode step passes none of them: each
    # one left out is a conversion and a descriptor less per call).
    given = {name: _desc(_contiguous_last(t), name)
             for name, t in (("k", k), ("v", v), ("rotary_cos", rotary_cos),
                             ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                             ("cache_leftpad", cache_leftpad), ("block_table", block_table),
                             ("k_descale", k_descale), ("v_descale", v_descale))
             if t is not None}
    batch, seqlen_q, nheads, _ = q.shape
    out = _new_out(q, v_cache.shape[-1])
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32) if want_lse else None
    _C.forward_kvcache(
        _desc(q, "q"), _desc(k_cache, "k_cache"), _desc(v_cache, "v_cache"),
        _desc(cache_seqlens, "cache_seqlens"), _desc(out, "out"), _desc(lse, "lse"),
        rotary_interleaved=rotary_interleaved, num_splits=num_splits, **given,
        **_options(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                   False),
        **_execution(q))
    return out, lse


@torch.library.custom_op("flashattn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                k: Optional[Tensor], v: Optional[Tensor], rotary_cos: Optional[Tensor],
                rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                block_table: Optional[Tensor], softmax_scale: Optional[float], causal: bool,
                window_left: int, window_right: int, softcap: float,
                alibi_slopes: Optional[Tensor], num_splits: int, k_descale: Optional[Tensor],
                v_descale: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Appends k/v into k_cache/v_cache in place, then out (B, Sq, H, Dv), lse (B, H, Sq) fp32."""
    return _fwd_kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin,
                             rotary_interleaved, cache_batch_idx, cache_leftpad, block_table,
                             softmax_scale, causal, window_left, window_right, softcap,
                             alibi_slopes, num_splits, k_descale, v_descale)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, rotary_interleaved,
      cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes, num_splits, k_descale, v_descale):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v_cache.shape[-1]))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, lse


def forward_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, *rest,
                    want_lse=True) -> Tuple[Tensor, Optional[Tensor]]:
    """out, lse of flash_attn_with_kvcache: the op, or its implementation when plainly eager
    (rest: fwd_kvcache's arguments after v; want_lse as forward()'s). The op has no autograd
    formula: a call that wants a gradient takes the op, so that it refuses the backward as the
    op does."""
    if not _plain_eager(q, k_cache, v_cache, cache_seqlens, k, v, *rest) or _wants_grad(
            q, k_cache, v_cache, k, v):
        return fwd_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, *rest)
    out, lse = _fwd_kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, *rest,
                                 want_lse=want_lse)
    if k is not None:
        # What the op does for its mutated arguments: autograd sees the caches change.
        torch.autograd.graph.increment_version((k_cache, v_cache))
    return out, lse


def cache_seqlens_tensor(cache_seqlens, q: Tensor, k_cache: Tensor, k: Optional[Tensor],
                         block_table: Optional[Tensor]) -> Tensor:
    """What fwd_kvcache takes: an int (or SymInt) becomes int32 (batch,) on q's device; None
    means every sequence fills the whole cache (nothing may be appended then)."""
    if isinstance(cache_seqlens, Tensor):
        return cache_seqlens
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: expected an int or an int32 (batch,) tensor when k "
                             "and v are appended, given None")
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        cache_seqlens = capacity
    elif not isinstance(cache_seqlens, torch.SymInt):
        try:
            cache_seqlens = operator.index(cache_seqlens)
        except TypeError:
            raise TypeError(f"cache_seqlens: expected an int or an int32 (batch,) tensor, given "
                            f"{type(cache_seqlens).__name__}") from None
    return torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)


# ---------------------------------------------------------------------------- fp8 (e4m3)
# The forward on torch.float8_e4m3fn q, k, v with their fp32 descales (docs/SPEC.md, "FP8
# inputs"): out is bf16. Forward only (no FP8 backward, as in FlashAttention-3), so the ops
# have no autograd formula and no dropout.

def _fp8_out_dtype(q: Tensor) -> torch.dtype:
    """bf16 for fp8 inputs; q's own dtype otherwise (the library then refuses the descales)."""
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype


def _descale_args(q_descale, k_descale, v_descale) -> dict:
    return {"q_descale": _desc(q_descale, "q_descale"), "k_descale": _desc(k_descale, "k_descale"),
            "v_descale": _desc(v_descale, "v_descale")}


@torch.library.custom_op("flashattn::fwd_fp8", mutates_args=())
def fwd_fp8(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor],
            k_descale: Optional[Tensor], v_descale: Optional[Tensor],
            softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
            softcap: float, alibi_slopes: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """out (B, Sq, H, Dv) bf16, lse (B, H, Sq) fp32."""
    _check_dim(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    _check_dim(v, "v", 4, "(batch, seqlen_k, nheads_k, headdim_v)")
    q, k, v = _contiguous_last(q), _contiguous_last(k), _fp8_values(v)
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],), dtype=_fp8_out_dtype(q))
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    _C.forward(_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(out, "out"), _desc(lse, "lse"),
               **_options(softmax_scale, causal, window_left, window_right, softcap,
                          alibi_slopes, False),
               **_descale_args(q_descale, k_descale, v_descale), **_execution(q))
    return out, lse


@fwd_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
      window_right, softcap, alibi_slopes):
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, v.shape[-1]), dtype=_fp8_out_dtype(q))
    return out, q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashattn::varlen_fwd_fp8", mutates_args=())
def varlen_fwd_fp8(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[Tensor],
                   block_table: Optional[Tensor], q_descale: Optional[Tensor],
                   k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                   softmax_scale: Optional[float], causal: bool, window_left: int,
                   window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """out (total_q, H, Dv) bf16, lse (H, total_q) fp32."""
    _check_dim(q, "q", 3, "(total_q, nheads, headdim)")
    v = _fp8_values(v, block_table)
    q, k, block_table = (_contiguous_last(t) for t in (q, k, block_table))
    total_q, nheads, _ = q.shape
    out = q.new_empty((total_q, nheads, v.shape[-1]), dtype=_fp8_out_dtype(q))
    lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    _C.forward_varlen(_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(out, "out"),
                      _desc(lse, "lse"), _desc(cu_seqlens_q, "cu_seqlens_q"),
                      _desc(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k,
                      seqused_k=_desc(seqused_k, "seqused_k"),
                      block_table=_desc(block_table, "block_table"),
                      **_options(softmax_scale, causal, window_left, window_right, softcap,
                                 alibi_slopes, False),
                      **_descale_args(q_descale, k_descale, v_descale), **_execution(q))
    return out, lse


@varlen_fwd_fp8.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
      q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right, softcap,
      alibi_slopes):
    total_q, nheads, _ = q.shape
    out = q.new_empty((total_q, nheads, v.shape[-1]), dtype=_fp8_out_dtype(q))
    return out, q.new_empty((nheads, total_q), dtype=torch.float32)


def _fp8_setup_context(ctx, inputs, output):
    pass


def _fp8_backward(ctx, dout, dlse):
    # As FlashAttention-3: the forward runs whether or not its inputs require grad (fp8 tensors
    # may), and a backward through it stops here.
    raise NotImplementedError("q: expected dtype float32, float16 or bfloat16 for a backward, "
                              "given torch.float8_e4m3fn (fp8 inputs are forward only)")


fwd_fp8.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)
varlen_fwd_fp8.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)
