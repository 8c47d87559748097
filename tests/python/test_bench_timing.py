"""bench/gpu_forward.py's side-by-side timing (time_interleaved), which both GPU benchmarks
use: the rounds, their rotating order, the split of each system's calls and the median, with
a fake timer in place of CUDA events (no GPU, no torch needed)."""
import contextlib
import importlib
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_forward_bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # as gpu_backward.py and gpu_decode.py import it
    return importlib.import_module("gpu_forward")


class FakeTimer:
    """Stands in for event_times: each system's calls take the milliseconds its list gives,
    in turn; every timed batch is logged as (system, first call index, count)."""

    def __init__(self, ms_of):
        self.ms_of, self.log, self.next = ms_of, [], {name: 0 for name in ms_of}

    def calls_of(self, name):
        return [name]  # time_interleaved passes a system's calls back to the timer

    def __call__(self, calls, start, n):
        name = calls[0]
        if isinstance(self.ms_of[name], Exception):
            raise self.ms_of[name]
        self.log.append((name, start, n))
        times = []
        for _ in range(n):
            seq = self.ms_of[name]
            times.append(seq[self.next[name] % len(seq)])
            self.next[name] += 1
        return times


def test_rounds_rotate_and_split_every_system_s_calls():
    fw = load_forward_bench()
    timer = FakeTimer({"ours": [1.0], "flash": [2.0], "cudnn": [4.0]})
    systems = {name: (timer.calls_of(name), contextlib.nullcontext) for name in timer.ms_of}
    # target 0.03 s: ours 30 calls, flash 15, cudnn 8 (7.5 rounded up); 3 warm-up calls each.
    result = fw.time_interleaved(systems, target_s=0.03, max_reps=100, times_of=timer)
    timed = [entry for entry in timer.log if entry[1] != 1 or entry[2] != 3]
    order = [name for name, _, _ in timed]
    assert order == ["ours", "flash", "cudnn", "flash", "cudnn", "ours", "cudnn", "ours", "flash"]
    counts = {name: [n for who, _, n in timed if who == name] for name in systems}
    assert counts == {"ours": [10, 10, 10], "flash": [5, 5, 5], "cudnn": [2, 3, 3]}
    # Each round continues the rotation through the input sets where the last one stopped.
    assert [start for who, start, _ in timed if who == "cudnn"] == [0, 2, 5]
    assert {name: r.timing.reps for name, r in result.items()} == {"ours": 30, "flash": 15, "cudnn": 8}
    assert {name: r.timing.ms for name, r in result.items()} == {"ours": 1.0, "flash": 2.0, "cudnn": 4.0}
    assert all(len(r.windows) == 3 and r.error is None for r in result.values())


def test_median_over_all_rounds_and_the_reps_bounds():
    fw = load_forward_bench()
    # Warm-up calls 1, 9, 5 (estimate 5 ms), then 1..9 ms repeating: median of 9 calls is 5.
    timer = FakeTimer({"ours": [1.0, 9.0, 5.0] + [float(i) for i in range(1, 10)]})
    systems = {"ours": (timer.calls_of("ours"), contextlib.nullcontext)}
    result = fw.time_interleaved(systems, target_s=1.0, max_reps=9, times_of=timer)["ours"]
    assert (result.timing.reps, result.timing.ms) == (9, 5.0)
    assert (result.timing.ms_min, result.timing.ms_max) == (1.0, 9.0)
    # A run far shorter than the target still makes MIN_REPS calls.
    timer = FakeTimer({"ours": [100.0]})
    result = fw.time_interleaved({"ours": (timer.calls_of("ours"), contextlib.nullcontext)},
                                 target_s=0.001, max_reps=100, times_of=timer)["ours"]
    assert result.timing.reps == fw.MIN_REPS


def test_a_failing_system_is_reported_and_the_others_are_timed():
    fw = load_forward_bench()
    failure = RuntimeError("refused")
    timer = FakeTimer({"ours": [1.0], "flash": failure})
    systems = {name: (timer.calls_of(name), contextlib.nullcontext) for name in timer.ms_of}
    result = fw.time_interleaved(systems, target_s=0.01, max_reps=100, times_of=timer)
    assert result["flash"].error is failure and result["flash"].timing is None
    assert result["ours"].error is None and result["ours"].timing.reps == 10
