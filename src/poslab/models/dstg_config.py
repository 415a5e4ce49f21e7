"""DSTG-NeoBERT's configuration: a typed dataclass validated when it is built (papers/dstg.md).

The residual stream is [AP (d_ap) | semantic (d_sem)]; ``d_ap: 0`` switches absolute position off
(no table, no AP stream, no AP q/k), ``rp: null`` switches the relative bias off.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from poslab.attention import BACKENDS
from poslab.errors import check_fields, is_int, known_fields, require
from poslab.positional import SCHEMES, PositionalConfig

#: Relative schemes DSTG can take: those that only add a (heads, n, m) logit bias.
RP_SCHEMES = tuple(name for name, scheme in SCHEMES.items() if scheme.bias_only)
#: The ``attn_backend`` values DSTG runs: the fused-kernel backend belongs to PoPE.
DSTG_BACKENDS = tuple(b for b in BACKENDS if b != "triton")


def _default_rp() -> PositionalConfig:
    # (code) 32 buckets, max distance 128, one table per layer, zero-initialised: T5Options' defaults.
    return PositionalConfig("t5", {})


@dataclass
class DSTGConfig:
    """Three streams: semantic (token embedding), absolute position (learned table), relative bias.

    ``qk_head_dim`` None = (d_ap + d_sem) / n_heads, the per-head q/k size of BOTH streams (variance
    matching: each stream's score is a qk_head_dim-wide dot product, so the wider stream does not
    dominate). ``ffn_hidden`` None = NeoBERT's int(2 * 4 * d_model / 3); round(ffn_hidden * d_ap /
    d_model) of its units write to AP, the rest to the semantic stream. Positions count non-pad tokens
    from ``position_start`` (0 or 1; the authors' code uses 1); in training each sequence's positions are
    shifted by a random offset in [0, position_offset_max].
    """

    arch: str = "dstg"
    vocab_size: int = 30522
    n_layers: int = 6
    n_heads: int = 12
    d_ap: int = 48
    d_sem: int = 720
    qk_head_dim: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int = 1024
    rp: PositionalConfig | None = field(default_factory=_default_rp)
    position_start: int = 1
    position_offset_max: int = 0
    norm_eps: float = 1e-5
    init_mean: float = 0.0
    init_std: float = 0.02
    attn_backend: str = "auto"
    pad_token_id: int | None = None
    sparse_prediction: bool = False  # as ModelConfig's: given labels, score only the labelled tokens

    def __post_init__(self) -> None:
        require(self.arch == "dstg", f"a DSTG config needs arch 'dstg', got '{self.arch}'")
        if isinstance(self.rp, dict):
            self.rp = PositionalConfig(**known_fields(self.rp, PositionalConfig, "rp"))
        require(self.rp is None or isinstance(self.rp, PositionalConfig),
                f"rp must be a mapping like {{name: t5, options: {{}}}} or null for no relative bias, got {self.rp!r}")
        for name in ("vocab_size", "n_layers", "n_heads", "d_sem", "max_seq_len"):
            value = getattr(self, name)
            require(is_int(value) and value > 0, f"{name} must be a positive integer, got {value!r}")
        require(is_int(self.d_ap) and self.d_ap >= 0,
                f"d_ap must be a non-negative integer (0 switches absolute position off), got {self.d_ap!r}")
        for name in ("d_ap", "d_sem"):
            value = getattr(self, name)
            require(value % self.n_heads == 0,
                    f"{name} ({value}) must be divisible by n_heads ({self.n_heads}): each head gets {name}/n_heads "
                    f"value dims; use a multiple of {self.n_heads} or another head count")
        require(self.qk_head_dim is None or (is_int(self.qk_head_dim) and self.qk_head_dim > 0),
                f"qk_head_dim must be a positive integer (one per-head q/k size for both streams) or null for "
                f"(d_ap + d_sem) / n_heads, got {self.qk_head_dim!r}")
        require(self.ffn_hidden is None or (is_int(self.ffn_hidden) and self.ffn_hidden > 0),
                f"ffn_hidden must be a positive integer or null, got {self.ffn_hidden!r}")
        check_fields(self)  # the sizes above first, for their messages; then every other field's type
        require(self.d_ap == 0 or 1 <= self.ffn_ap < self.ffn_size,
                f"ffn_hidden ({self.ffn_size}) is too small to give both streams hidden units at the d_ap/d_model "
                f"share ({self.d_ap}/{self.d_model}); raise ffn_hidden")
        if self.rp is not None:
            require(self.rp.name in RP_SCHEMES,
                    f"rp.name must be one of {', '.join(RP_SCHEMES)} (or rp: null for no relative bias), "
                    f"got '{self.rp.name}'")
        require(self.position_start in (0, 1), f"position_start must be 0 or 1, got {self.position_start!r}")
        require(is_int(self.position_offset_max) and self.position_offset_max >= 0,
                f"position_offset_max must be a non-negative integer (0 = no random offset), "
                f"got {self.position_offset_max!r}")
        require(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        require(self.attn_backend in DSTG_BACKENDS,
                f"attn_backend must be one of {', '.join(DSTG_BACKENDS)} for DSTG, got '{self.attn_backend}'")
        require(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
                f"pad_token_id must lie in [0, vocab_size), got {self.pad_token_id}")

    @property
    def causal(self) -> bool:
        return False

    @property
    def d_model(self) -> int:
        return self.d_ap + self.d_sem

    @property
    def head_dim(self) -> int:
        """Per-head q/k size of each stream."""
        return self.qk_head_dim if self.qk_head_dim is not None else self.d_model // self.n_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else int(2 * 4 * self.d_model / 3)

    @property
    def ffn_ap(self) -> int:
        """Hidden units whose down-projection writes only into the AP stream."""
        return round(self.ffn_size * self.d_ap / self.d_model)

    @property
    def streams(self) -> dict[str, int]:
        """Width of each present stream, in residual order (AP first, as in the authors' code)."""
        return {name: d for name, d in (("ap", self.d_ap), ("sem", self.d_sem)) if d > 0}

    @property
    def table_size(self) -> int:
        """Rows of the AP table: the largest position plus one."""
        return self.max_seq_len + self.position_start + self.position_offset_max

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rp"] = None if self.rp is None else self.rp.to_dict()
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DSTGConfig:
        for key, hint in ENCODER_KEYS.items():
            require(not isinstance(values, dict) or key not in values, f"DSTG has no '{key}': {hint}")
        return cls(**known_fields(values, cls, "dstg model"))


#: Encoder keys a DSTG config replaces, and with what (a config copied from a baseline trips on these).
ENCODER_KEYS = {
    "d_model": "its width is d_ap + d_sem; set those instead",
    "positional": "absolute position is the d_ap stream and relative position is 'rp'; set those instead",
}
