"""What every recipe needs: train a run unless it already finished, and read its numbers back."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from poslab.train import RunConfig, train
from poslab.train.checkpoint import load_trainer_state, resolve
from poslab.errors import CheckpointError

FINAL = "final.json"


def rel(path: Path | str, recipe_dir: Path) -> str:
    """A figure's path relative to the reproduction directory (the parent of a recipe's directory)."""
    return os.path.relpath(path, recipe_dir.parent)


def ensure_run(config: dict[str, Any], out: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Train ``config`` into ``out`` and return its final metrics. A finished run is not trained again
    (its metrics come from out/final.json); an interrupted one resumes from its last checkpoint."""
    cfg = RunConfig.from_dict(config)
    final = out / FINAL
    if final.exists():
        metrics = json.loads(final.read_text())
        if metrics.get("step") == cfg.train.steps:
            return metrics
    resume = False
    with contextlib.suppress(CheckpointError):  # no checkpoint yet: a fresh run
        resume = load_trainer_state(resolve(out / "checkpoints" / "last"))["step"] > 0
    log(f"  training {out.name}: {cfg.model.to_dict().get('positional', {}).get('name', cfg.model.to_dict()['arch'])}"
        f", {cfg.train.steps} steps")
    metrics = train(cfg, out, resume=resume, overwrite=not resume and out.exists())
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one writer
        tmp = out / f".{FINAL}.tmp"
        tmp.write_text(json.dumps(metrics, default=float))
        tmp.replace(final)
    return metrics
