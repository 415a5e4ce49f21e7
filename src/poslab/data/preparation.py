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
documents form ``validation``, the rest ``train``. An evaluation-only preparation (``evaluation_only``:
a corpus that only measures a model trained on another, such as PG-19 for length extrapolation) reads
just the first ``validation_documents`` documents and has no ``train`` split; its manifest says so and
its cache key differs from the ordinary preparation's of the same config.

Memory stays flat: documents stream from the source in batches of ``batch_documents``, a shard is held
in memory until ``shard_tokens`` tokens are reached and then written, so peak memory is about one shard
whatever the corpus size. Everything is written into a temporary sibling directory renamed into place at
the end; on any error the temporary directory is removed.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Encoding

from poslab.data.config import DataConfig
from poslab.data.sources import Document, document_text, open_source
from poslab.data.synthetic import GRAMMAR_VERSION
from poslab.data.tokenizer import TRAINING_VERSION, load_tokenizer, save_tokenizer, special_ids, train_tokenizer
from poslab.errors import DataError
from poslab.files import make_dirs, release_lock, remove_made_dirs, take_lock

MANIFEST_VERSION = 1
# Bump when the same text and tokenizer give other tokens or labels (the sentence segmenter's rules included; 2:
# special-token strings in the text are text, sentences without tokens are not counted): caches are keyed by it.
ENCODING_VERSION = 2
SENTENCE_COLUMNS = ("doc_id", "paragraph_index", "sentence_index", "sentence_in_paragraph",
                    "sentence_start", "paragraph_start", "document_start")


@dataclass
class EncodedDocuments:
    """A batch of tokenised documents, concatenated. T tokens, S sentences, D documents.

    ids (T,), sentence_of_token (T,) and paragraph_of_sentence (S,) index sentences / paragraphs across the
    whole batch (nondecreasing), doc_of_sentence (S,) and lengths (D,) tie them to documents, doc_ids (D,).
    """

    doc_ids: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray
    sentence_of_token: np.ndarray
    paragraph_of_sentence: np.ndarray
    doc_of_sentence: np.ndarray


def _sentence_starts(enc: Encoding, ends: list[int], base: int) -> list[int]:
    """``base`` plus the index of each sentence's first token: the token holding the first character of
    the sentence's span [ends[k - 1], ends[k]) that any token holds (the first sentence: 0; none: len(enc))."""
    char_to_token, length = enc.char_to_token, len(enc)
    starts = [base]
    for begin, end in zip(ends, ends[1:]):
        token, char = None, begin
        while token is None and char < end:  # usually two tries: one separator character holds no token
            token, char = char_to_token(char), char + 1
        starts.append(base + (length if token is None else token))
    return starts


def label_documents(laid: list[tuple[str, list[int], list[int]]], encodings: list[Encoding],
                    first_id: int) -> EncodedDocuments:
    """Give each token of the tokenised documents (ids first_id, first_id + 1, ...) its sentence.

    ``laid``: ``document_text`` of each document; ``encodings``: the tokenizer's output for those texts.
    Sentence k starts at the token holding the first character after sentence k-1 that a token holds, as
    the tokenizer's character alignment (``char_to_token``) says: so the whitespace between sentences,
    when a token carries it (byte-level BPE's "Ġ", newlines), belongs to the next sentence, and characters
    the normaliser drops are skipped. One alignment query per sentence rather than an offset pair per
    token keeps labelling a small fraction of tokenisation time. Documents without tokens are dropped
    (their ids stay unused), and so are sentences without tokens (all their characters normalised away: zero-width
    spaces), and paragraphs left without a sentence: the structure labels count the sentences a model sees.
    """
    keep = [i for i, e in enumerate(encodings) if len(e)]
    encodings, laid = [encodings[i] for i in keep], [laid[i] for i in keep]
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(keep))
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=int(lengths.sum()))
    bases = itertools.accumulate(lengths.tolist(), initial=0)
    sentence_ends = (ends for _, ends, _ in laid)
    starts = list(itertools.chain.from_iterable(map(_sentence_starts, encodings, sentence_ends, bases)))
    # A sentence without tokens starts where the next one does (reverse running minimum), so that each
    # token belongs to the last sentence starting at or before it: sentence k has starts[k + 1] - starts[k] tokens.
    starts = np.minimum.accumulate(np.asarray(starts, dtype=np.int64)[::-1])[::-1]
    counts = np.diff(starts, append=len(ids))
    sentences = np.fromiter((len(ends) for _, ends, _ in laid), dtype=np.int64, count=len(keep))
    doc_of_sentence = np.repeat(np.arange(len(keep)), sentences)
    paragraph_base = np.cumsum([0] + [p[-1] + 1 for _, _, p in laid])[:-1]
    paragraph_of_sentence = np.fromiter(itertools.chain.from_iterable(p for _, _, p in laid), dtype=np.int64,
                                        count=len(starts)) + paragraph_base[doc_of_sentence]
    seen = counts > 0
    sentence_of_token = np.repeat(np.arange(int(seen.sum())), counts[seen])
    paragraphs = np.unique(paragraph_of_sentence[seen], return_inverse=True)[1].astype(np.int64)  # renumbered
    return EncodedDocuments(np.asarray(keep, dtype=np.int64) + first_id, lengths, ids, sentence_of_token,
                            paragraphs, doc_of_sentence[seen])


class ShardWriter:
    """Accumulates one split's documents and writes a shard once ``shard_tokens`` is reached (so a shard
    holds at most ``shard_tokens`` plus one batch of documents)."""

    def __init__(self, directory: Path, shard_tokens: int, token_dtype: np.dtype, sep_id: int) -> None:
        self.directory, self.shard_tokens, self.token_dtype, self.sep_id = directory, shard_tokens, token_dtype, sep_id
        directory.mkdir(parents=True)
        self.shards: list[dict[str, int]] = []
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.sentences: list[np.ndarray] = []
        self.documents: list[np.ndarray] = []
        self.n_tokens = self.n_sentences = self.n_documents = 0

    def add(self, batch: EncodedDocuments) -> None:
        """Append a batch: each document's tokens then [SEP], its sentence table rows, its document row."""
        n_docs, n_sent = len(batch.lengths), len(batch.paragraph_of_sentence)
        if not n_docs:
            return
        token_doc = np.repeat(np.arange(n_docs), batch.lengths)
        position = np.arange(len(batch.ids)) + token_doc  # in the batch's stream: one [SEP] per earlier document
        doc_start = np.cumsum(batch.lengths + 1) - batch.lengths - 1
        stream = np.full(len(batch.ids) + n_docs, self.sep_id, dtype=self.token_dtype)
        stream[position] = batch.ids
        rows = np.full(len(stream), -1, dtype=np.int32)
        rows[position] = batch.sentence_of_token + self.n_sentences
        first_token = np.searchsorted(batch.sentence_of_token, np.arange(n_sent))  # every sentence has tokens
        sentence_start = position[first_token]
        sentence = np.arange(n_sent)
        first_of_paragraph = np.searchsorted(batch.paragraph_of_sentence, batch.paragraph_of_sentence)
        first_of_doc = np.searchsorted(batch.doc_of_sentence, batch.doc_of_sentence)
        table = np.stack([batch.doc_ids[batch.doc_of_sentence],
                          batch.paragraph_of_sentence - batch.paragraph_of_sentence[first_of_doc],
                          sentence - first_of_doc,
                          sentence - first_of_paragraph,
                          sentence_start + self.n_tokens,
                          sentence_start[first_of_paragraph] + self.n_tokens,
                          doc_start[batch.doc_of_sentence] + self.n_tokens], axis=1)
        self.tokens.append(stream)
        self.rows.append(rows)
        self.sentences.append(table)
        self.documents.append(np.stack([batch.doc_ids, doc_start + self.n_tokens, batch.lengths], axis=1))
        self.n_tokens += len(stream)
        self.n_sentences += n_sent
        self.n_documents += n_docs
        if self.n_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.n_tokens:
            return
        stem = self.directory / f"{len(self.shards):05d}"
        for part, pieces in (("tokens", self.tokens), ("rows", self.rows), ("sentences", self.sentences),
                             ("documents", self.documents)):
            _save_array(f"{stem}.{part}.npy", np.concatenate(pieces))
        self.shards.append({"name": stem.name, "tokens": self.n_tokens, "sentences": self.n_sentences,
                            "documents": self.n_documents})
        self._reset()

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {"shards": self.shards, **{k: sum(s[k] for s in self.shards) for k in ("tokens", "sentences", "documents")}}


def _batches(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    while batch := list(itertools.islice(docs, size)):
        yield batch


EMPTY_CORPUS = "the corpus is empty: the source yielded no document with text"


def _trained_tokenizer(config: DataConfig, source: Any, log: Callable[[str], None]):
    """A tokenizer trained on up to ``train_documents`` documents after the validation split: a vocabulary
    learned on the validation documents would have seen the text the models are evaluated on."""
    tcfg, skip = config.tokenizer, config.validation_documents
    seen = 0

    def texts() -> Iterator[str]:
        nonlocal seen
        for document in itertools.islice(source.documents(), skip + tcfg.train_documents):
            seen += 1
            if seen == 1:  # said once the source is read: a corpus that cannot be reached fails in one line
                log(f"training a {tcfg.vocab_size}-token {tcfg.type} tokenizer on up to {tcfg.train_documents} "
                    f"documents after the {skip} validation documents")
            if seen > skip:
                yield document_text(document)[0]

    tok = train_tokenizer(tcfg, texts())
    if not seen:
        raise DataError(EMPTY_CORPUS)
    if seen <= skip:
        raise DataError(f"no documents to train the tokenizer on: validation_documents takes {skip} and the corpus "
                        "has no more; lower validation_documents or name a trained tokenizer in tokenizer.path")
    return tok


def _write(config: DataConfig, root: Path, log: Callable[[str], None],
           evaluation_only: bool = False) -> dict[str, Any]:
    if evaluation_only and not config.validation_documents:
        raise DataError("an evaluation-only corpus is its validation split: set validation_documents > 0 "
                        "(how many documents to evaluate on)")
    source = open_source(config.source)
    tcfg = config.tokenizer
    if tcfg.path is not None:
        tok, origin = load_tokenizer(tcfg.path), f"at {tcfg.path}"
    else:
        tok, origin = _trained_tokenizer(config, source, log), f"trained ({tcfg.type})"
    ids = special_ids(tok, tcfg, origin)
    hf = save_tokenizer(tok, ids, tcfg, root / "tokenizer")
    vocab_size = len(hf)
    # "[SEP]" or "[MASK]" written in a document is text, not the special token (a separator mid-document, a
    # [MASK] the masking never chose); the saved tokenizer keeps the library's default for its users.
    tok.encode_special_tokens = True
    token_dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)

    writers = {}
    if not evaluation_only:
        writers["train"] = ShardWriter(root / "train", config.shard_tokens, token_dtype, ids.sep)
    if config.validation_documents:
        writers["validation"] = ShardWriter(root / "validation", config.shard_tokens, token_dtype, ids.sep)
    documents = source.documents()
    if evaluation_only:  # nothing past the validation documents is read (a streamed corpus may be huge)
        documents = itertools.islice(documents, config.validation_documents)
    start, n_docs, pending = time.perf_counter(), 0, []
    # Tokenisation runs in Rust with the GIL released: a worker thread encodes one batch while this thread
    # labels and writes the previous one and reads and segments the next.
    with ThreadPoolExecutor(max_workers=1) as pool:
        for batch in _batches(documents, config.batch_documents):
            cut = min(len(batch), max(0, config.validation_documents - n_docs))  # the first K documents validate
            submitted = []
            for split, part, first in (("validation", batch[:cut], n_docs), ("train", batch[cut:], n_docs + cut)):
                if part:
                    laid = [document_text(d) for d in part]
                    job = pool.submit(tok.encode_batch, [text for text, _, _ in laid], add_special_tokens=False)
                    submitted.append((split, laid, first, job))
            for split, laid, first, job in pending:
                writers[split].add(label_documents(laid, job.result(), first))
            pending, n_docs = submitted, n_docs + len(batch)
        for split, laid, first, job in pending:
            writers[split].add(label_documents(laid, job.result(), first))
    seconds = time.perf_counter() - start
    splits = {name: w.summary() for name, w in writers.items()}
    if sum(split["tokens"] for split in splits.values()) == 0:
        raise DataError(EMPTY_CORPUS)
    if not evaluation_only and splits["train"]["tokens"] == 0:
        raise DataError(f"no training documents: the corpus has {n_docs} documents and validation_documents takes "
                        f"{config.validation_documents}; lower validation_documents")
    manifest = {
        "version": MANIFEST_VERSION,
        "config": config.prepare_dict(),
        "evaluation_only": evaluation_only,
        "synthetic_grammar": GRAMMAR_VERSION,
        "tokenizer": {"directory": "tokenizer", "vocab_size": vocab_size, "special_ids": ids.__dict__,
                      "origin": origin},
        "token_dtype": token_dtype.name,
        "sentence_columns": list(SENTENCE_COLUMNS),
        "splits": splits,
        "documents_read": n_docs,
        "local_files": _local_files(config),
        "invalid_utf8_replaced": source.invalid_utf8,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(sum(split["tokens"] for split in splits.values()) / max(seconds, 1e-9), 1),
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def prepare(config: DataConfig, out: str | Path, *, force: bool = False,
            log: Callable[[str], None] = lambda message: None, evaluation_only: bool = False) -> dict[str, Any]:
    """Prepare ``config``'s source into ``out`` atomically; returns the manifest.

    An existing ``out`` is an error unless ``force``, in which case it is replaced only after the new
    directory is complete, and only if it is an empty or a prepared directory: ``force`` never deletes
    a file or a directory of other files (a mistyped --out). ``evaluation_only``: only the validation
    split (see the module docstring).
    """
    if config.source is None:
        raise DataError("nothing to prepare: the data config names 'prepared' instead of a 'source'")
    out = Path(out)
    if out.exists() and not force:
        raise DataError(f"{out} already exists; choose another --out or pass --force to replace it")
    if out.exists() and not _replaceable(out):
        what = "a directory of other files" if out.is_dir() else "not a directory"
        raise DataError(f"--force replaces only an empty or a prepared data directory (one with manifest.json), "
                        f"and {out} is {what}; choose another --out")
    made = make_dirs(out.parent)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        manifest = _write(config, tmp, log, evaluation_only)
        if force and out.exists():
            old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:  # the replaced copy comes back: a failed --force loses nothing
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            _rename_new(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made_dirs(made)  # a failed preparation leaves no trace, not even the --out's new parents
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _rename_new(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, which did not exist when preparation began. Should a concurrent preparer
    (every torchrun rank builds its source) have renamed its copy in meanwhile, that first copy stays:
    ranks may already be reading it, and a tokenizer trained in another process can number tokens
    differently, so replacing it would leave ranks reading different data."""
    try:
        tmp.rename(out)  # atomic; fails onto a non-empty directory (POSIX) or any existing path (Windows)
    except OSError:
        if not out.exists():
            raise
        raise DataError(f"{out} appeared while preparing (another process prepared it); kept that one") from None


def _replaceable(out: Path) -> bool:
    """Whether ``out`` (which exists) is an empty directory or a prepared one, which --force may replace."""
    return out.is_dir() and ((out / "manifest.json").is_file() or not any(out.iterdir()))


def default_cache_dir() -> Path:
    return Path(os.environ.get("POSLAB_CACHE", Path.home() / ".cache" / "poslab")) / "data"


def prepare_key(config: DataConfig, evaluation_only: bool = False) -> str:
    """Cache directory name: a hash of the preparation settings and of the versions of the shard format,
    the synthetic grammar and tokenizer training, so that changing any prepares afresh instead of reusing
    stale data. An evaluation-only preparation has its own key (the ordinary keys are unchanged)."""
    content = {"prepare": config.prepare_dict(), "format": MANIFEST_VERSION, "grammar": GRAMMAR_VERSION,
               "tokenizer_training": TRAINING_VERSION, "encoding": ENCODING_VERSION}
    if evaluation_only:
        content["evaluation_only"] = True
    if named := _named_paths(config):  # keys of configs that name no local path are unchanged
        content["paths"] = named
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _named_paths(config: DataConfig) -> list[str]:
    """The local corpus and tokenizer paths the settings name, made absolute: a relative path read from
    another directory is another corpus under the same settings (the default cache is shared by every
    project)."""
    paths = config.source.get("paths") if isinstance(config.source, dict) else None
    named = [paths] if isinstance(paths, str) else list(paths or [])
    if isinstance(config.source, dict) and config.source.get("type") == "hf":  # local files it names, if any
        named += open_source(config.source).local_paths
    if config.tokenizer.path is not None:
        named.append(config.tokenizer.path)
    return [str(Path(path).resolve()) for path in named]


def _local_files(config: DataConfig) -> dict[str, list[int]] | None:
    """{absolute path: [size, mtime_ns]} of the local corpus and tokenizer files preparation reads (a
    tokenizer named by hub id has none); None when the corpus files cannot all be found (moved or deleted
    since). Size and time, not a hash of the contents: a local corpus may be many gigabytes."""
    try:
        files = list(getattr(open_source(config.source), "files", []))
    except DataError:
        return None
    if config.tokenizer.path is not None:
        path = Path(config.tokenizer.path)
        if path.exists():  # else a hub name (bert-base-uncased): the corpus files are still checked
            files += sorted(path.iterdir()) if path.is_dir() else [path]
    stats = {str(f.resolve()): f.stat() for f in files if f.is_file()}
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in stats.items()}


def _check_unchanged(config: DataConfig, path: Path) -> None:
    """Refuse a cache entry whose local files were edited after it was prepared (the settings, and so the
    key, are the same). Files gone since are no objection: the prepared copy is what runs read."""
    recorded = json.loads((path / "manifest.json").read_text()).get("local_files")
    now = _local_files(config) if recorded else None
    if now is not None and now != recorded:
        changed = sorted(set(now).symmetric_difference(recorded) | {f for f in now if now[f] != recorded.get(f)})
        raise DataError(f"{changed[0]} changed (size or modification time) since it was prepared into {path}; "
                        "delete that directory to prepare the corpus again")


def ensure_prepared(config: DataConfig, log: Callable[[str], None] = lambda message: None, *,
                    evaluation_only: bool = False) -> Path:
    """The prepared directory for ``config``: ``prepared`` itself, or a cache entry keyed by the content
    hash of the preparation settings, prepared now if missing (by one process at a time: the others wait
    for its copy) and refused if its local files changed since. ``evaluation_only``: only the validation
    split."""
    if config.prepared is not None:
        path = Path(config.prepared)
        if not path.exists():  # a relative path is read from the current directory, not the run config's
            where = f" (relative to the current directory, {Path.cwd()})" if not path.is_absolute() else ""
            raise DataError(f"data.prepared {path} does not exist{where}; give the --out directory of "
                            "'poslab data prepare'")
        if not (path / "manifest.json").is_file():
            raise DataError(f"{path} is not a prepared data directory (no manifest.json); run 'poslab data prepare'")
        return path
    path = Path(config.cache_dir or default_cache_dir()) / prepare_key(config, evaluation_only)
    if (path / "manifest.json").is_file():
        _check_unchanged(config, path)
        return path
    with _preparing(path, log):
        if (path / "manifest.json").is_file():  # prepared by the process this one waited for
            _check_unchanged(config, path)
            return path
        log(f"preparing data into cache {path}")
        try:
            prepare(config, path, log=log, evaluation_only=evaluation_only)
        except (DataError, OSError):  # a preparer on a file system without flock may have renamed its copy first
            if not (path / "manifest.json").is_file():
                raise
    return path


@contextlib.contextmanager
def _preparing(path: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Held while preparing the cache entry ``path``: every torchrun rank, and every recipe trained side by side,
    builds its data source, and without it each would stream and tokenize the whole corpus only for the first
    copy to be kept. The others wait here, then read that copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}.lock"
    fd = take_lock(lock, waiting=lambda: log(f"waiting for another process preparing {path}"))
    try:
        yield
    finally:
        release_lock(lock, fd)


def _save_array(path: str, array: np.ndarray) -> None:
    try:
        np.save(path, array)
    except OSError as err:
        if err.errno is not None:
            raise
        # numpy's short write says only "N requested and M written", which is what a full disk gives
        raise OSError(errno.ENOSPC, f"writing stopped short ({err}), as on a full disk", path) from None
