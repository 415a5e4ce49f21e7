"""Cosine self-similarity and the adjacency probability score (papers/adjacency.md).

Definition we commit to. For a similarity matrix C (n, n), row k looks only at the
earlier positions 0..k-1 (the diagonal and later columns are ignored, as a causal model sees them):

    P_k = ( #{i < j < k : C_ki < C_kj} + 1/2 #{i < j < k : C_ki == C_kj} ) / C(k, 2)

i.e. the share of pairs where the nearer of two earlier positions is the more similar one, ties counted
1/2. Rows with fewer than two earlier positions (k = 0, 1) are skipped; the score of a matrix is the
mean of P_2..P_{n-1}. 0.5 = no order, 1.0 = similarity strictly increasing toward the diagonal.
P_k = (1 + tau_b-like)/2, so it is a per-row Kendall-type count: done here with one sort per row and a
Fenwick tree over the ranks, compiled with numba, O(n^2 log n) per matrix. A row containing a non-finite value gives NaN (and so does the score of its matrix).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from poslab.errors import DataError

__all__ = [
    "cosine_self_similarity",
    "adjacency_row_scores",
    "adjacency_score",
    "adjacency_row_scores_reference",
    "sequence_adjacency",
]


def cosine_self_similarity(h: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """C_ij = cos(h_i, h_j). h (..., n, d) -> (..., n, n) float64.

    float64 because the score ranks these values: states sharing a large component (an init mean of 4 or
    8) have cosines within ~1e-6 of 1, where float32's rounding (~6e-8) would reorder them. The states need
    the precision too: the reproduction's initialisation ablation runs its models in float64.
    A zero vector has similarity 0 with everything (eps guards the norm), never NaN.
    Equal states (a repeated token at the embedding layer) get equal columns: the matrix product rounds each
    entry in its own order, which split 2% of such ties by the last bit, and the score counts a tie 1/2.
    """
    x = F.normalize(h.double(), dim=-1, eps=eps)
    sim = x @ x.transpose(-1, -2)
    return sim.gather(-1, _first_equal(h)[..., None, :].expand_as(sim))


def _first_equal(h: torch.Tensor) -> torch.Tensor:
    """h (..., n, d) -> (..., n) int64: for each state, the index of the first state in its sequence equal to it."""
    n = h.shape[-2]
    flat = h.reshape(-1, n, h.shape[-1])
    first = torch.empty(flat.shape[:2], dtype=torch.long, device=h.device)
    positions = torch.arange(n, device=h.device)
    for b, states in enumerate(flat):
        _, group = torch.unique(states, dim=0, return_inverse=True)
        lowest = torch.full((n,), n, dtype=torch.long, device=h.device).scatter_reduce(0, group, positions, "amin")
        first[b] = lowest[group]
    return first.view(h.shape[:-1])


def _row_scores(rows: np.ndarray, out: np.ndarray) -> None:
    """P_k of every row of every matrix, into out. rows (B, n, n) float64, out (B, n) float64 prefilled NaN.

    Per row: a stable argsort gives dense ranks (equal values share one, and each run of c equal values adds
    c(c-1)/2 ties); then a Fenwick tree over ranks counts, for each j in position order, the earlier
    entries with a strictly smaller rank. O(k log k) per row, O(n^2 log n) per matrix.
    """
    n = rows.shape[-1]
    tree = np.zeros(n + 1, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    for m in range(rows.shape[0]):
        for k in range(2, n):
            v = rows[m, k, :k]
            if not np.isfinite(v).all():
                continue
            order = np.argsort(v, kind="mergesort")
            ties = run = top = 0
            for t in range(k):
                if t == 0 or v[order[t]] != v[order[t - 1]]:
                    top += 1
                    ties += run * (run - 1) // 2
                    run = 0
                run += 1
                rank[order[t]] = top
            ties += run * (run - 1) // 2
            tree[:top + 1] = 0
            ascending = 0
            for j in range(k):
                i = rank[j] - 1  # earlier entries with rank <= rank_j - 1
                while i > 0:
                    ascending += tree[i]
                    i -= i & -i
                i = rank[j]
                while i <= top:
                    tree[i] += 1
                    i += i & -i
            out[m, k] = (ascending + 0.5 * ties) / (k * (k - 1) // 2)


@functools.cache
def _compiled_row_scores():
    """numba is imported and the count compiled (or loaded from numba's cache) on first use only, so that
    importing poslab stays fast."""
    import numba

    try:
        return numba.njit(cache=True, nogil=True)(_row_scores)
    except RuntimeError:  # no writable cache location (read-only install, no writable HOME): compile each time
        return numba.njit(nogil=True)(_row_scores)


def adjacency_row_scores(sim: torch.Tensor) -> torch.Tensor:
    """P_k for every row. sim (..., n, n) -> (..., n) float64 on sim's device; NaN for k < 2 and for rows
    with a non-finite entry. Counted on the CPU in float64 (a compiled Fenwick-tree pass, ``_row_scores``):
    the matrix is n^2 numbers, the count is the expensive part, and it is exact."""
    if sim.dim() < 2 or sim.shape[-1] != sim.shape[-2]:
        raise DataError(f"adjacency needs square similarity matrices (..., n, n), got shape {tuple(sim.shape)}")
    n, batch = sim.shape[-1], sim.shape[:-2]
    if n < 3 or sim.numel() == 0:  # no row has two earlier positions (and reshape(-1, 0, 0) is ambiguous)
        return torch.full((*batch, n), float("nan"), dtype=torch.float64, device=sim.device)
    rows = np.ascontiguousarray(sim.detach().reshape(-1, n, n).to("cpu", torch.float64).numpy())
    out = np.full(rows.shape[:2], np.nan)
    _compiled_row_scores()(rows, out)
    return torch.from_numpy(out).view(*batch, n).to(sim.device)


def adjacency_score(sim: torch.Tensor) -> torch.Tensor:
    """Adjacency probability score per matrix: mean of P_k over rows k >= 2. sim (..., n, n) -> (...) float64."""
    n = sim.shape[-1] if sim.dim() >= 2 else 0
    if n < 3:
        raise DataError(f"adjacency needs at least 3 positions (a row with 2 earlier ones), got n={n}")
    p = adjacency_row_scores(sim)[..., 2:]
    return p.mean(-1)  # NaN rows propagate: a matrix with a non-finite entry has no score


def adjacency_row_scores_reference(sim: torch.Tensor) -> torch.Tensor:
    """The O(n^3) brute-force count of the same P_k, pair by pair; the test and benchmark baseline."""
    n = sim.shape[-1]
    rows = sim.reshape(-1, n, n).double()
    out = torch.full(rows.shape[:2], float("nan"), dtype=torch.float64)
    for k in range(2, n):
        v = rows[:, k, :k]  # (B, k)
        before = torch.triu(torch.ones(k, k, dtype=torch.bool), diagonal=1)  # i < j
        less = (v[:, :, None] < v[:, None, :]) & before
        equal = (v[:, :, None] == v[:, None, :]) & before
        # counts as float64: integer + 0.5 * integer would be a float32 sum, exact only to ~1e-7
        out[:, k] = (less.sum((1, 2)).double() + 0.5 * equal.sum((1, 2)).double()) / (k * (k - 1) / 2)
        out[:, k] = torch.where(torch.isfinite(v).all(-1), out[:, k], float("nan"))
    return out.view(*sim.shape[:-1])


def sequence_adjacency(h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Adjacency score of each sequence's own real tokens. h (S, n, d), mask (S, n) bool -> (S,) float64;
    NaN for a sequence with fewer than 3 real tokens. Sequences of equal length are scored together."""
    S, n = h.shape[:2]
    mask = torch.ones(S, n, dtype=torch.bool, device=h.device) if mask is None else mask.bool()
    lengths = mask.sum(-1)
    out = torch.full((S,), float("nan"), dtype=torch.float64)
    for length in torch.unique(lengths).tolist():
        if length < 3:
            continue
        rows = (lengths == length).nonzero().flatten()
        states = h[rows][mask[rows]].view(len(rows), length, -1)
        out[rows.cpu()] = adjacency_score(cosine_self_similarity(states)).cpu()
    return out
