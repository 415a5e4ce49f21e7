"""Length extrapolation: loss and accuracy against evaluation length, 1x to 10x the training length.

The evaluation is the training engine's own (``poslab.train.evaluation.evaluate``: loss and token
accuracy over labelled tokens; tasks add exact match), run on the same data source rebuilt at a longer
length, or on another corpus (``eval_data``, below). What "length" means depends on the data kind
(``LENGTHS``): text sources cut sequences of ``seq_len`` tokens; tasks draw problems of exactly L in the
task's own length unit.

Models whose scheme has context scalings (``Scheme.context_scalings``: RoPE's linear, ntk -- the dynamic
NTK-aware scaling -- and yarn; xPos's blockwise attention) are also evaluated with them applied at
evaluation time only (no fine-tuning): the model is rebuilt with the scheme's ``context_options`` for
factor = L / training length, and the same weights are loaded.

Evaluating on another corpus (``eval_data``, text runs only): a mapping of data-section overrides applied
at evaluation only, e.g. ``{source: {type: hf, name: emozilla/pg19, split: test, ...}, validation_documents:
100}`` (``poslab/configs/data/pg19_eval.yaml``: the PoPE paper's test set). A run trained on short
documents (FineWeb's ~1k tokens) and evaluated on its own data at 10x its length reads windows stitched
from unrelated documents; long books test what the paper tests. ``evaluation_config`` turns the run's
config into the evaluated one, once, before any length is evaluated (a bad eval_data raises):
  * overrides that only change how text is read (``packing``, ``structure_labels``, ...) read the run's
    own corpus that way;
  * overrides naming a corpus (``source``, ``prepared``, ``tokenizer``, ``validation_documents``,
    ``shard_tokens``) make it the evaluation corpus. A source is prepared evaluation-only
    (``poslab.data.preparation``: just its first ``validation_documents`` documents, the run's number
    unless eval_data gives one; no train split; cached in the run's ``cache_dir``) with the run's own
    tokenizer: ``tokenizer: {path: <the run's prepared data>/tokenizer}`` with the run's special tokens,
    so every token id means what it meant in training (a cached corpus whose tokenizer no longer equals
    the run's, because the run's data was prepared again since, is prepared again). A ``tokenizer`` or
    a ``prepared`` directory in eval_data brings its own and is refused unless its vocabulary has the
    model's size;
  * the evaluated split is then the corpus's ``validation``; ``seq_len`` cannot be overridden (the
    lengths are the training length times the factors).
``evaluate_lengths`` and ``scaled_lengths`` take ``eval_data``; their records are the same.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from poslab.errors import ConfigError, DataError, PoslabError, unknown_key_message
from poslab.models import build_model
from poslab.positional import SCHEMES, get_scheme
from poslab.tasks import build_task
from poslab.train.config import RunConfig
from poslab.train.evaluation import evaluate


@dataclasses.dataclass(frozen=True)
class LengthOption:
    """How a data kind states its length: the training length read from the options, the options that
    evaluate at length L, and whether its sequences are windows cut in order from one token stream.

    Packed text is: a curve then reads the same tokens at every length (``evaluate_lengths``), so a loss
    ratio between lengths measures length, not which text was read (256 windows at each length read ~3 books
    of PG-19 at 1x and ~25 at 10x). Unpacked text is cut per document, and task problems are drawn at each
    length: every length reads the same number of sequences."""

    base: Callable[[dict], int]
    at: Callable[[int], dict]
    windows: Callable[[dict], bool]


def _task_training_length(options: dict) -> int:
    """The longest problem a task run trained on, from the task's own options: a config that leaves
    ``max_len`` to the task's default (the adjacency recipe's) trains at that default, not at 1."""
    task = build_task(**options).options
    return int(task.train_max_len or task.max_len)


LENGTHS: dict[str, LengthOption] = {
    "lm": LengthOption(lambda o: int(o.get("seq_len", 128)), lambda n: {"seq_len": n},
                       windows=lambda o: bool(o.get("packing", True))),
    "mlm": LengthOption(lambda o: int(o.get("seq_len", 128)), lambda n: {"seq_len": n},
                        windows=lambda o: bool(o.get("packing", True))),
    "task": LengthOption(_task_training_length,
                         lambda n: {"min_len": n, "max_len": n, "train_max_len": None}, windows=lambda o: False),
}
# Every scheme's evaluation-time context scalings (``Scheme.context_scalings``), in registry order.
CONTEXT_SCALINGS = tuple(dict.fromkeys(name for scheme in SCHEMES.values() for name in scheme.context_scalings))


def _length_option(config: RunConfig) -> LengthOption:
    if config.data.kind not in LENGTHS:
        raise ConfigError(unknown_key_message("data kind for length extrapolation", config.data.kind, LENGTHS))
    return LENGTHS[config.data.kind]


def training_length(config: RunConfig) -> int:
    return _length_option(config).base(config.data.options)


def training_tokens(config: RunConfig) -> int:
    """The training context in tokens: the longest sequence the training data makes (tasks report it;
    text sources cut exactly ``seq_len``)."""
    return int(getattr(config.data.build(config.seed), "max_seq_len", None) or training_length(config))


def config_at_length(config: RunConfig, length: int, sequences: int, batch_size: int) -> RunConfig:
    """The run config with its data at ``length`` and evaluation limited to about ``sequences`` sequences."""
    options = {**config.data.options, **_length_option(config).at(length)}
    data = dataclasses.replace(config.data, options=options)
    train = dataclasses.replace(config.train, eval_batch_size=batch_size,
                                eval_batches=max(1, math.ceil(sequences / batch_size)))
    return dataclasses.replace(config, data=data, train=train)


TEXT_KINDS = ("lm", "mlm")
# eval_data keys that name another corpus (it is prepared for evaluation); the others change how text is read.
CORPUS_KEYS = ("source", "prepared", "tokenizer", "validation_documents", "shard_tokens")
PREPARATION_KEYS = ("source", "tokenizer", "validation_documents", "shard_tokens", "batch_documents", "cache_dir")
EVAL_SPLIT = "validation"  # an evaluation-only corpus has no other split


def _prepared_corpus(options: dict[str, Any], evaluation_only: bool = False):
    from poslab.data import DataConfig as TextDataConfig, PreparedCorpus, ensure_prepared

    return PreparedCorpus(ensure_prepared(TextDataConfig.from_options(options), evaluation_only=evaluation_only))


def run_tokenizer(config: RunConfig) -> dict[str, Any]:
    """The tokenizer section that loads the run's own tokenizer: the ``tokenizer/`` directory of the run's
    prepared data (prepared again if its cache is gone), with the special tokens it was prepared with."""
    corpus = _prepared_corpus(config.data.options)
    section: dict[str, Any] = {"path": str(corpus.directory / corpus.manifest["tokenizer"]["directory"])}
    special = corpus.manifest.get("config", {}).get("tokenizer", {}).get("special_tokens")
    if special:
        section["special_tokens"] = special
    return section


def _refuse_vocab(size: int, config: RunConfig, what: str) -> None:
    model = config.model.vocab_size
    if size != model:
        raise ConfigError(f"eval_data {what} has a {size}-token vocabulary but the model has {model}: its token ids "
                          "would not mean the model's tokens; leave 'tokenizer' (and 'prepared') out of eval_data to "
                          "evaluate with the run's own tokenizer")


def evaluation_config(config: RunConfig, eval_data: dict[str, Any] | None) -> RunConfig:
    """The run config that evaluation reads: ``config`` itself when ``eval_data`` is empty, else its data
    options with ``eval_data`` over them (see the module docstring). A corpus named by ``eval_data`` is
    prepared now, evaluation-only, with the run's tokenizer unless ``eval_data`` names one."""
    if not eval_data:
        return config
    if not isinstance(eval_data, dict):
        raise ConfigError(f"eval_data must be a mapping of data options, got {type(eval_data).__name__}")
    overrides = dict(eval_data)
    kind = overrides.pop("kind", config.data.kind)
    if kind != config.data.kind:
        raise ConfigError(f"eval_data kind '{kind}' differs from the run's data kind '{config.data.kind}'; "
                          "the evaluation keeps the run's kind")
    if config.data.kind not in TEXT_KINDS:
        raise ConfigError(f"eval_data applies to text data (kind {' or '.join(TEXT_KINDS)}); this run's data kind "
                          f"is '{config.data.kind}'")
    if "seq_len" in overrides:
        raise ConfigError("eval_data cannot set seq_len: the evaluation lengths are the training length times the "
                          "factors")
    if isinstance(overrides.get("source"), dict) and "type" not in overrides["source"]:
        own_source = _own_source(config)
        if own_source is not None:
            overrides["source"] = {**own_source, **overrides["source"]}  # other options of the run's own source
    options = {**config.data.options, **overrides}
    if not set(CORPUS_KEYS) & overrides.keys():  # the run's own corpus, read differently
        return _checked(dataclasses.replace(config, data=dataclasses.replace(config.data, options=options)))
    if "source" in overrides:
        options.pop("prepared", None)
    if "prepared" in overrides:
        options.pop("source", None)
    own_tokenizer = "tokenizer" not in overrides and "prepared" not in overrides
    if own_tokenizer:
        options["tokenizer"] = run_tokenizer(config)
    elif isinstance(overrides.get("tokenizer"), dict) and overrides["tokenizer"].get("path"):
        from poslab.data.tokenizer import load_tokenizer  # refuse before preparing anything

        path = overrides["tokenizer"]["path"]
        _refuse_vocab(load_tokenizer(path).get_vocab_size(with_added_tokens=True), config, f"tokenizer {path}")
    corpus = _prepared_corpus(options, evaluation_only=True)
    if own_tokenizer:
        _check_same_tokenizer(corpus, options)
    else:
        _refuse_vocab(corpus.vocab_size, config, f"corpus {corpus.directory}")
    reading = {k: v for k, v in options.items() if k not in PREPARATION_KEYS} | {"prepared": str(corpus.directory)}
    return _checked(dataclasses.replace(config, data=dataclasses.replace(config.data, options=reading),
                                        train=dataclasses.replace(config.train, eval_split=EVAL_SPLIT)))


def _own_source(config: RunConfig) -> dict[str, Any] | None:
    """The source of the run's corpus: in its config, or for a run on prepared data, in that data's manifest."""
    source = config.data.options.get("source")
    if source is None and config.data.options.get("prepared"):
        source = _prepared_corpus(config.data.options).manifest.get("config", {}).get("source")
    return source if isinstance(source, dict) else None


def _checked(config: RunConfig) -> RunConfig:
    """``config`` once its data builds and has the evaluated split (what the source refuses raises here, not
    once per length)."""
    config.data.build(config.seed).corpus.split(config.train.eval_split)
    return config


def _check_same_tokenizer(corpus, options: dict[str, Any]) -> None:
    """The cached evaluation corpus is keyed by the run tokenizer's path, not its content: if the run's data
    was prepared again since (a retrained tokenizer at the same path), prepare the evaluation corpus again."""
    from poslab.data import DataConfig as TextDataConfig, prepare
    from poslab.data.tokenizer import load_tokenizer

    stored = corpus.directory / corpus.manifest["tokenizer"]["directory"]
    if load_tokenizer(stored).get_vocab(True) != load_tokenizer(options["tokenizer"]["path"]).get_vocab(True):
        prepare(TextDataConfig.from_options(options), corpus.directory, force=True, evaluation_only=True)


def with_context_scaling(config: RunConfig, model: torch.nn.Module, scaling: str, factor: float,
                         original_max_len: int) -> torch.nn.Module:
    """The same weights in a model whose scheme uses ``scaling`` (RoPE's "linear", "ntk", "yarn"; xPos's
    "blockwise") at ``factor`` x ``original_max_len``."""
    if scaling not in CONTEXT_SCALINGS:
        raise ConfigError(unknown_key_message("context scaling", scaling, CONTEXT_SCALINGS))
    spec = config.model.to_dict()
    name = spec.get("positional", {}).get("name", "nope")
    scheme = get_scheme(name)
    if scaling not in scheme.context_scalings:
        able = ", ".join(n for n, s in SCHEMES.items() if scaling in s.context_scalings)
        raise ConfigError(f"context scaling '{scaling}' applies to {able} models; this run's positional scheme is "
                          f"'{name}'")
    spec["positional"]["options"] = {**spec["positional"]["options"],
                                     **scheme.context_options(scaling, factor, original_max_len)}
    scaled = build_model(spec)
    scaled.load_state_dict(model.state_dict())
    return scaled.to(next(model.parameters()).device).eval()


def evaluate_lengths(config: RunConfig, model: torch.nn.Module, lengths: list[int], sequences: int = 64,
                     batch_size: int = 16, seed: int | None = None,
                     eval_data: dict[str, Any] | None = None, longest: int | None = None) -> list[dict[str, Any]]:
    """One record per length: {"length", "factor", "sequences", "loss", "token_accuracy", ...} or {"length",
    "error"} when the data or the model cannot go that far (e.g. past a learned position table).

    ``sequences`` are read at the ``longest`` length (default: the longest of ``lengths``); text reads the
    same tokens at every length, so sequences x longest / L windows at length L (rounded up to a batch, so
    the same text to within a batch of windows). ``eval_data``: evaluate on another corpus
    (``evaluation_config``); a bad one raises rather than filling the records."""
    base = training_length(config)
    evaluated = evaluation_config(config, eval_data)
    windows = _length_option(evaluated).windows(evaluated.data.options)
    longest = longest or max(lengths)
    device = next(model.parameters()).device
    out = []
    for length in lengths:
        count = math.ceil(sequences * longest / length) if windows else sequences
        record: dict[str, Any] = {"length": length, "factor": length / base, "sequences": count}
        try:
            cfg = config_at_length(evaluated, length, count, batch_size)
            source = cfg.data.build(config.seed if seed is None else seed)
            if windows:
                # A split shorter than a window reads the same short text at every longer "length"; fewer
                # windows than asked for are what was read, and the record says so.
                text = source.corpus.split(cfg.train.eval_split).n_tokens
                if text < length - 1:
                    raise DataError(f"the evaluation text holds {text} tokens, too few for one sequence of "
                                    f"{length}; evaluate on more text (eval_data) or at shorter lengths")
                record["sequences"] = min(source.num_sequences(cfg.train.eval_split),
                                          cfg.train.eval_batches * batch_size)
            record.update(evaluate(model, source, cfg, device, contextlib.nullcontext()))
            # Answer scoring reads the whole split (train.evaluation.batches), whatever was asked for
            record["sequences"] = record.get("examples", record["sequences"])
        except PoslabError as err:
            record["error"] = str(err)
        out.append(record)
    return out


def scaled_lengths(config: RunConfig, model: torch.nn.Module, lengths: list[int], scaling: str,
                   sequences: int = 64, batch_size: int = 16,
                   eval_data: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """As ``evaluate_lengths``, with the model rebuilt under ``scaling`` at factor L / training length."""
    base, tokens = training_length(config), training_tokens(config)
    evaluated = evaluation_config(config, eval_data)
    out = []
    for length in lengths:
        scaled = with_context_scaling(config, model, scaling, length / base, tokens)
        out.extend(evaluate_lengths(evaluated, scaled, [length], sequences, batch_size, longest=max(lengths)))
    return out
