#!/usr/bin/env python3
"""What one small call costs through the installed package, eager, as users make it:

    out = flashattn.flash_attn_func(q, k, v)                          # tiny forward
    flashattn.flash_attn_func(q, k, v).backward(dout)                 # tiny training step
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache,      # one decode step
                                            cache_seqlens=lengths)

against PyTorch SDPA forced to FlashAttention-2 ("fa2") and to cuDNN ("cudnn") on the same
tensors. The shapes are small enough that the kernel takes a few microseconds, so the EAGER
time per call (back-to-back calls, the host's work included) is what the Python path costs;
the KERNEL time (the calls replayed from a CUDA graph) shows what is left without it
(bench/harness.py describes the method). Tiny: q, k, v (1, 128, 16, 64); training step: the
same with gradients, forward and backward per call; decode: q (1, 1, 32, 128) against a dense
cache of 8192 positions with 8 key/value heads (the peers read the same cache with
enable_gqa=True). Ours's forward and decode outputs are checked against a float64 reference
first (the gradients' checks are backward.py's). Writes
overhead.json and overhead.md in --out and prints the table last (microseconds per call).
"""
from __future__ import annotations

import harness as h

TINY = (1, 128, 16, 64)  # batch, seqlen, heads, hdim
DECODE = (1, 8192, 32, 8, 128)  # batch, cache length, heads, kv heads, hdim
CPU_DECODE = (1, 256, 4, 2, 64)


def tiny_sets(args, grad: bool) -> list[tuple]:
    import torch
    gen = h.generator(args.device, args.seed)
    dtype = h.torch_dtype(args.dtype)
    sets = []
    for _ in range(4):  # a few sets: the calls rotate as in the other benchmarks
        q, k, v, dout = h.random_tensors([TINY] * 4, dtype, args.device, gen)
        if grad:
            for t in (q, k, v):
                t.requires_grad_()
        sets.append((q, k, v, dout))
    return sets


def decode_sets(args) -> list[dict]:
    import torch
    b, s, heads, kv_heads, d = DECODE if args.device == "cuda" else CPU_DECODE
    dtype = h.torch_dtype(args.dtype)
    gen = h.generator(args.device, args.seed)
    per_set = h.kv_bytes(b, s, kv_heads, d, dtype.itemsize)
    sets = []
    for _ in range(h.set_count(per_set, args.rotate_mib * h.MIB)):
        q, k_cache, v_cache = h.random_tensors([(b, 1, heads, d)] + [(b, s, kv_heads, d)] * 2,
                                               dtype, args.device, gen)
        sets.append({"q": q, "k_cache": k_cache, "v_cache": v_cache,
                     "cache_seqlens": torch.full((b,), s, dtype=torch.int32,
                                                 device=args.device)})
    return sets


def check_forward(q, k, v, out_of, args) -> dict:
    """Ours's out and lse (on poisoned memory) against float64 on the first and last
    (batch, head) and against the first peer."""
    import torch
    g = q.shape[2] // k.shape[2]
    blocks = [(out_of(lse=False).shape, q.dtype),
              ((q.shape[0], q.shape[2], q.shape[1]), torch.float32)]
    with h.poisoned_allocations(args.device, blocks) as addresses:
        out, lse = out_of(lse=True)
    poisoned = out.data_ptr() in addresses and lse.data_ptr() in addresses
    peer, peer_out = h.first_working_peer(
        args, lambda: h.sdpa_call(q, k, v, False, enable_gqa=g > 1))
    pairs = sorted({(0, 0), (q.shape[0] - 1, q.shape[2] - 1)})
    return h.check_attention(out.detach(), lse, q.detach(),
                             lambda b, hh: (k[b, :, hh // g].detach(), v[b, :, hh // g].detach()),
                             False, args.dtype, pairs, peer,
                             None if peer_out is None else peer_out.detach(), poisoned)


def measure_tiny(args, target_s: float) -> dict:
    from flashattn import flash_attn_func
    sets = tiny_sets(args, grad=False)
    q, k, v, _ = sets[0]

    def out_of(lse):
        out, softmax_lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
        return (out, softmax_lse) if lse else out

    row = {"label": "tiny forward", "shape": "q, k, v (1, 128, 16, 64)",
           "check": check_forward(q, k, v, out_of, args)}
    systems = [h.System("ours", [lambda s=s: flash_attn_func(*s[:3]) for s in sets])]
    systems += h.peer_systems(args, lambda name: [lambda s=s: h.sdpa_call(*s[:3], False)
                                                  for s in sets])
    return h.time_row(row, systems, args, target_s, flops=h.forward_flops(1, 16, 128, 128, 64,
                                                                          False))


def check_gradients(inputs, args) -> dict:
    """Ours's dq, dk, dv against float64 autograd of the textbook attention, each on its own
    scale, and against the first peer (the bound of backward.py: 3x the peer's own error
    plus 1e-3 of the scale)."""
    import torch
    from flashattn import flash_attn_func
    q, k, v, dout = inputs
    ours = torch.autograd.grad(flash_attn_func(q, k, v), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q64, k64) * q.shape[-1] ** -0.5, dim=-1)
    ref = torch.autograd.grad(torch.einsum("bhqk,bkhd->bqhd", p, v64), (q64, k64, v64),
                              dout.double())
    peer, peer_grads = h.first_working_peer(args, lambda: torch.autograd.grad(
        h.sdpa_call(q, k, v, False), (q, k, v), dout))
    result = {"peer": peer, "ok": True, "finite": True}
    for i, name in enumerate(("dq", "dk", "dv")):
        scale = max(float(ref[i].abs().max()), 1e-30)
        peer_err = None if peer_grads is None else h.max_abs(peer_grads[i], ref[i])
        diff = None if peer_grads is None else h.max_beyond_ulp(ours[i], peer_grads[i],
                                                                 args.dtype)
        ok, figures = h.verdict(h.max_abs(ours[i], ref[i]), scale, args.dtype, peer_err, diff,
                                factor=3.0, slack=1e-3)
        finite = bool(ours[i].isfinite().all())
        result[name] = figures | {"ok": ok and finite}
        result["ok"] = result["ok"] and ok and finite
        result["finite"] = result["finite"] and finite
    return result


def measure_training_step(args, target_s: float) -> dict:
    import torch
    from flashattn import flash_attn_func
    sets = tiny_sets(args, grad=True)

    def step(forward, s):
        q, k, v, dout = s
        return lambda: torch.autograd.grad(forward(q, k, v), (q, k, v), dout)

    row = {"label": "tiny forward + backward", "shape": "q, k, v (1, 128, 16, 64), autograd",
           "check": check_gradients(sets[0], args)}
    systems = [h.System("ours", [step(flash_attn_func, s) for s in sets])]
    systems += h.peer_systems(args, lambda name: [
        step(lambda q, k, v: h.sdpa_call(q, k, v, False), s) for s in sets])
    flops = h.forward_flops(1, 16, 128, 128, 64, False) + h.backward_flops(1, 16, 128, 128, 64,
                                                                           False)
    return h.time_row(row, systems, args, target_s, flops=flops)


def measure_decode(args, target_s: float) -> dict:
    from flashattn import flash_attn_with_kvcache
    sets = decode_sets(args)
    x = sets[0]

    def call(x, lse=False):
        return flash_attn_with_kvcache(x["q"], x["k_cache"], x["v_cache"],
                                       cache_seqlens=x["cache_seqlens"], return_softmax_lse=lse)

    b, s, heads, kv_heads, d = x["q"].shape[0], x["k_cache"].shape[1], x["q"].shape[2], \
        x["k_cache"].shape[2], x["q"].shape[3]
    row = {"label": "decode step", "shape": f"q ({b}, 1, {heads}, {d}), dense cache "
                                            f"({b}, {s}, {kv_heads}, {d})",
           "check": check_forward(x["q"], x["k_cache"], x["v_cache"],
                                  lambda lse: call(x, lse), args)}
    systems = [h.System("ours", [lambda x=x: call(x) for x in sets])]
    systems += h.peer_systems(args, lambda name: [
        lambda x=x: h.sdpa_call(x["q"], x["k_cache"], x["v_cache"], False, enable_gqa=True)
        for x in sets])
    return h.time_row(row, systems, args, target_s,
                      nbytes=h.kv_bytes(b, s, kv_heads, d, x["q"].element_size()))


def table(rows: list[dict], systems: list[str]) -> str:
    def us(row, name, method):
        t = (row["results"].get(name) or {}).get(method)
        return None if t is None else t["ms"] * 1e3

    header = ["call", "shape"] + [f"{s} eager us" for s in systems] + \
        [f"{s} kernel us" for s in systems] + ["ours / best peer, eager"]
    lines = []
    for r in rows:
        peers = [x for x in (us(r, s, "eager") for s in systems if s != "ours") if x]
        lines.append([r["label"], r["shape"]] + [h.fmt(us(r, s, "eager")) for s in systems] +
                     [h.fmt(us(r, s, "kernel")) for s in systems] +
                     [h.ratio(us(r, "ours", "eager"), min(peers) if peers else None)])
    return h.markdown_table(header, lines)


def main() -> int:
    args = h.finish_args(h.parser(__doc__).parse_args())
    meta = h.run_metadata("flashattn per-call cost (eager, small calls)", args)
    rows = []
    with h.on_side_stream(args.device):
        for measure in (measure_tiny, measure_training_step, measure_decode):
            rows.append(h.measure_safely(measure, {"label": measure.__name__}, args, args,
                                         args.target_s))
    systems = list(rows[0]["results"])
    notes = "\n".join(n for n in (h.check_notes(rows, lambda r: r["label"]),
                                  h.failure_notes(rows, lambda r: r["label"])) if n)
    return h.report(args, "overhead", meta, rows, table(rows, systems), notes)


if __name__ == "__main__":
    raise SystemExit(main())
