"""Tests for recursa.stats: hand-worked numbers first, then scipy cross-checks."""

import math

import numpy as np
import pytest
from scipy import stats as sps

import recursa.stats as rs
from recursa.stats import (
    bootstrap_mean_ci,
    clopper_pearson,
    mcnemar_exact,
    paired_compare,
    wilson_interval,
)

# z for a two-sided 95% interval, and z^2, used in the hand computations below.
Z95 = 1.959963984540054
Z95_SQ = 3.841458820694124


# ----------------------------------------------------------------------------- Wilson


def test_wilson_hand_values():
    # 0/10: p = 0, so the upper end is z^2 / (n + z^2) = 3.8414588 / 13.8414588.
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0
    assert hi == pytest.approx(0.27753279986289, abs=1e-12)
    # 10/10 mirrors 0/10: lower end n / (n + z^2) = 10 / 13.8414588.
    lo, hi = wilson_interval(10, 10)
    assert lo == pytest.approx(0.72246720013711, abs=1e-12)
    assert hi == 1.0
    # 5/10: centre 0.5, half-width z / (1 + z^2/10) * sqrt(0.025 + z^2/400)
    #       = 1.959964 / 1.3841459 * sqrt(0.0346036) = 0.2634069.
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.23659309051256, abs=1e-12)
    assert hi == pytest.approx(0.76340690948744, abs=1e-12)


def test_wilson_hand_closed_forms_match_constants():
    # Guards the literals above against a typo in Z95.
    assert Z95 * Z95 == pytest.approx(Z95_SQ, rel=1e-15)
    assert Z95_SQ / (10 + Z95_SQ) == pytest.approx(0.27753279986289, abs=1e-12)


def test_wilson_no_trials():
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("n", [1, 7, 20, 133])
@pytest.mark.parametrize("confidence", [0.8, 0.95, 0.99])
def test_wilson_matches_scipy(n, confidence):
    for k in range(n + 1):
        ref = sps.binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
        lo, hi = wilson_interval(k, n, confidence)
        assert lo == pytest.approx(ref.low, abs=1e-12)
        assert hi == pytest.approx(ref.high, abs=1e-12)


def test_wilson_rejects_bad_input():
    with pytest.raises(ValueError):
        wilson_interval(11, 10)
    with pytest.raises(ValueError):
        wilson_interval(-1, 10)
    with pytest.raises(ValueError):
        wilson_interval(3, 10, confidence=1.0)


# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_deterministic_and_seed_sensitive():
    values = np.random.default_rng(123).normal(size=50)
    a = bootstrap_mean_ci(values, seed=7)
    b = bootstrap_mean_ci(list(values), seed=7)
    c = bootstrap_mean_ci(values, seed=8)
    assert a == b
    assert a != c


def test_bootstrap_contains_mean_and_is_ordered():
    values = np.random.default_rng(0).exponential(size=80)
    lo, hi = bootstrap_mean_ci(values)
    assert lo < float(np.mean(values)) < hi


def test_bootstrap_two_point_hand_case():
    # Resampling [0, 1] twice gives means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4.
    # 95%: the 2.5% and 97.5% quantiles fall inside the masses at 0 and 1.
    assert bootstrap_mean_ci([0.0, 1.0], confidence=0.95) == (0.0, 1.0)
    # 40%: the 30% and 70% quantiles both fall inside the mass at 0.5.
    assert bootstrap_mean_ci([0.0, 1.0], confidence=0.40) == (0.5, 0.5)


def test_bootstrap_constant_and_single_values():
    assert bootstrap_mean_ci([2.5] * 9) == (2.5, 2.5)
    assert bootstrap_mean_ci([-1.0]) == (-1.0, -1.0)


def test_bootstrap_agrees_with_scipy_percentile_bootstrap():
    values = np.random.default_rng(5).normal(loc=1.0, scale=2.0, size=120)
    lo, hi = bootstrap_mean_ci(values, n_boot=20000, seed=1)
    ref = sps.bootstrap(
        (values,), np.mean, n_resamples=20000, method="percentile",
        confidence_level=0.95, rng=np.random.default_rng(2),
    ).confidence_interval
    width = ref.high - ref.low
    assert lo == pytest.approx(ref.low, abs=0.05 * width)
    assert hi == pytest.approx(ref.high, abs=0.05 * width)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0, 2.0], n_boot=0)


# ----------------------------------------------------------------------------- McNemar


def test_mcnemar_hand_b8_c2():
    # n = 10 discordant; P(X >= 8) = (C(10,8) + C(10,9) + C(10,10)) / 2^10 = (45 + 10 + 1) / 1024.
    assert mcnemar_exact(8, 2, "greater") == pytest.approx(56 / 1024, abs=1e-15)
    assert mcnemar_exact(8, 2, "greater") == pytest.approx(0.0546875, abs=1e-15)
    assert mcnemar_exact(8, 2, "two-sided") == pytest.approx(0.109375, abs=1e-15)
    # P(X <= 8) = 1 - (C(10,9) + C(10,10)) / 1024 = 1013 / 1024.
    assert mcnemar_exact(8, 2, "less") == pytest.approx(0.9892578125, abs=1e-15)
    # Swapping the systems swaps the one-sided tails.
    assert mcnemar_exact(2, 8, "less") == pytest.approx(0.0546875, abs=1e-15)


def test_mcnemar_hand_other_cases():
    # b=0, c=7: P(X <= 0) = 1/128; two-sided doubles it.
    assert mcnemar_exact(0, 7, "less") == pytest.approx(1 / 128, abs=1e-15)
    assert mcnemar_exact(0, 7) == pytest.approx(0.015625, abs=1e-15)
    assert mcnemar_exact(0, 7, "greater") == 1.0
    # b=c=3: P(X >= 3 | n=6) = (20 + 15 + 6 + 1) / 64; two-sided is capped at 1.
    assert mcnemar_exact(3, 3, "greater") == pytest.approx(42 / 64, abs=1e-15)
    assert mcnemar_exact(3, 3) == 1.0


@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_mcnemar_no_discordant_pairs(alternative):
    assert mcnemar_exact(0, 0, alternative) == 1.0


@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_mcnemar_matches_scipy_binomtest(alternative):
    for b in range(0, 16):
        for c in range(0, 16):
            if b + c == 0:
                continue
            ref = sps.binomtest(b, b + c, 0.5, alternative=alternative).pvalue
            assert mcnemar_exact(b, c, alternative) == pytest.approx(ref, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("b,c", [(140, 100), (510, 490), (6000, 5800), (12000, 11500)])
@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
def test_mcnemar_large_counts_match_scipy(b, c, alternative):
    ref = sps.binomtest(b, b + c, 0.5, alternative=alternative).pvalue
    assert mcnemar_exact(b, c, alternative) == pytest.approx(ref, rel=1e-8)


def test_mcnemar_log_space_path_agrees_with_exact_path(monkeypatch):
    exact = [mcnemar_exact(b, 300 - b, "greater") for b in (120, 150, 170, 200)]
    monkeypatch.setattr(rs, "_EXACT_BINOMIAL_MAX_N", 0)  # force the lgamma branch
    logspace = [mcnemar_exact(b, 300 - b, "greater") for b in (120, 150, 170, 200)]
    assert logspace == pytest.approx(exact, rel=1e-10)


def test_mcnemar_rejects_bad_input():
    with pytest.raises(ValueError):
        mcnemar_exact(3, 2, "bigger")
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


# ----------------------------------------------------------------------------- paired_compare


def test_paired_compare_counts_hand():
    before = [True, True, False, False, True, False, True, False]
    after = [True, False, True, True, True, False, True, True]
    # item:   both   c      b     b     both   neither both  b
    res = paired_compare(before, after)
    assert (res["n"], res["both"], res["b"], res["c"], res["neither"]) == (8, 3, 3, 1, 1)
    assert res["before_rate"] == 0.5
    assert res["after_rate"] == 0.75
    assert res["diff"] == 0.25
    # b=3, c=1: P(X >= 3 | n=4) = (C(4,3) + C(4,4)) / 16 = 5/16.
    assert res["p_greater"] == pytest.approx(5 / 16, abs=1e-15)
    assert res["p_two_sided"] == pytest.approx(10 / 16, abs=1e-15)
    assert res["p_less"] == pytest.approx(15 / 16, abs=1e-15)
    lo, hi = res["diff_ci95"]
    assert -1.0 <= lo < 0.25 < hi <= 1.0


def _table(both, b, c, neither):
    """before/after lists realising a paired 2x2 table."""
    before = [True] * both + [False] * b + [True] * c + [False] * neither
    after = [True] * both + [True] * b + [False] * c + [False] * neither
    return before, after


def test_paired_ci_published_newcombe_value():
    # Cavo et al. (2012) table [[59, 6], [16, 80]], n = 161, as worked in Fagerland,
    # Lydersen & Laake "Statistical Analysis of Contingency Tables", ch. 8:
    # Newcombe square-and-add interval -0.0621 (95% CI -0.1186 to -0.0046).
    # Rows = second system (after), columns = first (before): b = 6, c = 16.
    res = paired_compare(*_table(59, 6, 16, 80))
    assert res["diff"] == pytest.approx(-0.0621, abs=5e-5)
    lo, hi = res["diff_ci95"]
    assert lo == pytest.approx(-0.1186, abs=5e-5)
    assert hi == pytest.approx(-0.0046, abs=5e-5)


def test_paired_ci_no_discordant_pairs_is_not_degenerate():
    # All 10 solved by both: a margin is empty so phi = 0, and each side of the
    # interval is the distance from 1 to the Wilson lower end for 10/10,
    # i.e. z^2 / (10 + z^2) = 0.2775328 (see test_wilson_hand_values).
    res = paired_compare([True] * 10, [True] * 10)
    assert (res["b"], res["c"], res["diff"], res["p_two_sided"]) == (0, 0, 0.0, 1.0)
    lo, hi = res["diff_ci95"]
    assert lo == pytest.approx(-0.27753279986289, abs=1e-12)
    assert hi == pytest.approx(0.27753279986289, abs=1e-12)


def test_paired_ci_close_to_wald_for_large_n():
    both, b, c, neither = 4000, 1500, 1200, 3300
    n = both + b + c + neither
    res = paired_compare(*_table(both, b, c, neither))
    diff = (b - c) / n
    se = math.sqrt((b + c) / n - diff**2) / math.sqrt(n)  # Wald, Newcombe's method 1
    lo, hi = res["diff_ci95"]
    assert lo == pytest.approx(diff - Z95 * se, abs=1e-3)
    assert hi == pytest.approx(diff + Z95 * se, abs=1e-3)


def test_paired_ci_always_valid_on_small_tables():
    for both in range(4):
        for b in range(4):
            for c in range(4):
                for neither in range(4):
                    if both + b + c + neither == 0:
                        continue
                    res = paired_compare(*_table(both, b, c, neither))
                    lo, hi = res["diff_ci95"]
                    assert -1.0 <= lo <= res["diff"] <= hi <= 1.0
                    assert lo < hi


def test_paired_compare_rejects_bad_input():
    with pytest.raises(ValueError):
        paired_compare([True, False], [True])
    with pytest.raises(ValueError):
        paired_compare([], [])


# ----------------------------------------------------------------------------- Clopper-Pearson


def test_clopper_pearson_hand_edges():
    # k = 0: the upper end solves (1 - p)^n = alpha/2, i.e. 1 - 0.025^(1/10).
    lo, hi = clopper_pearson(0, 10)
    assert lo == 0.0
    assert hi == pytest.approx(0.30849710781876, abs=1e-12)
    # k = n mirrors it: lower end 0.025^(1/10).
    lo, hi = clopper_pearson(10, 10)
    assert lo == pytest.approx(0.69150289218124, abs=1e-12)
    assert hi == 1.0
    assert clopper_pearson(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("n", [1, 10, 57])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_clopper_pearson_matches_scipy(n, confidence):
    for k in range(n + 1):
        ref = sps.binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
        lo, hi = clopper_pearson(k, n, confidence)
        assert lo == pytest.approx(ref.low, abs=1e-10)
        assert hi == pytest.approx(ref.high, abs=1e-10)


def test_clopper_pearson_is_wider_than_wilson():
    for k in (1, 5, 9):
        cp, wi = clopper_pearson(k, 10), wilson_interval(k, 10)
        assert cp[0] < wi[0] and cp[1] > wi[1]
