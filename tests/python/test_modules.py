"""flashattn.modules on the CPU: RotaryEmbedding against the rotation written out, MHA against
a plain PyTorch MHA in float64 with the same weights (outputs and gradients; GQA, masks,
rotary, ALiBi, padded and unpadded batches), and cached decoding against recomputation."""
import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the module tests need it")

from flashattn.modules import MHA, InferenceParams, RotaryEmbedding, alibi_standard_slopes  # noqa: E402
from torch_reference import attention_reference  # noqa: E402


def rotate_reference(x, positions, dim, base, interleaved):
    """x (B, S, H, D) float64 rotated on its first dim features at positions (B, S)."""
    out = x.clone()
    for i in range(dim // 2):
        angle = positions.double() * base ** (-2.0 * i / dim)
        c, s = angle.cos()[..., None], angle.sin()[..., None]
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + dim // 2)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def reference_mha(mha, x, positions=None, segments=None):
    """The module's computation in float64 from its weights, with attention_reference: x (B, S,
    E); positions (B, S) for rotary (default 0 .. S - 1); segments: per batch row, the (start,
    end) ranges that attend to themselves only (padding rows left out of every range). The
    weights of a float64 module carry gradients; a lower-precision module's are copied."""
    def weight(t):
        return None if t is None else (t if t.dtype == torch.float64 else t.detach().double())

    qkv = torch.nn.functional.linear(x.double(), weight(mha.Wqkv.weight), weight(mha.Wqkv.bias))
    h, hk, d = mha.num_heads, mha.num_heads_kv, mha.head_dim
    qkv = qkv.unflatten(-1, (h + 2 * hk, d))
    q, k, v = qkv[..., :h, :], qkv[..., h:h + hk, :], qkv[..., h + hk:, :]
    b, s = x.shape[:2]
    if positions is None:
        positions = torch.arange(s).expand(b, s)
    if mha.rotary_emb is not None:
        re = mha.rotary_emb
        q = rotate_reference(q, positions, re.dim, re.base, re.interleaved)
        k = rotate_reference(k, positions, re.dim, re.base, re.interleaved)
    args = dict(softmax_scale=mha.softmax_scale, causal=mha.causal, window=mha.window_size,
                softcap=mha.softcap, alibi=mha.alibi_slopes.double() if mha.alibi_slopes is not None else None)
    if segments is None:
        out = attention_reference(q, k, v, **args)[0]
    else:
        out = torch.zeros(b, s, h, d, dtype=torch.float64)
        for row, ranges in enumerate(segments):
            for start, end in ranges:
                sl = slice(start, end)
                out[row:row + 1, sl] = attention_reference(q[row:row + 1, sl], k[row:row + 1, sl],
                                                           v[row:row + 1, sl], **args)[0]
    return torch.nn.functional.linear(out.flatten(-2), weight(mha.out_proj.weight), weight(mha.out_proj.bias))


def assert_close(got, ref, rel=1e-5, what=""):
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max error {err:.3g}, largest {scale:.3g}"


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [8, 16])
def test_rotary_matches_the_rotation_written_out(interleaved, dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(dim, base=500.0, interleaved=interleaved)
    q, k = torch.randn(2, 7, 3, 16, dtype=torch.float64), torch.randn(2, 7, 1, 16, dtype=torch.float64)
    offsets = torch.tensor([0, 5])
    rq, rk = rope(q, k, seqlen_offset=offsets)
    positions = offsets[:, None] + torch.arange(7)
    assert_close(rq, rotate_reference(q, positions, dim, 500.0, interleaved), rel=1e-6, what="q")
    assert_close(rk, rotate_reference(k, positions, dim, 500.0, interleaved), rel=1e-6, what="k")
    rq3, _ = rope(q, k, seqlen_offset=3)
    assert_close(rq3, rotate_reference(q, torch.arange(3, 10).expand(2, 7), dim, 500.0, interleaved),
                 rel=1e-6, what="int offset")
    # The features past dim are untouched; the tables grow and stay cached.
    assert torch.equal(rq[..., dim:], q[..., dim:])
    cos, _ = rope.cos_sin(40)
    assert cos.shape == (40, dim // 2) and rope.cos_sin(12)[0].data_ptr() == cos.data_ptr()


def test_rotary_rejects_odd_dims():
    with pytest.raises(ValueError, match="dim: expected a positive even number"):
        RotaryEmbedding(7)


CONFIGS = [
    dict(num_heads=4),
    dict(num_heads=4, num_heads_kv=2, causal=True),
    dict(num_heads=6, num_heads_kv=1, causal=True, rotary_emb_dim=8),
    dict(num_heads=4, num_heads_kv=2, window_size=(3, 1), rotary_emb_dim=16, rotary_emb_interleaved=True),
    dict(num_heads=4, causal=True, softcap=5.0, use_alibi=True, qkv_proj_bias=False),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_mha_outputs_and_gradients_match_float64(config):
    torch.manual_seed(1)
    embed = 16 * config["num_heads"]
    mha = MHA(embed, **config)
    x = torch.randn(2, 13, embed, requires_grad=True)
    y = mha(x)
    x64 = x.detach().double().requires_grad_()
    ref = reference_mha(mha, x64)
    assert_close(y, ref, rel=2e-5, what="out")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad, rel=5e-5, what="dx")
    # The weights' gradients: the same check through the float64 module's parameters.
    mha64 = MHA(embed, **config).double()
    mha64.load_state_dict(mha.state_dict())
    reference_mha(mha64, x.detach().double()).backward(dy.double())
    for (name, p), p64 in zip(mha.named_parameters(), mha64.parameters()):
        assert_close(p.grad, p64.grad, rel=5e-5, what=name)


@pytest.mark.parametrize("config", CONFIGS[1:4])
def test_padded_batch_equals_each_sequence_alone(config):
    torch.manual_seed(2)
    embed = 16 * config["num_heads"]
    mha = MHA(embed, **config)
    lengths = [9, 4, 11]
    x = torch.randn(3, 11, embed)
    mask = torch.arange(11)[None, :] < torch.tensor(lengths)[:, None]
    y = mha(x, key_padding_mask=mask)
    ref = reference_mha(mha, x, segments=[[(0, n)] for n in lengths])
    assert_close(y[mask], ref[mask], rel=2e-5, what="tokens")
    assert torch.count_nonzero(y[~mask]) == 0
    # The same batch unpadded, through cu_seqlens.
    cu = torch.tensor([0, 9, 13, 24], dtype=torch.int32)
    y_unpadded = mha(x[mask], cu_seqlens=cu, max_seqlen=11)
    assert_close(y_unpadded, ref[mask], rel=2e-5, what="unpadded")


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2], CONFIGS[4],
                                    dict(num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=16,
                                         rotary_emb_interleaved=True)])
def test_cached_generation_equals_recomputation(config):
    """Prefill then one-token steps through the cache give every position's output of a single
    call on the whole sequence."""
    torch.manual_seed(3)
    embed = 16 * config["num_heads"]
    mha = MHA(embed, layer_idx=0, **config).eval()
    x = torch.randn(2, 12, embed)
    full = mha(x)
    params = InferenceParams(max_seqlen=16, max_batch_size=4)
    with torch.no_grad():
        steps = [mha(x[:, :7], inference_params=params)]
        params.seqlen_offset += 7
        for t in range(7, 12):
            steps.append(mha(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    assert_close(torch.cat(steps, dim=1), full.detach().double(), rel=1e-5, what="cached")
    k_cache, _ = params.key_value_memory_dict[0]
    assert k_cache.shape == (4, 16, mha.num_heads_kv, mha.head_dim)
    assert torch.count_nonzero(k_cache[:, 12:]) == 0  # nothing written past the sequence


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_cache_generation_equals_recomputation(page_size):
    torch.manual_seed(6)
    mha = MHA(64, num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=16, layer_idx=1).eval()
    x = torch.randn(3, 11, 64)
    full = mha(x)
    params = InferenceParams(max_seqlen=14, max_batch_size=3, page_size=page_size)
    with torch.no_grad():
        steps = [mha(x[:, :6], inference_params=params)]
        params.seqlen_offset = 6
        for t in range(6, 11):
            steps.append(mha(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    assert_close(torch.cat(steps, dim=1), full.detach().double(), rel=1e-5, what="paged")
    k_pages, _ = params.key_value_memory_dict[1]
    assert k_pages.shape == (3 * -(-14 // page_size), page_size, 2, 16)
    assert params.block_table.shape == (3, -(-14 // page_size))


def test_cached_generation_with_per_sequence_lengths():
    """Sequences at different lengths share one decode step through lengths_per_sample."""
    torch.manual_seed(4)
    mha = MHA(64, num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=16, layer_idx=3).eval()
    a, b = torch.randn(1, 6, 64), torch.randn(1, 9, 64)
    k_cache, v_cache = torch.zeros(2, 12, 2, 16), torch.zeros(2, 12, 2, 16)
    with torch.no_grad():
        for row, prompt in enumerate((a, b)):  # each prompt prefilled into its own cache row
            alone = InferenceParams(max_seqlen=12, max_batch_size=1)
            alone.key_value_memory_dict[3] = (k_cache[row:row + 1], v_cache[row:row + 1])
            mha(prompt, inference_params=alone)
        params = InferenceParams(max_seqlen=12, max_batch_size=2,
                                 lengths_per_sample=torch.tensor([6, 9], dtype=torch.int32))
        params.key_value_memory_dict[3] = (k_cache, v_cache)
        step = torch.randn(2, 1, 64)
        out = mha(step, inference_params=params)
    full_a = mha(torch.cat([a, step[:1]], dim=1))[:, -1]
    full_b = mha(torch.cat([b, step[1:]], dim=1))[:, -1]
    assert_close(out[:, 0], torch.cat([full_a, full_b]).detach().double(), rel=1e-5, what="step")


def test_cached_generation_under_autocast_keeps_the_projections_dtype():
    """Under autocast the residual stream stays fp32 while q, k, v come out of the projection
    in bf16: the cache and the rotary tables take the projection's dtype, and cached decoding
    gives what one call on the whole sequence gives under the same autocast."""
    torch.manual_seed(7)
    mha = MHA(64, num_heads=4, num_heads_kv=2, causal=True, rotary_emb_dim=16, layer_idx=2).eval()
    x = torch.randn(2, 9, 64)
    params = InferenceParams(max_seqlen=12, max_batch_size=2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = mha(x)
        steps = [mha(x[:, :5], inference_params=params)]
        params.seqlen_offset = 5
        for t in range(5, 9):
            steps.append(mha(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    assert params.key_value_memory_dict[2][0].dtype == torch.bfloat16
    assert_close(torch.cat(steps, dim=1).float(), full.double(), rel=3e-2, what="autocast cached")


def test_module_dtype_conversion_keeps_alibi_slopes_in_fp32():
    """module.to(bf16) converts the weights; the slopes, a kernel argument in fp32, keep their
    dtype and their value, and follow the module across devices."""
    mha = MHA(96, num_heads=6, use_alibi=True).to(torch.bfloat16)
    assert mha.alibi_slopes.dtype == torch.float32
    assert mha.alibi_slopes.tolist() == pytest.approx(alibi_standard_slopes(6), rel=1e-7)
    x = torch.randn(1, 5, 96, dtype=torch.bfloat16)
    ref = reference_mha(mha, x)
    assert_close(mha(x), ref, rel=3e-2, what="bf16 alibi")


def test_mha_rejects_bad_configurations_clearly():
    with pytest.raises(ValueError, match="num_heads_kv: expected a positive divisor of num_heads = 4"):
        MHA(64, num_heads=4, num_heads_kv=3)
    with pytest.raises(ValueError, match="num_heads: expected a positive divisor of embed_dim = 60"):
        MHA(60, num_heads=8)
    with pytest.raises(ValueError, match="rotary_emb_dim: expected an even number"):
        MHA(64, num_heads=4, rotary_emb_dim=18)
    mha = MHA(64, num_heads=4, causal=True)
    with pytest.raises(ValueError, match="layer_idx"):
        mha(torch.randn(1, 3, 64), inference_params=InferenceParams(8, 1))
    mha = MHA(64, num_heads=4, causal=True, layer_idx=0)
    with pytest.raises(ValueError, match="seqlen_offset \\+ seqlen <= max_seqlen = 8"):
        mha(torch.randn(1, 9, 64), inference_params=InferenceParams(8, 1))
    with pytest.raises(ValueError, match="key_padding_mask: expected a bool tensor of shape"):
        mha(torch.randn(2, 3, 64), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))


def test_alibi_standard_slopes():
    assert alibi_standard_slopes(8) == pytest.approx([2 ** (-i) for i in range(1, 9)])
    six = alibi_standard_slopes(6)  # 4 of the series for 4, then every other one of 8's
    assert six == pytest.approx([2 ** (-2 * i) for i in range(1, 5)] + [2 ** -1, 2 ** -3])
    assert all(math.isfinite(s) and s > 0 for s in alibi_standard_slopes(12))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU module tests skipped")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2], CONFIGS[4]])
def test_mha_on_cuda_in_bf16(config):
    """The module in bf16 on the GPU against its float64 computation (bf16's tolerance), and
    cached generation against recomputation in the same dtype."""
    torch.manual_seed(5)
    embed = 16 * config["num_heads"]
    mha = MHA(embed, layer_idx=0, **config).cuda().to(torch.bfloat16)
    x = torch.randn(2, 70, embed, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = mha(x)
    x64 = x.detach().cpu().double().requires_grad_()
    mha64 = MHA(embed, layer_idx=0, **config).double()
    mha64.load_state_dict({k: v.cpu() for k, v in mha.state_dict().items()})
    ref = reference_mha(mha64, x64)
    assert_close(y.cpu(), ref, rel=3e-2, what="out")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.cpu().double())
    assert_close(x.grad.cpu(), x64.grad, rel=5e-2, what="dx")
    mha.eval()
    params = InferenceParams(max_seqlen=80, max_batch_size=2)
    with torch.no_grad():
        full = mha(x.detach())
        steps = [mha(x.detach()[:, :64], inference_params=params)]
        params.seqlen_offset = 64
        for t in range(64, 70):
            steps.append(mha(x.detach()[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    assert_close(torch.cat(steps, dim=1).cpu(), full.cpu().double(), rel=3e-2, what="cached")
