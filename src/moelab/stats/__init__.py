"""Statistical convergence toolkit: simulate MoE data, fit batched estimators, measure Voronoi
losses and estimate convergence rates (the perturbed cosine router (2024); CompeteSMoE (2024);
CompeteSMoE (2025); Ho (2025)).  Every model and estimator carries a leading replicate dimension R,
so R independent fits run as one batched computation; the estimators (:class:`LeastSquaresMoE`,
:class:`GaussianMoEMLE`) follow scikit-learn's conventions without depending on it.
docs/methods.md ("The statistics toolkit") has the models, the losses, the estimators and a
worked example; the studies are :mod:`moelab.stats.studies` (``moelab simulate --study NAME``).
"""

from .fit import GaussianMoEMLE, LeastSquaresMoE, minimize
from .identifiability import IdentifiabilityReport, check_strong_identifiability
from .measures import (
    density_distances,
    k_subset_voronoi,
    l2_distance,
    mixture_tv,
    rbar,
    voronoi_d,
)
from .mixtures import LoRAMixture, Mixture, fit_params
from .models import GaussianMoE, GaussianParams, MoEParams, RegressionMoE
from .rates import RateDifference, RateFit, fit_rate, mean_table, slope_difference
from .simulate import gaussian_truth, regression_truth, sample_inputs, simulate_gaussian, simulate_regression
from .translation import Bracket, scale_inf, translation_inf
from .voronoi import block_voronoi_loss, gaussian_voronoi_loss, voronoi_cells, voronoi_loss

__all__ = [
    "Bracket",
    "GaussianMoE",
    "GaussianMoEMLE",
    "GaussianParams",
    "IdentifiabilityReport",
    "LeastSquaresMoE",
    "LoRAMixture",
    "Mixture",
    "MoEParams",
    "RateDifference",
    "RateFit",
    "RegressionMoE",
    "block_voronoi_loss",
    "check_strong_identifiability",
    "density_distances",
    "fit_params",
    "fit_rate",
    "gaussian_truth",
    "gaussian_voronoi_loss",
    "k_subset_voronoi",
    "l2_distance",
    "mean_table",
    "minimize",
    "mixture_tv",
    "rbar",
    "regression_truth",
    "sample_inputs",
    "scale_inf",
    "simulate_gaussian",
    "simulate_regression",
    "slope_difference",
    "translation_inf",
    "voronoi_cells",
    "voronoi_d",
    "voronoi_loss",
]
