"""Probes: closed-form ridge against a direct solve, sequence-level splits, MLP and classifier sanity."""
import pytest
import torch

from poslab.analysis.probes import (absolute_positions, classification_probe, cosine_features, count_from_window,
                                    macro_f1, mlp_probe, ridge_probe, shuffle_tokens, split_sequences, start_shown,
                                    valid_targets, variance_features, window_labels)
from poslab.errors import DataError


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_is_by_sequence_disjoint_and_complete():
    s = split_sequences(23, seed=3)
    all_idx = torch.cat([s.train, s.val, s.test])
    assert sorted(all_idx.tolist()) == list(range(23))
    assert len(s.test) == 6 and len(s.val) >= 1 and len(s.train) >= 1
    assert torch.equal(split_sequences(23, seed=3).test, s.test)
    assert not torch.equal(split_sequences(23, seed=4).test, s.test)


def test_too_few_sequences_is_one_clear_error():
    with pytest.raises(DataError, match="too few sequences for a probe split: 2"):
        split_sequences(2)
    with pytest.raises(DataError, match="too few distinct sequences for a probe split: 2"):
        split_sequences(5, same=torch.tensor([[1, 2], [3, 4], [1, 2], [1, 2], [3, 4]]))


def test_copies_of_a_sequence_fall_in_one_part_of_the_split():
    """A task's evaluation set repeats its short problems: a copy on each side would be recalled, not probed."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (40, 3), generator=g)  # 64 possible rows: many repeats
    ids[:10] = ids[0]
    s = split_sequences(40, seed=1, same=ids)
    assert sorted(torch.cat([s.train, s.val, s.test]).tolist()) == list(range(40))
    parts = [{tuple(row) for row in ids[part].tolist()} for part in (s.train, s.val, s.test)]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert len(parts[2]) == round(len(torch.unique(ids, dim=0)) * 0.25)
    # distinct rows: the same split as without ``same`` when they come in sorted order
    distinct = torch.arange(23)[:, None]
    assert torch.equal(split_sequences(23, seed=3, same=distinct).test, split_sequences(23, seed=3).test)


def test_ridge_matches_a_direct_regularised_solve():
    g = torch.Generator().manual_seed(0)
    S, n, d = 40, 16, 6
    x = torch.randn(S, n, d, generator=g) * torch.tensor([1.0, 10, 0.1, 1, 1, 3]) + 5
    w_true = torch.randn(d, 2, generator=g)
    y = (x @ w_true + 0.5 * torch.randn(S, n, 2, generator=g)).abs() + 1  # non-negative targets
    mask = torch.rand(S, n, generator=g) > 0.1
    split = split_sequences(S, seed=1)
    out = ridge_probe(x, y, mask, split, alphas=(1e-2,), chunk_tokens=50)  # small chunks: many accumulations
    # The same fit done directly: standardise on the training tokens, solve, score on test tokens.
    X, Y = x[split.train][mask[split.train]].double(), y[split.train][mask[split.train]].double()
    mu, sd = X.mean(0), X.std(0, unbiased=False)
    Z = (X - mu) / sd
    wz = torch.linalg.solve(Z.T @ Z + 1e-2 * len(Z) * torch.eye(d, dtype=torch.float64), Z.T @ (Y - Y.mean(0)))
    Xt, Yt = x[split.test][mask[split.test]].double(), y[split.test][mask[split.test]].double()
    pred = ((Xt - mu) / sd) @ wz + Y.mean(0)
    r2 = 1 - ((Yt - pred) ** 2).sum(0) / ((Yt - Yt.mean(0)) ** 2).sum(0)
    assert out["r2"] == pytest.approx(r2.tolist(), abs=1e-5)
    assert out["train_tokens"] == len(X) and out["test_tokens"] == len(Xt)


def test_ridge_picks_the_strength_on_validation_sequences():
    g = torch.Generator().manual_seed(1)
    S, n, d = 30, 8, 40  # few tokens, many noise features: strong regularisation should win
    x = torch.randn(S, n, d, generator=g)
    y = 5 + x[..., 0] + 2 * torch.randn(S, n, generator=g)
    out = ridge_probe(x, y, torch.ones(S, n, dtype=torch.bool), split_sequences(S), alphas=(1e-6, 1.0))
    assert out["alpha"] == [1.0]


def test_ridge_cannot_memorise_sequences_across_the_split():
    # Each sequence carries its own identity feature and a random constant target. A token split would
    # let the probe read the target off the identity (R^2 ~ 1); a sequence split gives R^2 <= ~0.
    S, n = 60, 10
    g = torch.Generator().manual_seed(2)
    x = torch.eye(S)[:, None, :].expand(S, n, S).clone()
    y = (torch.rand(S, generator=g) * 100)[:, None].expand(S, n)
    out = ridge_probe(x, y, torch.ones(S, n, dtype=torch.bool), split_sequences(S))
    assert out["r2"][0] < 0.05


def test_ridge_recovers_a_linear_position_code():
    S, n, d = 30, 32, 8
    pos = absolute_positions(torch.ones(S, n, dtype=torch.bool)).float()
    x = torch.randn(S, n, d)
    x[..., 3] += 0.1 * pos
    out = ridge_probe(x, pos, torch.ones(S, n, dtype=torch.bool), split_sequences(S))
    assert out["r2"][0] > 0.3


def test_absolute_positions_and_missing_targets():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    assert absolute_positions(mask)[:, :2].tolist() == [[0, 1], [0, 1]]
    labels = torch.tensor([[0, -1, 2, 3], [-100, 1, 1, 1]])
    assert valid_targets(labels, mask).tolist() == [[True, False, True, False], [False, True, False, False]]


def test_mlp_probe_reads_position_from_causal_means_but_not_from_noise():
    torch.manual_seed(0)
    S, n, d = 48, 24, 16
    mask = torch.ones(S, n, dtype=torch.bool)
    pos = absolute_positions(mask)
    noise = torch.randn(S, n, d)
    means = noise.cumsum(1) / torch.arange(1, n + 1)[None, :, None]  # causal averaging: variance ~ 1/k
    split = split_sequences(S)
    kw = dict(steps=150, hidden=32, batch=256, lr=3e-3)
    informative = mlp_probe(variance_features(means).log(), pos, mask, split, **kw)
    blind = mlp_probe(noise, pos, mask, split, **kw)
    assert informative["pearson_r"] > 0.8 and informative["nrmse"] < 0.6
    assert abs(blind["pearson_r"]) < 0.3 and blind["nrmse"] > 0.9


def test_classification_probe_and_macro_f1():
    assert macro_f1(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 1])) == 1.0
    # class 0: tp 1 fp 0 fn 1 -> 2/3; class 1: tp 1 fp 1 fn 1 -> 1/2; class 2 (predicted only): 0
    assert macro_f1(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 0, 1, 1])) == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    torch.manual_seed(0)
    S, n, d = 40, 12, 5
    x = torch.randn(S, n, d)
    y = torch.bucketize(x[..., 1] + x[..., 2], torch.tensor([-0.7, 0.7]))  # 3 classes, linearly separable
    out = classification_probe(x, y, torch.ones(S, n, dtype=torch.bool), split_sequences(S), steps=150, batch=256)
    assert out["accuracy"] > 0.85 and out["macro_f1"] > 0.8 and out["classes"] == 3


def test_count_from_window_restarts_each_document_at_its_first_sentence_in_the_sequence():
    index = torch.tensor([[-1, 3, 3, 4, -1, 0, 1, -1], [-1, 0, 0, 1, 1, 2, -1, -1]])
    doc_id = torch.tensor([[-1, 7, 7, 7, -1, 8, 8, -1], [-1, 7, 7, 7, 7, 7, -1, -1]])
    assert count_from_window(index, doc_id).tolist() == [[-1, 0, 0, 1, -1, 0, 1, -1], [-1, 0, 0, 1, 1, 2, -1, -1]]


def test_within_unit_positions_are_known_only_where_the_unit_starts_in_view():
    """A sequence that starts inside a sentence (a long document's later chunk, a packed window) cannot show
    how far into that sentence its first tokens are, nor, inside a paragraph, which sentence of it they are."""
    doc_id = torch.tensor([[7, 7, 7, 7, 7, -1], [7, 7, 8, 8, 8, 8]])
    batch = {"doc_id": doc_id,
             "sentence_index": torch.tensor([[3, 3, 4, 4, 5, -1], [0, 0, 0, 0, 1, 1]]),
             "paragraph_index": torch.tensor([[1, 1, 1, 1, 2, -1], [0, 0, 0, 0, 0, 0]]),
             "pos_in_sentence": torch.tensor([[4, 5, 0, 1, 0, -1], [0, 1, 0, 1, 0, 1]]),
             "pos_in_paragraph": torch.tensor([[9, 10, 11, 12, 0, -1], [0, 1, 0, 1, 2, 3]]),
             "sentence_in_paragraph": torch.tensor([[1, 1, 2, 2, 0, -1], [0, 0, 0, 0, 1, 1]])}
    assert start_shown(batch["pos_in_sentence"], batch["sentence_index"], doc_id).tolist() == \
        [[False, False, True, True, True, False], [True] * 6]
    known = window_labels(batch)
    assert known["pos_in_sentence"].tolist() == [[-1, -1, 0, 1, 0, -1], [0, 1, 0, 1, 0, 1]]
    assert known["pos_in_paragraph"].tolist() == [[-1, -1, -1, -1, 0, -1], [0, 1, 0, 1, 2, 3]]
    assert known["sentence_in_paragraph"].tolist() == [[-1, -1, -1, -1, 0, -1], [0, 0, 0, 0, 1, 1]]
    assert known["sentence_index"].tolist() == [[0, 0, 1, 1, 2, -1], [0, 0, 0, 0, 1, 1]]


def test_cosine_features_shapes_and_values():
    cos = torch.nn.functional.cosine_similarity
    h = torch.randn(3, 10, 4)
    mask = torch.ones(3, 10, dtype=torch.bool)
    f, defined = cosine_features(h, mask, lags=(1, 3))
    assert f.shape == (3, 10, 3)
    assert defined.tolist() == [[False] * 3 + [True] * 7] * 3  # a token needs a partner at every lag
    assert torch.allclose(f[:, 5, 0], cos(h[:, 5], h[:, 0], dim=-1), atol=1e-6)  # the first token
    assert torch.allclose(f[:, 5, 1], cos(h[:, 5], h[:, 4], dim=-1), atol=1e-6)  # lag 1
    assert torch.allclose(f[:, 5, 2], cos(h[:, 5], h[:, 2], dim=-1), atol=1e-6)  # lag 3
    bi, bi_defined = cosine_features(h, mask, causal=False, lags=(1,))
    both = (cos(h[:, 5], h[:, 4], dim=-1) + cos(h[:, 5], h[:, 6], dim=-1)) / 2
    assert torch.allclose(bi[:, 5, 1], both, atol=1e-6)
    assert bi_defined[0].tolist() == [False] + [True] * 8 + [False]  # bidirectional: a partner on each side


def test_cosine_features_count_real_tokens_across_padding():
    h = torch.randn(2, 8, 6)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, [0, 3]] = False  # padding on the left and inside
    f, defined = cosine_features(h, mask, lags=(1, 2))
    real = h[1, mask[1]]
    ref, ref_defined = cosine_features(real[None], torch.ones(1, 6, dtype=torch.bool), lags=(1, 2))
    assert torch.allclose(f[1, mask[1]], ref[0], atol=1e-6)
    assert defined[1, mask[1]].tolist() == ref_defined[0].tolist() and not defined[1, ~mask[1]].any()


def test_cosine_features_read_the_adjacency_pattern_and_nothing_from_states_without_position():
    """The null the features must pass: i.i.d. states carry no position, so a probe on their features must
    not find any (a feature whose input count grows with the position would fail this); causal running
    means carry the adjacency pattern, which the probe must read; shuffling their tokens removes it."""
    torch.manual_seed(0)
    S, n, d = 96, 32, 32
    mask = torch.ones(S, n, dtype=torch.bool)
    mask[::3, 24:] = False  # some shorter sequences
    pos = absolute_positions(mask)
    noise = torch.randn(S, n, d)
    means = noise.cumsum(1) / torch.arange(1, n + 1)[None, :, None]
    split = split_sequences(S)
    kw = dict(steps=300, hidden=64, batch=256, lr=3e-3)

    def probe(states):
        x, defined = cosine_features(states, mask)
        return mlp_probe(x, pos, mask & defined, split, **kw)

    blind, informative = probe(noise), probe(means)
    shuffled = probe(shuffle_tokens(means, mask, seed=1))
    assert blind["nrmse"] > 0.9 and abs(blind["pearson_r"]) < 0.3
    assert shuffled["nrmse"] > 0.9
    assert informative["nrmse"] < 0.7 and informative["pearson_r"] > 0.75  # measured 0.55 and 0.83


def test_shuffle_tokens_permutes_real_tokens_only():
    h = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6, 1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    out = shuffle_tokens(h, mask, seed=0)
    assert sorted(out[0, :, 0].tolist()) == h[0, :, 0].tolist() and out[0, :, 0].tolist() != h[0, :, 0].tolist()
    assert sorted(out[1, :4, 0].tolist()) == h[1, :4, 0].tolist() and out[1, 4:].equal(h[1, 4:])
    assert out.equal(shuffle_tokens(h, mask, seed=0))


def test_blocked_gram_equals_the_full_product():
    from poslab.analysis.probes import _gram

    x = torch.randn(50, 7, dtype=torch.float64)
    for width in (1, 3, 7, 10):
        assert torch.allclose(_gram(x, width), x.T @ x)


def test_cli_probe_targets_count_document_indices_from_the_window():
    # `poslab analyze probes` must probe what the input can tell, as the DSTG recipe does: a window that
    # starts at a document's sentence 3 (paragraph 1, token 40) shows sentence 0 of it, not sentence 3.
    from poslab.analysis.commands import _probe_targets

    doc_id = torch.tensor([[-1, 7, 7, 7, 8, 8, -1]])
    batch = {"input_ids": torch.zeros(1, 7, dtype=torch.long), "attention_mask": torch.ones(1, 7, dtype=torch.long),
             "doc_id": doc_id,
             "sentence_index": torch.tensor([[-1, 3, 3, 4, 0, 0, -1]]),
             "paragraph_index": torch.tensor([[-1, 1, 1, 2, 0, 0, -1]]),
             "pos_in_document": torch.tensor([[-1, 40, 41, 42, 0, 1, -1]]),
             "pos_in_sentence": torch.tensor([[-1, 5, 6, 0, 0, 1, -1]])}
    targets = _probe_targets(batch, batch["attention_mask"].bool(), None)
    assert targets["sentence_index"].tolist() == [[-1, 0, 0, 1, 0, 0, -1]]
    assert targets["paragraph_index"].tolist() == [[-1, 0, 0, 1, 0, 0, -1]]
    assert targets["pos_in_document"].tolist() == [[-1, 0, 1, 2, 0, 1, -1]]
    # within a sentence: known where the sentence starts in view (doc 7's sentence 3 began before the window)
    assert targets["pos_in_sentence"].tolist() == [[-1, -1, -1, 0, 0, 1, -1]]


def test_mlp_probe_scores_its_predictions_by_independent_formulas(monkeypatch):
    """With the network fixed (a known linear map, no training) the probe's predictions are known: features
    standardised by the training + validation tokens, outputs de-standardised by their targets. NRMSE is the
    test RMSE over the test targets' own spread and R is scipy's Pearson; the test targets are made to spread
    and sit unlike the fitted ones, so normalising by the wrong set, leaking test tokens into the fit or the
    standardisation, or an uncentred correlation all show."""
    from scipy import stats

    import poslab.analysis.probes as probes

    g = torch.Generator().manual_seed(7)
    S, n, d = 12, 5, 3
    x = torch.randn(S, n, d, generator=g) * torch.tensor([1.0, 4.0, 0.5]) + torch.tensor([3.0, -2.0, 1.0])
    split = split_sequences(S, seed=2)
    y = torch.rand(S, n, generator=g) * 10
    y[split.test] = y[split.test] * 3 + 5
    mask = torch.ones(S, n, dtype=torch.bool)
    mask[split.test[0], 3:] = False
    net = torch.nn.Linear(d, 1).double()
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]))
        net.bias.fill_(0.3)
    monkeypatch.setattr(probes, "_network", lambda *args: net.float())
    monkeypatch.setattr(probes, "_train", lambda *args, **kwargs: None)
    out = mlp_probe(x, y, mask, split)

    fit = torch.cat([split.train, split.val])
    xf, yf = x[fit][mask[fit]].double(), y[fit][mask[fit]].double()
    xt, yt = x[split.test][mask[split.test]].double(), y[split.test][mask[split.test]].double()
    z = (xt - xf.mean(0)) / xf.std(0, unbiased=False)
    pred = (z @ torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) + 0.3) * yf.std(unbiased=False) + yf.mean()
    rmse = ((pred - yt) ** 2).mean().sqrt().item()
    assert out["rmse"] == pytest.approx(rmse, rel=1e-5)
    assert out["nrmse"] == pytest.approx(rmse / yt.std(unbiased=False).item(), rel=1e-5)
    assert out["pearson_r"] == pytest.approx(stats.pearsonr(pred.numpy(), yt.numpy()).statistic, abs=1e-5)
    assert out["train_tokens"] == len(xf) and out["test_tokens"] == len(xt)


def test_ridge_strength_is_chosen_on_validation_not_test_sequences():
    """Validation sequences follow the training relation exactly (a weak penalty wins there); test sequences
    do not (there a strong penalty, predicting the mean, would score better). The strength must be the
    validation sequences' choice, and the R^2 reported is the test sequences' under it."""
    g = torch.Generator().manual_seed(3)
    S, n = 30, 8
    split = split_sequences(S, seed=0)
    x = torch.randn(S, n, 1, generator=g)
    y = 10 + 2 * x[..., 0] + 0.1 * torch.randn(S, n, generator=g)
    y[split.val] = 10 + 2 * x[split.val][..., 0]
    y[split.test] = 10 + torch.randn(len(split.test), n, generator=g)
    out = ridge_probe(x, y, torch.ones(S, n, dtype=torch.bool), split, alphas=(1e-6, 1e3))
    assert out["alpha"] == [1e-6]
    assert out["r2"][0] < -1  # the weak-penalty fit on test sequences it does not describe


def test_variance_features_are_the_population_variance_across_hidden_dimensions():
    h = torch.tensor([[[1.0, 3.0], [0.0, 4.0], [2.0, 2.0]]])
    assert variance_features(h).tolist() == [[[1.0], [4.0], [0.0]]]
