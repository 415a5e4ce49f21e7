"""Reading a prepared directory: token ids and per-token structure labels at arbitrary stream positions.

A split is one token stream (its shards concatenated); positions are global indices into it. Shards are
memory-mapped on first use and kept in a small LRU cache, so memory stays flat and open file handles
stay bounded however many shards a corpus has.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from poslab.data.preparation import MANIFEST_VERSION, SENTENCE_COLUMNS
from poslab.data.tokenizer import load_hf_tokenizer
from poslab.errors import DataError, unknown_key_message

# Per-token structure labels derived from a sentence-table row; special tokens and padding get -1.
STRUCTURE_KEYS = ("doc_id", "paragraph_index", "sentence_index", "sentence_in_paragraph",
                  "pos_in_sentence", "pos_in_paragraph", "pos_in_document")
_COL = {name: i for i, name in enumerate(SENTENCE_COLUMNS)}


class Split:
    """One split's token stream (its shards end to end); ``offsets[i]`` is where shard i starts in it."""

    def __init__(self, directory: Path, info: dict) -> None:
        self.directory = directory
        self.names = [s["name"] for s in info["shards"]]
        self.offsets = np.cumsum([0] + [s["tokens"] for s in info["shards"]]).astype(np.int64)
        self.n_tokens = int(self.offsets[-1])
        self.n_documents = int(info["documents"])

    @functools.lru_cache(maxsize=128)
    def _shard(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stem = self.directory / self.names[i]
        try:
            return tuple(np.load(f"{stem}.{part}.npy", mmap_mode="r") for part in ("tokens", "rows", "sentences"))
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read shard {stem}: {err}; prepare the data again") from None

    @functools.cached_property
    def documents(self) -> np.ndarray:
        """(d, 2) int64: global start and length (without [SEP]) of every document, in stream order.
        Loaded on first use: only one-document-per-sequence reading needs it."""
        parts = []
        for i, name in enumerate(self.names):
            path = self.directory / f"{name}.documents.npy"
            try:
                table = np.load(path)
            except (OSError, ValueError) as err:  # as _shard's: a truncated or missing file
                raise DataError(f"cannot read {path}: {err}; prepare the data again") from None
            parts.append(np.stack([table[:, 1] + self.offsets[i], table[:, 2]], axis=1))
        return np.concatenate(parts)

    def _by_shard(self, positions: np.ndarray):
        """Yield (shard index, selection mask, shard-local positions) for positions (any shape, int64)."""
        shard = np.searchsorted(self.offsets, positions, side="right") - 1
        for s in np.unique(shard):
            sel = shard == s
            yield int(s), sel, positions[sel] - self.offsets[s]

    def tokens(self, positions: np.ndarray) -> np.ndarray:
        """Token ids (same shape, int64) at valid global positions."""
        out = np.empty(positions.shape, dtype=np.int64)
        for s, sel, local in self._by_shard(positions):
            out[sel] = self._shard(s)[0][local]
        return out

    def structure(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """STRUCTURE_KEYS -> int64 arrays shaped like ``positions``; -1 at document separators."""
        out = {k: np.full(positions.shape, -1, dtype=np.int64) for k in STRUCTURE_KEYS}
        for s, sel, local in self._by_shard(positions):
            _, rows, sentences = self._shard(s)
            r = rows[local]
            real = r >= 0
            table = sentences[r[real]]
            local = local[real]
            where = np.flatnonzero(sel.ravel())[real]
            for key in ("doc_id", "paragraph_index", "sentence_index", "sentence_in_paragraph"):
                out[key].ravel()[where] = table[:, _COL[key]]
            out["pos_in_sentence"].ravel()[where] = local - table[:, _COL["sentence_start"]]
            out["pos_in_paragraph"].ravel()[where] = local - table[:, _COL["paragraph_start"]]
            out["pos_in_document"].ravel()[where] = local - table[:, _COL["document_start"]]
        return out


class PreparedCorpus:
    """A prepared directory: manifest, tokenizer, splits."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        try:
            self.manifest = json.loads((self.directory / "manifest.json").read_text())
        except FileNotFoundError:
            raise DataError(f"{self.directory} is not a prepared data directory (no manifest.json); "
                            "run 'poslab data prepare'") from None
        except json.JSONDecodeError as err:
            raise DataError(f"{self.directory}/manifest.json is corrupt ({err.msg}); prepare the data again") from None
        if self.manifest.get("version") != MANIFEST_VERSION:
            raise DataError(f"{self.directory} was prepared by another poslab version (manifest version "
                            f"{self.manifest.get('version')}, need {MANIFEST_VERSION}); prepare it again")
        try:
            self.special_ids = self.manifest["tokenizer"]["special_ids"]
            self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
            self.splits = {name: Split(self.directory / name, info) for name, info in self.manifest["splits"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise DataError(f"{self.directory}/manifest.json is corrupt ({type(err).__name__}: {err}); prepare the "
                            "data again") from None

    @functools.cached_property
    def tokenizer(self):
        """The transformers PreTrainedTokenizerFast saved with the data."""
        directory = self.manifest["tokenizer"].get("directory")
        if not isinstance(directory, str):
            raise DataError(f"{self.directory}/manifest.json is corrupt (no tokenizer directory); prepare the data "
                            "again")
        return load_hf_tokenizer(self.directory / directory)

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise DataError(unknown_key_message(f"split of {self.directory}", name, self.splits)
                            + ("; set validation_documents > 0 when preparing" if name == "validation" else ""))
        return self.splits[name]
