"""Seed sensitivity of the dstg recipe's two spectra claims at quick scale: DSTG and AP-NeoBERT trained
with the recipe's own configs (shared prepared corpus, ``--jobs`` at a time) at other seeds, and the
recipe's own measures on each: top-2 PCA share and mean DCT low-bin share of PC1/PC2 over the rows most
sequences reach. One JSON line per seed goes to stdout.

    python benchmarks/quick_search/dstg_seeds.py --seeds 1 2 3 4 --out /tmp/exp/dstg_seeds
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from poslab.analysis.commands import Options
from poslab.analysis.runs import Run
from poslab.experiments import common, dstg

MODELS = ("dstg", "ap_neobert")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    base = dstg.runs("quick", args.out)
    trainings = {}
    for seed in args.seeds:
        for name in MODELS:
            config = copy.deepcopy(base[name][0])
            config["seed"] = seed
            trainings[seed, name] = (config, args.out / f"s{seed}" / name)
    finals = common.ensure_runs(trainings, print, args.jobs)
    opts = Options(sequences=dstg.SCALES["quick"]["sequences"], batch_size=16)
    for seed in args.seeds:
        loaded = {name: Run.load(args.out / f"s{seed}" / name) for name in MODELS}
        rows = dstg.reached_rows(loaded["dstg"], opts)
        spectra = {name: dstg.ap_spectrum(run, rows) for name, run in loaded.items()}
        print(json.dumps({"seed": seed, "rows": rows,
                          "top2": {n: round(top2, 4) for n, (top2, _) in spectra.items()},
                          "dct_low": {n: round(low, 4) for n, (_, low) in spectra.items()},
                          "eval_token_accuracy": {n: round(finals[seed, n]["eval_token_accuracy"], 4)
                                                  for n in MODELS}}), flush=True)


if __name__ == "__main__":
    main()
