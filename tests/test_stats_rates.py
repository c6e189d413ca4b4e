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
