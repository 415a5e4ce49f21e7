"""Helpers shared by the schemes' option dataclasses."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from poslab.errors import ConfigError, check_type, unknown_key_message


def options_dataclass(cls):
    """A frozen dataclass whose constructor names unknown keys and their closest valid spelling, and
    checks each value against its annotation before the scheme's own ``__post_init__`` compares it."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    init = cls.__init__
    fields = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, **kwargs: Any) -> None:
        hints = typing.get_type_hints(cls)
        for key, value in kwargs.items():
            if key not in fields:
                raise ConfigError(unknown_key_message(f"option for positional scheme '{cls.scheme}'", key, fields))
            check_type(f"{cls.scheme}.{key}", value, hints[key])
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls
