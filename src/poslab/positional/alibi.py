"""ALiBi (Press et al. 2022): a fixed linear penalty -slope_h * |k - q| on the logits.

Slopes follow the reference recipe for any head count: the geometric sequence 2^(-8i/n) for the
largest power of two n <= heads, then every other slope of the sequence for 2n, until all heads
have one. Causal models only see k <= q, so the penalty equals slope * (k - q) there.
"""
from __future__ import annotations

import math

import torch

from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass


@options_dataclass
class ALiBiOptions:
    scheme = "alibi"


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Press et al.'s per-head slopes, (n_heads,): a geometric sequence from 2^(-8/n) for a power of two n,
    else the closest power's slopes plus every other one of twice that power's (as Bloom builds them)."""
    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBiBias(LayerPositional):
    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def init_weights(self, mean: float, std: float) -> None:
        # Buffers are not saved; a model built on the meta device (from_pretrained) recomputes them here.
        with torch.no_grad():
            self.slopes.copy_(alibi_slopes(self.slopes.shape[0]))

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs().float()  # (batch, n, m)
        return -self.slopes[None, :, None, None] * distance[:, None]


class ALiBi(Scheme):
    name = "alibi"
    Options = ALiBiOptions
    bias_only = True

    @classmethod
    def build(cls, options: ALiBiOptions, geometry: AttentionGeometry):
        return None, [ALiBiBias(geometry.n_heads)] * geometry.n_layers
