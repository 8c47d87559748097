"""Tests of two dev/ tools: ab_table.py (A/B ratios) and clock_windows.py (the clock in each
timed window). Synthetic inputs with known answers; no GPU needed. Scratch space like the
tools: not part of the product's tests (CI does not run them); `python3 -m pytest dev`."""
import datetime
import importlib.util
import json
import pathlib

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_results(path, rows):
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))


def test_ab_table_ratios_per_variant(tmp_path, capsys):
    ab_table = load("ab_table")
    (tmp_path / "trees.txt").write_text("base\nthis\nother\n")
    tflops = {"base": (100.0, 102.0), "this": (110.0, 112.0), "other": (90.0, 92.0)}
    for tree, rounds in tflops.items():
        for r, value in zip((1, 2), rounds):
            write_results(tmp_path / f"fwd_{tree}_{r}", [
                {"system": "ours", "hdim": 128, "causal": False, "seqlen": 4096, "tflops": value},
                {"system": "flash", "hdim": 128, "causal": False, "seqlen": 4096, "tflops": 1.0}])
    assert ab_table.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| pass | hdim | causal | seqlen | base 1 | base 2 | this 1")
    assert lines[0].endswith("| this / base | other / base |")
    row = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert row[:4] == ["forward", "128", "no", "4096"]
    assert row[4:10] == ["100.0", "102.0", "110.0", "112.0", "90.0", "92.0"]
    assert row[10:] == [f"{111 / 101:.3f}", f"{91 / 101:.3f}"]  # flash's rows are not ours'


def test_ab_table_defaults_to_base_and_this(tmp_path, capsys):
    ab_table = load("ab_table")
    for tree, value in (("base", 200.0), ("this", 100.0)):
        for r in (1, 2):
            write_results(tmp_path / f"bwd_{tree}_{r}", [
                {"system": "ours", "hdim": 64, "causal": True, "seqlen": 1024, "bwd_tflops": value}])
    assert ab_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| backward | 64 | yes | 1024 | 200.0 | 200.0 | 100.0 | 100.0 | 0.500 |" in out


def test_ab_table_decode_rows_dense_and_paged(tmp_path, capsys):
    ab_table = load("ab_table")
    for tree, (dense, paged) in (("base", (4.0, 3.0)), ("this", (4.2, 2.7))):
        for r in (1, 2):
            write_results(tmp_path / f"dec_{tree}_{r}", [
                {"system": "ours", "batch": 64, "seqlen": 4096, "hdim": 128, "tbps": dense},
                {"system": "ours", "batch": 8, "seqlen": 32768, "hdim": 128, "tbps": dense},
                {"system": "ours-paged", "batch": 8, "seqlen": 32768, "hdim": 128, "tbps": paged},
                {"system": "cudnn", "batch": 8, "seqlen": 32768, "hdim": 128, "tbps": 9.0}])
    assert ab_table.main([str(tmp_path)]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    # Dense before paged, batches in numeric order (8 before 64), peers left out.
    assert rows == [
        "| decode | 128 | batch 8 | 32768 | 4.00 | 4.00 | 4.20 | 4.20 | 1.050 |",
        "| decode | 128 | batch 64 | 4096 | 4.00 | 4.00 | 4.20 | 4.20 | 1.050 |",
        "| decode paged | 128 | batch 8 | 32768 | 3.00 | 3.00 | 2.70 | 2.70 | 0.900 |"]


def stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


@pytest.mark.parametrize("with_reasons", [False, True])
def test_clock_windows_means_and_power_cap_share(tmp_path, capsys, with_reasons):
    clock_windows = load("clock_windows")
    t0 = 1_800_000_000.0
    log = tmp_path / "clocks.csv"
    lines = []
    for i in range(8):  # 50 ms apart; the window below holds samples 2..5
        mhz, watts = (1980, 500.0) if i % 2 else (1780, 700.0)
        line = f"{stamp(t0 + 0.05 * i)}, {mhz}, {watts}"
        if with_reasons:  # power cap (0x4) on odd samples, idle (0x1, not a hold) on even ones
            line += ", 0x0000000000000004" if i % 2 else ", 0x0000000000000001"
        lines.append(line)
    lines.append("garbage line")
    log.write_text("\n".join(lines) + "\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [
        {"system": "ours", "hdim": 256, "causal": False, "seqlen": 16384,
         "timed_window": [t0 + 0.09, t0 + 0.26]},
        {"system": "flash", "hdim": 256, "causal": False, "seqlen": 16384,
         "timed_window": [t0 + 10.0, t0 + 11.0]}]}))  # no samples: left out
    assert clock_windows.main([str(log), str(results)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("8 samples from")
    expected = "| 256 | no | 16384 | ours | 1880 | 600 | 4 |"
    assert expected in out
    share = "| 50 % | 0 % |" if with_reasons else "| - | - |"
    assert expected + share.lstrip("|") in out
    assert "flash" not in out


def test_clock_windows_joins_the_rounds_of_an_interleaved_timing(tmp_path, capsys):
    clock_windows = load("clock_windows")
    t0 = 1_800_000_000.0
    log = tmp_path / "clocks.csv"
    # Samples 0..9, 50 ms apart: 1000 + 100 i MHz.
    log.write_text("".join(f"{stamp(t0 + 0.05 * i)}, {1000 + 100 * i}, 300.0\n" for i in range(10)))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [
        # Two rounds: samples 1 and 2, then 7: (1100 + 1200 + 1700) / 3 MHz.
        {"system": "ours", "hdim": 128, "causal": True, "seqlen": 512,
         "timed_windows": [[t0 + 0.04, t0 + 0.11], [t0 + 0.34, t0 + 0.36]]}]}))
    assert clock_windows.main([str(log), str(results)]) == 0
    assert "| 128 | yes | 512 | ours | 1333 | 300 | 3 |" in capsys.readouterr().out
