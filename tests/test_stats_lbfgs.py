"""The batched L-BFGS: every replicate its own fit."""

from __future__ import annotations

import torch

from moelab.stats import LeastSquaresMoE, simulate_regression  # noqa: F401  (public API)
from moelab.stats.lbfgs import batched_lbfgs


def _quadratic(A: torch.Tensor, b: torch.Tensor, x: torch.Tensor):
    return lambda: 0.5 * torch.einsum("bi,bij,bj->b", x, A, x) - (b * x).sum(1)


def test_each_replicate_reaches_its_own_minimum_of_a_convex_problem():
    torch.manual_seed(0)
    B, P = 4, 6
    M = torch.randn(B, P, P, dtype=torch.float64)
    A = (
        M @ M.transpose(1, 2)
        + torch.eye(P, dtype=torch.float64) * torch.tensor([0.1, 1.0, 10.0, 100.0])[:, None, None]
    )
    b = torch.randn(B, P, dtype=torch.float64)
    x = torch.zeros(B, P, dtype=torch.float64, requires_grad=True)
    result = batched_lbfgs(_quadratic(A, b, x), [x], max_iter=200, gtol=1e-10, ftol=0.0)
    expected = torch.linalg.solve(A, b)
    torch.testing.assert_close(x.detach(), expected, rtol=1e-7, atol=1e-8)
    assert result.converged.all() and (result.grad_norm <= 1e-8).all()
    assert len(set(result.n_iter.tolist())) > 1  # each replicate stopped on its own


def test_a_batched_fit_equals_the_separate_fits_of_its_replicates():
    torch.manual_seed(1)
    B, P = 5, 3
    target = torch.randn(B, P, dtype=torch.float64)
    scale = torch.rand(B, P, dtype=torch.float64) * 10 + 0.1

    def rosen_like(x):  # a non-convex loss per replicate, scaled differently in each
        return lambda: ((scale * (x - target)) ** 2).sum(1) + (x[:, 0] ** 2 - x[:, 1]) ** 2

    x = torch.zeros(B, P, dtype=torch.float64, requires_grad=True)
    batched = batched_lbfgs(rosen_like(x), [x], max_iter=300)
    for r in range(B):
        xr = torch.zeros(1, P, dtype=torch.float64, requires_grad=True)
        sr, tr = scale[r : r + 1], target[r : r + 1]
        alone = batched_lbfgs(
            lambda xr=xr, sr=sr, tr=tr: ((sr * (xr - tr)) ** 2).sum(1) + (xr[:, 0] ** 2 - xr[:, 1]) ** 2,
            [xr],
            max_iter=300,
        )
        torch.testing.assert_close(x.detach()[r], xr.detach()[0], rtol=1e-12, atol=1e-12)
        assert alone.n_iter.item() == batched.n_iter[r].item()


def test_the_estimators_report_iterations_gradient_and_convergence_per_replicate():
    from moelab.stats.models import MoEParams  # noqa: F401

    torch.manual_seed(2)
    X = torch.rand(3, 200, 2, dtype=torch.float64) * 2 - 1
    w = torch.tensor([1.5, -0.5], dtype=torch.float64)
    Y = X @ w + 0.05 * torch.randn(3, 200, dtype=torch.float64)
    est = LeastSquaresMoE(
        2, gate="linear", expert="linear", init="random", optimizer="lbfgs", lr=1.0, steps=200
    ).fit(X, Y)
    assert est.n_iter_.shape == (3,) and est.grad_norm_.shape == (3,) and est.converged_.dtype == torch.bool
    # at most 200 iterations per round: the first, and the restarts of a fit at its cap
    from moelab.stats.lbfgs import STALL_RESTARTS

    assert (est.n_iter_ <= 200 * (1 + STALL_RESTARTS)).all()


def test_the_start_near_the_truth_centres_the_gate_bias_noise_for_every_gate():
    from moelab.stats.models import MoEParams, RegressionMoE

    torch.manual_seed(3)
    truth = MoEParams(torch.randn(1, 2, dtype=torch.float64), torch.randn(1, 2, 3, dtype=torch.float64),
                      torch.randn(1, 2, 4, dtype=torch.float64))  # fmt: skip
    for gate in ("linear", "cosine", "perturbed"):
        est = LeastSquaresMoE(2, gate=gate, expert="linear", init_noise=0.5)
        start = est._init(
            RegressionMoE(gate=gate, expert="linear"),
            6,
            3,
            truth,
            torch.Generator().manual_seed(0),
            torch.float64,
        )
        shift = (start.beta0 - truth.beta0).mean(dim=1)
        torch.testing.assert_close(shift, torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)


def test_a_replicate_where_no_step_is_ever_accepted_is_not_converged():
    from moelab.stats.lbfgs import REASONS

    x = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    start = x.detach().clone()
    finite_rows = torch.tensor([True, True, False])

    def loss():  # a slope of 1, but every move costs 1e9: no step length lowers it; row 2 is inf
        moved = (x.detach() != start).any(1).to(x.dtype)
        f = x.sum(1) + 1e9 * moved
        return torch.where(finite_rows, f, f + torch.inf)

    result = batched_lbfgs(loss, [x], max_iter=50)
    assert not result.converged.any() and (result.n_iter == 0).all()
    assert [REASONS[i] for i in result.reason] == ["no step accepted", "no step accepted", "loss not finite"]


def test_a_start_at_the_minimum_is_converged_by_the_gradient_test():
    from moelab.stats.lbfgs import REASONS

    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    result = batched_lbfgs(lambda: (x**2).sum(1), [x], max_iter=10)
    assert result.converged.all() and [REASONS[i] for i in result.reason] == ["gradient"] * 2


def _rosenbrock(x):
    """Rosenbrock's valley per replicate: L-BFGS needs tens of iterations to cross it."""
    return lambda: ((1 - x[:, :-1]) ** 2 + 100 * (x[:, 1:] - x[:, :-1] ** 2) ** 2).sum(1)


def test_a_fit_at_its_cap_is_restarted_from_its_best_point_until_a_stopping_test_holds():
    start = torch.tensor([[-1.2, 1.0, -0.5, 0.8], [0.5, -0.7, 1.3, 0.2]], dtype=torch.float64)
    x = start.clone().requires_grad_(True)
    capped = batched_lbfgs(_rosenbrock(x), [x], max_iter=15, gtol=1e-9, ftol=0.0)
    assert not capped.converged.any() and (capped.reason == 3).all()  # the iteration cap
    x = start.clone().requires_grad_(True)
    restarted = batched_lbfgs(_rosenbrock(x), [x], max_iter=15, gtol=1e-9, ftol=0.0, stall_restarts=40)
    assert restarted.converged.all() and (restarted.reason == 0).all()  # the gradient test
    torch.testing.assert_close(x.detach(), torch.ones_like(start), rtol=0, atol=1e-8)
    assert (restarted.n_iter > 15).all()  # every round's iterations counted
    # restarts keep replicates independent: the batched fit equals each replicate's own
    for r in range(2):
        xr = start[r : r + 1].clone().requires_grad_(True)
        alone = batched_lbfgs(_rosenbrock(xr), [xr], max_iter=15, gtol=1e-9, ftol=0.0, stall_restarts=40)
        torch.testing.assert_close(x.detach()[r], xr.detach()[0], rtol=0, atol=1e-12)
        assert alone.n_iter.item() == restarted.n_iter[r].item()
