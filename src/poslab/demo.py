"""``poslab demo``: build every positional scheme, train a tiny decoder briefly with each, print a table.

The task is in-context copying (the second half of each sequence repeats the first), which needs
position or content matching, so the schemes differ within a few dozen steps.
"""
from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table

from poslab.errors import ConfigError
from poslab.models import build_model
from poslab.positional import SCHEMES


def copy_batch(generator: torch.Generator, batch: int, half: int, vocab: int) -> torch.Tensor:
    first = torch.randint(0, vocab, (batch, half), generator=generator)
    return torch.cat([first, first], dim=1)


def run_demo(steps: int = 40, seed: int = 0) -> list[dict]:
    rows = []
    for scheme in sorted(SCHEMES):
        torch.manual_seed(seed)
        model = build_model({"arch": "decoder", "vocab_size": 16, "d_model": 64, "n_heads": 4, "n_layers": 2,
                             "max_seq_len": 32, "positional": {"name": scheme}})
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        for _ in range(steps):
            x = copy_batch(gen, 32, 16, 16)
            labels = x.clone()
            labels[:, :16] = -100  # score only the copied half
            loss = model(x, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        rows.append({"scheme": scheme, "params": model.num_parameters(), "loss": loss.item(),
                     "seconds": time.perf_counter() - start})
    return rows


def _cmd(args) -> int:
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1 (training steps per scheme), got {args.steps}")
    if not 0 <= args.seed < 2**63:  # a run config's range (torch.manual_seed overflows past 2^64 - 1)
        raise ConfigError(f"--seed must lie in [0, 2^63), got {args.seed}")
    table = Table(title=f"poslab demo: copy task, {args.steps} steps per scheme")
    for column in ("scheme", "parameters", "final loss", "seconds"):
        table.add_column(column, justify="right" if column != "scheme" else "left")
    for row in run_demo(args.steps, args.seed):
        table.add_row(row["scheme"], f"{row['params']:,}", f"{row['loss']:.3f}", f"{row['seconds']:.1f}")
    Console().print(table)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="build every scheme and train a tiny model briefly with each")
    p.add_argument("--steps", type=int, default=40, help="training steps per scheme (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed in [0, 2^63) (default 0)")
    p.set_defaults(func=_cmd)
