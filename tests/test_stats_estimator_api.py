"""The stats estimators follow scikit-learn's estimator conventions: parameters, clone, fit, score."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from moelab.stats import (
    GaussianMoE,
    GaussianMoEMLE,
    LeastSquaresMoE,
    RegressionMoE,
    gaussian_truth,
    regression_truth,
    simulate_gaussian,
    simulate_regression,
)

sklearn_base = pytest.importorskip("sklearn.base")
from sklearn.exceptions import NotFittedError  # noqa: E402
from sklearn.utils import estimator_checks  # noqa: E402

# small, quick fits that need no truth: what scikit-learn's generic checks can run
QUICK = {
    LeastSquaresMoE: dict(gate="linear", expert="linear", init="random", optimizer="lbfgs", lr=1.0, steps=5),
    GaussianMoEMLE: dict(init="random", optimizer="lbfgs", lr=1.0, steps=5),
}
ESTIMATORS = list(QUICK)
MODEL = {LeastSquaresMoE: dict(gate="linear", expert="linear"), GaussianMoEMLE: {}}  # the data's model


def _quick(cls, **kw):
    return cls(2, **{**QUICK[cls], **kw})


def _regression(n=400, R=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = RegressionMoE(gate="linear", expert="linear")
    truth = regression_truth(model, 2, 2, generator=g)
    X, Y = simulate_regression(model, truth, n, R, noise_var=0.01, generator=g)
    return truth, X.double(), Y.double()


def _gaussian(n=400, R=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    truth = gaussian_truth(2, 2, generator=g)
    X, Y = simulate_gaussian(GaussianMoE(), truth, n, R, generator=g)
    return truth, X, Y


def _data(cls, **kw):
    return (_regression if cls is LeastSquaresMoE else _gaussian)(**kw)


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_init_stores_the_hyper_parameters_and_nothing_else(cls):
    est = cls(3, seed=7, steps=11)
    assert set(vars(est)) == set(est.get_params())
    assert est.get_params()["n_experts"] == 3 and est.seed == 7 and est.steps == 11
    assert not hasattr(est, "model_")


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_get_params_set_params_round_trip(cls):
    est = cls(2)
    params = est.get_params()
    assert est.set_params(**params) is est and est.get_params() == params
    est.set_params(n_experts=4, lr=0.5)
    assert est.get_params() == {**params, "n_experts": 4, "lr": 0.5}
    assert cls(**est.get_params()).get_params() == est.get_params()


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_set_params_rejects_an_unknown_name_and_changes_nothing(cls):
    est = cls(2)
    before = est.get_params()
    with pytest.raises(
        ValueError, match=r"tau1=0\.5 is not a parameter of \w+; expected one of \['n_experts'"
    ):
        est.set_params(lr=0.5, tau1=0.5)
    assert est.get_params() == before


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_clone_gives_an_unfitted_estimator_with_equal_params(cls):
    truth, X, Y = _data(cls)
    est = cls(2, optimizer="lbfgs", lr=1.0, steps=3, seed=5, **MODEL[cls]).fit(X, Y, truth)
    copy = sklearn_base.clone(est)
    assert type(copy) is cls and copy is not est
    assert copy.get_params() == est.get_params()
    assert not hasattr(copy, "params_") and not hasattr(copy, "loss_")
    with pytest.raises(NotFittedError):
        copy.predict(X)


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_fit_returns_self_and_creates_the_fitted_attributes(cls):
    truth, X, Y = _data(cls)
    est = cls(3, optimizer="lbfgs", lr=1.0, steps=3, **MODEL[cls])
    assert est.fit(X, Y, truth) is est
    per_model = (
        ["beta0_", "beta1_", "eta_"] if cls is LeastSquaresMoE else ["beta0_", "beta1_", "a_", "b_", "nu_"]
    )
    shared = ["model_", "params_", "loss_", "restart_losses_", "n_iter_", "n_features_in_"]
    for name in shared + per_model:
        assert hasattr(est, name), name
    assert est.beta0_.shape == (2, 3) and est.loss_.shape == (2,) and est.n_features_in_ == 2
    assert sklearn_base.is_regressor(est) == (cls is LeastSquaresMoE)
    # fit changes no hyper-parameter (scikit-learn's check_dont_overwrite_parameters, by identity)
    params = est.get_params()
    est.fit(X, Y, truth)
    assert all(est.get_params()[k] is v for k, v in params.items())


@pytest.mark.parametrize("cls", ESTIMATORS)
@pytest.mark.parametrize("method", ["predict", "score"])
def test_unfitted_predict_and_score_raise_not_fitted_error_naming_the_estimator(cls, method):
    _, X, Y = _data(cls)
    args = (X,) if method == "predict" else (X, Y)
    with pytest.raises(NotFittedError, match=rf"This {cls.__name__} instance is not fitted yet; call fit"):
        getattr(cls(2), method)(*args)


def test_without_scikit_learn_moelab_imports_and_unfitted_predict_raises_value_error():
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "import torch\n"
        "from moelab.stats import LeastSquaresMoE\n"
        "try:\n"
        "    LeastSquaresMoE(2).predict(torch.zeros(5, 2))\n"
        "except ValueError as e:\n"
        "    assert type(e) is ValueError, type(e)\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "This LeastSquaresMoE instance is not fitted yet" in out


def test_least_squares_score_is_r2_per_replicate():
    from sklearn.metrics import r2_score

    truth, X, Y = _regression(n=500, R=3)
    est = LeastSquaresMoE(2, gate="linear", expert="linear", optimizer="lbfgs", lr=1.0, steps=10).fit(
        X, Y, truth
    )
    scores = est.score(X, Y)
    pred = est.predict(X)
    assert scores.shape == (3,)
    for r in range(3):
        assert scores[r].item() == pytest.approx(r2_score(Y[r].numpy(), pred[r].numpy()), rel=1e-12)
    single = LeastSquaresMoE(2, gate="linear", expert="linear", optimizer="lbfgs", lr=1.0, steps=10)
    single.fit(X[0], Y[0], truth)
    assert isinstance(single.score(X[0], Y[0]), float)
    assert single.score(X[0], Y[0]) == pytest.approx(r2_score(Y[0].numpy(), single.predict(X[0]).numpy()))
    assert single.score(X[0], Y[0]) > 0.8  # noise variance 0.01 of a signal variance ≈ 0.09


def test_gaussian_score_is_the_mean_log_likelihood_and_predict_the_conditional_mean():
    truth, X, Y = _gaussian(n=500, R=2)
    est = GaussianMoEMLE(2, optimizer="lbfgs", lr=1.0, steps=10).fit(X, Y, truth)
    model, p = est.model_, est.params_
    torch.testing.assert_close(est.score(X, Y), model.log_density(X, Y, p).mean(dim=-1))
    torch.testing.assert_close(-est.score(X, Y), est.loss_)  # the training NLL on the training data
    torch.testing.assert_close(est.predict(X), (model.gate_weights(X, p) * model.means(X, p)).sum(dim=-1))
    assert isinstance(GaussianMoEMLE(2, **QUICK[GaussianMoEMLE]).fit(X[0], Y[0]).score(X[0], Y[0]), float)


def test_predict_rejects_inputs_with_the_wrong_number_of_features():
    truth, X, Y = _regression(n=300, R=1)
    est = LeastSquaresMoE(2, gate="linear", expert="linear", steps=2).fit(X, Y, truth)
    with pytest.raises(ValueError, match=r"X has d=3 features; LeastSquaresMoE was fitted with d=2"):
        est.predict(torch.zeros(4, 3, dtype=X.dtype))


def test_repr_shows_the_parameters_that_differ_from_the_defaults():
    assert (
        repr(LeastSquaresMoE(2, gate="linear", lr=0.5))
        == "LeastSquaresMoE(n_experts=2, gate='linear', lr=0.5)"
    )
    assert repr(GaussianMoEMLE(3)) == "GaussianMoEMLE(n_experts=3)"


def test_numpy_data_and_cross_val_score_work_on_unbatched_data():
    from sklearn.model_selection import cross_val_score

    _, X, Y = _regression(n=600, R=1)
    scores = cross_val_score(_quick(LeastSquaresMoE, steps=20), X[0].numpy(), Y[0].numpy(), cv=3)
    assert scores.shape == (3,) and np.isfinite(scores).all() and (scores > 0.5).all()


SKLEARN_CHECKS = [
    "check_estimator_cloneable",
    "check_estimator_repr",
    "check_no_attributes_set_in_init",
    "check_parameters_default_constructible",
    "check_get_params_invariance",
    "check_set_params",
    "check_do_not_raise_errors_in_init_or_set_params",
    "check_estimators_unfitted",
    "check_dont_overwrite_parameters",
    "check_fit_score_takes_y",
    "check_estimators_overwrite_params",
]


@pytest.mark.parametrize("cls", ESTIMATORS)
@pytest.mark.parametrize("check", SKLEARN_CHECKS)
def test_scikit_learn_estimator_checks_pass(cls, check):
    # the parameter, clone and fit-contract checks of sklearn.utils.estimator_checks; the data
    # checks (dtypes, NaN, sparse input, pickling of fitted state...) assume NumPy outputs
    getattr(estimator_checks, check)(cls.__name__, _quick(cls))
