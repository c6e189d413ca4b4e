"""Empirical convergence rates: ``log L̄(n) = a + b log n`` with a bootstrap confidence interval.

The perturbed cosine router (2024), §5.1 / Fig. 1, reports, for each sample size, the mean Voronoi loss over 20 replicates and the
slope of a least-squares line through ``(log n, log mean loss)``; that slope is ``b`` here.  The
confidence interval resamples the replicates of every sample size with replacement (a
nonparametric bootstrap, independently per n), recomputes the means and the slope, and takes
the percentile interval.

:func:`slope_difference` compares two series (two routers fitted on independent data): it
bootstraps each series' replicates independently and takes the percentile interval of the
difference of the two slopes.  :func:`mean_table` gives, per sample size, the mean loss, its
standard deviation over replicates and the percentile bootstrap interval of the mean.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .._validate import positive_int, probability

__all__ = ["RateDifference", "RateFit", "fit_rate", "mean_table", "slope_difference"]


@dataclass(frozen=True)
class RateFit:
    """A fitted rate: ``mean loss ≈ exp(intercept) · n^slope``; ``[ci_low, ci_high]`` the bootstrap CI."""

    slope: float
    intercept: float
    ci_low: float
    ci_high: float
    level: float
    n_boot: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class RateDifference:
    """``slope_a − slope_b`` and its bootstrap interval ``[ci_low, ci_high]``."""

    difference: float
    ci_low: float
    ci_high: float
    level: float
    n_boot: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _ols_slopes(log_n: np.ndarray, log_means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slopes and intercepts of the OLS lines through ``(log_n, log_means[..., s])``."""
    xc = log_n - log_n.mean()
    slope = (log_means * xc).sum(axis=-1) / (xc**2).sum()
    return slope, log_means.mean(axis=-1) - slope * log_n.mean()


def _check(sample_sizes, losses) -> tuple[np.ndarray, np.ndarray]:
    n = np.asarray(sample_sizes, dtype=np.float64)
    L = np.asarray(losses.detach().cpu() if hasattr(losses, "detach") else losses, dtype=np.float64)
    if n.ndim != 1 or len(np.unique(n)) < 2 or np.any(n <= 0):
        raise ValueError(f"sample_sizes={n.tolist()!r} is not allowed; expected >= 2 distinct positive sizes")
    if L.ndim != 2 or L.shape[0] != n.shape[0]:
        raise ValueError(f"losses must be (S, R) with S={n.shape[0]} sample sizes; got shape {L.shape}")
    if not np.all(np.isfinite(L)) or np.any(L <= 0):
        raise ValueError("losses must be finite and > 0 to take logarithms")
    return n, L


def _boot_means(L: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``(n_boot, S)`` means of the replicates resampled with replacement, independently per n."""
    S, R = L.shape
    idx = rng.integers(0, R, size=(n_boot, S, R))
    return np.take_along_axis(L[None].repeat(n_boot, 0), idx, axis=2).mean(axis=2)


def fit_rate(
    sample_sizes,
    losses,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RateFit:
    """Fit ``log mean_r L(n, r) = a + b log n``.

    Args:
        sample_sizes: ``(S,)`` sample sizes, at least two distinct.
        losses: ``(S, R)`` positive losses, replicate r of sample size s (array or tensor).
        n_boot: bootstrap resamples.
        level: confidence level of the percentile interval.
        seed: seeds the bootstrap.

    Returns:
        :class:`RateFit`.
    """
    positive_int("n_boot", n_boot)
    probability("level", level)
    n, L = _check(sample_sizes, losses)
    log_n = np.log(n)
    slope, intercept = _ols_slopes(log_n, np.log(L.mean(axis=1)))
    boot_slopes, _ = _ols_slopes(log_n, np.log(_boot_means(L, n_boot, np.random.default_rng(seed))))
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot_slopes, [alpha, 1 - alpha])
    return RateFit(float(slope), float(intercept), float(lo), float(hi), float(level), int(n_boot))


def slope_difference(
    sample_sizes,
    losses_a,
    losses_b,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RateDifference:
    """``slope(losses_a) − slope(losses_b)`` (each as :func:`fit_rate`) with a bootstrap interval.

    The two series are independent samples (two estimators on independent data), so each is
    resampled on its own; the interval is the percentile interval of the ``n_boot`` differences.
    """
    positive_int("n_boot", n_boot)
    probability("level", level)
    n, La = _check(sample_sizes, losses_a)
    _, Lb = _check(sample_sizes, losses_b)
    log_n = np.log(n)
    diff = _ols_slopes(log_n, np.log(La.mean(axis=1)))[0] - _ols_slopes(log_n, np.log(Lb.mean(axis=1)))[0]
    rng = np.random.default_rng(seed)
    boot = (
        _ols_slopes(log_n, np.log(_boot_means(La, n_boot, rng)))[0]
        - _ols_slopes(log_n, np.log(_boot_means(Lb, n_boot, rng)))[0]
    )
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return RateDifference(float(diff), float(lo), float(hi), float(level), int(n_boot))


def mean_table(
    sample_sizes,
    losses,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Per sample size: ``n``, ``mean`` loss, ``sd`` over replicates (ddof = 1; 0 for one
    replicate), ``ci_low``/``ci_high`` (percentile bootstrap interval of the mean) and
    ``replicates``."""
    positive_int("n_boot", n_boot)
    probability("level", level)
    n, L = _check(sample_sizes, losses)
    boot = _boot_means(L, n_boot, np.random.default_rng(seed))
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha], axis=0)
    R = L.shape[1]
    sd = L.std(axis=1, ddof=1) if R > 1 else np.zeros(len(n))
    return [
        {
            "n": int(n[s]),
            "mean": float(L[s].mean()),
            "sd": float(sd[s]),
            "ci_low": float(lo[s]),
            "ci_high": float(hi[s]),
            "replicates": int(R),
        }
        for s in range(len(n))
    ]
