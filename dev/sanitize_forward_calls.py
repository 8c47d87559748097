"""A few forward calls for compute-sanitizer (dev/gpu_patches_session.sh, dev/gpu_pending.sh):
dense calls on the TMA kernel's two- and three-consumer shapes (causal, GQA, several tiles a CTA),
varlen with empty and one-row sequences, and an fp8 call whose v the library copies (d, seqlen)-
major. Prints each output's finiteness; the sanitizer's report is the result."""
import torch, flashattn
g = torch.Generator(device="cuda").manual_seed(1)
def finite(x):  # on the host: a torch reduction on the GPU draws a racecheck report of its own
    return bool(x.float().cpu().isfinite().all())
def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)
# dense: two consumers (128, 256), three (64), causal, GQA, several tiles a CTA
for d, causal, hq, hk, sq, sk in ((128, False, 4, 4, 333, 517), (128, True, 8, 2, 700, 700), (256, False, 2, 2, 300, 257),
                                   (64, False, 4, 4, 1100, 4500), (64, True, 4, 1, 513, 1000)):
    q, k, v = rnd(2, sq, hq, d), rnd(2, sk, hk, d), rnd(2, sk, hk, d)
    o = flashattn.flash_attn_func(q, k, v, causal=causal)
    print("dense", d, causal, finite(o))
# varlen, empty and one-row sequences among them
lens = [0, 1, 130, 700, 64, 257]
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
n = sum(lens)
for d, causal in ((128, True), (256, False), (64, False)):
    q, k, v = rnd(n, 4, d), rnd(n, 2, d), rnd(n, 2, d)
    o = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    print("varlen", d, causal, finite(o))
# fp8 with 2100 query rows per key: the copy patch runs it on a (d, seqlen)-major copy of v
x = [rnd(2, s, 2, 128, dtype=torch.float32) for s in (2100, 333, 333)]
(q8, qd), (k8, kd), (v8, vd) = (flashattn.quantize_fp8(t) for t in x)
o = flashattn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
torch.cuda.synchronize()
print("fp8", finite(o))
