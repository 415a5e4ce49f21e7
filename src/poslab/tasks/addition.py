"""Addition (adjacency paper): ``123+456=579``.

Length = the characters of the problem before ``=`` (``123+456`` has length 7), the paper's input
length (max 9). A problem of length l has operands of a and b digits, a + b = l - 1, a uniform in
[1, l - 2]; operands have no leading zeros (a one-digit operand may be 0). Prompt ``A+B=``, answer
the decimal sum, then <eos>. Digits are added column by column, so lengths are not limited by int64.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from poslab.tasks.base import Ragged, Task, TaskOptions, concat, digits, reverse, text


@dataclasses.dataclass(frozen=True)
class AdditionOptions(TaskOptions):
    task = "addition"
    shortest = 3

    min_len: int = 3
    max_len: int = 9
    train_size: int | None = 20_000


def random_operand(rng: np.random.Generator, lens: np.ndarray) -> np.ndarray:
    """Digit values (batch, max(lens)), most significant first, no leading zero unless one digit."""
    values = rng.integers(0, 10, size=(len(lens), int(lens.max())))
    values[:, 0] = np.where(lens > 1, rng.integers(1, 10, size=len(lens)), values[:, 0])
    return values


def add(a: np.ndarray, a_lens: np.ndarray, b: np.ndarray, b_lens: np.ndarray) -> Ragged:
    """Sum of two batches of digit rows (most significant first) as decimal strings."""
    width = max(a.shape[1], b.shape[1]) + 1
    columns = np.zeros((2, len(a_lens), width), dtype=np.int64)  # least significant digit first
    columns[0, :, : a.shape[1]] = reverse(a, a_lens)
    columns[1, :, : b.shape[1]] = reverse(b, b_lens)
    total = np.zeros((len(a_lens), width), dtype=np.int64)
    carry = np.zeros(len(a_lens), dtype=np.int64)
    for j in range(width):
        column = columns[0, :, j] + columns[1, :, j] + carry
        total[:, j], carry = column % 10, column // 10
    lens = np.where(total.any(axis=1), width - np.argmax(total[:, ::-1] != 0, axis=1), 1)
    return digits(reverse(total, lens), lens)


class Addition(Task):
    name = "addition"
    summary = "'123+456=579': the decimal sum"
    Options = AdditionOptions

    def alphabet(self) -> str:
        return "0123456789+="

    def max_chars(self, max_len: int) -> int:
        # prompt l + '=', sum of at most l - 2 digit operands: l - 1 digits
        return 2 * max_len

    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> tuple[Ragged, Ragged]:
        a_lens = rng.integers(1, lengths - 1)
        b_lens = lengths - 1 - a_lens
        a, b = random_operand(rng, a_lens), random_operand(rng, b_lens)
        batch = len(lengths)
        prompt = concat(digits(a, a_lens), text("+", batch), digits(b, b_lens), text("=", batch))
        return prompt, add(a, a_lens, b, b_lens)
