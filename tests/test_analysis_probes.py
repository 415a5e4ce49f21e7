"""Probes: closed-form ridge against a direct solve, sequence-level splits, MLP and classifier sanity."""
import pytest
import torch

from poslab.analysis.probes import (absolute_positions, classification_probe, cosine_features, macro_f1, mlp_probe,
                                    ridge_probe, split_sequences, valid_targets, variance_features)
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


def test_cosine_features_shapes_and_values():
    h = torch.randn(3, 10, 4)
    f = cosine_features(h, lags=(1, 3))
    assert f.shape == (3, 10, 6)
    assert torch.all(f[:, 0] == 0)  # position 0 sees nothing
    c = torch.nn.functional.cosine_similarity(h[:, 5], h[:, 4], dim=-1)
    assert torch.allclose(f[:, 5, 4], c, atol=1e-6)  # lag 1
    assert torch.allclose(f[:, 5, 3], torch.nn.functional.cosine_similarity(h[:, 5], h[:, 0], dim=-1), atol=1e-6)
    bi = cosine_features(h, causal=False, lags=(1,))
    both = (torch.nn.functional.cosine_similarity(h[:, 5], h[:, 4], dim=-1)
            + torch.nn.functional.cosine_similarity(h[:, 5], h[:, 6], dim=-1)) / 2
    assert torch.allclose(bi[:, 5, 4], both, atol=1e-6)
    assert torch.all(bi[:, 0, 0] != 0)  # bidirectional: position 0 sees the others


def test_blocked_gram_equals_the_full_product():
    from poslab.analysis.probes import _gram

    x = torch.randn(50, 7, dtype=torch.float64)
    for width in (1, 3, 7, 10):
        assert torch.allclose(_gram(x, width), x.T @ x)
