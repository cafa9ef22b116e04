"""Hand-worked checks of the empirical-Bayes trust in the self-teacher."""

import json
import math

import numpy as np
import pytest

from recursa.algorithms.trust import TrustEstimator, agreement_trials, fit_beta_prior


def close(actual, expected, atol=1e-9):
    assert math.isclose(actual, expected, rel_tol=0, abs_tol=atol), (actual, expected)


# ------------------------------------------------------------ agreement trials

def test_agreement_trials_counts_and_exclusions():
    groups = ["a", "a", "a", "a", "a", "b", "b", "b", None]
    mean_delta = [0.5, -0.4, 0.3, 0.9, 0.05, -0.2, 0.2, -0.3, 0.7]
    outcome_adv = [1.0, -2.0, -1.0, 0.0, 1.0, -0.5, 0.5, 0.3, 1.0]
    is_source = [False, False, False, False, False, False, True, False, False]
    out = agreement_trials(groups, mean_delta, outcome_adv, is_source, threshold=0.1)
    # a: rows 0 (+,+) agree, 1 (-,-) agree, 2 (+,-) disagree;
    #    row 3 has A = 0, row 4 has |Delta| = 0.05 <= 0.1: not counted   -> (2, 3)
    # b: row 5 (-,-) agree, row 6 is the skill's source, row 7 (-,+) disagree -> (1, 2)
    # row 8 has no skill (None)
    assert out == {"a": (2, 3), "b": (1, 2)}
    # the threshold is strict: |Delta| = 0.2 is not > 0.2, so rows 5 and 6 of b drop out
    out = agreement_trials(groups, mean_delta, outcome_adv, is_source, threshold=0.2)
    assert out == {"a": (2, 3), "b": (0, 1)}
    # a source trajectory counts once it is not flagged; groups without trials are absent
    out = agreement_trials(groups, mean_delta, outcome_adv, [False] * 9, threshold=0.1)
    assert out["b"] == (2, 3)
    assert agreement_trials(["c"], [0.5], [0.0], [False], threshold=0.0) == {}


def test_agreement_trials_bad_input():
    with pytest.raises(ValueError, match="shape"):
        agreement_trials(["a", "b"], [0.1], [1.0, 1.0], [False, False], 0.0)
    with pytest.raises(ValueError, match="finite"):
        agreement_trials(["a"], [math.nan], [1.0], [False], 0.0)
    with pytest.raises(ValueError, match="threshold"):
        agreement_trials(["a"], [0.1], [1.0], [False], -1.0)


# ------------------------------------------------------------ moment fit by hand

def test_moment_fit_three_groups_by_hand():
    # A: 9/10 = 0.9, B: 5/10 = 0.5, C: 14/20 = 0.7 (no decay, so q_g = n_g, e_g = n_g)
    # N = 40, m = 28/40 = 0.7, m(1-m) = 0.21
    # S = 10 * 0.2^2 + 10 * 0.2^2 + 20 * 0^2 = 0.8
    # 1 - n_g/N = 0.75, 0.75, 0.5
    # C = 0.75 + 0.75 + 0.5 = 2 (= K - 1)
    # D = 9 * 0.75 + 9 * 0.75 + 19 * 0.5 = 23
    # v_between = (0.8 - 0.21 * 2) / 23 = 0.38 / 23 = 0.0165217391
    # alpha + beta = 0.21 * 23 / 0.38 - 1 = 12.7105263158 - 1 = 11.7105263158
    # alpha = 0.7 * 11.7105263158 = 8.1973684211, beta = 0.3 * 11.7105263158 = 3.5131578947
    est = TrustEstimator()
    est.update({"A": (9, 10), "B": (5, 10), "C": (14, 20)})
    alpha, beta = est.prior()
    close(alpha, 8.1973684211)
    close(beta, 3.5131578947)
    # posteriors (a + alpha) / (n + 11.7105263158):
    #   A: 17.1973684211 / 21.7105263158 = 0.7921212121  -> T = 0.5842424242
    #   B: 13.1973684211 / 21.7105263158 = 0.6078787879  -> T = 0.2157575758
    #   C: 22.1973684211 / 31.7105263158 = 0.7 (at the mean, shrinkage moves nothing) -> T = 0.4
    close(est.posterior("A"), 0.7921212121)
    close(est.posterior("B"), 0.6078787879)
    close(est.posterior("C"), 0.7)
    trusts = est.trusts()
    assert set(trusts) == {"A", "B", "C"}
    close(trusts["A"], 0.5842424242)
    close(trusts["B"], 0.2157575758)
    close(trusts["C"], 0.4)
    # the raw rates would give T = 0.8, 0, 0.4: shrinkage pulls A down and B up
    assert 0.5842424242 < 0.8 and 0.2157575758 > 0.0


def test_strength_clamps():
    # same counts, min_strength 20 > 11.71: alpha + beta = 20 -> alpha 14, beta 6;
    # A: (9 + 14) / (10 + 20) = 23/30 = 0.7666666667
    est = TrustEstimator(min_strength=20.0)
    est.update({"A": (9, 10), "B": (5, 10), "C": (14, 20)})
    close(est.prior()[0], 14.0)
    close(est.prior()[1], 6.0)
    close(est.posterior("A"), 23 / 30)
    # max_strength 5 < 11.71: alpha 3.5, beta 1.5; A: 12.5 / 15 = 0.8333333333
    est = TrustEstimator(max_strength=5.0)
    est.update({"A": (9, 10), "B": (5, 10), "C": (14, 20)})
    close(est.prior()[0], 3.5)
    close(est.posterior("A"), 12.5 / 15)


def test_no_between_group_variance_pools_fully():
    # 7/10 and 14/20: both rates 0.7, S = 0 < m(1-m) C -> v_between < 0 -> max_strength
    # (departure from the issue, which fell back to the weak cold-start prior here)
    est = TrustEstimator(max_strength=50.0)
    est.update({"A": (7, 10), "B": (14, 20)})
    close(est.prior()[0], 35.0)  # 0.7 * 50
    close(est.prior()[1], 15.0)  # 0.3 * 50


def test_cold_start_prior_when_not_identified():
    est = TrustEstimator(prior_mean=0.6, prior_strength=5.0)
    close(est.prior()[0], 3.0)
    close(est.prior()[1], 2.0)
    # one group: no between-group information -> cold prior (3, 2);
    # posterior (8 + 3) / (10 + 5) = 0.7333333333 -> T = 0.4666666667
    est.update({"A": (8, 10)})
    assert est.prior() == (3.0, 2.0)
    close(est.posterior("A"), 11 / 15)
    close(est.trust("A"), 2 * 11 / 15 - 1)
    # two groups of one trial each: D = sum (n - q/n)(...) = 0 -> not identified
    assert fit_beta_prior([1, 0], [1, 1], [1, 1], 2.0, 100.0) is None
    # groups with no trials are ignored by the fit and get the cold-start posterior and trust
    assert fit_beta_prior([9, 0], [10, 0], [10, 0], 2.0, 100.0) is None
    close(est.posterior("never-seen"), 0.6)
    close(est.trust("never-seen"), 0.2)  # max(0, 2 * 0.6 - 1)


# ------------------------------------------------------------ decay

def test_decay_over_two_updates_by_hand():
    est = TrustEstimator(decay=0.5)
    est.update({"A": (3, 4)})
    est.update({"A": (1, 2), "B": (2, 2)})
    # A: a = 0.5 * 3 + 1 = 2.5, n = 0.5 * 4 + 2 = 4, q = 0.25 * 4 + 2 = 3 (e_A = 16/3)
    # B: a = 2, n = 2, q = 2 (fresh)
    assert est.state_dict() == {"steps": 2, "groups": [["A", 2.5, 4.0, 3.0], ["B", 2.0, 2.0, 2.0]]}
    # fit: N = 6, m = 4.5 / 6 = 0.75, m(1-m) = 0.1875, rates 0.625 and 1
    #   S = 4 * 0.125^2 + 2 * 0.25^2 = 0.0625 + 0.125 = 0.1875
    #   1 - n/N = 1/3, 2/3
    #   C = (3/4)(1/3) + (2/2)(2/3) = 0.25 + 0.6666666667 = 0.9166666667
    #   D = (4 - 0.75)(1/3) + (2 - 1)(2/3) = 1.0833333333 + 0.6666666667 = 1.75
    #   v_between = (0.1875 - 0.1875 * 0.9166666667) / 1.75 = 0.015625 / 1.75 = 0.0089285714
    #   alpha + beta = 0.1875 / 0.0089285714 - 1 = 21 - 1 = 20 -> alpha 15, beta 5
    close(est.prior()[0], 15.0)
    close(est.prior()[1], 5.0)
    # A: (2.5 + 15) / (4 + 20) = 0.7291666667 -> T = 0.4583333333
    # B: (2 + 15) / (2 + 20) = 0.7727272727 -> T = 0.5454545455
    close(est.trust("A"), 0.4583333333)
    close(est.trust("B"), 0.5454545455)
    # Treating decayed counts as binomial counts (q = n) would give C = 1/3 + 2/3 = 1,
    # S - m(1-m) C = 0, i.e. no between-group variance at all.
    assert fit_beta_prior([2.5, 2], [4, 2], [4, 2], 2.0, 100.0) == (75.0, 25.0)


def test_old_evidence_fades_toward_the_prior():
    est = TrustEstimator(decay=0.9, prior_mean=0.5, prior_strength=2.0)
    est.update({"A": (10, 10)})
    close(est.posterior("A"), 11 / 12)  # (10 + 1) / (10 + 2)
    for _ in range(20):
        est.update({})
    # n = 10 * 0.9^20 = 1.2157665459, a the same: (1.2157665459 + 1) / (1.2157665459 + 2)
    close(est.posterior("A"), 2.2157665459 / 3.2157665459)


def test_fit_recovers_the_prior_from_faded_groups():
    # 300 groups with true rates ~ Beta(6, 4): mean 0.6, alpha + beta = 10.  Each group
    # gets 20 trials once, at a random one of 30 steps, and then decays (n_g from 20 down to
    # 20 * 0.9^29 = 0.94).  The fit must still find alpha + beta near 10.
    rng = np.random.default_rng(0)
    rates = rng.beta(6.0, 4.0, 300)
    first = rng.integers(0, 30, 300)
    est = TrustEstimator(decay=0.9, max_strength=1000.0)
    for step in range(30):
        est.update({g: (int(rng.binomial(20, rates[g])), 20) for g in np.flatnonzero(first == step)})
    alpha, beta = est.prior()
    assert 7.0 < alpha + beta < 15.0, (alpha, beta)
    assert abs(alpha / (alpha + beta) - 0.6) < 0.05
    # treating the decayed counts as binomial counts (q = n) mistakes faded groups for
    # noisy ones and pools far too strongly
    _, a, n, _ = zip(*est.state_dict()["groups"])
    naive_alpha, naive_beta = fit_beta_prior(a, n, n, 2.0, 1000.0)
    assert naive_alpha + naive_beta > 50.0, (naive_alpha, naive_beta)


# ------------------------------------------------------------ warm-up

def test_warmup_returns_cold_trust():
    est = TrustEstimator(warmup_steps=2)
    counts = {"A": (9, 10), "B": (5, 10), "C": (14, 20)}
    assert est.warming_up and est.trust("A") == 0.0
    est.update(counts)
    # counts are collected (the posterior moves) but trust stays at the cold value 0
    assert est.warming_up
    assert est.posterior("A") > 0.75
    assert est.trusts() == {"A": 0.0, "B": 0.0, "C": 0.0}
    est.update({})
    assert not est.warming_up
    assert est.trust("A") > 0.5
    # a configured cold value: prior_mean 0.75 -> cold trust 0.5 for every group
    est = TrustEstimator(warmup_steps=2, prior_mean=0.75)
    est.update({"A": (0, 10), "B": (10, 10)})
    assert est.trust("A") == 0.5 and est.trust("B") == 0.5


# ------------------------------------------------------------ checkpoints

def test_state_dict_round_trip_through_json():
    est = TrustEstimator(decay=0.8, warmup_steps=1)
    est.update({"A": (9, 10), "B": (5, 10)})
    est.update({"C": (14, 20), "A": (3, 4)})
    state = json.loads(json.dumps(est.state_dict()))
    restored = TrustEstimator(decay=0.8, warmup_steps=1)
    restored.load_state_dict(state)
    assert restored.trusts() == est.trusts()
    assert restored.prior() == est.prior()
    est.update({"B": (1, 3)})
    restored.update({"B": (1, 3)})
    assert restored.state_dict() == est.state_dict()
    assert restored.trusts() == est.trusts()
    with pytest.raises(ValueError, match="steps"):
        restored.load_state_dict({"groups": []})
    with pytest.raises(ValueError, match=r"\[group, a, n, q\]"):
        restored.load_state_dict({"steps": 1, "groups": [["A", 1.0, 2.0]]})


def test_bad_arguments():
    for kwargs, match in [
        (dict(decay=0.0), "decay"),
        (dict(decay=1.5), "decay"),
        (dict(prior_mean=1.5), "prior_mean"),
        (dict(prior_strength=0.0), "prior_strength"),
        (dict(min_strength=5.0, max_strength=2.0), "min_strength"),
        (dict(warmup_steps=-1), "warmup_steps"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrustEstimator(**kwargs)
    est = TrustEstimator()
    with pytest.raises(ValueError, match="agreements <= trials"):
        est.update({"A": (5, 3)})
    assert est.steps == 0  # a rejected update changes nothing


# ------------------------------------------------------------ simulation

def simulate(rates, steps, seed, trajectories=24, decay=0.9):
    """Each step, each group g gets `trajectories` trajectories whose mean Delta agrees in sign
    with the outcome advantage with probability rates[g]; some have A = 0, a small |Delta|,
    or are the skill's source, so agreement_trials keeps about 20 per group."""
    rng = np.random.default_rng(seed)
    est = TrustEstimator(decay=decay)
    for _ in range(steps):
        groups, mean_delta, adv, source = [], [], [], []
        for g, rate in rates.items():
            a = rng.choice([-1.0, 1.0], size=trajectories) * rng.uniform(0.2, 2.0, trajectories)
            a[rng.random(trajectories) < 0.05] = 0.0
            agree = rng.random(trajectories) < rate
            d = np.where(agree, np.sign(a), -np.sign(a)) * rng.exponential(0.5, trajectories)
            d[a == 0] = rng.normal(0.0, 0.5, int((a == 0).sum()))
            groups += [g] * trajectories
            mean_delta += d.tolist()
            adv += a.tolist()
            source += (np.arange(trajectories) == 0).tolist()
        est.update(agreement_trials(groups, mean_delta, adv, source, threshold=0.05))
    return est


def test_simulation_separates_reliable_from_noisy_teacher():
    rates = {"reliable": 0.9, "noise": 0.5, "g2": 0.7, "g3": 0.6, "g4": 0.8}
    est = simulate(rates, steps=30, seed=0)
    trusts = est.trusts()
    assert trusts["reliable"] > 0.6, trusts
    assert trusts["noise"] < 0.2, trusts
    # the fit found real between-group variance: neither clamp, nor the cold start
    alpha, beta = est.prior()
    assert est.min_strength < alpha + beta < est.max_strength, (alpha, beta)
    # trust is ordered like the true reliabilities
    order = sorted(rates, key=trusts.get)
    assert order == sorted(rates, key=rates.get), trusts


def test_simulation_adapts_when_a_teacher_degrades():
    # decay lets trust follow a teacher that stops being reliable (SRPO's concern:
    # the self-teacher's reliability degrades during training)
    rates = {"drifting": 0.9, "noise": 0.5, "g2": 0.75, "g3": 0.65}
    est = simulate(rates, steps=20, seed=1)
    assert est.trust("drifting") > 0.6
    rng = np.random.default_rng(2)
    for _ in range(30):  # the teacher of "drifting" turns into noise
        est.update(
            {g: (int(rng.binomial(20, 0.5 if g == "drifting" else r)), 20) for g, r in rates.items()}
        )
    assert est.trust("drifting") < 0.2, est.trusts()
