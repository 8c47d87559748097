#!/usr/bin/env python3
"""One attention call, repeated, for Nsight Compute (scripts/gpu.sh profile): ours through the
installed package (flashattn.flash_attn_func, its backward through autograd, or
flash_attn_with_kvcache), or a peer through PyTorch's SDPA with one backend forced, on the
same inputs, so that the two kernels can be compared metric by metric.

  profile_call.py fwd|bwd ours|flash HDIM SEQLEN CAUSAL(yes|no)
      batch = 16384 / SEQLEN, heads = 2048 / HDIM (the benchmark grid's shapes), bf16
  profile_call.py dec ours|cudnn BATCH CACHE_LEN
      one new token per sequence, 32 query heads over 8 key/value heads, head dim 128, bf16

The call runs five times (CALLS): the profiler skips the first three launches (warm-up).
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import flashattn

PEERS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
CALLS = 5


def randn(*shape, grad=False):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def dense_call(who, backward, hdim, seqlen, causal):
    """A (batch, seqlen, heads, hdim) forward, or forward + backward, as users write it."""
    q, k, v = (randn(16384 // seqlen, seqlen, 2048 // hdim, hdim, grad=backward) for _ in range(3))
    dout = randn(*q.shape)

    def call():
        if who == "ours":
            out = flashattn.flash_attn_func(q, k, v, causal=causal)
        else:  # SDPA takes (batch, heads, seqlen, hdim): transposed views, no copies
            with sdpa_kernel(PEERS[who]):
                out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           is_causal=causal).transpose(1, 2)
        if backward:
            out.backward(dout)
    return call


def decode_call(who, batch, cache_len):
    """One new token per sequence against a full cache of CACHE_LEN keys."""
    q = randn(batch, 1, 32, 128)
    k_cache, v_cache = randn(batch, cache_len, 8, 128), randn(batch, cache_len, 8, 128)
    lengths = torch.full((batch,), cache_len, device="cuda", dtype=torch.int32)

    def call():
        if who == "ours":
            flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
        else:
            with sdpa_kernel(PEERS[who]):
                sdpa(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                     enable_gqa=True)
    return call


def main(argv):
    if len(argv) < 4 or argv[0] not in ("fwd", "bwd", "dec"):
        sys.exit(__doc__)
    pass_, who = argv[0], argv[1]
    if who != "ours" and who not in PEERS:
        sys.exit(f"profile_call.py: unknown system {who!r} (ours, flash or cudnn)")
    if pass_ == "dec":
        call = decode_call(who, int(argv[2]), int(argv[3]))
    else:
        if len(argv) < 5:
            sys.exit(__doc__)
        call = dense_call(who, pass_ == "bwd", int(argv[2]), int(argv[3]), argv[4] == "yes")
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
