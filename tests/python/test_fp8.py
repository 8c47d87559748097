"""FP8 (e4m3) inputs through the Python API on the CPU (docs/SPEC.md, "FP8 inputs"): the forward
against the float64 reference of the dequantised values, the errors, and quantize_fp8."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn.fp8 import dequantize_fp8, hadamard_rotation  # noqa: E402

from conftest import reference  # noqa: E402

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


@pytest.mark.skipif(not (torch.cuda.is_available() and flashattn.cuda_compiled()),
                    reason="needs a GPU and the CUDA backend")
def test_cuda_refuses_fp8_until_its_kernel_exists():
    q = random_fp8(1, 4, 2, 8).cuda()
    with pytest.raises(NotImplementedError, match="fp8_e4m3"):
        flashattn.flash_attn_func(q, q, q, q_descale=torch.ones(1, 2, device="cuda"))
