"""The model configuration: a typed dataclass validated when it is built."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from poslab.attention import BACKENDS
from poslab.errors import check_fields, known_fields, require, shown
from poslab.positional import AttentionGeometry, LayerPositional, PositionalConfig, build_positional

ARCHS = ("decoder", "encoder")
NORMS = ("rmsnorm", "layernorm")
MLPS = ("swiglu", "gelu")


@dataclass
class ModelConfig:
    """A decoder (GPT-style, causal, LM head) or encoder (NeoBERT-style, bidirectional, MLM head).

    ``ffn_hidden`` None means 4 * d_model for GELU and NeoBERT's int(2 * 4 * d_model / 3) for SwiGLU
    (the same parameter count). Weights start from normal(init_mean, init_std): the adjacency study
    ablates both. ``sparse_prediction`` (encoders): given labels, the MLM head scores only the labelled
    tokens and ``logits`` is (labelled tokens, vocab) (``masked_lm_output``).
    """

    arch: str = "decoder"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int | None = None
    max_seq_len: int = 512
    positional: PositionalConfig = field(default_factory=PositionalConfig)
    #: None = the architecture's own: layernorm + gelu (nanoGPT) for decoders, rmsnorm + swiglu (NeoBERT) for encoders.
    norm: str | None = None
    mlp: str | None = None
    norm_eps: float = 1e-5
    init_mean: float = 0.0
    init_std: float = 0.02
    tie_embeddings: bool = False
    attn_backend: str = "auto"
    pad_token_id: int | None = None
    sparse_prediction: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.positional, dict):
            self.positional = PositionalConfig(**known_fields(self.positional, PositionalConfig, "positional"))
        require(isinstance(self.positional, PositionalConfig),
                f"positional must be a mapping like {{name: rope, options: {{}}}}, got {shown(self.positional)}")
        check_fields(self)
        require(self.arch in ARCHS, f"arch must be one of {', '.join(ARCHS)}, got '{self.arch}'")
        self.norm = self.norm or ("layernorm" if self.arch == "decoder" else "rmsnorm")
        self.mlp = self.mlp or ("gelu" if self.arch == "decoder" else "swiglu")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            require(value > 0, f"{name} must be a positive integer, got {shown(value)}")
        require(self.d_model % self.n_heads == 0,
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}); change one of them")
        require(self.ffn_hidden is None or self.ffn_hidden > 0, f"ffn_hidden must be positive, got {self.ffn_hidden}")
        require(self.norm in NORMS, f"norm must be one of {', '.join(NORMS)}, got '{self.norm}'")
        require(self.mlp in MLPS, f"mlp must be one of {', '.join(MLPS)}, got '{self.mlp}'")
        require(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        require(self.attn_backend in BACKENDS,
                f"attn_backend must be one of {', '.join(BACKENDS)}, got '{self.attn_backend}'")
        require(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size,
                f"pad_token_id must lie in [0, vocab_size), got {self.pad_token_id}")
        # The masked-LM head has a bias and its own decoder (NeoBERT's); only decoders tie theirs to the embedding.
        require(not (self.tie_embeddings and not self.causal),
                "tie_embeddings is for decoders (arch: decoder); the encoder's masked-LM head keeps its own weights")
        require(not (self.sparse_prediction and self.causal),
                "sparse_prediction is for masked-LM encoders (arch: encoder); remove it from the decoder's config")
        self._check_positional()

    def _check_positional(self) -> None:
        """The checks a scheme makes of the model it goes into (xPos and CoPE in decoders only, T5's range in the
        model's direction, an even head dim for rotations, ...) run when it is built: build it here, on the meta
        device (nothing allocated), so a config that can never build is refused when it is made. One layer's: no
        check depends on depth, and 10^8 layers would take hours to build even there."""
        with torch.device("meta"):
            _, layers = build_positional(self.positional, AttentionGeometry(
                1, self.n_heads, self.head_dim, self.d_model, self.max_seq_len, self.causal))
        fused = any(type(layer).fused_attention is not LayerPositional.fused_attention for layer in layers if layer)
        require(self.attn_backend != "triton" or fused,
                f"attn_backend 'triton' runs a scheme's fused kernel, and {self.positional.name} has none (pope has); "
                "use attn_backend 'auto' or 'sdpa'")

    @property
    def causal(self) -> bool:
        return self.arch == "decoder"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 4 * self.d_model if self.mlp == "gelu" else int(2 * 4 * self.d_model / 3)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["positional"] = self.positional.to_dict()
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        return cls(**known_fields(values, cls, "model"))
