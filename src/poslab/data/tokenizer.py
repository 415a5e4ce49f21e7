"""Tokenizers: train WordPiece or byte-level BPE with Hugging Face ``tokenizers``, or load a local one.

The pipeline works on the Rust ``tokenizers.Tokenizer`` (batch encoding with character offsets, which is
how structure labels reach tokens); sources expose a ``transformers.PreTrainedTokenizerFast`` wrapping the
same object for decoding and for saving next to checkpoints.

Special tokens are named by role (``TokenizerConfig.special_tokens``): cls, sep and pad are always
needed (sequence start, document separator, padding); mask is needed for masked-LM data and may be set to
null for causal-LM-only data; unk is optional (a trained WordPiece needs it). A tokenizer whose
vocabulary lacks a needed token is rejected with the role and token named.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from poslab.data.config import TokenizerConfig
from poslab.data.sources import hub_retries_quiet, hub_unreachable
from poslab.errors import DataError

REQUIRED_ROLES = ("cls", "sep", "pad")
# Bump when trained tokenizers change (2: canonical ids, 3: validation documents left out): cached preparations
# are keyed by it.
TRAINING_VERSION = 3


def _wordpiece(cfg: TokenizerConfig, specials: list[str]) -> tuple[Tokenizer, trainers.Trainer]:
    """BERT's layout: BERT normaliser (lower-casing optional), punctuation/whitespace split, ## pieces."""
    tok = Tokenizer(models.WordPiece(unk_token=cfg.special_tokens["unk"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=cfg.lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                        special_tokens=specials, show_progress=False)
    return tok, trainer


def _bpe(cfg: TokenizerConfig, specials: list[str]) -> tuple[Tokenizer, trainers.Trainer]:
    """GPT-2's layout: byte-level BPE (never unknown), NFC normalisation, optional lower-casing."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFC()] + ([normalizers.Lowercase()] if cfg.lowercase else []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    return tok, trainer


TRAINABLE = {"wordpiece": _wordpiece, "bpe": _bpe}


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    pad: int
    mask: int | None
    unk: int | None

    @property
    def all(self) -> list[int]:
        return sorted({i for i in (self.cls, self.sep, self.pad, self.mask, self.unk) if i is not None})


def special_ids(tok: Tokenizer, cfg: TokenizerConfig, where: str) -> SpecialIds:
    """Ids of the special tokens by role; DataError naming the first needed token the vocabulary lacks."""
    ids: dict[str, int | None] = {}
    for role, token in cfg.special_tokens.items():
        ids[role] = None if token is None else tok.token_to_id(token)
        needed = role in REQUIRED_ROLES or (role == "mask" and token is not None)
        if needed and ids[role] is None:
            raise DataError(f"tokenizer {where} has no {role} token '{token}'; add it to the tokenizer or map the "
                            f"role to one it has with tokenizer.special_tokens.{role}")
    return SpecialIds(**ids)


def train_tokenizer(cfg: TokenizerConfig, texts: Iterable[str]) -> Tokenizer:
    """A tokenizer of ``cfg.type`` trained on ``texts``.

    Runs of over 100 non-space characters are left out of the trainer's input: both trainers take time
    quadratic in a word's length (a 1 MB word took 843 s), WordPiece encodes a word of over 100 characters
    (its ``max_input_chars_per_word``) as [UNK] anyway, and byte-level BPE still encodes one from the merges
    learned on the other words. A word is never longer than its run, so no shorter word is affected unless
    punctuation joins it into such a run.
    """
    long_runs = re.compile(r"\S{101,}")
    specials = [t for t in cfg.special_tokens.values() if t is not None]
    tok, trainer = TRAINABLE[cfg.type](cfg, list(dict.fromkeys(specials)))
    tok.train_from_iterator((long_runs.sub(" ", text) for text in texts), trainer)
    return _canonical_ids(tok)


def _canonical_ids(tok: Tokenizer) -> Tokenizer:
    """The trainers number tokens partly in hash-map order, which changes from process to process: two
    preparations of the quick LM corpus gave 21 of 2,048 WordPiece ids ("##v", "##i", ...) other numbers,
    so the same config trained models whose embedding rows belonged to other tokens, and the quick LM
    recipes' numbers moved between runs. Every token but the special ones gets its id slot by sorted
    (length, text), so a vocabulary has one numbering. Encoding depends on the vocabulary (and BPE's merge
    list), never on ids. Not fixed here: where merges tie in count, at any point of training, which one is
    taken can change between processes (so can which intermediate pieces the vocabulary keeps, even when
    every word ends up whole); the trainers offer no seed."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    prefix = data["model"].get("continuing_subword_prefix") or ""
    added = {t["content"] for t in data.get("added_tokens", [])}
    tokens = [t for t in vocab if t not in added]
    slots = sorted(vocab[t] for t in tokens)
    order = sorted(tokens, key=lambda t: (len(t.removeprefix(prefix)), t.removeprefix(prefix), t))
    for token, slot in zip(order, slots):
        vocab[token] = slot
    return Tokenizer.from_str(json.dumps(data))


# A Hugging Face hub repository id: "name" or "owner/name", neither part starting with a dot (./tok, ../tok and
# .. are local paths). "data/tok" is both: tried as a hub id only when no such local path exists.
HUB_ID = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A local tokenizer directory (or tokenizer.json file): tokenizers' own format first, else whatever
    transformers' AutoTokenizer reads, as long as it is a fast (Rust-backed) tokenizer. A name that is no local
    path but a hub id (``bert-base-uncased``, as the DSTG paper's) is loaded from the Hugging Face hub, as
    datasets are by name: downloaded once into its cache, and read from there afterwards without asking the hub
    (offline, the hub's client retried for a minute before falling back to its cache). Truncation and padding
    saved with it are turned off: the pipeline encodes whole documents and cuts sequences itself."""
    tok = _load_tokenizer(Path(path), str(path))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _load_tokenizer(path: Path, name: str) -> Tokenizer:
    file = path if path.is_file() else path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None
    if file is not None:
        try:
            return Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception for a file that is not its JSON
            raise DataError(f"cannot load tokenizer from {file}: {str(err).splitlines()[0]} (not a tokenizers "
                            "tokenizer.json)") from None
    # "data/tok" where ./data exists is a mistyped local path, not a repository of a hub user "data"
    hub = not path.exists() and HUB_ID.fullmatch(name) is not None and not (len(path.parts) == 2
                                                                           and path.parent.is_dir())
    if not path.is_dir() and not hub:
        raise DataError(f"no tokenizer at {path}: expected a directory with tokenizer.json (or vocab files), or "
                        "a Hugging Face hub name such as bert-base-uncased")
    from transformers import AutoTokenizer

    try:
        try:
            hf = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            if not hub:
                raise
            if (why := hub_unreachable()) is not None:
                raise DataError(f"cannot load tokenizer '{name}': no local directory, not in the Hugging Face cache, "
                                f"and {why}; use a local tokenizer directory, or fetch it where there is internet")
            with hub_retries_quiet():
                hf = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        where = f"'{name}': no local directory, and from the Hugging Face hub" if hub else f"from {path}"
        raise DataError(f"cannot load tokenizer {where}: {str(err).splitlines()[0]}") from None
    if not getattr(hf, "is_fast", False):
        raise DataError(f"tokenizer {name} has no fast (Rust) version; convert it or save tokenizer.json")
    return hf.backend_tokenizer


def save_tokenizer(tok: Tokenizer, ids: SpecialIds, cfg: TokenizerConfig, directory: Path):
    """Save as a transformers tokenizer directory (AutoTokenizer-loadable) that adds [CLS] ... [SEP] the
    way the pipeline does; returns the PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast

    cls, sep = cfg.special_tokens["cls"], cfg.special_tokens["sep"]
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}",
                                                       special_tokens=[(cls, ids.cls), (sep, ids.sep)])
    named = {f"{role}_token": token for role, token in cfg.special_tokens.items()
             if token is not None and getattr(ids, role) is not None}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    hf.save_pretrained(str(directory))
    return hf


def load_hf_tokenizer(directory: Path):
    """The transformers tokenizer saved with prepared data, or DataError: a directory damaged since."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    except Exception as err:  # missing files: ValueError; a damaged tokenizer.json: JSONDecodeError or Exception
        raise DataError(f"cannot load the tokenizer saved in {directory} ({str(err).splitlines()[0][:200]}); "
                        "prepare the data again") from None
