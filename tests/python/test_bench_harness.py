"""bench/harness.py's side-by-side timing (time_interleaved), which every benchmark uses: the
rounds, their rotating order, the split of each system's samples and the median, with a fake
sampler in place of CUDA events (no GPU, no torch needed); and its counts and checks."""
import importlib
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_harness():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # as the scripts in bench/ import it
    return importlib.import_module("harness")


class FakeTimer:
    """Stands in for the samplers: each system's samples take the milliseconds its list
    gives, in turn; every timed batch is logged as (system, first sample index, count)."""

    def __init__(self, ms_of):
        self.ms_of, self.log, self.next = ms_of, [], {name: 0 for name in ms_of}

    def sampler(self, name):
        def sample(start, n):
            if isinstance(self.ms_of[name], Exception):
                raise self.ms_of[name]
            self.log.append((name, start, n))
            times = []
            for _ in range(n):
                seq = self.ms_of[name]
                times.append(seq[self.next[name] % len(seq)])
                self.next[name] += 1
            return times
        return sample

    def samplers(self):
        return {name: self.sampler(name) for name in self.ms_of}


def test_rounds_rotate_and_split_every_system_s_samples():
    h = load_harness()
    timer = FakeTimer({"ours": [1.0], "fa2": [2.0], "cudnn": [4.0]})
    # target 0.03 s: ours 30 samples, fa2 15, cudnn 8 (7.5 rounded up); 3 warm-up samples each.
    result = h.time_interleaved(timer.samplers(), target_s=0.03, max_reps=100)
    timed = [entry for entry in timer.log if entry[1] != 1 or entry[2] != 3]
    order = [name for name, _, _ in timed]
    assert order == ["ours", "fa2", "cudnn", "fa2", "cudnn", "ours", "cudnn", "ours", "fa2"]
    counts = {name: [n for who, _, n in timed if who == name] for name in timer.ms_of}
    assert counts == {"ours": [10, 10, 10], "fa2": [5, 5, 5], "cudnn": [2, 3, 3]}
    # Each round continues the rotation through the input sets where the last one stopped.
    assert [start for who, start, _ in timed if who == "cudnn"] == [0, 2, 5]
    assert {name: r.timing.samples for name, r in result.items()} == \
        {"ours": 30, "fa2": 15, "cudnn": 8}
    assert {name: r.timing.ms for name, r in result.items()} == \
        {"ours": 1.0, "fa2": 2.0, "cudnn": 4.0}
    assert all(len(r.windows) == 3 and r.error is None for r in result.values())


def test_median_over_all_rounds_and_the_reps_bounds():
    h = load_harness()
    # Warm-up samples 1, 9, 5 (estimate 5 ms), then 1..9 ms repeating: median of 9 is 5.
    timer = FakeTimer({"ours": [1.0, 9.0, 5.0] + [float(i) for i in range(1, 10)]})
    result = h.time_interleaved(timer.samplers(), target_s=1.0, max_reps=9)["ours"]
    assert (result.timing.samples, result.timing.ms) == (9, 5.0)
    assert (result.timing.ms_min, result.timing.ms_max) == (1.0, 9.0)
    # A run far shorter than the target still takes MIN_REPS samples.
    timer = FakeTimer({"ours": [100.0]})
    result = h.time_interleaved(timer.samplers(), target_s=0.001, max_reps=100)["ours"]
    assert result.timing.samples == h.MIN_REPS


def test_a_failing_system_is_reported_and_the_others_are_timed():
    h = load_harness()
    failure = RuntimeError("refused")
    timer = FakeTimer({"ours": [1.0], "fa2": failure})
    result = h.time_interleaved(timer.samplers(), target_s=0.01, max_reps=100)
    assert result["fa2"].error is failure and result["fa2"].timing is None
    assert result["ours"].error is None and result["ours"].timing.samples == 10


def test_rotation_continues_through_the_input_sets():
    h = load_harness()
    calls = ["a", "b", "c"]
    step = h.rotation(calls, per_sample=2, start=2)  # sample 2 starts at call 4
    assert [next(step) for _ in range(5)] == ["b", "c", "a", "b", "c"]
    assert h.calls_per_sample(0.01) == h.MAX_CALLS_PER_SAMPLE
    assert h.calls_per_sample(h.SAMPLE_MS / 4) == 4
    assert h.calls_per_sample(100.0) == 1


def test_counts_and_input_sets():
    h = load_harness()
    assert h.forward_flops(2, 3, 5, 7, 8, causal=False) == 4 * 2 * 3 * 5 * 7 * 8
    assert h.forward_flops(2, 3, 5, 7, 8, causal=True) == 2 * 2 * 3 * 5 * 7 * 8
    assert h.backward_flops(1, 1, 4, 4, 8, causal=False) == 2.5 * 4 * 4 * 4 * 8
    assert h.kv_bytes(8, 32768, 8, 128, 2) == 2 * 8 * 32768 * 8 * 128 * 2
    mib = h.MIB
    assert h.set_count(64 * mib, 256 * mib) == 5     # 5 x 64 MiB > 256 MiB
    assert h.set_count(512 * mib, 256 * mib) == 2    # never fewer than two
    assert h.set_count(1, 256 * mib) == h.MAX_INPUT_SETS


def test_the_grid_keeps_tokens_and_model_width():
    h = load_harness()
    args = type("Args", (), {"device": "cuda", "quick": False, "hdims": None, "seqlens": None,
                             "causal": "both"})()
    shapes = h.grid_shapes(args)
    assert len(shapes) == 36
    assert {(s.batch * s.seqlen, s.heads * s.hdim) for s in shapes} == {(16384, 2048)}


def test_verdict_scales_with_the_peer():
    h = load_harness()
    ok, figures = h.verdict(0.01, 1.0, "bf16", peer_err=0.006, peer_diff=0.012)
    assert ok and figures["bound_vs_fp64"] == pytest.approx(0.012 + 2 ** -9)
    assert not h.verdict(0.02, 1.0, "bf16", peer_err=0.006, peer_diff=0.01)[0]
    assert not h.verdict(0.001, 1.0, "bf16", peer_err=0.001, peer_diff=0.5)[0]
    assert h.verdict(0.001, 1.0, "bf16", None, None)[0]
    assert not h.verdict(float("inf"), 1.0, "bf16", None, None)[0]


def test_peer_distance_forgives_one_rounding_step_only():
    torch = pytest.importorskip("torch")
    h = load_harness()
    peer = torch.tensor([1.5, -0.75, 0.001], dtype=torch.bfloat16)
    one_ulp = torch.tensor([1.5 + 2 ** -7, -0.75 - 2 ** -8, 0.001], dtype=torch.bfloat16)
    assert h.max_beyond_ulp(one_ulp, peer, "bf16") == 0.0
    three_ulps = torch.tensor([1.5 + 3 * 2 ** -7, -0.75, 0.001], dtype=torch.bfloat16)
    assert h.max_beyond_ulp(three_ulps, peer, "bf16") == pytest.approx(3 * 2 ** -7 - 1.5 * 2 ** -7)
    nan = torch.tensor([float("nan"), -0.75, 0.001], dtype=torch.bfloat16)
    assert h.max_beyond_ulp(nan, peer, "bf16") == float("inf")


def test_reference_gradients_match_float64_autograd():
    torch = pytest.importorskip("torch")
    load_harness()
    backward = importlib.import_module("backward")
    gen = torch.Generator().manual_seed(0)
    for causal in (False, True):
        q, k, v, dout = (torch.randn(2, 40, 3, 16, dtype=torch.float64, generator=gen)
                         for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / 4
        if causal:
            scores = scores.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1),
                                        float("-inf"))
        out = (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
        expected = torch.autograd.grad(out, (q, k, v), dout)
        rows = torch.tensor([0, 7, 39])
        got = backward.reference_grads(q, k, v, dout, 1, 2, rows, rows, causal)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e[1, rows, 2], rtol=1e-10, atol=1e-12)


def test_a_failed_check_or_a_missing_time_fails_the_run(tmp_path, capsys):
    h = load_harness()
    args = type("Args", (), {"out": tmp_path, "dtype": "bf16"})()
    meta = {"benchmark": "test", "date": "now", "commit": None, "cpu": "x", "torch": "t",
            "command": "c"}
    timed = {"eager": {"ms": 1.0, "tflops": 2.0}, "kernel": None, "error": None,
             "kernel_error": "no graphs"}
    refused = {"eager": None, "kernel": None, "error": "refused", "kernel_error": None}
    row = {"label": "s1", "check": {"ok": True}, "results": {"ours": timed, "fa2": refused}}
    table = h.rate_table([row], h.shape_label, ["ours", "fa2"], "tflops", "TFLOP/s")
    assert "| s1 | 2.0 | n/a | n/a | n/a |" in table
    notes = h.failure_notes([row, dict(row, label="s2")], h.shape_label)
    assert notes.splitlines() == ["- ours, no kernel time (every shape): no graphs",
                                  "- fa2, no time (every shape): refused"]
    assert h.report(args, "ok", meta, [row], table, notes) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| s1 |")
    failed = dict(row, check={"ok": False})
    assert h.report(args, "bad", meta, [failed], table, "") == 1
    untimed = dict(row, results={"ours": refused})
    assert h.report(args, "none", meta, [untimed], table, "") == 1
    assert (tmp_path / "ok.json").exists() and (tmp_path / "ok.md").exists()


def test_a_shape_that_raises_becomes_a_failed_row():
    h = load_harness()
    args = type("Args", (), {"device": "cpu"})()
    shape = h.Shape(1, 2, 64, 32, False)

    def measure(shape, args, target_s):
        raise ValueError("headdim: expected a multiple of 8\nmore")

    row = h.measure_safely(measure, shape.fields(), args, shape, args, 0.1)
    assert row["hdim"] == 32 and not row["check"]["ok"]
    assert row["results"]["ours"]["error"] == "ValueError: headdim: expected a multiple of 8"
    assert row["results"]["fa2"]["eager"] is None
