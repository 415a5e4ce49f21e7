"""Typed configuration of a text-data pipeline, validated at construction.

One ``DataConfig`` covers both halves of the pipeline:
  preparation  (``source``, ``tokenizer``, ``validation_documents``, ``shard_tokens``, ``batch_documents``)
               -- what ``poslab data prepare`` turns into a directory of shards;
  reading      (``seq_len``, ``packing``, ``masking``, ``structure_labels``, ``prefetch``) -- how batches are
               cut from the shards; changing these never requires preparing again.
``prepared`` names an existing prepared directory instead of a source; ``cache_dir`` is where a source is
prepared on the fly when no directory is given.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from poslab.errors import ConfigError, check_fields, is_int, known_fields, lookup, require, unknown_key_message


def from_dict(cls: type, data: Any, what: str):
    """Build dataclass ``cls`` from a mapping (an instance passes as it is), naming unknown keys and their
    closest valid spelling."""
    if isinstance(data, cls):
        return data
    return cls(**known_fields(data, cls, what))


def _int_range(value: Any, name: str, minimum: int = 0) -> tuple[int, int]:
    """[lo, hi] inclusive; a single integer means [n, n]."""
    if is_int(value):
        value = [value, value]
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(is_int(v) for v in value))
    require(ok, f"{name} must be an integer or a [min, max] pair of integers, got {value!r}")
    lo, hi = value
    require(minimum <= lo <= hi, f"{name} must satisfy {minimum} <= min <= max, got [{lo}, {hi}]")
    return int(lo), int(hi)


# 64x the largest vocabularies in use (~256k); each entry costs the trainer about 66 bytes before it starts.
MAX_TOKENIZER_VOCAB = 2**24
SPECIAL_ROLES = ("cls", "sep", "pad", "mask", "unk")
BERT_SPECIAL_TOKENS = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]", "unk": "[UNK]"}


@dataclass
class TokenizerConfig:
    """Either ``path`` (a local tokenizer directory: tokenizer.json, or anything transformers' AutoTokenizer
    reads; or a Hugging Face hub name such as bert-base-uncased, downloaded once) or a tokenizer trained on the
    first ``train_documents`` documents after the validation split.

    ``special_tokens`` maps roles to token strings; the defaults are BERT's. A loaded tokenizer lacking
    one of them is rejected (``mask`` is only required for masked-LM data).
    """

    path: str | None = None
    type: str = "wordpiece"
    vocab_size: int = 30522
    lowercase: bool = True
    min_frequency: int = 2
    train_documents: int = 100_000
    special_tokens: dict[str, str | None] = field(default_factory=lambda: dict(BERT_SPECIAL_TOKENS))

    def __post_init__(self) -> None:
        from poslab.data.tokenizer import TRAINABLE  # the registry lives with the trainers

        lookup("tokenizer type", self.type, TRAINABLE)  # before check_fields: it names the valid types
        check_fields(self, "tokenizer.")
        # The tokenizers trainer reserves memory for vocab_size entries up front (2^31 asked for 141 GB and aborted
        # the process) and takes the counts as 64-bit integers; islice takes train_documents up to sys.maxsize.
        require(16 <= self.vocab_size <= MAX_TOKENIZER_VOCAB, f"tokenizer.vocab_size must be an integer in [16, "
                f"{MAX_TOKENIZER_VOCAB:,}] (the trainer reserves memory for every entry), got {self.vocab_size!r}")
        require(1 <= self.min_frequency < 2**63,
                f"tokenizer.min_frequency must be an integer in [1, 2^63), got {self.min_frequency!r}")
        require(1 <= self.train_documents < 2**63,
                f"tokenizer.train_documents must be an integer in [1, 2^63), got {self.train_documents!r}")
        require(isinstance(self.special_tokens, dict), "tokenizer.special_tokens must be a mapping role -> token")
        for role in self.special_tokens:
            if role not in SPECIAL_ROLES:
                raise ConfigError(unknown_key_message("special-token role", str(role), SPECIAL_ROLES))
        for role, token in self.special_tokens.items():
            # A space splits the post-processor's template ("{cls} $A {sep}") into two tokens it does not know
            require(token is None or (isinstance(token, str) and token.strip() != "" and token.split() == [token]),
                    f"tokenizer.special_tokens.{role} must be a token (a non-empty string without spaces) or null, "
                    f"got {token!r}")
        self.special_tokens = {**BERT_SPECIAL_TOKENS, **self.special_tokens}  # roles not named keep BERT's
        # A trained tokenizer adds one id per token: a token in two roles would make a sequence's start marker
        # end its documents too. (A pretrained one may mean it: GPT-2 has one token for all of them.)
        named = [t for t in self.special_tokens.values() if t is not None]
        for token in sorted({t for t in named if named.count(t) > 1}) if self.path is None else []:
            raise ConfigError(f"tokenizer.special_tokens gives {token!r} more than one role; a trained tokenizer "
                              "needs a token of its own for each")
        # Byte-level BPE starts from its 256 bytes and the special tokens: a smaller cap was exceeded without a word.
        needed = 256 + len(set(named))
        require(self.path is not None or self.type != "bpe" or self.vocab_size >= needed,
                f"tokenizer.vocab_size {self.vocab_size} is below what byte-level BPE starts from (256 bytes and "
                f"{len(set(named))} special tokens); give at least {needed}")
        # WordPiece encodes every unseen character as unk; byte-level BPE never needs one.
        require(self.path is not None or self.type != "wordpiece" or self.special_tokens["unk"] is not None,
                "a trained wordpiece tokenizer needs an unk token (tokenizer.special_tokens.unk, e.g. '[UNK]'); "
                "use type: bpe for a tokenizer without one")


@dataclass(frozen=True)
class MaskingStyle:
    """Default rate and what a chosen token becomes: [MASK] with mask_prob, a random token with
    random_prob, unchanged otherwise."""

    rate: float
    mask_prob: float
    random_prob: float


# NeoBERT replaces every chosen token by [MASK] (no 80/10/10); BERT uses 80/10/10 at 15%.
MASKING_STYLES: dict[str, MaskingStyle] = {
    "neobert": MaskingStyle(rate=0.20, mask_prob=1.0, random_prob=0.0),
    "bert": MaskingStyle(rate=0.15, mask_prob=0.8, random_prob=0.1),
}


@dataclass
class MaskingConfig:
    style: str = "neobert"
    rate: float | None = None  # None: the style's rate

    def __post_init__(self) -> None:
        style = lookup("masking style", self.style, MASKING_STYLES)
        check_fields(self, "masking.")
        if self.rate is None:
            self.rate = style.rate
        require(0.0 < self.rate < 1.0, f"masking.rate must lie in (0, 1), got {self.rate!r}")

    @property
    def resolved(self) -> MaskingStyle:
        base = MASKING_STYLES[self.style]
        return MaskingStyle(rate=float(self.rate), mask_prob=base.mask_prob, random_prob=base.random_prob)


# What determines the prepared shards: a prepared directory records them, and the cache is keyed by them.
PREPARE_FIELDS = ("source", "tokenizer", "validation_documents", "shard_tokens")


@dataclass
class DataConfig:
    source: dict[str, Any] | None = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    validation_documents: int = 0
    shard_tokens: int = 16_000_000
    batch_documents: int = 1024
    seq_len: int = 128
    packing: bool = True
    masking: MaskingConfig | None = None
    structure_labels: bool = True
    prefetch: bool = True
    prepared: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        from poslab.data.sources import parse_source  # validates the source's own options

        check_fields(self)
        self.tokenizer = from_dict(TokenizerConfig, self.tokenizer, "data.tokenizer")
        if self.masking is not None:
            self.masking = from_dict(MaskingConfig, self.masking, "data.masking")
        require((self.source is None) != (self.prepared is None),
                "data needs exactly one of 'source' (a corpus to prepare) or 'prepared' (a prepared directory)")
        if self.source is not None:
            parse_source(self.source)
        require(self.seq_len >= 2,
                f"seq_len must be an integer >= 2 ([CLS] plus at least one token), got {self.seq_len!r}")
        require(self.packing or self.seq_len >= 3,
                f"seq_len must be >= 3 with packing: false ([CLS] and [SEP] take two), got {self.seq_len}")
        require(self.validation_documents >= 0,
                f"validation_documents must be an integer >= 0, got {self.validation_documents!r}")
        require(self.shard_tokens >= 1, f"shard_tokens must be a positive integer, got {self.shard_tokens!r}")
        require(self.batch_documents >= 1, f"batch_documents must be a positive integer, got {self.batch_documents!r}")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "DataConfig":
        return from_dict(cls, options, "data")

    def prepare_dict(self) -> dict[str, Any]:
        """The part of the config that determines the prepared shards (JSON-able)."""
        values = dataclasses.asdict(self)
        return {name: values[name] for name in PREPARE_FIELDS}
