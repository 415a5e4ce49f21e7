"""xPos (Sun et al. 2023, "A Length-Extrapolatable Transformer"): RoPE whose rotations also decay.

Each frequency pair i of a head (i < d/2, RoPE's half-split layout and frequencies base^(-2i/d)) gets a decay
rate zeta_i = (2i/d + gamma) / (1 + gamma), gamma = 0.4: the query at position t is rotated and scaled by
zeta_i^((t - c) / scale_base), the key at s rotated and scaled by zeta_i^(-(s - c) / scale_base), so their
product carries zeta_i^((t - s) / scale_base) -- a decay with distance that is strongest at the fastest
frequencies (i = 0), whose rotations are the least stable to extrapolate, and nearly absent at the slowest.
The logits depend on t - s only: xPos is relative.

The centre c cancels in every logit; it only sets where the scales are 1. The reference implementations
(torchscale, x-transformers) centre each call at half its length, which would change a cached key's scale
between decoding steps; here c is fixed (default half the model's max_seq_len), so a key's transform depends
on its own position only, as a KV cache needs. Scales are computed in fp32 and grow as e^(|p - c| * 1.25 /
scale_base) at the fastest frequency: a model whose positions lie within 64 x scale_base of c stays inside
fp32's (and bf16's) range, which build checks for max_seq_len; float16 holds only ~4.5 x scale_base either
side for q and k entries of about 1, less for larger ones. Positions past what the inputs' dtype holds (a long
generation, fp16) are refused in one line instead of overflowing to inf, and in float16 so are scaled q and k that
overflow nearer the centre.

Blockwise causal attention, the paper's way past the training length (``block``): positions fall into blocks of
``block``, and a query sees the keys of its own block and of the one before, so no key lies ``2 x block`` or more
positions back. Half the training length keeps every distance within what the model trained on, and is what the
evaluation-time scaling ``blockwise`` (``poslab analyze extrapolation --scalings blockwise``) sets. It is a mask
given as ``logit_bias`` (-inf on the hidden keys): it sees the cached keys' positions while decoding. Blocks
are fixed in position, so with them xPos is no longer relative (``Scheme.relative`` describes its default).

Only causal models: for a key after its query the factor grows with distance instead of decaying, which is
why the reference implementations refuse bidirectional attention too.
"""
from __future__ import annotations

import math

import torch

from poslab.errors import InputError, require
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass
from poslab.positional.rope import base_inv_freq, pair_norms, rope_cos_sin, rotate_half

# |log scale| a float32 or bfloat16 tensor holds with room for a q.k product of unit-sized entries (e^80 ~ 5e34);
# float16's is its largest value's log, less the same room.
FP32_LOG_RANGE = 80.0
FP16_LOG_RANGE = math.log(torch.finfo(torch.float16).max) - 1.0


@options_dataclass
class XPosOptions:
    scheme = "xpos"
    base: float = 10000.0
    #: Positions per unit of the decay's exponent: larger = slower decay with distance.
    scale_base: float = 512.0
    #: zeta_i = (2i/d + gamma) / (1 + gamma): the fastest pair decays at gamma / (1 + gamma) per scale_base.
    gamma: float = 0.4
    #: The position whose scales are 1; None = max_seq_len // 2.
    center: int | None = None
    #: Blockwise causal attention: a query sees the keys of its block of ``block`` positions and of the one before;
    #: None = every earlier key (training).
    block: int | None = None

    def __post_init__(self) -> None:
        require(self.base > 1, f"xpos.base must be > 1, got {self.base}")
        require(self.scale_base > 0, f"xpos.scale_base must be > 0, got {self.scale_base}")
        require(self.gamma > 0, f"xpos.gamma must be > 0 (gamma / (1 + gamma) is the fastest pair's decay), "
                                f"got {self.gamma}")
        require(self.center is None or self.center >= 0, f"xpos.center must be >= 0, got {self.center}")
        require(self.block is None or self.block >= 1, f"xpos.block must be >= 1 (positions per block) or null for "
                                                       f"attention to every earlier key, got {self.block}")


def fastest_log_decay(gamma: float) -> float:
    """-log zeta_0, the fastest pair's decay per scale_base, from Python numbers (models built on the meta
    device have no values to read)."""
    return math.log((1 + gamma) / gamma)


def xpos_zeta(head_dim: int, gamma: float) -> torch.Tensor:
    """Per-pair decay rates (head_dim/2,) fp32, in (0, 1): (2i/d + gamma) / (1 + gamma)."""
    return (torch.arange(0, head_dim, 2, dtype=torch.float32) + gamma * head_dim) / ((1 + gamma) * head_dim)


class XPosLayer(LayerPositional):
    """Rotates q and k as RoPE does and scales them by opposite powers of zeta; parameter-free, so one
    instance serves every layer."""

    fp32_tables = ("inv_freq", "log_zeta")

    def __init__(self, opts: XPosOptions, head_dim: int, center: int) -> None:
        super().__init__()
        self.opts, self.head_dim, self.center = opts, head_dim, center
        self._checked: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None  # what _check_range read last
        # fp32 whatever the default dtype: from_pretrained(dtype=bf16) builds under it, and tables filled in bf16
        # stay rounded (casts keep fp32_tables as they are)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("log_zeta", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.init_weights(0.0, 0.0)

    def init_weights(self, mean: float, std: float) -> None:
        # Buffers are not saved; a model built on the meta device (from_pretrained) recomputes them here.
        with torch.no_grad():
            self.inv_freq.copy_(base_inv_freq(self.opts.base, self.head_dim))
            self.log_zeta.copy_(xpos_zeta(self.head_dim, self.opts.gamma).log())

    def scales(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (batch, n) -> zeta^((p - c) / scale_base), (batch, 1, n, head_dim) fp32, a pair's halves alike."""
        power = (positions.to(torch.float32) - self.center) / self.opts.scale_base
        scale = torch.exp(power[..., None] * self.log_zeta.to(positions.device))
        return torch.cat((scale, scale), dim=-1)[:, None]

    def transform_qk(self, q, k, q_pos, k_pos):
        self._check_range(q_pos, k_pos, q.dtype)
        cos_q, sin_q = rope_cos_sin(self.inv_freq, q_pos, 1.0)
        cos_k, sin_k = (cos_q, sin_q) if k_pos is q_pos else rope_cos_sin(self.inv_freq, k_pos, 1.0)
        q, k = self.rotate(q, cos_q, sin_q, self.scales(q_pos)), self.rotate(k, cos_k, sin_k, 1 / self.scales(k_pos))
        # float16's range is narrow enough for large entries to overflow well inside the positions' check: read the
        # values themselves (a GPU sync per layer, in float16 only)
        if q.dtype == torch.float16 and not q.is_meta and not (torch.isfinite(q).all() and torch.isfinite(k).all()):
            far = max(int((q_pos - self.center).abs().max()), int((k_pos - self.center).abs().max()))
            raise InputError(f"xpos-scaled q or k overflow float16 at positions up to {far} from their centre "
                             f"({self.center}): run in bfloat16 or float32, or raise xpos.scale_base")
        return q, k

    def logit_bias(self, q_pos, k_pos):
        """0 where a key lies in the query's block or the one before, -inf elsewhere: (batch or 1, 1, n, m) fp32."""
        if self.opts.block is None:
            return None
        q_block, k_block = q_pos // self.opts.block, k_pos // self.opts.block
        hidden = k_block[:, None, None, :] < q_block[:, None, :, None] - 1
        return torch.zeros(hidden.shape, device=q_pos.device).masked_fill(hidden, float("-inf"))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x (batch, heads, n, d); cos, sin, scale (batch, 1, n, d) -> (batch, heads, n, d) in x's dtype."""
        # At least fp32, as RoPE rotates: half-precision rotations drift at large positions; fp64 stays fp64.
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return ((wide * cos + rotate_half(wide) * sin) * scale).to(x.dtype)

    def _check_range(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> None:
        """One line instead of inf and NaN logits where positions lie too far from the centre for dtype (past
        max_seq_len, which build checked). Reading the positions syncs a GPU, so each forward's positions are read
        once: every layer shares this module and gets the same tensors."""
        last = self._checked
        if q_pos.is_meta or k_pos.is_meta or (last and last[0] is q_pos and last[1] is k_pos and last[2] == dtype):
            return
        half = dtype == torch.float16
        reach = (FP16_LOG_RANGE if half else FP32_LOG_RANGE) * self.opts.scale_base / fastest_log_decay(self.opts.gamma)
        far = max(int((q_pos - self.center).abs().max()), int((k_pos - self.center).abs().max()))
        if far > reach:
            fix = "run in bfloat16 or float32, or raise xpos.scale_base" if half else \
                f"raise xpos.scale_base to at least {math.ceil(self.opts.scale_base * far / reach)}"
            raise InputError(f"xpos scales at positions {far} from their centre ({self.center}) overflow "
                              f"{str(dtype).removeprefix('torch.')}, which holds {int(reach)}: {fix}")
        # The tensors themselves (a few longs), not their ids: a freed tensor's id can come back with other values.
        self._checked = (q_pos, k_pos, dtype)

    def qk_frequency_norms(self, q, k):
        """2-norm of each raw pair (i, i + d/2): (..., d/2) for q and k."""
        return pair_norms(q, self.head_dim), pair_norms(k, self.head_dim)


class XPos(Scheme):
    name = "xpos"
    relative = True
    causal_only = True
    causal_reason = "toward later keys its factor grows with distance instead of decaying; use rope for encoders"
    Options = XPosOptions
    context_scalings = ("blockwise",)

    @classmethod
    def context_options(cls, scaling: str, factor: float, original_max_len: int) -> dict:
        if scaling not in cls.context_scalings:
            return super().context_options(scaling, factor, original_max_len)
        # Floor: blocks of (L - 1) / 2 for an odd L keep the farthest key, 2 x block - 1 back, within L - 1.
        return {"block": max(1, original_max_len // 2)}

    @classmethod
    def build(cls, options: XPosOptions, geometry: AttentionGeometry):
        require(geometry.head_dim % 2 == 0, f"xpos needs an even head dim, got {geometry.head_dim}; change "
                                            f"d_model or n_heads")
        center = geometry.max_seq_len // 2 if options.center is None else options.center
        reach = FP32_LOG_RANGE * options.scale_base / fastest_log_decay(options.gamma)
        far = max(center, geometry.max_seq_len - 1 - center)
        require(far <= reach,
                f"xpos scales at positions {far} from their centre ({center}) leave float32's range, which holds "
                f"{int(reach)} with xpos.scale_base {options.scale_base:g}: raise xpos.scale_base to at least "
                f"{math.ceil(options.scale_base * far / reach)}")
        return None, [XPosLayer(options, geometry.head_dim, center)] * geometry.n_layers
