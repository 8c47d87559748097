#!/usr/bin/env python3
"""Scratch: one forward call of ours and one of cuDNN's (through PyTorch SDPA) per shape, for
Nsight Compute to profile side by side (launch shape, registers, shared memory, pipes, stalls):

    ncu --profile-from-start off --kernel-name regex:'forward_ws|forward_kernel|cudnn|sdpa|fprop' \
        --section LaunchStats --section SpeedOfLight --section WarpStateStats \
        python3 dev/ncu_forward_peers.py 128:512:no 64:512:yes

Each SHAPE is hdim:seqlen:causal(yes|no) on the grid's batch = 16384/seqlen, heads = 2048/hdim,
bf16. Warm-up calls run before the profiled range.
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn


def main():
    shapes = [a.split(":") for a in sys.argv[1:]] or [["128", "512", "no"]]
    for hdim, seqlen, causal in shapes:
        d, n, c = int(hdim), int(seqlen), causal == "yes"
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def ours():
            return flashattn.flash_attn_func(q, k, v, causal=c)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=c)

        for _ in range(3):
            ours(), cudnn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        ours()
        cudnn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled hdim {d} seqlen {n} causal {c}: batch {b} heads {h}", flush=True)


if __name__ == "__main__":
    main()
