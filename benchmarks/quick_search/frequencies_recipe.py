"""The extrapolation and frequencies recipes, run as they are, with a variant of their quick scale: a longer
training context at the same tokens per step, to see whether PoPE's share of q/k norm in the fastest quarter
of frequencies depends on how many frequencies turn within the context.

    python benchmarks/quick_search/frequencies_recipe.py --seq-len 256 --batch 8 --out /tmp/exp/freq_256

Prints both recipes' claims and writes their results under --out (extrapolation/, frequencies/).
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from poslab.experiments import extrapolation, frequencies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    scale = copy.deepcopy(extrapolation.SCALES["quick"])
    scale["seq_len"] = args.seq_len
    scale["train"]["batch_size"] = args.batch
    if args.steps:
        scale["train"]["steps"] = args.steps
    extrapolation.SCALES["search"] = scale
    for recipe in (extrapolation, frequencies):
        result = recipe.run("search", args.out / recipe.__name__.rsplit(".", 1)[-1], print, args.jobs)
        for claim in result.claims:
            print(json.dumps({"claim": claim.claim, "ours": claim.ours, "held": claim.held}))


if __name__ == "__main__":
    main()
