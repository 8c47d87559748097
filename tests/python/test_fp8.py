"""FP8 (e4m3) inputs through the Python API on the CPU (docs/SPEC.md, "FP8 inputs"): the forward
against the float64 reference of the dequantised values, the errors, and quantize_fp8."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn.fp8 import dequantize_fp8, hadamard_rotation  # noqa: E402

from conftest import mask, page_keys, reference  # noqa: E402

E4M3 = torch.float8_e4m3fn


def random_fp8(*shape, spread=8.0):
    return (torch.randn(*shape) * spread).clamp(-448, 448).to(E4M3)


def random_descale(*shape):
    return torch.exp2(torch.empty(*shape).uniform_(-2, 2))


def expect_close_to_dequantised(out, q, k, v, qd, kd, vd, **options):
    """out (bf16) within one bf16 rounding (plus fp32's 1e-5) of the float64 attention over
    the exactly dequantised inputs: the CPU engine's rule for fp8."""
    window = options.pop("window_size", (-1, -1))
    exact, _ = reference(dequantize_fp8(q, qd).double().numpy(),
                         dequantize_fp8(k, kd).double().numpy(),
                         dequantize_fp8(v, vd).double().numpy(), window=window, **options)
    assert out.dtype == torch.bfloat16
    error = np.abs(out.double().numpy() - exact).max()
    tolerance = (2.0 ** -8 + 1e-5) * np.abs(exact).max()
    assert error <= tolerance, (error, tolerance)


@pytest.mark.parametrize("block_scaling", [False, True])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (50, -1), 0.0),
                                                   (False, (3, 7), 4.0)])
def test_forward_matches_the_dequantised_reference(block_scaling, causal, window, softcap):
    b, sq, sk, h, hk, d = 2, 131, 260, 4, 2, 24
    q, k, v = random_fp8(b, sq, h, d), random_fp8(b, sk, hk, d), random_fp8(b, sk, hk, d)
    blocks = lambda s: -(-s // flashattn.FP8_SCALE_BLOCK_ROWS)  # noqa: E731
    if block_scaling:
        qd, kd, vd = (random_descale(b, hk, blocks(sq)), random_descale(b, hk, blocks(sk)),
                      random_descale(b, hk, blocks(sk)))
    else:
        qd, kd, vd = (random_descale(b, hk) for _ in range(3))
    out, lse, probs = flashattn.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, return_attn_probs=True,
        q_descale=qd, k_descale=kd, v_descale=vd)
    assert probs is None and lse.shape == (b, h, sq) and lse.dtype == torch.float32
    expect_close_to_dequantised(out, q, k, v, qd, kd, vd, causal=causal, window_size=window,
                                softcap=softcap)


def test_absent_descales_are_one():
    q, k, v = random_fp8(1, 7, 2, 16), random_fp8(1, 9, 2, 16), random_fp8(1, 9, 2, 16)
    ones = torch.ones(1, 2)
    expect_close_to_dequantised(flashattn.flash_attn_func(q, k, v), q, k, v, ones, ones, ones)


def test_varlen_matches_dense_per_sequence():
    h, d = 2, 16
    lengths_q, lengths_k = [5, 0, 140], [9, 3, 150]
    cu_q = torch.tensor([0] + list(np.cumsum(lengths_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lengths_k)), dtype=torch.int32)
    q, k, v = random_fp8(sum(lengths_q), h, d), random_fp8(sum(lengths_k), h, d), random_fp8(
        sum(lengths_k), h, d)
    qd, kd, vd = random_descale(3, h, 2), random_descale(3, h, 2), random_descale(3, h)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 140, 150, causal=True,
                                           q_descale=qd, k_descale=kd, v_descale=vd)
    for s in range(3):
        if lengths_q[s] == 0:
            continue
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        expect_close_to_dequantised(out[None, rq], q[None, rq], k[None, rk], v[None, rk],
                                    qd[s:s + 1], kd[s:s + 1], vd[s:s + 1], causal=True)


def seqlen_major(v):
    """v's values stored (d, seqlen)-major (each head-dim column of a head a contiguous run of
    its rows, padded to a 16-byte multiple), viewed with v's sizes: a view, never a copy."""
    rows = v.shape[-3]
    padded = -(-rows // 16) * 16 + 16
    store = torch.full(v.shape[:-3] + (v.shape[-2], v.shape[-1], padded), float("nan"), device=v.device).to(v.dtype)
    store[..., :rows] = v.movedim(-3, -1)
    view = store[..., :rows].movedim(-1, -3)
    assert view.stride(-3) == 1 and view.stride(-1) == padded and torch.equal(view.float(), v.float())  # noqa
    return view


@pytest.mark.parametrize("causal", [False, True])
def test_values_seqlen_major_equal_row_major(causal):
    """v (d, seqlen)-major, dense and varlen: the same result, bit for bit, as v row-major
    (the CPU engine dequantises the same values either way)."""
    q, k, v = random_fp8(2, 37, 4, 24), random_fp8(2, 150, 2, 24), random_fp8(2, 150, 2, 24)
    qd, kd, vd = random_descale(2, 2), random_descale(2, 2, 2), random_descale(2, 2, 2)
    options = dict(causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    row_major = flashattn.flash_attn_func(q, k, v, **options)
    assert torch.equal(flashattn.flash_attn_func(q, k, seqlen_major(v), **options), row_major)
    cu_q = torch.tensor([0, 37, 74], dtype=torch.int32)
    cu_k = torch.tensor([0, 150, 300], dtype=torch.int32)
    varlen = [flashattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), values, cu_q, cu_k, 37, 150,
                                               **options) for values in (v.flatten(0, 1), seqlen_major(v.flatten(0, 1)))]
    assert torch.equal(varlen[0], varlen[1])
    assert torch.equal(varlen[0], row_major.flatten(0, 1))


@pytest.mark.parametrize("shape", [(2, 37, 3, 32), (70, 2, 16)])
def test_seqlen_major_helper(shape):
    """flashattn.fp8.seqlen_major: the same values and sizes, the sequence dimension contiguous,
    columns at 16-byte multiples; the forward takes it as it is (bit for bit on the CPU)."""
    from flashattn.fp8 import seqlen_major as helper
    v = random_fp8(*shape)
    vt = helper(v)
    assert vt.shape == v.shape and vt.dtype == v.dtype and torch.equal(vt.float(), v.float())
    assert vt.stride(-3) == 1 and vt.stride(-1) % 16 == 0 and vt.stride(-1) >= shape[-3]
    if len(shape) == 4:
        q, k = random_fp8(2, 9, 3, 32), random_fp8(2, 37, 3, 32)
        assert torch.equal(flashattn.flash_attn_func(q, k, vt, causal=True),
                           flashattn.flash_attn_func(q, k, v, causal=True))
    with pytest.raises(ValueError, match="v: expected 3 or 4 dimensions"):
        helper(v[0, 0])


def test_values_neither_row_nor_seqlen_major_are_copied():
    """A v with neither dimension contiguous (every other row of a (d, seqlen)-major one) runs
    on a row-major copy, as any other input."""
    q, k, v = random_fp8(1, 9, 2, 16), random_fp8(1, 40, 2, 16), random_fp8(1, 80, 2, 16)
    ones = torch.ones(1, 2)
    strided = seqlen_major(v)[:, ::2]
    assert strided.stride(1) == 2 and strided.stride(-1) != 1
    expect_close_to_dequantised(flashattn.flash_attn_func(q, k, strided), q, k, v[:, ::2], ones, ones, ones)


def test_errors_name_the_argument():
    q, k, v = random_fp8(2, 5, 4, 8), random_fp8(2, 5, 2, 8), random_fp8(2, 5, 2, 8)
    with pytest.raises(ValueError, match=r"k_descale: expected shape .*\(B, Hk\).*given.*\(2, 4\)"):
        flashattn.flash_attn_func(q, k, v, k_descale=torch.ones(2, 4))
    with pytest.raises(TypeError, match="q_descale: expected dtype fp32, given dtype bf16"):
        flashattn.flash_attn_func(q, k, v, q_descale=torch.ones(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dropout_p: expected 0 for fp8_e4m3"):
        flashattn.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="k: expected dtype fp8_e4m3, given dtype bf16"):
        flashattn.flash_attn_func(q, k.to(torch.bfloat16), v)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(ValueError, match="v_descale: expected none: descales go with fp8_e4m3"):
        flashattn.flash_attn_func(qb, kb, vb, v_descale=torch.ones(2, 2))


def test_no_backward():
    q = random_fp8(1, 4, 2, 8).requires_grad_(True)
    out = flashattn.flash_attn_func(q, q, q)
    with pytest.raises(NotImplementedError, match="fp8 inputs are forward only"):
        out.float().sum().backward()


def test_dlpack_fp8_through_the_thin_binding():
    """flashattn._C (for other frameworks) takes DLPack float8_e4m3fn arrays and descales."""
    q = random_fp8(1, 6, 2, 8)
    qd = random_descale(1, 2)
    out = torch.empty(1, 6, 2, 8, dtype=torch.bfloat16)
    flashattn._C.forward(q, q, q, out, None, q_descale=qd)
    assert torch.equal(out, flashattn.flash_attn_func(q, q, q, q_descale=qd))


# ---- quantize_fp8

def outlier_heavy(*shape, generator=None):
    """The FA3 paper's inputs: N(0, 1) + N(0, 100) x Bernoulli(0.001), per entry."""
    base = torch.randn(*shape, generator=generator)
    outliers = torch.randn(*shape, generator=generator) * 10.0
    keep = torch.rand(*shape, generator=generator) < 0.001
    return base + outliers * keep


def expect_within_e4m3_rounding(x, x8, descale):
    """|dequantised - x| <= half an e4m3 unit: 2^-4 relative for normals, 2^-10 x descale
    (half the smallest subnormal) near zero."""
    back = dequantize_fp8(x8, descale)
    per_row = dequantize_fp8(torch.ones_like(x8, dtype=torch.float32).to(E4M3), descale)
    bound = x.float().abs() * 2.0 ** -4 + per_row * 2.0 ** -10
    assert torch.all((back - x.float()).abs() <= bound * (1 + 1e-6))


@pytest.mark.parametrize("block_scaling", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_dequantises_within_e4m3_rounding(block_scaling, dtype):
    x = outlier_heavy(2, 300, 6, 32).to(dtype)
    x8, descale = flashattn.quantize_fp8(x, num_heads_k=3, block_scaling=block_scaling)
    assert x8.dtype == E4M3 and x8.shape == x.shape
    assert descale.dtype == torch.float32
    assert descale.shape == ((2, 3, 3) if block_scaling else (2, 3))
    expect_within_e4m3_rounding(x, x8, descale)
    # amax / 448: the largest magnitude of each group maps to 448, nothing saturates past it.
    assert x8.float().abs().max() == 448.0


def test_quantize_zero_block_and_short_sequence():
    x = torch.zeros(1, 3, 2, 8)
    x[0, 1, 1, 2] = 5.0
    x8, descale = flashattn.quantize_fp8(x, block_scaling=True)
    assert descale.shape == (1, 2, 1) and descale[0, 0, 0] == 1.0
    assert torch.equal(dequantize_fp8(x8, descale), x)


def test_hadamard_rotation_is_orthogonal_and_keeps_qk():
    r = hadamard_rotation(64, seed=3).double()
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-6)
    assert not torch.equal(hadamard_rotation(64, seed=3), hadamard_rotation(64, seed=4))
    with pytest.raises(ValueError, match="hadamard: expected a head dim that is a power of two"):
        hadamard_rotation(48, seed=0)


@pytest.mark.parametrize("block_scaling", [False, True])
def test_rotated_quantised_qk_equals_the_original_within_rounding(block_scaling):
    q, k = outlier_heavy(1, 200, 2, 64), outlier_heavy(1, 150, 2, 64)
    q8, qd = flashattn.quantize_fp8(q, hadamard=True, seed=7, block_scaling=block_scaling)
    k8, kd = flashattn.quantize_fp8(k, hadamard=True, seed=7, block_scaling=block_scaling)
    rq, rk = dequantize_fp8(q8, qd).double(), dequantize_fp8(k8, kd).double()
    exact = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    got = torch.einsum("bqhd,bkhd->bhqk", rq, rk)
    # Each rotated element is within 2^-4 of itself (relative) plus the subnormal floor: the
    # dot product within ~2 x 2^-4 of sum |q_d||k_d| (Cauchy-Schwarz on the rotated rows).
    bound = 2.2 * 2.0 ** -4 * torch.einsum("bqhd,bkhd->bhqk", rq.abs(), rk.abs()) + 1e-3
    assert torch.all((got - exact).abs() <= bound)
    # Unquantised, the rotation alone leaves q k^T as it was (fp32 rounding only).
    r = hadamard_rotation(64, seed=7).double()
    assert torch.allclose(torch.einsum("bqhd,bkhd->bhqk", q.double() @ r, k.double() @ r), exact,
                          atol=1e-9 * exact.abs().max().item())


def test_quantised_inputs_run_through_the_forward():
    q, k, v = outlier_heavy(1, 130, 4, 32), outlier_heavy(1, 140, 2, 32), outlier_heavy(1, 140, 2, 32)
    q8, qd = flashattn.quantize_fp8(q, num_heads_k=2, block_scaling=True, hadamard=True, seed=1)
    k8, kd = flashattn.quantize_fp8(k, block_scaling=True, hadamard=True, seed=1)
    v8, vd = flashattn.quantize_fp8(v, block_scaling=True)
    out = flashattn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                    v_descale=vd, softmax_scale=1 / math.sqrt(32))
    expect_close_to_dequantised(out, q8, k8, v8, qd, kd, vd, causal=True,
                                softmax_scale=1 / math.sqrt(32))
    exact, _ = reference(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True)
    rmse = np.sqrt(np.mean((out.double().numpy() - exact) ** 2))
    assert rmse < 0.05, rmse


def test_compiles_without_graph_breaks():
    """The fp8 ops have fake implementations: torch.compile traces them whole (bf16 out)."""
    q, k, v = random_fp8(1, 9, 2, 16), random_fp8(1, 11, 1, 16), random_fp8(1, 11, 1, 16)
    qd, kd, vd = random_descale(1, 1), random_descale(1, 1, 1), random_descale(1, 1)

    def attend(q, k, v, qd, kd, vd):
        return flashattn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                         v_descale=vd)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, qd, kd, vd), attend(q, k, v, qd, kd, vd))


def test_accuracy_demo_runs_and_the_rotation_helps(tmp_path):
    """bench/fp8_accuracy.py --quick: every scheme's RMSE, and the Hadamard rotation lowering
    the per-(batch, head) scheme's error on outlier-heavy inputs."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "fp8_accuracy.py"
    subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)], check=True,
                   capture_output=True)
    rows = {r["scheme"]: r for r in json.loads((tmp_path / "fp8_accuracy.json").read_text())["rows"]}
    assert len(rows) == 7
    plain, rotated = rows["per-(batch, head)"], rows["per-(batch, head) + Hadamard"]
    assert rotated["cpu_path"] < plain["cpu_path"]
    assert rotated["p_in_e4m3"] < plain["p_in_e4m3"]


# ---- the Hopper kernel (runs on a GPU)

hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and flashattn.cuda_compiled()
         and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper GPU and the CUDA backend: the FP8 kernel's tests skipped")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flashattn.cuda_compiled()),
                          reason="needs a GPU and the CUDA backend (skipped)")


def kernel_emulation(q8, k8, v8, qd, kd, vd, causal=False, window=(-1, -1), softcap=0.0,
                     softmax_scale=None):
    """out (B, Sq, H, D) of the Hopper FP8 kernel emulated in float64 (docs/SPEC.md, "FP8
    inputs"): the scores of the exactly dequantised q and k; per query tile of 128 rows its key
    blocks of 128 (aligned to the sequence's start) in order, with the running max; each
    block's exponentials rounded to e4m3 as they are, times the stored (raw) V, added to O
    kept in units of the last block's v factor (O times vd(previous) / vd(block) before the
    block; a block whose factor is 0 adds nothing); the sum unrounded; out = O vd(last) / sum.
    Only the fp32 arithmetic of the kernel differs from it."""
    b, sq, h, d = q8.shape
    sk, hk = k8.shape[1], k8.shape[2]
    group = h // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = dequantize_fp8(q8, qd).double()
    kf = dequantize_fp8(k8, kd).double().repeat_interleave(group, dim=2)
    v_raw = v8.double().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~torch.from_numpy(mask(sq, sk, causal, window)), -math.inf)
    blocks = -(-sk // 128)
    v_factor = vd.double().reshape(b, hk, -1).expand(b, hk, blocks) if vd.dim() == 2 or \
        vd.shape[2] == 1 else vd.double()
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            factors = v_factor[bi, hi // group]
            for m0 in range(0, sq, 128):
                st = s[bi, hi, m0:m0 + 128]
                seen = torch.isfinite(st).any(dim=0).nonzero()
                if len(seen) == 0:
                    continue
                first, last = int(seen.min()) // 128, int(seen.max()) // 128
                v_unit = 1.0
                m = torch.full((st.shape[0],), -math.inf, dtype=torch.float64)
                total = torch.zeros(st.shape[0], dtype=torch.float64)
                acc = torch.zeros(st.shape[0], d, dtype=torch.float64)
                for j in range(first, last + 1):
                    sj = st[:, 128 * j:128 * j + 128]
                    m_new = torch.maximum(m, sj.max(dim=1).values)
                    finite = torch.isfinite(m_new)
                    shift = torch.where(finite, m_new, torch.zeros_like(m_new))
                    p = torch.exp(sj - shift[:, None])
                    alpha = torch.where(finite, torch.exp(m - shift), torch.zeros_like(m))
                    total = total * alpha + p.sum(dim=1)
                    factor = float(factors[j])
                    if factor > 0:
                        acc = acc * (v_unit / factor)
                        v_unit = factor
                    p8 = p.float().to(E4M3).double() * (1.0 if factor > 0 else 0.0)
                    acc = acc * alpha[:, None] + p8 @ v_raw[bi, 128 * j:128 * j + 128, hi]
                    m = m_new
                safe = torch.where(total > 0, total, torch.ones_like(total))
                out[bi, m0:m0 + 128, hi] = torch.where(total[:, None] > 0, acc * v_unit / safe[:, None], 0.0)
    return out


def quantized(b, s, h, d, generator, block_scaling, num_heads_k=None):
    x = torch.randn(b, s, h, d, generator=generator)
    return flashattn.quantize_fp8(x, num_heads_k=num_heads_k, block_scaling=block_scaling)


# The FP8 tensor cores keep about 13-14 bits of each product sum (not fp32's 24), so a score
# of the kernel may be off by 2^-10 of its row's absolute dot products |q| . |k| (scaled),
# over the 4-8 wgmmas of a head dim; that error reaches lse directly and P's exponentials.
FP8_SUM_ERROR = 2.0 ** -10


def score_error_bound(q8, k8, qd, kd):
    """(B, H, Sq): how far the tensor cores' FP8 sums may move a row's scores, FP8_SUM_ERROR of
    the row's largest scaled |q| . |k| (float64 of the dequantised inputs)."""
    qf, kf = dequantize_fp8(q8, qd).double(), dequantize_fp8(k8, kd).double()
    group = q8.shape[2] // k8.shape[2]
    absolute = torch.einsum("bqhd,bkhd->bhqk", qf.abs(), kf.abs().repeat_interleave(group, dim=2))
    return FP8_SUM_ERROR * absolute.amax(dim=-1) / math.sqrt(q8.shape[-1])


def expect_kernel_result(out, q8, k8, v8, qd, kd, vd, **options):
    """out (bf16, on the GPU) against kernel_emulation: the RMS error within 1% of the RMS
    output (bf16's rounding and the few probabilities that round the other way at an e4m3
    boundary) plus the RMS over rows of the scores' error bound (score_error_bound) times it
    (the tensor cores' sums move each probability by up to that much, relative: 1.2% at head
    dim 256 on these inputs), the largest within 1/8 of the largest output. Without P's
    rounding (the CPU path) the RMS error is a few per cent; a wrong key order, block or
    factor gives errors of the order of the outputs themselves."""
    emulated = kernel_emulation(q8, k8, v8, qd, kd, vd, **options)
    got = out.double().cpu()
    assert got.shape == emulated.shape and torch.isfinite(got).all()
    rms = emulated.pow(2).mean().sqrt().item()
    error = (got - emulated).abs()
    sums = score_error_bound(q8, k8, qd, kd).pow(2).mean().sqrt().item()
    assert error.pow(2).mean().sqrt().item() <= (1e-2 + sums) * rms, \
        (error.pow(2).mean().sqrt().item(), rms, sums)
    assert error.max().item() <= 2.0 ** -3 * emulated.abs().max().item(), error.max().item()


def expect_lse(lse, q8, k8, v8, qd, kd, vd, causal, window, softcap):
    """lse does not see P's rounding: against float64 of the dequantised inputs, within the
    tensor cores' sums (FP8_SUM_ERROR of each row's largest scaled |q| . |k|)."""
    qf, kf, vf = (dequantize_fp8(x, f).double() for x, f in ((q8, qd), (k8, kd), (v8, vd)))
    _, lse64 = reference(qf.numpy(), kf.numpy(), vf.numpy(), causal=causal, window=window, softcap=softcap)
    bound = score_error_bound(q8, k8, qd, kd).numpy() + 1e-5 * np.abs(lse64)
    lse = lse.double().cpu().numpy()
    finite = np.isfinite(lse64)
    assert (np.isfinite(lse) == finite).all()
    assert (np.abs(lse - lse64)[finite] <= bound[finite]).all(), np.abs(lse - lse64)[finite].max()


@hopper
@pytest.mark.parametrize("d", [128, 256, 80])
@pytest.mark.parametrize("block_scaling", [False, True])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (200, 7), 0.0), (True, (-1, -1), 8.0)])
def test_cuda_forward_matches_the_kernel_emulation(d, block_scaling, causal, window, softcap):
    b, sq, sk, h, hk = 2, 300, 397, 4, 2
    g = torch.Generator().manual_seed(d + 7 * block_scaling + 13 * causal + int(softcap))
    (q8, qd), (k8, kd), (v8, vd) = (quantized(b, s, n, d, g, block_scaling, num_heads_k=hk)
                                    for s, n in ((sq, h), (sk, hk), (sk, hk)))
    options = dict(causal=causal, window_size=window, softcap=softcap)
    cuda = [t.cuda() for t in (q8, k8, v8, qd, kd, vd)]
    out, lse, _ = flashattn.flash_attn_func(*cuda[:3], q_descale=cuda[3], k_descale=cuda[4],
                                            v_descale=cuda[5], return_attn_probs=True, **options)
    expect_kernel_result(out, q8, k8, v8, qd, kd, vd, causal=causal, window=window, softcap=softcap)
    expect_lse(lse, q8, k8, v8, qd, kd, vd, causal, window, softcap)


@hopper
def test_cuda_varlen_and_paged_match_the_dense_calls():
    """A ragged batch (an empty sequence among them), its keys dense and then in pages of
    256 in a random order: each sequence as the dense call on its own rows gives it."""
    h, hk, d = 4, 1, 128
    lengths_q, lengths_k = [130, 0, 257, 5], [300, 64, 511, 129]
    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0] + list(np.cumsum(lengths_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lengths_k)), dtype=torch.int32)
    q8, _ = quantized(1, sum(lengths_q), h, d, g, False)
    k8, _ = quantized(1, sum(lengths_k), hk, d, g, False)
    v8, _ = quantized(1, sum(lengths_k), hk, d, g, False)
    q8, k8, v8 = q8[0], k8[0], v8[0]
    # Per-block factors: ceil(max_seqlen / 128) blocks (3 for q, 4 for k and v).
    qd, kd, vd = (torch.exp2(torch.empty(4, hk, n).uniform_(-3, -1, generator=g)) for n in (3, 4, 4))
    cuda = dict(q_descale=qd.cuda(), k_descale=kd.cuda(), v_descale=vd.cuda())
    out = flashattn.flash_attn_varlen_func(q8.cuda(), k8.cuda(), v8.cuda(), cu_q.cuda(), cu_k.cuda(),
                                           max(lengths_q), max(lengths_k), causal=True, **cuda).cpu()
    rng = np.random.default_rng(5)
    # (Paged as float32, exact for e4m3 values: the unused rows NaN, which e4m3 holds too.)
    k_pages, v_pages, table = page_keys(k8.float().numpy(), v8.float().numpy(), cu_k.numpy(), 256, rng)
    paged = flashattn.flash_attn_varlen_func(
        q8.cuda(), torch.from_numpy(k_pages).to(E4M3).cuda(), torch.from_numpy(v_pages).to(E4M3).cuda(),
        cu_q.cuda(), cu_k.cuda(), max(lengths_q), max(lengths_k), causal=True,
        block_table=torch.from_numpy(table).cuda(), **cuda).cpu()
    assert torch.equal(out, paged)
    for s in range(4):
        if lengths_q[s] == 0:
            continue
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        blocks = lambda n: -(-n // 128)  # noqa: E731
        one = [qd[s:s + 1, :, :blocks(lengths_q[s])], kd[s:s + 1, :, :blocks(lengths_k[s])],
               vd[s:s + 1, :, :blocks(lengths_k[s])]]
        dense = flashattn.flash_attn_func(q8[None, rq].cuda(), k8[None, rk].cuda(), v8[None, rk].cuda(),
                                          causal=True, q_descale=one[0].cuda(), k_descale=one[1].cuda(),
                                          v_descale=one[2].cuda()).cpu()
        assert torch.equal(out[None, rq], dense), s


@hopper
@pytest.mark.parametrize("d", [128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_values_seqlen_major_match_the_kernel_emulation(d, causal):
    """v given (d, seqlen)-major (no transposing warps; P's registers put in key order):
    within the same rules as the row-major call, per-block descales when causal."""
    b, sq, sk, h, hk = 2, 300, 397, 4, 2
    g = torch.Generator().manual_seed(d + 5 * causal)
    (q8, qd), (k8, kd), (v8, vd) = (quantized(b, s, n, d, g, causal, num_heads_k=hk)
                                    for s, n in ((sq, h), (sk, hk), (sk, hk)))
    out, lse, _ = flashattn.flash_attn_func(q8.cuda(), k8.cuda(), seqlen_major(v8.cuda()), causal=causal,
                                            q_descale=qd.cuda(), k_descale=kd.cuda(), v_descale=vd.cuda(),
                                            return_attn_probs=True)
    expect_kernel_result(out, q8, k8, v8, qd, kd, vd, causal=causal)
    expect_lse(lse, q8, k8, v8, qd, kd, vd, causal, (-1, -1), 0.0)


@hopper
@pytest.mark.parametrize("d", [128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_row_major_values_read_often_match_the_kernel_emulation(d, causal):
    """A dense call whose keys are each read by >= 2048 query rows (4 query heads per key/value
    head x 600) runs on a (d, seqlen)-major copy of its row-major v: the same rules."""
    b, sq, sk, h, hk = 1, 600, 397, 4, 1
    g = torch.Generator().manual_seed(d + 3 * causal)
    (q8, qd), (k8, kd), (v8, vd) = (quantized(b, s, n, d, g, causal, num_heads_k=hk)
                                    for s, n in ((sq, h), (sk, hk), (sk, hk)))
    out, lse, _ = flashattn.flash_attn_func(q8.cuda(), k8.cuda(), v8.cuda(), causal=causal, q_descale=qd.cuda(),
                                            k_descale=kd.cuda(), v_descale=vd.cuda(), return_attn_probs=True)
    expect_kernel_result(out, q8, k8, v8, qd, kd, vd, causal=causal)
    expect_lse(lse, q8, k8, v8, qd, kd, vd, causal, (-1, -1), 0.0)


@hopper
def test_cuda_refuses_varlen_values_seqlen_major():
    """On CUDA (d, seqlen)-major values go with dense calls only: a varlen sequence's first key
    need not start a TMA box at a 16-byte multiple. Refused before anything is written."""
    q, k, v = random_fp8(60, 2, 128).cuda(), random_fp8(70, 2, 128).cuda(), random_fp8(70, 2, 128).cuda()
    cu_q = torch.tensor([0, 20, 60], dtype=torch.int32).cuda()
    cu_k = torch.tensor([0, 33, 70], dtype=torch.int32).cuda()
    with pytest.raises(NotImplementedError, match="v: expected a contiguous last dimension for varlen calls"):
        flashattn.flash_attn_varlen_func(q, k, seqlen_major(v), cu_q, cu_k, 40, 37)


@pytest.mark.skipif(not (torch.cuda.is_available() and flashattn.cuda_compiled())
                    or torch.cuda.get_device_capability()[0] == 9,
                    reason="needs a GPU other than Hopper: there the FP8 kernel runs (skipped)")
def test_cuda_refuses_fp8_off_hopper():
    q = random_fp8(1, 4, 2, 64).cuda()
    with pytest.raises(NotImplementedError, match="fp8_e4m3"):
        flashattn.flash_attn_func(q, q, q)

