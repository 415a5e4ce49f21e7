"""How far each attention head looks: distances, entropy and offset profiles of attention probabilities.

A head's attention probabilities p(t, s) (query t, key s, ``blocks.{i}.attn.probs``) say where it reads
from; positional encodings shape that pattern, so these measures summarise it per layer and head:

- ``mean_distance``: sum_s p(t, s) |t - s|, averaged over queries: how many tokens away a head reads.
- ``uniform_distance``: the same for uniform attention over each query's visible keys, the baseline the
  mask alone gives (about t / 2 in a causal model), and ``distance_ratio`` = mean_distance /
  uniform_distance: below 1 a local head, above 1 a head that looks further than chance.
- ``entropy``: H(p_t) / log(#visible keys), 1 for uniform attention, 0 for attention on one key.
- ``previous_token``: p(t, t - 1), the induction-circuit's previous-token head; ``self``: p(t, t);
  ``first_token``: p(t, 0), the "attention sink" where heads park mass they do not need.
- ``profile``: the mean probability at each offset Delta = t - s, over the queries that see a key at
  that offset: 0..n-1 for a causal model, -(n-1)..n-1 (Delta < 0: keys after the query) for a
  bidirectional one. It is a mean probability per offset, not a distribution: it does not sum to 1.

Queries counted: real tokens (``attention_mask`` 1, right padding) that have a choice, i.e. at least two
visible keys (``poslab.analysis.heads.allowed_keys``: causal order, real keys). A causal model's first
query sees only itself, so every head puts p = 1 on it at distance 0; counting it would pull all heads
alike towards "self" and "local". Hence previous-token attention (p(t, t - 1) = 1 for t >= 1) has
mean_distance exactly 1. ``previous_token`` and ``first_token`` further need t >= 1 and the key visible.

Batches are reduced to sums and counts (``attention_sums``), added up (``add_sums``) and divided at the
end (``attention_means``), so no analysis holds more than one batch's probabilities.
"""
from __future__ import annotations

import torch

from poslab.analysis.heads import allowed_keys


def attention_sums(probs: torch.Tensor, causal: bool, attention_mask: torch.Tensor | None = None,
                   hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-head sums of each measure over one batch's counted queries, and the counts to divide them by.

    probs (batch, heads, n, n), summing to 1 over each query's visible keys (as the models' do; anything
    on other keys is ignored); attention_mask (batch, n), 1 for real tokens; hidden (batch or 1, 1, n, n) bool,
    True on keys the model itself masks (a logit bias at -inf in every head: xPos's blocks), not visible either.
    Returns float64 tensors: ``distance``, ``entropy``, ``previous_token``, ``self``, ``first_token`` (heads,); ``uniform_distance``
    and the counts ``queries``, ``previous_queries``, ``first_queries`` (); ``profile``
    (heads, offsets) and ``profile_queries`` (offsets,) at ``offsets`` (offsets,) = 0..n-1 when causal, else
    -(n-1)..n-1.
    """
    b, h, n, _ = probs.shape
    allowed = allowed_keys(n, causal, attention_mask).expand(b, 1, n, n)
    if hidden is not None:
        allowed = allowed & ~hidden
    visible = allowed.sum(-1)  # (b, 1, n)
    chosen = visible >= 2  # the queries counted: those with a choice (module docstring)
    allowed = allowed & chosen[..., None]
    keys = visible.clamp(min=2).double()  # a counted query's number of keys; 2 stands in for the others
    p = torch.where(allowed, probs.double(), 0.0)
    t = torch.arange(n)
    offset = t[:, None] - t[None, :]  # (n, n): Delta = t - s
    distance = offset.abs().double()
    out = {"queries": chosen.sum().double(),
           "distance": (p * distance).sum((0, 2, 3)),
           "uniform_distance": (torch.where(allowed, distance, 0.0).sum(-1) / keys).sum(),
           "self": p.diagonal(dim1=-2, dim2=-1).sum((0, 2))}
    plogp = torch.where(p > 0, p * p.clamp(min=1e-300).log(), 0.0).sum(-1)  # (b, h, n); 0 log 0 = 0
    out["entropy"] = (-plogp / keys.log()).sum((0, 2))  # rows of uncounted queries are all 0
    # The diagonal below the main one: (query t, key t - 1) for t = 1..n-1
    out["previous_token"] = p.diagonal(offset=-1, dim1=-2, dim2=-1).sum((0, 2))
    out["previous_queries"] = allowed.diagonal(offset=-1, dim1=-2, dim2=-1).sum().double()
    out["first_token"] = p[..., 1:, 0].sum((0, 2))
    out["first_queries"] = allowed[..., 1:, 0].sum().double()
    offsets = torch.arange(0 if causal else -(n - 1), n)
    index = (offset - offsets[0]).clamp(min=0).flatten()  # causal: Delta < 0 is never visible
    out["profile"] = torch.zeros(h, len(offsets), dtype=torch.float64).index_add_(1, index, p.sum(0).flatten(1))
    out["profile_queries"] = torch.zeros(len(offsets), dtype=torch.float64).index_add_(
        0, index, allowed.sum((0, 1)).flatten().double())
    out["offsets"] = offsets
    return out


def add_sums(total: dict[str, torch.Tensor] | None, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sums of two batches (``attention_sums``), the profile widened to the longer one's offsets
    (batches of a task are as wide as their longest sequence)."""
    if total is None:
        return dict(part)
    offsets = torch.arange(min(total["offsets"][0], part["offsets"][0]), max(total["offsets"][-1],
                                                                           part["offsets"][-1]) + 1)
    out = {k: total[k] + part[k] for k in total if not k.startswith("profile") and k != "offsets"}
    for key in ("profile", "profile_queries"):
        wide = total[key].new_zeros(*total[key].shape[:-1], len(offsets))
        for sums in (total, part):
            wide[..., sums["offsets"] - offsets[0]] += sums[key]
        out[key] = wide
    out["offsets"] = offsets
    return out


def attention_means(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums -> the measures of the module docstring: (heads,) each, ``uniform_distance`` (),
    ``profile`` (heads, offsets) and ``offsets``; NaN where no query was counted."""
    def mean(value: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return torch.where(count > 0, value / count.clamp(min=1), torch.nan)

    queries = sums["queries"]
    out = {"mean_distance": mean(sums["distance"], queries),
           "uniform_distance": mean(sums["uniform_distance"], queries),
           "entropy": mean(sums["entropy"], queries),
           "previous_token": mean(sums["previous_token"], sums["previous_queries"]),
           "self": mean(sums["self"], queries),
           "first_token": mean(sums["first_token"], sums["first_queries"]),
           "profile": mean(sums["profile"], sums["profile_queries"]),
           "offsets": sums["offsets"]}
    out["distance_ratio"] = out["mean_distance"] / out["uniform_distance"]
    return out
