"""Fixed sinusoidal position embeddings (Vaswani et al. 2017), added to the token embeddings.

PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)); computed on the fly, so any
position works (no table limit). As in Vaswani et al. (section 3.4) the token embeddings are multiplied by
sqrt(d) first (``scale_tokens``): the table's entries have RMS 1/sqrt(2), and token embeddings at the usual
N(0, 0.02) init added unscaled would sit ~35x below it, so position would drown content at the start.
"""
from __future__ import annotations

import math

import torch

from poslab.errors import require
from poslab.positional.base import AttentionGeometry, InputPositional, Scheme
from poslab.positional.options import options_dataclass


@options_dataclass
class SinusoidalOptions:
    scheme = "sinusoidal"
    base: float = 10000.0
    scale_tokens: bool = True

    def __post_init__(self) -> None:
        require(self.base > 1, f"sinusoidal.base must be > 1, got {self.base}")
        require(isinstance(self.scale_tokens, bool),
                f"sinusoidal.scale_tokens must be true or false, got {self.scale_tokens!r}")


def sinusoidal_table(positions: torch.Tensor, d: int, base: float) -> torch.Tensor:
    """positions (...,) -> (..., d) fp32, interleaved sin/cos."""
    inv_freq = base ** (-torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d)
    angle = positions.to(torch.float32)[..., None] * inv_freq
    table = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).flatten(-2)
    return table[..., :d]


class SinusoidalInput(InputPositional):
    def __init__(self, d_model: int, base: float, scale_tokens: bool) -> None:
        super().__init__()
        self.d_model, self.base = d_model, base
        self.token_scale = math.sqrt(d_model) if scale_tokens else 1.0

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., n, d_model) token embeddings, positions (..., n) -> (..., n, d_model)."""
        return x * self.token_scale + sinusoidal_table(positions, self.d_model, self.base).to(x.dtype)


class Sinusoidal(Scheme):
    name = "sinusoidal"
    Options = SinusoidalOptions

    @classmethod
    def build(cls, options: SinusoidalOptions, geometry: AttentionGeometry):
        return SinusoidalInput(geometry.d_model, options.base, options.scale_tokens), [None] * geometry.n_layers
