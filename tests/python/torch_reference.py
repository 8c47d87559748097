"""A differentiable float64 reference in PyTorch (scores materialised), for the torch tests."""
import torch


def scores_reference(q, k, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                     alibi=None):
    """The scores (B, H, Sq, Sk) of docs/SPEC.md, steps 1-4: -inf where masked. q (B, Sq, H, D),
    k (B, Sk, Hk, D); computed in the inputs' dtype."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    k = k.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi is not None:
        slopes = alibi.to(s.dtype)
        slopes = slopes[None, :] if slopes.dim() == 1 else slopes
        s = s - slopes[:, :, None, None] * (i + sk - sq - j).abs().to(s.dtype)
    left, right = window
    if causal:
        right = 0
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return s.masked_fill(~visible, float("-inf"))


def attention_reference(q, k, v, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                        alibi=None, keep=None, dropout_p=0.0):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D); computed in the inputs' dtype. keep (B, H, Sq, Sk)
    bool: the dropout mask to apply (scaled by 1/(1-dropout_p)). Returns out, lse."""
    s = scores_reference(q, k, softmax_scale, causal, window, softcap, alibi)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    lse = torch.logsumexp(s, dim=-1)
    # A row that sees no key (every score -inf) gives zeros, as the kernels do; a NaN score
    # (a key of NaN) keeps its row NaN.
    p = torch.softmax(s, dim=-1).masked_fill(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse
