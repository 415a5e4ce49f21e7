"""Head taxonomy: which additive logit term drives each attention head (DSTG finding 2).

A head's logits are a sum of terms (DSTG: ``ap`` + ``sem`` + ``rp``; other models: ``content`` and, for
T5/ALiBi, ``bias``), captured separately as ``blocks.{i}.attn.logits.{term}``. Softmax ignores anything
constant along a query's row, so a term's influence is measured by its variance *across the keys a
query may attend to*, averaged over queries (rows with fewer than two keys are skipped). A term's share
is its variance divided by the sum of all terms' variances: in [0, 1], summing to 1 per head
(covariances between terms are left out so that shares stay non-negative and comparable).

Labelling rule: a head is named after the term with the largest share when that share is at least
``threshold`` (default 0.5, a majority), otherwise it is "mixed". Terms map to labels by TERM_LABELS:
ap -> structure, sem -> semantic, rp and bias -> relative, content -> content; a scheme whose bias is not a
distance names its own label (``Scheme.bias_label``: CoPE's "contextual").
"""
from __future__ import annotations

import torch

TERM_LABELS = {"ap": "structure", "sem": "semantic", "rp": "relative", "bias": "relative", "content": "content"}
# A label's mark in the heatmaps' cells: distinct where first letters are not (structure, semantic).
MARKS = {"structure": "St", "semantic": "Se", "relative": "R", "contextual": "Cx", "content": "C", "mixed": "M"}


def allowed_keys(n: int, causal: bool, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(batch or 1, 1, n, n) bool: key j is visible to query i (causal order, real tokens only)."""
    i = torch.arange(n)
    allowed = (i[None, :] <= i[:, None]) if causal else torch.ones(n, n, dtype=torch.bool)
    allowed = allowed[None, None]
    if attention_mask is not None:
        real = attention_mask.bool()
        allowed = allowed & real[:, None, None, :] & real[:, None, :, None]
    return allowed


def term_variances(terms: dict[str, torch.Tensor], allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of each term's within-row variance over allowed keys, and the number of rows.

    terms: name -> (batch, heads, n, m); allowed (batch or 1, 1, n, m) bool.
    Returns (sums (terms, heads) float64, rows (heads,) float64) to be accumulated over batches.
    A key some term puts at -inf (a mask given as a bias: xPos's blocks) is not attended to, so not allowed.
    """
    b, h, n, _ = next(iter(terms.values())).shape
    allowed = allowed & ~torch.stack([torch.isneginf(t) for t in terms.values()]).any(0)
    count = allowed.sum(-1)  # (b or 1, 1 or h, n)
    rows = (count >= 2).expand(b, h, n)
    out = []
    for logits in terms.values():
        x = logits.double()
        mean = torch.where(allowed, x, 0.0).sum(-1, keepdim=True) / count[..., None].clamp(min=1)
        var = torch.where(allowed, (x - mean) ** 2, 0.0).sum(-1) / count.clamp(min=1)
        out.append(torch.where(rows, var, 0.0).sum((0, 2)))  # (heads,)
    n_rows = rows.sum((0, 2)).double()
    return torch.stack(out), n_rows


def variance_shares(sums: torch.Tensor) -> torch.Tensor:
    """(terms, ...) summed variances -> shares of the same shape, summing to 1 over terms (0 where all are 0)."""
    total = sums.sum(0, keepdim=True)
    return torch.where(total > 0, sums / total.clamp(min=1e-300), 0.0)


def label_heads(shares: torch.Tensor, names: list[str], threshold: float = 0.5, bias_label: str = "relative"
                ) -> list[str]:
    """shares (terms, heads) -> one label per head by the rule in the module docstring."""
    best = shares.max(0)
    labels = {**TERM_LABELS, "bias": bias_label}
    return [labels.get(names[int(i)], names[int(i)]) if float(v) >= threshold else "mixed"
            for v, i in zip(best.values, best.indices)]
