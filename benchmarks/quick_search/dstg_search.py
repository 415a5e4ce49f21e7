"""Quick-scale search for the ``dstg`` reproduction recipe: run the recipe's own code with one variant of
its quick settings and record what each training costs in process CPU time (all threads of its worker),
so that numbers measured on a busy machine translate to an idle one.

A variant is a JSON object merged over the recipe's quick SCALES entry: ``documents``, ``sequences`` and
``train`` are updated key by key; ``data_overrides``, ``model_overrides``, ``dstg_overrides`` and
``baseline_overrides`` replace the shipped sections (the recipe re-matches DSTG's ffn_hidden).

    python benchmarks/quick_search/dstg_search.py --tag b1 --out /tmp/dstg_b1 \\
        --variant '{"train": {"steps": 2000}, "baseline_overrides": {"d_model": 96}}'

Trainings run as the recipe runs them (``--jobs`` at a time, one thread each); appends one JSON line
(variant, CPU seconds per training and for the rest, claims, tables) to --results.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import time
from pathlib import Path
from typing import Any

from poslab.experiments import common, dstg

_worker = common._ensure_run_in_worker
_finals: dict[str, dict[str, Any]] = {}


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def timed_worker(config: dict[str, Any], out: Path, threads: int) -> dict[str, Any]:
    """The recipe's worker, plus the CPU seconds this training took in its process."""
    c0 = cpu_seconds()
    metrics = _worker(config, out, threads)
    return {**metrics, "cpu_s": cpu_seconds() - c0}


def recorded_ensure_runs(*args, **kwargs) -> dict[str, dict[str, Any]]:
    """The recipe's ensure_runs, keeping each run's final metrics (with the worker's cpu_s) for the record."""
    _finals.update(common.ensure_runs(*args, **kwargs))
    return _finals


def variant_scale(variant: dict[str, Any]) -> dict[str, Any]:
    scale = copy.deepcopy(dstg.SCALES["quick"])
    for key, value in variant.items():
        if key == "train":
            scale["train"].update(value)
        else:
            scale[key] = value
    return scale


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="{}")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--results", default="/tmp/dstg_logs/results.jsonl")
    args = ap.parse_args()
    variant = json.loads(args.variant)
    dstg.SCALES["search"] = scale = variant_scale(variant)
    common._ensure_run_in_worker, dstg.ensure_runs = timed_worker, recorded_ensure_runs
    c0, w0 = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    result = dstg.run("search", Path(args.out), print, jobs=args.jobs)
    total = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN) - c0
    record = {"tag": args.tag, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variant": variant,
              "scale": scale, "cpu_total_s": round(total, 1), "wall_s": round(time.perf_counter() - w0, 1),
              "cpu_s": {m: round(f["cpu_s"], 1) for m, f in _finals.items() if "cpu_s" in f},
              "pretraining": {m: {k: f.get(k) for k in ("train_loss", "eval_token_accuracy", "tokens_per_s")}
                              for m, f in _finals.items()},
              "claims": [{"claim": c.claim[:60], "ours": c.ours, "held": c.held} for c in result.claims],
              "tables": result.tables[:2], "details": {k: result.details[k] for k in ("spectra_rows", "heads")}}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(record, default=float) + "\n")
    print(json.dumps(record, indent=1, default=float))


if __name__ == "__main__":
    main()
