#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets that have none yet: fuzz/corpus/NAME/seed0-7,
bytes from a fixed pseudo-random stream per (target, seed), so that rerunning it gives the same
files. The targets read their bytes as a stream of choices (fuzz/fuzz_common.hpp), so random
bytes make random, mostly well-formed calls; libFuzzer's mutations do the rest.

    python3 fuzz/corpus/make_seeds.py backward varlen kvcache
"""
import pathlib
import random
import sys

here = pathlib.Path(__file__).resolve().parent
for target in sys.argv[1:]:
    folder = here / target
    folder.mkdir(exist_ok=True)
    for n in range(8):
        rng = random.Random(f"flashattn-fuzz-{target}-{n}")
        size = rng.choice([48, 96, 160, 256, 320])
        (folder / f"seed{n}").write_bytes(bytes(rng.randrange(256) for _ in range(size)))
