"""Tests for recursa.gate: hand-worked decisions, exact power, and simulated error rates."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from recursa.envs.base import split_seed
from recursa.gate import (
    GateConfig,
    alpha_at,
    binary_gate,
    continuous_gate,
    fresh_gate_seeds,
    mcnemar_power,
    regression_upper_bound,
    sample_size_for_gain,
    sample_size_paired,
)
from recursa.stats import mcnemar_exact


def outcomes(n: int, both: int, b: int, c: int) -> tuple[list[bool], list[bool]]:
    """(incumbent, candidate) per-item successes with the given concordant/discordant counts."""
    neither = n - both - b - c
    assert neither >= 0
    inc = [True] * both + [False] * b + [True] * c + [False] * neither
    cand = [True] * both + [True] * b + [False] * c + [False] * neither
    return inc, cand


# ----------------------------------------------------------------------------- alpha_at


def test_alpha_at_hand_values():
    assert alpha_at(GateConfig(alpha=0.05), t=7) == 0.05
    assert alpha_at(GateConfig(alpha=0.05), t=1, k_candidates=4) == 0.0125
    basel = GateConfig(alpha=0.05, spending="basel")
    assert alpha_at(basel, 1) == pytest.approx(0.3 / math.pi**2, rel=1e-15)  # 0.0303964
    assert alpha_at(basel, 2, 2) == pytest.approx(6 * 0.05 / (math.pi**2 * 4) / 2, rel=1e-15)
    assert alpha_at(basel, 2, 2) == pytest.approx(0.0037995443865876676, rel=1e-12)
    # k_candidates defaults to the config's candidates_per_round.
    assert alpha_at(GateConfig(alpha=0.05, candidates_per_round=5), 1) == pytest.approx(0.01)


def test_basel_spending_sums_to_alpha():
    cfg = GateConfig(alpha=0.05, spending="basel")
    total = math.fsum(alpha_at(cfg, t) for t in range(1, 100_001))
    assert total == pytest.approx(0.05, abs=1e-4)
    assert total < 0.05  # the tail beyond 10^5 is still unspent
    cfg3 = GateConfig(alpha=0.05, spending="basel", candidates_per_round=3)
    assert 3 * math.fsum(alpha_at(cfg3, t) for t in range(1, 100_001)) == pytest.approx(0.05, abs=1e-4)


@pytest.mark.parametrize("t", [0, -1, 1.5, True])
def test_alpha_at_rejects_bad_round(t):
    with pytest.raises(ValueError, match="round t"):
        alpha_at(GateConfig(), t)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": 0.5}, "alpha"),
        ({"delta": float("nan")}, "delta"),
        ({"max_regressions": -1}, "max_regressions"),
        ({"regression_rate": 0.0}, "regression_rate"),
        ({"regression_rate": 1.5}, "regression_rate"),
        ({"regression_confidence": 0.5}, "regression_confidence"),
        ({"spending": "linear"}, "spending"),
        ({"candidates_per_round": 0}, "candidates_per_round"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GateConfig(**kwargs)


# --------------------------------------------------------------------------- binary gate


def test_binary_gate_hand_case_significance():
    # 20 items: both solve 4, only the candidate solves 6, nobody loses one.
    # p = P(Bin(6, 1/2) >= 6) = 0.5^6 = 0.015625.
    inc, cand = outcomes(20, both=4, b=6, c=0)
    d = binary_gate(inc, cand, GateConfig(alpha=0.05))
    assert (d.n, d.b, d.c) == (20, 6, 0)
    assert d.p_value == 0.015625
    assert d.gain == pytest.approx(0.3)
    assert d.accepted and d.reason.startswith("accepted")
    assert (d.regressions, d.n_incumbent_solved) == (0, 4)
    lo, hi = d.gain_ci95
    assert lo < 0.3 < hi

    d = binary_gate(inc, cand, GateConfig(alpha=0.01))
    assert not d.accepted
    assert "p=0.01562 > alpha_t=0.01" in d.reason
    assert "delta" not in d.reason and "regression" not in d.reason


def test_binary_gate_uses_spending_and_bonferroni():
    inc, cand = outcomes(20, both=4, b=6, c=0)  # p = 0.015625
    basel = GateConfig(alpha=0.05, spending="basel")
    assert binary_gate(inc, cand, basel, t=1).accepted  # alpha_1 = 0.0304
    late = binary_gate(inc, cand, basel, t=2)  # alpha_2 = 0.0076
    assert not late.accepted and late.alpha_t == pytest.approx(0.007599088773175335)
    assert binary_gate(inc, cand, GateConfig(alpha=0.05), k_candidates=2).accepted  # 0.025
    assert not binary_gate(inc, cand, GateConfig(alpha=0.05), k_candidates=4).accepted  # 0.0125
    assert not binary_gate(inc, cand, GateConfig(alpha=0.05, candidates_per_round=4)).accepted


def test_binary_gate_rejected_only_by_delta():
    inc, cand = outcomes(20, both=4, b=6, c=0)  # gain 0.3, p = 0.0156
    d = binary_gate(inc, cand, GateConfig(alpha=0.05, delta=0.35))
    assert not d.accepted
    assert d.reason == "rejected: gain 0.3000 < delta 0.35"
    assert binary_gate(inc, cand, GateConfig(alpha=0.05, delta=0.3)).accepted  # gain >= delta


def test_binary_gate_rejected_only_by_regression_count():
    # 40 items: b = 10, c = 2: p = (C(12,10) + C(12,11) + C(12,12)) / 2^12 = 79 / 4096.
    inc, cand = outcomes(40, both=18, b=10, c=2)
    ok = binary_gate(inc, cand, GateConfig(alpha=0.05, max_regressions=2))
    assert ok.accepted and ok.p_value == 79 / 4096
    d = binary_gate(inc, cand, GateConfig(alpha=0.05, max_regressions=1))
    assert not d.accepted
    assert d.reason == "rejected: 2 regressions > max_regressions 1"


def test_binary_gate_clopper_pearson_regression_bound():
    # The incumbent solves 20 items; the candidate loses 2 of them (and gains 10 others).
    inc, cand = outcomes(40, both=18, b=10, c=2)
    upper = sps.beta.ppf(0.95, 2 + 1, 20 - 2)  # one-sided 95% bound: 0.2826
    d = binary_gate(inc, cand, GateConfig(alpha=0.05, regression_rate=0.25))
    assert d.regression_upper == pytest.approx(upper, rel=1e-12)
    assert d.regression_upper == pytest.approx(0.28261852488586087, rel=1e-12)
    assert not d.accepted
    assert d.reason.startswith("rejected: regression-rate upper bound 0.2826 > regression_rate 0.25")
    assert binary_gate(inc, cand, GateConfig(alpha=0.05, regression_rate=0.3)).accepted
    # At 99% confidence the bound is wider: beta.ppf(0.99, 3, 18) = 0.36 > 0.3.
    strict = GateConfig(alpha=0.05, regression_rate=0.3, regression_confidence=0.99)
    d99 = binary_gate(inc, cand, strict)
    assert d99.regression_upper == pytest.approx(sps.beta.ppf(0.99, 3, 18), rel=1e-12)
    assert not d99.accepted


def test_regression_budget_holds_when_incumbent_solves_nothing():
    inc, cand = outcomes(20, both=0, b=6, c=0)
    d = binary_gate(inc, cand, GateConfig(alpha=0.05, regression_rate=0.01, max_regressions=0))
    assert d.accepted and d.n_incumbent_solved == 0 and d.regression_upper is None


def test_regression_upper_bound_values():
    assert regression_upper_bound(0, 10, 0.95) == pytest.approx(1 - 0.05 ** (1 / 10), rel=1e-12)
    assert regression_upper_bound(5, 5, 0.95) == 1.0
    with pytest.raises(ValueError, match="confidence"):
        regression_upper_bound(1, 10, 0.4)


def test_binary_gate_rejects_identical_systems():
    inc = [True, False, True, True, False] * 8
    d = binary_gate(inc, inc, GateConfig(alpha=0.45))
    assert not d.accepted and d.p_value == 1.0 and d.gain == 0.0


def test_binary_gate_accepts_numpy_and_01_input():
    inc, cand = outcomes(20, both=4, b=6, c=0)
    d = binary_gate(np.array(inc, dtype=int), np.array(cand), GateConfig())
    assert d.b == 6 and d.accepted


@pytest.mark.parametrize(
    "inc, cand, match",
    [
        ([True, False], [True], "same items"),
        ([], [], "at least one item"),
        ([0.5, 1.0], [1.0, 1.0], "booleans"),
        ([[True], [False]], [[True], [True]], "flat"),
    ],
)
def test_binary_gate_bad_input(inc, cand, match):
    with pytest.raises(ValueError, match=match):
        binary_gate(inc, cand, GateConfig())


# ----------------------------------------------------------------------- continuous gate


def test_continuous_gate_accepts_clear_improvement():
    rng = np.random.default_rng(1)
    inc = rng.uniform(0.0, 0.9, size=200)
    cand = np.clip(inc + rng.normal(0.3, 0.2, size=200), 0.0, 1.0)
    d = continuous_gate(inc, cand, GateConfig(alpha=0.05))
    assert d.accepted and d.reason.startswith("accepted")
    assert 0.0 < d.lower_bound < d.mean_diff
    # Same seed, same answer; another seed, a slightly different bound.
    assert continuous_gate(inc, cand, GateConfig(alpha=0.05)).lower_bound == d.lower_bound
    assert continuous_gate(inc, cand, GateConfig(alpha=0.05), seed=1).lower_bound != d.lower_bound


def test_continuous_gate_rejects_zero_mean_difference():
    inc = np.linspace(0.0, 1.0, 101)
    same = continuous_gate(inc, inc, GateConfig(alpha=0.05))
    assert not same.accepted and same.lower_bound == 0.0 and same.mean_diff == 0.0
    wobble = inc + np.tile([0.1, -0.1], 51)[:101] - 0.1 / 101  # mean difference exactly 0
    d = continuous_gate(inc, wobble, GateConfig(alpha=0.05))
    assert d.mean_diff == pytest.approx(0.0, abs=1e-15)
    assert not d.accepted and d.lower_bound < 0.0
    assert "bootstrap lower bound" in d.reason


def test_continuous_gate_lower_bound_matches_normal_and_scipy():
    rng = np.random.default_rng(7)
    n = 4000
    inc = rng.normal(0.0, 1.0, size=n)
    cand = inc + rng.normal(0.05, 1.0, size=n)
    diff = cand - inc
    d = continuous_gate(inc, cand, GateConfig(alpha=0.05), n_boot=20_000)
    se = diff.std() / math.sqrt(n)  # the bootstrap's plug-in standard error
    normal = diff.mean() - sps.norm.ppf(0.95) * se
    assert d.lower_bound == pytest.approx(normal, abs=0.05 * se)
    ref = sps.bootstrap(
        (diff,),
        np.mean,
        confidence_level=0.95,
        alternative="greater",
        method="percentile",
        n_resamples=20_000,
        random_state=np.random.default_rng(3),
    )
    assert d.lower_bound == pytest.approx(ref.confidence_interval.low, abs=0.05 * se)


def test_continuous_gate_regression_budget():
    # Incumbent solves (score >= 1) 10 items; the candidate keeps 7 and gains a lot elsewhere.
    inc = np.array([1.0] * 10 + [0.0] * 30)
    cand = np.array([1.0] * 7 + [0.5] * 3 + [1.0] * 30)
    d = continuous_gate(inc, cand, GateConfig(alpha=0.05, max_regressions=2))
    assert (d.regressions, d.n_incumbent_solved) == (3, 10)
    assert d.lower_bound > 0.0 and not d.accepted
    assert d.reason == "rejected: 3 regressions > max_regressions 2"
    assert continuous_gate(inc, cand, GateConfig(alpha=0.05, max_regressions=3)).accepted
    # A lower solved_threshold: 0.5 counts as solved, so nothing regresses.
    loose = continuous_gate(inc, cand, GateConfig(alpha=0.05, max_regressions=0), solved_threshold=0.5)
    assert loose.accepted and (loose.regressions, loose.n_incumbent_solved) == (0, 10)


def test_continuous_gate_bad_input():
    with pytest.raises(ValueError, match="same items"):
        continuous_gate([0.1, 0.2], [0.3], GateConfig())
    with pytest.raises(ValueError, match="finite"):
        continuous_gate([0.1, float("nan")], [0.3, 0.4], GateConfig())
    late = GateConfig(alpha=0.05, spending="basel")
    with pytest.raises(ValueError, match="n_boot"):
        continuous_gate([0.1, 0.2], [0.3, 0.4], late, t=100, n_boot=10_000)  # alpha_t = 3e-6


# -------------------------------------------------------------------- power, sample size


def power_by_enumeration(n: int, p10: float, p01: float, alpha: float) -> float:
    """Sum over all 3^n item outcomes (candidate only / incumbent only / concordant)."""
    total = 0.0
    for items in itertools.product((0, 1, 2), repeat=n):
        b, c = items.count(0), items.count(1)
        prob = p10**b * p01**c * (1.0 - p10 - p01) ** (n - b - c)
        if mcnemar_exact(b, c, "greater") <= alpha:
            total += prob
    return total


@pytest.mark.parametrize("p10, p01", [(0.3, 0.1), (0.5, 0.2), (0.2, 0.2)])
def test_mcnemar_power_hand_n3(p10, p01):
    q = p10 + p01
    # alpha = 0.25 (a tie): reject on (D=2, b=2) [p = 1/4] and (D=3, b=3) [p = 1/8].
    hand = 3 * p10**2 * (1 - q) + p10**3
    assert mcnemar_power(3, p10, p01, 0.25) == pytest.approx(hand, rel=1e-12)
    assert power_by_enumeration(3, p10, p01, 0.25) == pytest.approx(hand, rel=1e-12)
    # alpha = 0.125: only (D=3, b=3); alpha = 0.1: nothing can reject.
    assert mcnemar_power(3, p10, p01, 0.125) == pytest.approx(p10**3, rel=1e-12)
    assert mcnemar_power(3, p10, p01, 0.1) == 0.0
    # Just below the tie the D=2 outcome no longer rejects.
    assert mcnemar_power(3, p10, p01, 0.2499) == pytest.approx(p10**3, rel=1e-12)


@pytest.mark.parametrize("n, b", [(30, 20), (30, 22), (101, 60), (250, 140)])
def test_mcnemar_power_size_at_attainable_alpha(n, b):
    # p10 = p01 = 1/2: every item is discordant (D = n) and H0 holds, so the power is the
    # test's exact size P(Bin(n, 1/2) >= crit). With alpha set to an attainable tail
    # P(X >= b), the gate rejects at b (p == alpha), so the size equals alpha exactly;
    # a float tail a hair above alpha would give P(X >= b + 1) instead.
    alpha = mcnemar_exact(b, n - b, "greater")
    assert mcnemar_power(n, 0.5, 0.5, alpha) == pytest.approx(alpha, rel=1e-9)


@pytest.mark.parametrize("alpha", [0.05, 1 / 64, 0.2])
def test_mcnemar_power_matches_enumeration_n6(alpha):
    assert mcnemar_power(6, 0.35, 0.15, alpha) == pytest.approx(
        power_by_enumeration(6, 0.35, 0.15, alpha), rel=1e-10
    )


def test_mcnemar_power_matches_monte_carlo():
    n, p10, p01, alpha, draws = 60, 0.25, 0.1, 0.05, 20_000
    rng = np.random.default_rng(11)
    counts = rng.multinomial(n, [p10, p01, 1.0 - p10 - p01], size=draws)  # (draws, 3)
    pvals = {}
    rejected = 0
    for b, c, _ in counts:
        key = (int(b), int(c))
        if key not in pvals:
            pvals[key] = mcnemar_exact(*key, "greater")
        rejected += pvals[key] <= alpha
    exact = mcnemar_power(n, p10, p01, alpha)
    assert 0.5 < exact < 0.95  # a non-trivial point of the power curve
    assert rejected / draws == pytest.approx(exact, abs=0.01)


def test_sample_size_is_the_first_n_reaching_power():
    # A case with a saw-tooth: bisection alone would answer 11; n = 9 already has power 0.14.
    n = sample_size_paired(p_incumbent_only=0.3, p_candidate_only=0.6, alpha=0.05, power=0.14)
    assert n == 9
    assert mcnemar_power(9, 0.6, 0.3, 0.05) >= 0.14
    assert all(mcnemar_power(m, 0.6, 0.3, 0.05) < 0.14 for m in range(1, 9))
    assert mcnemar_power(10, 0.6, 0.3, 0.05) < 0.14  # the saw-tooth dips again after 9
    for p01, p10, power in [(0.1, 0.3, 0.8), (0.05, 0.4, 0.9), (0.2, 0.3, 0.5)]:
        n = sample_size_paired(p01, p10, 0.05, power)
        assert mcnemar_power(n, p10, p01, 0.05) >= power
        assert all(mcnemar_power(m, p10, p01, 0.05) < power for m in range(1, n))


def test_sample_size_for_gain():
    # Independence: p10 = 0.6 * 0.5 = 0.3, p01 = 0.5 * 0.4 = 0.2.
    n = sample_size_for_gain(0.5, 0.1, alpha=0.05, power=0.8)
    assert n == sample_size_paired(p_incumbent_only=0.2, p_candidate_only=0.3, alpha=0.05, power=0.8)
    # The normal approximation (z_a sqrt(q) + z_b sqrt(q - g^2))^2 / g^2 gives ~307;
    # the exact conservative test needs a few percent more.
    z_a, z_b = sps.norm.ppf(0.95), sps.norm.ppf(0.8)
    approx = (z_a * math.sqrt(0.5) + z_b * math.sqrt(0.5 - 0.01)) ** 2 / 0.01
    assert approx < n < 1.1 * approx
    assert n == 326
    # A known disagreement rate q = 0.3: p10 = 0.2, p01 = 0.1; fewer items than independence.
    m = sample_size_for_gain(0.5, 0.1, alpha=0.05, power=0.8, discordance=0.3)
    assert m == sample_size_paired(p_incumbent_only=0.1, p_candidate_only=0.2, alpha=0.05, power=0.8)
    assert m < n


def test_sample_size_bad_input():
    with pytest.raises(ValueError, match="truly better"):
        sample_size_paired(0.3, 0.2, 0.05, 0.8)
    with pytest.raises(ValueError, match="p10"):
        sample_size_paired(0.6, 0.7, 0.05, 0.8)
    with pytest.raises(ValueError, match="discordance"):
        sample_size_for_gain(0.5, 0.1, 0.05, 0.8, discordance=0.05)
    with pytest.raises(ValueError, match="max_n"):
        sample_size_paired(0.2, 0.21, 0.05, 0.99, max_n=100)
    with pytest.raises(ValueError, match="alpha"):
        mcnemar_power(10, 0.3, 0.1, 1.0)


# ---------------------------------------------------------------------- fresh gate seeds


def test_fresh_gate_seeds_blocks_and_skips():
    assert fresh_gate_seeds(0, 3, set()) == [split_seed("gate", i) for i in (0, 1, 2)]
    assert fresh_gate_seeds(2, 3, set()) == [split_seed("gate", i) for i in (6, 7, 8)]
    used = {split_seed("gate", 3), split_seed("gate", 5), 17}
    seeds = fresh_gate_seeds(1, 3, used)
    assert seeds == [split_seed("gate", i) for i in (4, 6, 7)]
    assert fresh_gate_seeds(1, 3, used) == seeds and not used & set(seeds)
    assert fresh_gate_seeds(4, 0, set()) == []
    with pytest.raises(ValueError, match="round_index"):
        fresh_gate_seeds(-1, 3, set())
    # start: a run evaluated on the gate split's first 5 items gates on blocks after them
    assert fresh_gate_seeds(0, 3, set(), start=5) == [split_seed("gate", i) for i in (5, 6, 7)]
    assert fresh_gate_seeds(2, 3, set(), start=5) == [split_seed("gate", i) for i in (11, 12, 13)]
    from recursa.envs.base import split_seeds

    assert not set(fresh_gate_seeds(0, 3, set(), start=5)) & set(split_seeds("gate", 5))


# ---------------------------------------------------------------- simulated error rates


def test_simulated_false_accept_rate_at_most_alpha():
    """A useless candidate (same per-item solve probability, items correlated) is
    accepted at most alpha of the time (the exact test is conservative)."""
    sims, n, alpha = 2000, 200, 0.05
    rng = np.random.default_rng(2024)
    accepted = 0
    for _ in range(sims):
        p_item = rng.beta(1.0, 1.0, size=n)  # item difficulty shared by both systems
        inc = rng.random(n) < p_item
        cand = rng.random(n) < p_item
        accepted += binary_gate(inc, cand, GateConfig(alpha=alpha)).accepted
    rate = accepted / sims
    assert rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / sims)  # 0.0646
    assert rate > 0.01  # the gate is not simply closed


def test_simulated_power_at_prescribed_sample_size():
    """Incumbent 0.5, candidate 0.6 (independent items): at the n from
    sample_size_for_gain(power=0.8) the gate accepts at least ~80% of the time."""
    sims, alpha = 2000, 0.05
    n = sample_size_for_gain(0.5, 0.1, alpha=alpha, power=0.8)
    rng = np.random.default_rng(99)
    accepted = 0
    for _ in range(sims):
        inc = rng.random(n) < 0.5
        cand = rng.random(n) < 0.6
        accepted += binary_gate(inc, cand, GateConfig(alpha=alpha)).accepted
    power = accepted / sims
    assert power >= 0.8 - 3 * math.sqrt(0.8 * 0.2 / sims)  # 0.773
    assert power == pytest.approx(mcnemar_power(n, 0.3, 0.2, alpha), abs=0.03)
