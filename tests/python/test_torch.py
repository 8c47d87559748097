"""PyTorch on the CPU: outputs and gradients against float64 and SDPA's math backend, autograd,
dropout seeding, custom-op checks, torch.compile(fullgraph=True), a small training step."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashattn import (_C, flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_qkvpacked_func)
from conftest import page_keys  # noqa: E402
from torch_reference import attention_reference  # noqa: E402

FEATURES = [
    dict(),
    dict(causal=True),
    dict(window_size=(6, 2)),
    dict(causal=True, window_size=(4, -1)),
    dict(softcap=4.0),
    dict(alibi=True),
    dict(softmax_scale=0.25, causal=True, softcap=3.0, alibi=True),
]


def rel_close(got, ref, rel=1e-5, name=""):
    got = got.detach().double()
    ref = ref.detach().double()
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, 1e-3)
    assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel:g} x {scale:.3g}"


def make(shape, dtype=torch.float32, grad=True):
    return torch.randn(shape, dtype=dtype).requires_grad_(grad)


def split_kw(features, h):
    kw = dict(features)
    alibi = torch.rand(h) * 0.4 + 0.05 if kw.pop("alibi", False) else None
    ref_kw = dict(softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                  window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                  alibi=None if alibi is None else alibi.double())
    return kw, alibi, ref_kw


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("sq,sk", [(33, 33), (17, 45)])
@pytest.mark.parametrize("h,hk,d", [(4, 4, 32), (6, 2, 24)])
def test_forward_backward_fp32_vs_float64(features, sq, sk, h, hk, d):
    check_forward_backward_vs_float64(features, 2, sq, sk, h, hk, d)


@pytest.mark.parametrize("features", [FEATURES[0], FEATURES[-1]],
                         ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("d", [1, 5, 59, 111, 250])
def test_head_dims_not_multiples_of_8(features, d):
    """Any head dim in [1, 256], through flash_attn_func and autograd (the default scale is
    1/sqrt(d)), and through the packed function."""
    check_forward_backward_vs_float64(features, 2, 19, 37, 4, 2, d)
    qkv = make((2, 23, 3, 2, d))
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q64, k64, v64 = (qkv.detach()[:, :, i].double().requires_grad_() for i in range(3))
    ref, _ = attention_reference(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    rel_close(out, ref, name="packed out")
    rel_close(dqkv, torch.stack(ref_grads, dim=2), name="dqkv")


def check_forward_backward_vs_float64(features, b, sq, sk, h, hk, d):
    q, k, v = make((b, sq, h, d)), make((b, sk, hk, d)), make((b, sk, hk, d))
    kw, alibi, ref_kw = split_kw(features, h)
    out, lse, probs = flash_attn_func(q, k, v, alibi_slopes=alibi, return_attn_probs=True, **kw)
    assert probs is None and out.dtype == torch.float32 and lse.shape == (b, h, sq)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, **ref_kw)
    rdq, rdk, rdv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    rel_close(out, ref, name="out")
    rel_close(lse, ref_lse, name="lse")
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        rel_close(got, want, name=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_matches_sdpa_math_fp32(causal, h, hk):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, d = 2, 57, 64
    q, k, v = make((b, s, h, d)), make((b, s, hk, d)), make((b, s, hk, d))
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q2, k2, v2 = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal,
                                             enable_gqa=h != hk).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), dout)
    rel_close(out, ref, name="out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        rel_close(got, want.transpose(1, 2), name=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accuracy_rule(dtype):
    """fp16/bf16 on the CPU: within 2x (forward) / 3x (gradients) of a plain implementation in
    the same dtype, against float64."""
    b, sq, sk, h, d = 2, 40, 56, 4, 64
    q, k, v = make((b, sq, h, d), dtype), make((b, sk, h, d), dtype), make((b, sk, h, d), dtype)
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
    low, _ = attention_reference(ql, kl, vl, causal=True)
    low_grads = torch.autograd.grad(low, (ql, kl, vl), dout)

    def check(got, want, plain, factor, name):
        err = (got.double() - want).abs().max().item()
        bound = factor * (plain.double() - want).abs().max().item() + 1e-3
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"

    check(out, ref, low, 2, "out")
    for name, g, w, p in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        check(g, w, p, 3, name)


def test_dropout_mask_is_governed_by_manual_seed_and_replayed_in_backward():
    b, s, h, d, p = 2, 16, 3, 16, 0.3
    q, k = make((b, s, h, d)), make((b, s, h, d))
    # v = identity over the keys: out[b, i, h, j] = P_ij * keep_ij / (1 - p), so the keep bits
    # are visible in the output (P_ij > 0 without a mask).
    eye = torch.eye(s).expand(b, h, s, s).permute(0, 2, 1, 3).contiguous()
    torch.manual_seed(1234)
    probe = flash_attn_func(q.detach(), k.detach(), eye, dropout_p=p)
    keep = (probe != 0).permute(0, 2, 1, 3)  # (B, H, Sq, Sk)
    assert 0.5 < keep.float().mean().item() < 0.9

    torch.manual_seed(1234)
    probe_again = flash_attn_func(q.detach(), k.detach(), eye, dropout_p=p)
    assert torch.equal(probe, probe_again)
    assert not torch.equal(probe, flash_attn_func(q.detach(), k.detach(), eye, dropout_p=p))

    v = make((b, s, h, d))
    torch.manual_seed(1234)
    out = flash_attn_func(q, k, v, dropout_p=p)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, keep=keep, dropout_p=p)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    rel_close(out, ref, name="out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        rel_close(got, want, name=name)


def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v = make((2, 50, 4, 32)), make((2, 50, 2, 32)), make((2, 50, 2, 32))
    dout = torch.randn(2, 50, 4, 32)
    first = torch.autograd.grad(flash_attn_func(q, k, v, deterministic=True), (q, k, v), dout)
    second = torch.autograd.grad(flash_attn_func(q, k, v, deterministic=True), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_packed_inputs_are_views_and_gradients_match(monkeypatch):
    b, s, h, d = 2, 21, 3, 16
    qkv = make((b, s, 3, h, d))
    seen = {}
    real = _C.forward

    def spy(q, k, v, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(_C, "forward", spy)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    for i, name in enumerate("qkv"):  # raw descriptors: (data_ptr, dtype, device, index, sizes, strides)
        assert seen[name][0] == qkv[:, :, i].data_ptr(), f"{name} was copied"
        assert seen[name][5] == qkv.stride()[:2] + qkv.stride()[3:]
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(dqkv, torch.stack(ref_grads, dim=2), rtol=0, atol=0)

    kv = make((b, 30, 2, 1, d))
    qq = make((b, s, 3, d))
    out = flash_attn_kvpacked_func(qq, kv)
    ref = flash_attn_func(qq, kv[:, :, 0], kv[:, :, 1])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_varlen_forward_backward_vs_float64():
    lens_q, lens_k = [7, 0, 25, 12], [11, 5, 25, 0]
    h, hk, d = 4, 2, 32
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q, k, v = make((int(cu_q[-1]), h, d)), make((int(cu_k[-1]), hk, d)), make((int(cu_k[-1]), hk, d))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=True, return_attn_probs=True)
    assert lse.shape == (h, q.shape[0])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    pieces = []
    for bi in range(len(lens_q)):
        qs, ks = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        o, _ = attention_reference(q64[None, qs], k64[None, ks], v64[None, ks], causal=True)
        pieces.append(o[0])
    ref = torch.cat(pieces)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    rel_close(out, ref, name="out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        rel_close(got, want, name=name)

    qkv = make((int(cu_q[-1]), 3, h, d))
    packed = flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lens_q))
    unpacked = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_q, max(lens_q),
                                      max(lens_q))
    torch.testing.assert_close(packed, unpacked, rtol=0, atol=0)


def paged_batch(lens_q, lens_k, h, hk, d, page_size, grad):
    """A varlen batch and its keys paged (conftest.page_keys), as torch tensors."""
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q, k, v = make((sum(lens_q), h, d), grad=grad), make((sum(lens_k), hk, d), grad=grad), \
        make((sum(lens_k), hk, d), grad=grad)
    pages = page_keys(k.detach().numpy(), v.detach().numpy(), cu_k.tolist(), page_size,
                      np.random.default_rng())
    k_pages, v_pages, table = (torch.from_numpy(a) for a in pages)
    return q, k, v, cu_q, cu_k, k_pages.requires_grad_(grad), v_pages.requires_grad_(grad), table


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_varlen_paged_forward_vs_float64_and_backward_refused(page_size):
    """block_table: the paged forward runs on inputs that require grad (as upstream's), matches
    float64 and the dense call's bits, and a backward through it raises, naming block_table."""
    lens_q, lens_k = [7, 0, 25, 12], [11, 5, 25, 0]
    h, hk, d = 4, 2, 32
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged_batch(lens_q, lens_k, h, hk, d,
                                                               page_size, grad=True)
    out, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q),
                                         max(lens_k), causal=True, block_table=table,
                                         return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0]) and out.requires_grad
    dense, dense_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=True, return_attn_probs=True)
    torch.testing.assert_close(out, dense, rtol=0, atol=0)
    torch.testing.assert_close(lse, dense_lse, rtol=0, atol=0)
    pieces = []
    for bi in range(len(lens_q)):
        qs, ks = slice(cu_q[bi], cu_q[bi + 1]), slice(cu_k[bi], cu_k[bi + 1])
        o, _ = attention_reference(q.detach().double()[None, qs], k.detach().double()[None, ks],
                                   v.detach().double()[None, ks], causal=True)
        pieces.append(o[0])
    rel_close(out, torch.cat(pieces), name="out")
    with pytest.raises(NotImplementedError, match=r"^block_table: expected None for a backward"):
        out.sum().backward()
    with torch.no_grad():
        again = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k),
                                       causal=True, block_table=table)
    torch.testing.assert_close(again, dense, rtol=0, atol=0)


def test_varlen_paged_errors_carry_the_library_message():
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged_batch([3, 4], [5, 2], 2, 2, 8, 2,
                                                               grad=False)
    table[0, 1] = -2
    with pytest.raises(ValueError, match=r"^block_table: expected page indices"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 5, block_table=table)
    with pytest.raises(ValueError, match=r"^v: expected 4 dimensions"):
        flash_attn_varlen_func(q, k_pages, v, cu_q, cu_k, 4, 5, block_table=table)
    with pytest.raises(TypeError, match=r"^block_table: expected dtype int32"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 5,
                               block_table=table.to(torch.float32))


@pytest.mark.parametrize("dropout_p", [-0.1, float("nan"), 1.0])
def test_dropout_outside_its_range_is_refused(dropout_p):
    # Found by scripts/gpu_sweep.py: a negative or NaN dropout_p ran without dropout.
    q = torch.randn(1, 3, 2, 8)
    for call in (lambda: flash_attn_func(q, q, q, dropout_p=dropout_p),
                 lambda: flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 3], dtype=torch.int32),
                                                torch.tensor([0, 3], dtype=torch.int32), 3, 3,
                                                dropout_p=dropout_p)):
        with pytest.raises(ValueError, match=r"^dropout_p: expected a probability in \[0, 1\)"):
            call()


def test_a_window_past_int32_is_refused_naming_it():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match=r"^window_size: expected .* below 2\^31"):
        flash_attn_func(q, q, q, window_size=(2 ** 31, 0))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_no_queries_give_empty_outputs_and_lse(requires_grad):
    # Found by scripts/gpu_sweep.py: torch gives an empty (3, 4, 0) lse the strides (4, 1, 1),
    # which the library refused as not row-major.
    q = torch.randn(3, 0, 4, 8, requires_grad=requires_grad)
    k = torch.randn(3, 5, 4, 8, requires_grad=requires_grad)
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True)
    assert out.shape == (3, 0, 4, 8) and lse.shape == (3, 4, 0)
    cu_q = torch.zeros(2, dtype=torch.int32)
    cu_k = torch.tensor([0, 5], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q[0], k[0], k[0], cu_q, cu_k, 0, 5, return_attn_probs=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)


def test_errors_carry_the_library_message():
    q, k = make((1, 8, 4, 32)), make((1, 8, 3, 32))
    with pytest.raises(ValueError, match=r"^k: expected .*given"):
        flash_attn_func(q, k, k)
    with pytest.raises(TypeError, match="float64"):
        flash_attn_func(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match=r"^k: expected dtype fp32, given dtype fp16"):
        flash_attn_func(q, q.half(), q)
    with pytest.raises(ValueError, match="q: expected 4 dimensions"):
        flash_attn_func(q[0], q[0], q[0])


@pytest.mark.parametrize("op,args", [
    ("fwd", lambda: (make((2, 9, 4, 16)), make((2, 13, 2, 16)), make((2, 13, 2, 16)), 0.0, None,
                     True, -1, -1, 0.0, None, False)),
    ("varlen_fwd", lambda: (make((12, 2, 16)), make((15, 2, 16)), make((15, 2, 16)),
                            torch.tensor([0, 5, 12], dtype=torch.int32),
                            torch.tensor([0, 9, 15], dtype=torch.int32), 7, 9, 0.0, 0.5, False,
                            -1, -1, 0.0, None, False)),
])
def test_opcheck(op, args):
    """Schema, fake implementation, autograd registration and AOT dispatch of the custom ops."""
    torch.library.opcheck(getattr(torch.ops.flashattn, op).default, args())


def paged_opcheck_args():
    q, _, _, cu_q, cu_k, k_pages, v_pages, table = paged_batch([5, 7], [9, 6], 2, 2, 16, 4,
                                                               grad=False)
    return (q, k_pages, v_pages, cu_q, cu_k, 7, 9, 0.0, 0.5, True, -1, -1, 0.0, None, False,
            table)


def test_opcheck_paged():
    """The paged form of varlen_fwd (block_table given; inputs without grad: no backward)."""
    torch.library.opcheck(torch.ops.flashattn.varlen_fwd.default, paged_opcheck_args())


def test_torch_compile_fullgraph_paged_varlen():
    """A paged varlen call (inference: no grad) is one node of a full graph."""
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = paged_batch([5, 9], [12, 3], 4, 2, 16, 8,
                                                               grad=False)

    def step(q, k_pages, v_pages, table):
        return flash_attn_varlen_func(q * 2, k_pages, v_pages, cu_q, cu_k, 9, 12, causal=True,
                                      block_table=table)

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_pages, v_pages, table)
    want = flash_attn_varlen_func(q * 2, k, v, cu_q, cu_k, 9, 12, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()

    def block(q, k, v, w):
        out = flash_attn_func(q @ w, k, v, causal=True, softcap=2.0)
        return (out * out).sum()

    q, k, v = make((2, 19, 4, 32)), make((2, 23, 2, 32)), make((2, 23, 2, 32))
    w = make((32, 32))
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = compiled(q, k, v, w)
    got_grads = torch.autograd.grad(got, (q, k, v, w))
    want = block(q, k, v, w)
    want_grads = torch.autograd.grad(want, (q, k, v, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-4, atol=1e-5)


class TinyBlock(nn.Module):
    def __init__(self, dim, heads, use_flash):
        super().__init__()
        self.heads, self.use_flash = heads, use_flash
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads)
        if self.use_flash:
            a = flash_attn_qkvpacked_func(qkv, causal=True)
        else:
            q, k, v = qkv.unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, dim=64, heads=4, layers=2, use_flash=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TinyBlock(dim, heads, use_flash) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def test_training_steps_match_sdpa():
    torch.manual_seed(0)
    ref_model = TinyLM(use_flash=False)
    model = TinyLM(use_flash=True)
    model.load_state_dict(ref_model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref_model, model)]
    tokens = torch.randint(0, 50, (3, 33))
    for step in range(3):
        losses = []
        for m, opt in zip((ref_model, model), opts):
            opt.zero_grad()
            logits = m(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss)
        assert abs(losses[0].item() - losses[1].item()) <= 1e-5 * abs(losses[0].item()), step
        for (name, p_ref), p in zip(ref_model.named_parameters(), model.parameters()):
            rel_close(p.grad, p_ref.grad, rel=1e-4, name=f"step {step} {name}")
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("op,args", [
    ("bwd", lambda: (torch.randn(2, 9, 4, 16), torch.randn(2, 9, 4, 16), torch.randn(2, 13, 2, 16),
                     torch.randn(2, 13, 2, 16), torch.randn(2, 9, 4, 16), torch.randn(2, 4, 9),
                     torch.zeros(2, dtype=torch.int64), 0.0, None, False, -1, -1, 0.0, None,
                     False)),
])
def test_opcheck_backward_op(op, args):
    a = list(args())
    # A consistent (out, lse) pair for the backward: the forward's own.
    a[4], a[5], _ = torch.ops.flashattn.fwd(a[1], a[2], a[3], 0.0, None, False, -1, -1, 0.0,
                                            None, False)
    torch.library.opcheck(getattr(torch.ops.flashattn, op).default, tuple(a))


def test_example_training_loop_matches_sdpa():
    """examples/train_swap.py: the same loop with the import swapped gives SDPA's loss curve."""
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_swap.py"
    main = runpy.run_path(str(path))["main"]
    assert main(["--compare", "--steps", "8", "--seqlen", "32", "--rtol", "1e-4"]) == 0


def test_torch_compile_dynamic_shapes_and_upstream_module_path():
    from flashattn.flash_attn_interface import flash_attn_func as upstream_path_func

    assert upstream_path_func is flash_attn_func
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                             fullgraph=True, dynamic=True, backend="aot_eager")
    for s in (17, 40, 63):
        q, k, v = (make((2, s, 4, 32)) for _ in range(3))
        got = compiled(q, k, v)
        torch.testing.assert_close(got, flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
        got.sum().backward()
        assert q.grad.shape == q.shape


# ---- the eager path (torch_ops module docstring): plain eager calls run the op's
# implementation directly; anything that must see the op still gets it.

class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every op dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_eager_path_equals_the_op_bitwise(dropout_p):
    q, k, v = (make((2, 19, 4, 24)) for _ in range(3))
    g = torch.randn(2, 19, 4, 24)
    torch.manual_seed(7)
    out = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)
    out.backward(g)
    eager = (out.detach(), q.grad, k.grad, v.grad)
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(7)  # the same seed drawn: the same dropout mask
    with _OpNames() as mode:
        out = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)
        out.backward(g)
    assert "flashattn.fwd.default" in mode.names and "flashattn.bwd.default" in mode.names
    for a, b in zip(eager, (out.detach(), q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


def test_eager_path_varlen_gradients_equal_the_op():
    total, h, d = 29, 3, 16
    q, k, v = (make((total, h, d)) for _ in range(3))
    cu = torch.tensor([0, 11, 11, 29], dtype=torch.int32)
    g = torch.randn(total, h, d)
    results = []
    for mode in (None, _OpNames()):
        for t in (q, k, v):
            t.grad = None
        if mode is not None:
            mode.__enter__()
        out = flash_attn_varlen_func(q, k, v, cu, cu, 18, 18, causal=True)
        out.backward(g)
        if mode is not None:
            mode.__exit__(None, None, None)
            assert "flashattn.varlen_fwd.default" in mode.names
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_eager_path_without_grad_and_lse_has_no_gradient():
    q, k, v = (make((1, 5, 2, 8), grad=False) for _ in range(3))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.grad_fn is None and lse.grad_fn is None
    q.requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.grad_fn is not None and not lse.requires_grad


def test_eager_kvcache_append_bumps_the_caches_versions():
    from flashattn import flash_attn_with_kvcache
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.zeros(2, 9, 2, 16), torch.zeros(2, 9, 2, 16)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    before = (k_cache._version, v_cache._version)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert (k_cache._version, v_cache._version) == before  # nothing appended
    k_new, v_new = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens)
    assert k_cache._version > before[0] and v_cache._version > before[1]
    assert torch.equal(k_cache[0, 3], k_new[0, 0]) and torch.equal(v_cache[1, 5], v_new[1, 0])
    with torch.inference_mode():  # caches without version counters: still fine
        kc, vc = torch.zeros(2, 9, 2, 16), torch.zeros(2, 9, 2, 16)
        out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens)
        assert torch.equal(kc[0, 3], k_new[0, 0]) and out.isfinite().all()


def test_plain_eager_calls_do_not_dispatch_the_op(monkeypatch):
    from flashattn import flash_attn_with_kvcache, torch_ops

    def op_called(*args, **kwargs):
        raise AssertionError("a plain eager call went through the custom op")

    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache"):
        monkeypatch.setattr(torch_ops, name, op_called)
    q, k, v = (make((1, 7, 2, 8)) for _ in range(3))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    cu = torch.tensor([0, 7], dtype=torch.int32)
    flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 7).sum().backward()
    with torch.no_grad():
        flash_attn_with_kvcache(q, k, v, cache_seqlens=7)
