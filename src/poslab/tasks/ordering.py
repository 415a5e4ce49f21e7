"""Ordering (adjacency paper; the paper gives no format, so this one is ours): ``order(3829,8293)=1230``.

A sequence of n distinct digits and a permutation of it; the answer lists, for each digit of the
permuted sequence in turn, its 0-based index in the original sequence (8 was at 1, 2 at 2, 9 at 3,
3 at 0: ``1230``). Distinct digits make the indices unique, so n <= 10 and every index is one digit.

Length = the characters of the problem before ``=``, 2n + 8 (``order(3829,8293)`` has length 16),
the paper's input length (max 18, so up to 5 digits); lengths are even. Prompt ``order(S,P)=``,
answer the n indices, then <eos>.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from poslab.errors import require
from poslab.tasks.base import Ragged, Task, TaskOptions, concat, digits, text

OVERHEAD = len("order(,)")
MAX_ITEMS = 10


@dataclasses.dataclass(frozen=True)
class OrderingOptions(TaskOptions):
    task = "ordering"
    shortest = OVERHEAD + 2

    min_len: int = OVERHEAD + 2
    max_len: int = 18
    train_size: int | None = 20_000

    def __post_init__(self) -> None:
        super().__post_init__()
        longest = OVERHEAD + 2 * MAX_ITEMS
        require(self.max_len <= longest,
                f"ordering.max_len must be <= {longest} (at most {MAX_ITEMS} distinct digits), got {self.max_len}")


class Ordering(Task):
    name = "ordering"
    summary = "'order(3829,8293)=1230': index in the first sequence of each digit of the second"
    Options = OrderingOptions

    def alphabet(self) -> str:
        return "0123456789order(,)="

    def lengths(self) -> np.ndarray:
        lengths = super().lengths()
        return lengths[(lengths - OVERHEAD) % 2 == 0]

    def max_chars(self, max_len: int) -> int:
        return max_len + 1 + (max_len - OVERHEAD) // 2

    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> tuple[Ragged, Ragged]:
        n = (lengths - OVERHEAD) // 2
        batch, width = len(n), int(n.max())
        sequence = np.argsort(rng.random((batch, MAX_ITEMS)), axis=1)[:, :width]  # distinct digits
        keys = rng.random((batch, width))
        keys[np.arange(width) >= n[:, None]] = np.inf  # shuffle only the first n positions
        moved = np.argsort(keys, axis=1)  # permuted[j] = sequence[moved[j]]
        permuted = np.take_along_axis(sequence, moved, axis=1)
        prompt = concat(text("order(", batch), digits(sequence, n), text(",", batch), digits(permuted, n),
                        text(")=", batch))
        return prompt, digits(moved, n)
