"""Where documents come from: local text files and directories, JSONL, Hugging Face datasets, synthetic.

Every source yields documents as paragraphs of sentences (``list[list[str]]``); real text is segmented by
``poslab.data.sentences`` (paragraphs at blank lines, rule-based sentence splitter), the synthetic corpus
knows its boundaries exactly. ``documents()`` starts a fresh pass each call (the tokenizer trainer reads a
prefix, preparation reads everything) and streams: nothing holds more than one document.

Invalid UTF-8 in files is replaced, one U+FFFD per invalid byte, and counted in ``invalid_utf8`` (the
count of the latest pass) so that preparation can report it instead of failing or hiding it. JSON's
``\\u`` escapes can spell an unpaired surrogate, which is no text either: each is replaced and counted too.
"""
from __future__ import annotations

import contextlib
import glob
import itertools
import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from poslab.data.config import from_dict
from poslab.data.sentences import segment
from poslab.data.synthetic import SyntheticCorpus, SyntheticOptions
from poslab.errors import ConfigError, DataError, check_fields, lookup, require

Document = list[list[str]]
_ESCAPED = re.compile("[\udc80-\udcff]")  # invalid bytes, as the 'surrogateescape' decoder leaves them
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs: any left is unpaired


def _limit(value: Any) -> int | None:
    require(value is None or (isinstance(value, int) and value >= 1),
            f"max_documents must be a positive integer or null, got {value!r}")
    return value


def _relative_glob(pattern: str, where: str) -> None:
    """A glob searches inside the directories ``paths`` names: an absolute one (pathlib refuses it with a
    NotImplementedError) or one with '..' (it read files outside them) names files elsewhere."""
    require(pattern != "" and not Path(pattern).is_absolute() and ".." not in Path(pattern).parts,
            f"{where} glob must be a pattern inside the directories of paths, such as '*.txt' or 'sub/**/*.txt', "
            f"got {pattern!r}; name other files in paths")


def _decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 text with invalid bytes replaced by U+FFFD, and how many were replaced."""
    try:
        return raw.decode("utf-8"), 0  # valid text (nearly always): no scan for escaped bytes
    except UnicodeDecodeError:
        return _ESCAPED.subn("\ufffd", raw.decode("utf-8", "surrogateescape"))


def _list_files(paths: Any, pattern: str) -> list[Path]:
    """Files named by ``paths`` (files, or directories searched recursively for ``pattern``), sorted."""
    paths = [paths] if isinstance(paths, str) else paths
    require(isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths),
            f"paths must be a path or a non-empty list of paths, got {paths!r}")
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob(pattern) if f.is_file())
            if not found:
                raise DataError(f"no files matching '{pattern}' under directory {p}")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"no such file or directory: {p}")
    return files


@dataclass
class TextOptions:
    paths: Any = None
    glob: str = "*.txt"
    doc_separator: str | None = None  # a line equal to this (stripped) ends a document; None: one per file
    max_documents: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, "text source ")
        _limit(self.max_documents)
        _relative_glob(self.glob, "text source")


class TextSource:
    """Plain text files. Paragraphs at blank lines; documents are whole files or end at ``doc_separator``."""

    Options = TextOptions

    def __init__(self, **options: Any) -> None:
        self.opts: TextOptions = from_dict(TextOptions, options, "text source")
        self.files = _list_files(self.opts.paths, self.opts.glob)
        self.invalid_utf8 = 0

    def _texts(self) -> Iterator[str]:
        sep = self.opts.doc_separator
        for path in self.files:
            lines: list[str] = []
            with open(path, "rb") as f:
                for raw in f:
                    line, bad = _decode(raw)
                    self.invalid_utf8 += bad
                    if sep is not None and line.strip() == sep:
                        yield "".join(lines)
                        lines = []
                    else:
                        lines.append(line)
            yield "".join(lines)

    def documents(self) -> Iterator[Document]:
        self.invalid_utf8 = 0
        yield from _take(filter(None, map(segment, self._texts())), self.opts.max_documents)


@dataclass
class JsonlOptions:
    paths: Any = None
    glob: str = "*.jsonl"
    text_field: str = "text"
    max_documents: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, "jsonl source ")
        _limit(self.max_documents)
        _relative_glob(self.glob, "jsonl source")


class JsonlSource:
    """JSON Lines files: one document per line, its text under ``text_field``."""

    Options = JsonlOptions

    def __init__(self, **options: Any) -> None:
        self.opts: JsonlOptions = from_dict(JsonlOptions, options, "jsonl source")
        self.files = _list_files(self.opts.paths, self.opts.glob)
        self.invalid_utf8 = 0

    def _texts(self) -> Iterator[str]:
        field = self.opts.text_field
        for path in self.files:
            with open(path, "rb") as f:
                for number, raw in enumerate(f, 1):
                    line, bad = _decode(raw)
                    self.invalid_utf8 += bad
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
                    if not isinstance(record, dict) or not isinstance(record.get(field), str):
                        raise DataError(f"{path}:{number}: no string field '{field}'; set text_field to the field "
                                        "holding the text")
                    text, bad = _SURROGATE.subn("\ufffd", record[field])
                    self.invalid_utf8 += bad
                    yield text

    def documents(self) -> Iterator[Document]:
        self.invalid_utf8 = 0
        yield from _take(filter(None, map(segment, self._texts())), self.opts.max_documents)


@dataclass
class HFOptions:
    name: str | None = None  # hub name ("HuggingFaceFW/fineweb"), local directory, or builder ("json")
    config_name: str | None = None
    split: str = "train"
    streaming: bool = True
    data_files: Any = None
    data_dir: str | None = None
    revision: str | None = None
    text_field: str = "text"
    max_documents: int | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and bool(self.name), "hf source needs 'name' (a dataset name or path)")
        check_fields(self, "hf source ")
        require(self.data_files is None or _data_file_patterns(self.data_files),
                "hf source data_files must be a path, a list of paths, or a mapping of split to path(s), got "
                f"{self.data_files!r}")
        _limit(self.max_documents)


def _data_file_patterns(files: Any) -> list[str]:
    """The paths and globs of a ``data_files`` option (a path, a list, or split -> path or list), or [] when
    it is none of these."""
    entries = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else \
        files if isinstance(files, list) else []
    flat = [f for entry in entries for f in (entry if isinstance(entry, list) else [entry])]
    return flat if all(isinstance(f, str) and f for f in flat) else []


class HFSource:
    """A Hugging Face dataset via ``datasets.load_dataset``; streaming reads remote corpora without
    downloading them whole (FineWeb is ~45 TB)."""

    Options = HFOptions

    def __init__(self, **options: Any) -> None:
        self.opts: HFOptions = from_dict(HFOptions, options, "hf source")
        self.invalid_utf8 = 0  # datasets decodes text itself

    @property
    def local_paths(self) -> list[str]:
        """The local paths the options name, absolute: ``data_files`` (paths and globs) resolved as
        ``load_dataset`` does, against ``data_dir`` within a local directory given as ``name``, else against
        ``data_dir``, else the working directory; without them, the local directory the data is read from.
        Nothing for a hub dataset (a name with a '/' that is no local directory) or a URL. Preparation keys its
        cache by them, as by a text source's paths."""
        o = self.opts
        local_name = Path(o.name).is_dir()
        base = Path(o.name, o.data_dir or "") if local_name else Path(o.data_dir or ".")
        if o.data_files is None:
            named = [str(base)] if local_name or (o.data_dir is not None and base.is_dir()) else []
        elif local_name or "/" not in o.name:  # a local dataset or a packaged builder (json, parquet, ...)
            named = [str(base / p) for p in _data_file_patterns(o.data_files) if "://" not in p]
        else:
            named = []
        return [str(Path(p).resolve()) for p in named]

    @property
    def files(self) -> list[Path]:
        """The files behind ``local_paths`` (directories searched, globs expanded), or DataError when one of
        them names nothing: preparation checks its cache entry against their sizes and times."""
        found: set[Path] = set()
        for path in self.local_paths:
            if Path(path).is_dir():
                found.update(f for f in Path(path).rglob("*") if f.is_file())
                continue
            matches = [Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file()]
            if not matches:
                raise DataError(f"no local file matches {path}")
            found.update(matches)
        return sorted(found)

    def _texts(self) -> Iterator[str]:
        import datasets
        from datasets.exceptions import DatasetGenerationError

        o = self.opts
        # A row the loader cannot parse fails inside load_dataset, wrapped, or (streaming) while rows are read.
        failures = (ValueError, OSError, DatasetGenerationError)
        unreachable = hub_unreachable()
        try:
            with hub_retries_quiet(), hub_offline(unreachable is not None):
                ds = datasets.load_dataset(o.name, o.config_name, split=o.split, streaming=o.streaming,
                                           data_files=o.data_files, data_dir=o.data_dir, revision=o.revision)
        except failures as err:
            why = _first_line(err)
            if unreachable is not None and isinstance(err, ConnectionError):  # offline mode's: not in the cache
                why = f"not in the Hugging Face cache, and {unreachable}; fetch it where there is internet"
            raise DataError(f"cannot load Hugging Face dataset '{o.name}': {why}") from None
        rows = iter(ds)
        for i in itertools.count():
            try:
                row = next(rows, None)
            except failures as err:
                raise DataError(f"cannot read Hugging Face dataset '{o.name}' after row {i}: "
                                f"{_first_line(err)}") from None
            if row is None:
                return
            text = row.get(o.text_field)
            if not isinstance(text, str):
                raise DataError(f"dataset '{o.name}' row {i}: no string field '{o.text_field}' "
                                f"(fields: {', '.join(row)}); set text_field")
            yield text

    def documents(self) -> Iterator[Document]:
        yield from _take(filter(None, map(segment, self._texts())), self.opts.max_documents)


@contextlib.contextmanager
def hub_retries_quiet() -> Iterator[None]:
    """huggingface_hub logs each retry of a request it cannot make (offline: eleven lines); the error that
    follows, as one line, says why, so they are held back while a dataset or tokenizer is resolved."""
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


@contextlib.contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """Both hub clients in offline mode while ``offline``, as HF_HUB_OFFLINE=1 puts them: a dataset is then
    read from the datasets cache at once, or fails at once, where the client would retry a hub it cannot
    reach for 25 s before falling back to the same cache."""
    import datasets
    from huggingface_hub import constants

    if not offline:
        yield
        return
    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached from here, or None when it may be. Where its host name does
    not resolve, huggingface_hub still retries each request with backoff before it fails (55 s for a
    tokenizer), which a failed lookup answers at once. Nothing is decided behind a proxy (it resolves names
    itself) or with HF_HUB_OFFLINE (the client then fails at once on its own)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except (socket.gaierror, UnicodeError):
        return f"the hub ({host}) cannot be reached: its name does not resolve"
    except OSError:  # another failure of the lookup: the client tries, and says why
        return None
    return None


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message; of its cause for datasets' wrapper, which only says that
    generating the dataset failed."""
    from datasets.exceptions import DatasetGenerationError

    if isinstance(err, DatasetGenerationError) and err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class SyntheticSource(SyntheticCorpus):
    Options = SyntheticOptions
    invalid_utf8 = 0


def _take(docs: Iterator[Document], limit: int | None) -> Iterator[Document]:
    """The first ``limit`` documents, reading no further: the one after was read (and its invalid bytes
    counted) before the limit was checked."""
    return docs if limit is None else itertools.islice(docs, limit)


SOURCES: dict[str, type] = {"synthetic": SyntheticSource, "text": TextSource, "jsonl": JsonlSource, "hf": HFSource}


def parse_source(config: Any) -> tuple[type, dict[str, Any]]:
    """Validate a source mapping ``{type: NAME, ...options}`` without touching files or the network."""
    if not isinstance(config, dict) or "type" not in config:
        raise ConfigError(f"data.source must be a mapping with a 'type' ({', '.join(SOURCES)}), got {config!r}")
    options = {k: v for k, v in config.items() if k != "type"}
    cls = lookup("source type", config["type"], SOURCES)
    from_dict(cls.Options, options, f"{config['type']} source")
    return cls, options


def open_source(config: dict[str, Any]):
    """The source object for a mapping: checks that files exist; opens nothing remote yet."""
    cls, options = parse_source(config)
    return cls(**options)


def document_text(doc: Document) -> tuple[str, list[int], list[int]]:
    """The text a document is tokenised as (sentences joined by a space, paragraphs by a blank line),
    with each sentence's end offset and paragraph index."""
    paragraph = [p for p, sentences in enumerate(doc) for _ in sentences]
    # Each sentence's length plus the separator before it: 1 inside a paragraph, 2 at a new paragraph.
    steps = [len(sentence) + (2 if s == 0 else 1) for sentences in doc for s, sentence in enumerate(sentences)]
    steps[0] -= 2
    return "\n\n".join(" ".join(sentences) for sentences in doc), list(itertools.accumulate(steps)), paragraph
