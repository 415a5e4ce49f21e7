"""``poslab train CONFIG --out DIR [--resume | --overwrite] [--set key.path=value ...]``.

Under torchrun every process runs the same command: ``torchrun --nproc_per_node 4 -m poslab.cli train ...``.
"""
from __future__ import annotations

import argparse
import json
import math

from poslab.arguments import output_argument
from poslab.train import load_config, train
from poslab.train.checkpoint import saved_step
from poslab.train.parallel import launched_as_rank_zero
from poslab.train.stopping import terminate_as_interrupt


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a model from a YAML run config",
                              description="Train a model from a YAML run config and write a run directory "
                                          "(config.yaml, metrics.jsonl, checkpoints/last and best).")
    p.add_argument("config", help="run config YAML (seed, model, data, train)")
    p.add_argument("--out", required=True, type=output_argument, help="run directory to create")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in --out from checkpoints/last")
    mode.add_argument("--overwrite", action="store_true", help="delete the run in --out and start again")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-3 (repeatable; values are YAML)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    try:
        with terminate_as_interrupt():
            final = train(config, args.out, resume=args.resume, overwrite=args.overwrite, stop_between_steps=True)
    except KeyboardInterrupt:
        # What the user needs next: where the run stands (a first interrupt during the steps saved the step it
        # stopped after; a second one, or one before or after the steps, keeps the last periodic checkpoint)
        step = saved_step(args.out, log=lambda _: None)
        raise KeyboardInterrupt(f"the run in {args.out} resumes from its checkpoint at step {step} with --resume"
                                if step else f"no checkpoint of the run in {args.out} was saved yet") from None
    if launched_as_rank_zero():  # one summary line, not one per torchrun process
        # JSON has no NaN or infinity (Python would write a bare NaN that other parsers refuse): null instead,
        # e.g. tokens_per_s of a resumed run that had no step left to train.
        summary = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in final.items()}
        print(json.dumps(summary, allow_nan=False))
    return 0
