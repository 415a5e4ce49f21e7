"""How the quick extrapolation recipe's "PoPE beats RoPE + YaRN fine-tuned at 4x" depends on the fine-tune's
length: the recipe's YaRN fine-tune repeated with other step counts, from the same RoPE run, evaluated as the
recipe evaluates it (the same lengths, sequences and text), against the same PoPE run.

    python benchmarks/quick_search/yarn_finetune_steps.py --recipe runs/quick/extrapolation \\
        --steps 5 10 25 50 100 --out /tmp/yarn_steps

--recipe is a finished quick extrapolation recipe (its pope and rope runs are read, not changed). Prints, per
step count, the fine-tuned model's loss at each factor, PoPE's, and whether PoPE's loss at the top factor is the
lower. A sensitivity check for FINDINGS.md: the recipe itself keeps the fine-tune it was designed with.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from poslab.analysis.extrapolation import evaluate_lengths
from poslab.analysis.runs import Run
from poslab.experiments import extrapolation
from poslab.experiments.common import ensure_run


def losses(run_dir: Path, lengths: list[int], sequences: int, data: dict | None) -> dict[int, float]:
    run = Run.load(run_dir, device="cpu")
    return {rec["length"]: rec["loss"] for rec in evaluate_lengths(run.config, run.model, lengths, sequences, 8,
                                                                   eval_data=data)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", type=Path, required=True, help="a finished quick extrapolation recipe directory")
    p.add_argument("--steps", type=int, nargs="+", default=[5, 10, 25, 50, 100])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    scale = extrapolation.SCALES["quick"]
    lengths = [scale["seq_len"] * f for f in scale["factors"]]
    data = extrapolation.eval_data(scale)
    pope = losses(a.recipe / "runs" / "pope", lengths, scale["sequences"], data)
    top = lengths[-1]
    print("steps | " + " | ".join(f"{length // scale['seq_len']}x" for length in lengths) + " | PoPE lower at top")
    print("pope | " + " | ".join(f"{pope[length]:.4f}" for length in lengths) + " |")
    for steps in a.steps:
        config = extrapolation.finetune_config({**scale, "finetune": {**scale["finetune"], "steps": steps}},
                                               a.recipe)
        # The recipe's data directory holds the corpus the runs were trained on: read it, do not prepare another.
        config["data"]["cache_dir"] = str(a.recipe / "data")
        ensure_run(config, a.out / f"rope-yarn-{steps}", lambda _: None)
        tuned = losses(a.out / f"rope-yarn-{steps}", lengths, scale["sequences"], data)
        print(f"{steps} | " + " | ".join(f"{tuned[length]:.4f}" for length in lengths)
              + f" | {'yes' if pope[top] < tuned[top] else 'no'}")


if __name__ == "__main__":
    main()
