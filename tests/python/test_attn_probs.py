"""return_attn_probs=True with dropout: S_dmask in upstream FlashAttention 2's form (docs/SPEC.md,
"Attention probabilities"), read the way upstream's dropout tests read it: the mask from the
sign (S_dmask >= 0), the probabilities from |S_dmask| through upstream's block normalisation
with _get_block_size_n. Checked: the probabilities against float64, the drop fraction against
dropout_p, the output recomputed from S_dmask against the returned output, the backward
unchanged, the packed and varlen variants, torch.compile, NumPy. On the CPU, and on CUDA when
there is a device and the CUDA backend (skipped otherwise)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

from flashattn import (_C, flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from flashattn.flash_attn_interface import _get_block_size_n  # noqa: E402
from torch_reference import attention_reference, scores_reference  # noqa: E402

_HAS_GPU = torch.cuda.is_available() and _C.cuda_compiled()
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not _HAS_GPU,
                       reason="no CUDA device, or a build without the CUDA backend")])]


def dtype_on(device):
    return torch.float32 if device == "cpu" else torch.float16


def normalize_flash_attn_s(attn_unnorm, scores, block_size_n):
    """Upstream's normalize_flash_attn_S (tests/test_flash_attn.py of FlashAttention 2), on
    float64 scores (B, H, Sq, Sk) with -inf where masked: key block j times exp(m_j - lse),
    m_j the max of the scores over blocks j..last."""
    blocks = scores.split(block_size_n, dim=-1)
    lse = torch.logsumexp(torch.stack([torch.logsumexp(s, dim=-1) for s in blocks], -1), -1)
    lse[lse == float("-inf")] = float("inf")  # a row that sees nothing: exp(m - lse) = 0
    block_max = torch.stack([s.amax(dim=-1) for s in blocks], dim=-1)
    cummax = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1).unbind(dim=-1)
    return torch.cat([a * torch.exp(m - lse)[..., None]
                      for a, m in zip(attn_unnorm.split(block_size_n, dim=-1), cummax)], dim=-1)


def check_sequence(q, k, v, out, s_dmask, p, ref_kw):
    """One dense batch (or one sequence of a varlen batch, with a batch dim of 1): S_dmask
    (B, H, Sq, Sk) against float64, its drop fraction, and out recomputed from it."""
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    scores = scores_reference(q64, k64, **ref_kw)
    visible = torch.isfinite(scores)
    s = s_dmask.double()
    # Only visible elements carry a sign; masked ones are exactly +0.
    assert torch.all(s[~visible] == 0) and not torch.any(torch.signbit(s[~visible]))
    keep = ~torch.signbit(s)  # upstream reads S_dmask >= 0; the sign bit also covers -0.0
    block = _get_block_size_n(q.device, q.shape[-1], True, ref_kw.get("causal", False))
    attn = normalize_flash_attn_s(s.abs(), scores, block)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    err = (attn - probs).abs().max().item() if attn.numel() else 0.0
    assert err <= 2e-5, f"probabilities: max error {err:.3g}"

    n_visible = int(visible.sum())
    dropped = int((visible & ~keep).sum())
    if p > 0 and n_visible:
        sigma = (n_visible * p * (1 - p)) ** 0.5
        assert abs(dropped - n_visible * p) <= 5 * sigma + 1, (dropped, n_visible, p)

    # out from S_dmask against the returned out; for fp16 the tolerance is twice the error of
    # the same math in fp16 (docs/SPEC.md's rule, the recomputed value standing for the exact).
    g = q.shape[2] // v.shape[2]
    recomputed = torch.einsum("bhqk,bkhd->bqhd", attn * keep / (1 - p),
                              v64.repeat_interleave(g, dim=2))
    err = (out.double() - recomputed).abs().max().item() if out.numel() else 0.0
    if out.dtype == torch.float32:
        bound = 1e-5 * max(recomputed.abs().max().item() if out.numel() else 0.0, 1.0)
    else:
        low, _ = attention_reference(q.detach(), k.detach(), v.detach(), keep=keep,
                                     dropout_p=p, **ref_kw)
        bound = 2 * (low.double() - recomputed).abs().max().item() + 1e-4
    assert err <= bound, f"out from S_dmask: max error {err:.3g} > {bound:.3g}"


FEATURES = [
    dict(),
    dict(causal=True),
    dict(window_size=(6, 2)),
    dict(causal=True, window_size=(4, -1)),
    dict(softcap=3.0),
    dict(alibi=True),
    dict(softmax_scale=0.3, causal=True, alibi=True),
]


def split_kw(features, h, device):
    kw = dict(features)
    alibi = torch.rand(h, device=device) * 0.4 + 0.05 if kw.pop("alibi", False) else None
    ref_kw = dict(softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                  window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                  alibi=None if alibi is None else alibi.double())
    return kw, alibi, ref_kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("b,sq,sk,h,hk,d", [(2, 45, 61, 4, 2, 32), (1, 70, 33, 6, 1, 64)])
def test_dense_s_dmask_as_upstream_reads_it(device, features, b, sq, sk, h, hk, d):
    dt = dtype_on(device)
    q, k, v = (torch.randn(shape, dtype=dt, device=device, requires_grad=True)
               for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    kw, alibi, ref_kw = split_kw(features, h, device)
    p = 0.17
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, alibi_slopes=alibi,
                                        return_attn_probs=True, **kw)
    assert s_dmask.shape == (b, h, sq, sk) and s_dmask.dtype == torch.float32
    assert s_dmask.device == q.device and not s_dmask.requires_grad
    check_sequence(q, k, v, out, s_dmask, p, ref_kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_s_dmask_per_sequence(device, causal):
    lens_q, lens_k = [7, 0, 25, 12, 30], [11, 5, 25, 0, 19]
    h, hk, d, p = 4, 2, 32, 0.3
    dt = dtype_on(device)
    cu_q = torch.tensor([0] + lens_q, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=device).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, dtype=dt, device=device)
    k, v = (torch.randn(int(cu_k[-1]), hk, d, dtype=dt, device=device) for _ in range(2))
    max_q, max_k = max(lens_q) + 3, max(lens_k) + 2  # bounds beyond the longest are allowed
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p,
                                               causal=causal, return_attn_probs=True)
    assert s_dmask.shape == (len(lens_q), h, max_q, max_k)
    for bi, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(int(cu_q[bi]), int(cu_q[bi + 1]))
        keys = slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        seq = s_dmask[bi]
        # Positions past the sequence: +0, the padding upstream's conversion cuts off.
        assert torch.all(seq[:, lq:] == 0) and torch.all(seq[:, :, lk:] == 0)
        assert not torch.any(torch.signbit(seq[:, lq:]))
        assert not torch.any(torch.signbit(seq[:, :, lk:]))
        if lq and lk:  # (upstream's normalisation needs a key; no key: out is 0, checked elsewhere)
            check_sequence(q[None, rows], k[None, keys], v[None, keys], out[None, rows],
                           seq[None, :, :lq, :lk], p, dict(causal=causal))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_unchanged_by_return_attn_probs(device):
    dt = dtype_on(device)
    q, k, v = (torch.randn(2, 37, 4, 32, dtype=dt, device=device, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(2, 37, 4, 32, dtype=dt, device=device)
    results = []
    for with_probs in (True, False):
        torch.manual_seed(1234)  # the same dropout seed for both calls
        res = flash_attn_func(q, k, v, dropout_p=0.25, causal=True,
                              return_attn_probs=with_probs)
        out = res[0] if with_probs else res
        results.append((out,) + torch.autograd.grad(out, (q, k, v), dout))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_variants_return_the_same_s_dmask(device):
    dt = dtype_on(device)
    b, s, h, d, p = 2, 29, 2, 16, 0.4
    qkv = torch.randn(b, s, 3, h, d, dtype=dt, device=device, requires_grad=True)

    def seeded(fn, *args, **kw):
        torch.manual_seed(77)
        return fn(*args, dropout_p=p, return_attn_probs=True, **kw)[2]

    want = seeded(flash_attn_func, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert want.shape == (b, h, s, s)
    for got in (seeded(flash_attn_qkvpacked_func, qkv, causal=True),
                seeded(flash_attn_kvpacked_func, qkv[:, :, 0], qkv[:, :, 1:], causal=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    flat = qkv.reshape(b * s, 3, h, d)
    want = seeded(flash_attn_varlen_func, flat[:, 0], flat[:, 1], flat[:, 2], cu, cu, s, s)
    assert want.shape == (b, h, s, s)
    for got in (seeded(flash_attn_varlen_qkvpacked_func, flat, cu, s),
                seeded(flash_attn_varlen_kvpacked_func, flat[:, 0], flat[:, 1:], cu, cu, s, s)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Without dropout there is no mask to show: None, as documented.
    assert flash_attn_qkvpacked_func(qkv, return_attn_probs=True)[2] is None
    assert flash_attn_varlen_qkvpacked_func(flat, cu, s, return_attn_probs=True)[2] is None


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_with_s_dmask(device):
    torch._dynamo.reset()
    dt = dtype_on(device)

    def step(q, k, v):
        out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.3, causal=True,
                                            return_attn_probs=True)
        return out.sum(), s_dmask

    q, k, v = (torch.randn(2, 21, 2, 32, dtype=dt, device=device, requires_grad=True)
               for _ in range(3))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    got_loss, got_s = compiled(q, k, v)
    got_grads = torch.autograd.grad(got_loss, (q, k, v))
    torch.manual_seed(5)
    want_loss, want_s = step(q, k, v)
    want_grads = torch.autograd.grad(want_loss, (q, k, v))
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("op,args", [
    ("attn_probs", lambda: (torch.randn(2, 9, 4, 16), torch.randn(2, 13, 2, 16),
                            torch.tensor([3, 0]), 0.3, None, True, -1, -1, 0.0, None)),
    ("varlen_attn_probs", lambda: (torch.randn(12, 2, 16), torch.randn(15, 2, 16),
                                   torch.tensor([0, 5, 12], dtype=torch.int32),
                                   torch.tensor([0, 9, 15], dtype=torch.int32), 7, 9,
                                   torch.tensor([3, 0]), 0.3, 0.5, False, 2, -1, 0.0, None)),
])
def test_opcheck(op, args):
    """Schema and fake implementation of the probabilities' custom ops."""
    torch.library.opcheck(getattr(torch.ops.flashattn, op).default, args())


def test_block_covers_every_key():
    for causal in (False, True):
        assert _get_block_size_n("cpu", 128, True, causal) >= 2**31 - 1


def test_numpy_s_dmask():
    rng = np.random.default_rng()
    b, sq, sk, h, d, p = 2, 40, 53, 3, 16, 0.35
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, sk, h, d)).astype(np.float32) for _ in range(2))
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                        return_attn_probs=True)
    assert isinstance(s_dmask, np.ndarray) and s_dmask.shape == (b, h, sq, sk)
    assert s_dmask.dtype == np.float32
    # Each row's probabilities are |S| / sum |S| (exp(max - lse) is that sum's inverse), and
    # its largest |S| is exp(0) = 1 (causal with Sq < Sk: every row sees a key).
    a = np.abs(s_dmask.astype(np.float64))
    total = a.sum(-1, keepdims=True)
    assert np.all(a.max(-1) == 1.0)
    probs = np.where(total > 0, a / np.where(total > 0, total, 1), 0)
    keep = ~np.signbit(s_dmask)
    recomputed = np.einsum("bhqk,bkhd->bqhd", probs * keep / (1 - p), v.astype(np.float64))
    np.testing.assert_allclose(out, recomputed, rtol=0, atol=2e-5)
    assert flash_attn_func(q, k, v, return_attn_probs=True)[2] is None
