"""AdamW with decay on weight matrices only, and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from poslab.train.config import TrainConfig

# Modules whose ``weight`` is a linear map. Weight decay shrinks those; it must not pull norm gains towards
# 0, embedding rows of rare tokens towards the origin, or biases (PoPE's phase offsets, ALiBi slopes,
# positional tables) away from what they encode.
LINEAR_MAPS = (nn.Linear, _ConvNd)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups, decided by each parameter's role rather than its name.

    Decayed: the ``weight`` of linear layers. Not decayed: everything else -- biases, norm gains, embedding
    tables (also when an output head shares the embedding matrix) and free parameters of positional schemes.
    """
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, LINEAR_MAPS)}
    decay, no_decay = [], []
    for p in model.parameters():  # shared parameters appear once
        if p.requires_grad:
            (decay if id(p) in linear and id(p) not in embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # The fused CUDA kernel is one launch for all parameters; CPU keeps the default (foreach) path.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             fused=device.type == "cuda")


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier on cfg.lr for (0-based) step: linear warmup, the full lr at step warmup_steps - 1, then a
    cosine to min_lr/lr at the last step (or constant). A warmup as long as the run (warmup_steps == steps)
    leaves no step to decay: the last step takes the full lr.

    Warmup starts at 1/warmup_steps rather than 0 so that the first update is not wasted.
    """
    floor = cfg.min_lr / cfg.lr
    peak = max(cfg.warmup_steps - 1, 0)
    decay_steps = max(1, cfg.steps - 1 - peak)
    after_peak = {
        "cosine": lambda t: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t / decay_steps)),
        "constant": lambda t: 1.0,
    }[cfg.schedule]

    def factor(step: int) -> float:
        return (step + 1) / cfg.warmup_steps if step < peak else after_peak(min(step - peak, decay_steps))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                    done: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of ``cfg``, positioned for step ``done`` (the updates a resumed run has made)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr  # a resumed optimizer's groups hold the lr of the run that saved them
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg), last_epoch=done - 1)
