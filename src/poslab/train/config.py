"""The run configuration: YAML -> typed dataclasses, validated when built.

A run config has four sections::

    seed: 0
    model: {arch: decoder, vocab_size: null, d_model: 128, ...}   # ModelConfig (or DSTGConfig) fields
    data:  {kind: task, name: indirect_indexing, ...}              # kind + the source builder's keywords
    train: {steps: 2000, batch_size: 64, lr: 3.0e-4, ...}          # TrainConfig below

``model.vocab_size`` null (or absent) is taken from the data source, so a config never repeats the
tokenizer's size. A section may name a YAML file holding it instead (``model: ../models/mine.yaml``,
relative to the run config), and a model section a ready config (``model: paper/dstg``).
Every error names the offending key (``train.lr``) and what to change; unknown keys get the closest valid
spelling. ``--set train.lr=1e-3`` overrides parse their value as YAML.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from poslab.batches import SOURCES, BatchSource, build_batch_source
from poslab.arguments import load_yaml_text, read_yaml
from poslab.errors import (ConfigError, check_fields, check_type, cut, finite, known_fields, lookup, parse_number,
                           require, shown)
from poslab.models import ARCHS, DSTGConfig, ModelConfig
from poslab.models.dstg import CONFIG_DIR as READY_DIR, READY, SCALES as READY_SCALES

PRECISIONS = ("auto", "fp32", "bf16")
SCHEDULES = ("cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")
# The model archs that learn from each data kind. lm and task sources label a token with itself (unshifted: a
# causal model scores its prediction at i against the label at i + 1), so a bidirectional model sees every
# label in its input and learns to copy it; an mlm source hides its labels behind masked tokens, for a
# bidirectional model to fill in from both sides, which a decoder, reading left to right, cannot.
DATA_ARCHS = {"lm": ("decoder",), "task": ("decoder",), "mlm": ("encoder", "dstg")}


@dataclass
class TrainConfig:
    """Optimisation, evaluation and bookkeeping. Steps count optimizer updates; 0 disables a periodic action.

    ``batch_size`` is the global batch (sequences per optimizer step, over all ranks and accumulation
    micro-steps): a run's result does not depend on how many processes share it. ``eval_batches`` caps
    the generic evaluation (loss and token accuracy); task sources evaluate their whole split, whose
    size is a data option (``validation_size``). ``best_metric`` names an evaluation metric (loss,
    token_accuracy, exact_match for tasks) and ``best_mode`` whether lower or higher is better (default: min
    for loss, max for the accuracies, so that naming an accuracy alone keeps its best checkpoint); it and
    ``eval_split`` are checked against the data and model when training starts, before the first step.
    ``precision`` auto is bf16 autocast on CUDA and fp32 on CPU; ``device`` auto prefers CUDA.
    ``activation_checkpointing`` keeps only each block's input and recomputes the rest in the backward pass
    (Hugging Face's ``activation_checkpointing_enable``): the same gradients in less memory, for about one
    more forward pass of time.
    ``init_from`` fine-tunes: a checkpoint directory, or a run directory (its checkpoints/last), whose weights
    the model starts from; the optimizer, the schedule and the step count start afresh. Its model may differ
    in what leaves the weights' names and shapes alone (a RoPE scaling, max_seq_len without a position table).
    """

    steps: int = 1000
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 0
    eval_split: str = "validation"
    eval_batch_size: int | None = None
    eval_batches: int | None = None
    best_metric: str = "loss"
    best_mode: str | None = None
    checkpoint_every: int = 0
    log_every: int = 10
    precision: str = "auto"
    compile: bool = False
    fsdp: bool = False
    activation_checkpointing: bool = False
    device: str = "auto"
    init_from: str | None = None

    def __post_init__(self) -> None:
        check_fields(self, "train.")
        for name in ("steps", "batch_size", "grad_accum", "log_every"):
            require(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            require(getattr(self, name) >= 0, f"train.{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        require(self.batch_size % self.grad_accum == 0,
                f"train.grad_accum ({self.grad_accum}) must divide train.batch_size ({self.batch_size})")
        require(self.warmup_steps <= self.steps,
                f"train.warmup_steps ({self.warmup_steps}) must not exceed train.steps ({self.steps}); shortening a "
                f"run, set both (e.g. --set train.steps={self.steps} --set train.warmup_steps={self.steps // 10})")
        require(self.lr > 0, f"train.lr must be a positive number, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, f"train.min_lr must lie in [0, train.lr={self.lr}], got {self.min_lr}")
        require(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        require(isinstance(self.betas, (tuple, list)) and len(self.betas) == 2,
                f"train.betas must be two numbers in [0, 1), got {shown(self.betas)}")
        for i, beta in enumerate(self.betas):
            check_type(f"train.betas[{i}]", beta, float)
        require(all(0 <= b < 1 for b in self.betas), f"train.betas must be two numbers in [0, 1), got {list(self.betas)}")
        # AdamW's first update moves each weight by lr / (1 - beta1), which torch converts to the weights' float32:
        # past its range optimizer.step raised an overflow RuntimeError rather than the run diverging.
        first_step = self.lr / (1 - self.betas[0])
        require(first_step <= torch.finfo(torch.float32).max,
                f"train.lr ({self.lr:g}) is too large: AdamW's first step, lr / (1 - train.betas[0]) = {first_step:.3g}, "
                "does not fit in a float32; lower train.lr")
        # AdamW multiplies each weight by 1 - lr x weight_decay per step: at 1 or more it zeroes or flips them
        require(self.lr * self.weight_decay < 1, f"train.lr x train.weight_decay must be below 1 (AdamW scales the "
                f"weights by 1 - their product each step), got {self.lr:g} x {self.weight_decay:g}; lower either")
        require(self.eps > 0, f"train.eps must be > 0, got {self.eps}")
        require(self.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        require(self.eval_batch_size is None or self.eval_batch_size >= 1,
                f"train.eval_batch_size must be >= 1 or null (= batch_size), got {self.eval_batch_size}")
        require(self.eval_batches is None or self.eval_batches >= 1,
                f"train.eval_batches must be >= 1 or null (the whole split), got {self.eval_batches}")
        lower_is_better = self.best_metric == "loss"  # the others are accuracies (evaluation.check names them)
        if self.best_mode is None:
            self.best_mode = "min" if lower_is_better else "max"
        require(self.best_mode in ("min", "max"), f"train.best_mode must be min or max, got '{self.best_mode}'")
        if self.best_metric in ("loss", "token_accuracy", "exact_match"):
            right = "min" if lower_is_better else "max"
            require(self.best_mode == right, f"train.best_mode {self.best_mode} would keep the checkpoint with the "
                    f"{'highest' if lower_is_better else 'lowest'} {self.best_metric}; use {right}, or leave "
                    "best_mode out")
        require(self.init_from is None or self.init_from.strip() != "",
                "train.init_from must name a checkpoint or run directory, or be null")
        for name, valid in (("schedule", SCHEDULES), ("precision", PRECISIONS), ("device", DEVICES)):
            require(getattr(self, name) in valid,
                    f"train.{name} must be one of {', '.join(valid)}, got '{getattr(self, name)}'")


@dataclass
class DataConfig:
    """``kind`` picks a builder in ``poslab.batches.SOURCES``; ``options`` are its keyword arguments."""

    kind: str = "task"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lookup("data kind", self.kind, SOURCES)
        require("seed" not in self.options, "data.seed is not an option: the run's top-level 'seed' seeds its "
                "data (a task's problems have their own data_seed)")

    def build(self, seed: int) -> BatchSource:
        """The batch source; its builder validates the options (and names unknown ones)."""
        return build_batch_source(self.kind, seed=seed, **self.options)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.options}


@dataclass
class RunConfig:
    seed: int = 0
    model: ModelConfig | DSTGConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        require(0 <= self.seed < 2**63, f"seed must be an integer in [0, 2^63), got {shown(self.seed)}")
        arch, kind = self.model.arch, self.data.kind
        fits = DATA_ARCHS.get(kind, (arch,))  # a data kind not listed takes any model
        if arch not in fits:
            why = ("its labels are masked tokens, which a decoder cannot fill in from the tokens after them"
                   if kind == "mlm" else "its labels are its input tokens, which a bidirectional model sees and copies")
            others = [k for k, archs in DATA_ARCHS.items() if arch in archs]
            raise ConfigError(f"model.arch '{arch}' does not learn from data.kind '{kind}': {why}; use model.arch "
                              f"{' or '.join(fits)}, or data.kind {' or '.join(others)} for this model")

    @classmethod
    def from_dict(cls, raw: Any) -> RunConfig:
        """Validate a parsed YAML mapping; a null ``model.vocab_size`` is read from the data source."""
        require(isinstance(raw, dict), f"a run config must be a mapping of seed/model/data/train, got {type(raw).__name__}")
        known_fields(raw, cls, "a run config", "top-level key")
        seed = _coerce(int, raw.get("seed", 0), "seed")
        data_raw = dict(_mapping(raw.get("data", {}), "data"))
        data = DataConfig(kind=data_raw.pop("kind", DataConfig.kind), options=data_raw)
        train = _build_dataclass(TrainConfig, _mapping(raw.get("train", {}), "train"), "train")
        model_raw = dict(_mapping(raw.get("model", {}), "model"))
        model_cls, _ = lookup("model.arch", model_raw.get("arch", "decoder"), ARCHS)
        hints = typing.get_type_hints(model_cls)
        # Known keys are converted here; the config's own from_dict names unknown ones (with its hints). A null
        # vocab_size means "from the data"; a null anywhere else is checked against the key's type like any value.
        values = {k: _coerce(hints[k], v, f"model.{k}") if k in hints and (v is not None or k != "vocab_size")
                  else v for k, v in model_raw.items()}
        if values.get("vocab_size") is None:
            # Everything else is checked first: building the source may mean preparing a corpus.
            cls(seed=seed, model=model_cls.from_dict(values | {"vocab_size": sys.maxsize}), data=data, train=train)
            values["vocab_size"] = data.build(seed).vocab_size
        return cls(seed=seed, model=model_cls.from_dict(values), data=data, train=train)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists for tuples), so ``yaml.safe_dump`` round-trips through ``from_dict``."""
        train = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self.train).items()}
        # Every metric implies its mode: a saved mode would refuse the config.yaml reused with another best_metric.
        train["best_mode"] = None
        return {"seed": self.seed, "model": self.model.to_dict(), "data": self.data.to_dict(), "train": train}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config, apply ``key.path=value`` overrides, validate. A section given as a string
    names a YAML file that holds it (see ``section_file``); overrides then change that file's values."""
    raw = read_yaml(path)
    require(raw not in (None, {}) or bool(overrides), f"{path} is empty: a run config holds seed, model, data and "
                                                      "train (examples: src/poslab/configs/tasks/*.yaml)")
    raw = {} if raw is None else raw
    require(isinstance(raw, dict), f"{path} must hold a mapping of seed/model/data/train, got {type(raw).__name__}")
    _read_section_files(raw, Path(path).parent)
    for item in overrides:
        apply_override(raw, item)
        _read_section_files(raw, Path.cwd())  # `--set model=paper/dstg` names a file, which later --sets change
    return RunConfig.from_dict(raw)


# A run config's sections (besides its seed), which `--set SECTION=null` would drop whole
SECTIONS = ("model", "data", "train")


def _read_section_files(raw: dict[str, Any], folder: Path) -> None:
    for section in SECTIONS:
        if isinstance(raw.get(section), str):
            raw[section] = section_file(raw[section], section, folder)


def section_file(name: str, section: str, folder: Path) -> dict[str, Any]:
    """The mapping in the YAML file ``name``: relative to ``folder`` (the run config's), then to the current
    directory. A model section may also name a ready config as SCALE/NAME (``paper/dstg``:
    configs/models/paper/dstg.yaml in the package), so that a run config can share one model file."""
    path = Path(name)
    candidates = [path] if path.is_absolute() else [folder / path, path]
    scale, _, ready = name.partition("/")
    if section == "model" and scale in READY_SCALES and ready in READY:
        candidates.append(READY_DIR / scale / f"{ready}.yaml")
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        also = (f", nor a ready config ({', '.join(f'{s}/{r}' for s in READY_SCALES for r in READY)})"
                if section == "model" else "")
        raise ConfigError(f"{section}: '{cut(name)}' is neither a mapping of {section} keys nor a YAML file (looked "
                          f"for {' and '.join(str(c) for c in dict.fromkeys(candidates))}){also}")
    values = read_yaml(found, f"{section} file")
    require(isinstance(values, dict), f"{section} file {found} must hold a mapping of {section} keys, got "
                                      f"{type(values).__name__}")
    return values


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested mapping; the value is parsed as YAML (``1e-3``, ``null``, ``[1, 2]``)."""
    key, sep, text = item.partition("=")
    require(bool(sep) and bool(key), f"--set expects key.path=value (e.g. train.lr=1e-3), got '{cut(item)}'")
    try:
        value = load_yaml_text(text)
    except (yaml.YAMLError, ValueError):  # ValueError: a date 2001-13-01, an integer of 5000 digits
        raise ConfigError(f"--set {key}: value '{cut(text)}' is not valid YAML; to give it as a string, quote it "
                          f"inside the argument: '{cut(key)}=\"{cut(text)}\"'") from None
    *parents, leaf = key.split(".")
    # A whole section set to null trained on its defaults without a word (model.rp=null, deeper, is a setting)
    require(parents or value is not None or leaf not in SECTIONS or not isinstance(raw.get(leaf), dict),
            f"--set {key}=null would drop the config's whole '{key}' section; set its keys instead "
            f"(--set {key}.KEY=VALUE)")
    node = raw
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        require(isinstance(node, dict), f"--set {key}: '{'.'.join(parents[:i + 1])}' is not a mapping")
    node[leaf] = value


def _mapping(value: Any, section: str) -> dict[str, Any]:
    value = {} if value is None else value
    require(isinstance(value, dict), f"{section} must be a mapping of keys to values, got {type(value).__name__}")
    return value


def _build_dataclass(cls: type, values: dict[str, Any], section: str) -> Any:
    """cls(**values) with each value checked and converted to its annotated type."""
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(hints[k], v, f"{section}.{k}") for k, v in known_fields(values, cls, section).items()})


def _coerce(kind: Any, value: Any, key: str) -> Any:
    """Convert a YAML value to an annotated type, or say which key is wrong and what it needs.

    YAML 1.1 reads ``3e-4`` as a string, so numbers are accepted in any spelling Python's float() takes.
    Types outside int/float/bool/str/tuple/Optional (e.g. nested configs) pass through to their own checks.
    """
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key)
    if origin is tuple:
        require(isinstance(value, (list, tuple)) and len(value) == len(args),
                f"{key} must be a list of {len(args)} values, got {shown(value)}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if kind in (int, float):
        number = parse_number(value)
        require(number is not None, f"{key} must be a number, got {shown(value)}")
        if kind is int:
            require(isinstance(number, int) or float(number).is_integer(),
                    f"{key} must be an integer, got {shown(value)}")
            return int(number)
        # nan and inf pass the range checks (nan compares false, inf > 0) and only surface as a NaN loss.
        require(finite(number), f"{key} must be a finite number, got {shown(value)}")
        return float(number)
    if kind in (bool, str):
        check_type(key, value, kind)
    return value
