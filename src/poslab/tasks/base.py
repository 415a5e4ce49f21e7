"""What every task shares: its options, its interface, and vectorised string building.

A task writes whole batches of problems at once with numpy, so that data never slows training: a
batch of strings is a ``Ragged`` pair -- ASCII codes ``(batch, width)`` uint8 right-padded with 0, and
lengths ``(batch,)`` int64 -- and formats are assembled by concatenating ragged pieces column-wise.

Every task measures a problem by one integer *length* (each task's docstring says what it counts);
``min_len``/``max_len`` bound it, and ``train_max_len`` cuts a length-generalisation split.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, NamedTuple

import numpy as np

from poslab.errors import check_fields, known_fields, require


class Ragged(NamedTuple):
    """A batch of strings: codes (batch, width) (ASCII codes or token ids), 0 past each row's length."""

    codes: np.ndarray
    lens: np.ndarray

    def strings(self) -> list[str]:
        return [row[:n].tobytes().decode("ascii") for row, n in zip(self.codes.astype(np.uint8), self.lens)]

    def take(self, rows: np.ndarray) -> Ragged:
        lens = self.lens[rows]
        return Ragged(self.codes[rows, : max(int(lens.max(initial=0)), 1)], lens)


def text(s: str, batch: int) -> Ragged:
    """The same string in every row."""
    codes = np.frombuffer(s.encode("ascii"), dtype=np.uint8)
    return Ragged(np.broadcast_to(codes, (batch, len(s))), np.full(batch, len(s), dtype=np.int64))


def digits(values: np.ndarray, lens: np.ndarray) -> Ragged:
    """Digit values (batch, width) 0..9, most significant first -> their characters."""
    width = values.shape[1]
    codes = np.where(np.arange(width) < lens[:, None], values + ord("0"), 0).astype(np.uint8)
    return Ragged(codes, lens.astype(np.int64))


def number(values: np.ndarray) -> Ragged:
    """Non-negative integers (batch,) -> their decimal strings, no leading zeros."""
    width = len(str(int(values.max(initial=0))))
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    lens = np.maximum((values[:, None] >= powers).sum(axis=1), 1)
    padded = values[:, None] // powers % 10  # (batch, width), leading zeros included
    shift = np.clip((width - lens)[:, None] + np.arange(width), 0, width - 1)
    return digits(np.take_along_axis(padded, shift, axis=1), lens)


def reverse(values: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Reverse each row's first lens[i] entries; 0 beyond them."""
    width = values.shape[1]
    index = lens[:, None] - 1 - np.arange(width)
    return np.where(index >= 0, np.take_along_axis(values, np.maximum(index, 0), axis=1), 0).astype(values.dtype)


def concat(*parts: Ragged) -> Ragged:
    """Row-wise concatenation of ragged pieces (every piece has the same batch size)."""
    batch = len(parts[0].lens)
    lens = sum(p.lens for p in parts)
    out = np.zeros((batch, int(lens.max(initial=0))), dtype=np.result_type(*(p.codes for p in parts)))
    offset = np.zeros(batch, dtype=np.int64)
    for part in parts:
        cols = np.arange(part.codes.shape[1])
        keep = cols < part.lens[:, None]
        rows = np.broadcast_to(np.arange(batch)[:, None], keep.shape)
        out[rows[keep], (offset[:, None] + cols)[keep]] = part.codes[keep]
        offset += part.lens
    return Ragged(out, lens)


def stack(parts: list[Ragged]) -> Ragged:
    """Stack batches of strings (possibly of different widths) into one batch."""
    width = max(p.codes.shape[1] for p in parts)
    codes = np.concatenate([np.pad(p.codes, ((0, 0), (0, width - p.codes.shape[1]))) for p in parts])
    return Ragged(codes, np.concatenate([p.lens for p in parts]))


# Splits are drawn by rejection (TaskSource._draw), so a split's share of the problem space sets the draws per
# problem kept: at least 1e-4 for validation and test, at least 0.1 (1 - 2 x 0.45) for training. Closer to 0
# or 0.5, a run would spend hours drawing before it could tell the split is (nearly) empty.
HOLDOUT_RANGE = (1e-4, 0.45)
# A problem is one training sequence, and splits are drawn tens of thousands of problems at a time, padded
# to max_len (TaskSource._draw): at this length drawing the default validation split of addition already
# takes 1.5 GB. (max_len 10^11 asked numpy for 745 GiB, to list the lengths.)
MAX_LEN = 512
# Splits are drawn and held in memory whole (up to ~1 KB a problem at MAX_LEN); the papers' largest is 1M.
MAX_SIZE = 10_000_000
# An evaluation split of n problems at share h of the problem space takes about n / h draws (~1.5 us each):
# this many is a few minutes, where the extremes the ranges above allow together (1e7 at 1e-4) took days.
MAX_DRAWS = 200_000_000


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """Options every task has; each task subclasses this with its own defaults and fields.

    Lengths are in the task's own unit (see its docstring). Splits: ``holdout`` of the problem space
    (chosen by a hash of the problem, salted with ``data_seed``) is reserved for validation and as
    much again for test, so training never sees an evaluation problem. With ``train_max_len`` set,
    train/validation/test use lengths <= train_max_len and the ``test_long`` split the longer ones.
    ``train_size`` None samples fresh training problems every step; an integer fixes a pool of that
    many, drawn from ``data_seed`` and visited in a ``seed``-dependent order, epoch after epoch.
    """

    task: ClassVar[str] = ""
    shortest: ClassVar[int] = 1  # the shortest length the format can express

    min_len: int = 1
    max_len: int = 1
    train_max_len: int | None = None
    train_size: int | None = None
    validation_size: int = 2000
    test_size: int = 20000
    holdout: float = 0.05
    data_seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, f"{self.task}.")
        t = self.task
        require(self.min_len >= self.shortest, f"{t}.min_len must be >= {self.shortest}, got {self.min_len}")
        require(self.max_len >= self.min_len,
                f"{t}.max_len ({self.max_len}) must be >= min_len ({self.min_len})")
        require(self.max_len <= MAX_LEN, f"{t}.max_len must be <= {MAX_LEN} (one problem is one sequence, and "
                                         f"splits are drawn tens of thousands at a time), got {self.max_len}")
        require(self.train_max_len is None or self.min_len <= self.train_max_len < self.max_len,
                f"{t}.train_max_len must lie in [min_len, max_len) = [{self.min_len}, {self.max_len}), "
                f"got {self.train_max_len}")
        for name in ("train_size", "validation_size", "test_size"):
            value = getattr(self, name)
            require(value is None or 1 <= value <= MAX_SIZE,
                    f"{t}.{name} must lie in [1, {MAX_SIZE:,}] (splits are drawn and held in memory whole), "
                    f"got {value}")
        low, high = HOLDOUT_RANGE
        require(low <= self.holdout <= high, f"{t}.holdout must lie in [{low}, {high}], got {self.holdout}")
        for name in ("validation_size", "test_size"):
            draws = getattr(self, name) / self.holdout
            require(draws <= MAX_DRAWS, f"{t}.{name} / holdout = {draws:.3g} draws to fill the split, past "
                    f"{MAX_DRAWS:.0e} (minutes of drawing); raise holdout or lower {name}")
        require(0 <= self.data_seed < 2**64, f"{t}.data_seed must lie in [0, 2^64), got {self.data_seed}")


def parse_options(cls: type[TaskOptions], options: dict[str, Any]) -> TaskOptions:
    return cls(**known_fields(options, cls, f"task '{cls.task}' options", f"option for task '{cls.task}'"))


class Task(abc.ABC):
    """One synthetic task. Subclasses set the class attributes and implement the abstract methods."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for `poslab tasks list`
    Options: ClassVar[type[TaskOptions]]
    end_token: ClassVar[bool] = True  # whether the answer ends with <eos> (so greedy decoding can stop)

    def __init__(self, options: TaskOptions) -> None:
        self.options = options

    @abc.abstractmethod
    def alphabet(self) -> str:
        """Every character a problem or answer can contain."""

    def lengths(self) -> np.ndarray:
        """The lengths in [min_len, max_len] that problems can have (some formats skip some)."""
        return np.arange(self.options.min_len, self.options.max_len + 1)

    @abc.abstractmethod
    def max_chars(self, max_len: int) -> int:
        """The longest prompt plus answer, in characters, of the problems of length at most ``max_len``."""

    @abc.abstractmethod
    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> tuple[Ragged, Ragged]:
        """One problem per entry of lengths (batch,) -> (prompt, answer) as ASCII ``Ragged``."""
