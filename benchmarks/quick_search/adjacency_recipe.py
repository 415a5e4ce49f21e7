"""The adjacency recipe at its quick scale with other training lengths or model sizes, to see how
training changes the first attention layer's adjacency score (the "after training" claim).

    python benchmarks/quick_search/adjacency_recipe.py --steps 1500 --out /tmp/adj1500 [--width 384 --layers 2 --heads 6]

Prints the claims and the score of every hidden state at initialisation and after training.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from poslab.experiments import adjacency


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    scale = adjacency.SCALES["quick"]
    scale["train"] = {**scale["train"], "steps": a.steps, "warmup_steps": max(30, a.steps // 10)}
    model = {"d_model": a.width, "n_layers": a.layers, "n_heads": a.heads}
    scale["model"] = {**scale["model"], **{k: v for k, v in model.items() if v is not None}}
    start = time.time()
    result = adjacency.run("quick", a.out, print, jobs=a.jobs)
    print(f"model {scale['model']}, {a.steps} steps, {time.time() - start:.0f} s")
    for claim in result.claims:
        print(f"{'held' if claim.held else 'NOT held'}: {claim.claim}: {claim.ours}")
    for title_index in (0, 3):
        table = result.tables[title_index]
        print(f"\n{table['title']}\n| " + " | ".join(table["columns"]) + " |")
        for row in table["rows"]:
            print("| " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in row) + " |")


if __name__ == "__main__":  # the recipe trains in spawned worker processes, which import this module
    main()
