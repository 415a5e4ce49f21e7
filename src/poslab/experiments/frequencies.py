"""Frequency usage (papers/pope.md): per-frequency q/k norms, layer x frequency, RoPE vs PoPE.

Reads the PoPE and RoPE language models of the extrapolation recipe (training them if that recipe has
not run). RoPE reports the 2-norm of each rotated 2-D chunk (d/2 frequencies), PoPE the softplus
magnitude of each of its d components; index 0 is the fastest rotation in both. "Broad use" is
measured as the normalised entropy of each layer's mean-norm profile over frequencies (1 = every
frequency carries the same norm) and as the share carried by the fastest quarter of frequencies.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Callable

import torch

from poslab.analysis.commands import Options, frequencies as frequencies_analysis
from poslab.analysis.runs import Run
from poslab.experiments import claims, extrapolation
from poslab.experiments.common import ensure_runs, rel
from poslab.experiments.runner import RecipeResult

# The least gap in normalised entropy that "broader" needs: untrained q/k norms are spread evenly (~1), and
# the quick models' trained RoPE still sits near 0.97 -- nowhere near the paper's "few frequencies".
BROADER = 0.05
# What was tried for a claim (by its opening words) that does not hold at a scale: shown only then.
TRIED = {"quick": {"PoPE puts more weight on the highest":
                       "At base 10000 the fastest quarter of frequencies are those that turn within the quick "
                       "models' 64-token context, where a short-context model's positional use sits. A 256-token "
                       "context at the same tokens per step (benchmarks/quick_search/frequencies_recipe.py, "
                       "FINDINGS.md; then with a WordPiece vocabulary) did not change the verdict: PoPE 0.315 vs RoPE "
                       "0.391. The paper's 1,024-token language models were not tried."}}


def spread(profile: list[float]) -> float:
    """Normalised entropy of a non-negative profile: 1 = flat, 0 = one frequency carries everything."""
    p = torch.tensor(profile, dtype=torch.float64).clamp(min=0)
    p = p / p.sum()
    entropy = -(p * torch.log(p.clamp(min=1e-300))).sum()
    return float(entropy / math.log(len(profile)))


def runs(scale_name: str, out: Path) -> dict:
    """The extrapolation recipe's PoPE and RoPE trainings (shared: trained once, by whichever recipe runs first;
    not its fine-tune, which this recipe does not read)."""
    trainings = extrapolation.runs(scale_name, out.parent / "extrapolation")
    return {scheme: trainings[scheme] for scheme in extrapolation.SCHEMES}


def run(scale_name: str, out: Path, log: Callable[[str], None], jobs: int = 1, device: str = "cpu") -> RecipeResult:
    scale = extrapolation.SCALES[scale_name]
    source = out.parent / "extrapolation"
    results, figures = {}, []
    ensure_runs(runs(scale_name, out), log, jobs)
    for scheme in extrapolation.SCHEMES:
        run_dir = source / "runs" / scheme
        data = frequencies_analysis(Run.load(run_dir, device=device),
                                    Options(sequences=scale["sequences"], batch_size=8))
        results[scheme] = data
        figures += [rel(run_dir / "analysis" / f, out) for f in data["figures"]]
    # Layer 1 is excluded when there are others, as in the paper's observation (PoPE's first layer differs).
    first = 1 if len(results["pope"]["q"]) > 1 else 0
    breadth = {s: statistics.fmean(spread(row) for w in ("q", "k") for row in d[w][first:]) for s, d in results.items()}
    high = {s: statistics.fmean(x for w in ("q", "k") for x in d["summary"][w]["high_frequency_share"][first:])
            for s, d in results.items()}
    # Untrained, both spread their norms evenly (normalised entropy ~1): a gap of a few hundredths says little
    # about "broad vs few", so the rule asks for BROADER of the [0, 1] scale.
    result_claims = [
        claims.exceeds(f"PoPE uses a broader frequency range than RoPE (normalised entropy of q/k norms over "
                       f"frequencies, layers >= 2, by >= {BROADER:g})", "broad vs few",
                       {"pope": breadth["pope"], "rope": breadth["rope"]}, larger="pope", smaller="rope",
                       margin=BROADER),
        claims.exceeds("PoPE puts more weight on the highest frequencies (share of norm in the fastest quarter, "
                       "layers >= 2)", "PoPE uses high ones", {"pope": high["pope"], "rope": high["rope"]},
                       larger="pope", smaller="rope"),
    ]
    tables = [{"title": "Frequency usage by layer (normalised entropy of mean q norm over frequencies)",
               "columns": ["layer", *results], "rows": [[i + 1, *[spread(results[s]["q"][i]) for s in results]]
                                                        for i in range(len(results["pope"]["q"]))]}]
    notes = ["Layer 1 is shown in the table but excluded from the claims (when a model has more than one layer), "
             "as in the paper's observation.", *claims.tried_notes(result_claims, TRIED.get(scale_name, {}))]
    return RecipeResult("frequencies", scale_name, result_claims, figures=figures, tables=tables, notes=notes,
                        details={"breadth": breadth, "high_frequency_share": high})
