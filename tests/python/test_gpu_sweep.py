"""scripts/gpu_sweep.py, the seeded random sweep of hostile calls (issue 34), run as a test.

The CPU variant runs everywhere torch is installed (100 small calls, about 15 seconds): every
accepted call against the float64 reference, every bad one refused with a message naming its
argument. The CUDA variant (marked `gpu`) runs a short sweep on the GPU, skipped without one;
`scripts/gpu.sh sweep` runs the long one under compute-sanitizer memcheck.
"""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the sweep needs it")

import flashattn  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                      "scripts", "gpu_sweep.py")


def run_sweep(tmp_path, *args):
    result = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"gpu_sweep.py {' '.join(args)} failed:\n{output[-6000:]}"
    with open(tmp_path / "gpu_sweep.json") as f:
        summary = json.load(f)
    assert summary["failures"] == [], output[-6000:]
    return summary, output


def test_cpu_sweep(tmp_path):
    summary, output = run_sweep(tmp_path, "--device", "cpu", "--calls", "100", "--seed", "1")
    kinds = summary["by_kind"]
    assert sum(kinds.values()) == 100
    # Every kind of call ran, and most were checked or refused as expected.
    assert set(kinds) >= {"dense", "varlen", "paged", "kvcache", "kvbad", "invalid"}, kinds
    assert summary["checked"] > 50 and summary["refused"] > 12, output[-2000:]


def test_cpu_sweep_reruns_one_call(tmp_path):
    summary, _ = run_sweep(tmp_path, "--device", "cpu", "--calls", "150", "--seed", "3",
                           "--only", "17")
    assert sum(summary["by_kind"].values()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
@pytest.mark.skipif(not flashattn.cuda_compiled(),
                    reason="flashattn was built without the CUDA backend (no nvcc, or no GPU at test.sh time)")
def test_cuda_sweep(tmp_path):
    summary, output = run_sweep(tmp_path, "--device", "cuda", "--calls", "300", "--seed", "2")
    assert summary["checked"] > 150, output[-2000:]
