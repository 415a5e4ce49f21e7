"""``poslab reproduce NAME|all --scale quick|paper|smoke --out DIR``, ``poslab reproduce --list`` and
``poslab reproduce --compare OLD --out NEW``."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from poslab.analysis.runs import DEVICES, analysis_device
from poslab.arguments import path_argument
from poslab.errors import PoslabError
from poslab.train.parallel import launched_as_rank_zero
from poslab.train.stopping import terminate_as_interrupt


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("reproduce", help="reproduce the papers' headline claims and write a report")
    p.add_argument("names", nargs="*", metavar="NAME", help="recipe names, or 'all'")
    p.add_argument("--scale", default="quick",
                   help="quick (CPU minutes, the default), paper (GPUs, torchrun) or smoke (about a minute: checks that "
                        "the recipes run; its numbers mean nothing)")
    p.add_argument("--out", default="runs/reproduce", type=path_argument,
                   help="output directory (default runs/reproduce); it holds the results of one --scale")
    p.add_argument("--force", action="store_true",
                   help="redo recipes that already finished in --out (at the same --scale): their measurements "
                        "and claims; finished trainings are kept (delete DIR/RECIPE/runs to train them again)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 at quick and smoke scale, where the models are too small for "
                        "intra-op parallelism to pay; torch's default otherwise)")
    p.add_argument("--jobs", type=int, default=None,
                   help="models trained side by side, each in its own process, the next recipes' models while a "
                        "recipe is analysed (default: one per CPU at quick and smoke scale on a machine without CUDA, "
                        "else 1; always 1 under torchrun)")
    p.add_argument("--analysis-device", default="auto", choices=DEVICES,
                   help="where trained models are measured (default auto: the CUDA device when there is one, "
                        "else the CPU; trainings follow each run config's train.device)")
    p.add_argument("--list", action="store_true", help="list the recipes and exit")
    p.add_argument("--plan", action="store_true",
                   help="print what the recipes would train at --scale (models, tokens, training FLOPs, progress "
                        "in --out) and exit without training or writing anything")
    p.add_argument("--compare", metavar="DIR", type=path_argument,
                   help="print which claims of --out (of the NAMEd recipes, default all) differ from those of DIR (an "
                        "earlier reproduction: its results.json) in value or verdict, and exit: 0 if none, 1 if any, "
                        "as diff does")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from poslab.experiments.runner import RECIPES, check_scale, finished_at_scale, reproduce, resolve

    if args.list:
        for name, (_, description) in RECIPES.items():
            print(f"{name}\t{description}")
        return 0
    if args.compare is not None:
        from poslab.experiments import compare

        for flag in ("plan", "force", "threads", "jobs"):  # a comparison trains and plans nothing
            if getattr(args, flag) is not None and getattr(args, flag) is not False:  # --jobs 0 is given too
                raise PoslabError(f"--compare only reads two finished reproductions; drop --{flag}, or run it "
                                  "without --compare")
        old, new = compare.load(args.compare), compare.load(args.out)
        only = set(resolve(args.names)) if args.names else None  # recipe names, if any, narrow the comparison
        if only is not None:
            compare.check_names(only, old, new, args.compare, args.out)
        rows = compare.compare(old, new, only)
        print(compare.render(rows, old, new, args.compare, args.out, only))
        return int(any(row["status"] != "same" for row in rows))
    if not args.names:
        raise PoslabError("name a recipe or 'all' (see 'poslab reproduce --list')")
    names, scale = resolve(args.names), check_scale(args.scale)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for option in ("threads", "jobs"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise PoslabError(f"--{option} must be >= 1, got {value}")
        if value is not None and value > cpus:  # 5000 threads took 28x as long; 100000 failed allocating them
            raise PoslabError(f"--{option} {value} is more than the {cpus} CPUs this process may use; give at most "
                              f"{cpus}")
    if args.plan:
        from poslab.experiments.plan import plan, render

        finished_at_scale(Path(args.out), scale, lambda _: None)  # refused here as the run would refuse it
        table = render(plan(names, scale, args.out), scale)
        if launched_as_rank_zero():  # once, not once per torchrun process
            print(table)
        return 0
    small = scale in ("quick", "smoke")
    threads = args.threads if args.threads is not None else (1 if small else None)
    if threads is not None:
        torch.set_num_threads(threads)
    # One 1-thread training per CPU suits small CPU models; on a GPU they would all crowd onto one device.
    jobs = args.jobs if args.jobs is not None else cpus if small and not torch.cuda.is_available() else 1
    device = analysis_device(args.analysis_device)
    if scale == "paper" and not torch.cuda.is_available() and launched_as_rank_zero():
        print(f"poslab: warning: --scale paper on a machine without CUDA: its trainings take GPU-days (see "
              f"'poslab reproduce {' '.join(args.names)} --scale paper --plan --out {args.out}')", file=sys.stderr)
    try:
        with terminate_as_interrupt():
            data = reproduce(names, scale, args.out, force=args.force, jobs=jobs, device=device)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the same command resumes: the finished recipes and trainings in {args.out} are "
                                "kept, and an unfinished training continues from its last checkpoint") from None
    if launched_as_rank_zero():  # under torchrun the other ranks trained but did not measure
        held = sum(c["held"] for r in data["recipes"].values() for c in r["claims"])
        total = sum(len(r["claims"]) for r in data["recipes"].values())
        print(f"{held}/{total} claims held; report: {args.out}/report.md")
    return 0
