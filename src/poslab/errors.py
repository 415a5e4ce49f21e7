"""Errors a user can fix. The CLI prints ``str(err)`` as one line on stderr and exits with code 2."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class PoslabError(Exception):
    """Base of every error caused by bad input (config, data, command line, checkpoint)."""


class ConfigError(PoslabError, ValueError):
    """A configuration value is invalid; the message says what to change."""


class DataError(PoslabError):
    """Input data is missing, empty or malformed."""


class CheckpointError(PoslabError):
    """A checkpoint is missing, corrupt or belongs to another model."""


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless condition holds (config validation reads top to bottom)."""
    if not condition:
        raise ConfigError(message)


def unknown_key_message(kind: str, key: str, valid: Iterable[str]) -> str:
    """'unknown <kind> 'x'; did you mean 'y'? valid: a, b, c' -- the closest match first."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown {kind} '{key}'{hint} (valid: {', '.join(valid)})"


class InputError(PoslabError, ValueError):
    """A tensor input does not fit the model (e.g. a sequence longer than a learned position table)."""
