"""Cosine self-similarity and the adjacency probability score (papers/adjacency.md).

Definition we commit to (DESIGN.md). For a similarity matrix C (n, n), row k looks only at the
earlier positions 0..k-1 (the diagonal and later columns are ignored, as a causal model sees them):

    P_k = ( #{i < j < k : C_ki < C_kj} + 1/2 #{i < j < k : C_ki == C_kj} ) / C(k, 2)

i.e. the share of pairs where the nearer of two earlier positions is the more similar one, ties counted
1/2. Rows with fewer than two earlier positions (k = 0, 1) are skipped; the score of a matrix is the
mean of P_2..P_{n-1}. 0.5 = no order, 1.0 = similarity strictly increasing toward the diagonal.
P_k = (1 + tau_b-like)/2, so it is a per-row Kendall-type count: done here with one sort per row plus
a vectorised wavelet-matrix pass (log n levels of O(n) scans) over all rows at once, O(n^2 log n) per
matrix. A row containing a non-finite value gives NaN (and so does the score of its matrix).
"""
from __future__ import annotations

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
    """C_ij = cos(h_i, h_j). h (..., n, d) -> (..., n, n), computed in at least fp32.

    A zero vector has similarity 0 with everything (eps guards the norm), never NaN.
    """
    x = F.normalize(h.float() if h.dtype in (torch.float16, torch.bfloat16) else h, dim=-1, eps=eps)
    return x @ x.transpose(-1, -2)


def _tie_pairs(sorted_vals: torch.Tensor) -> torch.Tensor:
    """sorted_vals (R, n), each row ascending -> (R,) int64 number of pairs with equal values."""
    n = sorted_vals.shape[-1]
    idx = torch.arange(n, device=sorted_vals.device, dtype=torch.int32)
    new_run = torch.ones_like(sorted_vals, dtype=torch.bool)
    new_run[..., 1:] = sorted_vals[..., 1:] != sorted_vals[..., :-1]
    run_start = torch.where(new_run, idx, 0).cummax(dim=-1).values
    return (idx - run_start).sum(-1, dtype=torch.int64)  # element j ties with the j - start before it


def _ascending_pairs(rank: torch.Tensor, split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count pairs i < j with r_i < r_j in rows of a rank permutation, bit by bit from the top.

    rank (R, N) int, each row a permutation of 0..N-1, N a power of two (<= 2^31); split (R,) int.
    Returns (total, below), each (R,) int64: ``below`` counts only pairs whose later element j has
    r_j < split, so two independent sequences packed into one row (the second offset above the first)
    can be told apart. The sequence is kept ordered by (rank >> (b + 1), index): a pair is counted once,
    at the highest bit b where its ranks differ, when the 0-bit one comes before the 1-bit one in their
    shared block. Ranks are a permutation, so blocks sit at fixed offsets and each level is O(N).
    """
    R, N = rank.shape
    small = torch.int16 if N < 1 << 15 else torch.int32  # half the memory traffic of int32 when ranks fit
    seq = rank.to(small)
    pos = torch.arange(N, device=rank.device)  # int64: destinations come out int64, as scatter wants
    split = split.to(small)[:, None]
    total = torch.zeros(R, dtype=torch.int64, device=rank.device)
    below = torch.zeros(R, dtype=torch.int64, device=rank.device)
    for b in reversed(range(N.bit_length() - 1)):
        half, block = 1 << b, 2 << b
        one = (seq & half) != 0
        zeros = (~one).view(R, N // block, block).cumsum(-1, dtype=small).view(R, N)
        earlier_smaller = zeros * one  # a 1-bit element follows `zeros` 0-bits in its block
        total += earlier_smaller.sum(-1)
        below += (earlier_smaller * (seq < split)).sum(-1)
        # Stable partition of each block by this bit: 0-bits keep their order in the first half.
        one_dest = pos + half  # minus the zeros before it
        zero_dest = (pos & ~(block - 1)) - 1  # plus the zeros up to it
        new_pos = torch.where(one, one_dest - zeros, zero_dest + zeros)
        seq = torch.empty_like(seq).scatter_(-1, new_pos, seq)
    return total, below


def adjacency_row_scores(sim: torch.Tensor) -> torch.Tensor:
    """P_k for every row. sim (..., n, n) -> (..., n) float64; NaN for k < 2 and for non-finite rows.

    Rows are ranked with one stable sort (later columns become +inf, ties broken by descending index so
    that a tied pair never counts as ascending; ties are counted separately). Row k has k ranks and row
    n-1-k has n-1-k, so the two are packed into one sequence of length n-1 (the second offset above
    the first, which makes every cross pair ascending, a known a*b) and counted together: half the work.
    """
    if sim.dim() < 2 or sim.shape[-1] != sim.shape[-2]:
        raise DataError(f"adjacency needs square similarity matrices (..., n, n), got shape {tuple(sim.shape)}")
    n, batch, dev = sim.shape[-1], sim.shape[:-2], sim.device
    rows = sim.reshape(-1, n, n)
    B = rows.shape[0]
    k = torch.arange(n, device=dev)
    earlier = k[None, :] < k[:, None]  # (n, n): column j is earlier than row k
    finite = torch.where(earlier, torch.isfinite(rows), True).all(-1)  # (B, n)
    if n < 3:
        return torch.full((*batch, n), float("nan"), dtype=torch.float64, device=dev)

    # Non-finite entries (their rows end up NaN anyway) become 0 so that each row still ranks its k
    # earlier values 0..k-1 below the +inf pads.
    masked = torch.where(earlier, torch.where(torch.isfinite(rows), rows, 0.0), torch.inf)
    sorted_vals, order = torch.sort(masked.flip(-1), dim=-1, stable=True)
    ties = _tie_pairs(sorted_vals.view(B * n, n)).view(B, n) - (n - k) * (n - k - 1) // 2
    rank = torch.empty((B, n, n), dtype=torch.int32, device=dev)
    rank.scatter_(-1, (n - 1) - order, k.to(torch.int32).expand(B, n, n).contiguous())

    # Pair rows a and b = T - a (lengths a + b = T); with n odd, row 0 (empty) stays out.
    T = n - 1 if n % 2 == 0 else n
    a = torch.arange(n % 2, (n + 1) // 2, device=dev)  # (P,)
    b = T - a
    t = torch.arange(T, device=dev)
    in_a = t[None, :] < a[:, None]  # (P, T)
    src_row = torch.where(in_a, a[:, None], b[:, None])
    src_col = torch.where(in_a, t[None, :], t[None, :] - a[:, None])
    packed = rank[:, src_row, src_col] + torch.where(in_a, 0, a[:, None]).to(torch.int32)  # (B, P, T)
    N = 1 << max(0, (T - 1).bit_length())
    pad = torch.arange(T, N, device=dev, dtype=torch.int32).expand(B, a.numel(), N - T)
    packed = torch.cat([packed, pad], -1).view(-1, N)  # pads rank above everything: each pad at t adds t
    split = a.repeat(B)
    # Row chunks of ~2^19 entries keep a level's working set in cache (about 2x faster than one pass).
    step = max(1, (1 << 19) // N)
    parts = [_ascending_pairs(packed[i:i + step], split[i:i + step]) for i in range(0, packed.shape[0], step)]
    total, below = torch.cat([t for t, _ in parts]), torch.cat([b for _, b in parts])
    total, below = total.view(B, -1), below.view(B, -1)
    ascending = torch.zeros((B, n), dtype=torch.int64, device=dev)
    ascending[:, a] = below
    ascending[:, b] = total - below - a * b - (N * (N - 1) - T * (T - 1)) // 2

    pairs = (k * (k - 1) // 2).double()
    p = (ascending.double() + 0.5 * ties.double()) / pairs.clamp(min=1)
    p = torch.where((k >= 2)[None, :] & finite, p, torch.full_like(p, float("nan")))
    return p.view(*batch, n)


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
        out[:, k] = (less.sum((1, 2)) + 0.5 * equal.sum((1, 2))) / (k * (k - 1) / 2)
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
