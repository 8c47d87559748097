"""Scratch (issue 32): the CPU engine against torch SDPA's CPU kernel, through the installed
package, on this machine's threads (THREADS, default 2): fp32/bf16 forward GFLOP/s at a few
shapes (batch 1, 8 heads), then ours alone: a causal forward + backward, a decode step over an
8k cache (GQA 32/8, hdim 128) and a chunked prefill. Best of 5 wall-clock calls each.

    python3 dev/cpu_vs_torch.py
"""
import os
import time

import torch

import flashattn

torch.set_num_threads(int(os.environ.get("THREADS", "2")))


def best_s(fn, reps=5):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    print(f"threads {torch.get_num_threads()}")
    for seqlen, hdim, causal, dtype in [(1024, 64, False, torch.float32), (2048, 128, True, torch.float32),
                                        (2048, 128, False, torch.float32), (1024, 64, True, torch.bfloat16)]:
        q, k, v = (torch.randn(1, seqlen, 8, hdim, dtype=dtype) for _ in range(3))
        flops = 4 * 8 * seqlen * seqlen * hdim / (2 if causal else 1)
        ours = best_s(lambda: flashattn.flash_attn_func(q, k, v, causal=causal))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        theirs = best_s(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
        print(f"seqlen {seqlen} hdim {hdim} causal {causal} {dtype}: ours {flops / ours / 1e9:.0f} GFLOP/s, "
              f"torch {flops / theirs / 1e9:.0f}, ours/torch {theirs / ours:.2f}")
    q, k, v = (torch.randn(1, 1024, 8, 64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 1024, 8, 64)
    t = best_s(lambda: torch.autograd.grad(flashattn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout))
    print(f"forward + backward, seqlen 1024 hdim 64 causal fp32: {t * 1e3:.2f} ms")
    qd, kc, vc = torch.randn(1, 1, 32, 128), torch.randn(1, 8192, 8, 128), torch.randn(1, 8192, 8, 128)
    lengths = torch.full((1,), 8192, dtype=torch.int32)
    t = best_s(lambda: flashattn.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lengths), 20)
    print(f"decode, 8k cache, GQA 32/8, hdim 128, fp32: {t * 1e6:.0f} us ({2 * kc.numel() * 4 / t / 1e9:.1f} GB/s)")
    qp, kp = torch.randn(4, 16, 32, 128), torch.randn(4, 4096, 8, 128)
    lengths = torch.full((4,), 4096, dtype=torch.int32)
    t = best_s(lambda: flashattn.flash_attn_with_kvcache(qp, kp, kp, cache_seqlens=lengths, causal=True), 10)
    print(f"chunked prefill, batch 4 x 16 queries, 4k cache: {t * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
