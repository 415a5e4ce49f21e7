"""Preparation: documents -> tokens with structure labels -> memory-mapped shards + a JSON manifest.

Layout of a prepared directory::

    manifest.json                  what was prepared, from what, with counts (MANIFEST_VERSION)
    tokenizer/                     a transformers tokenizer directory (AutoTokenizer-loadable)
    <split>/<i>.tokens.npy         (n,) token ids of the split's stream: doc tokens then [SEP], per document
    <split>/<i>.rows.npy           (n,) int32 row of each token in <i>.sentences.npy, -1 for [SEP]
    <split>/<i>.sentences.npy      (s, 7) int64, columns SENTENCE_COLUMNS, starts are shard-local token indices
    <split>/<i>.documents.npy      (d, 3) int64 (doc_id, start, length without the [SEP])

Storing a sentence row per token (4 bytes) instead of six label arrays keeps shards small (about 7 bytes
per token in all with uint16 ids); every per-token label is recomputed from the row and the token index
when a batch is read. Documents never straddle shards. Splits: the first ``validation_documents``
documents form ``validation``, the rest ``train``.

Memory stays flat: documents stream from the source in batches of ``batch_documents``, a shard is held
in memory until ``shard_tokens`` tokens are reached and then written, so peak memory is about one shard
whatever the corpus size. Everything is written into a temporary sibling directory renamed into place at
the end; on any error the temporary directory is removed.
"""
from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from poslab.data.config import DataConfig
from poslab.data.sources import Document, document_text, open_source
from poslab.data.tokenizer import load_tokenizer, save_tokenizer, special_ids, train_tokenizer
from poslab.errors import DataError

MANIFEST_VERSION = 1
SENTENCE_COLUMNS = ("doc_id", "paragraph_index", "sentence_index", "sentence_in_paragraph",
                    "sentence_start", "paragraph_start", "document_start")


class ShardWriter:
    """Accumulates one split's documents and writes a shard whenever ``shard_tokens`` is reached."""

    def __init__(self, directory: Path, shard_tokens: int, token_dtype: np.dtype) -> None:
        self.directory, self.shard_tokens, self.token_dtype = directory, shard_tokens, token_dtype
        directory.mkdir(parents=True)
        self.shards: list[dict[str, int]] = []
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.sentences: list[np.ndarray] = []
        self.documents: list[tuple[int, int, int]] = []
        self.n_tokens = self.n_sentences = 0

    def add(self, doc_id: int, ids: np.ndarray, sentence_of_token: np.ndarray, paragraph_of_sentence: np.ndarray,
            sep_id: int) -> None:
        """One document: ids (t,), sentence_of_token (t,) nondecreasing, paragraph_of_sentence (s,)."""
        n_sent = len(paragraph_of_sentence)
        sentence_start = np.searchsorted(sentence_of_token, np.arange(n_sent))
        first_of_paragraph = np.searchsorted(paragraph_of_sentence, np.arange(paragraph_of_sentence[-1] + 1))
        table = np.empty((n_sent, len(SENTENCE_COLUMNS)), dtype=np.int64)
        table[:, 0] = doc_id
        table[:, 1] = paragraph_of_sentence
        table[:, 2] = np.arange(n_sent)
        table[:, 3] = np.arange(n_sent) - first_of_paragraph[paragraph_of_sentence]
        table[:, 4] = sentence_start + self.n_tokens
        table[:, 5] = sentence_start[first_of_paragraph][paragraph_of_sentence] + self.n_tokens
        table[:, 6] = self.n_tokens
        self.tokens += [ids.astype(self.token_dtype), np.array([sep_id], dtype=self.token_dtype)]
        self.rows += [(sentence_of_token + self.n_sentences).astype(np.int32), np.array([-1], dtype=np.int32)]
        self.sentences.append(table)
        self.documents.append((doc_id, self.n_tokens, len(ids)))
        self.n_tokens += len(ids) + 1
        self.n_sentences += n_sent
        if self.n_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.n_tokens:
            return
        stem = self.directory / f"{len(self.shards):05d}"
        np.save(f"{stem}.tokens.npy", np.concatenate(self.tokens))
        np.save(f"{stem}.rows.npy", np.concatenate(self.rows))
        np.save(f"{stem}.sentences.npy", np.concatenate(self.sentences))
        np.save(f"{stem}.documents.npy", np.array(self.documents, dtype=np.int64).reshape(-1, 3))
        self.shards.append({"name": stem.name, "tokens": self.n_tokens, "sentences": self.n_sentences,
                            "documents": len(self.documents)})
        self._reset()

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {"shards": self.shards, **{k: sum(s[k] for s in self.shards) for k in ("tokens", "sentences", "documents")}}


def label_encoding(offsets: list[tuple[int, int]], sentence_ends: list[int]) -> np.ndarray:
    """Sentence index (t,) of each token: the first sentence whose end lies after the token's start, so
    whitespace between sentences (and a token that carries it, as byte-level BPE does) belongs to the next."""
    starts = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))[0::2]
    index = np.searchsorted(np.asarray(sentence_ends), starts, side="right")
    return np.minimum(index, len(sentence_ends) - 1)


def _batches(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    while batch := list(itertools.islice(docs, size)):
        yield batch


def _write(config: DataConfig, root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    source = open_source(config.source)
    tcfg = config.tokenizer
    if tcfg.path is not None:
        tok, origin = load_tokenizer(tcfg.path), f"at {tcfg.path}"
    else:
        log(f"training a {tcfg.vocab_size}-token {tcfg.type} tokenizer on up to {tcfg.train_documents} documents")
        texts = (document_text(d)[0] for d in itertools.islice(source.documents(), tcfg.train_documents))
        tok, origin = train_tokenizer(tcfg, texts), f"trained ({tcfg.type})"
    ids = special_ids(tok, tcfg, origin)
    hf = save_tokenizer(tok, ids, tcfg, root / "tokenizer")
    vocab_size = len(hf)
    token_dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)

    writers = {"train": ShardWriter(root / "train", config.shard_tokens, token_dtype)}
    if config.validation_documents:
        writers["validation"] = ShardWriter(root / "validation", config.shard_tokens, token_dtype)
    start, n_docs, n_tokens = time.perf_counter(), 0, 0
    for batch in _batches(source.documents(), config.batch_documents):
        prepared = [document_text(d) for d in batch]
        encodings = tok.encode_batch([text for text, _, _ in prepared], add_special_tokens=False)
        for (_, ends, paragraphs), enc in zip(prepared, encodings):
            doc_id, n_docs = n_docs, n_docs + 1
            if not enc.ids:
                continue
            split = "validation" if doc_id < config.validation_documents else "train"
            writers[split].add(doc_id, np.asarray(enc.ids), label_encoding(enc.offsets, ends),
                               np.asarray(paragraphs), ids.sep)
            n_tokens += len(enc.ids) + 1
    seconds = time.perf_counter() - start
    splits = {name: w.summary() for name, w in writers.items()}
    if n_docs == 0 or n_tokens == 0:
        raise DataError("the corpus is empty: the source yielded no document with text")
    if splits["train"]["tokens"] == 0:
        raise DataError(f"no training documents: the corpus has {n_docs} documents and validation_documents takes "
                        f"{config.validation_documents}; lower validation_documents")
    manifest = {
        "version": MANIFEST_VERSION,
        "config": config.prepare_dict(),
        "tokenizer": {"directory": "tokenizer", "vocab_size": vocab_size, "special_ids": ids.__dict__,
                      "origin": origin},
        "token_dtype": token_dtype.name,
        "sentence_columns": list(SENTENCE_COLUMNS),
        "splits": splits,
        "documents_read": n_docs,
        "invalid_utf8_replaced": source.invalid_utf8,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(n_tokens / max(seconds, 1e-9), 1),
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def prepare(config: DataConfig, out: str | Path, *, force: bool = False,
            log: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Prepare ``config``'s source into ``out`` atomically; returns the manifest.

    An existing ``out`` is an error unless ``force``, in which case it is replaced only after the new
    directory is complete.
    """
    if config.source is None:
        raise DataError("nothing to prepare: the data config names 'prepared' instead of a 'source'")
    out = Path(out)
    if out.exists() and not force:
        raise DataError(f"{out} already exists; choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        manifest = _write(config, tmp, log)
        if out.exists():
            old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def default_cache_dir() -> Path:
    return Path(os.environ.get("POSLAB_CACHE", Path.home() / ".cache" / "poslab")) / "data"


def ensure_prepared(config: DataConfig, log: Callable[[str], None] = lambda message: None) -> Path:
    """The prepared directory for ``config``: ``prepared`` itself, or a cache entry keyed by the content
    hash of the preparation settings, prepared now if missing (concurrent preparers: the first rename
    wins, the others discard their copy)."""
    if config.prepared is not None:
        path = Path(config.prepared)
        if not (path / "manifest.json").is_file():
            raise DataError(f"{path} is not a prepared data directory (no manifest.json); run 'poslab data prepare'")
        return path
    path = Path(config.cache_dir or default_cache_dir()) / config.prepare_key()
    if not (path / "manifest.json").is_file():
        log(f"preparing data into cache {path}")
        try:
            prepare(config, path, log=log)
        except (DataError, OSError):  # another process may have renamed its copy into place first
            if not (path / "manifest.json").is_file():
                raise
    return path
