"""Periodic evaluation on a source's fixed split.

Task sources with a causal model use ``poslab.tasks.evaluate`` (loss, token accuracy and exact match on
the answer). Every other pairing gets loss and accuracy over the labelled tokens (labels != -100), with
the same target alignment as training: a causal model's logits at i are scored against labels at i + 1.
Every rank evaluates the whole split (FSDP's per-layer gathers need all ranks in the forward anyway), so
keep evaluation sets small; the trainer then takes rank 0's numbers on every rank.

``check`` refuses a split or ``train.best_metric`` that the evaluation would not find before training
starts: with ``eval_every: 0`` the first evaluation is the final one, and failing there loses the run.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from poslab import tasks
from poslab.batches import BatchSource
from poslab.errors import ConfigError, unknown_key_message
from poslab.train.config import RunConfig

# The metrics train.best_metric can name; evaluate() also reports counts (tokens, and examples for tasks).
METRICS = ("loss", "token_accuracy")
ANSWER_METRICS = (*METRICS, "exact_match")


def perplexity(loss: float) -> float:
    """exp(loss); a diverged run's loss past exp's range is an infinite perplexity, not an OverflowError."""
    return math.exp(loss) if loss < 700 or math.isnan(loss) else math.inf


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context training runs its forwards in: bf16 autocast for train.precision bf16 (auto: on CUDA),
    else none. Evaluations outside training take it too, to give training's numbers."""
    chosen = {"auto": "bf16" if device.type == "cuda" else "fp32"}.get(precision, precision)
    return torch.autocast(device.type, dtype=torch.bfloat16) if chosen == "bf16" else contextlib.nullcontext()


def _scores_answers(config: RunConfig) -> bool:
    """Whether evaluation scores whole answers (a causal model on a task) rather than labelled tokens."""
    return config.data.kind == "task" and config.model.causal


def metrics(config: RunConfig) -> tuple[str, ...]:
    """The metrics ``evaluate`` reports for this data and model that ``train.best_metric`` may name."""
    return ANSWER_METRICS if _scores_answers(config) else METRICS


def check(config: RunConfig, source: BatchSource) -> None:
    """ConfigError naming the valid choices unless ``source`` has ``train.eval_split`` and the evaluation
    reports ``train.best_metric``."""
    train = config.train
    if train.eval_split not in source.splits:
        raise ConfigError(unknown_key_message("train.eval_split", train.eval_split, source.splits))
    if train.best_metric not in metrics(config):
        raise ConfigError(unknown_key_message("train.best_metric", train.best_metric, metrics(config)))


def evaluated_set(config: RunConfig) -> dict[str, Any]:
    """What fixes the examples ``evaluate`` reads: the split, and for token scoring how many batches of what
    size (answer scoring reads the whole split). Evaluations on equal sets are comparable."""
    train = config.train
    if _scores_answers(config):
        return {"split": train.eval_split}
    return {"split": train.eval_split, "batches": train.eval_batches,
            "batch_size": train.eval_batch_size or train.batch_size}


def batches(config: RunConfig, source: BatchSource) -> Iterator[dict[str, torch.Tensor]]:
    """The batches ``evaluate`` reads: the whole split when it scores answers, else the first
    ``train.eval_batches``."""
    train = config.train
    limit = None if _scores_answers(config) else train.eval_batches
    return itertools.islice(source.eval_batches(train.eval_split, train.eval_batch_size or train.batch_size), limit)


def targets(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """The labels the loss scores: shifted left by one for a causal model. (b, n) -> (b, n or n - 1)."""
    return labels[:, 1:] if causal else labels


@torch.no_grad()
def evaluate(model: torch.nn.Module, source: BatchSource, config: RunConfig, device: torch.device,
             autocast: contextlib.AbstractContextManager) -> dict[str, float]:
    train = config.train
    batch_size = train.eval_batch_size or train.batch_size
    causal = config.model.causal
    was_training = model.training
    model.eval()
    try:
        if _scores_answers(config):
            def logits_of(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                with autocast:
                    return model(input_ids=ids, attention_mask=mask).logits
            return tasks.evaluate(logits_of, source, train.eval_split, batch_size, device)
        loss = torch.zeros((), dtype=torch.float64)
        tokens = correct = 0
        for batch in batches(config, source):
            batch = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels") if k in batch}
            with autocast:
                out = model(**batch)
            target = targets(batch["labels"], causal)
            labelled = target != -100
            count = int(labelled.sum())
            if count == 0:
                continue
            if out.logits.dim() == 2:  # sparse prediction: the labelled tokens' logits only, in order
                correct += int((out.logits.argmax(-1) == target[labelled]).sum())
            else:
                logits = out.logits[:, :-1] if causal else out.logits
                correct += int(((logits.argmax(-1) == target) & labelled).sum())
            loss += out.loss.double().cpu() * count
            tokens += count
        return {"loss": float(loss) / tokens if tokens else float("nan"),
                "token_accuracy": correct / tokens if tokens else float("nan"), "tokens": tokens}
    finally:
        model.train(was_training)
