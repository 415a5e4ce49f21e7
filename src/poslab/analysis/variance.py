"""The competing hypothesis (Chi et al. 2023, arXiv 2305.13571): position lives in the variance of states.

In a causal layer the attention output at position k averages k + 1 value vectors, so its spread across
hidden dimensions shrinks roughly like 1/k and a later layer could read position from it. These
functions measure that spread per position, so it can be set against the adjacency score and used as
probe features (``probes.variance_features``).
"""
from __future__ import annotations

import torch


def position_variance(h: torch.Tensor) -> torch.Tensor:
    """Population variance of each state across hidden dimensions. h (..., n, d) -> (..., n) fp32."""
    return h.float().var(-1, unbiased=False)


def variance_profile(h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean per-position variance over sequences. h (S, n, d), mask (S, n) bool -> (n,); NaN where no
    sequence has a real token."""
    var = position_variance(h)
    mask = torch.ones_like(var, dtype=torch.bool) if mask is None else mask.bool()
    count = mask.sum(0)
    total = torch.where(mask, var, 0.0).sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


def variance_trend(profile: torch.Tensor) -> dict[str, float]:
    """How the profile moves with position: Spearman rho (negative = shrinking, the hypothesis) and the
    ratio of the mean variance of the last quarter of positions to that of the first quarter."""
    keep = torch.isfinite(profile)
    values = profile[keep].double()
    if values.numel() < 4:
        return {"spearman_rho": float("nan"), "late_to_early": float("nan")}
    from scipy import stats  # imported here: scipy.stats costs ~1 s, too much for every `poslab` call

    pos = torch.arange(profile.numel())[keep]
    rho = stats.spearmanr(pos.numpy(), values.numpy()).statistic
    q = max(1, values.numel() // 4)
    early, late = values[:q].mean(), values[-q:].mean()
    return {"spearman_rho": float(rho), "late_to_early": float(late / early) if early > 0 else float("nan")}
