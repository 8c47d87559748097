"""Samples bytes from a checkpoint of train.py through the layers' key/value caches (one
prefill, then one token a step), and prints the text and the rate.

    python examples/gpt/generate.py --checkpoint gpt-run/model.pt --prompt "def main(" --tokens 200
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from model import ATTENTIONS, GPT, Config  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=pathlib.Path, default=pathlib.Path("gpt-run/model.pt"))
    p.add_argument("--prompt", default="import ")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--batch", type=int, default=1, help="sequences sampled at once from the same prompt")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--attention", default="flashattn", choices=ATTENTIONS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    saved = torch.load(args.checkpoint, map_location="cpu")
    model = GPT(Config(**saved["config"]), args.attention)
    model.load_state_dict(saved["model"])
    model = model.to(args.device).eval()
    prompt = torch.tensor([list(args.prompt.encode())] * args.batch, device=args.device)
    if prompt.shape[1] + args.tokens > model.cfg.max_seqlen:
        raise SystemExit(f"--tokens: the prompt and the new tokens must fit max_seqlen = {model.cfg.max_seqlen}")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    start = time.perf_counter()
    tokens = model.generate(prompt, args.tokens, args.temperature, args.top_k, generator)
    seconds = time.perf_counter() - start
    print(bytes(tokens[0].tolist()).decode("utf-8", errors="replace"))
    print(f"\n{args.batch * args.tokens} tokens in {seconds:.2f} s: {args.batch * args.tokens / seconds:,.1f} tokens/s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
