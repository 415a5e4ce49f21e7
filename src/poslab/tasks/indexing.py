"""Indexing (adjacency paper): ``wherex(134504392,4)=2``.

Length = the characters of the problem before ``=`` (``wherex(134504392,4)`` has length 19), the
paper's input length (max 20, so up to 10 digits). Digits are uniform (repeats and leading zeros
allowed); the query is the digit at a uniformly drawn position, so it always occurs. Prompt
``wherex(D,q)=``, answer the 0-based position of q's first occurrence in D (Python's ``str.index``),
then <eos>.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from poslab.tasks.base import Ragged, Task, TaskOptions, concat, digits, number, text

OVERHEAD = len("wherex(,0)")


@dataclasses.dataclass(frozen=True)
class IndexingOptions(TaskOptions):
    task = "indexing"
    shortest = OVERHEAD + 1

    min_len: int = OVERHEAD + 1
    max_len: int = 20
    train_size: int | None = 20_000


class Indexing(Task):
    name = "indexing"
    summary = "'wherex(134504392,4)=2': 0-based position of the first occurrence"
    Options = IndexingOptions

    def alphabet(self) -> str:
        return "0123456789wherx(,)="

    def max_chars(self, max_len: int) -> int:
        return max_len + 1 + len(str(max_len - OVERHEAD - 1))

    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> tuple[Ragged, Ragged]:
        n = lengths - OVERHEAD
        batch = len(n)
        values = rng.integers(0, 10, size=(batch, int(n.max())))
        query = values[np.arange(batch), rng.integers(0, n)]
        in_string = np.arange(values.shape[1]) < n[:, None]
        first = np.argmax((values == query[:, None]) & in_string, axis=1)
        prompt = concat(text("wherex(", batch), digits(values, n), text(",", batch),
                        digits(query[:, None], np.ones(batch, dtype=np.int64)), text(")=", batch))
        return prompt, number(first)
