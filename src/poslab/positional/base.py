"""How a positional scheme plugs into a Transformer.

A scheme can touch attention at four points, and most use one:

1. the input        -- ``InputPositional.forward(x, positions)`` adds to (or sits beside) the embeddings;
2. queries and keys -- ``LayerPositional.transform_qk(q, k, q_pos, k_pos)`` rotates them (RoPE) or maps
                       them to magnitudes and phases (PoPE, which returns 2d-wide q/k);
3. the logits       -- ``LayerPositional.logit_bias(q_pos, k_pos)`` returns an additive
                       (batch or 1, heads, q_len, k_len) bias (T5 buckets, ALiBi);
4. the logits, from content -- ``LayerPositional.content_bias(q, k, causal=, key_padding=)`` returns an
                       additive (batch, heads, q_len, k_len) bias computed from the (transformed) queries and
                       every key, cached ones included (CoPE, whose positions count gated keys).

Attention adds 3 and 4 into one logit term, ``bias``, which the eager path returns for analysis.

A scheme is a class registered under a name (``positional/__init__.py``); ``Scheme.build`` makes the
modules a model needs: at most one input module, and one layer module per attention layer (the same
instance may be returned for every layer when parameters are shared). The attention module only calls
these hooks; it never asks which scheme it holds.

Adding a scheme: its file (a ``Scheme`` subclass with an ``Options`` class and its modules), its import and
one ``SCHEMES`` entry in ``positional/__init__.py``. ``Options`` is decorated with ``@options_dataclass``
(positional/options.py: unknown keys and wrong types become one-line ConfigErrors) and names its scheme in
``scheme = "<name>"``, the registry key and ``Scheme.name`` (tests/test_positional.py checks the three agree).
The generic tests (tests/test_models.py, test_positional.py, test_gradients.py) parametrize over ``SCHEMES``
and pick it up. Rules the models rely on:

- Hugging Face's ``from_pretrained`` builds models on the meta device, and the reproduction's ``--plan``
  counts FLOPs by running ``forward`` there: ``build``, ``__init__``, ``init_weights`` and the hooks must not
  read tensor values (``.item()``, ``float(t)``: compute from Python numbers).
- Fixed tables that are not saved (frequencies, slopes) are buffers computed again in ``init_weights``, named
  in ``fp32_tables``.
- With a KV cache (generation), keys are cached after ``transform_qk``: a cached key is never transformed
  again, so its transform must depend on its own position only, and ``logit_bias`` sees the positions of every
  cached key (``k_pos``, length m) against the new queries' (``q_pos``, length n). ``content_bias`` sees the
  cached keys themselves (k, length m): the n new queries are the last n of the m.
- A scheme with a ``content_bias`` has no ``fused_attention`` (the fused path runs before it is asked).
"""
from __future__ import annotations

import abc

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from poslab.errors import ConfigError


@dataclass
class PositionalConfig:
    """Which scheme and its options. ``options`` are validated by the scheme's own options dataclass."""

    name: str = "rope"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from poslab.positional import get_scheme  # late import: the registry imports this module

        options = {} if self.options is None else self.options
        if not isinstance(options, dict):
            raise ConfigError(f"positional options must be a mapping of option names to values, got {options!r}")
        parsed = get_scheme(self.name).Options(**options)  # raises ConfigError on bad options
        # The values as the scheme reads them: YAML 1.1 gives `1e3` as a string, which config.json would keep
        # as one (only the options given are kept, so a saved config does not spell out every default)
        self.options = {key: getattr(parsed, key) for key in options}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.options)}


@dataclass(frozen=True)
class AttentionGeometry:
    """What a scheme needs to know about the model it is built into."""

    n_layers: int
    n_heads: int
    head_dim: int
    d_model: int
    max_seq_len: int
    causal: bool


class InputPositional(nn.Module, abc.ABC):
    """Adds position to the token embeddings. Parameters are plain ``nn.Parameter``s initialised by
    ``init_weights`` (never nn.Linear/nn.Embedding children, which the model's generic init would reset)."""

    def init_weights(self, mean: float, std: float) -> None:
        """(Re)initialise parameters; the model calls it with its normal(mean, std) init."""

    @abc.abstractmethod
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (batch, n, d_model), positions (batch, n) long -> (batch, n, d_model)."""


class LayerPositional(nn.Module):
    """Per-layer hooks. Defaults leave attention untouched, so a scheme overrides only what it uses.
    Parameters follow the same rule as ``InputPositional``'s."""

    #: Buffers holding fixed fp32 tables (frequencies, slopes) that a model cast moves but never rounds.
    fp32_tables: ClassVar[tuple[str, ...]] = ()

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round these tables too: a bf16 frequency is 0.4% off, which turns a
        # rotation at position 4000 by radians. Every cast and move goes through _apply; keep the fp32 values.
        tables = {name: self._buffers[name] for name in self.fp32_tables}
        super()._apply(fn, recurse)
        for name, table in tables.items():
            moved = self._buffers[name]
            # A meta table holds no values to keep; init_weights computes them once the model is materialised.
            self._buffers[name] = moved.float() if table.is_meta or moved.is_meta else table.to(moved.device)
        return self

    def init_weights(self, mean: float, std: float) -> None:
        """(Re)initialise parameters; the model calls it with its normal(mean, std) init."""

    def transform_qk(
        self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (batch, heads, n, d), k (batch, heads, m, d); q_pos (batch, n), k_pos (batch, m) long.

        Returns q, k of the same shape, or of width 2d for PoPE's Cartesian form. Values (v) are not passed:
        no scheme here changes them.
        """
        return q, k

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Additive logit bias (batch or 1, heads or 1, n, m), or None (xPos's block mask is one for every head)."""
        return None

    def content_bias(self, q: torch.Tensor, k: torch.Tensor, *, causal: bool, key_padding: torch.Tensor | None
                     ) -> torch.Tensor | None:
        """Additive logit bias (batch, heads, n, m) computed from q and k, or None.

        q (batch, heads, n, d) and k (batch, heads, m, d) are after ``transform_qk``, k holding the cached keys
        and the new ones (m >= n; the queries are the last n). Which keys a query sees comes from
        ``poslab.attention.core.visible_keys(n, m, causal=causal, key_padding=key_padding, device=...,
        q_offset=m - n)``, the mask attention itself applies; key_padding (batch, m) is 1 for real tokens.
        The mask is not passed in built: schemes without this hook would pay for an (n, m) mask per layer.
        """
        return None

    def qk_frequency_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-frequency norms of the raw (untransformed) q and k, (..., n_freq) each, or None when the
        scheme has no frequencies. Frequency-usage analysis reads these."""
        return None

    def fused_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
        *, causal: bool, scale: float, key_padding: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """A kernel that applies this scheme inside attention (PoPE's Triton kernel), or None when the
        scheme has none for these inputs. Raw q, k, v (batch, heads, n, d) -> (batch, heads, n, d)."""
        return None


class Scheme(abc.ABC):
    """A registered positional scheme: its options dataclass and a builder."""

    name: ClassVar[str]
    Options: ClassVar[type]
    #: Touches attention only through ``logit_bias`` (T5, ALiBi): what DSTG can take as its relative term.
    bias_only: ClassVar[bool] = False
    #: Evaluation-time ways past the training length (RoPE's linear, ntk, yarn; xPos's blockwise attention):
    #: ``poslab analyze extrapolation --scalings`` rebuilds the same weights with ``context_options``.
    context_scalings: ClassVar[tuple[str, ...]] = ()
    #: Attention logits depend on positions only through their differences: shifting every position changes
    #: nothing (RoPE, PoPE, T5, ALiBi; NoPE trivially), where absolute schemes' do change.
    relative: ClassVar[bool] = False
    #: Builds only into causal models (xPos, whose factor grows toward later keys); encoders refuse it in one line
    #: that gives ``causal_reason`` (why, and what to use instead).
    causal_only: ClassVar[bool] = False
    causal_reason: ClassVar[str] = ""
    #: What ``poslab analyze heads`` calls a head led by this scheme's ``bias`` logit term.
    bias_label: ClassVar[str] = "relative"

    @classmethod
    def context_options(cls, scaling: str, factor: float, original_max_len: int) -> dict[str, Any]:
        """The options (over the run's own) that evaluate ``scaling`` at ``factor`` x ``original_max_len``, the
        training context in tokens; ``scaling`` is one of ``context_scalings``."""
        raise ConfigError(f"positional scheme '{cls.name}' has no context scaling '{scaling}'")

    @classmethod
    @abc.abstractmethod
    def build(
        cls, options: Any, geometry: AttentionGeometry
    ) -> tuple[InputPositional | None, list[LayerPositional | None]]:
        """Modules for a model: (input module or None, one layer module or None per attention layer)."""
