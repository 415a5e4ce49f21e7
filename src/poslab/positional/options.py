"""Helpers shared by the schemes' option dataclasses."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from poslab.errors import ConfigError, check_type, known_fields, parse_number


def options_dataclass(cls):
    """A frozen dataclass whose constructor names unknown keys and their closest valid spelling, and
    checks each value against its annotation before the scheme's own ``__post_init__`` compares it."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    init = cls.__init__

    def __init__(self, **kwargs: Any) -> None:
        hints = typing.get_type_hints(cls)
        if kwargs and not dataclasses.fields(cls):  # known_fields would say "(valid: )"
            raise ConfigError(f"positional scheme '{cls.scheme}' takes no options; remove "
                              f"{', '.join(map(str, kwargs))}")
        kwargs = known_fields(kwargs, cls, f"{cls.scheme} options", f"option for positional scheme '{cls.scheme}'")
        for key, value in kwargs.items():
            kwargs[key] = _yaml_number(value, hints[key])
            check_type(f"{cls.scheme}.{key}", kwargs[key], hints[key])
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls


def _yaml_number(value: Any, hint: Any) -> Any:
    """A numeric option written as YAML 1.1 reads ``1e4`` (a string) as that number, as model and train numbers
    are; anything else is left for check_type to judge."""
    allowed = typing.get_args(hint) or (hint,)
    number = parse_number(value) if isinstance(value, str) else None
    if number is None:
        return value
    if float in allowed:
        return float(number)
    return int(number) if int in allowed and float(number).is_integer() else value
