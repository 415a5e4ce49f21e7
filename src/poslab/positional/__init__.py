"""Positional schemes: one file each, one registry line each (see ``base.py`` for the interface)."""
from __future__ import annotations

from poslab.errors import lookup
from poslab.positional.absolute import LearnedAbsolute
from poslab.positional.alibi import ALiBi
from poslab.positional.base import AttentionGeometry, InputPositional, LayerPositional, PositionalConfig, Scheme
from poslab.positional.nope import NoPE
from poslab.positional.pope import PoPE
from poslab.positional.relative_bias import T5RelativeBias
from poslab.positional.rope import RoPE
from poslab.positional.sinusoidal import Sinusoidal

SCHEMES: dict[str, type[Scheme]] = {
    "nope": NoPE,
    "learned": LearnedAbsolute,
    "sinusoidal": Sinusoidal,
    "rope": RoPE,
    "t5": T5RelativeBias,
    "alibi": ALiBi,
    "pope": PoPE,
}


def get_scheme(name: str) -> type[Scheme]:
    return lookup("positional scheme", name, SCHEMES)


def build_positional(
    config: PositionalConfig, geometry: AttentionGeometry
) -> tuple[InputPositional | None, list[LayerPositional | None]]:
    scheme = get_scheme(config.name)
    return scheme.build(scheme.Options(**config.options), geometry)


__all__ = [
    "SCHEMES", "AttentionGeometry", "InputPositional", "LayerPositional", "PositionalConfig", "Scheme",
    "build_positional", "get_scheme",
]
