#!/usr/bin/env python3
"""Scratch: a few calls through the installed package that reach each sm90 kernel family, for
running under compute-sanitizer (racecheck, memcheck, synccheck) without building the C++
test suites:

    compute-sanitizer --tool racecheck --error-exitcode 99 python3 dev/sanitize_package.py

The TMA forward (plain and general variants; head dims 64, 128, 256; causal and not), the
TMA backward (64, 128) and the cp.async backward (256), bf16, odd sequence lengths. Each
result is checked loosely against SDPA's math backend, so a race that corrupts shows too."""
import sys

import torch

from flashattn import flash_attn_func


def check(name, got, ref):
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    ok = err <= 2e-2 * max(scale, 1.0)
    print(f"{name}: max error {err:.3g} (largest {scale:.3g}) {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def reference(q, k, v, causal, softcap):
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    s = qt @ kt.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vt).transpose(1, 2)


def main():
    torch.manual_seed(0)
    ok = True
    for d, causal, softcap, grad in [(64, False, 0.0, True), (64, True, 0.0, True),
                                     (128, False, 0.0, True), (128, True, 5.0, False),
                                     (256, True, 0.0, True), (256, False, 0.0, False)]:
        q, k, v = (torch.randn(2, 333, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                   for _ in range(3))
        out = flash_attn_func(q, k, v, causal=causal, softcap=softcap)
        name = f"d{d} causal={causal} softcap={softcap}"
        ok &= check(name + " out", out, reference(q, k, v, causal, softcap))
        if grad:
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            ref = torch.autograd.grad(reference(*leaves, causal, softcap), leaves, dout.float())
            for g, r, n in zip(grads, ref, ("dq", "dk", "dv")):
                ok &= check(f"{name} {n}", g, r)
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
