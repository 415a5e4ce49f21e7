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

Following the paper and the code of its appendix (as the arithmetic-embeddings repository mcleish7/arithmetic,
``cramming/architectures/embeddings.py``, reproduces it):
- the formula above, psi(x) = log(|c x| + 1), the normalisation by psi(max(L, i)) + 1e-6;
- f_theta an MLP with one hidden layer of 32 ReLU units and one output per head (``hidden``), initialised as
  PyTorch's nn.Linear is (uniform in +-1/sqrt(fan_in): w1 and b1 in +-1, w2 in +-1/sqrt(hidden)), not with the
  model's normal(mean, std): its input lies in [0, 1], not in the embeddings' scale;
- c a learned scalar used through its absolute value, initialised to 0.1 (``c_init``);
- L = |m| * 512 (``threshold_init``) with a learned multiplier m initialised to 1: an optimizer's step moves m
  by about its learning rate, so L moves by ~512 times that (a parameter holding L itself would barely move);
- one FIRE module per layer; ``shared_across_layers: true`` gives every layer the same module (the paper's
  layer-shared variant): one set of parameters, each layer still evaluating it.

poslab's choices:
- L is used as at least 1: with the signed distances of a bidirectional model (below), psi(max(L, 0)) = 0
  would divide a key's distance by 1e-6; ``learn_threshold: false`` keeps L at ``threshold_init``
  (a Python constant, not a parameter);
- the output layer has no bias: a per-head constant adds the same to every logit of a query's row, which the
  softmax cancels, so it would never get a gradient;
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

#: Added to the normaliser psi(max(L, i)), as the paper's code does: 0 / 0 stays 0 when c reaches 0.
EPS = 1e-6


@options_dataclass
class FIREOptions:
    scheme = "fire"
    #: Width of f_theta's hidden layer (the paper's 32).
    hidden: int = 32
    #: psi's initial scale c (the paper's 0.1); learned, used through its absolute value.
    c_init: float = 0.1
    #: The initial threshold L of psi(max(L, i)) (the paper's 512): queries before it see plain relative
    #: distances, later ones distances normalised by their own position.
    threshold_init: float = 512.0
    #: Learn L, as |multiplier| x threshold_init (the paper), or keep it at threshold_init.
    learn_threshold: bool = True
    #: One FIRE module for every layer instead of one per layer (T5's option of that name).
    shared_across_layers: bool = False

    def __post_init__(self) -> None:
        require(self.hidden >= 1, f"fire.hidden must be a positive integer (the MLP's width), got {self.hidden}")
        require(self.c_init > 0, f"fire.c_init must be > 0 (psi(x) = log(c x + 1) needs c > 0), got {self.c_init}")
        require(self.threshold_init >= 1,
                f"fire.threshold_init must be >= 1 (the floor L of max(L, i); positions start at 0), "
                f"got {self.threshold_init}")


class FIREBias(LayerPositional):
    """One layer's FIRE bias. Parameters: w1, b1 (hidden,) and w2 (n_heads, hidden) -- f_theta; c (1,) -- psi's
    scale, used as |c|; threshold_multiplier (1,) -- L = |multiplier| x threshold_init, a parameter only when
    learned."""

    def __init__(self, opts: FIREOptions, n_heads: int, bidirectional: bool) -> None:
        super().__init__()
        self.opts, self.bidirectional = opts, bidirectional
        self.w1 = nn.Parameter(torch.empty(opts.hidden))
        self.b1 = nn.Parameter(torch.empty(opts.hidden))
        self.w2 = nn.Parameter(torch.empty(n_heads, opts.hidden))
        self.c = nn.Parameter(torch.empty(1))
        self.threshold_multiplier = nn.Parameter(torch.empty(1)) if opts.learn_threshold else None
        self.init_weights(0.0, 0.02)

    def init_weights(self, mean: float, std: float) -> None:
        # nn.Linear's default init (kaiming-uniform with a = sqrt(5) is uniform in +-1/sqrt(fan_in)), not the
        # model's normal(mean, std); bounds from Python numbers, so a meta-device model takes this too.
        first, second = 1.0, 1.0 / math.sqrt(self.opts.hidden)
        init.uniform_(self.w1, -first, first)
        init.uniform_(self.b1, -first, first)
        init.uniform_(self.w2, -second, second)
        init.constant_(self.c, self.opts.c_init)
        if self.threshold_multiplier is not None:
            init.ones_(self.threshold_multiplier)

    def threshold(self, dtype: torch.dtype) -> torch.Tensor:
        """L in use, (1,), at least 1."""
        if self.threshold_multiplier is None:
            return torch.tensor([max(self.opts.threshold_init, 1.0)], dtype=dtype, device=self.c.device)
        return (self.threshold_multiplier.to(dtype).abs() * self.opts.threshold_init).clamp(min=1.0)

    def inputs(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q_pos (batch, n), k_pos (batch, m) -> f_theta's inputs (batch, n, m): the normalised distances."""
        i = q_pos[:, :, None].to(dtype)  # (batch, n, 1)
        rel = (q_pos[:, :, None] - k_pos[:, None, :]).to(dtype)  # i - j, (batch, n, m); exact in integers first
        c = self.c.to(dtype).abs()
        normaliser = torch.log1p(c * torch.maximum(i, self.threshold(dtype))) + EPS  # psi(max(L, i)), (batch, n, 1)
        if self.bidirectional:
            return torch.sign(rel) * torch.log1p(c * rel.abs()) / normaliser
        return torch.log1p(c * rel.clamp(min=0)) / normaliser  # future keys are masked: any finite value does

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
