"""Shared code of the benchmarks in bench/: they time the installed package `flashattn` as
users call it (flash_attn_func, the backward through autograd, flash_attn_with_kvcache).

Method, the same for every script:

- Inputs: several sets of one shape whose bytes together exceed --rotate-mib (256 MiB by
  default; the H200's L2 holds 60 MB), and consecutive calls rotate through them, so that no
  call finds its inputs in L2 from the call before.
- Systems of one shape (ours and the peers) are timed side by side: each system's samples
  are split over ROUNDS rounds, the order of the systems rotated by one per round, so that a
  clock or thermal drift during the run touches all of them alike (time_interleaved).
- Two times per system, each the median over its samples, per call:
  EAGER   CUDA events around a sample of back-to-back calls exactly as a user makes them
          (Python, the dispatcher and the launches included), divided by the calls;
  KERNEL  the same calls captured in one CUDA graph (after a warm-up on the side stream all
          the work runs on), events around each replay, divided by the calls it holds: the
          GPU's time without the host.
- Peers: PyTorch SDPA forced to one backend, SDPBackend.FLASH_ATTENTION ("fa2") or
  SDPBackend.CUDNN_ATTENTION ("cudnn"), given q.transpose(1, 2) views of the same tensors (no
  copies). A peer that refuses a shape or fails to capture is recorded with its reason.
- Correctness of ours before timing: outputs on NaN-poisoned memory, against a float64
  reference on a slice and against a peer on the whole output.
- Output: <name>.json (rows + run metadata), <name>.md (the tables) and, when matplotlib is
  installed, charts; the last thing printed is a short markdown table.

`--device cpu` runs ours alone on tiny shapes with the CPU backend (a smoke test for CI):
wall-clock timing, no CUDA graphs, no peers, each omission recorded with its reason.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import pathlib
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_ROTATE_MIB = 256
MAX_INPUT_SETS = 32
ROUNDS = 3          # timed rounds per shape: each system's samples are split over them
MIN_REPS = 5        # samples per system and method, at least
SAMPLE_MS = 2.0     # the calls in one sample (one event pair, one graph) last about this long
MAX_CALLS_PER_SAMPLE = 200
PEERS = {"fa2": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
METHODS = ("eager", "kernel")
# The bound on ours against the float64 reference, relative to the reference's magnitude,
# when no peer's own error is there to scale it (the CPU smoke runs).
REFERENCE_TOLERANCE = {"bf16": 2.0 ** -6, "fp16": 2.0 ** -8, "fp32": 1e-5}
# The slack on top of twice the peer's own float64 error, relative to the magnitude.
PEER_SLACK = 2.0 ** -9
LSE_TOLERANCE = 1e-2  # absolute, natural log; the lse is fp32
CUDA_GRAPH_UNAVAILABLE = "CUDA graphs need a CUDA device"
PEERS_UNAVAILABLE = "the SDPA peers are CUDA backends"
BENCH_DIR = pathlib.Path(__file__).resolve().parent

Sampler = Callable[[int, int], list]  # (first sample index, count) -> ms per call of each


# --- arguments -------------------------------------------------------------------------------

def parser(description: str) -> argparse.ArgumentParser:
    """The options every script takes."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu-results"),
                   help="directory for the JSON, markdown and charts (created; default "
                        "./gpu-results, where scripts/gpu.sh puts results)")
    p.add_argument("--quick", action="store_true", help="a few small shapes, short timing")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: ours only, tiny shapes, the CPU backend (a smoke test)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--rotate-mib", type=int, default=DEFAULT_ROTATE_MIB,
                   help="the input sets of a shape exceed this many MiB together")
    p.add_argument("--target-s", type=float, default=0.4,
                   help="seconds of samples per system and method (at most)")
    p.add_argument("--repeat", type=int, default=100,
                   help="samples per system and method, at most")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="comma-separated peers among " + ", ".join(PEERS) + " ('' for none)")
    p.add_argument("--seed", type=int, default=0)
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Applies what --device and --quick imply; exits with a message when CUDA is asked for
    and absent."""
    import torch
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        sys.exit(f"--peers: unknown {unknown}; known: {list(PEERS)}")
    args.peer_list = peers if args.device == "cuda" else []
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device (run with --device cpu for the "
                 "CPU smoke test)")
    if args.device == "cuda":
        import flashattn
        if not flashattn.cuda_compiled():
            sys.exit(f"--device cuda: the installed flashattn ({flashattn.__file__}) was built "
                     "without the CUDA backend")
    if args.device == "cuda" and args.dtype == "fp32":
        sys.exit("--dtype fp32: the CUDA backend takes fp16 and bf16")
    if args.quick:
        args.target_s = min(args.target_s, 0.1)
        args.repeat = min(args.repeat, 20)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# --- shapes ----------------------------------------------------------------------------------

TOKENS = 16384       # batch * seqlen at every point of the grid
MODEL_WIDTH = 2048   # heads * hdim at every point of the grid
GRID_HDIMS = (64, 128, 256)
GRID_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_HDIMS = (64, 128)
QUICK_SEQLENS = (512, 2048)
# --device cpu: tiny shapes, a smoke test of the path, not a measurement.
CPU_HDIMS = (32, 64)
CPU_SEQLENS = (64, 128)
CPU_QUICK_HDIMS = (32,)
CPU_QUICK_SEQLENS = (64,)
CPU_BATCH, CPU_HEADS = 2, 2


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    hdim: int
    causal: bool

    def fields(self) -> dict:
        return {"hdim": self.hdim, "causal": self.causal, "seqlen": self.seqlen,
                "batch": self.batch, "heads": self.heads}

    def flops(self, backward: bool = False) -> float:
        count = backward_flops if backward else forward_flops
        return count(self.batch, self.heads, self.seqlen, self.seqlen, self.hdim, self.causal)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"d{self.hdim} {mask} s{seqlen_label(self.seqlen)} b{self.batch}h{self.heads}"


def add_grid_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hdims", type=int, nargs="+", help=f"default {list(GRID_HDIMS)}")
    p.add_argument("--seqlens", type=int, nargs="+", help=f"default {list(GRID_SEQLENS)}")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both")


def grid_shapes(args: argparse.Namespace) -> list[Shape]:
    """The grid: batch = TOKENS / seqlen, heads = MODEL_WIDTH / hdim (the same tokens and
    model width at every point); on the CPU, tiny shapes."""
    if args.device == "cpu":
        hdims = args.hdims or (CPU_QUICK_HDIMS if args.quick else CPU_HDIMS)
        seqlens = args.seqlens or (CPU_QUICK_SEQLENS if args.quick else CPU_SEQLENS)
    else:
        hdims = args.hdims or (QUICK_HDIMS if args.quick else GRID_HDIMS)
        seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else GRID_SEQLENS)
    causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    shapes = []
    for hdim in hdims:
        for causal in causals:
            for seqlen in seqlens:
                if args.device == "cpu":
                    shapes.append(Shape(CPU_BATCH, CPU_HEADS, seqlen, hdim, causal))
                else:
                    shapes.append(Shape(max(1, TOKENS // seqlen), max(1, MODEL_WIDTH // hdim),
                                        seqlen, hdim, causal))
    return shapes


def random_tensors(shapes: Sequence[tuple], dtype, device: str, generator) -> list:
    import torch
    return [torch.randn(s, dtype=dtype, device=device, generator=generator) for s in shapes]


def generator(device: str, seed: int):
    import torch
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# --- FLOP and byte counts --------------------------------------------------------------------

def forward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, hdim: int,
                  causal: bool) -> float:
    """Two matmuls of 2*Sq*Sk*D FLOPs per (batch, head); half of them under a causal mask."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * hdim
    return flops / 2 if causal else flops


def backward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, hdim: int,
                   causal: bool) -> float:
    """Five matmuls to the forward's two (dV, dP, dS->dQ, dK and the recomputed S): 2.5x."""
    return 2.5 * forward_flops(batch, heads, seqlen_q, seqlen_k, hdim, causal)


def kv_bytes(batch: int, seqlen: int, kv_heads: int, hdim: int, element_size: int) -> int:
    """The bytes of K and V a decode step must read."""
    return 2 * batch * seqlen * kv_heads * hdim * element_size


def set_count(bytes_per_set: int, rotate_bytes: int) -> int:
    """Input sets for a shape: enough that together they exceed rotate_bytes, at least two."""
    return max(2, min(MAX_INPUT_SETS, rotate_bytes // max(bytes_per_set, 1) + 1))


def seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


# --- timing ----------------------------------------------------------------------------------

@dataclass
class Timing:
    ms: float          # median over the samples, per call
    ms_min: float
    ms_max: float
    samples: int
    calls_per_sample: int = 1


@dataclass
class Timed:
    """One system's result from time_interleaved: its timing and the wall-clock windows of
    its rounds, or the exception that stopped it."""
    timing: Timing | None = None
    windows: list = field(default_factory=list)
    error: Exception | None = None


def time_interleaved(samplers: dict[str, Sampler], target_s: float, max_reps: int,
                     rounds: int = ROUNDS) -> dict[str, Timed]:
    """Times already-warmed systems of one shape side by side. `samplers` maps a name to a
    function (first sample index, count) -> the milliseconds per call of each sample; the
    index lets a sampler continue its rotation through the input sets. Three samples of each
    size its run (about target_s in all, between MIN_REPS and max_reps samples); the samples
    are then split over `rounds` rounds, every system taking its share in each round, the
    order rotated by one system per round. The median is over all of a system's samples. A
    system that raises is left out of the later rounds, its exception returned; the others
    go on."""
    result = {name: Timed() for name in samplers}
    reps: dict[str, int] = {}
    for name, sample in samplers.items():
        try:
            estimate = sorted(sample(1, 3))[1]
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
            began = time.time()
            try:
                samples[name] += samplers[name](len(samples[name]), n)
            except Exception as e:
                result[name].error = e
                continue
            result[name].windows.append([round(began, 3), round(time.time(), 3)])
    for name, times in samples.items():
        if result[name].error is None and times:
            times = sorted(times)
            result[name].timing = Timing(ms=times[len(times) // 2], ms_min=times[0],
                                         ms_max=times[-1], samples=len(times))
    return result


def calls_per_sample(ms_per_call: float) -> int:
    """Calls in one sample so that it lasts about SAMPLE_MS (event resolution and the gaps
    between samples then weigh little)."""
    return max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_MS / max(ms_per_call, 1e-4))))


def rotation(calls: Sequence[Callable[[], Any]], per_sample: int, start: int):
    """The calls of sample `start` on: sample j makes calls per_sample*j .. per_sample*(j+1)-1
    of the endless rotation through the input sets."""
    i = start * per_sample
    while True:
        yield calls[i % len(calls)]
        i += 1


def eager_sampler(device: str, calls: Sequence[Callable[[], Any]], per_sample: int,
                  context: Callable[[], Any] = contextlib.nullcontext) -> Sampler:
    """Samples of per_sample back-to-back calls. CUDA: an event pair around each sample on
    the current stream, all samples queued before one synchronisation (the host runs ahead as
    in a user's loop); CPU: the wall clock."""
    import torch

    def sample(start: int, n: int) -> list[float]:
        step = rotation(calls, per_sample, start)
        with context():
            if device != "cuda":
                times = []
                for _ in range(n):
                    began = time.perf_counter()
                    for _ in range(per_sample):
                        next(step)()
                    times.append((time.perf_counter() - began) * 1e3 / per_sample)
                return times
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(n)]
            for begin, end in events:
                begin.record()
                for _ in range(per_sample):
                    next(step)()
                end.record()
            events[-1][1].synchronize()
        return [begin.elapsed_time(end) / per_sample for begin, end in events]

    return sample


def capture_graph(calls: Sequence[Callable[[], Any]], per_sample: int,
                  context: Callable[[], Any] = contextlib.nullcontext):
    """One CUDA graph of per_sample calls rotating through the input sets, captured on the
    current stream (the side stream of on_side_stream, where the warm-up ran). What the calls
    return is dropped during the capture, so the graph's pool reuses it from call to call."""
    import torch
    graph = torch.cuda.CUDAGraph()
    step = rotation(calls, per_sample, 0)
    with context():
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
            for _ in range(per_sample):
                next(step)()
    return graph


def replay_sampler(graph, per_sample: int) -> Sampler:
    """Samples of one replay each, an event pair around it, all queued before one
    synchronisation."""
    import torch

    def sample(start: int, n: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for begin, end in events:
            begin.record()
            graph.replay()
            end.record()
        events[-1][1].synchronize()
        return [begin.elapsed_time(end) / per_sample for begin, end in events]

    return sample


@contextlib.contextmanager
def on_side_stream(device: str):
    """All CUDA work of a run on one side stream: PyTorch's documented place for the warm-up
    before a capture, and the stream the capture then records (the backward's kernels run on
    the stream of their forward, so forward, eager timing and capture share it)."""
    if device != "cuda":
        yield
        return
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@dataclass
class System:
    """One contender at one shape: its calls (one per input set, as a user makes them), the
    context they run in (the SDPA backend choice for a peer), and why it cannot run, if so."""
    name: str
    calls: list
    context: Callable[[], Any] = contextlib.nullcontext
    error: str | None = None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:600]


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def warm_up(system: System, device: str) -> None:
    """One call per input set outside any timing (first-call setup, cuDNN plans, the
    allocator's blocks); a system that raises is marked with the reason."""
    if system.error:
        return
    try:
        with system.context():
            for call in system.calls:
                call()
        synchronize(device)
    except Exception as e:
        system.error = first_line(e)
        synchronize_quietly(device)


def synchronize_quietly(device: str) -> None:
    """Drains the GPU after a failure; a sticky CUDA error then shows here."""
    try:
        synchronize(device)
    except Exception as e:  # pragma: no cover - only a broken context
        warnings.warn(f"CUDA after a failure: {first_line(e)}")


def time_systems(systems: list[System], device: str, target_s: float,
                 max_reps: int) -> dict[str, dict]:
    """Eager then kernel times of the systems of one shape, side by side. Returns per system
    {"eager": Timing dict | None, "kernel": ..., "error": reason of the whole system,
    "kernel_error": why there is no kernel time}."""
    for system in systems:
        warm_up(system, device)
    live = [s for s in systems if not s.error]
    per_sample: dict[str, int] = {}
    for system in live:
        # One untimed sample of one call per set sizes the samples of the eager run.
        try:
            ms = eager_sampler(device, system.calls, len(system.calls), system.context)(0, 1)[0]
            per_sample[system.name] = calls_per_sample(ms)
        except Exception as e:
            system.error = first_line(e)
            synchronize_quietly(device)
    live = [s for s in live if not s.error]
    results = {s.name: {"eager": None, "kernel": None, "error": s.error, "kernel_error": None}
               for s in systems}
    eager = time_interleaved({s.name: eager_sampler(device, s.calls, per_sample[s.name], s.context)
                              for s in live}, target_s, max_reps)
    for s in live:
        record(results[s.name], "eager", eager[s.name], per_sample[s.name], device)
    if device != "cuda":
        for s in live:
            results[s.name]["kernel_error"] = CUDA_GRAPH_UNAVAILABLE
        return results
    graphs, samplers = {}, {}
    for s in live:
        if results[s.name]["eager"] is None:
            continue
        # At least one call per input set, so that the replays rotate through all of them.
        n = max(len(s.calls), calls_per_sample(results[s.name]["eager"]["ms"]))
        try:
            graphs[s.name] = capture_graph(s.calls, n, s.context)
            graphs[s.name].replay()  # the first replay uploads the graph: not timed
            synchronize(device)
            samplers[s.name] = replay_sampler(graphs[s.name], n)
            per_sample[s.name] = n
        except Exception as e:
            results[s.name]["kernel_error"] = "capture: " + first_line(e)
            synchronize_quietly(device)
    kernel = time_interleaved(samplers, target_s, max_reps)
    for name in samplers:
        record(results[name], "kernel", kernel[name], per_sample[name], device)
    del graphs, samplers
    return results


def record(result: dict, method: str, timed: Timed, per_sample: int, device: str) -> None:
    if timed.error is not None:
        key = "error" if method == "eager" else "kernel_error"
        result[key] = f"{method} timing: " + first_line(timed.error)
        synchronize_quietly(device)
        return
    timed.timing.calls_per_sample = per_sample
    result[method] = asdict(timed.timing) | {"windows": timed.windows}


def add_rates(result: dict, flops: float | None = None, nbytes: float | None = None) -> None:
    """Adds tflops (or tbps, the bytes' rate) to each of a system's timings."""
    for method in METHODS:
        t = result.get(method)
        if t is None:
            continue
        if flops is not None:
            t["tflops"] = flops / (t["ms"] * 1e-3) / 1e12
        if nbytes is not None:
            t["tbps"] = nbytes / (t["ms"] * 1e-3) / 1e12


def rate(result: dict | None, method: str, key: str) -> float | None:
    t = (result or {}).get(method)
    return None if t is None else t[key]


def release_memory(device: str) -> None:
    if device == "cuda":
        import gc
        import torch
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --- peers -----------------------------------------------------------------------------------

def sdpa_context(peer: str):
    """The context that forces SDPA onto one backend. Torch says why a backend refuses a
    shape in warnings and raises "No available kernel": the warnings are kept out of the
    output and their first lines added to the exception's message, which is what the row
    records. (A backend that runs warns nothing, so the timed calls record nothing.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @contextlib.contextmanager
    def context():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([getattr(SDPBackend, PEERS[peer])]):
                    yield
            except RuntimeError as e:
                why = "; ".join(dict.fromkeys(str(w.message).strip().split("\n")[0]
                                              for w in caught))
                if not why:
                    raise
                raise RuntimeError(f"{first_line(e)} ({why})"[:600]) from e
    return context


def sdpa_call(q, k, v, causal: bool, enable_gqa: bool = False, dropout_p: float = 0.0):
    """SDPA on (B, S, H, D) tensors through (B, H, S, D) views; the output comes back as a
    (B, S, H, D) view. No copy is made by the call's arguments."""
    import torch.nn.functional as F
    extra = {"enable_gqa": True} if enable_gqa else {}
    if dropout_p > 0:
        extra["dropout_p"] = dropout_p
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), is_causal=causal,
                                          **extra).transpose(1, 2)


def peer_systems(args, make_calls: Callable[[str], list]) -> list[System]:
    """The peers asked for, each with the calls make_calls(peer) builds, or the reason there
    are none (CPU run, refusal while building)."""
    systems = []
    for peer in args.peer_list:
        try:
            systems.append(System(peer, make_calls(peer), sdpa_context(peer)))
        except Exception as e:
            systems.append(System(peer, [], error=first_line(e)))
    return systems


def skipped_peers(args) -> dict[str, dict]:
    """The peers not run on a CPU run, with the reason."""
    if args.device == "cuda":
        return {}
    return {p: {"eager": None, "kernel": None, "error": PEERS_UNAVAILABLE, "kernel_error": None}
            for p in args.peers.split(",") if p}


# --- correctness -----------------------------------------------------------------------------

@contextlib.contextmanager
def poisoned_allocations(device: str, blocks_of: Iterable[tuple]):
    """NaN-filled blocks, one per (shape, dtype), allocated and freed before the block runs,
    so that the caching allocator hands them to the outputs the call allocates: an element
    the call does not write stays NaN. Yields the set of their addresses; whether an output
    got one is reported ("poisoned"), since the allocator promises nothing."""
    import torch
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device=device)
              for shape, dtype in blocks_of]
    synchronize(device)
    addresses = {b.data_ptr() for b in blocks}
    del blocks
    yield addresses


def reference_rows(q_rows, k, v, positions, seqlen_q: int, causal: bool,
                   window: tuple = (-1, -1), softcap: float = 0.0, alibi_slope=None):
    """Float64 attention of some query rows of one head: q_rows (r, D), k and v (Sk, D),
    positions (r,) the rows' indices among seqlen_q queries; the masks bottom-right aligned
    (query i's diagonal is key i + Sk - Sq: causal sees keys j <= it, window (left, right)
    keys [it - left, it + right], -1 unbounded). In docs/SPEC.md's order: the scaled scores,
    softcap * tanh(s / softcap) when softcap > 0, -alibi_slope * |diagonal - j| when a slope
    is given, the masks. Returns out (r, D) and lse (r,)."""
    import torch
    q64, k64, v64 = q_rows.double(), k.double(), v.double()
    scores = (q64 @ k64.T) * (q_rows.shape[-1] ** -0.5)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(k.shape[0], device=k.device)[None, :]
    diagonal = positions.to(k.device)[:, None] + (k.shape[0] - seqlen_q)
    if alibi_slope is not None:
        scores -= float(alibi_slope) * (diagonal - keys).abs()
    left, right = window
    right = 0 if causal else right
    if right >= 0:
        scores.masked_fill_(keys > diagonal + right, float("-inf"))
    if left >= 0:
        scores.masked_fill_(keys < diagonal - left, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[:, None]) @ v64, lse


def sample_rows(seqlen: int, count: int = 128):
    """Evenly spaced row indices, the first and the last included."""
    import torch
    n = min(seqlen, count)
    return torch.linspace(0, seqlen - 1, n).round().long().unique()


def max_abs(a, b) -> float:
    """Max |a - b| in float64; NaN anywhere gives inf."""
    d = (a.double() - b.double()).abs()
    return float("inf") if bool(d.isnan().any()) else float(d.max()) if d.numel() else 0.0


# One unit in the last place of the storage dtype, relative: two correct kernels that round
# the same exact value to the dtype may differ by it at any element, the largest included.
ULP = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10, "fp32": 2.0 ** -23}


def max_beyond_ulp(a, b, dtype: str) -> float:
    """Max of |a - b| less one ulp of |b| (float64), over the whole tensors: how far ours is
    from a peer beyond the rounding step they may legitimately differ by. NaN gives inf."""
    d = (a.double() - b.double()).abs() - ULP[dtype] * b.double().abs()
    return float("inf") if bool(d.isnan().any()) else max(float(d.max()), 0.0) if d.numel() else 0.0


def alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's slopes: 2^(-8/n), 2^(-16/n), ... for n heads a power of two; for
    other n those of the power of two below, then every other slope of the one above."""
    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    if math.log2(heads).is_integer():
        return power_of_two(heads)
    below = 2 ** math.floor(math.log2(heads))
    return power_of_two(below) + alibi_slopes(2 * below)[0::2][:heads - below]


def verdict(ours_err: float, scale: float, dtype: str, peer_err: float | None,
            peer_diff: float | None, factor: float = 2.0, slack: float = PEER_SLACK) -> tuple:
    """Ours passes when its float64 error is within factor x the peer's own plus slack x
    scale (the magnitude of what is compared), or with no peer REFERENCE_TOLERANCE x scale,
    and its distance from the peer within that bound plus the peer's error. Returns
    (ok, figures)."""
    if peer_err is None:
        bound = REFERENCE_TOLERANCE[dtype] * scale
    else:
        bound = factor * peer_err + slack * scale
    ok = ours_err <= bound
    figures = {"max_abs_vs_fp64": ours_err, "bound_vs_fp64": bound}
    if peer_diff is not None:
        figures |= {"max_beyond_ulp_vs_peer": peer_diff, "peer_max_abs_vs_fp64": peer_err,
                    "bound_vs_peer": bound + peer_err}
        ok = ok and peer_diff <= bound + peer_err
    return ok, figures


def check_attention(out, lse, q, kv_of: Callable, causal: bool, dtype: str, pairs,
                    peer_name: str | None, peer_out, poisoned: bool,
                    window: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None) -> dict:
    """Ours's out (B, Sq, H, D) and lse (B, H, Sq) (None: not checked) on the (batch, head)
    pairs against the float64 reference of sample_rows of the queries (kv_of(b, h) gives the
    key and value rows (Sk, D) query head h reads), and against a peer's out on the whole
    tensor. window, softcap and alibi_slopes ((H,) or (B, H)) as flash_attn_func takes them
    (reference_rows). Non-finite elements fail it."""
    seqlen_q = q.shape[1]
    rows = sample_rows(seqlen_q)
    ours_err = peer_err = lse_err = scale = 0.0
    for b, h in pairs:
        k, v = kv_of(b, h)
        slope = None if alibi_slopes is None else \
            alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
        ref, ref_lse = reference_rows(q[b, rows.to(q.device), h], k, v, rows, seqlen_q, causal,
                                      window, softcap, slope)
        scale = max(scale, float(ref.abs().max()))
        ours_err = max(ours_err, max_abs(out[b, rows.to(out.device), h], ref))
        if lse is not None:
            lse_err = max(lse_err, max_abs(lse[b, h, rows.to(lse.device)], ref_lse))
        if peer_out is not None:
            peer_err = max(peer_err, max_abs(peer_out[b, rows.to(out.device), h], ref))
    finite = bool(out.isfinite().all()) and (lse is None or bool(lse.isfinite().all()))
    # Outputs are averages of values of magnitude ~1: the bound's floor is absolute below 1.
    ok, figures = verdict(ours_err, max(scale, 1.0), dtype,
                          peer_err if peer_out is not None else None,
                          max_beyond_ulp(out, peer_out, dtype) if peer_out is not None else None)
    if lse is not None:
        figures |= {"max_abs_lse_vs_fp64": lse_err, "bound_lse": LSE_TOLERANCE}
        ok = ok and lse_err <= LSE_TOLERANCE
    return {"ok": ok and finite, "finite": finite, "poisoned": poisoned, "peer": peer_name,
            "slices": [list(p) for p in pairs], "rows_per_slice": int(rows.numel())} | figures


def first_working_peer(args, run: Callable[[], Any], peers: Sequence[str] | None = None):
    """(name, result) of the first peer (of `peers`, default all asked for) whose context runs
    `run`, or (None, None)."""
    for peer in args.peer_list if peers is None else [p for p in args.peer_list if p in peers]:
        try:
            with sdpa_context(peer)():
                return peer, run()
        except Exception:
            synchronize_quietly(args.device)
    return None, None


# --- output ----------------------------------------------------------------------------------

def git_commit() -> str | None:
    """The commit measured: a COMMIT file at the repository's root where there is one (a
    snapshot copied to a GPU machine, whose .git may not be the tree's), else git's HEAD."""
    named = BENCH_DIR.parent / "COMMIT"
    if named.is_file():
        return named.read_text().strip() or None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH_DIR, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=BENCH_DIR, text=True, capture_output=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) if commit else None


def run_metadata(benchmark: str, args: argparse.Namespace) -> dict:
    import flashattn
    import torch
    meta = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv),
        "commit": git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flashattn": flashattn.__version__,
        "flashattn_file": flashattn.__file__,
        "flashattn_cuda_compiled": flashattn.cuda_compiled(),
        "device": args.device,
        "dtype": args.dtype,
        "peers": args.peer_list,
        "timing": {"eager": "CUDA events around samples of back-to-back calls as a user "
                            "makes them, per call; median" if args.device == "cuda" else
                            "wall clock around samples of back-to-back calls, per call; median",
                   "kernel": "the same calls in one CUDA graph, events around replays, per "
                             "call; median",
                   "rounds": ROUNDS, "min_samples": MIN_REPS, "max_samples": args.repeat,
                   "target_s": args.target_s, "sample_ms": SAMPLE_MS,
                   "rotate_mib": args.rotate_mib},
    }
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        meta |= {
            "gpu": torch.cuda.get_device_name(),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "l2_mib": round(getattr(props, "L2_cache_size", 0) / MIB, 1),
            "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }
    else:
        meta["cpu"] = platform.processor() or platform.machine()
    return meta


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, digits: int = 1) -> str:
    """digits decimals; three significant digits for the small rates of a CPU run."""
    if x is None:
        return "n/a"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def write_json(path: pathlib.Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")


def rate_table(rows: list[dict], label: Callable[[dict], str], systems: Sequence[str],
               key: str, unit: str) -> str:
    """Per row: eager then kernel rate of each system, and ours over each peer (eager and
    kernel). rows carry {"results": {system: result}}; a system without a time shows n/a."""
    header = ["shape"] + [f"{s} eager {unit}" for s in systems] \
        + [f"{s} kernel {unit}" for s in systems] \
        + [f"ours/{s} eager, kernel" for s in systems if s != "ours"]
    body = []
    for row in rows:
        res = row["results"]
        eager = [rate(res.get(s), "eager", key) for s in systems]
        kernel = [rate(res.get(s), "kernel", key) for s in systems]
        cells = [label(row)] + [fmt(x, 2 if key == "tbps" else 1) for x in eager + kernel]
        for i, s in enumerate(systems):
            if s != "ours":
                pair = [ratio(eager[0], eager[i]), ratio(kernel[0], kernel[i])]
                cells.append(", ".join(x or "-" for x in pair) if any(pair) else "")
        body.append(cells)
    return markdown_table(header, body)


def failure_notes(rows: list[dict], label: Callable[[dict], str]) -> str:
    """The reasons a system has no time at some shapes (refusals, capture failures), one
    line per system and reason."""
    shapes_of: dict[tuple, list] = {}
    for row in rows:
        for name, res in row["results"].items():
            for key in ("error", "kernel_error"):
                if res.get(key):
                    shapes_of.setdefault((name, key, res[key]), []).append(label(row))
    notes = []
    for (name, key, reason), shapes in shapes_of.items():
        where = "every shape" if len(shapes) == len(rows) else ", ".join(shapes)
        what = "no time" if key == "error" else "no kernel time"
        notes.append(f"- {name}, {what} ({where}): {reason}")
    return "\n".join(notes)


def check_notes(rows: list[dict], label: Callable[[dict], str]) -> str:
    bad = [f"- {label(r)}: check FAILED {r['check']}" for r in rows
           if r.get("check") and not r["check"]["ok"]]
    return "\n".join(bad)


def line_chart(path: pathlib.Path, title: str, panels: dict[str, list[tuple[str, list, list]]],
               xlabel: str, ylabel: str) -> str | None:
    """One PNG of line plots: panels maps a panel title to its (label, xs, ys) lines. Returns
    why no chart was made (matplotlib missing), else None."""
    if not panels:
        return "no chart: nothing was measured"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no chart: {first_line(e)}"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (panel, lines) in zip(axes[0], panels.items()):
        for label, xs, ys in lines:
            if any(y is not None for y in ys):  # a gap where a system has no time
                ax.plot(range(len(xs)), [math.nan if y is None else y for y in ys],
                        marker="o", label=label, linestyle="-" if "ours" in label else "--")
        ax.set_xticks(range(len(lines[0][1])) if lines else [])
        ax.set_xticklabels([str(x) for x in lines[0][1]] if lines else [])
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def report(args, name: str, meta: dict, rows: list[dict], table: str, notes: str,
           extra: dict | None = None) -> int:
    """Writes <name>.json and <name>.md in --out, prints the table last; returns the exit
    status: 1 when a check of ours failed or ours has no time, else 0."""
    write_json(args.out / f"{name}.json", {"meta": meta, "rows": rows} | (extra or {}))
    failed = any((r.get("check") and not r["check"]["ok"]) or r["results"]["ours"]["eager"] is None
                 for r in rows)
    return report_text(args, name, meta, table, notes, failed)


def report_text(args, name: str, meta: dict, table: str, notes: str, failed: bool,
                printed: str | None = None) -> int:
    """Writes <name>.md (a header with the run's facts, the table, the notes), prints the
    notes and then `printed` (default: the table) last; returns 1 when failed, else 0."""
    head = f"# {meta['benchmark']}\n\n{meta['date']}, commit {meta['commit']}, " \
           f"{meta.get('gpu', meta.get('cpu'))}, torch {meta['torch']}" \
           + (f", cuDNN {meta['cudnn']}" if meta.get("cudnn") else "") \
           + f", {args.dtype}; command: `{meta['command']}`\n\n"
    (args.out / f"{name}.md").write_text(head + table + "\n" + (f"\n{notes}\n" if notes else ""))
    print(f"wrote {name}.md and its data in {args.out}", file=sys.stderr)
    if notes:
        print(notes + "\n")
    print(printed or table)
    return 1 if failed else 0


def progress(row: dict, key: str) -> None:
    """One line per shape on stderr while the run goes."""
    cells = []
    for name, res in row["results"].items():
        eager, kernel = rate(res, "eager", key), rate(res, "kernel", key)
        cells.append(f"{name} {fmt(eager, 2)}/{fmt(kernel, 2)}")
    ok = row.get("check", {}).get("ok")
    print(f"{shape_label(row)}: {', '.join(cells)} (eager/kernel {key})"
          + ("" if ok is None else f", check {'ok' if ok else 'FAILED'}"),
          file=sys.stderr, flush=True)


def shape_label(row: dict) -> str:
    return row.get("label") or Shape(**{k: row[k] for k in
                                        ("batch", "heads", "seqlen", "hdim", "causal")}).label()


def grid_panels(rows: list[dict], key: str, method: str, select=lambda r: r) -> dict:
    """Chart panels of grid rows: one per hdim, a line per (system, mask) over seqlen."""
    panels: dict[str, list] = {}
    for hdim in sorted({r["hdim"] for r in rows}):
        lines = []
        for causal in (False, True):
            mine = sorted((r for r in rows if r["hdim"] == hdim and r["causal"] == causal),
                          key=lambda r: r["seqlen"])
            if not mine:
                continue
            for name in select(mine[0])["results"]:
                lines.append((f"{name} {'causal' if causal else 'full'}",
                              [seqlen_label(r["seqlen"]) for r in mine],
                              [rate(select(r)["results"].get(name), method, key) for r in mine]))
        panels[f"hdim {hdim}"] = lines
    return panels


def finish(args, name: str, meta: dict, rows: list[dict], key: str, unit: str,
           label: Callable[[dict], str] = shape_label, panels: dict | None = None,
           extra: dict | None = None, xlabel: str = "seqlen") -> int:
    """The markdown table (every system, eager and kernel), the notes, the chart and the
    files of a run; returns the exit status."""
    systems = list(rows[0]["results"]) if rows else ["ours"]
    table = rate_table(rows, label, systems, key, unit)
    notes = "\n".join(n for n in (check_notes(rows, label), failure_notes(rows, label)) if n)
    if panels is None:
        panels = grid_panels(rows, key, "eager")
    why = line_chart(args.out / f"{name}.png", f"{meta['benchmark']}: eager {unit}, "
                     f"{meta.get('gpu', meta.get('cpu'))}", panels, xlabel, unit)
    meta["chart"] = why or f"{name}.png"
    return report(args, name, meta, rows, table, notes, extra)


def time_row(row: dict, systems: list[System], args, target_s: float,
             flops: float | None = None, nbytes: float | None = None,
             with_peers: bool = True) -> dict:
    """Times the systems of one shape into row["results"] with their rates (and the peers a
    CPU run skips, with_peers); frees the shape's memory afterwards."""
    results = time_systems(systems, args.device, target_s, args.repeat)
    for result in results.values():
        add_rates(result, flops=flops, nbytes=nbytes)
    row |= {"flops": flops} if flops is not None else {"bytes": nbytes}
    row["results"] = results | (skipped_peers(args) if with_peers else {})
    systems.clear()
    release_memory(args.device)
    return row


def main_over_grid(doc: str, benchmark: str, name: str, measure: Callable,
                   add_args: Callable | None = None) -> int:
    """forward.py's and backward.py's main: measure(shape, args, target_s) over the grid
    (add_args(parser): options of the script's own)."""
    p = parser(doc)
    add_grid_args(p)
    if add_args is not None:
        add_args(p)
    args = finish_args(p.parse_args())
    meta = run_metadata(benchmark, args)
    rows = []
    with on_side_stream(args.device):
        for shape in grid_shapes(args):
            rows.append(measure_safely(measure, shape.fields(), args, shape, args,
                                       args.target_s))
            progress(rows[-1], "tflops")
    return finish(args, name, meta, rows, "tflops", "TFLOP/s")


def measure_safely(measure: Callable[..., dict], fields: dict, args, *more) -> dict:
    """measure(*more) with anything it raises (ours refusing the shape, an out-of-memory,
    a failed check's own error) turned into a row that says so, so that one shape cannot
    end the run. The row's check fails: the run's exit status shows it."""
    try:
        return measure(*more)
    except Exception as e:
        synchronize_quietly(args.device)
        release_memory(args.device)
        reason = first_line(e)
        print(f"{fields.get('label') or shape_label(fields)}: {reason}", file=sys.stderr)
        missing = {"eager": None, "kernel": None, "error": reason, "kernel_error": None}
        return fields | {"check": {"ok": False, "error": reason},
                         "results": {"ours": missing} | {p: dict(missing, error="not run: "
                                                                 + reason)
                                                         for p in PEERS}}
