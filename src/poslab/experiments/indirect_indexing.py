"""Indirect indexing (papers/pope.md): find the source character, move by the shift, name the target.

The task needs an independent content match (where is the source character?) and an independent
position match (which token sits `shift` places away?): PoPE separates the two, RoPE entangles them.
Quick scale shrinks the alphabet, strings, shifts and model until it trains in CPU minutes; the
search that chose it is in benchmarks/quick_search/FINDINGS.md.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

from poslab.analysis import plots
from poslab.experiments import claims
from poslab.experiments.common import ensure_runs, rel
from poslab.experiments.runner import RecipeResult

MAIN = ("pope", "rope")
OTHERS = ("nope", "learned", "sinusoidal", "alibi", "t5", "rope-half", "alibi-half")
# The paper's later revision also reports half-channel RoPE (half of each head's channels rotate, the rest
# match content alone) and half-head ALiBi (half the heads without a bias).
VARIANTS = {"rope-half": {"name": "rope", "options": {"fraction": 0.5}},
            "alibi-half": {"name": "alibi", "options": {"heads": 0.5}}}

SCALES = {
    # 2 x 64 decoder with 8 heads, 8 letters, strings of 5-8, shifts within +-3, 1,600 steps of batch 128
    # (~2 CPU-min a model), from the search in benchmarks/quick_search/FINDINGS.md. At this size RoPE, too,
    # learns the task in some seeds (with shifts +-2 and 8 heads it did in all three), so the outcome of one
    # seed is a late jump or not: 3 seeds, and the report shows each. Shorter runs separate the schemes about
    # as well, RoPE's jump coming later than PoPE's: over nine seeds on one CPU, PoPE 71.6% vs RoPE 52.4% mean
    # at 1,600 steps, PoPE ahead in eight (twenty-fourth session; 82.9% vs 59.9% at 2,000 steps on another CPU
    # in the fourteenth, 3,000 and 2,500 steps in the ninth).
    "quick": {"task": {"alphabet_size": 8, "min_len": 5, "max_len": 8, "min_shift": -3, "max_shift": 3},
              "model": {"d_model": 64, "n_layers": 2, "n_heads": 8},
              "train": {"steps": 1600, "batch_size": 128, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 100,
                        "betas": [0.9, 0.99]},
              "seeds": [0, 1, 2], "other_seeds": [0], "others": (), "margin": 0.10, "eval_size": 2000,
              # What the paper scale's third claim (PoPE above every other scheme) met at this size, outside the
              # budget: benchmarks/quick_search/indirect_indexing_recipe.py --others ... (FINDINGS.md).
              "others_explored": "The other schemes are not trained at this scale (the budget). Trained at it outside "
                                 "the budget, seeds 0-2 (FINDINGS.md, twenty-sixth session), T5's learned bias came "
                                 "out far above PoPE (means 87.3% against 71.7%) and FIRE level with it (72.4%), then "
                                 "ALiBi 60.5%, CoPE 56.5%, xPos 52.0%, KERPLE 46.8%, NoPE 38.5%, learned 34.2%, "
                                 "sinusoidal 27.2%: the paper scale's claim that PoPE is above every scheme did not "
                                 "hold there.",
              "tried": {"PoPE far above RoPE":
                            "The search (benchmarks/quick_search/FINDINGS.md) ran this recipe with 4 and 8 heads, "
                            "shifts +-2 and +-3 and 1,600-3,000 steps, and its own loop with 16 letters: at this size "
                            "RoPE learns the task in some seeds, so the mean gap depends on which seeds do."}},
    "smoke": {"task": {"alphabet_size": 8, "min_len": 5, "max_len": 7, "min_shift": -2, "max_shift": 2},
              "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
              "train": {"steps": 3, "batch_size": 8, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1},
              "seeds": [0], "other_seeds": [0], "others": ("nope",), "margin": 0.10, "eval_size": 64},
    # The paper's setting (appendix): 8 x 512, 100k steps, 3 seeds, every scheme.
    # 1M training problems, as the paper's fixed 1M/10k/10k split: 100k steps of 64 see each about 6 times.
    "paper": {"task": {"min_len": 20, "max_len": 40, "min_shift": -15, "max_shift": 15, "train_size": 1_000_000},
              "model": {"d_model": 512, "n_layers": 8, "n_heads": 8},
              "train": {"steps": 100000, "batch_size": 64, "lr": 2e-4, "min_lr": 2e-5, "warmup_steps": 4000,
                        "betas": [0.9, 0.99], "weight_decay": 0.01, "grad_clip": 1.0, "checkpoint_every": 5000},
              "seeds": [0, 1, 2], "other_seeds": [0, 1, 2], "others": OTHERS, "margin": 0.5, "eval_size": 10000},
}


def run_config(scale: dict, scheme: str, seed: int) -> dict:
    return {
        "seed": seed,
        "model": {"arch": "decoder", "vocab_size": None, "max_seq_len": 64, "norm": "rmsnorm", "mlp": "swiglu",
                  "positional": VARIANTS.get(scheme, {"name": scheme}), **scale["model"]},
        "data": {"kind": "task", "name": "indirect_indexing", "train_size": None,
                 "validation_size": scale["eval_size"], "test_size": scale["eval_size"], **scale["task"]},
        "train": {"eval_every": 0, "log_every": 100, "eval_split": "test", "eval_batch_size": 500,
                  "weight_decay": 0.01, "grad_clip": 1.0, **scale["train"]},
    }


def _seeds(scale: dict) -> dict[str, list[int]]:
    return {scheme: scale["seeds"] if scheme in MAIN else scale["other_seeds"] for scheme in (*MAIN, *scale["others"])}


def runs(scale_name: str, out: Path) -> dict:
    """The trainings: (scheme, seed) -> (run config, run directory)."""
    scale = SCALES[scale_name]
    return {(scheme, seed): (run_config(scale, scheme, seed), out / "runs" / f"{scheme}-s{seed}")
            for scheme, seeds in _seeds(scale).items() for seed in seeds}


def chance_levels(task: dict) -> tuple[float, float]:
    """(chance, position-blind) exact match for the task options ``task`` (uniform lengths and shifts).

    Chance: a random letter of the string, 1 / length. A model that reads the letters but not their order
    does better: the answer is the source letter when the shift is 0, and otherwise one of the others."""
    lengths = range(task["min_len"], task["max_len"] + 1)
    shifts = range(task["min_shift"], task["max_shift"] + 1)
    zero = (0 in shifts) / len(shifts)
    return statistics.fmean(1 / n for n in lengths), zero + (1 - zero) * statistics.fmean(1 / (n - 1) for n in lengths)


def run(scale_name: str, out: Path, log: Callable[[str], None], jobs: int = 1, device: str = "cpu") -> RecipeResult:
    """Trains and reads the trainings' final evaluations; nothing is measured afterwards, so ``device``
    (where the other recipes measure) goes unused."""
    scale = SCALES[scale_name]
    finals = ensure_runs(runs(scale_name, out), log, jobs)
    accuracy = {scheme: [finals[scheme, seed]["eval_exact_match"] for seed in seeds]
                for scheme, seeds in _seeds(scale).items()}
    mean = {s: statistics.fmean(v) for s, v in accuracy.items()}
    std = {s: statistics.pstdev(v) if len(v) > 1 else 0.0 for s, v in accuracy.items()}
    alphabet = scale["task"].get("alphabet_size") or 52
    chance, blind = chance_levels(scale["task"])
    figure = plots.bars(out / "accuracy.png", {"test accuracy": mean},
                        f"Indirect indexing ({scale_name} scale), chance {chance:.1%}", "exact match")
    result_claims = [
        claims.exceeds(f"PoPE far above RoPE on indirect indexing (test accuracy, mean over seeds "
                       f"{scale['seeds']}, by >= {scale['margin']:.0%})", "94.82% vs 11.16%",
                       {"pope": mean["pope"], "rope": mean["rope"]}, larger="pope", smaller="rope",
                       margin=scale["margin"]),
        claims.at_least(f"PoPE well above chance (>= 3x chance = {3 * chance:.1%}; chance: a random letter of the "
                        "string)", "94.82%", mean["pope"], 3 * chance),
    ]
    if scale["others"]:  # where the scale trains the other schemes (paper: all of them, 3 seeds each)
        result_claims.append(claims.highest(
            "PoPE above every other positional scheme (test accuracy, mean over each scheme's seeds)",
            "94.82% vs at most 28.5% (half-channel RoPE)", mean, best="pope"))
    paper = {"pope": "94.82 +- 2.91", "rope": "11.16 +- 2.45", "learned": "10.08", "sinusoidal": "1.90",
             "alibi": "-", "t5": "-", "nope": "-", "rope-half": "28.5", "alibi-half": "27.35"}
    tables = [{"title": f"Test accuracy (exact match) by scheme; chance {chance:.1%}",
               # Per seed too: at small scale learning the task is a late, seed-dependent jump, so a mean alone
               # hides whether a gap comes from every seed or from one.
               "columns": ["scheme", "ours (mean)", "ours (std)", "per seed", "paper (%)"],
               "rows": [[s, mean[s], std[s], accuracy[s], paper.get(s, "-")] for s in accuracy]}]
    notes = [f"{scale_name.capitalize()}-scale task: alphabet {alphabet}, string lengths {scale['task'].get('min_len')}-"
             f"{scale['task'].get('max_len')}, shifts {scale['task'].get('min_shift')}..{scale['task'].get('max_shift')}; "
             f"model {scale['model']}; {scale['train']['steps']} steps of batch {scale['train']['batch_size']}.",
             f"Chance is {chance:.1%} for a random letter of the string; a model blind to position can reach "
             f"{blind:.1%} (the source letter when the shift is 0, else a random other letter).",
             *([scale["others_explored"]] if "others_explored" in scale else []),
             *claims.tried_notes(result_claims, scale.get("tried", {}))]
    return RecipeResult("indirect-indexing", scale_name, result_claims, figures=[rel(figure, out)], tables=tables,
                        notes=notes, details={"accuracy": accuracy})
