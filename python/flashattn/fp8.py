"""Quantisation of attention inputs to FP8 e4m3 for the FP8 forward (docs/SPEC.md, "FP8 inputs").

``quantize_fp8(x)`` turns a (batch, seqlen, nheads, headdim) bf16/fp16/fp32 tensor into
``torch.float8_e4m3fn`` values and the fp32 descales that ``flash_attn_func(...,
q_descale=..., k_descale=..., v_descale=...)`` takes, so that ``x8.float() * descale`` (the
descale broadcast over its rows and heads) is x within e4m3's rounding:

- per (batch, key/value head): descale (batch, nheads_k), FlashAttention-3's interface;
- per block (``block_scaling=True``): descale (batch, nheads_k, ceil(seqlen / 128)), one factor
  per block of ``FP8_SCALE_BLOCK_ROWS`` rows, which keeps a block of small values apart from an
  outlier elsewhere in the sequence.

Each factor is amax / 448 over the values it covers (the heads of a GQA group share one: pass
``num_heads_k`` for q), so the largest of them maps to e4m3's largest finite value 448 and
nothing saturates. ``hadamard=True`` first rotates the head dim by a random-sign Hadamard
matrix (incoherent processing, from the FlashAttention-3 paper): an orthogonal R with
(q R)(k R)^T = q k^T, which spreads an outlier over every column, so that fewer values sit
far below their factor. Rotate q and k with the same ``seed`` (never v: P V would come out
rotated). The head dim must be a power of two; for other head dims zero-pad q and k to the next
power of two first (zero columns add nothing to q k^T) and pass the padded tensors, with
softmax_scale set for the original head dim.

``seqlen_major(v8)`` stores quantised values (d, seqlen)-major, the layout the Hopper kernel
reads without transposing them.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C

# The rows of a sequence that share one factor of a block-scaled descale.
FP8_SCALE_BLOCK_ROWS = _C.FP8_SCALE_BLOCK_ROWS
# e4m3's largest finite value (float8_e4m3fn: S.1111.110).
FP8_E4M3_MAX = 448.0


def hadamard_rotation(head_dim: int, seed: int, device=None) -> Tensor:
    """The orthogonal (head_dim, head_dim) fp32 matrix R = diag(s) H / sqrt(head_dim) that
    quantize_fp8(..., hadamard=True, seed=seed) applies as x @ R: H the Sylvester Hadamard
    matrix, s random signs drawn from `seed` (torch's CPU generator, so the same on every
    device)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"hadamard: expected a head dim that is a power of two, given "
                         f"{head_dim} (zero-pad q and k to the next power of two)")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.int64) * 2 - 1
    rotation = signs.to(torch.float64)[:, None] * h / head_dim ** 0.5
    return rotation.to(device=device, dtype=torch.float32)


def quantize_fp8(x: Tensor, *, num_heads_k: Optional[int] = None, block_scaling: bool = False,
                 hadamard: bool = False, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """(x8, descale): x (batch, seqlen, nheads, headdim) in e4m3 and its fp32 descale, (batch,
    num_heads_k) or, with block_scaling, (batch, num_heads_k, ceil(seqlen / 128)).

    num_heads_k: the key/value heads of the call (default nheads): query heads h of one group
    (h // (nheads // num_heads_k)) share a factor, as the forward's q_descale has one per
    key/value head. hadamard: rotate the head dim first (module docstring), with `seed`.
    """
    if x.dim() != 4:
        raise ValueError(f"x: expected 4 dimensions (batch, seqlen, nheads, headdim), given "
                         f"{x.dim()} (shape {tuple(x.shape)})")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected dtype float32, float16 or bfloat16, given {x.dtype}")
    batch, seqlen, nheads, head_dim = x.shape
    heads_k = nheads if num_heads_k is None else int(num_heads_k)
    if heads_k < 1 or nheads % heads_k:
        raise ValueError(f"num_heads_k: expected a divisor of nheads = {nheads}, given {heads_k}")
    xf = x.float()
    if hadamard:
        xf = xf @ hadamard_rotation(head_dim, seed, x.device)
    group = nheads // heads_k
    rows = FP8_SCALE_BLOCK_ROWS if block_scaling else max(seqlen, 1)
    blocks = -(-seqlen // rows)
    # (batch, blocks, rows, heads_k, group, headdim), the last block zero-padded: the amax of
    # every (batch, block, kv head).
    padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, blocks * rows - seqlen))
    grouped = padded.view(batch, blocks, rows, heads_k, group, head_dim)
    amax = grouped.abs().amax(dim=(2, 4, 5))  # (batch, blocks, heads_k)
    # An all-zero block quantises to zeros with any factor; 1 keeps the division finite.
    descale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scaled = grouped / descale[:, :, None, :, None, None]
    x8 = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    x8 = x8.view(batch, blocks * rows, nheads, head_dim)[:, :seqlen].contiguous()
    descale = descale.transpose(1, 2).contiguous()  # (batch, heads_k, blocks)
    return x8, (descale if block_scaling else descale[:, :, 0].contiguous())


def dequantize_fp8(x8: Tensor, descale: Tensor) -> Tensor:
    """x8 (batch, seqlen, nheads, headdim) e4m3 times its descale, in fp32: the values the FP8
    forward computes with (exactly, up to the product's rounding)."""
    batch, seqlen, nheads, _ = x8.shape
    heads_k = descale.shape[1]
    if descale.dim() == 3:  # per block of FP8_SCALE_BLOCK_ROWS rows
        per_row = descale.repeat_interleave(FP8_SCALE_BLOCK_ROWS, dim=2)[:, :, :seqlen]
    else:
        per_row = descale[:, :, None].expand(batch, heads_k, seqlen)
    per_row = per_row.repeat_interleave(nheads // heads_k, dim=1)  # (batch, nheads, seqlen)
    return x8.float() * per_row.transpose(1, 2)[..., None]


def seqlen_major(v: Tensor) -> Tensor:
    """v (batch, seqlen, nheads, headdim) or varlen (total, nheads, headdim) with the same sizes
    but stored (d, seqlen)-major: each head-dim column of a head one contiguous run of the rows,
    padded to a multiple of 16 (so that every column starts at 16 bytes, as the CUDA kernel
    needs). Pass it as the fp8 forward's v: the Hopper kernel then loads it as the P V
    product's operand instead of transposing each block (docs/SPEC.md, "FP8 inputs"; dense
    calls on CUDA). One copy of v; the view keeps its storage alive."""
    if v.dim() not in (3, 4):
        raise ValueError(f"v: expected 3 or 4 dimensions ((total, nheads, headdim) or (batch, seqlen, "
                         f"nheads, headdim)), given {v.dim()}")
    rows = v.shape[-3]
    padded = -(-rows // 16) * 16
    storage = v.new_zeros(v.shape[:-3] + (v.shape[-2], v.shape[-1], padded))
    storage[..., :rows] = v.movedim(-3, -1)
    return storage[..., :rows].movedim(-1, -3)

