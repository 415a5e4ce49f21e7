"""`poslab tasks list` and `poslab tasks show NAME -n 5 [--seed S] [--split SPLIT] [--set KEY=VALUE ...]`."""
from __future__ import annotations

import argparse
import dataclasses

from poslab.errors import ConfigError
from poslab.tasks import TASKS, build_batch_source
from poslab.tasks.source import MAX_EXAMPLES
from poslab.train.config import apply_override


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tasks", help="list the synthetic tasks or print samples of one")
    commands = parser.add_subparsers(dest="tasks_command", required=True)
    listing = commands.add_parser("list", help="name, format and default options of every task")
    listing.set_defaults(func=list_tasks)
    show = commands.add_parser("show", help="print samples of a task as input<TAB>answer lines")
    show.add_argument("name", help="task name (see `poslab tasks list`)")
    show.add_argument("-n", type=int, default=5, help=f"how many samples, at most {MAX_EXAMPLES:,} (default 5)")
    show.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    show.add_argument("--split", default="train",
                      help="train, validation, test, or test_long where the task sets train_max_len (default train)")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a task option, e.g. --set max_len=12 (repeatable; values parse as YAML)")
    show.set_defaults(func=show_task)


def parse_overrides(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        apply_override(options, item)
    return options


def list_tasks(args: argparse.Namespace) -> int:
    for name, task in TASKS.items():
        defaults = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(task.Options))
        print(f"{name}\t{task.summary}\n\t{defaults}")
    return 0


def show_task(args: argparse.Namespace) -> int:
    if not 1 <= args.n <= MAX_EXAMPLES:
        raise ConfigError(f"-n must lie in [1, {MAX_EXAMPLES:,}] (samples to print), got {args.n}")
    options = parse_overrides(args.set)
    # Both are build_batch_source's own arguments, which a task option of that name would collide with.
    for key, where in (("name", "the NAME argument"), ("seed", "--seed")):
        if key in options:
            raise ConfigError(f"--set {key}: the task's {key} is given as {where}, not as a task option")
    source = build_batch_source(args.seed, args.name, **options)
    for prompt, answer in source.examples(args.split, args.n):
        print(f"{prompt}\t{answer}")
    return 0
