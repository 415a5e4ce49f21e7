"""What a reproduction will train, before it trains: ``poslab reproduce NAME|all --scale S --plan``.

A paper-scale reproduction is days of GPU time, so a user should see its cost first: each training a recipe
needs, its model, the tokens it reads and the compute that takes, and how far it already got in --out.
Nothing is downloaded, prepared, trained or written.

Compute is counted, not modelled: ``torch.utils.flop_counter`` records the matmul FLOPs (attention included)
of one forward and backward of a sequence of the data's length, run on the meta device, and that is scaled
by the sequences the training reads. Optimizer updates and elementwise work are not counted; models whose
head scores only the masked tokens (``sparse_prediction``) are counted with it on every token.
"""
from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from poslab.experiments.common import finished, trained_otherwise
from poslab.train.checkpoint import saved_step
from poslab.experiments.runner import RECIPES
from poslab.models import build_model
from poslab.train import RunConfig, load_config


@dataclass(frozen=True)
class Training:
    recipes: tuple[str, ...]  # the recipes that read it (extrapolation and frequencies share their models)
    directory: str  # relative to the reproduction's --out
    model: str  # "decoder, pope, 8 x 512"
    parameters: int
    sequence: int  # tokens per sequence: a corpus's seq_len, a task's longest problem (batches pad to it)
    tokens: int  # sequences x sequence over all steps
    flops: float
    status: str  # "done", "step k of n", "not started", or why it cannot be reused
    left: float  # the FLOPs still to train: flops x the share of steps not trained (all of them to redo)
    bound: bool = False  # sized at its tokenizer's vocabulary cap, not yet trained: parameters and FLOPs at most


def plan(names: list[str], scale: str, out: str | Path) -> list[Training]:
    """Every training of the recipes ``names`` at ``scale``, once each, in the order they run."""
    out = Path(out)
    found: dict[Path, tuple[list[str], dict[str, Any]]] = {}
    for name in names:
        module = importlib.import_module(RECIPES[name][0].split(":")[0])
        for config, run_dir in module.runs(scale, out / name).values():
            found.setdefault(run_dir, ([], config))[0].append(name)
    return [_training(tuple(recipes), config, run_dir, out) for run_dir, (recipes, config) in found.items()]


def _training(recipes: tuple[str, ...], config: dict[str, Any], run_dir: Path, out: Path) -> Training:
    vocab, sequence, bound = data_shape(config["data"], config.get("seed", 0))
    if (run_dir / "config.yaml").is_file():  # trained (or training): the vocabulary its tokenizer reached
        vocab, bound = load_config(run_dir / "config.yaml").model.vocab_size, False
    cfg = RunConfig.from_dict({**config, "model": {**config["model"], "vocab_size": vocab}})
    parameters, step_flops = _count(json.dumps(cfg.model.to_dict(), sort_keys=True), sequence)
    sequences = cfg.train.steps * cfg.train.batch_size
    model = cfg.model.to_dict()
    shape = f"{model['n_layers']} x {model.get('d_model') or model['d_ap'] + model['d_sem']}"
    positional = model.get("positional", {})
    options = " ".join(f"{k}={v}" for k, v in positional.get("options", {}).items())
    scheme = f"{positional.get('name')} ({options})" if options else positional.get("name")
    return Training(recipes=recipes, directory=str(run_dir.relative_to(out)),
                    model=", ".join(x for x in (model["arch"], scheme, shape) if x),
                    parameters=parameters, sequence=sequence, tokens=sequences * sequence,
                    flops=step_flops * sequences, bound=bound, **_progress(cfg, run_dir, step_flops * sequences))


def data_shape(data: dict[str, Any], seed: int) -> tuple[int, int, bool]:
    """(vocabulary size, tokens per sequence, whether the size is only a cap) without preparing anything. A
    task's come from its source, which draws no problem until asked; a corpus's from its config, whose size
    for a tokenizer still to be trained is a cap it may not reach (a ready tokenizer's, bert-base-uncased's,
    is its size)."""
    options = {k: v for k, v in data.items() if k != "kind"}
    if data.get("kind", "task") == "task":
        from poslab.tasks import build_batch_source

        source = build_batch_source(seed=seed, **options)
        return source.vocab_size, source.max_train_len, False
    from poslab.data import DataConfig

    text = DataConfig.from_options(options)
    return text.tokenizer.vocab_size, text.seq_len, text.tokenizer.path is None


@functools.lru_cache(maxsize=None)
def _count(model_json: str, sequence: int) -> tuple[int, float]:
    """(parameters, matmul FLOPs of a forward and backward of one sequence); cached: seeds share a shape."""
    with torch.device("meta"):
        model = build_model(json.loads(model_json))
        ids = torch.zeros(1, sequence, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids).logits.float().sum().backward()
    return model.num_parameters(), float(counter.get_total_flops())


def _progress(cfg: RunConfig, run_dir: Path, flops: float) -> dict[str, Any]:
    """The status and the FLOPs still to train of a run that would train ``flops`` from scratch."""
    difference = trained_otherwise(cfg, run_dir) if (run_dir / "config.yaml").exists() else None
    if difference is not None:  # what finished() and the run would refuse
        return {"status": f"trained with other settings ({difference}): delete it or use another --out", "left": flops}
    if finished(cfg, run_dir) is not None:
        return {"status": "done", "left": 0.0}
    step = saved_step(run_dir, log=lambda _: None)
    if step:
        return {"status": f"step {step:,} of {cfg.train.steps:,}", "left": flops * (1 - step / cfg.train.steps)}
    return {"status": "not started", "left": flops}


def render(trainings: list[Training], scale: str) -> str:
    """The plan as Markdown: a row per training, then the totals per recipe."""
    lines = [f"# poslab reproduce --scale {scale}: {len(trainings)} trainings", "",
             "| recipe | run | model | parameters | tokens / sequence | tokens | training FLOPs | status |",
             "|---|---|---|---|---|---|---|---|"]
    for t in trainings:
        at_most, millions = "<= " if t.bound else "", t.parameters / 1e6
        size = f"{millions:.1f}M" if millions >= 1 else f"{millions:.2g}M"  # smoke's models read "0.0M"
        lines.append(f"| {', '.join(t.recipes)} | {t.directory} | {t.model} | {at_most}{size} | "
                     f"{t.sequence:,} | {t.tokens:.3g} | {at_most}{t.flops:.3g} | {t.status} |")
    lines += ["", "| recipe | trainings | training FLOPs | still to train |", "|---|---|---|---|"]
    groups: dict[str, list[Training]] = {}
    for t in trainings:  # a shared training counts once, with the first recipe that reads it
        groups.setdefault(t.recipes[0], []).append(t)
    for recipe, group in [*groups.items(), ("total", trainings)]:
        left = sum(t.left for t in group)
        lines.append(f"| {recipe} | {len(group)} | {sum(t.flops for t in group):.3g} | {left:.3g} |")
    lines += ["", "FLOPs: the matmul FLOPs of one forward and backward (torch.utils.flop_counter on the meta device, "
                  "attention in full even where causal) times the sequences read; evaluation and analyses are not "
                  "counted."]
    if any(t.bound for t in trainings):
        lines += ["", "<=: a text run whose tokenizer is not trained yet is sized at its vocabulary cap; a trained "
                      "tokenizer can stop below it (the quick and smoke corpora's do), and the run's own figures "
                      "show once it has started."]
    return "\n".join(lines)
