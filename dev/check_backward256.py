"""The backward at head dims 232-256 against float64 autograd through the Python package: dense
calls (masks, windows, GQA, softcap, ALiBi, both dtypes, a single query row) in the default and
deterministic modes (the deterministic bits compared across two calls), and varlen batches with
empty sequences. Relative error against the largest reference gradient, tolerance 3e-2.

    python3 dev/check_backward256.py [quick|full] [cuda|cpu]   (default: full cuda)

`quick` runs three dense cases (for compute-sanitizer); `cpu` checks the CPU engine, which
checks this script's reference. Exit status 1 on any failure.
"""
import math, sys, torch, flashattn

torch.manual_seed(0)
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"

def reference(q, k, v, dout, causal, window, softcap, slopes):
    # q (sq, h, d), k/v (sk, hk, d); float64 autograd; FA2's bottom-right aligned masks.
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    kk = k.repeat_interleave(h // hk, dim=1)
    vv = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=dev).view(-1, 1)
    j = torch.arange(sk, device=dev).view(1, -1)
    diag = i + sk - sq
    if slopes is not None:
        s = s - slopes.double().view(-1, 1, 1) * (diag - j).abs()
    left, right = window
    if causal:
        right = 0
    mask = torch.zeros(sq, sk, dtype=torch.bool, device=dev)
    if right >= 0:
        mask |= j > diag + right
    if left >= 0:
        mask |= j < diag - left
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vv)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad

def rel(a, b):
    return float((a.double() - b).abs().max() / max(b.abs().max().item(), 1e-6))

worst = 0.0
fails = 0
def check(name, got, ref, tol=3e-2):
    global worst, fails
    e = rel(got, ref)
    worst = max(worst, e)
    if not (e <= tol):
        fails += 1
        print(f"FAIL {name}: rel err {e:.3g}")

cases = [  # (b, sq, sk, h, hk, d, causal, window, softcap, alibi, dtype)
    (2, 200, 333, 4, 2, 256, False, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 257, 257, 2, 1, 256, True, (-1, -1), 0.0, False, torch.float16),
    (2, 130, 400, 4, 4, 232, False, (64, 32), 0.0, False, torch.bfloat16),
    (1, 300, 129, 3, 1, 256, True, (-1, -1), 15.0, False, torch.bfloat16),
    (2, 190, 190, 4, 2, 256, False, (-1, -1), 0.0, True, torch.float16),
    (1, 513, 700, 2, 2, 256, True, (100, -1), 5.0, True, torch.bfloat16),
    (1, 64, 64, 2, 2, 256, False, (-1, -1), 0.0, False, torch.bfloat16),
    (1, 1, 77, 2, 1, 248, False, (-1, -1), 0.0, False, torch.bfloat16),
]
if len(sys.argv) > 1 and sys.argv[1] == "quick":  # for compute-sanitizer
    cases = cases[:2] + cases[3:4]
for (b, sq, sk, h, hk, d, causal, window, softcap, alibi, dt) in cases:
    name = f"b{b} sq{sq} sk{sk} h{h}/{hk} d{d} causal={causal} w={window} cap={softcap} alibi={alibi} {dt}"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device=dev, dtype=dt)
    slopes = (torch.rand(b, h, device=dev) * 0.3).float() if alibi else None
    grads = []
    for det in (False, True, True):
        out = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                        alibi_slopes=slopes, deterministic=det)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    if not all(torch.equal(x, y) for x, y in zip(grads[1], grads[2])):
        fails += 1
        print(f"FAIL {name}: deterministic mode not bitwise reproducible")
    for bi in range(b):
        ro, rq, rk, rv = reference(q[bi], k[bi], v[bi], dout[bi], causal, window, softcap,
                                   slopes[bi] if alibi else None)
        for mode, g in (("default", grads[0]), ("deterministic", grads[1])):
            check(f"{name} [{mode}] dq", g[0][bi], rq)
            check(f"{name} [{mode}] dk", g[1][bi], rk)
            check(f"{name} [{mode}] dv", g[2][bi], rv)
    print(f"done {name}", flush=True)

# varlen with empty sequences, GQA, causal and a softcap case
lens_q = [0, 37, 1, 64, 100, 5]
lens_k = [3, 0, 77, 64, 99, 40]
for (causal, softcap, d) in ((False, 0.0, 256), (True, 0.0, 256), (True, 7.0, 240)):
    h, hk, dt = 4, 2, torch.bfloat16
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=dev)
    q = torch.randn(sum(lens_q), h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn_like(q)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           softcap=softcap)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), dout)
    for s in range(len(lens_q)):
        a, bq = cu_q[s].item(), cu_q[s + 1].item()
        c, bk = cu_k[s].item(), cu_k[s + 1].item()
        if bq == a:
            continue
        if bk == c:
            check(f"varlen seq {s} d{d} dq (no keys: zero)", gq[a:bq], torch.zeros_like(gq[a:bq], dtype=torch.float64) + 1e-30)
            continue
        ro, rq, rk, rv = reference(q[a:bq], k[c:bk], v[c:bk], dout[a:bq], causal, (-1, -1), softcap, None)
        check(f"varlen seq {s} d{d} causal={causal} dq", gq[a:bq], rq)
        check(f"varlen seq {s} d{d} causal={causal} dk", gk[c:bk], rk)
        check(f"varlen seq {s} d{d} causal={causal} dv", gv[c:bk], rv)
    print(f"done varlen d{d} causal={causal} cap={softcap}", flush=True)
if dev == "cuda":
    torch.cuda.synchronize()
print(f"check_backward256: {fails} failures, worst relative error {worst:.3g}")
sys.exit(1 if fails else 0)
