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
    # Small integers halve or quarter the memory traffic; every intermediate below stays under 1.5 N.
    small = torch.int16 if N <= 1 << 14 else torch.int32
    seq = rank.to(small)
    pos = torch.arange(N, device=rank.device, dtype=small)
    split = split.to(small)[:, None]
    # Per-position running counts (a position's total over all levels is < N); summed once at the end.
    total = torch.zeros(R, N, dtype=small, device=rank.device)
    below = torch.zeros(R, N, dtype=small, device=rank.device)
    for b in reversed(range(N.bit_length() - 1)):
        half, block = 1 << b, 2 << b
        one = (seq >> b) & 1
        zeros = (1 - one).view(R, N // block, block).cumsum(-1, dtype=small).view(R, N)
        earlier_smaller = zeros * one  # a 1-bit element follows `zeros` 0-bits in its block
        total += earlier_smaller
        below += earlier_smaller.masked_fill(seq >= split, 0)  # mixed-dtype products would copy
        # Stable partition of each block by this bit: a 0-bit goes to start - 1 + zeros, a 1-bit to
        # pos + half - zeros (arithmetic instead of torch.where, which is slower on small integers).
        start = pos & ~(block - 1)
        new_pos = (start - 1 + zeros) + one * ((pos - start + half + 1) - 2 * zeros)
        seq = torch.empty_like(seq).scatter_(-1, new_pos.long(), seq)
    total, below = total.sum(-1), below.sum(-1)
    return total, below


def _pack_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair row a with row b = T - a so that their earlier entries (a + b = T of them) fill one row.

    rows (B, n, n) -> (values (B * P, T), a (P,), b (P,)): packed row p holds C[a_p, 0..a_p-1] then
    C[b_p, 0..b_p-1]. T = n - 1 for even n; for odd n, T = n and row 0 (which has no entries) stays out.
    """
    n, dev = rows.shape[-1], rows.device
    T = n - 1 if n % 2 == 0 else n
    a = torch.arange(n % 2, (n + 1) // 2, device=dev)
    b = T - a
    t = torch.arange(T, device=dev)
    in_a = t[None, :] < a[:, None]  # (P, T)
    src_row = torch.where(in_a, a[:, None], b[:, None])
    src_col = torch.where(in_a, t[None, :], t[None, :] - a[:, None])
    return rows[:, src_row, src_col].reshape(-1, T), a, b


def adjacency_row_scores(sim: torch.Tensor) -> torch.Tensor:
    """P_k for every row. sim (..., n, n) -> (..., n) float64; NaN for k < 2 and for non-finite rows.

    Row k has k entries and row n-1-k has n-1-k, so each pair of rows is packed into one sequence of
    n - 1 values (``_pack_rows``). One stable sort of the packed rows, then a stable partition by which
    row a value came from, ranks both rows at once: the first row's values get ranks 0..a-1 and the
    second's a..T-1, so every cross pair is ascending (a known a * b). Ties are broken by descending
    position, so a tied pair never looks ascending, and are counted separately from the sorted runs.
    """
    if sim.dim() < 2 or sim.shape[-1] != sim.shape[-2]:
        raise DataError(f"adjacency needs square similarity matrices (..., n, n), got shape {tuple(sim.shape)}")
    n, batch, dev = sim.shape[-1], sim.shape[:-2], sim.device
    if n < 3:
        return torch.full((*batch, n), float("nan"), dtype=torch.float64, device=dev)
    rows = sim.reshape(-1, n, n)
    B = rows.shape[0]
    values, a, b = _pack_rows(rows)
    R, T = values.shape
    split = a.repeat(B)[:, None]  # (R, 1): packed positions >= split belong to the second row
    t = torch.arange(T, device=dev)
    second = t[None, :] >= split
    # A finite sum means every entry is finite (one reduction instead of an elementwise test).
    bad_first = bad_second = torch.zeros(R, dtype=torch.bool, device=dev)
    if not torch.isfinite(values.sum()):
        bad = ~torch.isfinite(values)
        bad_first, bad_second = (bad & ~second).any(-1), (bad & second).any(-1)
        values = torch.where(bad, 0.0, values)  # those rows end up NaN; 0 keeps the ranks a permutation

    # Descending stable sort, read backwards = ascending values, ties in descending position order.
    desc_vals, desc_order = torch.sort(values, dim=-1, descending=True, stable=True)
    sorted_vals, order = desc_vals.flip(-1), desc_order.flip(-1)
    from_second = order >= split
    # Stable partition by row: the first row's values take ranks 0..a-1, the second's a..T-1.
    dest = torch.where(from_second, split - 1 + from_second.cumsum(-1), (~from_second).cumsum(-1) - 1)
    rank = torch.empty_like(order).scatter_(-1, order, dest)
    ties_first = ties_second = torch.zeros(R, dtype=torch.long, device=dev)
    if bool((sorted_vals[:, 1:] == sorted_vals[:, :-1]).any()):  # float similarities rarely tie; skip if none
        # In partitioned order, a run of equal values that stays inside one row ties pairwise.
        part = torch.empty_like(sorted_vals).scatter_(-1, dest, sorted_vals)
        new_run = torch.ones_like(part, dtype=torch.bool)
        new_run[:, 1:] = (part[:, 1:] != part[:, :-1]) | (t[None, 1:] == split)
        run_start = torch.where(new_run, t, 0).cummax(dim=-1).values
        tied_before = t - run_start  # each value ties with this many before it in its run
        ties_first = torch.where(second, 0, tied_before).sum(-1)
        ties_second = tied_before.sum(-1) - ties_first

    N = 1 << max(0, (T - 1).bit_length())
    pad = torch.arange(T, N, device=dev).expand(R, N - T)  # ranked above everything: the pad at t adds t
    packed = torch.cat([rank, pad], -1)
    # Row chunks of ~2^19 entries keep a level's working set in cache (about 2x faster than one pass).
    step = max(1, (1 << 19) // N)
    parts = [_ascending_pairs(packed[i:i + step], split[i:i + step, 0]) for i in range(0, R, step)]
    total, below = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    rep_a, rep_b = a.repeat(B), b.repeat(B)
    above = total - below - rep_a * rep_b - (N * (N - 1) - T * (T - 1)) // 2

    ascending = torch.zeros((B, n), dtype=torch.float64, device=dev)
    ties = torch.zeros((B, n), dtype=torch.float64, device=dev)
    bad_row = torch.zeros((B, n), dtype=torch.bool, device=dev)
    for index, asc, tie, bad in ((a, below, ties_first, bad_first), (b, above, ties_second, bad_second)):
        ascending[:, index] = asc.view(B, -1).double()
        ties[:, index] = tie.view(B, -1).double()
        bad_row[:, index] = bad.view(B, -1)
    k = torch.arange(n, device=dev)
    pairs = (k * (k - 1) // 2).double()
    p = (ascending + 0.5 * ties) / pairs.clamp(min=1)
    p = torch.where((k >= 2)[None, :] & ~bad_row, p, torch.full_like(p, float("nan")))
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
