"""Reversal (adjacency paper): ``rev(1234)=4321``.

Length = the characters of the problem before ``=`` (``rev(1234)`` has length 9), the paper's input
length (max 22, so up to 17 digits). Digits are uniform, leading zeros included (it is a string task).
Prompt ``rev(D)=``, answer the digits reversed, then <eos>.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from poslab.tasks.base import Ragged, Task, TaskOptions, concat, digits, reverse, text

OVERHEAD = len("rev()")


@dataclasses.dataclass(frozen=True)
class ReversalOptions(TaskOptions):
    task = "reversal"
    shortest = OVERHEAD + 1

    min_len: int = OVERHEAD + 1
    max_len: int = 22
    train_size: int | None = 20_000


class Reversal(Task):
    name = "reversal"
    summary = "'rev(1234)=4321': the digits reversed"
    Options = ReversalOptions

    def alphabet(self) -> str:
        return "0123456789rev()="

    def max_chars(self, max_len: int) -> int:
        return max_len + 1 + max_len - OVERHEAD

    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> tuple[Ragged, Ragged]:
        n = lengths - OVERHEAD
        values = rng.integers(0, 10, size=(len(n), int(n.max())))
        batch = len(n)
        prompt = concat(text("rev(", batch), digits(values, n), text(")=", batch))
        return prompt, digits(reverse(values, n), n)
