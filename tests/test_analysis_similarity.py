"""Adjacency score: the fast count against the O(n^3) pair-by-pair count, hand-made cases, shapes."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poslab.analysis.similarity import (adjacency_row_scores, adjacency_row_scores_reference, adjacency_score,
                                        cosine_self_similarity, sequence_adjacency)
from poslab.errors import DataError
from poslab.functional import adjacency_score as functional_adjacency
from poslab.functional import cosine_self_similarity as functional_cosine


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.allclose(a.nan_to_num(0), b.nan_to_num(0), rtol=0,
                                                                          atol=1e-12)


def test_functional_reexports_the_contract_names():
    assert functional_adjacency is adjacency_score and functional_cosine is cosine_self_similarity


def test_cosine_self_similarity_shape_values_and_zero_vectors():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [0.0, 0.0]])
    c = cosine_self_similarity(h[None].expand(2, -1, -1))
    assert c.shape == (2, 4, 4)
    assert c[0, 0, 1].item() == pytest.approx(0.0) and c[0, 0, 2].item() == pytest.approx(math.sqrt(0.5))
    assert torch.allclose(torch.diagonal(c[0])[:3], torch.ones(3, dtype=torch.float64))
    assert torch.all(c[0, 3] == 0)  # a zero vector is dissimilar to everything, never NaN
    assert cosine_self_similarity(h.to(torch.bfloat16)).dtype == torch.float64


def test_repeated_states_tie_exactly():
    """The embedding layer repeats a token's state wherever the token repeats: its cosines with any state must
    tie, or the score counts 0 or 1 where the definition counts 1/2 (the matrix product split 2% of them)."""
    g = torch.Generator().manual_seed(0)
    vocab = torch.randn(10, 384, generator=g)
    tokens = torch.randint(0, 10, (64, 40), generator=g)
    unit = torch.nn.functional.normalize(vocab.double(), dim=-1)
    exact = (unit @ unit.T)[tokens[:, :, None], tokens[:, None, :]]  # equal by construction where tokens are
    sim = functional_cosine(vocab[tokens])
    same = (tokens[:, :, None] == tokens[:, None, :])[:, None].expand(-1, 40, -1, -1)  # (S, row, col, col)
    assert not (sim[:, :, :, None] != sim[:, :, None, :])[same].any()
    torch.testing.assert_close(sim, exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(adjacency_score(sim), adjacency_score(exact), rtol=0, atol=1e-15)


def test_perfect_monotone_scores_one_and_reversed_scores_zero():
    n = 9
    i = torch.arange(n, dtype=torch.float64)
    near = -(i[:, None] - i[None, :]).abs()  # nearer = more similar
    assert adjacency_score(near).item() == 1.0
    assert adjacency_score(-near).item() == 0.0


def test_hand_made_row_with_ties():
    # Row 3 sees columns 0, 1, 2 with values 0.5, 0.5, 0.1: pairs (0,1) tie -> 1/2, (0,2) and (1,2) decrease -> 0.
    # Row 2 sees 0.2, 0.9: ascending -> 1. Score = mean(1, 1/6).
    sim = torch.zeros(4, 4)
    sim[2, :2] = torch.tensor([0.2, 0.9])
    sim[3, :3] = torch.tensor([0.5, 0.5, 0.1])
    rows = adjacency_row_scores(sim)
    assert torch.isnan(rows[:2]).all()
    assert rows[2].item() == 1.0 and rows[3].item() == pytest.approx(1 / 6)
    assert adjacency_score(sim).item() == pytest.approx((1 + 1 / 6) / 2)


def test_constant_rows_score_one_half():
    assert adjacency_score(torch.ones(6, 6)).item() == 0.5


def test_later_columns_and_diagonal_are_ignored():
    torch.manual_seed(0)
    sim = torch.randn(12, 12)
    other = sim.clone()
    other.triu_().add_(torch.randn(12, 12).triu() * 100)  # change only the diagonal and the upper triangle
    other = torch.where(torch.ones(12, 12).tril(-1).bool(), sim, other)
    assert same(adjacency_row_scores(sim), adjacency_row_scores(other))


@pytest.mark.parametrize("n", [3, 4, 5, 8, 17, 32, 33])
def test_matches_brute_force_on_random_and_tied_matrices(n):
    g = torch.Generator().manual_seed(n)
    for sim in (torch.randn(3, n, n, generator=g), torch.randint(0, 3, (3, n, n), generator=g).float()):
        assert same(adjacency_row_scores(sim), adjacency_row_scores_reference(sim))


@settings(max_examples=25, deadline=None)
@given(batch=st.lists(st.integers(1, 3), min_size=0, max_size=2), n=st.integers(3, 24),
       levels=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_batched_matrices_match_brute_force(batch, n, levels, seed):
    g = torch.Generator().manual_seed(seed)
    sim = torch.randint(0, levels, (*batch, n, n), generator=g).double() / levels  # few levels: many ties
    fast = adjacency_score(sim)
    assert fast.shape == tuple(batch)
    ref = adjacency_row_scores_reference(sim)[..., 2:].mean(-1)
    assert torch.allclose(fast, ref, atol=1e-12)


def test_non_finite_row_gives_nan_and_other_matrices_are_unaffected():
    sim = torch.randn(2, 6, 6, dtype=torch.float64)
    sim[0, 4, 1] = float("nan")
    rows = adjacency_row_scores(sim)
    assert torch.isnan(rows[0, 4]) and not torch.isnan(rows[0, 5])
    scores = adjacency_score(sim)
    assert torch.isnan(scores[0]) and torch.isfinite(scores[1])


def test_bad_shapes_raise_a_data_error():
    with pytest.raises(DataError, match="square"):
        adjacency_score(torch.zeros(3, 4))
    with pytest.raises(DataError, match="at least 3 positions"):
        adjacency_score(torch.zeros(2, 2))


def test_causal_mixing_of_random_embeddings_is_adjacent():
    # The paper's mechanism: state k = mean of the first k + 1 embeddings -> nearby states are similar.
    torch.manual_seed(0)
    x = torch.randn(4, 64, 32)
    mixed = x.cumsum(1) / torch.arange(1, 65)[None, :, None]
    emb = adjacency_score(cosine_self_similarity(x))
    mix = adjacency_score(cosine_self_similarity(mixed))
    assert (emb - 0.5).abs().max() < 0.05 and (mix > 0.95).all()


def test_sequence_adjacency_scores_each_sequences_real_tokens():
    torch.manual_seed(0)
    h = torch.randn(3, 10, 8)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 2:] = False
    scores = sequence_adjacency(h, mask)
    assert scores[0].item() == pytest.approx(adjacency_score(cosine_self_similarity(h[0])).item())
    assert scores[1].item() == pytest.approx(adjacency_score(cosine_self_similarity(h[1, :6])).item())
    assert torch.isnan(scores[2])  # two real tokens: no row with two earlier positions


def test_huge_finite_values_and_low_precision_inputs_are_scored_exactly():
    """Entries whose sum overflows are still finite (only a non-finite entry voids a row), and half-precision
    matrices are counted on their exact values, widened to float64."""
    sim = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e308, 0.0, 0.0, 0.0], [1e308, 1.7e308, 0.0, 0.0],
                        [-1e308, 1e308, 1.7e308, 0.0]], dtype=torch.float64)
    assert same(adjacency_row_scores(sim), adjacency_row_scores_reference(sim))
    assert float(adjacency_score(sim)) == 1.0
    half = torch.randn(2, 9, 9).to(torch.bfloat16)
    assert same(adjacency_row_scores(half), adjacency_row_scores_reference(half.double()))


def test_matrices_too_small_for_a_score_give_nan_rows():
    for shape in [(0, 0), (3, 0, 0), (2, 2), (4, 1, 1)]:
        rows = adjacency_row_scores(torch.zeros(shape))
        assert rows.shape == shape[:-1] and torch.isnan(rows).all()


def test_near_parallel_states_are_scored_on_their_exact_cosines():
    # A large shared component (the paper's init mean 4 or 8) puts every cosine within ~1e-6 of 1, where
    # float32 resolves only ~6e-8: the similarities must not be rounded to that grid before they are ranked.
    torch.manual_seed(0)
    x = torch.randn(4, 48, 64)
    states = 8 + 0.002 * x.cumsum(1) / torch.arange(1, 49)[None, :, None]  # float32, as models capture them
    m = states.double()
    norm = m.norm(dim=-1)
    exact = adjacency_score((m @ m.transpose(-1, -2)) / (norm[..., :, None] * norm[..., None, :]))
    assert exact.min() > 0.99
    assert torch.allclose(adjacency_score(cosine_self_similarity(states)), exact, atol=1e-6)
    assert torch.allclose(sequence_adjacency(states), exact, atol=1e-6)


def test_a_sequence_of_exactly_three_real_tokens_is_scored():
    """Three tokens are the fewest with a score (row 2 has two earlier positions): its P_2 by hand."""
    h = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [5.0, 5.0]]])
    mask = torch.tensor([[True, True, True, False]])
    # row 2: cos to token 0 is 0.6, to token 1 is 0.8 -> the nearer one is the more similar: P_2 = 1
    assert sequence_adjacency(h, mask).tolist() == [1.0]
    assert sequence_adjacency(h[:, [1, 0, 2, 3]], mask).tolist() == [0.0]
