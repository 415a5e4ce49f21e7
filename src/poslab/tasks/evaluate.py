"""Loss, token accuracy and exact match of a causal model on a task split.

Exact match is computed under teacher forcing: an example counts when the argmax at every labelled
position is the label. This equals exact match under greedy decoding (generate from the prompt until
<eos>): if every teacher-forced argmax is right, greedy decoding feeds itself exactly the teacher's
tokens and reproduces the answer and its <eos>; at the first wrong argmax greedy decoding emits that
wrong token, so its answer differs. tests/test_tasks.py checks this against an explicit greedy loop.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from poslab.tasks.source import TaskSource

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def answer_hits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (b, n, vocab) unshifted, labels (b, n) -> (hit, labelled), both (b, n - 1) bool.

    Position i's logits predict token i + 1, so hit[:, i] compares argmax(logits[:, i]) with labels[:, i + 1].
    """
    target = labels[:, 1:]
    labelled = target != -100
    return (logits[:, :-1].argmax(dim=-1) == target) & labelled, labelled


def exact_match(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(b,) bool: every labelled token is the argmax under teacher forcing."""
    hit, labelled = answer_hits(logits, labels)
    return (hit | ~labelled).all(dim=1)


@torch.no_grad()
def evaluate(model_fn: ModelFn, source: TaskSource, split: str = "validation", batch_size: int = 256,
             device: torch.device | str | None = None, max_batches: int | None = None) -> dict[str, float]:
    """Run model_fn(input_ids, attention_mask) -> logits (b, n, vocab) over a split (its first
    max_batches batches when given; the split's order is fixed, so they are always the same examples).

    Returns loss (mean cross-entropy per answer token), token_accuracy, exact_match, and the counts
    examples and tokens. Put the model in eval mode first; for a poslab/Hugging Face model pass
    ``lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits``.
    """
    loss = torch.zeros((), dtype=torch.float64)
    tokens = correct = exact = examples = 0
    for batch in itertools.islice(source.eval_batches(split, batch_size), max_batches):
        ids, mask, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
        logits = model_fn(ids, mask).float()
        loss += F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                reduction="sum").double().cpu()
        hit, labelled = answer_hits(logits, labels)
        tokens += int(labelled.sum())
        correct += int(hit.sum())
        exact += int((hit | ~labelled).all(dim=1).sum())
        examples += ids.shape[0]
    return {"loss": float(loss) / tokens, "token_accuracy": correct / tokens, "exact_match": exact / examples,
            "examples": examples, "tokens": tokens}
