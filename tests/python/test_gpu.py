"""PyTorch on CUDA (the H200 run): skipped, with the reason shown by `pytest -rs`, without a GPU.

What runs on the GPU: outputs and gradients against float64 (the torch reference and SDPA's
math backend) under docs/SPEC.md's accuracy rule, fp16 and bf16, causal or not, GQA, odd lengths,
Sq != Sk both ways; the packed and varlen functions with gradients; torch.compile(fullgraph=True)
through the backward; CUDA-graph capture and replay of the forward and of forward + backward;
the current stream; the deterministic backward; dropout (the CUDA backward replaying the CPU
forward's mask today, the CUDA forward itself once the library has it); a training step
against SDPA; CuPy arrays through DLPack; paged varlen keys (block_table).

The accuracy rule (docs/SPEC.md, as src/reference applies it): against float64, the largest error
of an output must be at most 2x (gradients: 3x) the largest error of a plain implementation
in the same low precision (scores, probabilities and products rounded to the dtype at each
step) on the same inputs, plus a floor: 1e-4 (fp16) / 5e-4 (bf16), and for gradients at least
one unit in the last place of the call's largest gradient.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the GPU tests need it")

import torch.nn.functional as F  # noqa: E402

import flashattn  # noqa: E402
from flashattn import (_C, flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from conftest import page_keys  # noqa: E402
from torch_reference import attention_reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
    pytest.mark.skipif(not flashattn.cuda_compiled(),
                       reason="flashattn was built without the CUDA backend (no nvcc, or no GPU at test.sh time)"),
]

DTYPES = [torch.float16, torch.bfloat16]
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 5e-4}
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
P_DROP = 0.17


@pytest.fixture(autouse=True)
def poisoned_allocator():
    """NaN-fill memory that torch's caching allocator then hands out again, so that an output
    element the library forgets to write shows up as NaN (best effort: the ops allocate their
    outputs through torch, which reuses freed blocks of the same pool)."""
    if torch.cuda.is_available():
        blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda")]
        blocks += [torch.empty(256 << 10, dtype=torch.uint8, device="cuda") for _ in range(32)]
        for b in blocks:
            b.view(torch.float16)[:].fill_(float("nan"))
        del blocks
    yield


def make(shape, dtype, grad=False, scale=1.0):
    t = torch.randn(shape, dtype=torch.float32, device="cuda") * scale
    return t.to(dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------- the rule

def references(attend, tensors, dout):
    """float64 and plain low-precision results of `attend` (a differentiable reference over
    (q, k, v)): (out64, grads64, out_low, grads_low); grads are None without dout."""
    results = []
    for dtype in (torch.float64, None):
        leaves = [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]
        out = attend(*leaves)
        grads = None
        if dout is not None:
            grads = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
            grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves))
        results += [out.detach(), grads]
    return results


def assert_rule(name, got, exact, low, factor, floor):
    got, exact, low = got.detach().double(), exact.detach().double(), low.detach().double()
    assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    if got.numel() == 0:
        return
    err = (got - exact).abs().max().item()
    low_err = (low - exact).abs().max().item()
    bound = factor * low_err + floor
    # NaN never passes: the comparison is False.
    assert err <= bound, (f"{name}: max error {err:.3g} > {factor} x {low_err:.3g} (the plain "
                          f"implementation's) + {floor:.2g}")


def check_forward(out, out64, out_low, dtype):
    assert_rule("out", out, out64, out_low, 2, FLOOR[dtype])


def check_gradients(grads, grads64, grads_low, dtype, names=("dq", "dk", "dv")):
    magnitude = max((g.abs().max().item() for g in grads64 if g.numel()), default=0.0)
    floor = max(FLOOR[dtype], ULP[dtype] * magnitude)
    for name, g, g64, glow in zip(names, grads, grads64, grads_low):
        assert g.dtype == glow.dtype, f"{name}: dtype {g.dtype}, expected {glow.dtype}"
        assert_rule(name, g, g64, glow, 3, floor)


def check_lse(lse, lse64):
    assert lse.dtype == torch.float32
    lse, lse64 = lse.double(), lse64.double()
    empty = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse), empty), "lse: -inf exactly for the rows that see no key"
    torch.testing.assert_close(lse[~empty], lse64[~empty], rtol=1e-4, atol=1e-3)


def dense_reference(**kw):
    return lambda q, k, v: attention_reference(q, k, v, **kw)[0]


# ---------------------------------------------------------------------------- dense

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    (2, 113, 113, 8, 8, 64),
    (2, 97, 1025, 8, 2, 128),   # GQA 4:1, Sq < Sk
    (1, 1023, 257, 4, 4, 96),   # Sq > Sk: causal rows that see no key
    (3, 65, 31, 6, 1, 256),     # MQA, the largest head dim
    (2, 1, 77, 4, 2, 32),       # one query (decoding-like)
    (2, 77, 129, 4, 2, 59),     # head dims that are not multiples of 8: padded copies
    (1, 65, 33, 4, 4, 5),
    (1, 45, 90, 2, 1, 250),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", SHAPES, ids=lambda x: str(x))
def test_forward_and_gradients_vs_float64(dtype, causal, b, sq, sk, h, hk, d):
    q, k, v = make((b, sq, h, d), dtype, True), make((b, sk, hk, d), dtype, True), \
        make((b, sk, hk, d), dtype, True)
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert probs is None
    assert out.shape == (b, sq, h, d) and out.dtype == dtype and out.device == q.device
    assert lse.shape == (b, h, sq)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    out64, grads64, out_low, grads_low = references(dense_reference(causal=causal), (q, k, v),
                                                    dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients(grads, grads64, grads_low, dtype)
    _, lse64 = attention_reference(q.detach().double(), k.detach().double(),
                                   v.detach().double(), causal=causal)
    check_lse(lse, lse64)


# Keys whose scores grow from one 128-key block to the next (each key row scaled by growth(j)):
# the running max grows gently (later blocks' probabilities above 1 against an earlier max), in
# steps past any fixed margin, and past 2^128 against the first block's max (an exponential
# that would overflow): every step of an online softmax that rescales, or one that skips the
# block's own max, must give the float64 answer.
GROWTH = {
    "gentle": lambda j: 1.0 + j / 700.0,
    "steps": lambda j: 4.0 ** (j // 128),
    "shrinking": lambda j: 4.0 ** -(j // 128),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("growth", sorted(GROWTH))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_scores_growing_across_key_blocks(dtype, causal, growth, d):
    b, sq, sk, h = 2, 300, 700, 2
    scale = torch.tensor([GROWTH[growth](j) for j in range(sk)], device="cuda").view(1, sk, 1, 1)
    q, v = make((b, sq, h, d), dtype), make((b, sk, h, d), dtype)
    k = (torch.randn((b, sk, h, d), device="cuda") * scale).to(dtype)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out64, _, out_low, _ = references(dense_reference(causal=causal), (q, k, v), None)
    check_forward(out, out64, out_low, dtype)
    _, lse64 = attention_reference(q.double(), k.double(), v.double(), causal=causal)
    check_lse(lse, lse64)


FEATURES = [
    dict(window_size=(17, 5)),
    dict(causal=True, window_size=(40, -1)),
    dict(softcap=5.0),
    dict(alibi=True, causal=True),
    dict(softmax_scale=0.3, softcap=3.0, alibi=True, window_size=(-1, 30)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f))
def test_masks_softcap_alibi_vs_float64(dtype, features):
    b, sq, sk, h, hk, d = 2, 131, 173, 6, 3, 64
    q, k, v = make((b, sq, h, d), dtype, True), make((b, sk, hk, d), dtype, True), \
        make((b, sk, hk, d), dtype, True)
    kw = dict(features)
    alibi = (torch.rand(b, h, device="cuda") * 0.3 + 0.02) if kw.pop("alibi", False) else None
    out = flash_attn_func(q, k, v, alibi_slopes=alibi, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = dense_reference(softmax_scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                          window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                          alibi=alibi)
    out64, grads64, out_low, grads_low = references(ref, (q, k, v), dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients(grads, grads64, grads_low, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,sq,sk,h,hk", [(True, 257, 257, 8, 2), (False, 100, 333, 4, 4)],
                         ids=["causal-gqa", "full-sq<sk"])
def test_vs_sdpa_math_float64(dtype, causal, sq, sk, h, hk):
    """SDPA's math backend in float64 as the oracle (square when causal: SDPA's causal mask is
    top-left aligned, ours bottom-right; they agree for Sq == Sk)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, d = 2, 64
    q, k, v = make((b, sq, h, d), dtype, True), make((b, sk, hk, d), dtype, True), \
        make((b, sk, hk, d), dtype, True)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=causal,
                                               enable_gqa=h != hk)
        return o.transpose(1, 2)

    out64, grads64, _, _ = references(sdpa, (q, k, v), dout)
    _, _, out_low, grads_low = references(dense_reference(causal=causal), (q, k, v), dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients(grads, grads64, grads_low, dtype)


def test_fp32_on_cuda_is_refused_with_the_library_message():
    q = torch.randn(1, 8, 2, 32, device="cuda")
    with pytest.raises(NotImplementedError, match=r"^q: expected dtype fp16 or bf16"):
        flash_attn_func(q, q, q)


# ---------------------------------------------------------------------------- packed, varlen

def test_packed_functions_are_views_with_gradients(monkeypatch):
    dtype = torch.bfloat16
    b, s, h, d = 2, 129, 4, 64
    qkv = make((b, s, 3, h, d), dtype, True)
    seen = {}
    real = _C.forward

    def spy(q, k, v, *args, **kwargs):
        seen.update(q=q, k=k, v=v)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(_C, "forward", spy)
    out = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    monkeypatch.setattr(_C, "forward", real)
    for i, name in enumerate("qkv"):  # raw descriptors: (data_ptr, dtype, device, index, sizes, strides)
        assert seen[name][0] == qkv[:, :, i].data_ptr(), f"{name} was copied"
        assert seen[name][5] == qkv.stride()[:2] + qkv.stride()[3:]
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape

    def packed_reference(qkv):
        return attention_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)[0]

    out64, (g64,), out_low, (glow,) = references(packed_reference, (qkv,), dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients((dqkv,), (g64,), (glow,), dtype, names=("dqkv",))
    # The same call on unpacked copies gives the same bits (deterministic backward).
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=True, deterministic=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dqkv, torch.stack(torch.autograd.grad(ref, (q, k, v), dout), 2),
                               rtol=0, atol=0)

    # kv packed, GQA 2:1, Sq != Sk.
    q = make((b, 45, h, d), dtype, True)
    kv = make((b, 200, 2, h // 2, d), dtype, True)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)

    def kv_reference(q, kv):
        return attention_reference(q, kv[:, :, 0], kv[:, :, 1], causal=True)[0]

    out64, grads64, out_low, grads_low = references(kv_reference, (q, kv), dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients((dq, dkv), grads64, grads_low, dtype, names=("dq", "dkv"))


def varlen_reference(cu_q, cu_k, causal):
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()

    def attend(q, k, v):
        pieces = []
        for b in range(len(bounds_q) - 1):
            qs, ks = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
            o, _ = attention_reference(q[None, qs], k[None, ks], v[None, ks], causal=causal)
            pieces.append(o[0])
        return torch.cat(pieces)

    return attend


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_functions_with_gradients(dtype):
    lens_q, lens_k = [5, 0, 200, 64, 1, 97], [17, 3, 200, 0, 33, 97]
    h, hk, d = 4, 2, 64
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = make((sum(lens_q), h, d), dtype, True)
    k, v = make((sum(lens_k), hk, d), dtype, True), make((sum(lens_k), hk, d), dtype, True)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=True, return_attn_probs=True)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out64, grads64, out_low, grads_low = references(varlen_reference(cu_q, cu_k, True),
                                                    (q, k, v), dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients(grads, grads64, grads_low, dtype)

    # The packed varlen functions are views of the same call: equal bits (deterministic).
    qkv = make((sum(lens_q), 3, h, d), dtype, True)
    packed = flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lens_q), causal=True,
                                              deterministic=True)
    dout = torch.randn_like(packed)
    (dqkv,) = torch.autograd.grad(packed, qkv, dout)
    q2, k2, v2 = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    unpacked = flash_attn_varlen_func(q2, k2, v2, cu_q, cu_q, max(lens_q), max(lens_q),
                                      causal=True, deterministic=True)
    torch.testing.assert_close(packed, unpacked, rtol=0, atol=0)
    torch.testing.assert_close(dqkv, torch.stack(torch.autograd.grad(unpacked, (q2, k2, v2),
                                                                     dout), 1), rtol=0, atol=0)

    kv = make((sum(lens_k), 2, hk, d), dtype, True)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lens_q), max(lens_k),
                                          deterministic=True)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k2, v2 = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    ref = flash_attn_varlen_func(q2, k2, v2, cu_q, cu_k, max(lens_q), max(lens_k),
                                 deterministic=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    rq, rk, rv = torch.autograd.grad(ref, (q2, k2, v2), dout)
    torch.testing.assert_close(dq, rq, rtol=0, atol=0)
    torch.testing.assert_close(dkv, torch.stack((rk, rv), 1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size,d", [(1, 64), (3, 128), (16, 256), (256, 96), (5, 59)],
                         ids=lambda x: str(x))
def test_varlen_paged_vs_float64(dtype, page_size, d):
    """block_table on CUDA (the sm80 kernel's paged variant): float64's accuracy with pages in a
    random order and NaN wherever no key is (conftest.page_keys), the dense call's values, and
    a backward refused naming block_table."""
    lens_q, lens_k = [5, 0, 200, 64, 1, 97], [17, 3, 200, 0, 33, 130]
    h, hk = 4, 2
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = make((sum(lens_q), h, d), dtype, True)
    k, v = make((sum(lens_k), hk, d), dtype), make((sum(lens_k), hk, d), dtype)
    pages = page_keys(k.float().cpu().numpy(), v.float().cpu().numpy(), cu_k.tolist(),
                      page_size, np.random.default_rng())
    k_pages, v_pages = (torch.from_numpy(a).to("cuda", dtype) for a in pages[:2])
    table = torch.from_numpy(pages[2]).cuda()
    out, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lens_q),
                                         max(lens_k), causal=True, block_table=table,
                                         return_attn_probs=True)
    out64, _, out_low, _ = references(varlen_reference(cu_q, cu_k, True), (q, k, v), None)
    check_forward(out, out64, out_low, dtype)
    assert lse.shape == (h, sum(lens_q))
    # Off Hopper (or with the sm80 kernel forced) the dense call takes the same sm80 kernel, the
    # same tiles, so the same bits; on Hopper the sm90 kernel takes it.
    if os.environ.get("FLASHATTN_CUDA_FORWARD") == "sm80" or torch.cuda.get_device_capability()[0] != 9:
        dense = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                       causal=True)
        torch.testing.assert_close(out, dense, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()


# ---------------------------------------------------------------------------- streams, graphs

def test_runs_on_the_current_stream():
    """Inputs written on a side stream behind a long GPU sleep: a call that ran on any other
    stream would read them before they exist (NaN) instead of after."""
    dtype = torch.float16
    q, k, v = make((2, 300, 4, 64), dtype), make((2, 300, 2, 64), dtype), \
        make((2, 300, 2, 64), dtype)
    dout = torch.randn_like(q)
    q0 = q.clone().requires_grad_()
    expected = flash_attn_func(q0, k, v, causal=True, deterministic=True)
    expected_grads = torch.autograd.grad(expected, (q0,), dout)
    pending = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time at 2 GHz
        pending.copy_(q)
        x = pending.clone().requires_grad_()
        out = flash_attn_func(x, k, v, causal=True, deterministic=True)
        grads = torch.autograd.grad(out, (x,), dout)
    side.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(grads[0], expected_grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("d", [64, 59])
def test_cuda_graph_capture_and_replay_forward(d):
    q, k, v = (make((2, 256, 8, d), torch.float16) for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch recommends
        flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("d", [64, 59])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_cuda_graph_capture_and_replay_forward_and_backward(deterministic, d):
    """The backward's workspace comes from cudaMallocAsync on the capturing stream (a graph
    memory node), so forward + backward capture as one graph; at d = 59 the padded copies
    (allocated and copied on that stream) too."""
    dtype = torch.bfloat16
    q = make((2, 190, 8, d), dtype, True)
    k, v = make((2, 190, 2, d), dtype, True), make((2, 190, 2, d), dtype, True)
    dout = torch.randn(2, 190, 8, d, dtype=dtype, device="cuda")

    def step():
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, got, want in zip(("out", "dq", "dk", "dv"), static, eager):
            if deterministic or name != "dq":
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
            else:  # dq sums with atomics in no fixed order: equal up to the last bits
                err = (got.double() - want.double()).abs().max().item()
                assert err <= 4 * ULP[dtype] * want.abs().max().item(), f"dq: {err:.3g}"


# ---------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_with_backward(backend):
    if backend == "inductor":
        pytest.importorskip("triton", reason="Inductor's CUDA code generation needs Triton")
    torch._dynamo.reset()
    dtype = torch.float16
    b, s, h, hk, d = 2, 77, 4, 2, 64

    def block(x, w, k, v):
        q = (x @ w).view(b, s, h, d)
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() ** 2).sum()

    x = make((b, s, h * d), dtype, True)
    w = make((h * d, h * d), dtype, True, scale=(h * d) ** -0.5)
    k, v = make((b, s, hk, d), dtype, True), make((b, s, hk, d), dtype, True)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = compiled(x, w, k, v)
    got_grads = torch.autograd.grad(got, (x, w, k, v))
    want = block(x, w, k, v)
    want_grads = torch.autograd.grad(want, (x, w, k, v))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    for name, g, w_ in zip(("dx", "dw", "dk", "dv"), got_grads, want_grads):
        assert g.dtype == dtype and g.shape == w_.shape
        err = (g.double() - w_.double()).abs().max().item()
        assert err <= 1e-2 * w_.abs().max().item() + 1e-3, f"{backend} {name}: {err:.3g}"


# ---------------------------------------------------------------------------- determinism

def test_deterministic_backward_is_bitwise_reproducible():
    dtype = torch.bfloat16
    q = make((2, 333, 8, 128), dtype, True)
    k, v = make((2, 517, 2, 128), dtype, True), make((2, 517, 2, 128), dtype, True)
    dout = torch.randn(2, 333, 8, 128, dtype=dtype, device="cuda")
    runs = []
    for _ in range(4):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for again in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    # The default mode (dq through atomics) computes the same gradients up to rounding.
    out = flash_attn_func(q, k, v, causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], torch.autograd.grad(out, (q, k, v), dout)):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 4 * ULP[dtype] * a.abs().max().item(), f"{name}: {err:.3g}"


# ---------------------------------------------------------------------------- dropout

def keep_mask(q, k, dropout_p, seed, causal):
    """The keep bits (B, H, Sq, Sk) the forward applies for the seed that torch.manual_seed(seed)
    makes the op draw: with v = the identity over the keys, out[b, i, h, j] is
    P_ij * keep_ij / (1 - p), and P_ij > 0 wherever key j is visible. Needs Sk == headdim."""
    b, sk, hk, _ = k.shape
    eye = torch.eye(sk, dtype=q.dtype, device=q.device)[None, :, None, :].expand(b, sk, hk, sk)
    torch.manual_seed(seed)
    probe, _, rng_state = torch.ops.flashattn.fwd(q, k, eye.contiguous(), dropout_p, None, causal,
                                                  -1, -1, 0.0, None, False)
    return (probe != 0).permute(0, 2, 1, 3), rng_state


DROPOUT_SHAPE = (2, 45, 64, 4, 2, 64)  # b, sq, sk (== headdim, for keep_mask), h, hk, d


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_backward_on_cuda_replays_the_cpu_forward_mask(dtype, causal):
    """The forward runs on the CPU backend (which has dropout), the backward on CUDA with the
    forward's rng_state: the CUDA backward must drop exactly the CPU forward's elements."""
    b, sq, sk, h, hk, d = DROPOUT_SHAPE
    q, k, v = (torch.randn(shape).mul(0.5).to(dtype)
               for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    keep, rng_probe = keep_mask(q, k, P_DROP, 1234, causal)
    torch.manual_seed(1234)
    out, lse, rng_state = torch.ops.flashattn.fwd(q, k, v, P_DROP, None, causal, -1, -1, 0.0,
                                                  None, False)
    assert torch.equal(rng_state, rng_probe) and rng_state[0] != 0
    dout = torch.randn_like(out)

    def cuda_backward(rng):
        return torch.ops.flashattn.bwd(*(t.cuda() for t in (dout, q, k, v, out, lse)), rng,
                                       P_DROP, None, causal, -1, -1, 0.0, None, False)

    grads = cuda_backward(rng_state)
    assert all(g.is_cuda and g.dtype == dtype for g in grads)
    out64, grads64, out_low, grads_low = references(
        lambda q, k, v: attention_reference(q, k, v, causal=causal, keep=keep.cuda(),
                                            dropout_p=P_DROP)[0],
        tuple(t.cuda() for t in (q, k, v)), dout.cuda())
    check_forward(out.cuda(), out64, out_low, dtype)  # the CPU forward, as a sanity check
    check_gradients(grads, grads64, grads_low, dtype)
    # And the test can tell masks apart: another seed's backward is far off.
    wrong = cuda_backward(rng_state + torch.tensor([1, 0]))
    err = (wrong[2].double() - grads64[2]).abs().max().item()
    assert err > 10 * (grads[2].double() - grads64[2]).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_forward_on_cuda(dtype, causal):
    """Once the CUDA forward has dropout: torch.manual_seed governs the mask, the mask is the
    CPU backend's bit for bit, and out and the gradients follow the rule with that mask."""
    b, sq, sk, h, hk, d = DROPOUT_SHAPE
    q, k, v = make((b, sq, h, d), dtype, True, 0.5), make((b, sk, hk, d), dtype, True, 0.5), \
        make((b, sk, hk, d), dtype, True)

    def seeded(seed):
        torch.manual_seed(seed)
        return flash_attn_func(q, k, v, dropout_p=P_DROP, causal=causal)

    out = seeded(99)
    assert torch.equal(out, seeded(99)), "the same torch seed must give the same output"
    assert not torch.equal(out, seeded(100)), "another seed must give another mask"

    keep, _ = keep_mask(q.detach(), k.detach(), P_DROP, 99, causal)
    keep_cpu, _ = keep_mask(q.detach().cpu(), k.detach().cpu(), P_DROP, 99, causal)
    assert torch.equal(keep.cpu(), keep_cpu), "CUDA and CPU must keep the same elements"
    visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else \
        torch.ones(sq, sk, dtype=torch.bool)
    n = visible.sum().item() * b * h
    rate = keep_cpu[:, :, visible].float().mean().item()
    sigma = (P_DROP * (1 - P_DROP) / n) ** 0.5
    assert abs(rate - (1 - P_DROP)) < 5 * sigma, f"keep rate {rate:.4f}"

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)  # replays the saved rng_state
    out64, grads64, out_low, grads_low = references(
        lambda q, k, v: attention_reference(q, k, v, causal=causal, keep=keep,
                                            dropout_p=P_DROP)[0], (q, k, v), dout)
    check_forward(out, out64, out_low, dtype)
    check_gradients(grads, grads64, grads_low, dtype)


# ---------------------------------------------------------------------------- training step

def test_training_step_matches_sdpa():
    """A small transformer (bf16) with flashattn and with SDPA, the same weights and tokens:
    each parameter's gradient is within 3x SDPA's own distance from a float64 run of the same
    model (relative Frobenius norms) plus a bf16 rounding unit."""
    from test_torch import TinyLM

    torch.manual_seed(0)
    exact = TinyLM(use_flash=False).cuda().double()
    models = {"sdpa": TinyLM(use_flash=False), "flashattn": TinyLM(use_flash=True)}
    for m in models.values():
        m.load_state_dict(exact.state_dict())
        m.cuda().to(torch.bfloat16)
    tokens = torch.randint(0, 50, (4, 129), device="cuda")

    def step(model):
        model.zero_grad()
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
        loss.backward()
        return loss.item(), {n: p.grad.detach().double() for n, p in model.named_parameters()}

    loss64, grads64 = step(exact)
    results = {name: step(m) for name, m in models.items()}
    (loss_sdpa, grads_sdpa), (loss_ours, grads_ours) = results["sdpa"], results["flashattn"]
    assert abs(loss_ours - loss64) <= 3 * abs(loss_sdpa - loss64) + 2 ** -8 * abs(loss64), \
        (loss64, loss_sdpa, loss_ours)
    for name, g64 in grads64.items():
        norm = g64.norm().item() or 1.0
        ours = (grads_ours[name] - g64).norm().item() / norm
        sdpa = (grads_sdpa[name] - g64).norm().item() / norm
        assert ours <= 3 * sdpa + 2 ** -8, f"{name}: relative error {ours:.3g} vs SDPA's {sdpa:.3g}"


# ---------------------------------------------------------------------------- DLPack (CuPy)

def test_cupy_arrays_through_dlpack():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: the DLPack CUDA path "
                                              "is not tested")
    shape_q, shape_kv = (2, 77, 4, 64), (2, 130, 2, 64)
    q, k, v = (cupy.random.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)
               for s in (shape_q, shape_kv, shape_kv))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and out.shape == shape_q
    assert isinstance(lse, cupy.ndarray) and lse.shape == (2, 4, 77)
    cupy.cuda.get_current_stream().synchronize()
    qt, kt, vt = (torch.from_dlpack(a) for a in (q, k, v))
    want, want_lse, _ = flash_attn_func(qt, kt, vt, causal=True, return_attn_probs=True)
    torch.testing.assert_close(torch.from_dlpack(out), want, rtol=0, atol=0)
    torch.testing.assert_close(torch.from_dlpack(lse), want_lse, rtol=0, atol=0)

    cu = cupy.asarray([0, 30, 30, 77], dtype=cupy.int32)
    qv, kv_, vv = (a[0, :77] for a in (q, k, v))
    got = flash_attn_varlen_func(cupy.ascontiguousarray(qv), cupy.ascontiguousarray(kv_),
                                 cupy.ascontiguousarray(vv), cu, cu, 47, 47)
    cupy.cuda.get_current_stream().synchronize()
    ref = flash_attn_varlen_func(*(torch.from_dlpack(cupy.ascontiguousarray(a))
                                   for a in (qv, kv_, vv)),
                                 torch.from_dlpack(cu), torch.from_dlpack(cu), 47, 47)
    torch.testing.assert_close(torch.from_dlpack(got), ref, rtol=0, atol=0)
    with pytest.raises(TypeError, match="float64"):
        flash_attn_func(q.astype(cupy.float64), k.astype(cupy.float64), v.astype(cupy.float64))
