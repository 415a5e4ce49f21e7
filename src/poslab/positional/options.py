"""Helpers shared by the schemes' option dataclasses."""
from __future__ import annotations

import dataclasses
from typing import Any

from poslab.errors import ConfigError, unknown_key_message


def options_dataclass(cls):
    """A frozen dataclass whose constructor names unknown keys and their closest valid spelling."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    init = cls.__init__
    fields = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in fields:
                raise ConfigError(unknown_key_message(f"option for positional scheme '{cls.scheme}'", key, fields))
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls
