"""Rate fitting recovers known slopes; bad input is rejected."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.stats import fit_rate


def test_recovers_slope_of_noiseless_power_law():
    n = np.array([1e3, 2e3, 4e3, 8e3, 16e3])
    losses = (3.0 * n**-0.5)[:, None] * np.ones((1, 10))
    fit = fit_rate(n, losses)
    assert fit.slope == pytest.approx(-0.5, abs=1e-12)
    assert fit.intercept == pytest.approx(np.log(3.0), abs=1e-12)
    assert fit.ci_low == pytest.approx(-0.5, abs=1e-12) and fit.ci_high == pytest.approx(-0.5, abs=1e-12)


def test_recovers_slope_of_noisy_power_law_within_its_interval():
    rng = np.random.default_rng(0)
    n = np.geomspace(500, 64000, 8)
    losses = 2.0 * n[:, None] ** -0.25 * rng.lognormal(0.0, 0.3, size=(8, 40))
    fit = fit_rate(n, losses, seed=1)
    assert fit.ci_low < -0.25 < fit.ci_high
    assert abs(fit.slope + 0.25) < 0.03
    assert fit.ci_high - fit.ci_low < 0.1


@pytest.mark.parametrize(
    "n,losses,match",
    [([100], [[1.0]], "expected >= 2 distinct"), ([100, 200], [[1.0]], r"losses must be \(S, R\)"),
     ([100, 200], [[1.0], [-1.0]], "finite and > 0"), ([100, 100], [[1.0], [1.0]], "expected >= 2 distinct")],
)  # fmt: skip
def test_rejects_bad_input(n, losses, match):
    with pytest.raises(ValueError, match=match):
        fit_rate(n, losses)


def test_slope_difference_recovers_a_known_difference_and_covers_it():
    from moelab.stats import slope_difference

    rng = np.random.default_rng(0)
    n = np.geomspace(500, 64000, 8)
    a = 2.0 * n[:, None] ** -0.5 * rng.lognormal(0.0, 0.2, size=(8, 40))
    b = 1.0 * n[:, None] ** -0.25 * rng.lognormal(0.0, 0.2, size=(8, 40))
    diff = slope_difference(n, a, b, seed=1)
    assert abs(diff.difference + 0.25) < 0.03
    assert diff.ci_low < -0.25 < diff.ci_high and diff.ci_high < 0  # the difference is resolved
    same = slope_difference(n, a, a)
    assert same.difference == 0 and same.ci_low < 0 < same.ci_high  # a series against itself


def test_slope_difference_of_noiseless_series_is_exact():
    from moelab.stats import slope_difference

    n = np.array([1e3, 4e3, 16e3])
    diff = slope_difference(n, (n**-0.5)[:, None] * np.ones((1, 5)), (n**-0.25)[:, None] * np.ones((1, 5)))
    assert diff.difference == pytest.approx(-0.25, abs=1e-12)
    assert diff.ci_low == pytest.approx(-0.25, abs=1e-12) and diff.ci_high == pytest.approx(-0.25, abs=1e-12)


def test_mean_table_gives_mean_sd_and_a_bootstrap_interval_per_n():
    from moelab.stats import mean_table

    rng = np.random.default_rng(0)
    losses = rng.lognormal(0.0, 0.5, size=(3, 200))
    rows = mean_table([100, 200, 400], losses, seed=0)
    assert [r["n"] for r in rows] == [100, 200, 400]
    for s, row in enumerate(rows):
        assert row["mean"] == pytest.approx(losses[s].mean())
        assert row["sd"] == pytest.approx(losses[s].std(ddof=1))
        assert row["ci_low"] < row["mean"] < row["ci_high"]
        half = 1.96 * row["sd"] / np.sqrt(200)  # the normal interval, for scale
        assert row["ci_high"] - row["ci_low"] == pytest.approx(2 * half, rel=0.15)
        assert row["replicates"] == 200


def test_slope_difference_rejects_series_of_the_wrong_shape():
    from moelab.stats import slope_difference

    with pytest.raises(ValueError, match=r"losses must be \(S, R\) with S=2"):
        slope_difference([100, 200], [[1.0], [2.0]], [[1.0], [2.0], [3.0]])
