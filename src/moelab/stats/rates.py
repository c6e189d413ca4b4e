"""Empirical convergence rates: ``log L̄(n) = a + b log n`` with a bootstrap confidence interval.

The perturbed cosine router (2024), §5.1 / Fig. 1, reports, for each sample size, the mean Voronoi loss over 20 replicates and the
slope of a least-squares line through ``(log n, log mean loss)``; that slope is ``b`` here.  The
confidence interval resamples the replicates of every sample size with replacement (a
nonparametric bootstrap, independently per n), recomputes the means and the slope, and takes
the percentile interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .._validate import positive_int, probability

__all__ = ["RateFit", "fit_rate"]


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


def _ols_slopes(log_n: np.ndarray, log_means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slopes and intercepts of the OLS lines through ``(log_n, log_means[..., s])``."""
    xc = log_n - log_n.mean()
    slope = (log_means * xc).sum(axis=-1) / (xc**2).sum()
    return slope, log_means.mean(axis=-1) - slope * log_n.mean()


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
    n = np.asarray(sample_sizes, dtype=np.float64)
    L = np.asarray(losses.detach().cpu() if hasattr(losses, "detach") else losses, dtype=np.float64)
    if n.ndim != 1 or len(np.unique(n)) < 2 or np.any(n <= 0):
        raise ValueError(f"sample_sizes={n.tolist()!r} is not allowed; expected >= 2 distinct positive sizes")
    if L.ndim != 2 or L.shape[0] != n.shape[0]:
        raise ValueError(f"losses must be (S, R) with S={n.shape[0]} sample sizes; got shape {L.shape}")
    if not np.all(np.isfinite(L)) or np.any(L <= 0):
        raise ValueError("losses must be finite and > 0 to take logarithms")
    log_n = np.log(n)
    slope, intercept = _ols_slopes(log_n, np.log(L.mean(axis=1)))
    rng = np.random.default_rng(seed)
    S, R = L.shape
    idx = rng.integers(0, R, size=(n_boot, S, R))
    boot_means = np.take_along_axis(L[None].repeat(n_boot, 0), idx, axis=2).mean(axis=2)  # (B, S)
    boot_slopes, _ = _ols_slopes(log_n, np.log(boot_means))
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot_slopes, [alpha, 1 - alpha])
    return RateFit(float(slope), float(intercept), float(lo), float(hi), float(level), int(n_boot))
