"""The indirect-indexing recipe at its quick scale with other task or model settings, trained by the
recipe itself (the engine's trainer, the recipe's seeds and data), unlike indirect_indexing.py's own loop.

    python benchmarks/quick_search/indirect_indexing_recipe.py --heads 8 --shift 3 --out /tmp/ii_h8s3
    python benchmarks/quick_search/indirect_indexing_recipe.py --seeds 3 4 5 --out /tmp/ii_more_seeds
    python benchmarks/quick_search/indirect_indexing_recipe.py --others nope alibi cope --out /tmp/ii_others

Prints the claims and the per-seed test accuracy of each scheme.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from poslab.experiments import indirect_indexing


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--shift", type=int, default=None, help="shifts in [-shift, shift]")
    p.add_argument("--alphabet", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="other seeds than the recipe's 0 1 2")
    p.add_argument("--others", nargs="+", default=None,
                   help="other schemes to train besides PoPE and RoPE, at the same seeds (the quick recipe trains none)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    scale = indirect_indexing.SCALES["quick"]
    if a.heads or a.width:
        scale["model"] = {**scale["model"], **({"n_heads": a.heads} if a.heads else {}),
                          **({"d_model": a.width} if a.width else {})}
    if a.shift:
        scale["task"] = {**scale["task"], "min_shift": -a.shift, "max_shift": a.shift}
    if a.alphabet:
        scale["task"] = {**scale["task"], "alphabet_size": a.alphabet}
    if a.steps:
        scale["train"] = {**scale["train"], "steps": a.steps}
    if a.seeds:
        scale["seeds"] = a.seeds
    if a.others:
        scale["others"], scale["other_seeds"] = tuple(a.others), scale["seeds"]
    start = time.time()
    result = indirect_indexing.run("quick", a.out, print, jobs=a.jobs)
    print(f"task {scale['task']}, model {scale['model']}, {scale['train']['steps']} steps, {time.time() - start:.0f} s")
    for claim in result.claims:
        print(f"{'held' if claim.held else 'NOT held'}: {claim.claim}: {claim.ours}")
    for scheme, accuracies in result.details["accuracy"].items():
        print(scheme, accuracies)


if __name__ == "__main__":  # the recipe trains in spawned worker processes, which import this module
    main()
