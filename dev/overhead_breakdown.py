"""Scratch (issue 28): where the host time of a tiny call goes, on a CUDA device.

Times, per call, loops of back-to-back calls (wall clock, one synchronisation at the end) of
the layers under the public functions, so that the differences between lines show each
layer's cost: the C++ call with its descriptors built once, the implementation function, the
public function, and with autograd the training step (forward + torch.autograd.grad), ours
beside SDPA's flash and cuDNN backends. Then a torch.profiler table of one layer's CUDA
runtime calls and Python ops. Prints a table; --out writes it as JSON too.

    python3 dev/overhead_breakdown.py [--out DIR] [--calls 2000]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
import torch.nn.functional as F

import flashattn
from flashattn import torch_ops as ops


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def sdpa(q, k, v, backend):
    with torch.nn.attention.sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 16, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    out, lse = ops._fwd_impl(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False, None)
    B = torch.nn.attention.SDPBackend
    rows = {}

    # Forward layers.
    descs = [ops._desc(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"))]
    opts = ops._options(None, False, -1, -1, 0.0, None, False)
    stream = ops._execution(q)
    rows["fwd: _C.forward, descriptors prebuilt"] = per_call_us(
        lambda: ops._C.forward(*descs, None, **opts, **stream), args.calls)
    rows["fwd: _fwd_impl (allocation, descriptors)"] = per_call_us(
        lambda: ops._fwd_impl(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False, None, False),
        args.calls)
    rows["fwd: flash_attn_func"] = per_call_us(lambda: flashattn.flash_attn_func(q, k, v), args.calls)
    rows["fwd: sdpa flash"] = per_call_us(lambda: sdpa(q, k, v, B.FLASH_ATTENTION), args.calls)
    rows["fwd: sdpa cudnn"] = per_call_us(lambda: sdpa(q, k, v, B.CUDNN_ATTENTION), args.calls)

    # Backward layers.
    bdescs = [ops._desc(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"),
                                           (lse, "lse"))]
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    gdescs = [ops._desc(t, n) for t, n in ((dq, "dq"), (dk, "dk"), (dv, "dv"))]
    rows["bwd: _C.backward, descriptors prebuilt"] = per_call_us(
        lambda: ops._C.backward(*bdescs, *gdescs, **opts, **stream), args.calls)
    rows["bwd: _bwd_impl"] = per_call_us(
        lambda: ops._bwd_impl(dout, q, k, v, out, lse, None, 0.0, None, False, -1, -1, 0.0, None, False),
        args.calls)
    rows["fwd (grad): flash_attn_func, no backward"] = per_call_us(
        lambda: flashattn.flash_attn_func(qg, kg, vg), args.calls)
    rows["step: flash_attn_func + autograd.grad"] = per_call_us(
        lambda: torch.autograd.grad(flashattn.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout), args.calls)
    for name, backend in (("flash", B.FLASH_ATTENTION), ("cudnn", B.CUDNN_ATTENTION)):
        rows[f"fwd (grad): sdpa {name}, no backward"] = per_call_us(lambda: sdpa(qg, kg, vg, backend), args.calls)
        rows[f"step: sdpa {name} + autograd.grad"] = per_call_us(
            lambda: torch.autograd.grad(sdpa(qg, kg, vg, backend), (qg, kg, vg), dout), args.calls)
    # The step as bench/overhead.py times it: on a side stream, rotating through 4 input sets.
    sets = [tuple(torch.randn_like(q).requires_grad_() for _ in range(3)) + (torch.randn_like(q),)
            for _ in range(4)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    turn = [0]

    def rotating(forward):
        def step():
            a, b, c, d = sets[turn[0] % 4]
            turn[0] += 1
            return torch.autograd.grad(forward(a, b, c), (a, b, c), d)
        return step
    with torch.cuda.stream(side):
        rows["step, side stream: flash_attn_func + autograd.grad"] = per_call_us(
            lambda: torch.autograd.grad(flashattn.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout), args.calls)
        rows["step, side stream, 4 sets: flash_attn_func"] = per_call_us(
            rotating(flashattn.flash_attn_func), args.calls)
        for name, backend in (("flash", B.FLASH_ATTENTION), ("cudnn", B.CUDNN_ATTENTION)):
            rows[f"step, side stream, 4 sets: sdpa {name}"] = per_call_us(
                rotating(lambda a, b, c, backend=backend: sdpa(a, b, c, backend)), args.calls)
    torch.cuda.synchronize()
    # autograd alone: a trivial differentiable op of the same shape.
    rows["step: q * 2 + autograd.grad (autograd's own cost)"] = per_call_us(
        lambda: torch.autograd.grad(qg * 2, (qg,), dout), args.calls)

    # Decode layers: batch 1, 32 heads, 8 kv heads, an 8k dense cache.
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), 8192, dtype=torch.int32, device=dev)
    rows["decode: flash_attn_with_kvcache"] = per_call_us(
        lambda: flashattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens), args.calls)
    rows["decode: _fwd_kvcache_impl"] = per_call_us(
        lambda: ops._fwd_kvcache_impl(qd, kc, vc, seqlens, None, None, None, None, False, None, None, None,
                                      None, False, -1, -1, 0.0, None, 0, False), args.calls)
    od = torch.empty_like(qd)
    kdescs = [ops._desc(t, n) for t, n in ((qd, "q"), (kc, "k_cache"), (vc, "v_cache"),
                                           (seqlens, "cache_seqlens"), (od, "out"))]
    rows["decode: _C.forward_kvcache, descriptors prebuilt"] = per_call_us(
        lambda: ops._C.forward_kvcache(*kdescs, None, num_splits=0, **opts, **stream), args.calls)
    def sdpa_decode(backend):
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qd.transpose(1, 2), kc.transpose(1, 2),
                                                  vc.transpose(1, 2), enable_gqa=True)
    for name, backend in (("flash", B.FLASH_ATTENTION), ("cudnn", B.CUDNN_ATTENTION)):
        try:
            rows[f"decode: sdpa {name} (gqa)"] = per_call_us(lambda: sdpa_decode(backend), args.calls)
        except Exception as e:  # a backend that refuses the shape
            rows[f"decode: sdpa {name} (gqa)"] = f"refused: {str(e).splitlines()[0][:80]}"

    # Where the step's host time goes: the CUDA runtime calls and ops of 200 steps.
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(200):
            torch.autograd.grad(flashattn.flash_attn_func(qg, kg, vg), (qg, kg, vg), dout)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    step = rotating(flashattn.flash_attn_func)
    with torch.cuda.stream(side), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof3:
        for _ in range(200):
            step()
        torch.cuda.synchronize()
    table += "\n\nThe same on a side stream, 4 input sets:\n" + prof3.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof2:
        for _ in range(200):
            flashattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens)
        torch.cuda.synchronize()
    table2 = prof2.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overhead_breakdown.json").write_text(json.dumps(rows, indent=1))
        (args.out / "overhead_profile.txt").write_text(table + "\n\n" + table2)
    print(table)
    print(table2)
    for name, us in rows.items():
        print(f"{name:58s} {us if isinstance(us, str) else f'{us:8.1f} us'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
