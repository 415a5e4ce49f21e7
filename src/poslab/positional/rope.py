"""Rotary position embeddings (Su et al. 2021) with linear, dynamic-NTK and YaRN scaling.

Layout: half-split pairs (i, i + d/2), theta_i = base^(-2i/d) -- the layout of the Hugging Face
transformers Llama implementation, with which the frequencies, the scalings and YaRN's attention
factor are numerically identical (tests/test_positional.py checks it).

Partial rotation (``fraction`` < 1) is Hugging Face's ``partial_rotary_factor`` (GPT-NeoX's ``rotary_pct``,
Phi): the first rotary_dim = int(head_dim * fraction) channels of each head rotate, with every frequency
and scaling computed as for a head of width rotary_dim; the other channels pass through unchanged.

Dynamic NTK is stateless here: the base is stretched for the current length L = max position + 1 when
L exceeds ``original_max_len``; Hugging Face instead keeps the largest length seen so far. Both agree
on any single call with a fresh model. With a KV cache, as in Hugging Face, each key keeps the rotation
of the call that cached it: decoding past ``original_max_len`` token by token scores earlier keys with
a smaller stretch than one full pass over the same tokens would, so the two differ there.
Because the stretch follows the largest position, dynamic NTK is shift-invariant only within
``original_max_len``: past it, shifting every position changes the logits (``Scheme.relative`` describes the
default scaling, as for xPos's blocks).
"""
from __future__ import annotations

import math

import torch

from poslab.errors import require
from poslab.positional.base import AttentionGeometry, LayerPositional, Scheme
from poslab.positional.options import options_dataclass

SCALINGS = ("none", "linear", "dynamic", "yarn")


@options_dataclass
class RoPEOptions:
    scheme = "rope"
    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    #: The training context length that scaling extends from; None = the model's max_seq_len.
    original_max_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: YaRN's multiplier on cos/sin (so logits scale by its square); None = 0.1 ln(factor) + 1.
    attention_factor: float | None = None
    truncate: bool = True
    #: The share of each head's channels that rotate (the first int(head_dim * fraction)); the rest carry no position.
    fraction: float = 1.0

    def __post_init__(self) -> None:
        require(self.scaling in SCALINGS, f"rope.scaling must be one of {', '.join(SCALINGS)}, got '{self.scaling}'")
        require(self.base > 1, f"rope.base must be > 1, got {self.base}")
        require(self.factor >= 1, f"rope.factor must be >= 1 (1 = no scaling), got {self.factor}")
        require(self.original_max_len is None or self.original_max_len > 0,
                f"rope.original_max_len must be positive, got {self.original_max_len}")
        require(self.beta_fast > self.beta_slow > 0,
                f"rope needs beta_fast > beta_slow > 0, got {self.beta_fast} and {self.beta_slow}")
        require(self.attention_factor is None or self.attention_factor > 0,
                f"rope.attention_factor must be > 0 (it multiplies cos and sin) or null for 0.1 ln(factor) + 1, "
                f"got {self.attention_factor}")
        require(0 < self.fraction <= 1, f"rope.fraction must lie in (0, 1] (the share of channels that rotate), "
                                        f"got {self.fraction}")
        # Options of a scaling that is not on were ignored without a word
        require(self.scaling != "none" or self.factor == 1,
                f"rope.factor {self.factor:g} needs a scaling to apply it; set rope.scaling (linear, dynamic, yarn)")
        yarn_only = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None}
        changed = [name for name, default in yarn_only.items() if getattr(self, name) != default]
        require(self.scaling == "yarn" or not changed,
                f"rope.{changed[0] if changed else ''} is an option of yarn scaling, and rope.scaling is "
                f"'{self.scaling}'; set rope.scaling: yarn or drop it")

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading channels of a head_dim-wide head rotate: int(head_dim * fraction), as Hugging Face
        rounds it, checked to be even and at least one pair (two for dynamic scaling, whose base stretch
        divides by rotary_dim - 2)."""
        dim = int(head_dim * self.fraction)
        least = 4 if self.scaling == "dynamic" else 2
        require(dim % 2 == 0 and dim >= least,
                f"rope needs an even number >= {least} of rotating channels per head, got {dim} (head dim "
                f"{head_dim} x rope.fraction {self.fraction}); change d_model, n_heads or rope.fraction")
        return dim


def yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def base_inv_freq(base: float, dim: int) -> torch.Tensor:
    """Unscaled inverse frequencies base^(-2i/dim), (dim/2,) fp32, as Hugging Face computes them."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def pair_norms(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x (..., >= dim) -> (..., dim/2) fp32: the 2-norm of each pair (i, i + dim/2) of the first dim channels."""
    a, b = x[..., :dim].float().chunk(2, dim=-1)
    return torch.sqrt(a * a + b * b)


def rope_inv_freq(opts: RoPEOptions, dim: int, original_max_len: int, seq_len: int | None = None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2,) fp32 and the cos/sin multiplier for the given scaling."""
    if opts.scaling == "dynamic":
        length = max(seq_len or original_max_len, original_max_len)
        base = opts.base * ((opts.factor * length / original_max_len) - (opts.factor - 1)) ** (dim / (dim - 2))
        return base_inv_freq(base, dim), 1.0
    inv_freq = base_inv_freq(opts.base, dim)
    if opts.scaling == "linear":
        return inv_freq / opts.factor, 1.0
    if opts.scaling == "yarn":
        return _yarn_inv_freq(opts, dim, original_max_len, inv_freq)
    return inv_freq, 1.0


def _yarn_inv_freq(opts: RoPEOptions, dim: int, original_max_len: int, inv_freq: torch.Tensor):
    """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, ramp between them."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(opts.base))

    low, high = correction_dim(opts.beta_fast), correction_dim(opts.beta_slow)
    if opts.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 = extrapolate (high frequency), 0 = interpolate
    scaled = inv_freq / opts.factor * (1 - keep) + inv_freq * keep
    factor = opts.attention_factor if opts.attention_factor is not None else yarn_mscale(opts.factor)
    return scaled, factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d): [-x2, x1], each (i, i + d/2) pair turned by 90 degrees."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (batch, n) -> cos, sin (batch, 1, n, dim) fp32, as Hugging Face builds them."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling)[:, None], (emb.sin() * scaling)[:, None]


class RotaryLayer(LayerPositional):
    """Rotates the first rotary_dim channels of q and k by their positions; parameter-free, so one instance
    serves every layer."""

    fp32_tables = ("inv_freq",)

    def __init__(self, opts: RoPEOptions, head_dim: int, original_max_len: int) -> None:
        super().__init__()
        self.opts, self.original_max_len = opts, original_max_len
        self.rotary_dim = opts.rotary_dim(head_dim)
        inv_freq, self.attention_scaling = rope_inv_freq(opts, self.rotary_dim, original_max_len)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_weights(self, mean: float, std: float) -> None:
        # Buffers are not saved; a model built on the meta device (from_pretrained) recomputes them here.
        with torch.no_grad():
            self.inv_freq.copy_(rope_inv_freq(self.opts, self.rotary_dim, self.original_max_len)[0])

    def frequencies(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.opts.scaling != "dynamic":
            return self.inv_freq, self.attention_scaling
        # The longest position seen stretches the base. A model on the meta device (the plan's FLOP count) has no
        # positions to read; the frequencies' values do not matter there, so the count of positions stands in.
        length = (max(q_pos.shape[-1], k_pos.shape[-1]) if q_pos.is_meta or k_pos.is_meta
                  else int(max(q_pos.max(), k_pos.max())) + 1)
        inv_freq, scaling = rope_inv_freq(self.opts, self.rotary_dim, self.original_max_len, length)
        return inv_freq.to(self.inv_freq.device), scaling

    def transform_qk(self, q, k, q_pos, k_pos):
        inv_freq, scaling = self.frequencies(q_pos, k_pos)
        cos_q, sin_q = rope_cos_sin(inv_freq, q_pos, scaling)
        cos_k, sin_k = (cos_q, sin_q) if k_pos is q_pos else rope_cos_sin(inv_freq, k_pos, scaling)
        return self.rotate(q, cos_q, sin_q), self.rotate(k, cos_k, sin_k)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (batch, heads, n, head_dim), cos and sin (batch, 1, n, rotary_dim) -> (batch, heads, n, head_dim)."""
        # At least fp32 (half-precision rotations drift at large positions); fp64 stays fp64.
        wide, turned = torch.promote_types(x.dtype, torch.float32), x[..., : self.rotary_dim]
        rotated = (turned.to(wide) * cos + rotate_half(turned.to(wide)) * sin).to(x.dtype)
        if self.rotary_dim == x.shape[-1]:  # full rotation: nothing to pass through, so no copy
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)

    def qk_frequency_norms(self, q, k):
        """2-norm of each rotated 2-D chunk (i, i + rotary_dim/2): (..., rotary_dim/2) for q and k; the
        channels that do not rotate have no frequency."""
        return pair_norms(q, self.rotary_dim), pair_norms(k, self.rotary_dim)


class RoPE(Scheme):
    name = "rope"
    relative = True
    Options = RoPEOptions
    context_scalings = ("linear", "ntk", "yarn")

    @classmethod
    def context_options(cls, scaling: str, factor: float, original_max_len: int) -> dict:
        if scaling not in cls.context_scalings:
            return super().context_options(scaling, factor, original_max_len)
        # Dynamic NTK stretches its base by the length it sees (alpha = L / original_max_len) and keeps factor 1,
        # as Hugging Face's default does.
        name = {"linear": "linear", "ntk": "dynamic", "yarn": "yarn"}[scaling]
        return {"scaling": name, "factor": 1.0 if name == "dynamic" else float(max(1.0, factor)),
                "original_max_len": original_max_len}

    @classmethod
    def build(cls, options: RoPEOptions, geometry: AttentionGeometry):
        layer = RotaryLayer(options, geometry.head_dim, options.original_max_len or geometry.max_seq_len)
        return None, [layer] * geometry.n_layers
