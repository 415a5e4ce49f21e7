"""KERPLE (Chi, Fan, Ramadge, Rudnicky, NeurIPS 2022): a learned, conditionally positive definite kernel of
the distance |k - q|, added to the attention logits as a bias, per head and layer.

Two kernels, each with two learned (n_heads,) parameters per layer, r1 and r2:

- ``variant: log`` (the paper's best):  bias = -r1 * log(1 + r2 * |k - q|),  r1, r2 > 0;
- ``variant: power``:                   bias = -r1 * |k - q| ** r2,          r1 > 0, 0 < r2 <= 2.

``logit_bias(q_pos (batch, n), k_pos (batch, m))`` returns (batch, heads, n, m). With r2 = 1 the power
kernel is ALiBi with learned slopes r1. Distances are |k - q|, so encoders (bidirectional attention) get a
symmetric bias; the paper's code trains decoders only and its matrix is zero above the diagonal, which the
causal mask hides anyway.

Choices:

- Positivity: the paper's code (chijames/KERPLE, megatron/mpu/layers.py, ParallelKerpleLog and
  ParallelKerplePower) clamps the parameters' ``.data`` in place at every forward, to at least eps = 1e-2,
  and r2 of the power kernel to at most 2. Here the clamp is applied where they are used, on an
  unconstrained parameter (``raw_r1``, ``raw_r2``), as PoPE does for its delta: forward never writes to a
  parameter (which a meta-device forward, an eval pass or sharded/compiled training would not expect), and
  no training loop has to remember to project. The clamp is straight-through (the value is the clamp, the
  gradient that of the identity): a plain clamp has zero gradient past a bound, so a head pushed below eps
  once would stay frozen there, where the paper's projection lets the next gradient bring it back.
  The bounds: r1, r2 >= 1e-2 (the paper's eps); power r2 <= 2 (beyond 2, -|k - q|^r2 is no longer
  conditionally positive definite).
- Initialisation, as the paper's code: ``torch.rand(heads) * scale``, i.e. uniform, per head and layer.
  Log: r1 ~ U(0, 2), r2 ~ U(0, 1). Power: r1 ~ U(0, 1), r2 ~ U(0, 2) (the exponent's whole range). Draws
  under eps are used as eps (the clamp). ``r1_init`` / ``r2_init`` set every head to one value instead. The
  model's normal(mean, std) init is ignored, as T5's is: the parameters must be positive.
- dtype: the bias is computed and returned in at least fp32 (fp64 stays fp64, for gradcheck), like ALiBi's:
  log(1 + r2 * d) at d in the thousands loses the differences between nearby keys in bf16.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from poslab.errors import require
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass

VARIANTS = ("log", "power")
#: The paper's eps: r1 and r2 are used as at least this.
MIN_VALUE = 1e-2
#: The power kernel's exponent bound: -|k - q|^r2 is conditionally positive definite for 0 < r2 <= 2.
MAX_POWER = 2.0
#: The paper's uniform init, U(0, scale) per head: variant -> (r1 scale, r2 scale).
UNIFORM_SCALES = {"log": (2.0, 1.0), "power": (1.0, 2.0)}


@options_dataclass
class KERPLEOptions:
    scheme = "kerple"
    #: "log": -r1 log(1 + r2 |k - q|) (the paper's best); "power": -r1 |k - q|^r2.
    variant: str = "log"
    #: None = the paper's uniform draw per head (log U(0, 2), power U(0, 1)); a number = every head starts there.
    r1_init: float | None = None
    #: None = the paper's uniform draw per head (log U(0, 1), power U(0, 2)); a number = every head starts there.
    r2_init: float | None = None

    def __post_init__(self) -> None:
        require(self.variant in VARIANTS,
                f"kerple.variant must be one of {', '.join(VARIANTS)}, got '{self.variant}'")
        for name in ("r1_init", "r2_init"):
            value = getattr(self, name)
            require(value is None or value >= MIN_VALUE,
                    f"kerple.{name} must be >= {MIN_VALUE} (r1 and r2 are used as at least {MIN_VALUE}), "
                    f"got {value}; omit it for the paper's uniform init")
        require(self.variant != "power" or self.r2_init is None or self.r2_init <= MAX_POWER,
                f"kerple.r2_init must be <= {MAX_POWER} for variant power (the exponent of |k - q|), "
                f"got {self.r2_init}")


def _straight_through_clamp(raw: torch.Tensor, low: float, high: float | None) -> torch.Tensor:
    # The value is the clamp exactly (raw + (clamp - raw).detach() rounds when raw is far past a bound); the
    # added term is zero with the identity's gradient.
    return raw.detach().clamp(low, high) + (raw - raw.detach())


class KERPLEBias(LayerPositional):
    """One layer's kernel: parameters ``raw_r1``, ``raw_r2`` (n_heads,), used through the clamped ``r1``, ``r2``."""

    def __init__(self, opts: KERPLEOptions, n_heads: int) -> None:
        super().__init__()
        self.opts = opts
        self.raw_r1 = nn.Parameter(torch.empty(n_heads))
        self.raw_r2 = nn.Parameter(torch.empty(n_heads))
        self.init_weights(0.0, 0.0)

    def init_weights(self, mean: float, std: float) -> None:
        # Its own init, not the model's normal(mean, std): r1 and r2 must start positive.
        scales = UNIFORM_SCALES[self.opts.variant]
        for param, value, scale in zip((self.raw_r1, self.raw_r2), (self.opts.r1_init, self.opts.r2_init), scales):
            if value is None:
                init.uniform_(param, 0.0, scale)
            else:
                init.constant_(param, value)

    @property
    def r1(self) -> torch.Tensor:
        """The scale in use, (n_heads,), >= MIN_VALUE."""
        return _straight_through_clamp(self.raw_r1, MIN_VALUE, None)

    @property
    def r2(self) -> torch.Tensor:
        """The log kernel's rate or the power kernel's exponent in use, (n_heads,), >= MIN_VALUE (and <= 2
        for power)."""
        return _straight_through_clamp(self.raw_r2, MIN_VALUE, MAX_POWER if self.opts.variant == "power" else None)

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q_pos (batch, n), k_pos (batch, m) long -> (batch, heads, n, m), at least fp32."""
        dtype = torch.promote_types(self.raw_r1.dtype, torch.float32)
        r1, r2 = (r.to(dtype)[None, :, None, None] for r in (self.r1, self.r2))  # (1, heads, 1, 1)
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).abs().to(dtype)[:, None]  # (batch, 1, n, m)
        if self.opts.variant == "log":
            return -r1 * torch.log1p(r2 * distance)
        # pow's gradient in the exponent at distance 0 is 0 (torch takes 0^r2 log 0 as 0 for r2 > 0), not nan.
        return -r1 * distance.pow(r2)


class KERPLE(Scheme):
    name = "kerple"
    relative = True
    Options = KERPLEOptions
    bias_only = True

    @classmethod
    def build(cls, options: KERPLEOptions, geometry: AttentionGeometry):
        # One kernel per layer: the paper learns r1 and r2 per head and layer.
        return None, [KERPLEBias(options, geometry.n_heads) for _ in range(geometry.n_layers)]
