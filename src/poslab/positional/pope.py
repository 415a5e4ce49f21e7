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
import weakref
from dataclasses import dataclass

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

        # The kernel computes softplus and its derivative itself, so the ablations' magnitudes go the Cartesian
        # way; so do positions and padding it cannot take (_launch_plan), and inputs past its launch limits.
        if self.magnitude != "softplus" or not q.is_cuda:
            return None
        plan = _launch_plan(q_pos, k_pos, key_padding)
        if (plan is None or not fused_pope_supports(q, k, v, starts=plan.starts)
                or plan.seq_lens is not None and plan.seq_lens.shape != (q.shape[0],)):
            return None
        from poslab.kernels.pope_flash import launch_checked

        q_start, k_start = (torch.full((q.shape[0],), start, device=q.device, dtype=torch.int32)
                            for start in plan.starts)
        seq_lens = None if plan.seq_lens is None else plan.seq_lens.to(q.device)
        return launch_checked(q, k, v, self.delta, base=self.base, causal=causal, scale=scale, q_start=q_start,
                              k_start=k_start, seq_lens=seq_lens)


@dataclass(frozen=True)
class _LaunchPlan:
    """Positions and padding as the fused kernel takes them: the start positions of queries and keys, and
    the valid keys per row, (batch,) int32 counted from the left (right padding), or None without padding."""

    starts: tuple[int, int]
    seq_lens: torch.Tensor | None


# The last answer of _launch_plan: weak references to the tensors it read, with their versions, and the plan.
_last_plan: tuple = (None, None)


def _launch_plan(q_pos: torch.Tensor, k_pos: torch.Tensor, key_padding: torch.Tensor | None) -> _LaunchPlan | None:
    """The fused kernel's view of q_pos (1, n), k_pos (1, m) and key_padding (batch, m), or None when it has
    none: the kernel takes positions as start offsets, so rows shared by the batch that count up by one, and
    padding of 0s and 1s on the right only.

    Reading the values costs a host sync. Every layer of a forward asks about the same tensors, so the last
    answer is kept for the same tensor objects at the same versions: a new tensor, or one changed in place, is
    read again; one changed behind autograd's version counter (through ``.data`` or a NumPy view) is not, as
    autograd does not see it either. One sync per forward instead of several per layer."""
    global _last_plan
    tensors = (q_pos, k_pos, key_padding)
    if any(t is not None and t.is_inference() for t in tensors):  # inference tensors have no version counter
        return _read_plan(*tensors)
    kept, plan = _last_plan
    if kept is not None and all(_same(ref, t) for ref, t in zip(kept, tensors)):
        return plan
    plan = _read_plan(*tensors)
    _last_plan = tuple(None if t is None else (weakref.ref(t), t._version) for t in tensors), plan
    return plan


def _same(ref: tuple | None, t: torch.Tensor | None) -> bool:
    return t is None if ref is None else (ref[0]() is t and ref[1] == t._version)


def _read_plan(q_pos, k_pos, key_padding) -> _LaunchPlan | None:
    """_launch_plan's answer, read off the device in one sync."""
    if q_pos.shape[0] != 1 or k_pos.shape[0] != 1 or 0 in (q_pos.shape[1], k_pos.shape[1]):
        return None
    checks = [_counts_up(q_pos)] + ([] if k_pos is q_pos else [_counts_up(k_pos)])
    seq_lens = None
    if key_padding is not None:
        seq_lens = key_padding.sum(-1).to(torch.int32)
        right_padded = torch.arange(key_padding.shape[1], device=key_padding.device)[None] < seq_lens[:, None]
        # 0s and 1s, or a row could count more valid keys than there are
        checks.append((key_padding == right_padded).all())
    starts = torch.stack([q_pos[0, 0], k_pos[0, 0]]).long()
    q_start, k_start, *ok = torch.cat([starts, torch.stack(checks).long()]).tolist()
    return _LaunchPlan((q_start, k_start), seq_lens) if all(ok) else None


def _counts_up(pos: torch.Tensor) -> torch.Tensor:
    """Whether pos (1, n) is start, start + 1, ..., start + n - 1, as a 0-dim bool tensor."""
    return (pos[0] == pos[0, 0] + torch.arange(pos.shape[1], device=pos.device)).all()


class PoPE(Scheme):
    name = "pope"
    relative = True
    Options = PoPEOptions

    @classmethod
    def build(cls, options: PoPEOptions, geometry: AttentionGeometry):
        return None, [PolarLayer(options, geometry.n_heads, geometry.head_dim) for _ in range(geometry.n_layers)]
