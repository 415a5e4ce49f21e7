"""Learned absolute position embeddings, added to the token embeddings (GPT-2, BERT, AP-NeoBERT)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from poslab.errors import InputError, require
from poslab.positional.base import AttentionGeometry, InputPositional, Scheme
from poslab.positional.options import options_dataclass


@options_dataclass
class LearnedAbsoluteOptions:
    scheme = "learned"
    #: Table size; None = the model's max_seq_len.
    max_positions: int | None = None

    def __post_init__(self) -> None:
        require(self.max_positions is None or self.max_positions > 0,
                f"learned.max_positions must be positive, got {self.max_positions}")


class LearnedTable(InputPositional):
    def __init__(self, max_positions: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions, d_model))
        self.init_weights(0.0, 0.02)

    def init_weights(self, mean: float, std: float) -> None:
        init.normal_(self.weight, mean=mean, std=std)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        limit = self.weight.shape[0]
        # Meta tensors (poslab.experiments.plan counts FLOPs on them) hold no positions to check.
        if positions.numel() and not positions.is_meta:
            low, high = (int(v) for v in positions.aminmax())
            if low < 0:
                raise InputError(f"position {low} is negative; the learned position table starts at 0")
            if high >= limit:
                raise InputError(f"position {high} is beyond the learned position table ({limit} positions); "
                                 f"use sequences of at most {limit} tokens or a model with a larger max_seq_len")
        return x + F.embedding(positions, self.weight).to(x.dtype)


class LearnedAbsolute(Scheme):
    name = "learned"
    Options = LearnedAbsoluteOptions

    @classmethod
    def build(cls, options: LearnedAbsoluteOptions, geometry: AttentionGeometry):
        size = options.max_positions or geometry.max_seq_len
        return LearnedTable(size, geometry.d_model), [None] * geometry.n_layers
