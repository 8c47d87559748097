"""flashattn.flash_attn_interface's copies of upstream FlashAttention 2's internal entry points
(_flash_attn_forward, _flash_attn_varlen_forward, _flash_attn_backward,
_flash_attn_varlen_backward), which ring-attention libraries call inside their own autograd
functions: on the CPU against the float64 reference and against the public functions."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

from flashattn import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashattn.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward,  # noqa: E402
                                            _flash_attn_varlen_backward, _flash_attn_varlen_forward)
from conftest import page_keys  # noqa: E402
from torch_reference import attention_reference  # noqa: E402


def close(got, ref, rel=2e-5, name=""):
    got, ref = got.detach().double(), ref.detach().double()
    err = (got - ref).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-3)
    assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel:g} x {scale:.3g}"


def poisoned_like(t):
    return torch.full_like(t, float("nan"))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 0))])
def test_dense_forward_and_backward_match_the_reference(causal, window):
    torch.manual_seed(0)
    b, sq, sk, h, hk, d = 2, 19, 27, 6, 2, 40
    q = torch.randn(b, sq, h, d, dtype=torch.float64)
    k = torch.randn(b, sk, hk, d, dtype=torch.float64)
    v = torch.randn(b, sk, hk, d, dtype=torch.float64)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    out, lse, s_dmask, rng_state = _flash_attn_forward(q32, k32, v32, 0.0, 0.2, causal, *window,
                                                       0.0, None, False)
    assert s_dmask is None and rng_state.shape == (2,) and out.grad_fn is None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*leaves, softmax_scale=0.2, causal=causal, window=window)
    close(out, ref_out, name="out")
    close(lse, ref_lse, name="lse")
    dout = torch.randn_like(out)
    grads = [poisoned_like(t) for t in (q32, k32, v32)]
    softmax_d = _flash_attn_backward(dout, q32, k32, v32, out, lse, *grads, 0.0, 0.2, causal,
                                     *window, 0.0, None, False, rng_state)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    for got, ref, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        close(got, ref, rel=5e-5, name=name)
    assert softmax_d.shape == (b, h, sq)
    close(softmax_d, (dout.double() * out.double()).sum(-1).transpose(1, 2), name="softmax_d")


def test_dense_dropout_backward_reproduces_the_forwards_mask():
    """The rng_state the forward returns makes the backward drop the same entries: the
    gradients equal the reference's with the mask read from S_dmask's signs."""
    torch.manual_seed(1)
    b, s, h, d, p = 1, 23, 2, 16, 0.3
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, p, None, True, -1, -1, 0.0,
                                                       None, True)
    keep = s_dmask[..., :s, :s] >= 0
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*leaves, causal=True, keep=keep, dropout_p=p)
    close(out, ref_out, name="out")
    dout = torch.randn_like(out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    _flash_attn_backward(dout, q, k, v, out, lse, *grads, p, None, True, -1, -1, 0.0, None,
                         False, rng_state)
    for got, ref, name in zip(grads, torch.autograd.grad(ref_out, leaves, dout.double()),
                              ("dq", "dk", "dv")):
        close(got, ref, rel=5e-5, name=name)
    with pytest.raises(ValueError, match="rng_state: expected the forward's rng_state"):
        _flash_attn_backward(dout, q, k, v, out, lse, *grads, p, None, True, -1, -1, 0.0, None,
                             False, None)


def test_varlen_forward_and_backward_match_the_public_function():
    torch.manual_seed(2)
    lens_q, lens_k, h, hk, d = [5, 0, 17], [9, 4, 21], 4, 2, 24
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q = torch.randn(sum(lens_q) + 2, h, d)  # two rows past the last sequence
    k, v = torch.randn(sum(lens_k), hk, d), torch.randn(sum(lens_k), hk, d)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse, _, rng_state = _flash_attn_varlen_forward(q, k, v, *args, 0.0, None, True,
                                                        zero_tensors=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pub_out, pub_lse, _ = flash_attn_varlen_func(*leaves, *args, causal=True,
                                                 return_attn_probs=True)
    n = sum(lens_q)
    assert torch.equal(out[:n], pub_out[:n].detach()) and torch.equal(lse[:, :n], pub_lse[:, :n])
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # zero_tensors
    assert torch.isneginf(lse[:, n:]).all()
    dout = torch.randn_like(out)
    dout[n:] = 0
    grads = [poisoned_like(t) for t in (q, k, v)]
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, *args, 0.0, None,
                                            True, -1, -1, 0.0, None, False, rng_state,
                                            zero_tensors=True)
    pub_grads = torch.autograd.grad(pub_out[:n], leaves, dout[:n])
    for got, ref, name in zip(grads, pub_grads, ("dq", "dk", "dv")):
        rows = n if name == "dq" else k.shape[0]
        close(got[:rows], ref[:rows], name=name)
    assert torch.equal(grads[0][n:], torch.zeros_like(grads[0][n:]))  # zero_tensors
    assert softmax_d.shape == (h, q.shape[0])


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_forward_with_seqused_k(paged):
    """seqused_k[b] keys of sequence b's are used; with block_table they are paged. Against
    each sequence alone on its used keys; num_splits=0 gives the default's bits (upstream's
    test_flash_attn_varlen_paged_kv_num_splits, on the CPU)."""
    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    lens_q, lens_k, used, h, hk, d = [1, 3], [12, 30], [7, 30], 4, 2, 16
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d)
    k, v = torch.randn(sum(lens_k), hk, d), torch.randn(sum(lens_k), hk, d)
    table = None
    keys, values = k, v
    if paged:
        kp, vp, tbl = page_keys(k.numpy(), v.numpy(), cu_k.tolist(), 5, rng)
        keys, values, table = torch.from_numpy(kp), torch.from_numpy(vp), torch.from_numpy(tbl)
    seqused = torch.tensor(used, dtype=torch.int32)
    kw = dict(block_table=table, seqused_k=seqused)
    out, lse, _, _ = _flash_attn_varlen_forward(q, keys, values, cu_q, cu_k, 3, 30, 0.0, None,
                                                False, -1, 0, **kw)
    again = _flash_attn_varlen_forward(q, keys, values, cu_q, cu_k, 3, 30, 0.0, None, False, -1,
                                       0, num_splits=0, **kw)[0]
    assert torch.equal(out, again)
    for i in range(2):
        qi = q[cu_q[i]:cu_q[i + 1]].double()[None]
        ki = k[cu_k[i]:cu_k[i] + used[i]].double()[None]
        vi = v[cu_k[i]:cu_k[i] + used[i]].double()[None]
        ref_out, ref_lse = attention_reference(qi, ki, vi, window=(-1, 0))
        close(out[cu_q[i]:cu_q[i + 1]], ref_out[0], name=f"out {i}")
        close(lse[:, cu_q[i]:cu_q[i + 1]], ref_lse[0], name=f"lse {i}")


def test_unsupported_arguments_are_named():
    q = torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="leftpad_k: expected None"):
        _flash_attn_varlen_forward(q, q, q, cu, cu, 3, 3, 0.0, None, False,
                                   leftpad_k=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_splits: expected an int >= 0"):
        _flash_attn_varlen_forward(q, q, q, cu, cu, 3, 3, 0.0, None, False, num_splits=-1)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        _flash_attn_varlen_forward(q, q, q, cu, cu, 3, 3, 0.0, None, False, num_splits=2)


def test_forward_matches_flash_attn_func_bit_for_bit():
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 11, 3, 32, dtype=torch.bfloat16) for _ in range(3))
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    pub_out, pub_lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, pub_out) and torch.equal(lse, pub_lse)


def test_refused_varlen_backward_leaves_the_gradients_untouched():
    """zero_tensors zeroes only after a call that ran: a refused one writes nothing."""
    q = torch.randn(3, 2, 8)
    cu64 = torch.tensor([0, 3], dtype=torch.int64)  # cu_seqlens must be int32
    grads = [torch.full_like(q, 7.0) for _ in range(3)]
    with pytest.raises((ValueError, TypeError), match="cu_seqlens_q"):
        _flash_attn_varlen_backward(q, q, q, q, q, torch.zeros(2, 3), *grads, cu64, cu64, 3, 3,
                                    0.0, None, False, -1, -1, 0.0, None, False, None,
                                    zero_tensors=True)
    assert all(bool((g == 7.0).all()) for g in grads)
