"""Length extrapolation: loss and accuracy against evaluation length, 1x to 10x the training length.

The evaluation is the training engine's own (``poslab.train.evaluation.evaluate``: loss and token
accuracy over labelled tokens; tasks add exact match), run on the same data source rebuilt at a longer
length. What "length" means depends on the data kind (``LENGTHS``): text sources cut sequences of
``seq_len`` tokens; tasks draw problems of exactly L in the task's own length unit.

RoPE models are also evaluated with the context-extension scalings of ``poslab.positional.rope``
applied at evaluation time only (no fine-tuning): the model is rebuilt with the scaling in its
positional options, factor = L / training length, and the same weights are loaded. "ntk" is the
dynamic NTK-aware scaling.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from poslab.errors import ConfigError, PoslabError, unknown_key_message
from poslab.models import build_model
from poslab.train.config import RunConfig
from poslab.train.evaluation import evaluate


@dataclasses.dataclass(frozen=True)
class LengthOption:
    """How a data kind states its length: the training length read from the options, and the options
    that evaluate at length L."""

    base: Callable[[dict], int]
    at: Callable[[int], dict]


LENGTHS: dict[str, LengthOption] = {
    "lm": LengthOption(lambda o: int(o.get("seq_len", 128)), lambda n: {"seq_len": n}),
    "mlm": LengthOption(lambda o: int(o.get("seq_len", 128)), lambda n: {"seq_len": n}),
    "task": LengthOption(lambda o: int(o.get("train_max_len") or o.get("max_len", 1)),
                         lambda n: {"min_len": n, "max_len": n, "train_max_len": None}),
}
# name -> (rope.scaling, whether factor = L / training length is passed). Dynamic NTK stretches its base by
# the length it sees (alpha = L / original_max_len) and keeps factor 1, as Hugging Face's default does.
ROPE_SCALINGS = {"linear": ("linear", True), "ntk": ("dynamic", False), "yarn": ("yarn", True)}


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


def with_rope_scaling(config: RunConfig, model: torch.nn.Module, scaling: str, factor: float,
                      original_max_len: int) -> torch.nn.Module:
    """The same weights in a model whose RoPE uses ``scaling`` ("linear", "ntk", "yarn") at ``factor``."""
    if scaling not in ROPE_SCALINGS:
        raise ConfigError(unknown_key_message("RoPE scaling", scaling, ROPE_SCALINGS))
    spec = config.model.to_dict()
    scheme = spec.get("positional", {}).get("name")
    if scheme != "rope":
        raise ConfigError(f"RoPE scaling applies to rope models; this run's positional scheme is '{scheme}'")
    name, scaled_factor = ROPE_SCALINGS[scaling]
    spec["positional"]["options"] = {**spec["positional"]["options"], "scaling": name,
                                     "factor": float(max(1.0, factor)) if scaled_factor else 1.0,
                                     "original_max_len": original_max_len}
    scaled = build_model(spec)
    scaled.load_state_dict(model.state_dict())
    return scaled.to(next(model.parameters()).device).eval()


def evaluate_lengths(config: RunConfig, model: torch.nn.Module, lengths: list[int], sequences: int = 64,
                     batch_size: int = 16, seed: int | None = None) -> list[dict[str, Any]]:
    """One record per length: {"length", "factor", "loss", "token_accuracy", ...} or {"length", "error"}
    when the data or the model cannot go that far (e.g. past a learned position table)."""
    base = training_length(config)
    device = next(model.parameters()).device
    out = []
    for length in lengths:
        record: dict[str, Any] = {"length": length, "factor": length / base}
        try:
            cfg = config_at_length(config, length, sequences, batch_size)
            source = cfg.data.build(config.seed if seed is None else seed)
            record.update(evaluate(model, source, cfg, device, contextlib.nullcontext()))
        except PoslabError as err:
            record["error"] = str(err)
        out.append(record)
    return out


def rope_scaled_lengths(config: RunConfig, model: torch.nn.Module, lengths: list[int], scaling: str,
                        sequences: int = 64, batch_size: int = 16) -> list[dict[str, Any]]:
    """As ``evaluate_lengths``, with the model rebuilt under ``scaling`` at factor L / training length."""
    base, tokens = training_length(config), training_tokens(config)
    out = []
    for length in lengths:
        scaled = with_rope_scaling(config, model, scaling, length / base, tokens)
        out.extend(evaluate_lengths(config, scaled, [length], sequences, batch_size))
    return out
