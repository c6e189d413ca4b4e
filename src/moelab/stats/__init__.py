"""Statistical convergence toolkit: simulate MoE data, fit batched estimators, measure Voronoi
losses and estimate convergence rates (the perturbed cosine router (2024) §2-3, §5.1, App. E-F; CompeteSMoE v1 (2024) §4; CompeteSMoE (2025) §3, App. J; Ho (2025)).

Every model and estimator carries a leading replicate dimension R, so R independent fits run as
one batched computation.  The estimators (:class:`LeastSquaresMoE`, :class:`GaussianMoEMLE`)
follow scikit-learn's conventions — hyper-parameters in ``__init__``, ``fit`` returning ``self``
and creating the ``attr_`` results, ``get_params``/``set_params``/``sklearn.base.clone``,
``predict`` and ``score`` (R² for least squares, mean log-likelihood for the Gaussian MLE) —
without depending on scikit-learn.  The convergence-rate studies are :mod:`moelab.stats.studies`
(run into a folder by ``moelab simulate``, :mod:`moelab.experiments.simulate`).

Example — 20 replicates of a perturbed-cosine MoE, fitted exact-specified, Voronoi loss per replicate::

    import torch
    from moelab.stats import LeastSquaresMoE, RegressionMoE, regression_truth, simulate_regression, voronoi_loss

    g = torch.Generator().manual_seed(0)
    model = RegressionMoE(gate="perturbed", expert="ffn", tau1=1.0, tau2=1.0)
    truth = regression_truth(model, k=2, d=4, generator=g)                      # R = 1
    X, Y = simulate_regression(model, truth, n=4000, replicates=20, noise_var=0.01, generator=g)
    est = LeastSquaresMoE(2, gate="perturbed", tau=1.0, optimizer="lbfgs", lr=1.0, steps=60).fit(X, Y, truth)
    t = truth.expand(20)
    loss = voronoi_loss(est.beta0_, est.beta1_, est.eta_, t.beta0, t.beta1, t.eta)   # (20,)
"""

from .fit import GaussianMoEMLE, LeastSquaresMoE, minimize
from .models import GaussianMoE, GaussianParams, MoEParams, RegressionMoE
from .rates import RateDifference, RateFit, fit_rate, mean_table, slope_difference
from .simulate import gaussian_truth, regression_truth, sample_inputs, simulate_gaussian, simulate_regression
from .voronoi import block_voronoi_loss, gaussian_voronoi_loss, voronoi_cells, voronoi_loss

__all__ = [
    "GaussianMoE",
    "GaussianMoEMLE",
    "GaussianParams",
    "LeastSquaresMoE",
    "MoEParams",
    "RateDifference",
    "RateFit",
    "RegressionMoE",
    "block_voronoi_loss",
    "fit_rate",
    "gaussian_truth",
    "gaussian_voronoi_loss",
    "mean_table",
    "minimize",
    "regression_truth",
    "sample_inputs",
    "simulate_gaussian",
    "simulate_regression",
    "slope_difference",
    "voronoi_cells",
    "voronoi_loss",
]
