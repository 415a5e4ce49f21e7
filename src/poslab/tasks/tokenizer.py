"""A character tokenizer: one id per special token, then one per character.

Ids: ``<pad>`` = 0 (so zero-filled arrays are padding), ``<bos>`` = 1, ``<eos>`` = 2, then the
characters in the order given. Characters are printable ASCII, which lets a 256-entry table turn a
whole batch of byte strings into ids in one indexing operation (``ids_of_codes``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from poslab.errors import ConfigError, DataError
from poslab.files import atomic_write_text

SPECIALS = ("<pad>", "<bos>", "<eos>")
FORMAT = "poslab.CharTokenizer"


class CharTokenizer:
    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ConfigError(f"tokenizer characters must be distinct, got {chars!r}")
        bad = [c for c in chars if not (c.isascii() and c.isprintable())]
        if bad:
            raise ConfigError(f"tokenizer characters must be printable ASCII, got {''.join(bad)!r}")
        self.chars = chars
        self.tokens = list(SPECIALS) + list(chars)
        self.pad_id, self.bos_id, self.eos_id = range(len(SPECIALS))
        self._ids = {c: i for i, c in enumerate(self.tokens)}
        self._lut = np.full(256, -1, dtype=np.int64)
        self._lut[0] = self.pad_id
        for c in chars:
            self._lut[ord(c)] = self._ids[c]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Characters only; specials are not parsed out of text (add bos_id/eos_id yourself)."""
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise DataError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary {self.chars!r}") from None

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.tokens):
                raise DataError(f"token id {i} is out of range for vocabulary size {self.vocab_size}")
            if i >= len(SPECIALS) or not skip_special:
                out.append(self.tokens[i])
        return "".join(out)

    def ids_of_codes(self, codes: np.ndarray) -> np.ndarray:
        """ASCII codes (any shape, 0 = padding) -> token ids int64 of the same shape."""
        ids = self._lut[codes]
        if (ids < 0).any():
            missing = sorted({chr(c) for c in np.unique(codes[ids < 0])})
            raise DataError(f"characters {''.join(missing)!r} are not in the tokenizer's vocabulary {self.chars!r}")
        return ids

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temporary file in the same directory, then rename)."""
        payload = json.dumps({"format": FORMAT, "specials": list(SPECIALS), "chars": self.chars}, indent=1)
        atomic_write_text(path, payload + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise DataError(f"tokenizer file {path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"tokenizer file {path} is not readable JSON: {err}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("chars"), str):
            raise DataError(f"{path} is not a {FORMAT} file (expected keys 'format' and 'chars')")
        if data.get("specials") != list(SPECIALS):
            raise DataError(f"{path} has specials {data.get('specials')}, this version uses {list(SPECIALS)}")
        try:
            return cls(data["chars"])
        except ConfigError as err:
            raise DataError(f"{path}: {err}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.tokens == self.tokens

    def __repr__(self) -> str:
        return f"CharTokenizer(chars={self.chars!r})"
