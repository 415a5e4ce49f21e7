"""Indirect indexing (PoPE paper, appendix): ``NZTUIGWkXFrhCJDzscat, N, +4, I``.

A string of distinct characters drawn without replacement from the alphabet, a source character of
the string, a signed shift, and the target: the character ``shift`` places from the source. The shift
is drawn uniformly from [min_shift, max_shift] and the source uniformly among the positions from
which the target stays inside the string (so the shift's distribution is exactly uniform; min_len
must exceed the largest |shift| so that every shift fits every string). Shifts print with a sign:
``+0``, ``+4``, ``-12``.

Prompt ``STRING, S, +K, `` (note the trailing space), answer: the target character alone, with no
end token -- loss and accuracy are taken on the target only. Length = the string's length (paper:
20-40 over [A-Za-z], shifts in [-15, 15]). ``alphabet_size`` k keeps the first k characters of the
alphabet, for quick scales.
"""
from __future__ import annotations

import dataclasses
import string

import numpy as np

from poslab.errors import require
from poslab.tasks.base import Ragged, Task, TaskOptions, concat, number, text

FORMAT_CHARS = ", +-0123456789"


@dataclasses.dataclass(frozen=True)
class IndirectIndexingOptions(TaskOptions):
    task = "indirect_indexing"
    shortest = 2

    min_len: int = 20
    max_len: int = 40
    alphabet: str = string.ascii_uppercase + string.ascii_lowercase
    alphabet_size: int | None = None
    min_shift: int = -15
    max_shift: int = 15
    train_size: int | None = 1_000_000
    validation_size: int = 10_000
    test_size: int = 10_000

    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.task
        require(len(set(self.alphabet)) == len(self.alphabet), f"{t}.alphabet has repeated characters")
        bad = sorted(set(self.alphabet) & set(FORMAT_CHARS) | {c for c in self.alphabet if not c.isprintable()
                                                                or not c.isascii() or c.isspace()})
        require(not bad, f"{t}.alphabet may not contain {''.join(bad)!r}: use printable ASCII letters or symbols "
                         f"other than {FORMAT_CHARS!r}")
        require(self.alphabet_size is None or 2 <= self.alphabet_size <= len(self.alphabet),
                f"{t}.alphabet_size must lie in [2, {len(self.alphabet)}] (the alphabet's length), "
                f"got {self.alphabet_size}")
        require(self.max_len <= len(self.letters),
                f"{t}.max_len ({self.max_len}) exceeds the alphabet size ({len(self.letters)}): strings have "
                "distinct characters, so lower max_len or enlarge the alphabet")
        require(self.min_shift <= self.max_shift,
                f"{t}.min_shift ({self.min_shift}) must be <= max_shift ({self.max_shift})")
        widest = max(abs(self.min_shift), abs(self.max_shift))
        require(self.min_len > widest,
                f"{t}.min_len ({self.min_len}) must exceed the largest |shift| ({widest}) so that every shift "
                "fits in every string")

    @property
    def letters(self) -> str:
        return self.alphabet[: self.alphabet_size] if self.alphabet_size is not None else self.alphabet


class IndirectIndexing(Task):
    name = "indirect_indexing"
    summary = "'NZTUIGWkXFrhCJDzscat, N, +4, I': the character <shift> places from the source character"
    Options = IndirectIndexingOptions
    end_token = False

    def alphabet(self) -> str:
        return self.options.letters + FORMAT_CHARS

    def max_chars(self, max_len: int) -> int:
        o = self.options
        shift = 1 + len(str(max(abs(o.min_shift), abs(o.max_shift))))
        return max_len + 2 + 1 + 2 + shift + 2 + 1

    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> tuple[Ragged, Ragged]:
        o, batch = self.options, len(lengths)
        letters = np.frombuffer(o.letters.encode("ascii"), dtype=np.uint8)
        # The first L columns of a random permutation are L distinct letters.
        order = np.argsort(rng.random((batch, len(letters))), axis=1)[:, : int(lengths.max())]
        chars = letters[order]
        shift = rng.integers(o.min_shift, o.max_shift + 1, size=batch)
        source = rng.integers(np.maximum(0, -shift), lengths - np.maximum(0, shift))
        rows = np.arange(batch)
        sign = np.where(shift < 0, ord("-"), ord("+")).astype(np.uint8)[:, None]
        prompt = concat(
            Ragged(chars, lengths), text(", ", batch),
            Ragged(chars[rows, source][:, None], np.ones(batch, dtype=np.int64)), text(", ", batch),
            Ragged(sign, np.ones(batch, dtype=np.int64)), number(np.abs(shift)), text(", ", batch),
        )
        return prompt, Ragged(chars[rows, source + shift][:, None], np.ones(batch, dtype=np.int64))
