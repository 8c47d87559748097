#!/usr/bin/env python3
"""flashattn GPU forward benchmark: ours against PyTorch SDPA and naive attention, one card.

For every (head dim, causal, seqlen) of the grid, each system runs on the same random inputs,
in one process, on one GPU:

  ours       flashattn's C ABI `fa_forward` (libflashattn_c.so through ctypes), CUDA backend,
             q/k/v/out (B, S, H, D), lse (B, H, S) fp32, out and lse preallocated.
  flash      torch SDPA forced to SDPBackend.FLASH_ATTENTION (PyTorch's vendored FA2).
  cudnn      torch SDPA forced to SDPBackend.CUDNN_ATTENTION.
  efficient  torch SDPA forced to SDPBackend.EFFICIENT_ATTENTION.
  naive      softmax(scale * q k^T, masked) @ v written in torch: bf16/fp16 matmuls, softmax over
             the half-precision score matrix (torch.softmax accumulates in fp32, stores the
             input dtype). Skipped where its score matrices would not fit --naive-budget-gib.

SDPA gets q.transpose(1, 2) views of the same (B, S, H, D) data: no copies in the timed region.
The grid follows ANCHORS.md: batch = 16384 / seqlen, heads = 2048 / hdim, so every config
holds 16k tokens of width 2048 and the flops grow linearly with seqlen.

Timing (GUIDE.md, METHOD.md): one untimed call (module loading, cuDNN plans), three timed
warm-up calls to size the run, then N calls bracketed by CUDA events, N chosen so that a
system spends about --target-s on a config (between 5 and --repeat calls); the median is
reported. The systems of a config are timed side by side: the N calls of each are split over
three rounds, every system taking its turn in each round in an order that rotates, so that
none is always the first to meet a card whose clock the previous (heavier) config's power
draw still holds down. Each call reads the next of several input sets whose total exceeds
--rotate-mib (the H200 has 60 MB of L2), the same rotation for every system.
TFLOP/s = 4*B*H*S*S*D / time, halved when causal.

Correctness: on the first seqlen of every (hdim, causal) group, ours runs on outputs poisoned
with NaN and is compared with a float64 reference on a few (batch, head) slices (out and lse)
and, over the whole tensor, with SDPA flash (or the next peer that accepts the shape).
A row is marked when an element of out is NaN/unwritten or differs from either by more than
atol + rtol * |ref| (bf16: 2e-2 + 2^-7 |ref|, fp16: 1e-2 + 2^-10 |ref|: the relative part is one
unit in the last place, which two correct kernels may differ by), or lse by more than 1e-2.

Memory: for hdim 128 and the --memory-seqlens, every system's forward extra memory: peak
torch allocation during one call minus the allocation before it (outputs, workspaces, masks
created for the call included). The library allocates with cudaMalloc outside torch's
allocator, so for ours the device's free bytes (torch.cuda.mem_get_info) before and after the
call and fa_run_info.workspace_bytes are recorded as well.

Outputs in --out: results.json (every row and the run's metadata), results.md (the tables),
forward_tflops.png (one panel per (hdim, causal)). The markdown table is printed last.
Exit status: 0 when ours ran and passed its checks everywhere it is supported, 1 when a row of
ours failed or was marked, 2 when no benchmark could run (no GPU, bad arguments).

`--self-test-cpu` needs only numpy: it calls fa_forward through the same ctypes binding on
host arrays with the CPU backend and checks the results against a float64 numpy reference.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

# --- the C ABI (include/flashattn/flashattn.h) ---------------------------------------------------

FA_OK = 0
FA_ERROR_INVALID_ARGUMENT = 1
FA_ERROR_UNSUPPORTED = 2
FA_ERROR_BACKEND = 3
FA_ERROR_INTERNAL = 4
FA_STATUS_NAMES = {0: "ok", 1: "invalid argument", 2: "unsupported", 3: "backend error",
                   4: "internal error"}

FA_FLOAT32 = 0
FA_FLOAT16 = 1
FA_BFLOAT16 = 2

FA_DEVICE_CPU = 0
FA_DEVICE_CUDA = 1

FA_BACKEND_AUTO = 0
FA_BACKEND_CPU = 1
FA_BACKEND_CUDA = 2

FA_MAX_DIMS = 6

# --- the benchmark ------------------------------------------------------------------------------

TOKENS = 16384          # batch * seqlen in every config (ANCHORS.md)
MODEL_WIDTH = 2048      # heads * hdim in every config
DEFAULT_HDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_HDIMS = (64, 128)
QUICK_SEQLENS = (512, 2048)
MEMORY_HDIM = 128
DEFAULT_MEMORY_SEQLENS = (4096, 16384)
PEERS = ("flash", "cudnn", "efficient", "naive")


def peer_list_of(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated subset of `known` (each benchmark has its own)."""
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown peer(s) {unknown}; known: {', '.join(known)}")
        return names
    return parse


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION"}
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}  # absolute, on outputs of magnitude ~1
# Plus this much relative to the reference: one unit in the last place of the dtype, so that
# two correct kernels rounding an output of magnitude 4..8 to adjacent values do not fail.
RELATIVE_TOLERANCE = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}
LSE_TOLERANCE = 1e-2
MIN_REPS = 5
ROUNDS = 3  # timed rounds per config: each system's calls split over them (time_interleaved)
MAX_INPUT_SETS = 8
GIB = 1 << 30
MIB = 1 << 20


class FaTensor(ctypes.Structure):
    """fa_tensor: a non-owning strided view; sizes and strides in elements."""
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("sizes", ctypes.c_int64 * FA_MAX_DIMS),
        ("strides", ctypes.c_int64 * FA_MAX_DIMS),
    ]


class FaOptions(ctypes.Structure):
    """fa_options; fill with fa_options_init, which sets struct_size."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("has_softmax_scale", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("causal", ctypes.c_int32),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),
        ("alibi_slopes", ctypes.POINTER(FaTensor)),
        ("dropout_p", ctypes.c_float),
        ("dropout_seed", ctypes.c_uint64),
        ("dropout_offset", ctypes.c_uint64),
        ("deterministic", ctypes.c_int32),
    ]


class FaExecution(ctypes.Structure):
    """fa_execution; fill with fa_execution_init."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("num_threads", ctypes.c_int32),
    ]


class FaRunInfo(ctypes.Structure):
    """fa_run_info; fill with fa_run_info_init. The library reports into it."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_int32),
        ("workspace_bytes", ctypes.c_size_t),
        ("deterministic", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),  # fa_forward_kvcache: the key chunks it merged
    ]


class FlashAttnError(RuntimeError):
    """A non-OK status from the library, with fa_last_error()'s message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"fa_forward: {FA_STATUS_NAMES.get(status, status)}: {message}")
        self.status = status
        self.message = message


def make_fa_tensor(data_ptr: int, dtype: int, device_type: int, device_index: int,
                   sizes: Sequence[int], strides: Sequence[int]) -> FaTensor:
    """An fa_tensor from a raw pointer, an fa_dtype code, a device, sizes and strides in
    elements. Independent of any array library."""
    if len(sizes) != len(strides) or len(sizes) > FA_MAX_DIMS:
        raise ValueError(f"sizes {list(sizes)} and strides {list(strides)}: need equal lengths "
                         f"of at most {FA_MAX_DIMS}")
    t = FaTensor()
    t.data = ctypes.c_void_p(data_ptr)
    t.dtype = dtype
    t.device_type = device_type
    t.device_index = device_index
    t.ndim = len(sizes)
    for d, (size, stride) in enumerate(zip(sizes, strides)):
        t.sizes[d] = int(size)
        t.strides[d] = int(stride)
    return t


class ForwardCall:
    """One prepared fa_forward call. The argument structs are built once, so that a timed call
    costs a single ctypes crossing; `keepalive` holds the arrays the pointers refer to."""

    def __init__(self, lib: FlashAttnLib, q: FaTensor, k: FaTensor, v: FaTensor,
                 out: FaTensor, lse: FaTensor | None, causal: bool, backend: int,
                 stream: int | None, keepalive: tuple = ()):
        self._lib = lib
        self._tensors = (q, k, v, out, lse)
        self.options = FaOptions()
        lib.dll.fa_options_init(ctypes.byref(self.options))
        self.options.causal = int(bool(causal))
        self.execution = FaExecution()
        lib.dll.fa_execution_init(ctypes.byref(self.execution))
        self.execution.backend = backend
        self.execution.stream = ctypes.c_void_p(stream) if stream else None
        self.info = FaRunInfo()
        lib.dll.fa_run_info_init(ctypes.byref(self.info))
        self._keepalive = keepalive
        self._args = (ctypes.byref(q), ctypes.byref(k), ctypes.byref(v), ctypes.byref(out),
                      ctypes.byref(lse) if lse is not None else None,
                      ctypes.byref(self.options), ctypes.byref(self.execution),
                      ctypes.byref(self.info))

    def __call__(self) -> None:
        status = self._lib.dll.fa_forward(*self._args)
        if status != FA_OK:
            raise FlashAttnError(status, self._lib.last_error())


class FlashAttnLib:
    """libflashattn_c loaded with ctypes, its signatures declared and its struct sizes checked
    against this file's mirrors (fa_*_init writes sizeof(struct) into struct_size)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.dll = ctypes.CDLL(self.path)
        tensor_p = ctypes.POINTER(FaTensor)
        self.dll.fa_options_init.argtypes = [ctypes.POINTER(FaOptions)]
        self.dll.fa_options_init.restype = None
        self.dll.fa_execution_init.argtypes = [ctypes.POINTER(FaExecution)]
        self.dll.fa_execution_init.restype = None
        self.dll.fa_run_info_init.argtypes = [ctypes.POINTER(FaRunInfo)]
        self.dll.fa_run_info_init.restype = None
        self.dll.fa_forward.argtypes = [tensor_p, tensor_p, tensor_p, tensor_p, tensor_p,
                                        ctypes.POINTER(FaOptions), ctypes.POINTER(FaExecution),
                                        ctypes.POINTER(FaRunInfo)]
        self.dll.fa_forward.restype = ctypes.c_int
        self.dll.fa_last_error.argtypes = []
        self.dll.fa_last_error.restype = ctypes.c_char_p
        self.dll.fa_version.argtypes = []
        self.dll.fa_version.restype = ctypes.c_char_p
        self.dll.fa_cuda_compiled.argtypes = []
        self.dll.fa_cuda_compiled.restype = ctypes.c_int
        self._check_struct_sizes()

    def _check_struct_sizes(self) -> None:
        for struct, init in ((FaOptions, self.dll.fa_options_init),
                             (FaExecution, self.dll.fa_execution_init),
                             (FaRunInfo, self.dll.fa_run_info_init)):
            s = struct()
            init(ctypes.byref(s))
            if s.struct_size != ctypes.sizeof(struct):
                raise RuntimeError(f"{struct.__name__}: the library's struct is {s.struct_size} "
                                   f"bytes, this binding's {ctypes.sizeof(struct)}: "
                                   "bench/gpu_forward.py is out of date with flashattn.h")

    def version(self) -> str:
        return self.dll.fa_version().decode()

    def cuda_compiled(self) -> bool:
        return bool(self.dll.fa_cuda_compiled())

    def last_error(self) -> str:
        return (self.dll.fa_last_error() or b"").decode(errors="replace")

    def prepare_forward(self, q: FaTensor, k: FaTensor, v: FaTensor, out: FaTensor,
                        lse: FaTensor | None, causal: bool, backend: int,
                        stream: int | None = None, keepalive: tuple = ()) -> ForwardCall:
        """A ForwardCall with default options except `causal`."""
        return ForwardCall(self, q, k, v, out, lse, causal, backend, stream, keepalive)


# --- the CPU self-test (numpy only) ---------------------------------------------------------------

def _bf16_bits(x):
    """float32 array -> bf16 bit patterns (uint16), round to nearest even."""
    import numpy as np
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _bf16_to_f32(bits):
    """bf16 bit patterns (uint16) -> float32."""
    import numpy as np
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _numpy_storage(x, dtype: str):
    """(storage array, fa dtype code, decode function) for a float32 array in `dtype`."""
    import numpy as np
    if dtype == "fp32":
        return x.astype(np.float32), FA_FLOAT32, lambda a: a.astype(np.float64)
    if dtype == "fp16":
        return x.astype(np.float16), FA_FLOAT16, lambda a: a.astype(np.float64)
    return _bf16_bits(x), FA_BFLOAT16, lambda a: _bf16_to_f32(a).astype(np.float64)


def fa_tensor_from_numpy(a, dtype: int) -> FaTensor:
    """An fa_tensor on host memory viewing numpy array `a` (strides converted to elements)."""
    return make_fa_tensor(a.ctypes.data, dtype, FA_DEVICE_CPU, 0, a.shape,
                          [s // a.itemsize for s in a.strides])


def reference_numpy(q, k, v, causal: bool):
    """Float64 attention for (B, S, H, D) arrays: (out (B, S, H, D), lse (B, H, S))."""
    import numpy as np
    d = q.shape[-1]
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = np.where(j <= i + sk - sq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    lse = (np.log(denom) + m)[..., 0]
    out = np.einsum("bhij,bjhd->bihd", p / denom, v)
    return out, lse


def self_test_cpu(lib_path: str) -> int:
    """fa_forward through this file's ctypes binding on numpy arrays with the CPU backend,
    against reference_numpy. q, k, v are strided views of a packed (B, S, 3, H, D) array, out
    and lse are poisoned first. Also checks that a rejected call reports an error and leaves
    out untouched. Returns the exit status."""
    import numpy as np
    lib = FlashAttnLib(lib_path)
    print(f"library {lib.path}: version {lib.version()}, cuda compiled: {lib.cuda_compiled()}")
    print(f"struct sizes: fa_tensor {ctypes.sizeof(FaTensor)}, fa_options "
          f"{ctypes.sizeof(FaOptions)}, fa_execution {ctypes.sizeof(FaExecution)}, fa_run_info "
          f"{ctypes.sizeof(FaRunInfo)} (match the library's)")
    rng = np.random.default_rng(0)
    tolerances = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 2e-2}
    failures = 0
    for b, s, h, d in ((2, 97, 3, 64), (1, 130, 2, 128), (2, 33, 2, 256), (1, 1, 1, 8)):
        for dtype in ("fp32", "fp16", "bf16"):
            for causal in (False, True):
                packed, code, decode = _numpy_storage(
                    rng.standard_normal((b, s, 3, h, d)).astype(np.float32), dtype)
                q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
                out = np.empty((b, s, h, d), dtype=packed.dtype)
                out[...] = _numpy_storage(np.full(1, np.nan, np.float32), dtype)[0][0]
                lse = np.full((b, h, s), np.nan, dtype=np.float32)
                call = lib.prepare_forward(
                    fa_tensor_from_numpy(q, code), fa_tensor_from_numpy(k, code),
                    fa_tensor_from_numpy(v, code), fa_tensor_from_numpy(out, code),
                    fa_tensor_from_numpy(lse, FA_FLOAT32), causal, FA_BACKEND_CPU,
                    keepalive=(packed, out, lse))
                call()
                ref_out, ref_lse = reference_numpy(decode(q), decode(k), decode(v), causal)
                got = decode(out)
                err_out = float(np.max(np.abs(got - ref_out))) if np.isfinite(got).all() \
                    else math.inf
                err_lse = float(np.max(np.abs(lse - ref_lse))) if np.isfinite(lse).all() \
                    else math.inf
                ok = err_out <= tolerances[dtype] and err_lse <= 1e-4 and \
                    call.info.backend == FA_BACKEND_CPU
                failures += not ok
                print(f"  {'ok  ' if ok else 'FAIL'} B={b} S={s} H={h} D={d} {dtype} "
                      f"causal={int(causal)}: max|out-ref| {err_out:.2e}, max|lse-ref| "
                      f"{err_lse:.2e}, backend {call.info.backend}, workspace "
                      f"{call.info.workspace_bytes} B")
    # A rejected call: out has the wrong head dim. Expect a status, a message, out untouched.
    q = np.ones((1, 4, 1, 8), np.float32)
    out = np.full((1, 4, 1, 16), 7.0, np.float32)
    call = lib.prepare_forward(*(fa_tensor_from_numpy(a, FA_FLOAT32) for a in (q, q, q, out)),
                               None, False, FA_BACKEND_CPU, keepalive=(q, out))
    ok, message = check_rejected(call, lambda: bool((out == 7.0).all()))
    failures += not ok
    print(f"  {'ok  ' if ok else 'FAIL'} rejected call: {message}")
    print("self-test:", "PASS" if failures == 0 else f"{failures} FAILED")
    return 0 if failures == 0 else 1


# --- configs, inputs, systems (torch) ----------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One point of the grid."""
    hdim: int
    causal: bool
    seqlen: int

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return max(1, MODEL_WIDTH // self.hdim)

    @property
    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.hdim
        return f / 2 if self.causal else f

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen, self.heads, self.hdim)

    def label(self) -> str:
        return (f"hdim {self.hdim} {'causal' if self.causal else 'full  '} seqlen "
                f"{self.seqlen:>5} (B={self.batch}, H={self.heads})")


@dataclass
class Prepared:
    """A system ready to run on a config: one zero-argument callable per input set, and the
    context (e.g. an SDPA backend choice) the calls must run in."""
    calls: list[Callable[[], Any]]
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    forward_calls: list[ForwardCall] = field(default_factory=list)  # ours only
    out: Any = None  # ours only: the preallocated out and lse
    lse: Any = None


class NotAvailable(Exception):
    """A system refuses a config (unsupported shape, backend not built): recorded as n/a."""


def torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def fa_tensor_from_torch(t) -> FaTensor:
    """An fa_tensor viewing torch tensor `t` (sizes and strides in elements)."""
    import torch
    codes = {torch.float32: FA_FLOAT32, torch.float16: FA_FLOAT16, torch.bfloat16: FA_BFLOAT16}
    on_cuda = t.device.type == "cuda"
    return make_fa_tensor(t.data_ptr(), codes[t.dtype], FA_DEVICE_CUDA if on_cuda else
                          FA_DEVICE_CPU, (t.device.index or 0) if on_cuda else 0,
                          tuple(t.shape), tuple(t.stride()))


def make_inputs(cfg: Config, dtype: str, rotate_bytes: int, seed: int) -> list[tuple]:
    """Enough (q, k, v) sets, each (B, S, H, D) standard normal, that they exceed rotate_bytes
    together (at least two, at most MAX_INPUT_SETS)."""
    import torch
    dt = torch_dtype(dtype)
    set_bytes = 3 * math.prod(cfg.shape) * torch.empty((), dtype=dt).element_size()
    n = min(MAX_INPUT_SETS, max(2, math.ceil(rotate_bytes / set_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [tuple(torch.randn(cfg.shape, device="cuda", dtype=dt, generator=gen)
                  for _ in range(3)) for _ in range(n)]


def prepare_ours(lib: FlashAttnLib | None, sets: list[tuple], causal: bool) -> Prepared:
    """fa_forward on each input set into one preallocated out (B, S, H, D) and lse (B, H, S)."""
    import torch
    if lib is None:
        raise RuntimeError("the library could not be loaded (see the run's metadata)")
    if not lib.cuda_compiled():
        raise NotAvailable("the library was built without the CUDA backend")
    q0 = sets[0][0]
    b, s, h, _ = q0.shape
    out = torch.empty_like(q0)
    lse = torch.empty((b, h, s), device=q0.device, dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    fout, flse = fa_tensor_from_torch(out), fa_tensor_from_torch(lse)
    calls = [lib.prepare_forward(fa_tensor_from_torch(q), fa_tensor_from_torch(k),
                                 fa_tensor_from_torch(v), fout, flse, causal,
                                 FA_BACKEND_CUDA, stream, keepalive=(q, k, v, out, lse))
             for q, k, v in sets]
    return Prepared(calls=list(calls), forward_calls=calls, out=out, lse=lse)


def prepare_sdpa(system: str, sets: list[tuple], causal: bool,
                 contiguous: bool = False) -> Prepared:
    """torch SDPA with one backend forced, on (B, H, S, D) transposed views of the inputs (no
    copies), or with `contiguous`, on (B, H, S, D) copies made here, outside any timing."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, SDPA_BACKENDS[system])
    views = [tuple(t.transpose(1, 2) for t in qkv) for qkv in sets]
    if contiguous:
        views = [tuple(t.contiguous() for t in qkv) for qkv in views]
    calls = [functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
             for q, k, v in views]
    return Prepared(calls=calls, context=lambda: sdpa_kernel([backend]))


def naive_bytes(cfg: Config, element_size: int) -> int:
    """What naive attention is budgeted to need: three B*H*S*S half-precision matrices
    (scores, softmax output, and slack for the allocator and the matmul copies)."""
    return 3 * cfg.batch * cfg.heads * cfg.seqlen * cfg.seqlen * element_size


def naive_attention(q, k, v, causal_mask, scale: float):
    """Standard attention on (B, S, H, D) tensors, materialising the (B, H, S, S) scores:
    half-precision matmuls, softmax over the half-precision scores (fp32 inside torch.softmax).
    Returns (B, H, S, D)."""
    import torch
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = torch.matmul(qh, kh.transpose(-2, -1))
    scores.mul_(scale)
    if causal_mask is not None:
        scores.masked_fill_(causal_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.matmul(probs, vh)


def prepare_naive(sets: list[tuple], causal: bool) -> Prepared:
    """naive_attention on each input set; the causal mask (S, S) is built here, once."""
    import torch
    q0 = sets[0][0]
    s, d = q0.shape[1], q0.shape[3]
    mask = (torch.ones((s, s), dtype=torch.bool, device=q0.device).triu_(1) if causal
            else None)
    return Prepared(calls=[functools.partial(naive_attention, q, k, v, mask, d ** -0.5)
                           for q, k, v in sets])


def prepare_system(system: str, lib: FlashAttnLib | None, sets: list[tuple],
                   causal: bool) -> Prepared:
    if system == "ours":
        return prepare_ours(lib, sets, causal)
    if system == "naive":
        return prepare_naive(sets, causal)
    return prepare_sdpa(system, sets, causal)


def first_call(system: str, prepared: Prepared) -> None:
    """Runs the first call, turning a refusal into NotAvailable: FA_ERROR_UNSUPPORTED for ours;
    for SDPA, any failure of the forced backend, with the reasons torch warned about."""
    import torch
    if system == "ours":
        try:
            prepared.calls[0]()
        except FlashAttnError as e:
            if e.status == FA_ERROR_UNSUPPORTED:
                raise NotAvailable(e.message) from e
            raise
        torch.cuda.synchronize()
        return
    if system == "naive":
        prepared.calls[0]()
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
            reasons = [str(w.message).strip().splitlines()[0] for w in caught]
            reasons = [r for r in reasons if r] or [str(e).strip().splitlines()[0]]
            raise NotAvailable("; ".join(dict.fromkeys(reasons))[:400]) from e


# --- timing ---------------------------------------------------------------------------------

@dataclass
class Timing:
    """Milliseconds per call: the median of `reps` event-timed calls, and their range."""
    ms: float
    ms_min: float
    ms_max: float
    reps: int


def event_times(calls: Sequence[Callable[[], Any]], start: int, n: int) -> list[float]:
    """Milliseconds of n calls, each bracketed by its own pair of CUDA events, rotating
    through `calls` from index `start`. The calls are queued back to back."""
    import torch
    begins = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        begins[i].record()
        calls[(start + i) % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return [b.elapsed_time(e) for b, e in zip(begins, ends)]


@dataclass
class Timed:
    """One system's result from time_interleaved: its timing and the wall-clock windows of
    its rounds (for scripts/clock_windows.py), or the exception that stopped it."""
    timing: Timing | None = None
    windows: list[list[float]] = field(default_factory=list)
    error: Exception | None = None


def time_interleaved(systems: dict[str, tuple[Sequence[Callable[[], Any]],
                                               Callable[[], AbstractContextManager]]],
                     target_s: float, max_reps: int, rounds: int = ROUNDS,
                     times_of: Callable[..., list[float]] = event_times) -> dict[str, Timed]:
    """Times already-warmed systems of one config side by side. `systems` maps a name to its
    calls (one per input set) and the context they run in. Three calls of each size its run
    (about target_s in all, between MIN_REPS and max_reps calls); the calls are then split over
    `rounds` rounds, every system taking its share in each round, the order rotated by one
    system per round. The median is over all of a system's calls. A system that raises is
    left out of the later rounds, its exception returned; the others go on."""
    result = {name: Timed() for name in systems}
    reps: dict[str, int] = {}
    for name, (calls, context) in systems.items():
        try:
            with context():
                estimate = sorted(times_of(calls, 1, 3))[1]
        except Exception as e:
            result[name].error = e
            continue
        reps[name] = max(min(MIN_REPS, max_reps),
                         min(max_reps, math.ceil(target_s * 1e3 / max(estimate, 1e-3))))
    samples: dict[str, list[float]] = {name: [] for name in reps}
    names = list(reps)
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if result[name].error is not None:
                continue
            # This round's share: the shares of all rounds add up to reps exactly.
            n = reps[name] * (r + 1) // rounds - reps[name] * r // rounds
            if n == 0:
                continue
            calls, context = systems[name]
            began = time.time()
            try:
                with context():
                    samples[name] += times_of(calls, len(samples[name]), n)
            except Exception as e:
                result[name].error = e
                continue
            result[name].windows.append([round(began, 3), round(time.time(), 3)])
    for name, times in samples.items():
        if result[name].error is None and times:
            times = sorted(times)
            result[name].timing = Timing(ms=times[len(times) // 2], ms_min=times[0],
                                         ms_max=times[-1], reps=len(times))
    return result


# --- correctness ---------------------------------------------------------------------------

def reference_slice(q, k, v, b: int, h: int, causal: bool):
    """Float64 (out (S, D), lse (S,)) of one (batch, head) on the GPU."""
    import torch
    qs, ks, vs = (t[b, :, h, :].double() for t in (q, k, v))
    scores = (qs @ ks.T) * (q.shape[-1] ** -0.5)
    if causal:
        s = scores.shape[0]
        scores.masked_fill_(torch.ones((s, s), dtype=torch.bool, device=q.device).triu_(1),
                            float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[:, None]) @ vs
    return out, lse


def peer_output(q, k, v, causal: bool):
    """(name, (B, S, H, D) output) of the first SDPA backend among flash, efficient, cudnn that
    accepts the shape, or (None, None)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name in ("flash", "efficient", "cudnn"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])]):
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v.transpose(1, 2), is_causal=causal)
            return name, o.transpose(1, 2)
        except RuntimeError:
            continue
    return None, None


def beyond(x, ref, atol: float, rtol: float) -> int:
    """How many elements of x are not within atol + rtol * |ref| of ref (NaN counts)."""
    x, ref = x.double(), ref.double()
    return int((~((x - ref).abs() <= atol + rtol * ref.abs())).sum())


def check_ours(prepared: Prepared, sets: list[tuple], causal: bool, dtype: str,
               with_peer: bool) -> dict:
    """Runs ours once on the first input set with NaN-poisoned out and lse, and compares it
    with a float64 reference on three (batch, head) slices and with an SDPA peer on the
    whole tensor. Returns the figures and `ok`."""
    import torch
    q, k, v = sets[0]
    out, lse = prepared.out, prepared.lse
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    prepared.calls[0]()
    torch.cuda.synchronize()
    tol, rtol = TOLERANCE[dtype], RELATIVE_TOLERANCE[dtype]
    result: dict[str, Any] = {
        "tolerance": f"|x - ref| <= {tol:g} + {rtol:g} * |ref|", "lse_tolerance": LSE_TOLERANCE,
        "nonfinite_out": int((~torch.isfinite(out)).sum()),
        "nonfinite_lse": int((~torch.isfinite(lse)).sum()),
    }
    b_, _, h_, _ = q.shape
    err_out = err_lse = err_peer_ref = 0.0
    beyond_ref = 0
    peer_name, peer = peer_output(q, k, v, causal) if with_peer else (None, None)
    for b, h in sorted({(0, 0), (b_ // 2, h_ // 2), (b_ - 1, h_ - 1)}):
        ref_out, ref_lse = reference_slice(q, k, v, b, h, causal)
        err_out = max(err_out, float((out[b, :, h, :].double() - ref_out).abs().max()))
        beyond_ref += beyond(out[b, :, h, :], ref_out, tol, rtol)
        err_lse = max(err_lse, float((lse[b, h, :].double() - ref_lse).abs().max()))
        if peer is not None:
            err_peer_ref = max(err_peer_ref,
                               float((peer[b, :, h, :].double() - ref_out).abs().max()))
        del ref_out, ref_lse
    result.update(max_abs_out_vs_fp64=err_out, max_abs_lse_vs_fp64=err_lse,
                  slices="(b, h) in {(0,0), (B/2,H/2), (B-1,H-1)}")
    failed = []
    if peer is not None:
        diff = float((out.float() - peer.float()).abs().max())
        count = beyond(out, peer, tol, rtol)
        result.update(peer=peer_name, max_abs_vs_peer=diff, peer_max_abs_vs_fp64=err_peer_ref,
                      beyond_tolerance_vs_peer=count)
        if count:
            failed.append(f"{count} elements beyond tolerance of {peer_name} "
                          f"(max|ours-{peer_name}| {diff:.3g})")
    if result["nonfinite_out"] or result["nonfinite_lse"]:
        failed.append(f"{result['nonfinite_out']} non-finite out, {result['nonfinite_lse']} "
                      "non-finite lse elements")
    result["beyond_tolerance_vs_fp64"] = beyond_ref
    if beyond_ref:
        failed.append(f"{beyond_ref} elements beyond tolerance of fp64 (max|out-fp64| "
                      f"{err_out:.3g})")
    if not err_lse <= LSE_TOLERANCE:
        failed.append(f"max|lse-fp64| {err_lse:.3g}")
    result["ok"] = not failed
    result["failed"] = "; ".join(failed)
    return result


# --- memory ----------------------------------------------------------------------------------

def measure_memory(system: str, lib: FlashAttnLib | None, inputs: tuple, causal: bool) -> dict:
    """Extra device memory of one forward call of `system` on `inputs`: torch's peak allocation
    during prepare + call minus its allocation before (outputs, workspaces and masks count);
    for ours also the device's free-byte change across the call (cudaMalloc outside torch)
    and fa_run_info.workspace_bytes."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prepared = prepare_system(system, lib, [inputs], causal)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    with prepared.context():
        result = prepared.calls[0]()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    peak = torch.cuda.max_memory_allocated()
    memory = {"extra_bytes": int(peak - base), "torch_peak_minus_baseline": int(peak - base)}
    if system == "ours":
        outside = int(free_before - free_after)
        memory.update(out_lse_bytes=int(prepared.out.nbytes + prepared.lse.nbytes),
                      device_free_drop_across_call=outside,
                      workspace_bytes=int(prepared.forward_calls[0].info.workspace_bytes))
        memory["extra_bytes"] = int(peak - base) + max(outside, 0)
    del result, prepared
    return memory


# --- the run ---------------------------------------------------------------------------------

def base_row(cfg: Config, system: str, dtype: str) -> dict:
    return {"system": system, "hdim": cfg.hdim, "causal": cfg.causal, "seqlen": cfg.seqlen,
            "batch": cfg.batch, "heads": cfg.heads, "dtype": dtype, "status": "ok",
            "reason": None, "ms": None, "ms_min": None, "ms_max": None, "reps": None,
            "tflops": None, "error": None, "check": None, "memory": None}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def record_failure(row: dict, e: Exception) -> None:
    """Marks a result row as not run (n/a: the system refused the shape) or failed, with the
    reason: one system's failure must not end the run."""
    import torch
    if isinstance(e, NotAvailable):
        row.update(status="n/a", reason=str(e)[:500])
    elif isinstance(e, torch.cuda.OutOfMemoryError):
        row.update(status="error", reason="out of memory: " + first_line(e))
    else:
        row.update(status="error", reason=first_line(e))


def check_rejected(call: Callable[[], Any], untouched: Callable[[], bool]) -> tuple[bool, str]:
    """Runs a call the library must refuse: passes when it raises an invalid-argument status
    with a message and untouched() still holds (nothing was written); returns (ok, message)."""
    try:
        call()
        return False, "no error raised"
    except FlashAttnError as e:
        return (e.status == FA_ERROR_INVALID_ARGUMENT and bool(e.message) and untouched()), str(e)


def cuda_healthy() -> bool:
    """False once the CUDA context is unusable (a sticky error such as an illegal address)."""
    import torch
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def prepare_row(system: str, cfg: Config, sets: list[tuple], lib: FlashAttnLib | None,
                args: argparse.Namespace, check: bool) -> tuple[dict, Prepared | None]:
    """One row up to its timing: prepare, first call, correctness check (ours, when `check`).
    Returns the row and the prepared system (None where it failed or was refused: the row
    says what happened). Never raises for a failure of the system itself."""
    import torch
    row = base_row(cfg, system, args.dtype)
    element_size = torch.empty((), dtype=torch_dtype(args.dtype)).element_size()
    if system == "naive" and naive_bytes(cfg, element_size) > args.naive_budget_gib * GIB:
        row.update(status="skipped", reason=f"would need "
                   f"{naive_bytes(cfg, element_size) / GIB:.0f} GiB (budget "
                   f"{args.naive_budget_gib:g} GiB)")
        return row, None
    prepared = None
    try:
        prepared = prepare_system(system, lib, sets, cfg.causal)
        try:
            first_call(system, prepared)
        except NotAvailable as refusal:
            if system not in SDPA_BACKENDS:
                raise
            # A backend that refuses the (B, S, H, D)-strided views may take (B, H, S, D).
            prepared = None
            prepared = prepare_sdpa(system, sets, cfg.causal, contiguous=True)
            try:
                first_call(system, prepared)
            except NotAvailable:
                raise refusal from None
            row["layout"] = f"contiguous (B, H, S, D) copies; the views were refused: {refusal}"
        if check:
            try:
                row["check"] = check_ours(prepared, sets, cfg.causal, args.dtype,
                                          with_peer=not args.skip_peers and "flash" in args.peers)
            except Exception as e:  # the check's own failure (e.g. memory) is not fatal
                row["check"] = {"ok": False, "failed": "the check raised " + first_line(e)}
            row["error"] = row["check"].get("max_abs_vs_peer",
                                            row["check"].get("max_abs_out_vs_fp64"))
        if system == "ours":
            row["workspace_bytes"] = int(prepared.forward_calls[0].info.workspace_bytes)
        return row, prepared
    except Exception as e:
        record_failure(row, e)
        return row, None


def time_calls(calls: Sequence[Callable[[], Any]], context: Callable[[], AbstractContextManager],
               target_s: float, max_reps: int) -> Timing:
    """One system timed alone (time_interleaved with one round); raises what the calls raise."""
    timed = time_interleaved({"alone": (calls, context)}, target_s, max_reps, rounds=1)["alone"]
    if timed.error is not None:
        raise timed.error
    return timed.timing


def record_timing(row: dict, timed: Timed, flops: float) -> None:
    """Puts a system's time_interleaved result into its row: the time and TFLOP/s, and the
    wall-clock windows of its rounds (scripts/clock_windows.py matches a clock log to them)."""
    if timed.error is not None:
        record_failure(row, timed.error)
        return
    t = timed.timing
    row.update(ms=t.ms, ms_min=t.ms_min, ms_max=t.ms_max, reps=t.reps,
               tflops=flops / (t.ms * 1e-3) / 1e12, timed_windows=timed.windows)


def build_grid(args: argparse.Namespace) -> list[Config]:
    causal = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    return [Config(h, c, s) for h in args.hdims for c in causal for s in args.seqlens]


def run_benchmark(args: argparse.Namespace, meta: dict, lib: FlashAttnLib | None) -> list[dict]:
    """Every config of the grid; writes the outputs after each config so that a partial run
    still leaves its results behind."""
    import torch
    systems = ["ours"] + ([] if args.skip_peers else list(args.peers))
    grid = build_grid(args)
    checked: set[tuple[int, bool]] = set()
    rows: list[dict] = []
    started = time.monotonic()
    healthy = True
    for index, cfg in enumerate(grid):
        over_budget = time.monotonic() - started > args.time_budget_s
        if over_budget or not healthy:
            reason = ("time budget (--time-budget-s) spent" if healthy
                      else "CUDA context lost earlier in the run")
            for system in systems:
                rows.append({**base_row(cfg, system, args.dtype), "status": "skipped",
                             "reason": reason})
            continue
        try:
            sets = make_inputs(cfg, args.dtype, args.rotate_mib * MIB, args.seed + index)
        except Exception as e:
            for system in systems:
                rows.append({**base_row(cfg, system, args.dtype), "status": "error",
                             "reason": "inputs: " + first_line(e)})
            continue
        config_rows = {}
        ready: dict[str, Prepared] = {}
        for system in systems:
            check = system == "ours" and (cfg.hdim, cfg.causal) not in checked
            row, prepared = prepare_row(system, cfg, sets, lib, args, check)
            if check and row["status"] != "n/a":
                checked.add((cfg.hdim, cfg.causal))
            config_rows[system] = row
            rows.append(row)
            if prepared is not None:
                ready[system] = prepared
            if row["status"] == "error" and not cuda_healthy():
                healthy = False
                for rest in systems[systems.index(system) + 1:]:
                    rows.append({**base_row(cfg, rest, args.dtype), "status": "skipped",
                                 "reason": "CUDA context lost earlier in the run"})
                break
        if healthy and ready:
            timed = time_interleaved({s: (p.calls, p.context) for s, p in ready.items()},
                                     args.target_s, args.repeat)
            for system, result in timed.items():
                record_timing(config_rows[system], result, cfg.flops)
            if any(r.error is not None for r in timed.values()) and not cuda_healthy():
                healthy = False
        del ready
        torch.cuda.empty_cache()  # naive's score matrices back before the memory figures
        if healthy and cfg.hdim == MEMORY_HDIM and cfg.seqlen in args.memory_seqlens:
            for system, row in config_rows.items():
                if row["status"] != "ok":
                    continue
                try:
                    row["memory"] = measure_memory(system, lib, sets[0], cfg.causal)
                except Exception as e:
                    row["memory"] = {"error": first_line(e)}
                torch.cuda.empty_cache()
        del sets
        torch.cuda.empty_cache()
        print_progress(cfg, config_rows)
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        write_outputs(args.out, meta, rows, chart=False)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    return rows


def print_progress(cfg: Config, config_rows: dict[str, dict]) -> None:
    cells = []
    for system, row in config_rows.items():
        if row["status"] == "ok":
            cells.append(f"{system} {row['tflops']:6.1f}")
        else:
            cells.append(f"{system} {row['status']}")
    print(f"{cfg.label()}: " + "  ".join(cells) + "  TFLOP/s", flush=True)
    for system, row in config_rows.items():
        if row["status"] in ("error", "n/a") and row["reason"]:
            print(f"    {system}: {row['status']}: {row['reason'][:200]}", flush=True)
        check = row.get("check")
        if check:
            peer = (f", max|ours-{check['peer']}| {fmt_e(check.get('max_abs_vs_peer'))}"
                    if check.get("peer") else "")
            print(f"    check {'ok' if check['ok'] else 'FAILED: ' + check['failed']}: "
                  f"max|out-fp64| {fmt_e(check.get('max_abs_out_vs_fp64'))}, max|lse-fp64| "
                  f"{fmt_e(check.get('max_abs_lse_vs_fp64'))}{peer}", flush=True)


# --- outputs --------------------------------------------------------------------------------

def cudnn_version() -> str | None:
    import torch
    try:
        return str(torch.backends.cudnn.version())
    except Exception as e:
        return f"unknown ({first_line(e)})"


def run_metadata(args: argparse.Namespace, lib: FlashAttnLib | None, lib_error: str | None):
    import torch
    props = torch.cuda.get_device_properties(0)
    return {
        "benchmark": "flashattn GPU forward",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable] + sys.argv),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(0),
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / GIB, 1),
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / MIB, 1),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": cudnn_version(),
        "python": platform.python_version(),
        "library": args.lib,
        "library_version": lib.version() if lib else None,
        "library_cuda_compiled": lib.cuda_compiled() if lib else None,
        "library_error": lib_error,
        "dtype": args.dtype,
        "grid": {"hdims": args.hdims, "seqlens": args.seqlens, "causal": args.causal,
                 "batch": f"{TOKENS}/seqlen", "heads": f"{MODEL_WIDTH}/hdim"},
        "timing": {"method": "CUDA events per call, median", "target_s": args.target_s,
                   "min_reps": MIN_REPS, "max_reps": args.repeat,
                   "rotate_mib": args.rotate_mib},
        "flops": "4*B*H*S*S*D, halved when causal",
        "naive": "bf16/fp16 matmuls; softmax over half-precision scores (fp32 inside "
                 "torch.softmax); causal mask by masked_fill_",
        "memory": "extra_bytes = peak torch allocation during prepare+call minus allocation "
                  "before (inputs excluded; outputs, workspaces, masks included); for ours "
                  "plus the device free-byte drop across the call",
    }


def fmt_tflops(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return {"n/a": "n/a", "skipped": "skip", "error": "err"}.get(row["status"], "?")
    mark = " (!)" if row.get("check") and not row["check"]["ok"] else ""
    return f"{row['tflops']:.1f}{mark}"


def fmt_e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def ratio(a: dict | None, b: dict | None) -> float | None:
    if a and b and a["status"] == "ok" and b["status"] == "ok":
        return a["tflops"] / b["tflops"]
    return None


def seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def index_rows(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["hdim"], r["causal"], r["seqlen"], r["system"]): r for r in rows}


def performance_table(rows: list[dict]) -> str:
    """The markdown table: rows hdim x causal x seqlen, columns TFLOP/s and ratios."""
    by_key = index_rows(rows)
    configs = sorted({(r["hdim"], r["causal"], r["seqlen"]) for r in rows})
    lines = ["| hdim | causal | seqlen | ours | flash | cudnn | efficient | naive | "
             "ours/flash | ours/cudnn |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for h, c, s in configs:
        cells = {x: by_key.get((h, c, s, x)) for x in ("ours",) + PEERS}
        ratios = [ratio(cells["ours"], cells[p]) for p in ("flash", "cudnn")]
        lines.append(f"| {h} | {'yes' if c else 'no'} | {seqlen_label(s)} | " +
                     " | ".join(fmt_tflops(cell) for cell in cells.values()) + " | " +
                     " | ".join("" if r is None else f"{r:.2f}" for r in ratios) + " |")
    return "\n".join(lines)


def min_ratio_line(rows: list[dict], peer: str) -> str:
    by_key = index_rows(rows)
    found = []
    for (h, c, s, system), row in by_key.items():
        if system == "ours":
            r = ratio(row, by_key.get((h, c, s, peer)))
            if r is not None:
                found.append((r, h, c, s))
    if not found:
        return f"min ours/{peer} ratio over the grid: n/a (no config where both ran)"
    r, h, c, s = min(found)
    return (f"min ours/{peer} ratio over the grid: {r:.3f} (hdim {h}, "
            f"{'causal' if c else 'non-causal'}, seqlen {seqlen_label(s)}; {len(found)} configs)")


def memory_table(rows: list[dict]) -> str:
    measured = [r for r in rows if r.get("memory") and "extra_bytes" in r["memory"]]
    if not measured:
        return ""
    lines = ["| hdim | causal | seqlen | system | extra MiB | notes |",
             "|---:|---|---:|---|---:|---|"]
    for r in sorted(measured, key=lambda r: (r["hdim"], r["causal"], r["seqlen"],
                                             (("ours",) + PEERS).index(r["system"]))):
        m = r["memory"]
        notes = ""
        if r["system"] == "ours":
            notes = (f"out+lse {m['out_lse_bytes'] / MIB:.1f} MiB, workspace "
                     f"{m['workspace_bytes']} B, device free-byte drop across the call "
                     f"{m['device_free_drop_across_call'] / MIB:.1f} MiB")
        lines.append(f"| {r['hdim']} | {'yes' if r['causal'] else 'no'} | "
                     f"{seqlen_label(r['seqlen'])} | {r['system']} | "
                     f"{m['extra_bytes'] / MIB:,.1f} | {notes} |")
    return "\n".join(lines)


def checks_table(rows: list[dict]) -> str:
    checked = [r for r in rows if r.get("check")]
    if not checked:
        return ""
    lines = ["| hdim | causal | seqlen | max abs out vs fp64 | max abs lse vs fp64 | peer | "
             "max abs vs peer | peer vs fp64 | result |",
             "|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for r in checked:
        e = r["check"]
        lines.append(
            f"| {r['hdim']} | {'yes' if r['causal'] else 'no'} | {seqlen_label(r['seqlen'])} | "
            f"{fmt_e(e.get('max_abs_out_vs_fp64'))} | {fmt_e(e.get('max_abs_lse_vs_fp64'))} | "
            f"{e.get('peer') or '-'} | {fmt_e(e.get('max_abs_vs_peer'))} | "
            f"{fmt_e(e.get('peer_max_abs_vs_fp64'))} | "
            f"{'ok' if e['ok'] else 'FAILED: ' + e['failed']} |")
    return "\n".join(lines)


def notes_list(rows: list[dict]) -> str:
    seen = {}
    for r in rows:
        if r["status"] != "ok" and r["reason"]:
            seen.setdefault((r["system"], r["status"], r["reason"]), []).append(
                f"{r['hdim']}/{'c' if r['causal'] else 'n'}/{seqlen_label(r['seqlen'])}")
    return "\n".join(f"- {system} {status} ({', '.join(where)}): {reason}"
                     for (system, status, reason), where in seen.items())


def render_markdown(meta: dict, rows: list[dict]) -> str:
    head = (f"# flashattn forward, {meta['dtype']}, {meta['device']}\n\n"
            f"{meta['date']}; torch {meta['torch']} (CUDA {meta['torch_cuda']}, cuDNN "
            f"{meta['cudnn']}); flashattn {meta['library_version']}; batch = {TOKENS}/seqlen, "
            f"heads = {MODEL_WIDTH}/hdim. TFLOP/s with fwd = 4*B*H*S*S*D (halved when causal), "
            f"median of CUDA-event-timed calls over rotating inputs. `(!)`: ours failed its "
            f"correctness check on that config.\n\n`{meta['command']}`\n")
    parts = [head, "## TFLOP/s\n", performance_table(rows), "",
             min_ratio_line(rows, "flash"), "", min_ratio_line(rows, "cudnn"), ""]
    for title, table in (("## Correctness of ours", checks_table(rows)),
                         ("## Forward extra memory", memory_table(rows)),
                         ("## Notes", notes_list(rows))):
        if table:
            parts += [title + "\n", table, ""]
    parts.append(f"Naive: {meta['naive']}. Memory: {meta['memory']}.\n")
    return "\n".join(parts)


def plot_chart(path: str, meta: dict, rows: list[dict]) -> None:
    """One panel per (causal, hdim): TFLOP/s against seqlen (log2), a line per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    hdims = sorted({r["hdim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    style = {"ours": dict(color="#d62728", lw=3.0, marker="o", ms=7, zorder=5),
             "flash": dict(color="#1f77b4", lw=1.5, marker="s", ms=4),
             "cudnn": dict(color="#2ca02c", lw=1.5, marker="^", ms=4),
             "efficient": dict(color="#9467bd", lw=1.5, marker="v", ms=4),
             "naive": dict(color="#7f7f7f", lw=1.2, marker="x", ms=4, ls="--")}
    fig, axes = plt.subplots(len(causals), len(hdims), squeeze=False, sharex=True,
                             figsize=(4.6 * len(hdims), 3.6 * len(causals)))
    by_key = index_rows(rows)
    for i, causal in enumerate(causals):
        for j, hdim in enumerate(hdims):
            ax = axes[i][j]
            for system in ("ours",) + PEERS:
                pts = [(s, by_key[(hdim, causal, s, system)]["tflops"]) for s in seqlens
                       if by_key.get((hdim, causal, s, system), {}).get("status") == "ok"]
                if pts:
                    ax.plot(*zip(*pts), label=system, **style[system])
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens)
            ax.set_xticklabels([seqlen_label(s) for s in seqlens])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"hdim {hdim}, {'causal' if causal else 'non-causal'}")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(causals) - 1:
                ax.set_xlabel("sequence length")
    handles, labels = [], []
    for ax in axes.flat:
        for hnd, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(hnd)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(f"Attention forward, {meta['dtype']}, {meta['device']} "
                 f"(batch x seqlen = {TOKENS}, heads x hdim = {MODEL_WIDTH})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def json_safe(x: Any) -> Any:
    """x with non-finite floats as strings ("nan", "inf"), so that the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def write_outputs(out_dir: str, meta: dict, rows: list[dict], chart: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(json_safe({"meta": meta, "rows": rows}), f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(render_markdown(meta, rows))
    if chart and rows:
        plot_chart(os.path.join(out_dir, "forward_tflops.png"), meta, rows)


# --- command line ---------------------------------------------------------------------------

def parse_seqlen(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def int_list(parse: Callable[[str], int]) -> Callable[[str], list[int]]:
    def convert(text: str) -> list[int]:
        try:
            return [parse(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return convert


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="flashattn GPU forward benchmark against torch SDPA (flash, cudnn, "
                    "efficient) and naive attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lib", default="build-gpu/src/libflashattn_c.so",
                   help="path to libflashattn_c.so")
    p.add_argument("--out", default="bench-gpu-forward", help="output folder")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--hdims", type=int_list(int), default=list(DEFAULT_HDIMS),
                   help="comma-separated head dims")
    p.add_argument("--seqlens", type=int_list(parse_seqlen), default=list(DEFAULT_SEQLENS),
                   help="comma-separated sequence lengths (512,1k,2k,...)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--repeat", type=int, default=100,
                   help=f"most timed calls per system and config (at least {MIN_REPS} run)")
    p.add_argument("--target-s", type=float, default=0.3,
                   help="timed seconds to aim for per system and config")
    p.add_argument("--rotate-mib", type=int, default=256,
                   help="input sets rotate until they exceed this many MiB (L2 is 60 MB)")
    p.add_argument("--naive-budget-gib", type=float, default=40.0,
                   help="skip naive where 3*B*H*S*S*2 bytes exceed this")
    p.add_argument("--memory-seqlens", type=int_list(parse_seqlen),
                   default=list(DEFAULT_MEMORY_SEQLENS),
                   help=f"seqlens (at hdim {MEMORY_HDIM}) whose forward extra memory is measured")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="configs not started after this many seconds are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: hdim 64,128, seqlen 512,2k, short timing")
    p.add_argument("--skip-peers", action="store_true", help="ours only")
    p.add_argument("--peers", type=peer_list_of(PEERS), default=list(PEERS),
                   help="comma-separated subset of " + ",".join(PEERS) + " (default: all)")
    p.add_argument("--self-test-cpu", action="store_true",
                   help="check the ctypes binding on the CPU backend with numpy, then exit")
    args = p.parse_args(argv)
    if args.quick:
        args.hdims = [h for h in args.hdims if h in QUICK_HDIMS] or list(QUICK_HDIMS)
        args.seqlens = [s for s in args.seqlens if s in QUICK_SEQLENS] or list(QUICK_SEQLENS)
        args.repeat = min(args.repeat, 10)
        args.target_s = min(args.target_s, 0.1)
        if not set(args.memory_seqlens) & set(args.seqlens):
            args.memory_seqlens = [max(args.seqlens)]
    if args.repeat < 1 or args.target_s <= 0:
        p.error("--repeat must be >= 1 and --target-s > 0")
    for s in args.seqlens:
        if s <= 0 or TOKENS % s:
            p.error(f"seqlen {s}: must divide {TOKENS} (batch = {TOKENS}/seqlen)")
    for h in args.hdims:
        if h <= 0 or MODEL_WIDTH % h:
            p.error(f"hdim {h}: must divide {MODEL_WIDTH} (heads = {MODEL_WIDTH}/hdim)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test_cpu:
        return self_test_cpu(args.lib)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to benchmark", file=sys.stderr)
        return 2
    lib, lib_error = None, None
    try:
        lib = FlashAttnLib(args.lib)
    except Exception as e:
        lib_error = first_line(e)
        print(f"ours: cannot load {args.lib}: {lib_error}", file=sys.stderr)
    meta = run_metadata(args, lib, lib_error)
    print(f"{meta['device']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, flashattn "
          f"{meta['library_version']} ({args.lib}), {args.dtype}", flush=True)
    torch.manual_seed(args.seed)
    rows: list[dict] = []
    try:
        with torch.inference_mode():
            rows = run_benchmark(args, meta, lib)
    finally:
        try:
            write_outputs(args.out, meta, rows, chart=True)
        except Exception as e:
            print(f"writing the outputs failed: {first_line(e)}", file=sys.stderr)
    print()
    print(performance_table(rows))
    print(min_ratio_line(rows, "flash"))
    if not args.skip_peers:
        print(min_ratio_line(rows, "cudnn"))
    bad = [r for r in rows if r["system"] == "ours" and (
        r["status"] == "error" or (r.get("check") and not r["check"]["ok"]))]
    if bad:
        print(f"ours: {len(bad)} config(s) failed or were marked (see results.md)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
