"""The training engine: run configs, the loop (one process or torchrun DDP/FSDP2), checkpoints, metrics.

``train(load_config("run.yaml"), "runs/x")`` is what ``poslab train run.yaml --out runs/x`` does;
``load_run("runs/x")`` gives back the config and the trained model.
"""
from __future__ import annotations

from poslab.train.config import DataConfig, RunConfig, TrainConfig, apply_override, load_config
from poslab.train.rundir import load_run
from poslab.train.trainer import TrainingDiverged, train

__all__ = ["DataConfig", "RunConfig", "TrainConfig", "TrainingDiverged", "apply_override", "load_config",
           "load_run", "train"]
