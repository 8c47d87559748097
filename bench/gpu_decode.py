#!/usr/bin/env python3
"""flashattn GPU decode benchmark: the KV-cache forward against PyTorch SDPA, one card.

Decoding reads the whole key/value cache for one new query token: a memory-bound problem, so
the figure is the rate at which the cache is read. For every (batch, cache length) of the grid
(ANCHORS.md's decode table by default: 1x8k, 1x128k, 8x32k, 64x4k; 32 query heads, 8 key/value
heads, head dim 128, bf16), in one process on one GPU, on the same inputs:

  ours        flashattn's C ABI `fa_forward_kvcache` (libflashattn_c.so through ctypes), CUDA
              backend, num_splits 0 (the library's choice; --num-splits overrides): q
              (B, Sq, H, D), caches (B, S, Hk, D), cache_seqlens = S - new tokens, out and lse
              preallocated. With --new-tokens n, each call also appends n new keys/values at
              positions S-n .. S-1 (the same values every call) and q has n rows (causal).
  ours-paged  the same cache as pages of --page-size rows (when given) scattered over a page
              pool in random order, addressed through block_table.
  flash       torch SDPA forced to SDPBackend.FLASH_ATTENTION, q (B, H, Sq, D) against the
  cudnn       caches as (B, Hk, S, D) transposed views (no copies) with enable_gqa=True; a
  efficient   backend that refuses grouped heads gets k/v expanded to H heads instead
              (contiguous copies made outside the timing), which reads H/Hk times the bytes:
              the row says so. A backend that refuses the shape altogether is n/a, with the
              reasons torch gave. Seen on the H200 with torch 2.11 / cuDNN 9.19 (2026-11-29):
              flash and cudnn take enable_gqa at these shapes (also with causal_lower_right
              for several new tokens); efficient refuses it and runs on expanded heads.

Metric: TB/s = (bytes of K and V the attention must read) / time = B * S * Hk * D * 2 (bytes)
* 2 (K and V) / time, the same numerator for every system, and ours as a percentage of the
card's device copy bandwidth measured in the same run (a torch copy of a --copy-mib buffer:
read + write bytes / time, median of event-timed copies).

Timing (bench/gpu_forward.py's method, adapted to calls of a few microseconds): an untimed
first call, then --graph-calls calls captured in one CUDA graph, rotating over input sets
whose caches exceed --rotate-mib together (the H200's L2 holds 60 MB: a 1x8k cache is 34 MB),
replayed with each replay bracketed by CUDA events; the median replay over the number of calls
is the time per call. That is the GPU's time, as a serving engine that replays decode graphs
sees it: without graphs a 10 us kernel is timed together with the host's launch latency. Each
system is also timed eagerly (gpu_forward.py's per-call events, host launch included), in the
JSON and a second table. A system whose capture fails is timed eagerly only, and says why.

Correctness, before timing, on every shape: ours runs on NaN-poisoned out/lse and is compared
over the whole output with the first SDPA backend that accepts the shape (max abs difference),
and on (batch, head) slices with a float64 reference computed on the GPU; ours fails on a
non-finite element, on a float64 error above 2x the peer's own plus 2^-9 of the output's
magnitude, or an lse off by more than 1e-3. With --new-tokens the appended rows of the caches
are checked too.

Outputs in --out: results.json (every row, the copy bandwidth and the run's metadata),
results.md (the tables). The markdown table is printed last. Exit status: 0 when ours ran and
passed everywhere, 1 when a row of ours failed, 2 when nothing could run (no GPU, bad
arguments).

`--check-only` runs the checks without timing; `--quick` a small grid with short timing.
`--self-test-cpu` needs only numpy: fa_forward_kvcache through this binding on host arrays with
the CPU backend (dense and paged, appending), against a float64 numpy reference.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import math
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_forward as fw  # noqa: E402  (the shared binding, timing and output helpers)

FA_INT32 = 3
DEFAULT_SHAPES = "1x8k,1x128k,8x32k,64x4k"  # ANCHORS.md's decode table
QUICK_SHAPES = ((1, 8192), (8, 4096))
PEERS = ("flash", "cudnn", "efficient")
DEFAULT_PEERS = ("flash", "cudnn")
LSE_TOLERANCE = 1e-3
MIB = fw.MIB

# --- the C ABI additions for the KV cache ----------------------------------------------------

_P = ctypes.POINTER(fw.FaTensor)


class FaKvCache(ctypes.Structure):
    """fa_kvcache; fill with fa_kvcache_init, which sets struct_size. NULL: absent."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("k_cache", _P),
        ("v_cache", _P),
        ("cache_seqlens", _P),
        ("k_new", _P),
        ("v_new", _P),
        ("rotary_cos", _P),
        ("rotary_sin", _P),
        ("rotary_interleaved", ctypes.c_int32),
        ("cache_batch_idx", _P),
        ("cache_leftpad", _P),
        ("block_table", _P),
        ("num_splits", ctypes.c_int32),
    ]


class FaRunInfo(ctypes.Structure):
    """fa_run_info with num_splits (the key chunks fa_forward_kvcache merged)."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_int32),
        ("workspace_bytes", ctypes.c_size_t),
        ("deterministic", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
    ]


def declare_kvcache(lib: fw.FlashAttnLib) -> None:
    """Declares fa_kvcache_init and fa_forward_kvcache on `lib` and checks the struct sizes.
    fa_run_info_init is bound a second time (a separate function object) for this file's
    FaRunInfo, which has the num_splits field."""
    lib.dll.fa_kvcache_init.argtypes = [ctypes.POINTER(FaKvCache)]
    lib.dll.fa_kvcache_init.restype = None
    lib.run_info_init = lib.dll["fa_run_info_init"]
    lib.run_info_init.argtypes = [ctypes.POINTER(FaRunInfo)]
    lib.run_info_init.restype = None
    lib.dll.fa_forward_kvcache.argtypes = [_P, ctypes.POINTER(FaKvCache), _P, _P,
                                           ctypes.POINTER(fw.FaOptions),
                                           ctypes.POINTER(fw.FaExecution),
                                           ctypes.POINTER(FaRunInfo)]
    lib.dll.fa_forward_kvcache.restype = ctypes.c_int
    for struct, init in ((FaKvCache, lib.dll.fa_kvcache_init), (FaRunInfo, lib.run_info_init)):
        s = struct()
        init(ctypes.byref(s))
        if s.struct_size != ctypes.sizeof(struct):
            raise RuntimeError(f"{struct.__name__}: the library's struct is {s.struct_size} "
                               f"bytes, this binding's {ctypes.sizeof(struct)}: "
                               "bench/gpu_decode.py is out of date with flashattn.h")


class KvCacheError(fw.FlashAttnError):
    """A non-OK status of fa_forward_kvcache, with fa_last_error()'s message."""

    def __str__(self) -> str:
        return (f"fa_forward_kvcache: {fw.FA_STATUS_NAMES.get(self.status, self.status)}: "
                f"{self.message}")


class KvCacheCall:
    """One prepared fa_forward_kvcache call: the argument structs are built once, so a timed
    call is one ctypes crossing. `tensors` maps fa_kvcache's field names to fa_tensors;
    `keepalive` holds the arrays they point into."""

    def __init__(self, lib: fw.FlashAttnLib, q: fw.FaTensor, out: fw.FaTensor,
                 lse: fw.FaTensor | None, tensors: dict[str, fw.FaTensor], causal: bool,
                 num_splits: int, backend: int, stream: int | None, keepalive: tuple = ()):
        self._lib = lib
        self._tensors = (q, out, lse, dict(tensors))
        self.cache = FaKvCache()
        lib.dll.fa_kvcache_init(ctypes.byref(self.cache))
        for name, t in self._tensors[3].items():
            setattr(self.cache, name, ctypes.pointer(t))
        self.cache.num_splits = num_splits
        self.options = fw.FaOptions()
        lib.dll.fa_options_init(ctypes.byref(self.options))
        self.options.causal = int(bool(causal))
        self.execution = fw.FaExecution()
        lib.dll.fa_execution_init(ctypes.byref(self.execution))
        self.execution.backend = backend
        self.set_stream(stream)
        self.info = FaRunInfo()
        lib.run_info_init(ctypes.byref(self.info))
        self._keepalive = keepalive
        self._args = (ctypes.byref(q), ctypes.byref(self.cache), ctypes.byref(out),
                      ctypes.byref(lse) if lse is not None else None,
                      ctypes.byref(self.options), ctypes.byref(self.execution),
                      ctypes.byref(self.info))

    def set_stream(self, stream: int | None) -> None:
        """The cudaStream_t the call launches on (a CUDA-graph capture needs the capturing
        stream)."""
        self.execution.stream = ctypes.c_void_p(stream) if stream else None

    def __call__(self) -> None:
        status = self._lib.dll.fa_forward_kvcache(*self._args)
        if status != fw.FA_OK:
            raise KvCacheError(status, self._lib.last_error())


# --- the CPU self-test (numpy only) --------------------------------------------------------


def reference_decode(q, keys, values, causal: bool):
    """Float64 attention of q (Sq, H, D) to keys/values (S, Hk, D), bottom-right causal:
    (out (Sq, H, D), lse (H, Sq))."""
    import numpy as np
    sq, h, d = q.shape
    group = h // keys.shape[1]
    k = np.repeat(keys, group, axis=1)
    v = np.repeat(values, group, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(d)
    if causal:
        i = np.arange(sq)[:, None]
        j = np.arange(k.shape[0])[None, :]
        s = np.where(j <= i + k.shape[0] - sq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p / denom, v), (np.log(denom) + m)[..., 0]


def self_test_cpu(lib_path: str) -> int:
    """fa_forward_kvcache through this file's binding with the CPU backend: dense and paged
    (page size 5) fp32 caches, two new tokens appended per sequence, GQA 4:1, causal, against
    reference_decode. Checks the appended rows and the untouched ones, and that a rejected
    call reports an error and writes nothing. Returns the exit status."""
    import numpy as np
    lib = fw.FlashAttnLib(lib_path)
    declare_kvcache(lib)
    print(f"library {lib.path}: version {lib.version()}, cuda compiled: {lib.cuda_compiled()}")
    rng = np.random.default_rng(0)
    b, h, hk, d, capacity, snew, page = 3, 8, 2, 64, 45, 2, 5
    failures = 0
    for paged in (False, True):
        for num_splits in (0, 1, 3):
            q = rng.standard_normal((b, snew, h, d)).astype(np.float32)
            k_new = rng.standard_normal((b, snew, hk, d)).astype(np.float32)
            v_new = rng.standard_normal((b, snew, hk, d)).astype(np.float32)
            seqlens = np.array([capacity - snew, 0, 17], np.int32)
            dense_k = rng.standard_normal((b, capacity, hk, d)).astype(np.float32)
            dense_v = rng.standard_normal((b, capacity, hk, d)).astype(np.float32)
            tensors = {"cache_seqlens": fw.fa_tensor_from_numpy(seqlens, FA_INT32),
                       "k_new": fw.fa_tensor_from_numpy(k_new, fw.FA_FLOAT32),
                       "v_new": fw.fa_tensor_from_numpy(v_new, fw.FA_FLOAT32)}
            if paged:
                pages = capacity // page
                order = rng.permutation(b * pages).astype(np.int32)
                table = order.reshape(b, pages)
                k_cache = np.empty((b * pages, page, hk, d), np.float32)
                v_cache = np.empty_like(k_cache)
                k_cache[order] = dense_k.reshape(b * pages, page, hk, d)
                v_cache[order] = dense_v.reshape(b * pages, page, hk, d)
                tensors["block_table"] = fw.fa_tensor_from_numpy(table, FA_INT32)
            else:
                table, k_cache, v_cache = None, dense_k.copy(), dense_v.copy()
            tensors["k_cache"] = fw.fa_tensor_from_numpy(k_cache, fw.FA_FLOAT32)
            tensors["v_cache"] = fw.fa_tensor_from_numpy(v_cache, fw.FA_FLOAT32)
            out = np.full((b, snew, h, d), np.nan, np.float32)
            lse = np.full((b, h, snew), np.nan, np.float32)
            call = KvCacheCall(lib, fw.fa_tensor_from_numpy(q, fw.FA_FLOAT32),
                               fw.fa_tensor_from_numpy(out, fw.FA_FLOAT32),
                               fw.fa_tensor_from_numpy(lse, fw.FA_FLOAT32), tensors, True,
                               num_splits, fw.FA_BACKEND_CPU, None,
                               keepalive=(q, k_new, v_new, seqlens, table, k_cache, v_cache,
                                          out, lse))
            call()
            want_k, want_v = dense_k.astype(np.float64), dense_v.astype(np.float64)
            err_out = err_lse = 0.0
            for i in range(b):
                rows = slice(seqlens[i], seqlens[i] + snew)
                want_k[i, rows], want_v[i, rows] = k_new[i], v_new[i]
                end = seqlens[i] + snew
                ref_out, ref_lse = reference_decode(q[i].astype(np.float64), want_k[i, :end],
                                                    want_v[i, :end], causal=True)
                err_out = max(err_out, float(np.abs(out[i] - ref_out).max()))
                err_lse = max(err_lse, float(np.abs(lse[i] - ref_lse).max()))
            got_k = k_cache[table].reshape(dense_k.shape) if paged else k_cache
            got_v = v_cache[table].reshape(dense_v.shape) if paged else v_cache
            caches_ok = np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)
            ok = err_out <= 1e-4 and err_lse <= 1e-4 and caches_ok and \
                call.info.backend == fw.FA_BACKEND_CPU and call.info.num_splits >= 1
            failures += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {'paged' if paged else 'dense'} num_splits "
                  f"{num_splits} (ran {call.info.num_splits}): max|out-ref| {err_out:.2e}, "
                  f"max|lse-ref| {err_lse:.2e}, caches {'ok' if caches_ok else 'WRONG'}")
    # A rejected call: cache_seqlens past the cache. Expect a status, a message, nothing written.
    q = np.ones((1, 1, 2, 8), np.float32)
    cache = np.zeros((1, 4, 1, 8), np.float32)
    new = np.ones((1, 1, 1, 8), np.float32)
    seqlens = np.array([4], np.int32)
    out = np.full((1, 1, 2, 8), 7.0, np.float32)
    T = fw.fa_tensor_from_numpy
    call = KvCacheCall(lib, T(q, fw.FA_FLOAT32), T(out, fw.FA_FLOAT32), None,
                       {"k_cache": T(cache, fw.FA_FLOAT32), "v_cache": T(cache, fw.FA_FLOAT32),
                        "cache_seqlens": T(seqlens, FA_INT32), "k_new": T(new, fw.FA_FLOAT32),
                        "v_new": T(new, fw.FA_FLOAT32)}, False, 0, fw.FA_BACKEND_CPU, None,
                       keepalive=(q, cache, new, seqlens, out))
    ok, message = fw.check_rejected(call, lambda: bool((out == 7.0).all() and (cache == 0).all()))
    failures += not ok
    print(f"  {'ok  ' if ok else 'FAIL'} rejected call: {message}")
    print("self-test:", "PASS" if failures == 0 else f"{failures} FAILED")
    return 0 if failures == 0 else 1


# --- shapes, inputs, systems (torch) -------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int      # keys each query attends to (the cache length)
    heads: int
    kv_heads: int
    hdim: int
    new_tokens: int  # appended per call; q has max(1, new_tokens) rows

    @property
    def sq(self) -> int:
        return max(1, self.new_tokens)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the attention must read (2-byte elements)."""
        return self.batch * self.seqlen * self.kv_heads * self.hdim * 2 * 2

    def label(self) -> str:
        return f"B={self.batch:<3} S={seqlen_label(self.seqlen):>5}"


def seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


@dataclass
class InputSet:
    """One set of decode inputs; the caches already hold the new tokens' rows (so that every
    system, in any order, attends to the same keys)."""
    q: Any
    k_cache: Any
    v_cache: Any
    seqlens: Any            # int32 (B,): S - new_tokens
    k_new: Any = None
    v_new: Any = None
    k_pages: Any = None     # (num_pages, page_size, Hk, D), when paged
    v_pages: Any = None
    block_table: Any = None


def make_sets(shape: Shape, dtype: str, page_size: int, rotate_bytes: int,
              seed: int) -> list[InputSet]:
    """Enough input sets that their caches exceed rotate_bytes together (2 to 8)."""
    import torch
    dt = fw.torch_dtype(dtype)
    b, s, hk, d = shape.batch, shape.seqlen, shape.kv_heads, shape.hdim
    n = min(fw.MAX_INPUT_SETS, max(2, math.ceil(rotate_bytes / shape.kv_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(n):
        x = InputSet(
            q=torch.randn((b, shape.sq, shape.heads, d), device="cuda", dtype=dt, generator=gen),
            k_cache=torch.randn((b, s, hk, d), device="cuda", dtype=dt, generator=gen),
            v_cache=torch.randn((b, s, hk, d), device="cuda", dtype=dt, generator=gen),
            seqlens=torch.full((b,), s - shape.new_tokens, dtype=torch.int32, device="cuda"))
        if shape.new_tokens:
            x.k_new = x.k_cache[:, s - shape.new_tokens:].clone()
            x.v_new = x.v_cache[:, s - shape.new_tokens:].clone()
        if page_size:
            pages = -(-s // page_size)
            order = torch.randperm(b * pages, device="cuda", generator=gen)
            x.block_table = order.view(b, pages).to(torch.int32)
            for name in ("k", "v"):
                cache = getattr(x, f"{name}_cache")
                padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, pages * page_size - s))
                pool = torch.empty((b * pages, page_size, hk, d), device="cuda", dtype=dt)
                pool[order] = padded.reshape(b * pages, page_size, hk, d)
                setattr(x, f"{name}_pages", pool)
        sets.append(x)
    return sets


def tensor_of(t) -> fw.FaTensor:
    """An fa_tensor viewing torch tensor `t` (float or int32)."""
    import torch
    if t.dtype == torch.int32:
        return fw.make_fa_tensor(t.data_ptr(), FA_INT32, fw.FA_DEVICE_CUDA, t.device.index or 0,
                                 tuple(t.shape), tuple(t.stride()))
    return fw.fa_tensor_from_torch(t)


@dataclass
class Prepared:
    """A system ready on a shape: one zero-argument call per input set, the context the calls
    run in, and for ours the prepared calls and the preallocated out/lse."""
    calls: list[Callable[[], Any]]
    context: Callable[[], Any] = contextlib.nullcontext
    kv_calls: list[KvCacheCall] | None = None
    out: Any = None
    lse: Any = None
    note: str | None = None
    layout: str | None = None


def prepare_ours(lib: fw.FlashAttnLib | None, sets: list[InputSet], shape: Shape, paged: bool,
                 num_splits: int) -> Prepared:
    import torch
    if lib is None:
        raise RuntimeError("the library could not be loaded (see the run's metadata)")
    if not lib.cuda_compiled():
        raise fw.NotAvailable("the library was built without the CUDA backend")
    q0 = sets[0].q
    out = torch.empty_like(q0)
    lse = torch.empty((shape.batch, shape.heads, shape.sq), device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    calls = []
    for x in sets:
        tensors = {"cache_seqlens": tensor_of(x.seqlens)}
        if paged:
            tensors.update(k_cache=tensor_of(x.k_pages), v_cache=tensor_of(x.v_pages),
                           block_table=tensor_of(x.block_table))
        else:
            tensors.update(k_cache=tensor_of(x.k_cache), v_cache=tensor_of(x.v_cache))
        if x.k_new is not None:
            tensors.update(k_new=tensor_of(x.k_new), v_new=tensor_of(x.v_new))
        calls.append(KvCacheCall(lib, tensor_of(x.q), tensor_of(out), tensor_of(lse), tensors,
                                 shape.new_tokens > 1, num_splits, fw.FA_BACKEND_CUDA, stream,
                                 keepalive=(x, out, lse)))
    return Prepared(calls=list(calls), kv_calls=calls, out=out, lse=lse)


def sdpa_mask(shape: Shape):
    """Bottom-right causal for several new tokens (SDPA's is_causal is top-left aligned); one
    query row sees every key: no mask."""
    if shape.sq == 1:
        return None
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(shape.sq, shape.seqlen)


def prepare_sdpa(system: str, sets: list[InputSet], shape: Shape, expand: bool) -> Prepared:
    """SDPA with one backend forced: q (B, H, Sq, D) and the caches as (B, Hk, S, D) views with
    enable_gqa, or (expand) k/v repeated to H heads as contiguous copies."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, fw.SDPA_BACKENDS[system])
    group = shape.heads // shape.kv_heads
    mask = sdpa_mask(shape)
    calls = []
    for x in sets:
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k_cache, x.v_cache))
        if expand:
            k, v = (t.repeat_interleave(group, dim=1).contiguous() for t in (k, v))
        calls.append(functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                       enable_gqa=not expand and group > 1))
    note = (f"k/v expanded to {shape.heads} heads (copies): reads {group}x the bytes"
            if expand and group > 1 else None)
    layout = ("q (B, H, Sq, D); k/v " + ("(B, H, S, D) contiguous copies" if expand else
                                         "(B, Hk, S, D) views, enable_gqa=True"))
    return Prepared(calls=calls, context=lambda: sdpa_kernel([backend]), note=note,
                    layout=layout)


def first_call(prepared: Prepared, is_ours: bool) -> None:
    """The first (untimed) call; a refusal becomes NotAvailable with the reasons torch gave."""
    import torch
    if is_ours:
        try:
            prepared.calls[0]()
        except fw.FlashAttnError as e:
            if e.status == fw.FA_ERROR_UNSUPPORTED:
                raise fw.NotAvailable(e.message) from e
            raise
        torch.cuda.synchronize()
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with prepared.context():
                prepared.calls[0]()
            torch.cuda.synchronize()
        except RuntimeError as e:
            if "out of memory" in str(e).lower() or "CUDA error" in str(e):
                raise  # not a refusal: an error of the run (possibly a sticky one)
            reasons = [torch_reason(str(w.message)) for w in caught] or [torch_reason(str(e))]
            raise fw.NotAvailable("; ".join(dict.fromkeys(r for r in reasons if r))[:500]) from e


def torch_reason(text: str) -> str:
    """A torch warning or error on one line, without its '(Triggered internally at ...)'."""
    text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", text)
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def prepare_system(system: str, lib, sets, shape, args) -> Prepared:
    """Prepares and runs the first call; SDPA falls back from enable_gqa to expanded heads."""
    if system in ("ours", "ours-paged"):
        prepared = prepare_ours(lib, sets, shape, system == "ours-paged", args.num_splits)
        first_call(prepared, True)
        return prepared
    try:
        prepared = prepare_sdpa(system, sets, shape, expand=False)
        first_call(prepared, False)
        return prepared
    except fw.NotAvailable as refusal:
        if shape.heads == shape.kv_heads:
            raise
        prepared = None
        try:
            prepared = prepare_sdpa(system, sets, shape, expand=True)
            first_call(prepared, False)
        except fw.NotAvailable as again:
            raise fw.NotAvailable(f"enable_gqa: {refusal}; expanded heads: {again}") from None
        prepared.note += f" (enable_gqa refused: {str(refusal)[:200]})"
        return prepared


# --- timing --------------------------------------------------------------------------------

def graph_time(prepared: Prepared, calls_per_graph: int, target_s: float,
               max_reps: int) -> fw.Timing:
    """Microsecond-scale calls: `calls_per_graph` calls (rotating over the input sets) in one
    CUDA graph, each replay event-timed; the median replay / calls_per_graph per call."""
    import torch
    per_graph = max(len(prepared.calls), calls_per_graph // len(prepared.calls) *
                    len(prepared.calls))
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    kv_calls = prepared.kv_calls or []
    graph = torch.cuda.CUDAGraph()
    try:
        with prepared.context():
            with torch.cuda.stream(capture):  # warm-up on the capturing stream
                for call in kv_calls:
                    call.set_stream(capture.cuda_stream)
                for call in prepared.calls:
                    call()
            torch.cuda.current_stream().wait_stream(capture)
            with torch.cuda.graph(graph, stream=capture):
                for i in range(per_graph):
                    prepared.calls[i % len(prepared.calls)]()
    finally:
        for call in kv_calls:
            call.set_stream(torch.cuda.current_stream().cuda_stream)
    graph.replay()
    torch.cuda.synchronize()
    replays = fw.event_times([graph.replay], 0, 3)
    estimate = sorted(replays)[1]
    reps = max(min(fw.MIN_REPS, max_reps),
               min(max_reps, math.ceil(target_s * 1e3 / max(estimate, 1e-3))))
    times = sorted(t / per_graph for t in fw.event_times([graph.replay], 0, reps))
    del graph
    return fw.Timing(ms=times[len(times) // 2], ms_min=times[0], ms_max=times[-1], reps=reps)


def copy_bandwidth(mib: int, reps: int = 20) -> dict:
    """The device's copy bandwidth: dst.copy_(src) of `mib` MiB, (read + write bytes) / the
    median of event-timed copies."""
    import torch
    n = mib * MIB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = sorted(fw.event_times([functools.partial(dst.copy_, src)], 0, reps))
    ms = times[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": n, "ms": ms, "tbps": 2 * n / (ms * 1e-3) / 1e12,
            "method": f"torch copy_ of {mib} MiB, (read + write) / median of {reps} copies"}


# --- correctness ---------------------------------------------------------------------------

def reference_slice(x: InputSet, shape: Shape, b: int, h: int):
    """Float64 (out (Sq, D), lse (Sq,)) of query head h of sequence b, on the GPU."""
    import torch
    kv = h // (shape.heads // shape.kv_heads)
    q = x.q[b, :, h].double()
    k, v = x.k_cache[b, :, kv].double(), x.v_cache[b, :, kv].double()
    scores = (q @ k.T) * shape.hdim ** -0.5
    if shape.sq > 1:
        i = torch.arange(shape.sq, device="cuda")[:, None]
        j = torch.arange(shape.seqlen, device="cuda")[None, :]
        scores.masked_fill_(j > i + shape.seqlen - shape.sq, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[:, None]) @ v, lse


def peer_output(x: InputSet, shape: Shape, peers: Sequence[str]):
    """(name, (B, Sq, H, D) output) of the first SDPA backend that accepts the shape (with
    enable_gqa, else expanded heads), the math backend last."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k_cache, x.v_cache))
    group = shape.heads // shape.kv_heads
    for name in list(peers) + ["math"]:
        backend = SDPBackend.MATH if name == "math" else getattr(SDPBackend,
                                                                 fw.SDPA_BACKENDS[name])
        for expand in (False, True):
            kk, vv = ((t.repeat_interleave(group, dim=1) for t in (k, v)) if expand
                      else (k, v))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with sdpa_kernel([backend]):
                        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=sdpa_mask(shape),
                                                           enable_gqa=not expand and group > 1)
                return name + (" (expanded)" if expand else ""), o.transpose(1, 2)
            except RuntimeError:
                continue
    return None, None


def check_ours(prepared: Prepared, sets: list[InputSet], shape: Shape,
               peers: Sequence[str], paged: bool) -> dict:
    """Ours on the first set with NaN-poisoned out/lse, against SDPA (whole output) and a
    float64 reference (slices); the appended rows of the caches when there are new tokens."""
    import torch
    x = sets[0]
    out, lse = prepared.out, prepared.lse
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    if shape.new_tokens:  # poison the rows the append must write
        if paged:
            page = x.k_pages.shape[1]
            for pos in range(shape.seqlen - shape.new_tokens, shape.seqlen):
                for b in range(shape.batch):
                    blk = int(x.block_table[b, pos // page])
                    x.k_pages[blk, pos % page] = float("nan")
                    x.v_pages[blk, pos % page] = float("nan")
        else:
            x.k_cache[:, shape.seqlen - shape.new_tokens:] = float("nan")
            x.v_cache[:, shape.seqlen - shape.new_tokens:] = float("nan")
    prepared.calls[0]()
    torch.cuda.synchronize()
    result: dict[str, Any] = {"nonfinite_out": int((~torch.isfinite(out)).sum()),
                              "nonfinite_lse": int((~torch.isfinite(lse)).sum())}
    failed = []
    if shape.new_tokens:
        rows = slice(shape.seqlen - shape.new_tokens, shape.seqlen)
        if paged:
            page = x.k_pages.shape[1]
            pages = x.k_pages[x.block_table.long()].flatten(1, 2)[:, :shape.seqlen]
            vpages = x.v_pages[x.block_table.long()].flatten(1, 2)[:, :shape.seqlen]
            appended = torch.equal(pages[:, rows], x.k_new) and torch.equal(vpages[:, rows],
                                                                              x.v_new)
        else:
            appended = torch.equal(x.k_cache[:, rows], x.k_new) and torch.equal(
                x.v_cache[:, rows], x.v_new)
        if paged or not appended:  # restore the dense copy the peers and reference read
            x.k_cache[:, rows], x.v_cache[:, rows] = x.k_new, x.v_new
        result["appended_rows_ok"] = bool(appended)
        if not appended:
            failed.append("the appended cache rows differ from the new keys/values")
    peer_name, peer = peer_output(x, shape, peers)
    err_out = err_lse = err_peer = magnitude = 0.0
    slices = sorted({(0, 0), (shape.batch - 1, shape.heads - 1),
                     (shape.batch // 2, shape.heads // 2 + 1 if shape.heads > 1 else 0)})
    for b, h in slices:
        ref_out, ref_lse = reference_slice(x, shape, b, h)
        magnitude = max(magnitude, float(ref_out.abs().max()))
        err_out = max(err_out, float((out[b, :, h].double() - ref_out).abs().max()))
        err_lse = max(err_lse, float((lse[b, h].double() - ref_lse).abs().max()))
        if peer is not None:
            err_peer = max(err_peer, float((peer[b, :, h].double() - ref_out).abs().max()))
    bound = (2 * err_peer if peer is not None else 2.0 ** -7 * magnitude) + 2.0 ** -9 * magnitude
    result.update(max_abs_out_vs_fp64=err_out, max_abs_lse_vs_fp64=err_lse,
                  fp64_bound=bound, slices=[list(s) for s in slices])
    if peer is not None:
        result.update(peer=peer_name, max_abs_vs_peer=float((out.double() - peer.double())
                                                            .abs().max()),
                      peer_max_abs_vs_fp64=err_peer)
    if result["nonfinite_out"] or result["nonfinite_lse"]:
        failed.append(f"{result['nonfinite_out']} non-finite out, {result['nonfinite_lse']} "
                      "non-finite lse elements")
    if not err_out <= bound:
        failed.append(f"max|out-fp64| {err_out:.3g} > {bound:.3g}")
    if not err_lse <= LSE_TOLERANCE:
        failed.append(f"max|lse-fp64| {err_lse:.3g} > {LSE_TOLERANCE:g}")
    result["ok"] = not failed
    result["failed"] = "; ".join(failed)
    return result


# --- the run -------------------------------------------------------------------------------

def base_row(shape: Shape, system: str, dtype: str) -> dict:
    return {"system": system, "batch": shape.batch, "seqlen": shape.seqlen,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "hdim": shape.hdim,
            "new_tokens": shape.new_tokens, "dtype": dtype, "kv_bytes": shape.kv_bytes,
            "status": "ok", "reason": None, "note": None, "timing": None, "us": None,
            "tbps": None, "us_eager": None, "tbps_eager": None, "num_splits": None,
            "check": None}


def run_system(system: str, shape: Shape, sets: list[InputSet], lib, args) -> dict:
    """One row: prepare + first call, the check (ours), graph and eager timing. Never raises
    for a failure of the system itself: the row says what happened."""
    row = base_row(shape, system, args.dtype)
    prepared = None
    try:
        prepared = prepare_system(system, lib, sets, shape, args)
        row["note"] = prepared.note
        row["layout"] = prepared.layout
        if prepared.kv_calls:
            row["num_splits"] = int(prepared.kv_calls[0].info.num_splits)
            row["workspace_bytes"] = int(prepared.kv_calls[0].info.workspace_bytes)
            try:
                row["check"] = check_ours(prepared, sets, shape, args.peers,
                                          system == "ours-paged")
            except Exception as e:  # the check's own failure (e.g. memory) is not fatal
                row["check"] = {"ok": False, "failed": "the check raised " + fw.first_line(e)}
        if args.check_only:
            return row
        eager = fw.time_calls(prepared.calls, prepared.context, args.target_s / 2, args.repeat)
        row.update(us_eager=eager.ms * 1e3, tbps_eager=shape.kv_bytes / (eager.ms * 1e-3) / 1e12)
        row["timing"] = "eager (per-call events, host launch included)"
        if not args.no_graph:
            try:
                t = graph_time(prepared, args.graph_calls, args.target_s / 2, args.repeat)
                row.update(us=t.ms * 1e3, us_min=t.ms_min * 1e3, us_max=t.ms_max * 1e3,
                           reps=t.reps, timing=f"CUDA graph of {args.graph_calls} calls")
            except Exception as e:
                row["graph_error"] = fw.first_line(e)
                if not fw.cuda_healthy():
                    raise
        if row["us"] is None:
            row.update(us=row["us_eager"])
        row["tbps"] = shape.kv_bytes / (row["us"] * 1e-6) / 1e12
    except Exception as e:
        fw.record_failure(row, e)
    finally:
        del prepared
    return row


def build_grid(args: argparse.Namespace) -> list[Shape]:
    pairs = args.shapes
    if args.batches or args.seqlens:
        batches = args.batches or sorted({b for b, _ in pairs})
        seqlens = args.seqlens or sorted({s for _, s in pairs})
        pairs = [(b, s) for b in batches for s in seqlens]
    return [Shape(b, s, args.heads, args.kv_heads, args.hdim, args.new_tokens) for b, s in pairs]


def systems_of(args: argparse.Namespace) -> list[str]:
    return ["ours"] + (["ours-paged"] if args.page_size else []) + (
        [] if args.skip_peers else list(args.peers))


def run_benchmark(args: argparse.Namespace, meta: dict, lib) -> list[dict]:
    import torch
    systems = systems_of(args)
    rows: list[dict] = []
    started = time.monotonic()
    healthy = True
    for index, shape in enumerate(build_grid(args)):
        if not healthy or time.monotonic() - started > args.time_budget_s:
            reason = ("time budget (--time-budget-s) spent" if healthy
                      else "CUDA context lost earlier in the run")
            rows += [{**base_row(shape, s, args.dtype), "status": "skipped", "reason": reason}
                     for s in systems]
            continue
        try:
            sets = make_sets(shape, args.dtype, args.page_size, args.rotate_mib * MIB,
                             args.seed + index)
        except Exception as e:
            rows += [{**base_row(shape, s, args.dtype), "status": "error",
                      "reason": "inputs: " + fw.first_line(e)} for s in systems]
            torch.cuda.empty_cache()
            continue
        shape_rows = {}
        for system in systems:
            row = run_system(system, shape, sets, lib, args)
            shape_rows[system] = row
            rows.append(row)
            if row["status"] == "error" and not fw.cuda_healthy():
                healthy = False
                rows += [{**base_row(shape, s, args.dtype), "status": "skipped",
                          "reason": "CUDA context lost earlier in the run"}
                         for s in systems[systems.index(system) + 1:]]
                break
        del sets
        torch.cuda.empty_cache()
        print_progress(shape, shape_rows, meta.get("copy"))
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        write_outputs(args.out, meta, rows)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    return rows


# --- outputs -------------------------------------------------------------------------------

def print_progress(shape: Shape, shape_rows: dict[str, dict], copy: dict | None) -> None:
    cells = []
    for system, row in shape_rows.items():
        if row["status"] != "ok":
            cells.append(f"{system} {row['status']}")
        elif row["tbps"] is not None:
            cells.append(f"{system} {row['tbps']:.2f} ({row['us']:.1f} us)")
        else:
            cells.append(f"{system} checked")
    print(f"{shape.label()}: " + "  ".join(cells) + "  TB/s", flush=True)
    for system, row in shape_rows.items():
        for key in ("reason", "note", "graph_error"):
            if row.get(key):
                print(f"    {system}: {key}: {row[key][:300]}", flush=True)
        check = row.get("check")
        if check:
            print(f"    {system} check {'ok' if check['ok'] else 'FAILED: ' + check['failed']}"
                  f": max|out-fp64| {fw.fmt_e(check.get('max_abs_out_vs_fp64'))} (bound "
                  f"{fw.fmt_e(check.get('fp64_bound'))}), max|lse-fp64| "
                  f"{fw.fmt_e(check.get('max_abs_lse_vs_fp64'))}, vs {check.get('peer')}: "
                  f"{fw.fmt_e(check.get('max_abs_vs_peer'))}; splits {row.get('num_splits')}",
                  flush=True)


def cell(row: dict | None, key: str = "tbps") -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return {"n/a": "n/a", "skipped": "skip", "error": "err"}.get(row["status"], "?")
    if row.get(key) is None:
        return "-"
    marks = ""
    if key == "tbps" and row.get("graph_error"):
        marks += " e"
    if row.get("check") and not row["check"]["ok"]:
        marks += " (!)"
    if row.get("note"):
        marks += " *"
    return f"{row[key]:.2f}{marks}"


def ratio(a: dict | None, b: dict | None, key: str = "tbps") -> str:
    if a and b and a["status"] == "ok" and b["status"] == "ok" and a.get(key) and b.get(key):
        return f"{a[key] / b[key]:.2f}"
    return ""


def tables(rows: list[dict], copy: dict | None, key: str = "tbps") -> str:
    peers = [p for p in PEERS if any(r["system"] == p for r in rows)]
    paged = any(r["system"] == "ours-paged" for r in rows)
    by_key = {(r["batch"], r["seqlen"], r["system"]): r for r in rows}
    head = ["batch", "cache len", "ours TB/s", "% of copy", "splits"]
    head += ["ours-paged"] if paged else []
    head += peers + [f"ours/{p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b, s in sorted({(r["batch"], r["seqlen"]) for r in rows}):
        ours = by_key.get((b, s, "ours"))
        pct = ""
        if ours and ours["status"] == "ok" and ours.get(key) and copy:
            pct = f"{100 * ours[key] / copy['tbps']:.0f}%"
        cells = [str(b), seqlen_label(s), cell(ours, key), pct,
                 str(ours.get("num_splits") or "") if ours else ""]
        if paged:
            cells.append(cell(by_key.get((b, s, "ours-paged")), key))
        cells += [cell(by_key.get((b, s, p)), key) for p in peers]
        cells += [ratio(ours, by_key.get((b, s, p)), key) for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: list[dict]) -> str:
    seen: dict[tuple, list[str]] = {}
    for r in rows:
        for key in ("reason", "note", "graph_error", "layout"):
            if r.get(key):
                seen.setdefault((r["system"], key, r[key]), []).append(
                    f"{r['batch']}x{seqlen_label(r['seqlen'])}")
    return "\n".join(f"- {system} ({', '.join(where)}): {key}: {text}"
                     for (system, key, text), where in seen.items())


def checks_table(rows: list[dict]) -> str:
    checked = [r for r in rows if r.get("check")]
    if not checked:
        return ""
    lines = ["| system | batch | cache len | splits | max abs out vs fp64 | bound | "
             "max abs lse vs fp64 | peer | max abs vs peer | result |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in checked:
        e = r["check"]
        lines.append(f"| {r['system']} | {r['batch']} | {seqlen_label(r['seqlen'])} | "
                     f"{r.get('num_splits')} | {fw.fmt_e(e.get('max_abs_out_vs_fp64'))} | "
                     f"{fw.fmt_e(e.get('fp64_bound'))} | {fw.fmt_e(e.get('max_abs_lse_vs_fp64'))}"
                     f" | {e.get('peer') or '-'} | {fw.fmt_e(e.get('max_abs_vs_peer'))} | "
                     f"{'ok' if e['ok'] else 'FAILED: ' + e['failed']} |")
    return "\n".join(lines)


def render_markdown(meta: dict, rows: list[dict]) -> str:
    copy = meta.get("copy")
    shape = meta["shape"]
    copy_line = (f"Device copy bandwidth: {copy['tbps']:.2f} TB/s ({copy['method']})."
                 if copy else "Device copy bandwidth: not measured.")
    parts = [f"# flashattn decode (KV cache), {meta['dtype']}, {meta['device']}\n",
             f"{meta['date']}; torch {meta['torch']} (CUDA {meta['torch_cuda']}, cuDNN "
             f"{meta['cudnn']}); flashattn {meta['library_version']}. {shape['heads']} query "
             f"heads, {shape['kv_heads']} kv heads, head dim {shape['hdim']}, "
             f"{shape['new_tokens']} new tokens per call. TB/s = B*S*Hk*D*2*2 bytes of K+V / "
             f"time. `*`: see the notes; `e`: timed eagerly (the graph capture failed, see the notes); "
             f"`(!)`: ours failed its check.\n",
             f"`{meta['command']}`\n", copy_line + "\n",
             "## TB/s, CUDA-graph timing (GPU time per call)\n", tables(rows, copy), "",
             "## TB/s, eager timing (per-call events, host launch included)\n",
             tables(rows, copy, key="tbps_eager"), ""]
    for title, body in (("## Correctness of ours", checks_table(rows)),
                        ("## Notes", notes(rows))):
        if body:
            parts += [title + "\n", body, ""]
    return "\n".join(parts)


def write_outputs(out_dir: str, meta: dict, rows: list[dict]) -> None:
    import json
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(fw.json_safe({"meta": meta, "rows": rows}), f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(render_markdown(meta, rows))


def run_metadata(args: argparse.Namespace, lib, lib_error: str | None) -> dict:
    import torch
    props = torch.cuda.get_device_properties(0)
    return {
        "benchmark": "flashattn GPU decode (KV cache)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable] + sys.argv),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(0),
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / MIB, 1),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": fw.cudnn_version(), "python": platform.python_version(),
        "library": args.lib, "library_version": lib.version() if lib else None,
        "library_cuda_compiled": lib.cuda_compiled() if lib else None,
        "library_error": lib_error, "dtype": args.dtype,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "hdim": args.hdim,
                  "new_tokens": args.new_tokens, "page_size": args.page_size,
                  "num_splits": args.num_splits},
        "grid": [[s.batch, s.seqlen] for s in build_grid(args)],
        "timing": {"graph_calls": None if args.no_graph else args.graph_calls,
                   "target_s": args.target_s, "max_reps": args.repeat,
                   "rotate_mib": args.rotate_mib},
        "metric": "TB/s = B*S*Hk*D*2 bytes*2 (K and V) / time per call",
    }


# --- command line --------------------------------------------------------------------------

def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x8k,8x32k' -> [(1, 8192), (8, 32768)]."""
    shapes = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            b, s = item.lower().split("x")
            shapes.append((int(b), fw.parse_seqlen(s)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected BATCHxSEQLEN, e.g. 8x32k")
    return shapes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="flashattn GPU decode benchmark: fa_forward_kvcache against torch SDPA "
                    "(flash, cudnn), in TB/s of K+V read and % of the device copy bandwidth.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lib", default="build-gpu/src/libflashattn_c.so",
                   help="path to libflashattn_c.so")
    p.add_argument("--out", default="bench-gpu-decode", help="output folder")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES,
                   help="comma-separated BATCHxCACHELEN pairs")
    p.add_argument("--batches", type=fw.int_list(int), default=None,
                   help="comma-separated batch sizes: with --seqlens (or the shapes' cache "
                        "lengths), a cross product replacing --shapes")
    p.add_argument("--seqlens", type=fw.int_list(fw.parse_seqlen), default=None,
                   help="comma-separated cache lengths (4k,32k,...); see --batches")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=0,
                   help="keys/values appended per call (q gets as many rows, causal); 0: a "
                        "pure read of the cache with one query row")
    p.add_argument("--page-size", type=int, default=0,
                   help="also time ours on a paged cache of this page size (0: dense only)")
    p.add_argument("--num-splits", type=int, default=0,
                   help="fa_kvcache.num_splits for ours (0: the library chooses)")
    p.add_argument("--peers", type=fw.peer_list_of(PEERS), default=list(DEFAULT_PEERS),
                   help="comma-separated subset of " + ",".join(PEERS))
    p.add_argument("--skip-peers", action="store_true", help="ours only")
    p.add_argument("--graph-calls", type=int, default=24,
                   help="calls per CUDA graph (rounded to whole rotations of the input sets)")
    p.add_argument("--no-graph", action="store_true", help="eager timing only")
    p.add_argument("--repeat", type=int, default=50, help="most timed replays / calls")
    p.add_argument("--target-s", type=float, default=0.3,
                   help="timed seconds to aim for per system and shape (graph + eager)")
    p.add_argument("--rotate-mib", type=int, default=256,
                   help="input sets rotate until their caches exceed this many MiB")
    p.add_argument("--copy-mib", type=int, default=2048,
                   help="buffer size of the device copy-bandwidth measurement")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="shapes not started after this many seconds are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: shapes 1x8k and 8x4k, short timing")
    p.add_argument("--check-only", action="store_true",
                   help="correctness checks only (every system's first call), no timing")
    p.add_argument("--self-test-cpu", action="store_true",
                   help="check the ctypes binding on the CPU backend with numpy, then exit")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes = [tuple(s) for s in QUICK_SHAPES]
        args.repeat = min(args.repeat, 10)
        args.target_s = min(args.target_s, 0.1)
        args.copy_mib = min(args.copy_mib, 512)
    if args.repeat < 1 or args.target_s <= 0 or args.graph_calls < 1:
        p.error("--repeat and --graph-calls must be >= 1 and --target-s > 0")
    if args.heads <= 0 or args.kv_heads <= 0 or args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    if args.page_size < 0 or args.new_tokens < 0 or args.num_splits < 0:
        p.error("--page-size, --new-tokens and --num-splits must be >= 0")
    for shape in build_grid(args):
        if shape.batch <= 0 or shape.seqlen <= args.new_tokens:
            p.error(f"shape {shape.batch}x{shape.seqlen}: the batch must be >= 1 and the cache "
                    f"longer than --new-tokens")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test_cpu:
        return self_test_cpu(args.lib)
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: nothing to benchmark", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to benchmark", file=sys.stderr)
        return 2
    lib, lib_error = None, None
    try:
        lib = fw.FlashAttnLib(args.lib)
        declare_kvcache(lib)
    except Exception as e:
        lib, lib_error = None, fw.first_line(e)
        print(f"ours: cannot load {args.lib}: {lib_error}", file=sys.stderr)
    meta = run_metadata(args, lib, lib_error)
    print(f"{meta['device']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, flashattn "
          f"{meta['library_version']} ({args.lib}), {args.dtype}", flush=True)
    torch.manual_seed(args.seed)
    rows: list[dict] = []
    try:
        with torch.inference_mode():
            if not args.check_only:
                meta["copy"] = copy_bandwidth(args.copy_mib)
                print(f"device copy bandwidth: {meta['copy']['tbps']:.2f} TB/s", flush=True)
            rows = run_benchmark(args, meta, lib)
    finally:
        try:
            write_outputs(args.out, meta, rows)
        except Exception as e:
            print(f"writing the outputs failed: {fw.first_line(e)}", file=sys.stderr)
    print()
    if meta.get("copy"):
        print(f"Device copy bandwidth: {meta['copy']['tbps']:.2f} TB/s")
    print(checks_table(rows))
    print()
    if not args.check_only:
        print(tables(rows, meta.get("copy")))
    bad = [r for r in rows if r["system"].startswith("ours") and (
        r["status"] == "error" or (r.get("check") and not r["check"]["ok"]))]
    if bad:
        print(f"ours: {len(bad)} row(s) failed (see results.md)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
