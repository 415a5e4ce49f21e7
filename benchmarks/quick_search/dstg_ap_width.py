"""How much of DSTG's top-2 PCA gap over AP-NeoBERT is the tables' width (fifteenth session, FINDINGS.md).

DSTG's AP table is d_ap wide, AP-NeoBERT's d_model. For each seed of a finished dstg recipe: the top-2 share of
the trained table, of the same architecture freshly initialised with the run's seed (``Run.control``), and of the
trained table at DSTG's width (``top2_at_width``); then random N(0, 1) tables of both widths.

    python benchmarks/quick_search/dstg_ap_width.py runs/quick/dstg
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from poslab.analysis.commands import ap_table
from poslab.analysis.runs import Run
from poslab.analysis.spectra import spectrum_summary, top2_at_width
from poslab.experiments.dstg import SPECTRA_MODELS, run_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path, help="a finished dstg recipe directory (e.g. runs/quick/dstg)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", type=int, default=41, help="leading positions read (the recipe's 'spectra_rows')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    width = ap_table(Run.load(args.recipe / "runs" / "dstg").model).shape[1]
    print(f"model seed table trained untrained trained-at-width-{width}")
    for model in SPECTRA_MODELS:
        shares = []
        for seed in args.seeds:
            run = Run.load(args.recipe / "runs" / run_name(model, seed))
            trained, untrained = (ap_table(m).detach()[:args.rows] for m in (run.model, run.control()))
            shares.append((spectrum_summary(trained)["top2_explained"], spectrum_summary(untrained)["top2_explained"],
                           top2_at_width(trained, width)))
            print(model, seed, tuple(trained.shape), *(f"{v:.4f}" for v in shares[-1]))
        print(model, "mean", "", *(f"{statistics.fmean(s[i] for s in shares):.4f}" for i in range(3)))
    g = torch.Generator().manual_seed(0)
    for d in (width, 64):
        random = [spectrum_summary(torch.randn(args.rows, d, generator=g))["top2_explained"] for _ in range(200)]
        print(f"N(0, 1) tables of {args.rows} x {d}: top-2 share {statistics.fmean(random):.4f} (mean of 200)")


if __name__ == "__main__":
    main()
