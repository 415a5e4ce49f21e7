"""PoPE, polar-coordinate position embeddings (Gopalakrishnan et al. 2025; papers/pope.md).

Content sets magnitudes, position sets phases: mu = softplus(q), softplus(k) per component, phase
t * theta_c with theta_c = base^(-c/d) for each of the d components, and a learnable key-phase bias
delta (layer x head x component) clamped to [-2pi, 0]. The score is
sum_c mu_q,c mu_k,c cos((s - t) theta_c + delta_c). Attention runs it in its Cartesian form,
q~ = [mu cos phi, mu sin phi] of width 2d, so any dot-product kernel applies; on CUDA the fused Triton
kernel computes the polar transform inside attention instead.

Two options give the paper's 124M ablations (experiments/pope_ablation.py): ``magnitude`` relu or identity
("no softplus") in place of softplus, and ``learn_delta: false`` (delta stays at its init).

The clamp is applied where delta is used (a clamped view of an unconstrained parameter), so no
training loop has to remember to project it. It is a straight-through clamp: a plain clamp has zero
gradient outside the range, and from the zero init every component whose first update points upward
would stay frozen at 0 for good (81-98% of the components of quick-scale indirect-indexing models did).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

from poslab.errors import require
from poslab.functional import POPE_MAGNITUDES, pope_frequencies, pope_polar
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass

DELTA_INITS = ("zero", "uniform")


@options_dataclass
class PoPEOptions:
    scheme = "pope"
    base: float = 10000.0
    #: "zero" generalises better in length, "uniform" (U(-2pi, 0)) is slightly better in distribution.
    delta_init: str = "zero"
    learn_delta: bool = True
    #: softplus (PoPE); relu and identity are the paper's ablations, run without the fused kernel.
    magnitude: str = "softplus"

    def __post_init__(self) -> None:
        require(self.base > 1, f"pope.base must be > 1, got {self.base}")
        require(self.magnitude in POPE_MAGNITUDES,
                f"pope.magnitude must be one of {', '.join(POPE_MAGNITUDES)}, got '{self.magnitude}'")
        require(self.delta_init in DELTA_INITS,
                f"pope.delta_init must be one of {', '.join(DELTA_INITS)}, got '{self.delta_init}'")


class PolarLayer(LayerPositional):
    fp32_tables = ("theta",)

    def __init__(self, opts: PoPEOptions, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.base = opts.base
        self.magnitude = opts.magnitude
        self.register_buffer("theta", pope_frequencies(head_dim, opts.base), persistent=False)
        self.delta_init = opts.delta_init
        if opts.learn_delta:
            self.raw_delta = nn.Parameter(torch.zeros(n_heads, head_dim))
        else:
            # A saved buffer, not a frozen parameter: Hugging Face's from_pretrained rebuilds every loaded
            # parameter as trainable, so a frozen delta would come back learning.
            self.register_buffer("raw_delta", torch.zeros(n_heads, head_dim))
        self.init_weights(0.0, 0.0)

    def init_weights(self, mean: float, std: float) -> None:
        with torch.no_grad():  # theta is not saved; recompute it for models built on the meta device
            self.theta.copy_(pope_frequencies(self.theta.shape[0], self.base))
        if self.delta_init == "uniform":
            init.uniform_(self.raw_delta, -2 * math.pi, 0.0)
        else:
            init.zeros_(self.raw_delta)

    @property
    def delta(self) -> torch.Tensor:
        """The key-phase bias in use, (heads, d), always inside [-2pi, 0]; its gradient reaches raw_delta even
        where the clamp is active, so a component pushed past a bound can come back."""
        raw = self.raw_delta
        # The value is the clamp exactly (raw + (clamp - raw).detach() rounds past -2pi when raw is far
        # below it); the added term is zero with an identity gradient.
        return raw.detach().clamp(-2 * math.pi, 0.0) + (raw - raw.detach())

    def transform_qk(self, q, k, q_pos, k_pos):
        return (pope_polar(q, q_pos, self.theta, magnitude=self.magnitude),
                pope_polar(k, k_pos, self.theta, self.delta, magnitude=self.magnitude))

    def qk_frequency_norms(self, q, k):
        """Magnitudes per component, (..., d) for q and k: softplus (|x| without it: a negative component is a
        positive magnitude at the opposite phase)."""
        magnitude = POPE_MAGNITUDES[self.magnitude]
        return magnitude(q.float()).abs(), magnitude(k.float()).abs()

    def fused_attention(self, q, k, v, q_pos, k_pos, *, causal, scale, key_padding):
        from poslab.kernels import fused_pope_supports

        # The kernel takes positions as start offsets, so it serves position rows shared by the batch
        # that count up by one; anything else goes the Cartesian way. It computes softplus and its
        # derivative itself, so the ablations' magnitudes go that way too.
        if (self.magnitude != "softplus" or not q.is_cuda or not fused_pope_supports(q)
                or not (_is_range(q_pos) and _is_range(k_pos))):
            return None
        starts = int(q_pos[0, 0]), int(k_pos[0, 0])
        if not fused_pope_supports(q, k, v, starts=starts):  # past the kernel's launch limits: SDPA serves it
            return None
        from poslab.kernels.pope_flash import pope_flash_attention

        seq_lens = None
        if key_padding is not None:
            seq_lens = key_padding.sum(-1).to(torch.int32)
            right_padded = torch.arange(key_padding.shape[1], device=q.device)[None] < seq_lens[:, None]
            if not torch.equal(key_padding.bool(), right_padded):  # the kernel's seq_lens mean right padding
                return None
        return pope_flash_attention(
            q, k, v, self.delta, base=self.base, causal=causal, scale=scale,
            q_start=starts[0], k_start=starts[1], seq_lens=seq_lens,
        )


def _is_range(pos: torch.Tensor) -> bool:
    """pos (1, n) equals start, start + 1, ..., start + n - 1."""
    return pos.shape[0] == 1 and torch.equal(pos[0], pos[0, 0] + torch.arange(pos.shape[1], device=pos.device))


class PoPE(Scheme):
    name = "pope"
    relative = True
    Options = PoPEOptions

    @classmethod
    def build(cls, options: PoPEOptions, geometry: AttentionGeometry):
        return None, [PolarLayer(options, geometry.n_heads, geometry.head_dim) for _ in range(geometry.n_layers)]
