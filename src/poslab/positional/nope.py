"""NoPE: no positional information at all. Causal attention alone still lets a decoder infer position
(papers/adjacency.md); a bidirectional encoder without it is permutation-equivariant."""
from __future__ import annotations

from poslab.positional.base import AttentionGeometry, Scheme
from poslab.positional.options import options_dataclass


@options_dataclass
class NoPEOptions:
    scheme = "nope"


class NoPE(Scheme):
    name = "nope"
    relative = True  # trivially: no position at all
    Options = NoPEOptions

    @classmethod
    def build(cls, options: NoPEOptions, geometry: AttentionGeometry):
        return None, [None] * geometry.n_layers
