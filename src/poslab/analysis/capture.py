"""Activation capture: ``run_with_cache`` and gathering captured tensors over evaluation batches.

Models take ``capture=ActivationCache(patterns)`` (``poslab.models.cache``) and record named tensors
themselves, so analysis never hooks or patches a model. Names (glob patterns select them):
``embed``, ``blocks.{i}.resid_pre``, ``blocks.{i}.attn.q`` / ``.k``, ``blocks.{i}.attn.freq_norms.q`` /
``.k``, ``blocks.{i}.attn.probs``, ``blocks.{i}.attn.logits.{term}``, ``blocks.{i}.attn_out``,
``blocks.{i}.resid_mid``, ``blocks.{i}.resid_post``, ``final``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from poslab.models.cache import ActivationCache

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


@torch.no_grad()
def run_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, names: Iterable[str] | str | None = None,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   ) -> tuple[Any, ActivationCache]:
    """One forward pass that also returns the activations whose names match ``names`` (None: all).

    input_ids (batch, n); returns (the model's output, the cache). Gradients are off; put the model in
    eval mode first if dropout matters.
    """
    cache = ActivationCache(names)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, capture=cache)
    return out, cache


def iterate_captures(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], names: Iterable[str] | str,
                     ) -> Iterator[tuple[dict[str, torch.Tensor], ActivationCache]]:
    """(batch, cache) for each batch, the model's inputs moved to its device."""
    device = next(model.parameters()).device
    for batch in batches:
        inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
        _, cache = run_with_cache(model, inputs.pop("input_ids"), names, **inputs)
        yield batch, cache


def pad_to(x: torch.Tensor, n: int, dims: tuple[int, ...], value: float = 0) -> torch.Tensor:
    """Right-pad the given dims of x to length n."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        pad[2 * (x.dim() - 1 - d) + 1] = n - x.shape[d]
    return F.pad(x, pad, value=value)


def stack_tokens(parts: list[torch.Tensor], value: float = 0) -> torch.Tensor:
    """Concatenate (b_i, n_i, ...) tensors along the batch, right-padding the token dim to the longest."""
    n = max(p.shape[1] for p in parts)
    return torch.cat([pad_to(p, n, (1,), value) for p in parts])


def collect(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], names: Iterable[str] | str,
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-token captures (batch, n, ...) and per-token batch entries, concatenated over batches.

    For names whose tensors have the token dim second (streams: ``embed``, ``resid_*``, ``attn_out``,
    ``final``); attention-shaped captures (q, k, probs, logits) are reduced batch by batch instead
    (``iterate_captures``). Returns (captured: name -> (S, n, ...) on CPU, batch: key -> (S, n)), tokens
    padded past each batch's width; ``batch['attention_mask']`` marks the real tokens (all ones when a
    source has none), labels are padded with -100, other batch keys with -1 (the data's "no label").
    """
    caps: dict[str, list[torch.Tensor]] = {}
    rows: dict[str, list[torch.Tensor]] = {}
    for batch, cache in iterate_captures(model, batches, names):
        batch = dict(batch)
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        for key, value in batch.items():
            rows.setdefault(key, []).append(value.cpu())
        for key, value in cache.items():
            caps.setdefault(key, []).append(value.float().cpu())
    fill = {"labels": -100, "attention_mask": 0, "input_ids": 0}
    return ({k: stack_tokens(v) for k, v in caps.items()},
            {k: stack_tokens(v, fill.get(k, -1)) for k, v in rows.items()})


def take_batches(batches: Iterable[dict[str, torch.Tensor]], sequences: int) -> list[dict[str, torch.Tensor]]:
    """The first batches covering ``sequences`` sequences, the last one trimmed."""
    out, seen = [], 0
    for batch in batches:
        if seen >= sequences:
            break
        batch = {k: v[: sequences - seen] for k, v in batch.items()}
        seen += batch["input_ids"].shape[0]
        out.append(batch)
    return out
