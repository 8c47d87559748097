"""examples/gpt on the CPU: the model on flashattn equals the same weights on SDPA, cached
generation equals recomputation, and train.py / generate.py run end to end (a few steps)."""
import json
import math
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the GPT example needs it")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpt"
sys.path.insert(0, str(EXAMPLE))
import generate  # noqa: E402
import train  # noqa: E402
from model import GPT, SIZES  # noqa: E402


def test_flashattn_and_sdpa_give_the_same_logits_and_gradients():
    torch.manual_seed(0)
    ours = GPT(SIZES["tiny"], "flashattn")
    sdpa = GPT(SIZES["tiny"], "sdpa-math")
    sdpa.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, 256, (2, 37))
    a, b = ours(tokens), sdpa(tokens)
    assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, pa), pb in zip(ours.named_parameters(), sdpa.parameters()):
        err = (pa.grad - pb.grad).abs().max().item()
        assert err <= 1e-3 * pb.grad.abs().max().item() + 1e-9, name


@pytest.mark.parametrize("attention", ["flashattn", "sdpa-math"])
def test_cached_greedy_generation_equals_recomputation(attention):
    torch.manual_seed(1)
    model = GPT(SIZES["tiny"], attention).eval()
    prompt = torch.randint(0, 256, (2, 9))
    out = model.generate(prompt, 12, temperature=0)
    with torch.no_grad():
        tokens = prompt
        for _ in range(12):  # no cache: the whole sequence each step
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens)


def test_train_and_generate_run_end_to_end(tmp_path, capsys):
    assert train.main(["--size", "tiny", "--steps", "6", "--seqlen", "32", "--batch", "2",
                       "--corpus-mb", "0.25", "--out", str(tmp_path), "--quiet"]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["last_loss"] < summary["first_loss"]
    assert len((tmp_path / "loss.csv").read_text().splitlines()) == 7
    assert generate.main(["--checkpoint", str(tmp_path / "model.pt"), "--tokens", "8",
                          "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_benchmark_smoke_run(tmp_path, capsys):
    """benchmark.py's whole path on tiny shapes: both attentions train from the same weights
    on the same batches (the same losses up to rounding) and generate."""
    import benchmark
    assert benchmark.main(["--sizes", "tiny", "--seqlens", "32", "--device", "cpu", "--dtype", "fp32",
                           "--attentions", "flashattn", "sdpa-math", "--steps", "2", "--warmup", "1",
                           "--gen-batches", "2", "--gen-tokens", "4", "--prompt-tokens", "8",
                           "--tokens-per-step", "64", "--corpus-mb", "0.25", "--rounds", "3", "--profile-kernels",
                           "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "benchmark.json").read_text())
    ours, sdpa = result["training"]
    assert len(ours["losses"]) == 3 and ours["losses"] == pytest.approx(sdpa["losses"], rel=1e-4)
    # Three rounds, the order rotated: each attention first, second, first.
    assert ours["places"] == [0, 1, 0] and sdpa["places"] == [1, 0, 1]
    assert len(ours["tokens_per_s_rounds"]) == 3
    assert ours["tokens_per_s"] == pytest.approx(3 / sum(1 / r for r in ours["tokens_per_s_rounds"]))
    # The profiled step: its operations by their own time, largest first, our attention among them.
    top = ours["kernels"]["top"]
    assert [ms for _, ms, _ in top] == sorted((ms for _, ms, _ in top), reverse=True)
    assert ours["kernels"]["total_ms"] > 0 and any("Attention" in name or "flashattn" in name for name, _, _ in top), top
    assert [r["attention"] for r in result["generation"]] == ["flashattn", "sdpa-math"]
    table = (tmp_path / "benchmark.md").read_text()
    assert "| tiny | 32 | 2 | flashattn |" in table and "one step's operations" in table
    again = tmp_path / "again"
    assert benchmark.main(["--render", str(tmp_path / "benchmark.json"), "--out", str(again)]) == 0
    assert (again / "benchmark.md").read_text() == table


def test_benchmark_compiled_leaves_the_warm_up_round_out(tmp_path):
    """--compile: the model through torch.compile (our attention one op in its graph); the first
    round, which compiles, is left out of tokens/s."""
    import benchmark
    assert benchmark.main(["--sizes", "tiny", "--seqlens", "32", "--device", "cpu", "--dtype", "fp32",
                           "--attentions", "flashattn", "--steps", "1", "--warmup", "1", "--gen-batches", "1",
                           "--gen-tokens", "2", "--prompt-tokens", "4", "--tokens-per-step", "64",
                           "--corpus-mb", "0.25", "--rounds", "2", "--compile", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "benchmark.json").read_text())
    (ours,) = result["training"]
    assert result["meta"]["compile"] and len(ours["tokens_per_s_rounds"]) == 2
    assert ours["tokens_per_s"] == pytest.approx(ours["tokens_per_s_rounds"][1])
    assert all(math.isfinite(x) for x in ours["losses"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA-graph decode is not tested")
@pytest.mark.parametrize("batch", [1, 3])
def test_cuda_graph_generation_equals_eager(batch):
    torch.manual_seed(2)
    model = GPT(SIZES["small"], "flashattn").cuda().eval()
    prompt = torch.randint(0, 256, (batch, 11), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model.generate(prompt, 20, temperature=0)
        graphed = model.generate(prompt, 20, temperature=0, cuda_graph=True)
    assert torch.equal(graphed, eager)


def test_cuda_graph_generation_refuses_sdpa():
    model = GPT(SIZES["tiny"], "sdpa-math")
    with pytest.raises(ValueError, match="cuda_graph"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, cuda_graph=True)
