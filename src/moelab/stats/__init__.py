"""Statistical convergence toolkit: simulate MoE data, fit batched estimators, measure Voronoi
losses and estimate convergence rates (papers 003 §2-3, §5.1, App. E-F; 000 §4; 001 §3, App. J; 004).

Every model and estimator carries a leading replicate dimension R, so R independent fits run as
one batched computation.  The command-line studies live in :mod:`moelab.stats.studies`
(``moelab simulate --study NAME``).
"""

from .fit import GaussianMoEMLE, LeastSquaresMoE, minimize
from .models import GaussianMoE, GaussianParams, MoEParams, RegressionMoE
from .rates import RateFit, fit_rate
from .simulate import gaussian_truth, regression_truth, sample_inputs, simulate_gaussian, simulate_regression
from .voronoi import block_voronoi_loss, gaussian_voronoi_loss, voronoi_cells, voronoi_loss

__all__ = [
    "GaussianMoE",
    "GaussianMoEMLE",
    "GaussianParams",
    "LeastSquaresMoE",
    "MoEParams",
    "RateFit",
    "RegressionMoE",
    "block_voronoi_loss",
    "fit_rate",
    "gaussian_truth",
    "gaussian_voronoi_loss",
    "minimize",
    "regression_truth",
    "sample_inputs",
    "simulate_gaussian",
    "simulate_regression",
    "voronoi_cells",
    "voronoi_loss",
]
