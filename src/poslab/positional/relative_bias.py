"""T5 relative position bias (Raffel et al. 2020): a learned scalar per bucket of k - q, added to logits.

Buckets are identical to Hugging Face transformers' T5 ``_relative_position_bucket``: half of them
exact for short distances, the rest log-spaced up to ``max_distance``; bidirectional buckets keep the
sign, causal ones only look back. DSTG uses 32 buckets, max distance 128, one table per layer,
zero-initialised (papers/dstg.md).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from poslab.errors import require
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass


@options_dataclass
class T5Options:
    scheme = "t5"
    num_buckets: int = 32
    max_distance: int = 128
    #: None = bidirectional for encoders, causal (look-back only) for decoders.
    bidirectional: bool | None = None
    #: One scalar per head and bucket (T5), or one per bucket shared by all heads.
    per_head: bool = True
    #: One table for every layer (T5) instead of one per layer (DSTG).
    shared_across_layers: bool = False
    init_std: float = 0.0

    def __post_init__(self) -> None:
        require(self.num_buckets >= 4, f"t5.num_buckets must be >= 4, got {self.num_buckets}")
        # Direction left to the model: the bidirectional case's bound, the smaller; build checks the other.
        self.check_range(self.bidirectional is not False)
        require(self.init_std >= 0, f"t5.init_std must be >= 0, got {self.init_std}")

    def check_range(self, bidirectional: bool) -> None:
        """The log-spaced buckets span max_exact..max_distance: an empty span divides by log(1) = 0."""
        exact = exact_range(self.num_buckets, bidirectional)
        require(self.max_distance > exact,
                f"t5.max_distance must exceed the exact range ({exact}) of {self.num_buckets} "
                f"{'bidirectional' if bidirectional else 'causal'} buckets, got {self.max_distance}")


def exact_range(num_buckets: int, bidirectional: bool) -> int:
    """Distances below this get a bucket each: half of a direction's buckets (a bidirectional table halves them)."""
    return (num_buckets // 2 if bidirectional else num_buckets) // 2


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """relative_position = key position - query position (any shape, long) -> bucket ids (same shape)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp(min=1) only guards log(0) on entries is_small already routes to the exact branch
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativeBias(LayerPositional):
    def __init__(self, opts: T5Options, n_heads: int, bidirectional: bool) -> None:
        super().__init__()
        self.opts, self.n_heads, self.bidirectional = opts, n_heads, bidirectional
        self.weight = nn.Parameter(torch.empty(opts.num_buckets, n_heads if opts.per_head else 1))
        self.init_weights(0.0, 0.0)

    def init_weights(self, mean: float, std: float) -> None:
        # Its own init, not the model's: DSTG zero-initialises the bias (papers/dstg.md).
        if self.opts.init_std > 0:
            init.normal_(self.weight, std=self.opts.init_std)
        else:
            init.zeros_(self.weight)

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        rel = k_pos[:, None, :] - q_pos[:, :, None]  # (batch, n, m)
        buckets = relative_position_bucket(rel, self.bidirectional, self.opts.num_buckets, self.opts.max_distance)
        return F.embedding(buckets, self.weight).permute(0, 3, 1, 2).expand(-1, self.n_heads, -1, -1)  # (batch, heads, n, m)


class T5RelativeBias(Scheme):
    name = "t5"
    relative = True
    Options = T5Options
    bias_only = True

    @classmethod
    def build(cls, options: T5Options, geometry: AttentionGeometry):
        bidirectional = (not geometry.causal) if options.bidirectional is None else options.bidirectional
        options.check_range(bidirectional)
        if options.shared_across_layers:
            return None, [RelativeBias(options, geometry.n_heads, bidirectional)] * geometry.n_layers
        return None, [RelativeBias(options, geometry.n_heads, bidirectional) for _ in range(geometry.n_layers)]
