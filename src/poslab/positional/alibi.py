"""ALiBi (Press et al. 2022): a fixed linear penalty -slope_h * |k - q| on the logits.

Slopes follow the reference recipe for any head count: the geometric sequence 2^(-8i/n) for the
largest power of two n <= heads, then every other slope of the sequence for 2n, until all heads
have one. Causal models only see k <= q, so the penalty equals slope * (k - q) there.

``heads`` < 1 biases only a share of the heads, as the PoPE paper's half-head ALiBi baseline does: the
first round(heads * n_heads) heads take the slopes for that many heads, the rest take slope 0 and attend
with no positional bias (NoPE heads).
"""
from __future__ import annotations

import math

import torch

from poslab.errors import require
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass


@options_dataclass
class ALiBiOptions:
    scheme = "alibi"
    #: The share of heads with a bias (the first round(heads * n_heads)); the others have none.
    heads: float = 1.0

    def __post_init__(self) -> None:
        require(0 < self.heads <= 1,
                f"alibi.heads must lie in (0, 1] (the share of heads with a bias), got {self.heads}")

    def biased_heads(self, n_heads: int) -> int:
        """How many of n_heads heads get a slope: round(heads * n_heads), checked to be at least one."""
        biased = round(self.heads * n_heads)
        require(biased >= 1, f"alibi.heads {self.heads} of {n_heads} heads biases {biased} heads; it must bias at "
                             f"least one: raise alibi.heads or n_heads")
        return biased


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


def partial_alibi_slopes(n_heads: int, biased: int) -> torch.Tensor:
    """(n_heads,): the slopes for ``biased`` heads, then zeros for the n_heads - biased unbiased heads."""
    return torch.cat((alibi_slopes(biased), torch.zeros(n_heads - biased)))


class ALiBiBias(LayerPositional):
    fp32_tables = ("slopes",)

    def __init__(self, n_heads: int, biased: int) -> None:
        super().__init__()
        self.biased = biased
        self.register_buffer("slopes", partial_alibi_slopes(n_heads, biased), persistent=False)

    def init_weights(self, mean: float, std: float) -> None:
        # Buffers are not saved; a model built on the meta device (from_pretrained) recomputes them here.
        with torch.no_grad():
            self.slopes.copy_(partial_alibi_slopes(self.slopes.shape[0], self.biased))

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs().float()  # (batch, n, m)
        return -self.slopes[None, :, None, None] * distance[:, None]


class ALiBi(Scheme):
    name = "alibi"
    relative = True
    Options = ALiBiOptions
    bias_only = True

    @classmethod
    def build(cls, options: ALiBiOptions, geometry: AttentionGeometry):
        biased = options.biased_heads(geometry.n_heads)
        return None, [ALiBiBias(geometry.n_heads, biased)] * geometry.n_layers
