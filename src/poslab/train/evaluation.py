"""Periodic evaluation on a source's fixed split.

Task sources with a causal model use ``poslab.tasks.evaluate`` (loss, token accuracy and exact match on
the answer). Every other pairing gets loss and accuracy over the labelled tokens (labels != -100), with
the same target alignment as training: a causal model's logits at i are scored against labels at i + 1.
Every rank evaluates the whole split (the numbers agree without a reduction, and FSDP's per-layer
gathers need all ranks in the forward anyway), so keep evaluation sets small.
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from poslab import tasks
from poslab.batches import BatchSource
from poslab.train.config import RunConfig


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
        if config.data.kind == "task" and causal:
            def logits_of(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                with autocast:
                    return model(input_ids=ids, attention_mask=mask).logits
            return tasks.evaluate(logits_of, source, train.eval_split, batch_size, device)
        loss = torch.zeros((), dtype=torch.float64)
        tokens = correct = 0
        for batch in itertools.islice(source.eval_batches(train.eval_split, batch_size), train.eval_batches):
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
