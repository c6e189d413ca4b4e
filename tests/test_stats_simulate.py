"""Simulation: inputs on the bounded set, responses from the model, reproducible under a seed."""

from __future__ import annotations

import pytest
import torch

from moelab.stats import (
    GaussianMoE,
    RegressionMoE,
    gaussian_truth,
    regression_truth,
    sample_inputs,
    simulate_gaussian,
    simulate_regression,
)


@pytest.mark.parametrize("distribution", ["uniform", "truncnormal"])
def test_inputs_lie_in_the_cube(distribution):
    x = sample_inputs(
        3, 5000, 2, distribution=distribution, bound=0.5, generator=torch.Generator().manual_seed(0)
    )
    assert x.shape == (3, 5000, 2)
    assert x.abs().max() <= 0.5
    assert x.abs().max() > 0.45  # fills the cube


def test_truncated_normal_is_more_concentrated_than_uniform():
    g = torch.Generator().manual_seed(0)
    u = sample_inputs(1, 20000, 1, distribution="uniform", bound=2.0, generator=g)
    t = sample_inputs(1, 20000, 1, distribution="truncnormal", bound=2.0, std=0.5, generator=g)
    assert t.std() < 0.6 < u.std()


def test_regression_noise_has_the_requested_variance_and_seed_reproduces():
    model = RegressionMoE(gate="linear", expert="ffn")
    truth = regression_truth(model, 2, 3, generator=torch.Generator().manual_seed(0))
    assert (
        truth.beta1[0, -1].abs().sum() == 0 and truth.beta0[0, -1] == 0
    )  # last router pinned (perturbed cosine router (2024) E.1)
    X, Y = simulate_regression(
        model, truth, 20000, 2, noise_var=0.04, generator=torch.Generator().manual_seed(1)
    )
    resid = Y - model.mean(X, truth.expand(2))
    assert abs(resid.var().item() - 0.04) < 0.002
    X2, Y2 = simulate_regression(
        model, truth, 20000, 2, noise_var=0.04, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(X, X2) and torch.equal(Y, Y2)


def test_gaussian_samples_follow_the_mixture_mean():
    model = GaussianMoE(gating="softmax")
    truth = gaussian_truth(2, 2, generator=torch.Generator().manual_seed(0))
    X, Y = simulate_gaussian(model, truth, 40000, 1, generator=torch.Generator().manual_seed(1))
    t = truth
    mean = (model.gate_weights(X, t) * model.means(X, t)).sum(-1)
    assert abs((Y - mean).mean().item()) < 0.02


def test_bad_distribution_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="distribution='cauchy'"):
        sample_inputs(1, 10, 2, distribution="cauchy")
    with pytest.raises(ValueError, match="n=0"):
        sample_inputs(1, 0, 2)
    with pytest.raises(ValueError, match="noise_var=-1"):
        model = RegressionMoE()
        simulate_regression(model, regression_truth(model, 2, 2), 10, 1, noise_var=-1)
