"""Batched estimators: recovery of the truth, batching = independent fits, bad input."""

from __future__ import annotations

import pytest
import torch

from moelab.stats import (
    GaussianMoE,
    GaussianMoEMLE,
    LeastSquaresMoE,
    MoEParams,
    RegressionMoE,
    gaussian_truth,
    regression_truth,
    simulate_gaussian,
    simulate_regression,
    voronoi_loss,
)


def _data(gate="linear", expert="linear", n=20000, R=2, k=2, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = RegressionMoE(gate=gate, expert=expert, tau1=1.0, tau2=1.0)
    truth = regression_truth(model, k, d, generator=g)
    X, Y = simulate_regression(model, truth, n, R, noise_var=0.01, generator=g)
    return model, truth, X, Y


def test_exact_specified_linear_gate_recovers_true_parameters_at_large_n():
    # a well-conditioned truth (linear gate, distinct non-linear one-unit experts)
    T = torch.float64
    truth = MoEParams(
        torch.tensor([[0.5, 0.0]], dtype=T),
        torch.tensor([[[2.0, -1.0], [0.0, 0.0]]], dtype=T),
        torch.tensor([[[1.0, 3.0, 0.0, 0.5], [-1.0, 0.0, 3.0, -0.5]]], dtype=T),
    )
    model = RegressionMoE(gate="linear", expert="ffn")
    X, Y = simulate_regression(
        model, truth, 10000, 1, noise_var=0.01, generator=torch.Generator().manual_seed(0)
    )
    kw = dict(gate="linear", expert="ffn", optimizer="lbfgs", lr=1.0, init_noise=0.2)
    est = LeastSquaresMoE(2, steps=40, **kw).fit(X, Y, truth)
    start = LeastSquaresMoE(2, steps=1, **{**kw, "optimizer": "sgd", "lr": 1e-12}).fit(X, Y, truth)
    # the initial perturbation (std 0.2) is removed up to the statistical error
    torch.testing.assert_close(est.beta1_, truth.beta1, atol=0.03, rtol=0)
    torch.testing.assert_close(est.beta0_, truth.beta0, atol=0.03, rtol=0)
    torch.testing.assert_close(est.eta_, truth.eta, atol=0.1, rtol=0)
    assert (est.loss_ - 0.01).abs().max() < 0.001  # training MSE ≈ noise variance
    t = truth
    loss_start = voronoi_loss(start.beta0_, start.beta1_, start.eta_, t.beta0, t.beta1, t.eta)
    loss_end = voronoi_loss(est.beta0_, est.beta1_, est.eta_, t.beta0, t.beta1, t.eta)
    assert (loss_end < 0.2 * loss_start).all()


@pytest.mark.parametrize(
    "optimizer,lr,batch_size", [("sgd", 0.1, None), ("adam", 0.01, None), ("sgd", 0.05, 125)]
)
def test_batched_fit_equals_fits_one_replicate_at_a_time(optimizer, lr, batch_size):
    _, truth, X, Y = _data(gate="perturbed", expert="ffn", n=500, R=3)
    kw = dict(
        gate="perturbed", tau=1.0, optimizer=optimizer, lr=lr, steps=2, batch_size=batch_size, init_noise=0.0
    )
    batched = LeastSquaresMoE(3, **kw).fit(X, Y, truth)
    for r in range(3):
        single = LeastSquaresMoE(3, **kw).fit(X[r : r + 1], Y[r : r + 1], truth)
        if batch_size is None:  # mini-batch shuffles differ between the two runs; full batch is exact
            torch.testing.assert_close(single.beta1_[0], batched.beta1_[r])
            torch.testing.assert_close(single.eta_[0], batched.eta_[r])
        else:
            assert torch.isfinite(single.loss_).all()


def test_random_restarts_keep_the_best_training_loss():
    _, _, X, Y = _data(n=2000, R=2)
    est = LeastSquaresMoE(
        2, gate="linear", expert="linear", init="random", restarts=3, optimizer="lbfgs", steps=30
    )
    est.fit(X, Y)
    assert est.beta1_.shape == (2, 2, 2) and est.loss_.shape == (2,)
    assert est.restart_losses_.shape == (3, 2)
    torch.testing.assert_close(est.loss_, est.restart_losses_.min(dim=0).values)
    # the kept parameters are the ones that achieve loss_
    torch.testing.assert_close(((Y - est.predict(X)) ** 2).mean(dim=-1), est.loss_)


def test_predict_unbatched_and_batched():
    _, truth, X, Y = _data(n=300, R=1)
    est = LeastSquaresMoE(2, gate="linear", expert="linear", steps=2, init_noise=0.0).fit(X[0], Y[0], truth)
    assert est.predict(X[0]).shape == (300,)
    torch.testing.assert_close(est.predict(X)[0], est.predict(X[0]))


def test_gaussian_mle_competition_recovers_means_and_variances():
    g = torch.Generator().manual_seed(0)
    model = GaussianMoE(gating="competition")
    truth = gaussian_truth(2, 2, generator=g)
    X, Y = simulate_gaussian(model, truth, 8000, 1, generator=g)
    est = GaussianMoEMLE(2, gating="competition", optimizer="lbfgs", lr=1.0, steps=60, init_noise=0.1).fit(
        X, Y, truth
    )
    t = truth
    torch.testing.assert_close(est.a_, t.a, atol=0.06, rtol=0)
    torch.testing.assert_close(est.nu_, t.nu, atol=0.03, rtol=0)
    assert torch.equal(est.beta1_, t.beta1 * 0 + est.beta1_)  # no gate parameters are trained


def test_sample_size_below_parameter_count_is_rejected():
    _, truth, X, Y = _data(n=10, R=1)
    with pytest.raises(ValueError, match=r"sample size n=10 is smaller than the number of parameters"):
        LeastSquaresMoE(2, gate="linear", expert="linear").fit(X, Y, truth)


def test_fewer_experts_than_truth_is_rejected():
    _, truth, X, Y = _data(n=500, R=1, k=3)
    with pytest.raises(ValueError, match=r"n_experts=2 is smaller than the true number of experts k\*=3"):
        LeastSquaresMoE(2, gate="linear", expert="linear").fit(X, Y, truth)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"tau": -0.5}, "tau=-0.5"), ({"gate": "hash"}, "gate='hash'"), ({"expert": "conv"}, "expert='conv'"),
     ({"optimizer": "rmsprop"}, "optimizer='rmsprop'"), ({"init": "zeros"}, "init='zeros'"),
     ({"steps": 0}, "steps=0"), ({"lr": -1.0}, "lr=-1.0"), ({"seed": 1.5}, "seed=1.5")],
)  # fmt: skip
def test_fit_rejects_bad_hyper_parameters_that_init_stored_unchecked(kwargs, match):
    _, truth, X, Y = _data(n=500, R=1)
    est = LeastSquaresMoE(2, **kwargs)  # scikit-learn's rule: __init__ stores, fit checks
    assert all(getattr(est, name) == value for name, value in kwargs.items())
    with pytest.raises(ValueError, match=match):
        est.fit(X, Y, truth)


def test_truth_init_without_truth_is_rejected():
    _, _, X, Y = _data(n=500, R=1)
    with pytest.raises(ValueError, match="init='truth' needs the true parameters"):
        LeastSquaresMoE(2).fit(X, Y)
