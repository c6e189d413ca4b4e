"""Summary statistics over seeds: mean ± sd, Student-t intervals and Welch's t-test against their
formulas and scipy; undefined statistics are ``None`` and print as a placeholder, never ``nan``."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import stats

from moelab.experiments.summary import (
    bootstrap_ranks,
    format_interval,
    format_mean_sd,
    holm,
    mean,
    mean_sd,
    paired,
    sd,
    seed_summary,
    t_interval,
    welch,
)


def test_mean_and_sd_are_the_mean_and_the_sample_standard_deviation():
    v = [1.30, 1.32, 1.31, 1.35]
    m, s = mean_sd(v)
    assert m == pytest.approx(np.mean(v)) and s == pytest.approx(np.std(v, ddof=1))
    assert (mean(v), sd(v)) == (m, s)


def test_one_value_has_a_mean_and_no_sd():
    assert mean_sd([0.2]) == (0.2, None) and sd([]) is None


def test_identical_values_have_zero_sd():
    assert mean_sd([0.1, 0.1, 0.1]) == (pytest.approx(0.1), 0.0)


def test_a_value_that_is_not_finite_gives_nan_not_a_number_that_hides_it():
    nan = float("nan")
    assert math.isnan(mean([nan, 1.0])) and math.isnan(sd([nan, 1.0])) and math.isnan(sd([math.inf, 1.0]))
    assert mean([math.inf, 1.0]) == math.inf and math.isnan(welch([nan, 1.0, 2.0], [1.0, 2.0, 3.0]).p)


def test_the_mean_of_no_values_is_refused():
    with pytest.raises(ValueError, match=r"^values=\[\] is not allowed; expected at least one value$"):
        mean([])


def test_t_interval_is_mean_plus_minus_t_quantile_times_standard_error():
    v = [0.10, 0.12, 0.11, 0.15, 0.09]
    half = stats.t.ppf(0.975, 4) * np.std(v, ddof=1) / np.sqrt(5)
    assert t_interval(v) == pytest.approx((np.mean(v) - half, np.mean(v) + half))
    half90 = stats.t.ppf(0.95, 4) * np.std(v, ddof=1) / np.sqrt(5)
    assert t_interval(v, level=0.9) == pytest.approx((np.mean(v) - half90, np.mean(v) + half90))


def test_t_interval_of_one_value_is_none_and_of_identical_values_is_a_point():
    assert t_interval([0.3]) is None
    low, high = t_interval([0.3, 0.3, 0.3])
    assert low == high == pytest.approx(0.3)


@pytest.mark.parametrize("level", [0, 1, 1.5, -0.1, float("nan"), True, "0.95"])
def test_t_interval_refuses_a_level_outside_zero_one(level):
    with pytest.raises(ValueError, match=r"^level=.* is not allowed; expected a number in \(0, 1\)$"):
        t_interval([1.0, 2.0], level=level)


def test_seed_summary_is_mean_sample_sd_and_student_t_interval():
    v = [0.10, 0.12, 0.11, 0.15, 0.09]
    s = seed_summary(v)
    half = stats.t.ppf(0.975, 4) * np.std(v, ddof=1) / np.sqrt(5)
    assert (
        s["n"] == 5 and s["mean"] == pytest.approx(np.mean(v)) and s["sd"] == pytest.approx(np.std(v, ddof=1))
    )
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((np.mean(v) - half, np.mean(v) + half))
    assert seed_summary([0.2]) == {"n": 1, "mean": 0.2, "sd": None, "ci_low": None, "ci_high": None}


def test_welch_matches_the_welch_satterthwaite_formula():
    a, b = (
        [1.303, 1.303, 1.307, 1.315, 1.304],
        [1.333, 1.322, 1.315, 1.320, 1.310],
    )  # CompeteSMoE (2024) Table 9
    ma, mb = sum(a) / 5, sum(b) / 5
    va = sum((x - ma) ** 2 for x in a) / 4
    vb = sum((x - mb) ** 2 for x in b) / 4
    t = (ma - mb) / math.sqrt(va / 5 + vb / 5)
    df = (va / 5 + vb / 5) ** 2 / ((va / 5) ** 2 / 4 + (vb / 5) ** 2 / 4)
    w = welch(a, b)
    assert w.t == pytest.approx(t) and w.df == pytest.approx(df)
    assert w.p == pytest.approx(2 * stats.t.sf(abs(t), df))
    assert w.p < 0.05  # CompeteSMoE (2024) App. C.4 reports p = 0.016 for these runs


def test_welch_matches_scipys_unequal_variance_t_test():
    a, b = [0.10, 0.12, 0.11, 0.15, 0.09], [0.08, 0.085, 0.09, 0.07]
    w = welch(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert (w.t, w.df, w.p) == pytest.approx((ref.statistic, ref.df, ref.pvalue))
    assert (w.n_a, w.n_b) == (5, 4)
    assert (w.mean_a, w.mean_b, w.diff) == pytest.approx((np.mean(a), np.mean(b), np.mean(a) - np.mean(b)))


def test_welch_is_undefined_with_one_value_a_side_or_no_spread_at_all():
    b = [0.08, 0.085, 0.09]
    for w in (welch([0.1], b), welch(b, []), welch([0.1, 0.1], [0.1, 0.1]), welch([1.0, 1.0], [2.0, 2.0])):
        assert (w.t, w.df, w.p) == (None, None, None)
    assert welch([0.1], b).mean_a == 0.1 and welch(b, []).mean_b is None and welch(b, []).diff is None


def test_welch_of_identical_samples_with_spread_finds_no_difference():
    w = welch([0.1, 0.2, 0.3], [0.1, 0.2, 0.3])
    assert w.t == pytest.approx(0.0) and w.p == pytest.approx(1.0)


def test_welch_against_a_constant_side_is_defined_and_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = welch([1.305, 1.305, 1.305], [1.30, 1.31, 1.32, 1.33])
    b = [1.30, 1.31, 1.32, 1.33]
    t = (1.305 - np.mean(b)) / math.sqrt(np.var(b, ddof=1) / 4)  # the constant side adds no variance
    assert (
        w.t == pytest.approx(t)
        and w.df == pytest.approx(3)
        and w.p == pytest.approx(2 * stats.t.sf(abs(t), 3))
    )


def test_mean_sd_prints_a_placeholder_for_an_undefined_sd():
    assert format_mean_sd(1.31, 0.01414) == "1.3100 ± 0.0141"
    assert format_mean_sd(1.3, None) == "1.3000 ± n/a"
    assert format_mean_sd(0.2, None, digits=3, missing="—") == "0.200 ± —"


def test_interval_prints_a_placeholder_when_undefined():
    assert format_interval((0.1234, 0.5678)) == "[0.123, 0.568]"
    assert format_interval(None) == "n/a" and format_interval(None, missing="NA") == "NA"


# ------------------------------------------------------------------ paired comparisons, TOST, Holm, ranks
def test_paired_test_matches_scipys_related_samples_t_test_and_its_interval():
    a, b = [2.01, 2.05, 1.98, 2.10, 2.03], [2.00, 2.02, 1.99, 2.05, 2.00]
    r = paired(a, b, margin=0.05)
    d = np.subtract(a, b)
    assert r.n == 5 and r.diff == pytest.approx(d.mean(), abs=1e-15)
    assert r.p == pytest.approx(stats.ttest_rel(a, b).pvalue, rel=1e-12)
    half = stats.t.ppf(0.975, 4) * d.std(ddof=1) / math.sqrt(5)
    assert (r.low, r.high) == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-12)


def test_tost_is_the_larger_of_the_two_one_sided_tests_against_the_margin():
    a, b = [2.01, 2.05, 1.98, 2.10, 2.03], [2.00, 2.02, 1.99, 2.05, 2.00]
    d = np.subtract(a, b)
    for margin in (0.01, 0.05, 0.2):
        lower = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
        upper = stats.ttest_1samp(d, margin, alternative="less").pvalue
        assert paired(a, b, margin).p_equivalent == pytest.approx(max(lower, upper), rel=1e-12)
    # a wide margin makes the same differences equivalent, a narrow one does not
    assert paired(a, b, 0.2).p_equivalent < 0.05 < paired(a, b, 0.01).p_equivalent


def test_paired_without_spread_has_no_test_and_refuses_unequal_lengths_and_a_bad_margin():
    r = paired([1.0, 2.0], [0.5, 1.5], margin=0.1)
    assert r.diff == 0.5 and r.p is None and r.p_equivalent is None and r.low is None
    with pytest.raises(ValueError, match=r"a and b have 2 and 1 values; expected the same number"):
        paired([1.0, 2.0], [1.0], 0.1)
    with pytest.raises(ValueError, match=r"margin=0 is not allowed; expected a number > 0"):
        paired([1.0, 2.0], [1.0, 3.0], 0)


def test_holm_adjusts_step_down_keeps_order_and_skips_none():
    # m = 3: sorted 0.01, 0.02, 0.04 -> 0.03, 0.04, 0.04 (monotone), back in the input order
    assert holm([0.04, None, 0.01, 0.02]) == pytest.approx([0.04, None, 0.03, 0.04])
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    assert holm([]) == [] and holm([None]) == [None]


def test_bootstrap_ranks_rank_by_mean_and_resample_the_same_seeds_for_every_method():
    values = {"a": [1.0, 1.1, 0.9, 1.0], "b": [2.0, 2.1, 1.9, 2.0], "c": [1.05, 1.0, 1.0, 1.1]}
    r = bootstrap_ranks(values, resamples=500, seed=3)
    assert r["a"][0] == 1 and r["c"][0] == 2 and r["b"] == (3, 3, 3)  # b is last in every resample
    assert r["a"][1] == 1 and r["a"][2] == 2 and r == bootstrap_ranks(values, resamples=500, seed=3)
    # paired resampling: a method that is another plus a constant never swaps rank with it
    shifted = {"x": [1.0, 3.0, 2.0], "y": [1.01, 3.01, 2.01]}
    assert bootstrap_ranks(shifted, resamples=300) == {"x": (1, 1, 1), "y": (2, 2, 2)}


def test_plan_paired_gives_the_mdd_and_the_fewest_seeds_that_reach_the_power():
    """The seeds the plan asks for reach the stated power by the exact (noncentral t) power of the
    paired t-test, and one seed fewer does not meet the planning inequality."""
    from scipy import stats

    from moelab.experiments.summary import plan_paired

    d = [-0.05, -0.11, -0.02, -0.09, -0.07]
    plan = plan_paired(d, 0.02, alpha=0.01, power=0.8)
    s, n = np.std(d, ddof=1), 5
    assert plan.target == "better" and plan.sd == pytest.approx(s)
    assert plan.mdd == pytest.approx((stats.t.ppf(0.995, 4) + stats.t.ppf(0.8, 4)) * s / np.sqrt(n))
    k = plan.seeds_needed
    crit = stats.t.ppf(0.995, k - 1)
    exact = stats.nct.sf(crit, k - 1, abs(np.mean(d)) * np.sqrt(k) / s)
    assert exact >= 0.78  # the t-quantile approximation, within a few points of the exact power
    fewer = k - 1
    assert (stats.t.ppf(0.995, fewer - 1) + stats.t.ppf(0.8, fewer - 1)) * s / np.sqrt(fewer) > abs(
        np.mean(d)
    )
    inside = plan_paired([0.001, -0.004, 0.003, 0.0, -0.002], 0.02)
    assert inside.target == "equivalent" and inside.seeds_needed is not None and inside.seeds_needed <= 5
    assert plan_paired([0.01, 0.01], 0.02).mdd is None  # no spread, no plan
    with pytest.raises(ValueError, match=r"margin=0 is not allowed; expected a number > 0"):
        plan_paired(d, 0)


def test_plan_paired_inside_the_margin_points_to_the_verdict_that_needs_fewer_seeds():
    """A steady difference inside the margin is decided sooner by the t-test of Δ = 0 than by the
    TOST (whose gap to the margin is small), and the benchmark counts either as a verdict."""
    from scipy import stats

    from moelab.experiments.summary import plan_paired

    def fewest(ok):
        return next(k for k in range(2, 10_000) if ok(k))

    d, margin, alpha = [0.025, 0.027, 0.026, 0.028, 0.024], 0.03, 0.01
    s, diff = np.std(d, ddof=1), np.mean(d)
    t_test = fewest(
        lambda k: (stats.t.ppf(1 - alpha / 2, k - 1) + stats.t.ppf(0.8, k - 1)) * s / np.sqrt(k) <= diff
    )
    tost = fewest(
        lambda k: (stats.t.ppf(1 - alpha, k - 1) + stats.t.ppf(0.9, k - 1)) * s / np.sqrt(k) <= margin - diff
    )
    assert t_test < tost
    plan = plan_paired(d, margin, alpha=alpha)
    assert (plan.target, plan.seeds_needed) == ("worse", t_test)
    centred = [x - diff for x in d]  # the same spread around 0: only the TOST can decide
    assert plan_paired(centred, margin, alpha=alpha).target == "equivalent"
