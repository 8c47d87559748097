"""The benchmarks in bench/ run through the installed package: forward.py, backward.py,
decode.py, overhead.py, forward_features.py, forward_fp8.py and grid.py with --device cpu --quick (the CPU
backend, tiny shapes; the peers and CUDA graphs are recorded as not available), each writing
its JSON with the check of ours passed; forward_features.py with a row of each feature and
its FLOP counts (the window's visible pairs, the sum over the ragged sequences); grid.py's
grid_latest.json in the schema docs/results/h200_grid_latest.json keeps;
cpu.py --quick (ours against torch SDPA on CPU) with both systems timed at every point."""
import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
pytest.importorskip("torch", reason="the benchmarks time torch tensors")
pytest.importorskip("flashattn", reason="the benchmarks time the installed package")


def run(script, out, *extra):
    done = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", "--quick",
                           "--out", str(out), *extra], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()
    assert last and last[-1].startswith("|"), "the markdown table comes last"
    return done


@pytest.mark.parametrize("script", ["forward.py", "backward.py", "decode.py", "overhead.py",
                                    "forward_features.py", "forward_fp8.py"])
def test_a_benchmark_runs_ours_and_checks_it(script, tmp_path):
    run(script, tmp_path)
    name = script[:-3]
    document = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.md").exists()
    assert document["meta"]["device"] == "cpu" and document["meta"]["torch"]
    assert document["rows"]
    for row in document["rows"]:
        assert row["check"]["ok"] and row["check"]["finite"], row["check"]
        ours = row["results"]["ours"]
        assert ours["eager"]["ms"] > 0 and ours["eager"]["samples"] >= 5
        rate = ours["eager"].get("tflops", ours["eager"].get("tbps"))
        assert rate > 0
        assert ours["kernel"] is None and ours["kernel_error"]
        for peer in ("fa2", "cudnn"):
            assert row["results"][peer]["eager"] is None and row["results"][peer]["error"]
    if name == "decode":
        assert {row["paged"] for row in document["rows"]} == {False, True}
        assert document["meta"]["copy_bandwidth"]["tbps"] > 0
    if name == "forward_features":
        rows = {(row["feature"], row["causal"]): row for row in document["rows"]}
        assert {feature for feature, _ in rows} == {"gqa", "window", "varlen", "paged", "softcap",
                                                    "alibi"}
        window = rows["window", True]
        left, right = window["window"]
        assert right == 0  # causal, `left` keys back: query i sees keys max(0, i - left) .. i
        pairs = sum(min(i, left) + 1 for i in range(window["seqlen"]))
        assert window["flops"] == 4 * window["hdim"] * window["batch"] * window["heads"] * pairs
        for causal in (False, True):
            varlen = rows["varlen", causal]
            assert varlen["seqlen"] == max(varlen["lengths"]) and len(varlen["check"]["sequences"])
            full = sum(4 * varlen["heads"] * n * n * varlen["hdim"] for n in varlen["lengths"])
            assert varlen["flops"] == (full / 2 if causal else full)


def test_backward_checks_dropout_with_its_keep_mask(tmp_path):
    """--dropout: ours against float64 gradients that apply the keep mask of ours's own
    forward (S_dmask's signs); a wrong mask or a missing 1 / (1 - p) fails the check."""
    run("backward.py", tmp_path, "--dropout", "0.25")
    document = json.loads((tmp_path / "backward.json").read_text())
    for row in document["rows"]:
        assert row["dropout"] == 0.25
        assert row["check"]["ok"] and row["check"]["peer"] is None, row["check"]


def test_grid_writes_the_schema(tmp_path):
    run("grid.py", tmp_path, "--time-budget-s", "30")
    document = json.loads((tmp_path / "grid_latest.json").read_text())
    assert set(document) == {"meta", "rows"}
    assert document["meta"]["checks_passed"] is True
    rows = document["rows"]
    assert len(rows) == 2  # --quick on the CPU: one hdim and seqlen, causal no and yes
    for row in rows:
        assert set(row) == {"hdim", "causal", "seqlen", "batch", "heads", "fwd", "bwd",
                            "fwd_kernel", "bwd_kernel"}
        for key in ("fwd", "bwd", "fwd_kernel", "bwd_kernel"):
            assert set(row[key]) == {"ours", "fa2", "cudnn"}
        assert row["fwd"]["ours"] > 0 and row["bwd"]["ours"] > 0
        assert row["fwd"]["fa2"] is None and row["fwd_kernel"]["ours"] is None
    assert {row["causal"] for row in rows} == {False, True}
    assert (tmp_path / "grid.md").exists() and (tmp_path / "grid_full.json").exists()


def test_cpu_times_ours_and_torch(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "cpu.py"), "--quick", "--threads", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("|"), "the markdown table comes last"
    document = json.loads((tmp_path / "cpu.json").read_text())
    assert (tmp_path / "cpu.md").exists()
    meta = document["meta"]
    assert meta["threads"] == 2 and meta["threads_torch"] == 2 and meta["torch"]
    assert meta["checks_passed"] is True and meta["skipped"] == 0
    rows = document["rows"]
    # --quick: seqlen 128 and 256, hdim 64, fp32, causal and full, fwd and fwd+bwd
    assert len(rows) == 8
    assert {(r["mode"], r["causal"]) for r in rows} == {(m, c) for m in ("fwd", "fwd+bwd")
                                                       for c in (False, True)}
    for row in rows:
        assert row["check"]["ok"] and row["check"]["finite"], row["check"]
        assert row["check"]["against"] == "float64"
        for system in ("ours", "torch"):
            result = row["results"][system]
            assert 0 < result["min_s"] <= result["median_s"] and result["calls"] >= 3
            assert result["gflops"] > 0
        assert row["ratio"] > 0
