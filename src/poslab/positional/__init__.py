"""Positional schemes: one file each, registered below by its import and one ``SCHEMES`` entry (see ``base.py``
for the interface and what adding one takes)."""
from __future__ import annotations

import torch

from poslab.errors import lookup, require
from poslab.positional.absolute import LearnedAbsolute
from poslab.positional.alibi import ALiBi
from poslab.positional.base import AttentionGeometry, InputPositional, LayerPositional, PositionalConfig, Scheme
from poslab.positional.cope import CoPE
from poslab.positional.fire import FIRE
from poslab.positional.kerple import KERPLE
from poslab.positional.nope import NoPE
from poslab.positional.pope import PoPE
from poslab.positional.relative_bias import T5RelativeBias
from poslab.positional.rope import RoPE
from poslab.positional.sinusoidal import Sinusoidal
from poslab.positional.xpos import XPos

SCHEMES: dict[str, type[Scheme]] = {
    "nope": NoPE,
    "learned": LearnedAbsolute,
    "sinusoidal": Sinusoidal,
    "rope": RoPE,
    "t5": T5RelativeBias,
    "alibi": ALiBi,
    "pope": PoPE,
    "xpos": XPos,
    "kerple": KERPLE,
    "fire": FIRE,
    "cope": CoPE,
}


def get_scheme(name: str) -> type[Scheme]:
    return lookup("positional scheme", name, SCHEMES)


def build_positional(
    config: PositionalConfig, geometry: AttentionGeometry
) -> tuple[InputPositional | None, list[LayerPositional | None]]:
    scheme = get_scheme(config.name)
    require(geometry.causal or not scheme.causal_only,
            f"{config.name} needs a causal model (arch: decoder): {scheme.causal_reason}")
    return scheme.build(scheme.Options(**config.options), geometry)


def owned_once(layer_pos: list[LayerPositional | None]) -> torch.nn.ModuleList:
    """The distinct per-layer modules, for a model to own: a scheme may hand every layer the same module
    (RoPE, a shared T5 table), which blocks then hold by reference and the model saves once."""
    unique: list[LayerPositional] = []
    for module in layer_pos:
        if module is not None and all(module is not u for u in unique):
            unique.append(module)
    return torch.nn.ModuleList(unique)


__all__ = [
    "SCHEMES", "AttentionGeometry", "InputPositional", "LayerPositional", "PositionalConfig", "Scheme",
    "build_positional", "get_scheme", "owned_once",
]
