"""Variance, spectra, head taxonomy and frequency-usage functions on inputs with known answers."""
import math

import pytest
import torch

from poslab.analysis.frequencies import frequency_sums, usage_summary
from poslab.analysis.heads import allowed_keys, label_heads, term_variances, variance_shares
from poslab.analysis.spectra import dct_power, pca, spectrum_summary, top2_at_width
from poslab.analysis.variance import position_variance, variance_profile, variance_trend


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def test_variance_profile_of_causal_means_shrinks():
    torch.manual_seed(0)
    x = torch.randn(64, 40, 128)
    means = x.cumsum(1) / torch.arange(1, 41)[None, :, None]
    prof = variance_profile(means)
    assert prof.shape == (40,)
    assert prof[0] == pytest.approx(1.0, rel=0.05) and prof[39] == pytest.approx(1 / 40, rel=0.1)
    trend = variance_trend(prof)
    assert trend["spearman_rho"] < -0.99 and trend["late_to_early"] < 0.2
    mask = torch.ones(64, 40, dtype=torch.bool)
    mask[:, 30:] = False
    assert torch.isnan(variance_profile(means, mask)[30:]).all()
    assert position_variance(torch.tensor([[1.0, 3.0]])).item() == 1.0


def test_pca_of_a_rank_two_smooth_table():
    pos = torch.arange(64, dtype=torch.float64)
    basis = torch.randn(2, 32, dtype=torch.float64)
    table = torch.stack([torch.cos(math.pi * pos / 63), pos / 63], 1) @ basis
    ratios, scores = pca(table)
    assert ratios[:2].sum() == pytest.approx(1.0) and ratios[2:].sum() < 1e-12
    summary = spectrum_summary(table.float())
    assert summary["top2_explained"] == pytest.approx(1.0, abs=1e-5)
    # PC1 is ~ the half cosine (bin 1); PC2 the part of the ramp orthogonal to it (mostly bin 3).
    assert min(summary["low_bin_share"][:2]) > 0.8
    # PC3 and PC4 carry no variance: no spectrum, rather than rounding noise scaled up to a unit of power
    exact = spectrum_summary(table)
    assert exact["dct_power"][2:] == [[0.0] * 64] * 2 and exact["low_bin_share"][2:] == [0.0, 0.0]
    noisy = spectrum_summary(torch.randn(64, 32))  # an entangled-looking table: no dominant smooth axes
    assert noisy["top2_explained"] < 0.25 and sum(noisy["low_bin_share"]) / 4 < 0.3


def test_top2_share_at_a_narrower_width():
    """A rank-2 table keeps its share through a projection; a random one falls to a random table's at that
    width, which is far above its own share at full width (the width effect the comparison removes)."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(41, dtype=torch.float64)
    flat = torch.stack([torch.cos(math.pi * pos / 40), pos / 40], 1) @ torch.randn(2, 64, generator=g, dtype=torch.float64)
    assert top2_at_width(flat, 16) == pytest.approx(1.0)
    wide = torch.randn(41, 64, generator=g, dtype=torch.float64)
    narrow = [float(pca(torch.randn(41, 16, generator=g, dtype=torch.float64))[0][:2].sum()) for _ in range(32)]
    full = float(pca(wide)[0][:2].sum())
    assert top2_at_width(wide, 16) == pytest.approx(sum(narrow) / len(narrow), abs=0.03)
    assert top2_at_width(wide, 16) > full + 0.1
    assert top2_at_width(wide, 64) == full and top2_at_width(wide, 16, seed=1) != top2_at_width(wide, 16)


def test_dct_power_locates_a_pure_cosine():
    n = 32
    t = torch.arange(n, dtype=torch.float64)
    sig = torch.cos(math.pi * 5 * (t + 0.5) / n)  # DCT-II basis function 5
    p = dct_power(sig[None])
    assert p[0, 5] == pytest.approx(1.0) and p.sum() == pytest.approx(1.0)
    noise = dct_power(torch.randn(1, n, dtype=torch.float64))
    assert noise[0, :4].sum() < 0.6


def test_head_shares_and_labels():
    torch.manual_seed(0)
    b, h, n = 2, 3, 6
    row_const = torch.randn(b, h, n, 1).expand(b, h, n, n)  # varies by query only: irrelevant to softmax
    big = torch.randn(b, h, n, n) * torch.tensor([10.0, 0.1, 1.0])[None, :, None, None]
    small = torch.randn(b, h, n, n)
    small[:, 2] = big[:, 2]  # head 2: ap and sem vary equally -> shares 1/2, 1/2
    terms = {"ap": big, "sem": small, "rp": row_const}
    sums, rows = term_variances(terms, allowed_keys(n, causal=True))
    assert rows.tolist() == [b * (n - 1)] * h  # query 0 sees one key: skipped
    shares = variance_shares(sums)
    assert torch.allclose(shares.sum(0), torch.ones(h, dtype=torch.float64))
    assert torch.all(shares[2] < 1e-12)
    assert torch.allclose(shares[:2, 2], torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert label_heads(shares, list(terms), threshold=0.6) == ["structure", "semantic", "mixed"]


def test_head_variance_matches_a_direct_count_with_padding():
    torch.manual_seed(1)
    n = 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    logits = torch.randn(2, 1, n, n)
    sums, rows = term_variances({"content": logits}, allowed_keys(n, causal=False, attention_mask=mask))
    expected, count = 0.0, 0
    for bi in range(2):
        real = int(mask[bi].sum())
        for q in range(real):
            expected += logits[bi, 0, q, :real].double().var(unbiased=False).item()
            count += 1
    assert sums[0, 0].item() == pytest.approx(expected) and rows.item() == count


def test_frequency_sums_ignore_padding():
    norms = torch.ones(2, 3, 4, 5)
    norms[1, :, 2:] = 100.0
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    total, count = frequency_sums(norms, mask)
    assert count == 3 * 6 and torch.allclose(total / count, torch.ones(5, dtype=torch.float64))
    summary = usage_summary(torch.tensor([[4.0, 1, 1, 1, 1, 1, 1, 1]]), torch.ones(1, 8))
    assert summary["q"]["peak_index"] == [0] and summary["q"]["high_frequency_share"][0] == pytest.approx(5 / 11)


# ---- against independent computations (mutation review: each of these caught a formula bug the tests above
# let through) ------------------------------------------------------------------------------------------------

def _orthonormal_dct2(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix written out: C[k, t] = s_k cos(pi k (2t + 1) / 2n), s_0 = sqrt(1/n), else
    sqrt(2/n)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    t = torch.arange(n, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * k * (2 * t + 1) / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c


def test_pca_matches_the_covariance_eigendecomposition():
    """Explained-variance ratios are the eigenvalues of the column covariance over their sum, and the scores the
    centred table's coordinates on the eigenvectors (up to sign). The table has large, different column means
    and an unequal spread per column, so PCA without centring, centring over the other axis, or ratios of
    singular values instead of their squares all give other numbers."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    table = torch.randn(30, 6, generator=g, dtype=torch.float64) * torch.tensor([5.0, 3, 2, 1, 0.5, 0.1])
    table += torch.tensor([40.0, -20, 7, 3, -9, 1])
    x = table.numpy()
    cov = np.cov(x, rowvar=False)
    evals, evecs = np.linalg.eigh(cov)
    evals, evecs = evals[::-1], evecs[:, ::-1]
    ratios, scores = pca(table)
    assert ratios.numpy() == pytest.approx(evals / evals.sum(), abs=1e-12)
    expected = (x - x.mean(0)) @ evecs  # (30, 6) coordinates on each axis
    assert np.abs(scores.numpy().T) == pytest.approx(np.abs(expected), abs=1e-9)
    assert spectrum_summary(table)["top2_explained"] == pytest.approx(float((evals[:2] / evals.sum()).sum()), abs=1e-12)


def test_dct_power_matches_the_orthonormal_dct2_written_out():
    """Power shares of random signals against the DCT-II matrix built by hand (scipy.fft.dct type 2, norm
    "ortho"): an unnormalised DCT doubles bin 0's share relative to the rest; normalising over the signals
    instead of the bins breaks every row's sum."""
    g = torch.Generator().manual_seed(4)
    sig = torch.randn(3, 12, generator=g, dtype=torch.float64) + torch.tensor([[2.0], [0.0], [-1.0]])
    coeffs = sig @ _orthonormal_dct2(12).T
    expected = coeffs**2 / (coeffs**2).sum(-1, keepdim=True)
    assert torch.allclose(dct_power(sig), expected, atol=1e-12)
    assert torch.allclose(dct_power(sig).sum(-1), torch.ones(3, dtype=torch.float64))


def test_low_bin_share_is_the_first_four_bins_of_each_component():
    """PC1 is DCT-II basis 3 (inside the first four bins 0..3), PC2 basis 4 (just outside): shares 1 and 0."""
    n = 32
    c = _orthonormal_dct2(n)
    axes = torch.linalg.qr(torch.randn(10, 2, dtype=torch.float64))[0].T  # two orthonormal directions in 10-D
    table = torch.stack([3 * c[3], c[4]], 1) @ axes  # PC1 (variance 9) along basis 3, PC2 (variance 1) along 4
    summary = spectrum_summary(table, components=2)
    assert summary["explained_variance_ratio"][:2] == pytest.approx([0.9, 0.1], abs=1e-12)
    assert summary["low_bin_share"] == pytest.approx([1.0, 0.0], abs=1e-12)


def test_top2_at_width_projects_through_orthonormal_directions():
    """A centred table whose columns are orthogonal and of equal norm (X^T X = I) stays isotropic through any
    orthonormal projection: every direction of the projected table carries the same variance, so the top-2
    share at width w is exactly 2 / w. A projection through non-orthonormal (e.g. Gaussian) directions is not
    isotropic and gives more."""
    g = torch.Generator().manual_seed(5)
    raw = torch.randn(41, 16, generator=g, dtype=torch.float64)
    table = torch.linalg.qr(raw - raw.mean(0))[0]  # centred (orthogonal to the ones vector), X^T X = I
    assert pca(table)[0].numpy() == pytest.approx([1 / 16] * 16, abs=1e-12)
    for width in (4, 8):
        assert top2_at_width(table, width) == pytest.approx(2 / width, abs=1e-9)


def test_variance_profile_averages_over_the_sequences_that_reach_each_position():
    h = torch.tensor([[[0.0, 2.0], [0.0, 4.0], [1.0, 1.0]],
                      [[0.0, 6.0], [0.0, 0.0], [0.0, 0.0]]])  # per-token variances [[1, 4, 0], [9, 0, 0]]
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert variance_profile(h, mask).tolist() == [5.0, 4.0, 0.0]  # position 1 and 2: only sequence 0


def test_variance_trend_against_scipy_and_its_quarters():
    from scipy import stats

    profile = torch.tensor([8.0, 4, 2, 1, 1.5, 1, 0.25, 0.5, float("nan")])
    trend = variance_trend(profile)
    assert trend["spearman_rho"] == pytest.approx(stats.spearmanr(range(8), profile[:8].numpy()).statistic)
    # 8 finite values: quarters of 2 -> (0.25 + 0.5) / 2 over (8 + 4) / 2
    assert trend["late_to_early"] == pytest.approx(0.375 / 6)


def test_keys_a_term_masks_with_minus_infinity_are_not_counted():
    """xPos's blocks hide keys through its bias: the variances are those of the keys left visible."""
    content = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    hidden = torch.rand(2, 1, 6, 6) < 0.3
    bias = torch.zeros(2, 3, 6, 6, dtype=torch.float64).masked_fill(hidden, float("-inf"))
    allowed = allowed_keys(6, causal=True)
    sums, rows = term_variances({"content": content, "bias": bias}, allowed)
    expected, expected_rows = term_variances({"content": content}, allowed & ~hidden)
    assert torch.isfinite(sums).all() and sums[1].eq(0).all()
    torch.testing.assert_close(sums[:1], expected)
    torch.testing.assert_close(rows, expected_rows)


def test_a_head_is_named_at_exactly_the_threshold_share():
    """The rule is "at least ``threshold``" (a majority of 0.5 included), not "more than"."""
    shares = torch.tensor([[0.5, 0.4], [0.25, 0.35], [0.25, 0.25]], dtype=torch.float64)
    assert label_heads(shares, ["ap", "sem", "rp"]) == ["structure", "mixed"]
    assert label_heads(shares, ["ap", "sem", "rp"], threshold=0.4) == ["structure", "structure"]
    assert label_heads(shares, ["bias", "content", "rp"]) == ["relative", "mixed"]
    assert label_heads(shares, ["bias", "content", "rp"], bias_label="contextual") == ["contextual", "mixed"]


def test_frequency_sums_without_a_mask_count_every_head_and_token():
    norms = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    total, count = frequency_sums(norms)
    assert count == 2 * 3 * 4 and torch.allclose(total, norms.double().sum((0, 1, 2)))
    masked_total, masked_count = frequency_sums(norms, torch.ones(2, 4, dtype=torch.long))
    assert masked_count == count and torch.allclose(masked_total, total)


def test_causal_head_variance_reads_each_querys_own_and_earlier_keys():
    """Query q of a causal head sees keys 0..q (itself included), never later ones: the sums match a direct
    count over those keys, with query 0 (a single key) skipped."""
    torch.manual_seed(2)
    n = 5
    logits = torch.randn(1, 1, n, n)
    sums, rows = term_variances({"content": logits}, allowed_keys(n, causal=True))
    expected = sum(logits[0, 0, q, :q + 1].double().var(unbiased=False).item() for q in range(1, n))
    assert sums[0, 0].item() == pytest.approx(expected) and rows.item() == n - 1
    assert allowed_keys(3, causal=True)[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
