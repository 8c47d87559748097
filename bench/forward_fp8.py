#!/usr/bin/env python3
"""The FP8 (e4m3) forward through the installed package, as users call it:

    q8, qd = flashattn.quantize_fp8(q, num_heads_k=Hk)       # likewise k and v
    out = flashattn.flash_attn_func(q8, k8, v8, causal=causal,
                                    q_descale=qd, k_descale=kd, v_descale=vd)

beside our bf16 forward on the same values (dequantised) and PyTorch SDPA's cuDNN and
FlashAttention-2 backends in bf16 ("cudnn", "fa2"; SDPA has no FP8 attention, and cuDNN's own
FP8 attention needs its frontend, which this benchmark does not load), over the grid (batch =
16384 / seqlen, heads = 2048 / hdim; --hdims 128 256 for the kernel's head dims). TFLOP/s
count 4*B*H*S*S*D (halved when causal) for every system, eager and kernel time
(bench/harness.py). "ours_vt" is the same FP8 call with v given (d, seqlen)-major
(`v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)`, docs/SPEC.md "FP8 inputs"), which
the kernel loads without transposing it. --block-scaling times per-block descales instead of
per-(batch, head) ones. The check: the FP8 call's out against our bf16 call on the dequantised inputs, the
largest difference relative to the largest output (the rounding of the inputs and of P to
e4m3 make a few per cent; the kernel's own accuracy is tests/python/test_fp8.py's). Writes
forward_fp8.{json,md,png} in --out and prints the table last.
"""
from __future__ import annotations

import harness as h


def add_args(p) -> None:
    p.add_argument("--block-scaling", action="store_true",
                   help="descales per block of 128 rows instead of per (batch, head)")


def make_sets(shape: h.Shape, args) -> list[dict]:
    """Input sets: the fp8 tensors with their descales and the bf16 dequantised copies."""
    import torch
    import flashattn
    from flashattn.fp8 import dequantize_fp8
    dims = (shape.batch, shape.seqlen, shape.heads, shape.hdim)
    per_set = 10 * shape.batch * shape.seqlen * shape.heads * shape.hdim  # q, k, v, v again in fp8; q, k, v in bf16
    gen = h.generator(args.device, args.seed)
    sets = []
    for _ in range(h.set_count(per_set, args.rotate_mib * h.MIB)):
        one = {}
        for name, x in zip("qkv", h.random_tensors([dims] * 3, torch.bfloat16, args.device, gen)):
            x8, descale = flashattn.quantize_fp8(x, block_scaling=args.block_scaling)
            one[name + "8"], one[name + "d"] = x8, descale
            one[name] = dequantize_fp8(x8, descale).to(torch.bfloat16)
        one["v8t"] = one["v8"].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # (d, seqlen)-major
        sets.append(one)
    return sets


def fp8_call(s: dict, causal: bool, values: str = "v8"):
    from flashattn import flash_attn_func
    return lambda: flash_attn_func(s["q8"], s["k8"], s[values], causal=causal, q_descale=s["qd"],
                                   k_descale=s["kd"], v_descale=s["vd"])


def check(shape: h.Shape, sets: list[dict]) -> dict:
    from flashattn import flash_attn_func
    s = sets[0]
    ref = flash_attn_func(s["q"], s["k"], s["v"], causal=shape.causal).float()
    scale = ref.abs().max().item()
    result = {"ok": True, "finite": True}
    for values, name in (("v8", "fp8"), ("v8t", "fp8_vt")):
        out = fp8_call(s, shape.causal, values)().float()
        error = (out - ref).abs().max().item() / scale if scale > 0 else 0.0
        finite = bool(out.isfinite().all().item())
        result[f"{name}_vs_bf16_max_relative"] = error
        result["finite"] = result["finite"] and finite
        result["ok"] = result["ok"] and finite and error <= 0.1
    return result


def measure(shape: h.Shape, args, target_s: float) -> dict:
    from flashattn import flash_attn_func
    sets = make_sets(shape, args)
    row = shape.fields() | {"check": check(shape, sets)}

    def bf16(s):
        return lambda: flash_attn_func(s["q"], s["k"], s["v"], causal=shape.causal)

    def peer(s):
        return lambda: h.sdpa_call(s["q"], s["k"], s["v"], shape.causal)

    systems = [h.System("ours", [fp8_call(s, shape.causal) for s in sets]),
               h.System("ours_vt", [fp8_call(s, shape.causal, "v8t") for s in sets]),
               h.System("ours_bf16", [bf16(s) for s in sets])]
    systems += h.peer_systems(args, lambda name: [peer(s) for s in sets])
    return h.time_row(row, systems, args, target_s, flops=shape.flops(backward=False))


if __name__ == "__main__":
    raise SystemExit(h.main_over_grid(__doc__, "flashattn FP8 forward (flash_attn_func, e4m3)",
                                      "forward_fp8", measure, add_args))
