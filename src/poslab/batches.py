"""The one interface between data and the training engine.

A ``BatchSource`` is deterministic: the batch of a step is a function of (seed, step) alone, so resuming
needs only the step number and data-parallel ranks need no coordination (rank r takes its slice of the
global batch). Synthetic tasks (``poslab.tasks``) and text corpora (``poslab.data``) both implement it.

Batch dictionaries hold:
  ``input_ids``      (batch, n) long
  ``labels``         (batch, n) long, -100 where no loss is taken (targets are NOT shifted: a causal
                     model shifts them itself, as Hugging Face models do)
  ``attention_mask`` (batch, n) long, 1 for real tokens, 0 for padding (optional)
and any extra per-token labels a source offers (e.g. structure labels for probes).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from poslab.errors import lookup


@runtime_checkable
class BatchSource(Protocol):
    vocab_size: int
    #: the widest training batch any step can draw (tokens per sequence), checked against the model before step 1
    max_train_len: int
    #: the evaluation splits ``eval_batches`` serves; checked against train.eval_split before training
    splits: tuple[str, ...]
    #: bos_token_id / eos_token_id / pad_token_id as Hugging Face generation reads them (an id may be None): where
    #: a sequence starts, where its text or answer ends, what pads it
    generation_ids: dict[str, int | None]

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s share (batch_size // world_size rows) of the global batch of ``step``."""
        ...

    def eval_batches(self, split: str, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every example of a fixed evaluation split ('validation', 'test', ...), in order."""
        ...

    def sequence_batches(self, split: str, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """What analyses read: the split's sequences as the data is (a masked LM's text unmasked)."""
        ...


# kind -> "module:function"; the function takes the config's options as keywords plus ``seed``.
# Import paths, not objects, so that choosing a source imports only what it needs.
SOURCES: dict[str, str] = {
    "task": "poslab.tasks:build_batch_source",
    "mlm": "poslab.data:build_mlm_source",
    "lm": "poslab.data:build_lm_source",
}


def build_batch_source(kind: str, seed: int, **options: Any) -> BatchSource:
    module, fn = lookup("data kind", kind, SOURCES).split(":")
    return getattr(importlib.import_module(module), fn)(seed=seed, **options)


def data_version(kind: str, **options: Any) -> dict[str, Any]:
    """What decides a kind's batches beyond the config (versions of the code that makes them), from the
    config alone: nothing is prepared or drawn. A run records it (DIR/data.json) so that a run trained on
    data an older poslab made is neither resumed nor reused as if trained on today's. Every builder's
    module defines ``data_version(**options)``."""
    module = lookup("data kind", kind, SOURCES).split(":")[0]
    return importlib.import_module(module).data_version(**options)
