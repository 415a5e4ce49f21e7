"""Frequency usage (PoPE paper): how much of each rotary frequency queries and keys actually use.

Each positional layer module reports per-frequency norms of the raw q and k through
``qk_frequency_norms`` (RoPE: the 2-norm of each rotated 2-D chunk, d/2 frequencies; PoPE: the
softplus magnitude of each of its d components), which models capture as
``blocks.{i}.attn.freq_norms.q`` / ``.k`` (batch, heads, n, n_freq). Averaging over heads, sequences and
real tokens gives one row per layer of a layer x frequency heatmap. Frequencies are in the scheme's
order, highest first (theta_0 = 1 rad per position).
"""
from __future__ import annotations

import torch


def frequency_sums(norms: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """norms (batch, heads, n, n_freq) -> (sum over heads and real tokens (n_freq,) float64, count)."""
    if attention_mask is None:
        return norms.double().sum((0, 1, 2)), float(norms.shape[0] * norms.shape[1] * norms.shape[2])
    real = attention_mask.bool()[:, None, :, None]
    total = torch.where(real, norms.double(), 0.0).sum((0, 1, 2))
    return total, float(real.sum()) * norms.shape[1]


def usage_summary(q: torch.Tensor, k: torch.Tensor) -> dict:
    """q, k (layers, n_freq) mean norms -> per-layer share of the total carried by the top quarter of
    frequency indices (the fastest rotations) and the index holding the largest mean norm."""
    out = {}
    for name, m in (("q", q), ("k", k)):
        quarter = max(1, m.shape[-1] // 4)
        share = m[:, :quarter].sum(-1) / m.sum(-1).clamp(min=1e-300)
        out[name] = {"high_frequency_share": share.tolist(), "peak_index": m.argmax(-1).tolist()}
    return out
