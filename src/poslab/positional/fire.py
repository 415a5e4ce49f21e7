"""FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"): a learned function of the query-normalised distance, added to the logits.

For query position i and key position j <= i, every layer adds

    b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) ),    psi(x) = log(c x + 1),

one value per head: f_theta is an MLP 1 -> hidden -> n_heads with a ReLU. Dividing by psi(i) maps every
distance a query can see into [0, 1], so a longer sequence than the training one interpolates between
inputs the MLP has seen instead of extrapolating past them ("progressive interpolation"); the threshold L
keeps short queries from being normalised by a tiny psi(i): below it the input is psi(i - j) / psi(L),
which depends on i - j alone, and only queries past L see their distances squeezed. No table and no length
limit: any position works.

Following the paper (as recalled here, the paper not being at hand to check):
- the formula above, with psi(x) = log(c x + 1) and the normalisation by psi(max(L, i));
- f_theta an MLP with one hidden layer of 32 ReLU units and one output per head (``hidden``);
- c and L learnable scalars, c initialised to 0.1 (``c_init``), L to 512 (``threshold_init``);
- one FIRE module per layer, the paper's default; ``shared_across_layers: true`` gives every layer the same
  module (the paper's layer-shared variant, as recalled): one set of parameters, each layer still evaluating it.

poslab's choices:
- c = softplus(raw_c) (raw_c a free parameter initialised to softplus^-1(c_init)) keeps c > 0, and it is
  floored at 1e-6 so psi never divides 0 by 0 once raw_c drifts far negative;
- L is used as max(L, 1): positions start at 0, and psi(max(L, i)) at i = 0 must stay above 0 if a learned L
  falls below 1 (L takes no gradient there); ``learn_threshold: false`` freezes L at ``threshold_init``
  (a Python constant, not a parameter);
- the output layer has no bias: a per-head constant adds the same to every logit of a query's row, which the
  softmax cancels, so it would never get a gradient;
- the MLP is initialised as PyTorch's nn.Linear is (uniform in +-1/sqrt(fan_in): w1 and b1 in +-1, w2 in
  +-1/sqrt(hidden)), ignoring the model's normal(mean, std): f_theta's input lies in [0, 1] (or [-1, 1]),
  not in the embeddings' scale;
- bidirectional models (encoders): the paper defines the causal case; here the input is the signed
  sign(i - j) psi(|i - j|) / psi(max(L, i)), so the MLP can tell past from future;
- a causal model's future keys (j > i, masked by attention) get the distance 0: their bias is never used,
  but psi of a negative distance would be the log of a negative number, and a NaN there poisons gradients;
- the bias is computed in at least fp32 (the parameters are upcast after a model.to(bf16)), and
  attention casts it to the logits' dtype (ALiBi's is fp32 too; T5's follows its table's dtype).

Not shift-invariant (``relative = False``): past L a query's distances are divided by its own psi(i).
Cost: the MLP runs on every (query, key) pair, a (batch, n, m, hidden) activation per layer (batch is 1 when
the positions are the model's default arange). ``--plan``'s FLOP counter sees its hidden -> heads matmul,
2 n m hidden heads per layer forward; the 1 -> hidden layer is a broadcast, elementwise work it does not count.
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

#: c's floor: keeps psi(max(L, i)) > 0 (0 / 0 would be NaN) when softplus(raw_c) underflows.
MIN_C = 1e-6


@options_dataclass
class FIREOptions:
    scheme = "fire"
    #: Width of f_theta's hidden layer (the paper's 32).
    hidden: int = 32
    #: psi's initial scale c (the paper's 0.1); learned, kept positive through a softplus.
    c_init: float = 0.1
    #: The initial threshold L of psi(max(L, i)) (the paper's 512): queries before it see plain relative
    #: distances, later ones distances normalised by their own position.
    threshold_init: float = 512.0
    #: Learn L (the paper) or keep it at threshold_init.
    learn_threshold: bool = True
    #: One FIRE module for every layer instead of one per layer (T5's option of that name).
    shared_across_layers: bool = False

    def __post_init__(self) -> None:
        require(self.hidden >= 1, f"fire.hidden must be a positive integer (the MLP's width), got {self.hidden}")
        require(self.c_init > 0, f"fire.c_init must be > 0 (psi(x) = log(c x + 1) needs c > 0), got {self.c_init}")
        require(self.threshold_init >= 1,
                f"fire.threshold_init must be >= 1 (the floor L of max(L, i); positions start at 0), "
                f"got {self.threshold_init}")


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y > 0, from Python numbers (init_weights must not read tensors)."""
    return y + math.log(-math.expm1(-y))  # log(exp(y) - 1) without overflow for large y


class FIREBias(LayerPositional):
    """One layer's FIRE bias. Parameters: w1, b1 (hidden,) and w2 (n_heads, hidden) -- f_theta;
    raw_c (1,) -- c = softplus(raw_c); threshold (1,) -- L, a parameter only when learned."""

    def __init__(self, opts: FIREOptions, n_heads: int, bidirectional: bool) -> None:
        super().__init__()
        self.opts, self.bidirectional = opts, bidirectional
        self.w1 = nn.Parameter(torch.empty(opts.hidden))
        self.b1 = nn.Parameter(torch.empty(opts.hidden))
        self.w2 = nn.Parameter(torch.empty(n_heads, opts.hidden))
        self.raw_c = nn.Parameter(torch.empty(1))
        self.threshold = nn.Parameter(torch.empty(1)) if opts.learn_threshold else None
        self.init_weights(0.0, 0.02)

    def init_weights(self, mean: float, std: float) -> None:
        # nn.Linear's default init (kaiming-uniform with a = sqrt(5) is uniform in +-1/sqrt(fan_in)), not the
        # model's normal(mean, std); bounds from Python numbers, so a meta-device model takes this too.
        first, second = 1.0, 1.0 / math.sqrt(self.opts.hidden)
        init.uniform_(self.w1, -first, first)
        init.uniform_(self.b1, -first, first)
        init.uniform_(self.w2, -second, second)
        init.constant_(self.raw_c, inverse_softplus(self.opts.c_init))
        if self.threshold is not None:
            init.constant_(self.threshold, self.opts.threshold_init)

    def c(self, dtype: torch.dtype) -> torch.Tensor:
        """psi's scale, (1,)."""
        return F.softplus(self.raw_c.to(dtype)).clamp(min=MIN_C)

    def inputs(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q_pos (batch, n), k_pos (batch, m) -> f_theta's inputs (batch, n, m): the normalised distances."""
        i = q_pos[:, :, None].to(dtype)  # (batch, n, 1)
        rel = (q_pos[:, :, None] - k_pos[:, None, :]).to(dtype)  # i - j, (batch, n, m); exact in integers first
        c = self.c(dtype)
        # L is floored at 1: psi(max(L, 0)) = 0 would divide a query at position 0 by zero (a padded token's
        # negative position falls back to L too)
        if self.threshold is None:
            top = i.clamp(min=max(self.opts.threshold_init, 1.0))
        else:
            top = torch.maximum(i, self.threshold.to(dtype).clamp(min=1.0))
        scale = torch.log1p(c * top)  # psi(max(L, i)), (batch, n, 1)
        if self.bidirectional:
            return torch.sign(rel) * torch.log1p(c * rel.abs()) / scale
        return torch.log1p(c * rel.clamp(min=0)) / scale  # future keys are masked: any finite value does

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """f_theta: x (...) -> (..., n_heads), in x's dtype."""
        dtype = x.dtype
        hidden = torch.relu(x[..., None] * self.w1.to(dtype) + self.b1.to(dtype))  # a width-1 input needs no matmul
        return F.linear(hidden, self.w2.to(dtype))

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos (batch, n), k_pos (batch, m) long -> (batch, heads, n, m), fp32 (fp64 for an fp64 model)."""
        dtype = torch.promote_types(self.w2.dtype, torch.float32)
        return self.mlp(self.inputs(q_pos, k_pos, dtype)).permute(0, 3, 1, 2)


class FIRE(Scheme):
    name = "fire"
    relative = False
    Options = FIREOptions
    bias_only = True

    @classmethod
    def build(cls, options: FIREOptions, geometry: AttentionGeometry):
        if options.shared_across_layers:
            return None, [FIREBias(options, geometry.n_heads, not geometry.causal)] * geometry.n_layers
        return None, [FIREBias(options, geometry.n_heads, not geometry.causal) for _ in range(geometry.n_layers)]
