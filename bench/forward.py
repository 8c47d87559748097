#!/usr/bin/env python3
"""The forward through the installed package, as users call it:

    out = flashattn.flash_attn_func(q, k, v, causal=causal)      # q, k, v (B, S, H, D)

against PyTorch SDPA forced to FlashAttention-2 ("fa2") and to cuDNN ("cudnn") on the same
tensors, over the grid (batch = 16384 / seqlen, heads = 2048 / hdim; bf16 by default). Every
shape reports TFLOP/s (4*B*H*S*S*D, halved when causal) of EAGER calls and of KERNEL time
(the calls replayed from a CUDA graph); bench/harness.py describes the method. Writes
forward.json and forward.md in --out, a chart forward.png, and prints the table last.
Exit status 1 when a check of ours failed.
"""
from __future__ import annotations

import harness as h


def make_sets(shape: h.Shape, args) -> list[tuple]:
    """Input sets (q, k, v), together beyond --rotate-mib."""
    dtype = h.torch_dtype(args.dtype)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.hdim)
    per_set = 4 * shape.batch * shape.seqlen * shape.heads * shape.hdim * dtype.itemsize
    gen = h.generator(args.device, args.seed)
    return [tuple(h.random_tensors([dims] * 3, dtype, args.device, gen))
            for _ in range(h.set_count(per_set, args.rotate_mib * h.MIB))]


def check(shape: h.Shape, sets: list[tuple], args) -> dict:
    """Ours on the first set, its outputs on poisoned memory, against the float64 reference
    on two (batch, head) slices and against the first peer that takes the shape."""
    import torch
    from flashattn import flash_attn_func
    q, k, v = sets[0]
    blocks = [(q.shape, q.dtype), ((shape.batch, shape.heads, shape.seqlen), torch.float32)]
    with h.poisoned_allocations(args.device, blocks) as addresses:
        out, lse, _ = flash_attn_func(q, k, v, causal=shape.causal, return_attn_probs=True)
    poisoned = out.data_ptr() in addresses and lse.data_ptr() in addresses
    peer, peer_out = h.first_working_peer(args, lambda: h.sdpa_call(q, k, v, shape.causal))
    pairs = sorted({(0, 0), (shape.batch - 1, shape.heads - 1)})
    return h.check_attention(out, lse, q, lambda b, hh: (k[b, :, hh], v[b, :, hh]),
                             shape.causal, args.dtype, pairs, peer, peer_out, poisoned)


def measure(shape: h.Shape, args, target_s: float) -> dict:
    """One row: the check and every system's eager and kernel TFLOP/s at this shape."""
    from flashattn import flash_attn_func
    sets = make_sets(shape, args)
    row = shape.fields() | {"check": check(shape, sets, args)}

    def ours(q, k, v):
        return lambda: flash_attn_func(q, k, v, causal=shape.causal)

    def peer(q, k, v):
        return lambda: h.sdpa_call(q, k, v, shape.causal)

    systems = [h.System("ours", [ours(*s) for s in sets])]
    systems += h.peer_systems(args, lambda name: [peer(*s) for s in sets])
    return h.time_row(row, systems, args, target_s, flops=shape.flops(backward=False))


if __name__ == "__main__":
    raise SystemExit(h.main_over_grid(__doc__, "flashattn forward (flash_attn_func)",
                                      "forward", measure))
