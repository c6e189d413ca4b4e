"""Summary statistics over seeds, shared by ``moelab report``, ``compare``, ``specialize`` and
``benchmark``: mean ± sample standard deviation, the Student-t interval of the mean, Welch's
unequal-variance t-test, the paired t-test with its equivalence twin (TOST), Holm's adjustment and
bootstrap intervals of ranks, and the power planning of a paired comparison (:func:`plan_paired`).
A statistic the values leave undefined (the spread of one value, a test without two values a side
or without any spread) is ``None``, never NaN, and the formatters print it as a placeholder, so no
table shows ``nan``.  docs/results.md ("Notes").
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "Paired",
    "Plan",
    "Welch",
    "bootstrap_ranks",
    "format_interval",
    "format_mean_sd",
    "holm",
    "mean",
    "mean_sd",
    "paired",
    "plan_paired",
    "sd",
    "seed_summary",
    "t_interval",
    "welch",
]


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean, computed exactly and rounded once (:func:`statistics.mean`), so equal
    values have themselves as their mean; NaN or ±inf where the values hold one (a diverged run)."""
    if len(values) == 0:
        raise ValueError("values=[] is not allowed; expected at least one value")
    v = [float(x) for x in values]
    if not all(map(math.isfinite, v)):
        return sum(v) / len(v)
    return statistics.mean(v)


def sd(values: Sequence[float]) -> float | None:
    """The sample standard deviation (divisor n − 1, :func:`statistics.stdev`: exact sums, so
    equal values have sd 0); ``None`` for fewer than two values, NaN where a value is not finite."""
    if len(values) < 2:
        return None
    v = [float(x) for x in values]
    if not all(map(math.isfinite, v)):
        return math.nan
    return statistics.stdev(v)


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """``(mean, sample sd)``; the sd is ``None`` for one value."""
    return mean(values), sd(values)


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The two-sided Student-t confidence interval of the mean at ``level``:
    ``mean ± t_{n-1}((1 + level) / 2) · sd / √n``; ``None`` for fewer than two values."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level={level!r} is not allowed; expected a number in (0, 1)")
    s = sd(values)
    if s is None:
        return None
    from scipy import stats

    m, n = mean(values), len(values)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * s / math.sqrt(n)
    return m - half, m + half


def seed_summary(values: Sequence[float], level: float = 0.95) -> dict[str, float | int | None]:
    """``n``, ``mean``, sample ``sd`` and the t-interval ``ci_low`` / ``ci_high`` of the mean over
    seeds (the keys written to ``metrics.json``); one value has no spread: ``sd`` and the interval
    are then ``None``."""
    interval = t_interval(values, level)
    low, high = interval if interval is not None else (None, None)
    return {"n": len(values), "mean": mean(values), "sd": sd(values), "ci_low": low, "ci_high": high}


@dataclass(frozen=True)
class Welch:
    """Welch's two-sided t-test of ``mean(a) = mean(b)``: the sizes and means of both samples,
    ``diff = mean_a − mean_b``, and ``t``, ``df`` (Welch–Satterthwaite) and ``p``, which are
    ``None`` when a side has fewer than two values or neither has any spread."""

    n_a: int
    n_b: int
    mean_a: float | None
    mean_b: float | None
    diff: float | None
    t: float | None
    df: float | None
    p: float | None


def welch(a: Sequence[float], b: Sequence[float]) -> Welch:
    """Welch's unequal-variance t-test (``scipy.stats.ttest_ind(a, b, equal_var=False)``)."""
    mean_a = mean(a) if len(a) else None
    mean_b = mean(b) if len(b) else None
    diff = mean_a - mean_b if mean_a is not None and mean_b is not None else None
    sizes = dict(n_a=len(a), n_b=len(b), mean_a=mean_a, mean_b=mean_b, diff=diff)
    # identical values on both sides leave t = 0/0: tested exactly, since the two variances
    # computed in floating point need not come out as exact zeros
    if len(a) < 2 or len(b) < 2 or (len(set(a)) == 1 and len(set(b)) == 1):
        return Welch(**sizes, t=None, df=None, p=None)
    from scipy import stats

    with warnings.catch_warnings():
        # scipy warns of "catastrophic cancellation" when one side's values are all equal (its
        # variance is then rounding noise around 0), which is a valid case of the test
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        result = stats.ttest_ind(list(a), list(b), equal_var=False)
    return Welch(**sizes, t=float(result.statistic), df=float(result.df), p=float(result.pvalue))


@dataclass(frozen=True)
class Paired:
    """The paired comparison of two methods over the seeds both ran (``diff``: the mean of
    ``a − b`` per seed): its Student-t interval at ``level``, the two-sided paired t-test ``p`` of
    ``diff = 0`` and the equivalence test ``p_equivalent`` of ``|diff| ≥ margin`` (TOST: the larger
    of the two one-sided p-values, Schuirmann 1987).  The tests and the interval are ``None`` for
    fewer than two seeds or differences without spread."""

    n: int
    diff: float
    low: float | None
    high: float | None
    p: float | None
    p_equivalent: float | None
    margin: float


def paired(a: Sequence[float], b: Sequence[float], margin: float, level: float = 0.95) -> Paired:
    """Paired t-test and TOST of ``a`` against ``b`` (equal lengths: ``a[i]`` and ``b[i]`` share a
    seed) with the equivalence ``margin`` (> 0, in the values' unit)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a and b have {len(a)} and {len(b)} values; expected the same number, at least one")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0:
        raise ValueError(f"margin={margin!r} is not allowed; expected a number > 0")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    diff, s = mean(d), sd(d)
    if s is None or len(set(d)) == 1:
        return Paired(len(d), diff, None, None, None, None, float(margin))
    from scipy import stats

    n = len(d)
    se = s / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
    p = float(2 * stats.t.sf(abs(diff) / se, n - 1))
    p_low = float(stats.t.sf((diff + margin) / se, n - 1))  # H0: diff <= -margin
    p_high = float(stats.t.cdf((diff - margin) / se, n - 1))  # H0: diff >= +margin
    return Paired(n, diff, diff - half, diff + half, p, max(p_low, p_high), float(margin))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (``None`` entries are left out of the
    family and stay ``None``): the k-th smallest of m becomes ``max_{j≤k} min(1, (m − j + 1)·p_(j))``."""
    kept = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(kept)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for j, (p, i) in enumerate(kept):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def bootstrap_ranks(
    values: dict[str, Sequence[float]], resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> dict[str, tuple[int, int, int]]:
    """Each method's rank by mean (1 = lowest) and its bootstrap percentile interval at ``level``:
    the seeds are resampled with replacement, the same seeds for every method (``values[m][i]``
    of every method share seed ``i``), ``resamples`` times from a generator seeded with ``seed``.
    Returns ``{method: (rank, low, high)}``; ties share the lower rank."""
    import numpy as np

    names = list(values)
    table = np.array([[float(v) for v in values[m]] for m in names])  # (methods, seeds)
    if table.ndim != 2 or table.shape[1] == 0:
        raise ValueError("values must give every method the same, non-zero number of seeds")

    def ranks(means) -> np.ndarray:  # ties share the lower rank: 1 + how many are strictly lower
        return 1 + (means[None, :] < means[:, None]).sum(axis=1)

    point = ranks(table.mean(axis=1))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, table.shape[1], size=(resamples, table.shape[1]))
    boot = np.stack([ranks(table[:, idx].mean(axis=1)) for idx in picks])  # (resamples, methods)
    tail = (1 - level) / 2
    low = np.floor(np.quantile(boot, tail, axis=0, method="lower"))
    high = np.ceil(np.quantile(boot, 1 - tail, axis=0, method="higher"))
    return {m: (int(point[i]), int(low[i]), int(high[i])) for i, m in enumerate(names)}


def format_mean_sd(mean: float, sd: float | None, digits: int = 4, missing: str = "n/a") -> str:
    """``"mean ± sd"`` with ``digits`` decimals; ``missing`` in place of an undefined sd."""
    spread = missing if sd is None else f"{sd:.{digits}f}"
    return f"{mean:.{digits}f} ± {spread}"


def format_interval(interval: tuple[float, float] | None, digits: int = 3, missing: str = "n/a") -> str:
    """``"[low, high]"`` with ``digits`` decimals; ``missing`` for an undefined interval."""
    if interval is None:
        return missing
    return f"[{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


@dataclass
class Plan:
    """The power of one paired comparison (:func:`plan_paired`)."""

    n: int
    diff: float
    sd: float | None
    #: the smallest true difference the paired t-test detects with ``power`` at this ``n``
    mdd: float | None
    #: what the comparison could end as, judged from the pilot: ``better`` / ``worse`` when the observed
    #: difference lies outside the margin; inside it ``equivalent``, or ``better`` / ``worse`` where the
    #: t-test of Δ = 0 needs fewer seeds than the TOST (a difference inside the margin is a verdict too)
    target: str
    #: seeds for that verdict with ``power`` if the true difference is the observed one (``None``:
    #: no spread to plan from, or more than ``max_seeds``)
    seeds_needed: int | None


def _t(q: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def plan_paired(
    d: Sequence[float], margin: float, *, alpha: float = 0.05, power: float = 0.8, max_seeds: int = 100_000
) -> Plan:
    """Power planning of a paired comparison from its per-seed differences ``d`` (a pilot): the
    minimum detectable difference of the two-sided paired t-test at this many seeds,
    ``(t₁₋α/₂ + t_power) · sd / √n`` with ``n − 1`` degrees of freedom, and the seeds the verdict
    the pilot points to would need at the same ``alpha`` and ``power`` if the true difference were
    the observed one: the t-test's ``(t₁₋α/₂ + t_power) · sd / √n ≤ |Δ|`` (better / worse) and, for
    ``|Δ| < margin``, the TOST's ``(t₁₋α + t₁₋(1−power)/2) · sd / √n ≤ margin − |Δ|``
    (equivalent), whichever needs fewer seeds (the usual approximations, Chow, Shao & Wang, *Sample
    Size Calculations in Clinical Research*, §3.2).  ``alpha`` is the level each test is run at
    (divide by the family size for Bonferroni, which bounds Holm's first step)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0:
        raise ValueError(f"margin={margin!r} is not allowed; expected a number > 0")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha={alpha!r}, power={power!r} are not allowed; expected both in (0, 1)")
    values = [float(x) for x in d]
    n, diff, spread = len(values), mean(values) if values else float("nan"), sd(values)
    direction = "better" if diff < 0 else "worse"
    if spread is None or spread == 0:
        return Plan(n, diff, spread, None, "equivalent" if abs(diff) < margin else direction, None)
    mdd = (_t(1 - alpha / 2, n - 1) + _t(power, n - 1)) * spread / math.sqrt(n)

    def fewest(enough: Callable[[int], bool]) -> int | None:
        if not enough(max_seeds):
            return None
        low, high = 2, max_seeds  # enough() grows with k: the smallest k by bisection
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if enough(mid) else (mid + 1, high)
        return low

    different = fewest(
        lambda k: (_t(1 - alpha / 2, k - 1) + _t(power, k - 1)) * spread / math.sqrt(k) <= abs(diff)
    )
    if abs(diff) >= margin:
        return Plan(n, diff, spread, mdd, direction, different)
    gap = margin - abs(diff)
    equivalent = fewest(
        lambda k: (_t(1 - alpha, k - 1) + _t(1 - (1 - power) / 2, k - 1)) * spread / math.sqrt(k) <= gap
    )
    if different is not None and (equivalent is None or different < equivalent):
        return Plan(n, diff, spread, mdd, direction, different)
    return Plan(n, diff, spread, mdd, "equivalent", equivalent)
