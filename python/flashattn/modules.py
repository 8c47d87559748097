"""PyTorch modules built on flashattn's functions, for model authors: rotary position
embeddings (``RotaryEmbedding``), multi-head attention with a fused QKV projection, GQA/MQA
and an inference cache (``MHA``), and the cache's bookkeeping (``InferenceParams``).

Importing this module imports torch (the rest of the package never does by itself)::

    from flashattn.modules import MHA, InferenceParams

    mha = MHA(embed_dim=1024, num_heads=16, num_heads_kv=4, causal=True, rotary_emb_dim=64)
    y = mha(x)                                        # training: x (batch, seqlen, 1024)
    y = mha(x, key_padding_mask=mask)                 # padded batch, computed unpadded
    y = mha(x_unpadded, cu_seqlens=cu, max_seqlen=n)  # unpadded batch (total, 1024)

    params = InferenceParams(max_seqlen=4096, max_batch_size=8)
    y = mha(prompt, inference_params=params)          # prefill: the cache is filled
    params.seqlen_offset += prompt.shape[1]
    y = mha(token, inference_params=params)           # one-token steps attend to the cache

Attention runs through ``flash_attn_func`` / ``flash_attn_varlen_func`` in training (with
autograd) and ``flash_attn_with_kvcache`` in inference, on whatever device the tensors are on.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., S, H, D) rotated on its first 2 * cos.shape[-1] features; cos and sin (..., S,
    rotary_dim / 2), broadcast over the heads. The same rotation as flash_attn_with_kvcache's:
    interleaved pairs (0, 1), (2, 3), ... or the halves (i, i + rotary_dim / 2)."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if interleaved:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    else:
        first, second = rot.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (RoFormer) on the first ``dim`` features of each head.

    Feature pair i turns by position * base^(-2i / dim) radians; ``interleaved`` pairs the
    features (0, 1), (2, 3), ... (GPT-J), otherwise (i, i + dim / 2) (GPT-NeoX, Llama). The
    angles are computed in fp32 and the cos/sin tables are cached per device and dtype, grown
    as longer positions are asked for.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"dim: expected a positive even number of rotated features, given {dim}")
        if not base > 0:
            raise ValueError(f"base: expected a positive number, given {base}")
        self.dim, self.base, self.interleaved = int(dim), float(base), bool(interleaved)
        exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
        self.register_buffer("inv_freq", 1.0 / (self.base ** exponents), persistent=False)
        self._tables: dict = {}  # (device, dtype) -> (cos, sin), rows for positions 0, 1, ...

    def cos_sin(self, seqlen: int, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables (seqlen, dim / 2) of positions 0 .. seqlen - 1."""
        device = torch.device(device) if device is not None else self.inv_freq.device
        dtype = dtype or torch.float32
        key = (device, dtype)
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] < seqlen:
            rows = max(seqlen, 2 * tables[0].shape[0] if tables is not None else 0)
            positions = torch.arange(rows, device=device, dtype=torch.float32)
            angles = torch.outer(positions, self.inv_freq.to(device=device, dtype=torch.float32))
            tables = (angles.cos().to(dtype), angles.sin().to(dtype))
            self._tables[key] = tables
        return tables[0][:seqlen], tables[1][:seqlen]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, bound: int) -> torch.Tensor:
        """x (..., S, H, D) rotated at integer positions of shape (..., S) (or (S,)), each below
        `bound` (a host-side bound: reading the positions' maximum would synchronise)."""
        cos, sin = self.cos_sin(bound, x.device, torch.float32)
        return _rotate(x, cos[positions], sin[positions], self.interleaved)

    def forward(self, q: torch.Tensor, k: torch.Tensor, seqlen_offset=0,
                max_seqlen: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, S, H, D) and k (B, S, Hk, D) rotated at positions seqlen_offset + 0 .. S - 1;
        seqlen_offset is an int or a (B,) tensor of each sequence's first position, and then
        max_seqlen bounds every position (without it the offsets are read back to the host)."""
        s = q.shape[1]
        positions = torch.arange(s, device=q.device)
        if isinstance(seqlen_offset, torch.Tensor):
            positions = seqlen_offset.to(device=q.device, dtype=torch.long)[:, None] + positions
            bound = max_seqlen if max_seqlen is not None else int(seqlen_offset.max()) + s
        else:
            positions = positions + int(seqlen_offset)
            bound = int(seqlen_offset) + s
        return self.rotate(q, positions, bound), self.rotate(k, positions, bound)


class InferenceParams:
    """The state of an incremental decode shared by a model's layers: each MHA with a
    ``layer_idx`` keeps its key/value cache (max_batch_size, max_seqlen, num_heads_kv,
    head_dim) in ``key_value_memory_dict[layer_idx]``, allocated at its first call.

    ``seqlen_offset`` is how many positions every sequence already has in the cache (0 at the
    prefill); ``lengths_per_sample``, a (batch,) int32 tensor, replaces it where sequences
    differ (and keeps decode steps CUDA-graph capturable: update it in place). The caller
    advances them after each step of the whole model. ``page_size`` makes the caches paged
    (pages of that many positions, addressed through ``block_table``).
    """

    def __init__(self, max_seqlen: int, max_batch_size: int, seqlen_offset: int = 0,
                 lengths_per_sample: Optional[torch.Tensor] = None, page_size: Optional[int] = None):
        if max_seqlen <= 0 or max_batch_size <= 0:
            raise ValueError(f"max_seqlen, max_batch_size: expected positive sizes, given "
                             f"{max_seqlen}, {max_batch_size}")
        if page_size is not None and page_size <= 0:
            raise ValueError(f"page_size: expected a positive number of positions per page, given {page_size}")
        self.max_seqlen, self.max_batch_size = int(max_seqlen), int(max_batch_size)
        self.seqlen_offset = int(seqlen_offset)
        self.lengths_per_sample = lengths_per_sample
        # A paged cache: (pages, page_size, heads_kv, head_dim) per layer, sequence b's position
        # p in page block_table[b, p // page_size]. Each sequence gets its own pages here (a
        # serving engine would share a pool through its own block_table).
        self.page_size = None if page_size is None else int(page_size)
        self.block_table: Optional[torch.Tensor] = None
        self.key_value_memory_dict: dict = {}

    def reset(self, max_seqlen: Optional[int] = None, max_batch_size: Optional[int] = None):
        """A new generation: offsets back to 0; the caches are kept (and overwritten) unless
        the sizes change."""
        if (max_seqlen, max_batch_size) != (None, None) and \
                (max_seqlen, max_batch_size) != (self.max_seqlen, self.max_batch_size):
            self.key_value_memory_dict.clear()
            self.max_seqlen = int(max_seqlen or self.max_seqlen)
            self.max_batch_size = int(max_batch_size or self.max_batch_size)
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def unpad(x: torch.Tensor, key_padding_mask: torch.Tensor):
    """The rows of x (B, S, ...) where key_padding_mask (B, S) is True, as (total, ...), with
    their indices into x.flatten(0, 1), cu_seqlens (B + 1,) int32, the longest length and
    each row's position within its sequence (its rank among the sequence's kept rows)."""
    if key_padding_mask.shape != x.shape[:2] or key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask: expected a bool tensor of shape {tuple(x.shape[:2])}, "
                         f"given {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    lengths = key_padding_mask.sum(dim=1, dtype=torch.int32)
    indices = key_padding_mask.flatten().nonzero(as_tuple=True)[0]
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    positions = (key_padding_mask.cumsum(dim=1) - 1).flatten()[indices]
    return x.flatten(0, 1)[indices], indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0, positions


def _positions_of(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each row's position within its sequence, for rows laid out by cu_seqlens."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                       output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts[sequence]


class MHA(nn.Module):
    """Multi-head self-attention: a fused QKV projection, attention through flashattn, an
    output projection.

    Arguments:
        embed_dim: the model width E; the head dim is E / num_heads.
        num_heads: query heads H. num_heads_kv: key/value heads Hk (GQA; 1 is MQA), dividing H.
            Default H.
        qkv_proj_bias, out_proj_bias: biases of the two projections.
        dropout: attention dropout probability, applied in training only.
        softmax_scale: the scale of QK^T (default 1 / sqrt(head_dim)).
        causal, window_size, softcap: the mask and score cap of flash_attn_func.
        alibi_slopes: (H,) fp32 slopes, or None. use_alibi=True takes the standard slopes of
            ALiBi (a geometric series in 2^(-8 / H)).
        rotary_emb_dim: rotated features per head (0: no rotary), rotary_emb_base and
            rotary_emb_interleaved as RotaryEmbedding's.
        layer_idx: this layer's key in InferenceParams.key_value_memory_dict (needed for
            inference with a cache).

    forward(x, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, inference_params=None):
        x (B, S, E) -> (B, S, E); with cu_seqlens (B + 1,) int32 and max_seqlen, an unpadded
        batch x (total, E) -> (total, E), each sequence attending to itself only; with
        key_padding_mask (B, S) bool (True: a token), a padded batch computed unpadded, the
        padding rows of the output zero. With inference_params, x's keys and values are
        appended to the layer's cache at the params' offset and x attends to the cache
        (prefill or decode; no autograd through the cache).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: Optional[int] = None,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: Optional[float] = None, causal: bool = False, window_size=(-1, -1),
                 softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, use_alibi: bool = False,
                 rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_interleaved: bool = False, layer_idx: Optional[int] = None,
                 device=None, dtype=None):
        super().__init__()
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"num_heads: expected a positive divisor of embed_dim = {embed_dim}, "
                             f"given {num_heads}")
        if num_heads_kv <= 0 or num_heads % num_heads_kv:
            raise ValueError(f"num_heads_kv: expected a positive divisor of num_heads = {num_heads}, "
                             f"given {num_heads_kv}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), given {dropout}")
        self.embed_dim, self.num_heads, self.num_heads_kv = embed_dim, num_heads, num_heads_kv
        self.head_dim = embed_dim // num_heads
        if rotary_emb_dim < 0 or rotary_emb_dim > self.head_dim or rotary_emb_dim % 2:
            raise ValueError(f"rotary_emb_dim: expected an even number in [0, head_dim = {self.head_dim}], "
                             f"given {rotary_emb_dim}")
        self.dropout, self.softmax_scale, self.causal = float(dropout), softmax_scale, bool(causal)
        self.window_size, self.softcap, self.layer_idx = tuple(window_size), float(softcap), layer_idx
        if use_alibi and alibi_slopes is None:
            alibi_slopes = torch.tensor(alibi_standard_slopes(num_heads), dtype=torch.float32)
        self.register_buffer("alibi_slopes", None if alibi_slopes is None else
                             torch.as_tensor(alibi_slopes, dtype=torch.float32, device=device),
                             persistent=False)
        self.rotary_emb = (RotaryEmbedding(rotary_emb_dim, rotary_emb_base, rotary_emb_interleaved, device)
                           if rotary_emb_dim > 0 else None)
        qkv_dim = (num_heads + 2 * num_heads_kv) * self.head_dim
        self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=out_proj_bias, device=device,
                                  dtype=dtype)

    def _apply(self, fn, recurse=True):
        # The slopes are a kernel argument in fp32 whatever the module's dtype: module.to(bf16)
        # or .half() moves them with the module but must not round them.
        slopes = self.alibi_slopes
        super()._apply(fn, recurse)
        if slopes is not None:
            self.alibi_slopes = slopes.to(self.alibi_slopes.device)
        return self

    def _split(self, qkv: torch.Tensor):
        """q, k, v views (..., heads, head_dim) of the fused projection."""
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = qkv.unflatten(-1, (h + 2 * hk, d))
        return qkv[..., :h, :], qkv[..., h:h + hk, :], qkv[..., h + hk:, :]

    def _attention_args(self):
        return dict(softmax_scale=self.softmax_scale, window_size=self.window_size, softcap=self.softcap,
                    alibi_slopes=self.alibi_slopes)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                inference_params: Optional[InferenceParams] = None) -> torch.Tensor:
        if inference_params is not None:
            if key_padding_mask is not None or cu_seqlens is not None:
                raise ValueError("inference_params: expected a dense batch x (B, S, E), given "
                                 "key_padding_mask or cu_seqlens too")
            return self._forward_cached(x, inference_params)
        if key_padding_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: expected None with key_padding_mask, given a tensor")
            rows, indices, cu, longest, positions = unpad(x, key_padding_mask)
            out_rows = self._forward_unpadded(rows, cu, longest, positions)
            out = out_rows.new_zeros(x.shape[0] * x.shape[1], out_rows.shape[-1])
            out = out.index_copy(0, indices, out_rows)
            return out.unflatten(0, x.shape[:2])
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("max_seqlen: expected the longest sequence's length with cu_seqlens, given None")
            return self._forward_unpadded(x, cu_seqlens, int(max_seqlen), None)
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected (batch, seqlen, {self.embed_dim}), given {tuple(x.shape)}")
        q, k, v = self._split(self.Wqkv(x))
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k)
        out = flash_attn_func(q, k, v, dropout_p=self.dropout if self.training else 0.0, causal=self.causal,
                              **self._attention_args())
        return self.out_proj(out.flatten(-2))

    def _forward_unpadded(self, x, cu_seqlens, max_seqlen, positions):
        if x.dim() != 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected (total_tokens, {self.embed_dim}) with cu_seqlens, given {tuple(x.shape)}")
        q, k, v = self._split(self.Wqkv(x))
        if self.rotary_emb is not None:
            if positions is None:
                positions = _positions_of(cu_seqlens, x.shape[0])
            # (total, H, D): each row at its own position within its sequence
            q, k = self.rotary_emb.rotate(q, positions, max_seqlen), self.rotary_emb.rotate(k, positions, max_seqlen)
        cu_seqlens = cu_seqlens.to(torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                     dropout_p=self.dropout if self.training else 0.0, causal=self.causal,
                                     **self._attention_args())
        return self.out_proj(out.flatten(-2))

    def _cache(self, params: InferenceParams, k: torch.Tensor):
        """This layer's (k_cache, v_cache), made on first use in k's dtype: under autocast the
        projections' dtype, not the residual stream's, is the one the kernel is given."""
        if self.layer_idx is None:
            raise ValueError("layer_idx: expected this layer's index for inference with a cache, given None")
        cache = params.key_value_memory_dict.get(self.layer_idx)
        if cache is None:
            if params.page_size is None:
                shape = (params.max_batch_size, params.max_seqlen, self.num_heads_kv, self.head_dim)
            else:
                pages_per_sequence = -(-params.max_seqlen // params.page_size)
                if params.block_table is None:
                    params.block_table = torch.arange(params.max_batch_size * pages_per_sequence, device=k.device,
                                                      dtype=torch.int32).view(params.max_batch_size, -1)
                shape = (params.max_batch_size * pages_per_sequence, params.page_size, self.num_heads_kv,
                         self.head_dim)
            cache = (torch.zeros(shape, device=k.device, dtype=k.dtype),
                     torch.zeros(shape, device=k.device, dtype=k.dtype))
            params.key_value_memory_dict[self.layer_idx] = cache
        return cache

    def _forward_cached(self, x: torch.Tensor, params: InferenceParams) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        if b > params.max_batch_size:
            raise ValueError(f"x: expected at most max_batch_size = {params.max_batch_size} sequences, given {b}")
        lengths = params.lengths_per_sample
        if lengths is None and params.seqlen_offset + s > params.max_seqlen:
            raise ValueError(f"inference_params: expected seqlen_offset + seqlen <= max_seqlen = "
                             f"{params.max_seqlen}, given {params.seqlen_offset} + {s}")
        q, k, v = self._split(self.Wqkv(x))
        k_cache, v_cache = self._cache(params, k)
        offset = lengths if lengths is not None else params.seqlen_offset
        rotary = {}
        if self.rotary_emb is not None and self.causal:
            # The kernel rotates k at its cache positions as it appends it, and q (causal) at
            # the same positions: the tables cover every position the cache can hold.
            cos, sin = self.rotary_emb.cos_sin(params.max_seqlen, q.device, q.dtype)
            rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=self.rotary_emb.interleaved)
        elif self.rotary_emb is not None:
            # Without the causal mask the kernel rotates every row of q at the first new
            # position; rotated here, q's rows keep their own positions, as in training.
            q, k = self.rotary_emb(q, k, seqlen_offset=offset, max_seqlen=params.max_seqlen)
        if params.page_size is None:
            caches = dict(k_cache=k_cache[:b], v_cache=v_cache[:b])
        else:
            caches = dict(k_cache=k_cache, v_cache=v_cache, block_table=params.block_table[:b])
        out = flash_attn_with_kvcache(q, k=k, v=v, cache_seqlens=offset, causal=self.causal, **caches, **rotary,
                                      **self._attention_args())
        return self.out_proj(out.flatten(-2))


def alibi_standard_slopes(num_heads: int) -> list[float]:
    """ALiBi's slopes for num_heads heads: 2^(-8 i / n) for i = 1 .. n with n the power of two
    at or below num_heads, then every other slope of the series for 2n to fill the rest."""
    def series(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    power = 2 ** math.floor(math.log2(num_heads))
    return series(power) + series(2 * power)[0::2][:num_heads - power]


__all__ = ["RotaryEmbedding", "MHA", "InferenceParams", "unpad", "alibi_standard_slopes"]
