"""Simulated data for the convergence studies: inputs on a bounded set, responses from a model.

The perturbed cosine router (2024), §5.1 / App. E.1: X_i drawn i.i.d. on a bounded set,
Y_i = f_G*(X_i) + ε_i with Gaussian noise ε_i ~ N(0, ν).  The true router parameters are drawn from an isotropic Gaussian (zero mean) for
the first k* − 1 experts and set to zero for the last one (the identifiability convention of
the perturbed cosine router (2024), (A.3), and Nguyen et al. 2024c); the true expert parameters are drawn from an isotropic
Gaussian.  The paper's exact variances and input law are not recoverable from the text:
the defaults below are ours and every study writes them to its config.

All draws use an explicit :class:`torch.Generator`, so a study is reproducible from its seed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validate import non_negative, one_of, positive, positive_int
from .models import GaussianMoE, GaussianParams, MoEParams, RegressionMoE

__all__ = [
    "INPUT_DISTRIBUTIONS",
    "gaussian_truth",
    "regression_truth",
    "sample_inputs",
    "simulate_gaussian",
    "simulate_regression",
]

INPUT_DISTRIBUTIONS = ("uniform", "truncnormal")


def sample_inputs(
    replicates: int,
    n: int,
    d: int,
    *,
    distribution: str = "uniform",
    bound: float = 1.0,
    std: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """``(R, n, d)`` inputs on the cube ``[-bound, bound]^d``.

    ``uniform``: i.i.d. uniform coordinates.  ``truncnormal``: i.i.d. N(0, std²) coordinates
    truncated to ``[-bound, bound]`` (exact inverse-CDF sampling, no rejection loop).
    """
    positive_int("replicates", replicates)
    positive_int("n", n)
    positive_int("d", d)
    one_of("distribution", distribution, INPUT_DISTRIBUTIONS)
    positive("bound", bound)
    positive("std", std)
    u = torch.rand(replicates, n, d, generator=generator, dtype=dtype)
    if distribution == "uniform":
        return (2 * u - 1) * bound
    lo = 0.5 * (1 + math.erf(-bound / (std * math.sqrt(2))))
    hi = 1 - lo
    return std * torch.special.ndtri(lo + (hi - lo) * u)


def regression_truth(
    model: RegressionMoE,
    k: int,
    d: int,
    *,
    router_std: float = 1.0,
    expert_std: float = 1.0,
    zero_last_weight: bool | None = None,
    zero_last_bias: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> MoEParams:
    """True parameters (R = 1) of a k-expert regression MoE, drawn as in the perturbed cosine router (2024) App. E.1.

    β₁ᵢ, β₀ᵢ ~ N(0, router_std²) for i < k, and for the last expert β₀ = 0 (``zero_last_bias``)
    and β₁ = 0 (``zero_last_weight``).  ``zero_last_weight`` defaults to True for the linear and
    sigmoid gates (softmax is invariant to a common shift of β₁, so one is pinned) and to False
    for the cosine gates: a zero embedding has no direction, the cosine of it is undefined, and
    the cosine gates are not shift-invariant in β₁ anyway (our choice; the paper's is lost).
    η ~ N(0, expert_std²), isotropic.
    """
    positive_int("k", k)
    positive_int("d", d)
    non_negative("router_std", router_std)
    non_negative("expert_std", expert_std)
    if zero_last_weight is None:
        zero_last_weight = model.gate in ("linear", "sigmoid")
    beta1 = router_std * torch.randn(1, k, d, generator=generator, dtype=dtype)
    beta0 = router_std * torch.randn(1, k, generator=generator, dtype=dtype)
    if zero_last_weight:
        beta1[:, -1] = 0
    if zero_last_bias:
        beta0[:, -1] = 0
    eta = expert_std * torch.randn(1, k, model.expert_dim(d), generator=generator, dtype=dtype)
    return MoEParams(beta0, beta1, eta)


def _inputs_and_truth(truth, n: int, replicates: int, distribution: str, bound: float, generator):
    """``X (R, n, d)`` drawn for R replicates, and ``truth`` with R parameter sets (one set is
    shared: expanded)."""
    if truth.replicates not in (1, replicates):
        raise ValueError(f"truth has R={truth.replicates} parameter sets; expected 1 or {replicates}")
    gate = truth.beta1
    x = sample_inputs(
        replicates,
        n,
        gate.shape[-1],
        distribution=distribution,
        bound=bound,
        generator=generator,
        dtype=gate.dtype,
    )
    return x, (truth.expand(replicates) if truth.replicates == 1 else truth)


def simulate_regression(
    model: RegressionMoE,
    truth: MoEParams,
    n: int,
    replicates: int,
    *,
    noise_var: float = 0.01,
    distribution: str = "uniform",
    bound: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """R independent samples of size n: ``X (R, n, d)``, ``Y = f_G*(X) + ε (R, n)``, ε ~ N(0, ν).

    ``truth`` holds one parameter set (R = 1, shared by all replicates, as in the perturbed cosine router (2024)) or R of them.
    """
    non_negative("noise_var", noise_var)
    x, truth = _inputs_and_truth(truth, n, replicates, distribution, bound, generator)
    f = model.mean(x, truth)
    noise = math.sqrt(noise_var) * torch.randn(f.shape, generator=generator, dtype=f.dtype)
    return x, f + noise


def gaussian_truth(
    k: int,
    d: int,
    *,
    router_std: float = 1.0,
    expert_std: float = 1.0,
    nu_range: tuple[float, float] = (0.05, 0.2),
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> GaussianParams:
    """True parameters (R = 1) of a Gaussian mixture of k linear experts.

    Gate β₁, β₀ ~ N(0, router_std²) with the last expert's pinned to 0 (Ho (2025)'s identifiability up
    to translation); a, b ~ N(0, expert_std²); ν ~ Uniform(nu_range).
    """
    positive_int("k", k)
    positive_int("d", d)
    lo, hi = nu_range
    positive("nu_range[0]", lo)
    if not hi >= lo:
        raise ValueError(f"nu_range={nu_range!r} is not allowed; expected low <= high")
    beta1 = router_std * torch.randn(1, k, d, generator=generator, dtype=dtype)
    beta0 = router_std * torch.randn(1, k, generator=generator, dtype=dtype)
    beta1[:, -1] = 0
    beta0[:, -1] = 0
    a = expert_std * torch.randn(1, k, d, generator=generator, dtype=dtype)
    b = expert_std * torch.randn(1, k, generator=generator, dtype=dtype)
    nu = lo + (hi - lo) * torch.rand(1, k, generator=generator, dtype=dtype)
    return GaussianParams(beta0, beta1, a, b, nu)


def simulate_gaussian(
    model: GaussianMoE,
    truth: GaussianParams,
    n: int,
    replicates: int,
    *,
    distribution: str = "uniform",
    bound: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """R samples of size n from ``p_G*(y|x)``: draw the expert z ~ π(x), then y ~ N(a_zᵀx + b_z, ν_z)."""
    x, truth = _inputs_and_truth(truth, n, replicates, distribution, bound, generator)
    pi = model.gate_weights(x, truth)  # (R, n, k)
    z = torch.multinomial(pi.reshape(-1, pi.shape[-1]), 1, generator=generator).view(replicates, n, 1)
    mean = model.means(x, truth).gather(-1, z).squeeze(-1)
    var = truth.nu.unsqueeze(-2).expand_as(pi).gather(-1, z).squeeze(-1)
    y = mean + var.sqrt() * torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
    return x, y
