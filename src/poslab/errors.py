"""Errors a user can fix. The CLI prints ``str(err)`` as one line on stderr and exits with code 2."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import reprlib
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class PoslabError(Exception):
    """Base of every error caused by bad input (config, data, command line, checkpoint)."""


class ConfigError(PoslabError, ValueError):
    """A configuration value is invalid; the message says what to change."""


class DataError(PoslabError):
    """Input data is missing, empty or malformed."""


class CheckpointError(PoslabError):
    """A checkpoint is missing, corrupt or belongs to another model."""


# A bad value is shown in its message at most this long: a few bytes of YAML aliases expand into a list of
# millions of items, and an error line must stay one readable line (and be cheap to build).
SHOWN_CHARS = 200


class _Shown(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxset, self.maxdict = 3, 8, 8, 8, 8
        self.maxstring, self.maxother, self.maxlong = 120, 120, 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:  # repr() refuses ints past 4300 digits; a message needs no digits of it
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


def shown(value: Any) -> str:
    """repr(value) for an error message, cut to about SHOWN_CHARS characters without building the whole repr."""
    return cut(_Shown().repr(value))


def cut(text: str) -> str:
    """text, or its first SHOWN_CHARS characters and '...' when it is longer."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless condition holds (config validation reads top to bottom)."""
    if not condition:
        raise ConfigError(message)


def unknown_key_message(kind: str, key: object, valid: Iterable[str]) -> str:
    """'unknown <kind> 'x'; did you mean 'y'? valid: a, b, c' -- the closest match first. The key may be
    any parsed YAML value (null, a list), which is what a user gets wrong."""
    valid = sorted(valid)
    key = cut(key) if isinstance(key, str) else shown(key)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown {kind} '{key}'{hint} (valid: {', '.join(valid)})"


def lookup(kind: str, name: object, registry: Mapping[str, T]) -> T:
    """registry[name], or ConfigError naming the closest valid name. A name is checked to be a string
    first: an unhashable one (a list from YAML) would raise TypeError at ``name in registry``."""
    if not isinstance(name, str) or name not in registry:
        raise ConfigError(unknown_key_message(kind, name, registry))
    return registry[name]


def parse_number(value: Any) -> int | float | None:
    """A config value as a number, or None. YAML 1.1 reads ``3e-4`` as a string, so a string is parsed in any
    spelling int() or float() takes (int first: float() rounds integers past 2^53); booleans are not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            with contextlib.suppress(ValueError):
                return parse(value)
    return None


def finite(number: int | float) -> bool:
    """Whether a number is finite, an int too large for a float included (math.isfinite overflows on one)."""
    return -sys.float_info.max <= number <= sys.float_info.max


def is_int(value: Any) -> bool:
    """Whether value is an int and not a bool (True is an int subclass, so ``max_seq_len: true`` would pass)."""
    return isinstance(value, int) and not isinstance(value, bool)


# How a message names each annotated type: the words a YAML user knows.
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _allowed(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def check_type(name: str, value: Any, hint: Any) -> None:
    """Raise ConfigError unless value fits the annotation (int, float, str, bool, or X | None). A float
    must be finite: nan or inf in a config only ever surfaces later as a non-finite loss."""
    allowed = _allowed(hint)
    for kind in allowed:
        if kind is type(None) and value is None:
            return
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            require(finite(value), f"{name} must be a finite number, got {shown(value)}")
            return
        if kind is int and is_int(value):
            return
        if kind in (str, bool) and isinstance(value, kind):
            return
    raise ConfigError(f"{name} must be {' or '.join(_TYPE_WORDS[k] for k in allowed)}, got {shown(value)}")


def check_fields(config: Any, prefix: str = "") -> None:
    """check_type on every field of a dataclass whose annotation check_type knows, under the name
    ``prefix + field``. Called first in a config's ``__post_init__``, so its range checks compare values of
    the right type and a new field is checked without anyone remembering to; other fields (nested configs,
    mappings, tuples) are left to the config's own checks."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if all(kind in _TYPE_WORDS for kind in _allowed(hints[f.name])):
            check_type(prefix + f.name, getattr(config, f.name), hints[f.name])


def known_fields(values: Any, cls: type, what: str, kind: str | None = None) -> dict[str, Any]:
    """``values`` as keyword arguments for dataclass ``cls``, or ConfigError: '<what> must be a mapping' for
    anything else, 'unknown <kind> ...' with the closest spelling for a key that is not a field (kind
    defaults to '<what> key')."""
    require(isinstance(values, dict), f"{what} must be a mapping, got {type(values).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            raise ConfigError(unknown_key_message(kind or f"{what} key", key, names))
    return dict(values)


class InputError(PoslabError, ValueError):
    """A tensor input does not fit the model (e.g. a sequence longer than a learned position table)."""


def check_token_ids(input_ids: Any, vocab_size: int) -> None:
    """InputError unless every id in the tensor lies in [0, vocab_size): the embedding would raise an
    IndexError (or, on CUDA, a device-side assert that kills the process). One min/max pass per forward."""
    if input_ids.numel() == 0 or input_ids.device.type == "meta":
        return
    low, high = (int(v) for v in input_ids.aminmax())
    if low < 0 or high >= vocab_size:
        raise InputError(f"token ids must lie in [0, {vocab_size}) for this model's vocabulary; got ids in "
                         f"[{low}, {high}]; encode the text with the model's tokenizer or raise model.vocab_size")


def check_attention_mask(mask: Any, batch: int, length: int) -> None:
    """InputError unless ``mask`` is None or (batch, length), 1 for real tokens: the models build their causal
    and padding masks themselves, and a 3-D or 4-D mask failed in a broadcast deep inside attention."""
    if mask is None:
        return
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] != length:
        raise InputError(f"attention_mask must be (batch, length) = ({batch}, {length}) with 1 for real tokens and 0 "
                         f"for padding, got shape {tuple(mask.shape)}; the model makes its causal and padding masks "
                         "itself, so pass the 2-D padding mask (packed documents: position_ids)")
    if mask.numel() and mask.device.type != "meta":
        low, high = (float(v) for v in mask.aminmax())
        # An additive mask (0 for real tokens, a large negative number for padding) was read the other way round
        if {low, high} - {0.0, 1.0}:
            raise InputError(f"attention_mask must hold 1 for real tokens and 0 for padding, got values in [{low:g}, "
                             f"{high:g}]; pass the 0/1 padding mask, not an additive one (0 / -inf)")


def check_position_ids(position_ids: Any, batch: int, length: int) -> None:
    """InputError unless ``position_ids`` is None or an integer (1 or batch, length) tensor: other shapes
    and dtypes failed in a broadcast or an embedding deep inside a scheme."""
    if position_ids is None:
        return
    dtype = getattr(position_ids, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise InputError(f"position_ids must be an integer tensor (torch.long), got "
                         f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise InputError(f"position_ids must be (batch, length) = ({batch}, {length}) or (1, {length}) for every "
                         f"sequence alike, got shape {tuple(position_ids.shape)}")
