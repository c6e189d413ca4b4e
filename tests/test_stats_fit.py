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


# ------------------------------------------------------------- compact parameter space, restarts


def test_to_ball_maps_onto_the_open_ball_and_from_ball_inverts_it():
    import math

    from moelab.stats.fit import from_ball, to_ball

    u = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 30
    u[0, 0] = 0.0
    beta = to_ball(u, 7.0)
    assert (beta.norm(dim=-1) < 7.0).all()
    torch.testing.assert_close(from_ball(beta[1:2], 7.0), u[1:2], rtol=1e-9, atol=1e-9)
    assert beta[0, 0].abs().max() == 0  # the origin is fixed, without a NaN
    zero = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)  # e.g. a pinned true atom, no noise
    to_ball(zero, 7.0).sum().backward()
    torch.testing.assert_close(zero.grad, torch.ones_like(zero))  # the Jacobian at 0 is the identity
    small = 1e-4 * u  # ‖u‖ ≤ 0.02: relative distortion ≤ ‖u‖²/(3B²) < 3e-6
    torch.testing.assert_close(to_ball(small, 7.0), small, rtol=3e-6, atol=0)  # identity near 0
    assert to_ball(u, math.inf) is u and from_ball(u, math.inf) is u


def _runaway_data():
    # perturbed gate with τ = 1, over-specified (k = k* + 1), small n: the unconstrained
    # least-squares estimator sends some ‖β₁ᵢ‖ far out (towards the cosine gate)
    model = RegressionMoE(gate="perturbed", expert="ffn", tau1=1.0, tau2=1.0)
    truth = regression_truth(model, 2, 4, generator=torch.Generator().manual_seed(0))
    X, Y = simulate_regression(
        model, truth, 200, 8, noise_var=0.01, generator=torch.Generator().manual_seed(1)
    )
    return truth, X, Y


def test_beta1_bound_keeps_a_runaway_fit_inside_the_ball():
    import math

    truth, X, Y = _runaway_data()
    kw = dict(gate="perturbed", tau=1.0, optimizer="lbfgs", lr=1.0, steps=500, init_noise=0.05, seed=1)
    free = LeastSquaresMoE(3, beta1_bound=math.inf, **kw).fit(X, Y, truth)
    bounded = LeastSquaresMoE(3, beta1_bound=20.0, **kw).fit(X, Y, truth)
    assert free.beta1_.norm(dim=-1).max() > 100  # the runaway the bound is for
    norms = bounded.beta1_.norm(dim=-1)
    assert (norms <= 20.0).all() and norms.max() > 19  # bounded, and the bound is active
    assert torch.isfinite(bounded.loss_).all()


@pytest.mark.parametrize("gate", ["linear", "perturbed"])
def test_fits_inside_the_bound_equal_the_unconstrained_fits(gate):
    import math

    T = torch.float64
    truth = MoEParams(
        torch.tensor([[0.5, 0.0]], dtype=T),
        torch.tensor([[[2.0, -1.0], [0.5, 1.0]]], dtype=T),
        torch.tensor([[[1.0, 3.0, 0.0, 0.5], [-1.0, 0.0, 3.0, -0.5]]], dtype=T),
    )
    model = RegressionMoE(gate=gate, expert="ffn", tau1=1.0, tau2=1.0)
    X, Y = simulate_regression(
        model, truth, 2000, 3, noise_var=0.01, generator=torch.Generator().manual_seed(0)
    )
    kw = dict(
        gate=gate,
        tau=1.0,
        optimizer="lbfgs",
        lr=1.0,
        steps=1000,
        init_noise=0.1,
        seed=1,
        gtol=1e-10,
        ftol=0.0,
    )
    free = LeastSquaresMoE(2, beta1_bound=math.inf, **kw).fit(X, Y, truth)
    bounded = LeastSquaresMoE(2, beta1_bound=10.0, **kw).fit(X, Y, truth)
    assert (bounded.beta1_.norm(dim=-1) < 5).all()  # well inside the ball
    assert free.converged_.all() and bounded.converged_.all()
    torch.testing.assert_close(bounded.loss_, free.loss_, rtol=1e-12, atol=0)
    torch.testing.assert_close(bounded.predict(X), free.predict(X), rtol=0, atol=1e-6)
    torch.testing.assert_close(bounded.beta0_, free.beta0_, rtol=0, atol=1e-6)
    torch.testing.assert_close(bounded.eta_, free.eta_, rtol=0, atol=1e-6)

    # the gate is identified only up to a common translation: of β₁ᵢ for the linear gate, of
    # wᵢ = β₁ᵢ / (‖β₁ᵢ‖ + τ) for the perturbed one (it sees only logit differences (wᵢ − wⱼ)ᵀx)
    def identified(b):
        w = b if gate == "linear" else b / (b.norm(dim=-1, keepdim=True) + 1.0)
        return w[:, :-1] - w[:, -1:]

    torch.testing.assert_close(identified(bounded.beta1_), identified(free.beta1_), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bound", [0, -1.0, "10", True, float("nan")])
def test_bad_beta1_bound_is_rejected(bound):
    _, truth, X, Y = _data(n=500, R=1)
    with pytest.raises(
        ValueError, match=r"beta1_bound=.* is not allowed; expected a number > 0 \(inf = unconstrained\)"
    ):
        LeastSquaresMoE(2, gate="linear", expert="linear", beta1_bound=bound).fit(X, Y, truth)


def test_a_truth_outside_the_bound_is_rejected_for_the_near_start():
    _, truth, X, Y = _data(n=500, R=1)
    far = MoEParams(truth.beta0, truth.beta1 * 0 + torch.tensor([3.0, 4.0], dtype=torch.float64), truth.eta)
    with pytest.raises(
        ValueError, match=r"beta1_bound=2.0 is not allowed for this truth: its largest ‖β₁ᵢ‖ is 5"
    ):
        LeastSquaresMoE(2, gate="linear", expert="linear", beta1_bound=2.0).fit(X, Y, far)


@pytest.mark.parametrize("kwargs,match", [({"gtol": -1.0}, "gtol=-1.0"), ({"ftol": "x"}, "ftol='x'")])
def test_bad_tolerances_are_rejected(kwargs, match):
    _, truth, X, Y = _data(n=500, R=1)
    with pytest.raises(ValueError, match=match):
        LeastSquaresMoE(2, gate="linear", expert="linear", **kwargs).fit(X, Y, truth)


@pytest.mark.parametrize("init", ["near", "random"])
def test_restarts_run_for_both_starts_and_keep_each_replicates_lowest_loss(init):
    _, truth, X, Y = _data(gate="perturbed", expert="ffn", n=500, R=3, k=2, d=2, seed=2)
    est = LeastSquaresMoE(
        3, gate="perturbed", tau=1.0, init=init, init_noise=0.3, restarts=4, optimizer="lbfgs", steps=40
    ).fit(X, Y, truth if init == "near" else None)
    assert est.restart_losses_.shape == (4, 3)
    torch.testing.assert_close(est.loss_, est.restart_losses_.min(dim=0).values)
    assert len({round(v, 12) for v in est.restart_losses_[:, 0].tolist()}) == 4  # four different starts
    torch.testing.assert_close(((Y - est.predict(X)) ** 2).mean(dim=-1), est.loss_)
    for attr in ("n_iter_", "grad_norm_", "converged_", "hit_cap_"):
        assert getattr(est, attr).shape == (3,)


def test_a_fit_reports_the_cap_and_stops_at_the_gradient_tolerance():
    _, truth, X, Y = _data(n=500, R=2)
    kw = dict(gate="linear", expert="linear", optimizer="lbfgs", init_noise=0.2)
    capped = LeastSquaresMoE(2, steps=2, **kw).fit(X, Y, truth)
    from moelab.stats.lbfgs import STALL_RESTARTS

    # the cap in every round: the first and each restart from the perturbed best point
    assert capped.hit_cap_.all() and not capped.converged_.any()
    assert (capped.n_iter_ == 2 * (1 + STALL_RESTARTS)).all()
    loose = LeastSquaresMoE(2, steps=200, gtol=1e6, **kw).fit(X, Y, truth)  # the start already passes
    assert loose.converged_.all() and not loose.hit_cap_.any() and (loose.n_iter_ == 0).all()


def test_eta_bound_keeps_the_experts_inside_their_ball():
    truth, X, Y = _runaway_data()
    kw = dict(gate="perturbed", tau=1.0, optimizer="lbfgs", lr=1.0, steps=300, init_noise=0.05, seed=1)
    free = LeastSquaresMoE(3, beta1_bound=20.0, **kw).fit(X, Y, truth)  # η unconstrained (the default)
    bounded = LeastSquaresMoE(3, beta1_bound=20.0, eta_bound=8.0, **kw).fit(X, Y, truth)
    assert free.eta_.norm(dim=-1).max() > 20  # a tanh expert running away towards a step
    assert (bounded.eta_.norm(dim=-1) <= 8.0).all() and (bounded.beta1_.norm(dim=-1) <= 20.0).all()
    with pytest.raises(ValueError, match=r"eta_bound=0 is not allowed; expected a number > 0"):
        LeastSquaresMoE(3, eta_bound=0, **kw).fit(X, Y, truth)
    with pytest.raises(ValueError, match=r"eta_bound=1.0 is not allowed for this truth: its largest ‖ηᵢ‖ is"):
        LeastSquaresMoE(3, eta_bound=1.0, **kw).fit(X, Y, truth)


def test_nu_min_floors_the_fitted_variances():
    g = torch.Generator().manual_seed(0)
    model = GaussianMoE(gating="softmax")
    truth = gaussian_truth(2, 2, nu_range=(0.1, 0.1), generator=g)
    X, Y = simulate_gaussian(model, truth, 300, 6, generator=g)
    kw = dict(gating="softmax", optimizer="lbfgs", steps=100, init_noise=0.05)
    free = GaussianMoEMLE(3, **kw).fit(X, Y, truth)
    floored = GaussianMoEMLE(3, nu_min=0.095, **kw).fit(X, Y, truth)
    assert free.nu_.min() < 0.095  # without the floor some variance goes below it
    assert (floored.nu_ >= 0.095).all()
    with pytest.raises(ValueError, match=r"nu_min=-0.1 is not allowed; expected a number >= 0"):
        GaussianMoEMLE(3, nu_min=-0.1, **kw).fit(X, Y, truth)
    with pytest.raises(ValueError, match=r"nu_min=0.2 is not allowed for this truth: its smallest ν is 0.1"):
        GaussianMoEMLE(3, nu_min=0.2, **kw).fit(X, Y, truth)


def test_a_target_on_the_sphere_of_the_bound_is_a_valid_start():
    # a reference fit Ḡ of a misspecified study can end on ‖β₁ᵢ‖ = B; fits started near it must run
    _, truth, X, Y = _data(n=500, R=2)
    norm = float(truth.beta1.norm(dim=-1).max())
    est = LeastSquaresMoE(2, gate="linear", expert="linear", beta1_bound=norm, optimizer="lbfgs", steps=5)
    est.fit(X, Y, truth)
    assert (est.beta1_.norm(dim=-1) < norm).all()
