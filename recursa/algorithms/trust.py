"""Empirical-Bayes trust in the self-teacher, per skill group (RSIPO spec).

The self-teacher shift Delta (``recursa.algorithms.distill``) of a trajectory is only
useful if its sign agrees with what the outcome says.  For each trajectory i, of skill
group g_i, the agreement trial is

    z_i = 1[ sign(mean Delta_i) = sign(A_outcome_i) ]

counted only where A_outcome_i != 0, |mean Delta_i| > threshold, and trajectory i is
not the one the skill was written from (that one agrees by construction).

Each group g keeps decayed counts: a_g agreements, n_g trials, and q_g, the sum of the
squared trial weights.  An update multiplies a_g and n_g by ``decay`` and q_g by
decay^2, then adds the new counts (a fresh trial has weight 1).  q_g is what the issue's
plain counts lack: with decayed weights, the rate p_g = a_g / n_g has the sampling
variance of e_g = n_g^2 / q_g binomial trials, not n_g (e_g = n_g without decay; e_g
stays 20 for 20 trials however old).  Without it a group seen long ago (small n_g) would
look like one with few trials and bias the fit below.

Beta-binomial prior, fitted by the method of moments across the K groups with n_g > 0
(weights n_g; Kleinman 1973, "Proportions with extraneous variance", JASA 68:46-54):

    N = sum_g n_g,   m = sum_g a_g / N,   S = sum_g n_g (p_g - m)^2
    E[S] = m(1-m) C + tau^2 D,  with   C = sum_g (n_g / e_g) (1 - n_g / N)
                                       D = sum_g (n_g - n_g / e_g) (1 - n_g / N)
    v_between = tau^2 = (S - m(1-m) C) / D
    alpha + beta = m(1-m) / v_between - 1, clamped to [min_strength, max_strength]
    alpha = m (alpha + beta),  beta = (1 - m)(alpha + beta)

This is the issue's "variance of the rates minus the binomial noise E[m(1-m)/n_g]",
made unbiased for unequal counts (without decay, C = K - 1 and D = N - sum n_g^2 / N
- (K - 1); with equal n it is the Bessel-corrected variance of the rates minus
m(1-m)/n, divided by 1 - 1/n).  Plugging m in for the true mean makes it very slightly
biased, as usual.

Posterior mean and trust:   r_g = (a_g + alpha) / (n_g + alpha + beta)   (shrunk toward m)
                            T_g = max(0, 2 r_g - 1)

Cold start: the prior (alpha0, beta0) = (prior_mean, 1 - prior_mean) * prior_strength is
used when fewer than 2 groups have trials or D <= 0 (every group has effectively a single
trial, so the between-group variance is not identified).  Groups with no trials get the
cold-start posterior prior_mean, and during the first ``warmup_steps`` updates every
group gets the cold-start trust max(0, 2 prior_mean - 1) (0 for the default 1/2), so
the teacher is off until evidence has accumulated.

Departure from the issue: when v_between <= 0 (the groups' rates vary no more than
binomial noise explains) the issue falls back to the cold-start prior, the weakest
pooling.  We take the limit of the formula instead, alpha + beta -> max_strength,
the strongest pooling: otherwise the prior would jump from strongest to weakest as
the noisy v_between crosses 0 between two steps.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np

__all__ = ["agreement_trials", "fit_beta_prior", "TrustEstimator"]


def agreement_trials(
    groups: Sequence[Optional[Hashable]],
    mean_delta: Sequence[float],
    outcome_adv: Sequence[float],
    is_source: Sequence[bool],
    threshold: float,
) -> dict[Hashable, tuple[int, int]]:
    """Agreement trials per skill group: {g: (agreements, trials)}, groups with >= 1 trial.

    groups       # (N,) skill group of each trajectory; None = no skill (skipped)
    mean_delta   # (N,) mean Delta over the trajectory's action tokens
    outcome_adv  # (N,) outcome advantage
    is_source    # (N,) True for the trajectory the group's skill was written from
    A trial is counted where A != 0, |mean Delta| > threshold and not is_source; it is an
    agreement when mean Delta and A have the same sign.
    """
    n = len(groups)
    delta = np.asarray(mean_delta, dtype=np.float64)
    adv = np.asarray(outcome_adv, dtype=np.float64)
    source = np.asarray(is_source, dtype=bool)
    for name, arr in (("mean_delta", delta), ("outcome_adv", adv), ("is_source", source)):
        if arr.shape != (n,):
            raise ValueError(f"{name} must have shape (N,) = ({n},) like groups, got {arr.shape}")
    if not (np.isfinite(delta).all() and np.isfinite(adv).all()):
        raise ValueError("mean_delta and outcome_adv must be finite")
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    counted = (adv != 0) & (np.abs(delta) > threshold) & ~source  # (N,)
    agree = (delta > 0) == (adv > 0)  # (N,)
    out: dict[Hashable, tuple[int, int]] = {}
    for i in np.flatnonzero(counted):
        g = groups[i]
        if g is None:
            continue
        successes, trials = out.get(g, (0, 0))
        out[g] = (successes + int(agree[i]), trials + 1)
    return out


def fit_beta_prior(
    successes: Sequence[float],
    trials: Sequence[float],
    sq_trials: Sequence[float],
    min_strength: float,
    max_strength: float,
) -> Optional[tuple[float, float]]:
    """Method-of-moments Beta(alpha, beta) prior across groups (see module doc).

    successes, trials, sq_trials  # (K,) a_g, n_g, q_g; groups with n_g = 0 are ignored.
    Returns None when the prior is not identified (fewer than 2 groups with trials, or
    D <= 0); the caller then uses its cold-start prior.
    """
    a = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    q = np.asarray(sq_trials, dtype=np.float64)
    if not (a.shape == n.shape == q.shape) or a.ndim != 1:
        raise ValueError(
            f"successes, trials and sq_trials must be 1-D of equal length, got shapes "
            f"{a.shape}, {n.shape}, {q.shape}"
        )
    if not 0 < min_strength <= max_strength:
        raise ValueError(
            f"need 0 < min_strength <= max_strength, got {min_strength} and {max_strength}"
        )
    seen = n > 0
    a, n, q = a[seen], n[seen], q[seen]
    if n.size < 2:
        return None
    total = n.sum()  # N
    m = a.sum() / total
    rates = a / n  # (K,) p_g
    spread = (n * (rates - m) ** 2).sum()  # S
    left = 1.0 - n / total  # (K,) 1 - n_g / N
    noise = ((q / n) * left).sum()  # C, with n_g / e_g = q_g / n_g
    signal = ((n - q / n) * left).sum()  # D
    if not signal > 1e-12:
        return None
    v_between = (spread - m * (1.0 - m) * noise) / signal
    if v_between <= 0:
        strength = max_strength
    else:
        strength = min(max(m * (1.0 - m) / v_between - 1.0, min_strength), max_strength)
    return float(m * strength), float((1.0 - m) * strength)


class TrustEstimator:
    """Decayed per-group agreement counts and the empirical-Bayes trust they imply.

    decay          multiplies the old counts at every update, in (0, 1]
    prior_mean     cold-start prior mean of the agreement rate, in [0, 1]
    prior_strength cold-start prior strength alpha0 + beta0, > 0
    min_strength, max_strength   clamp of the fitted alpha + beta
    warmup_steps   number of updates during which trust is the cold-start value
    """

    def __init__(
        self,
        decay: float = 0.9,
        prior_mean: float = 0.5,
        prior_strength: float = 2.0,
        min_strength: float = 2.0,
        max_strength: float = 100.0,
        warmup_steps: int = 0,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1] (1 = never forget), got {decay}")
        if not 0 <= prior_mean <= 1:
            raise ValueError(f"prior_mean must be in [0, 1], got {prior_mean}")
        if not prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if not 0 < min_strength <= max_strength:
            raise ValueError(
                f"need 0 < min_strength <= max_strength, got {min_strength} and {max_strength}"
            )
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.decay = decay
        self.prior_mean = prior_mean
        self.prior_strength = prior_strength
        self.min_strength = min_strength
        self.max_strength = max_strength
        self.warmup_steps = warmup_steps
        self.steps = 0
        self._counts: dict[Hashable, list[float]] = {}  # g -> [a_g, n_g, q_g]
        self._prior = self._fit()

    @property
    def cold_prior(self) -> tuple[float, float]:
        """(alpha0, beta0) = (prior_mean, 1 - prior_mean) * prior_strength."""
        return self.prior_mean * self.prior_strength, (1 - self.prior_mean) * self.prior_strength

    @property
    def cold_trust(self) -> float:
        """Trust during warm-up and for groups without trials: max(0, 2 prior_mean - 1)."""
        return max(0.0, 2.0 * self.prior_mean - 1.0)

    @property
    def warming_up(self) -> bool:
        """True until ``warmup_steps`` updates have been made."""
        return self.steps < self.warmup_steps

    def _fit(self) -> tuple[float, float]:
        if not self._counts:
            return self.cold_prior
        a, n, q = zip(*self._counts.values())
        fitted = fit_beta_prior(a, n, q, self.min_strength, self.max_strength)
        return self.cold_prior if fitted is None else fitted

    def update(self, trials_by_group: Mapping[Hashable, tuple[float, float]]) -> None:
        """Decay every group's counts, then add this step's {g: (agreements, trials)}."""
        for g, (successes, trials) in trials_by_group.items():
            if not (math.isfinite(trials) and 0 <= successes <= trials):
                raise ValueError(
                    f"group {g!r}: need 0 <= agreements <= trials, got ({successes}, {trials})"
                )
        for counts in self._counts.values():
            counts[0] *= self.decay
            counts[1] *= self.decay
            counts[2] *= self.decay**2
        for g, (successes, trials) in trials_by_group.items():
            counts = self._counts.setdefault(g, [0.0, 0.0, 0.0])
            counts[0] += successes
            counts[1] += trials
            counts[2] += trials  # each fresh trial has weight 1, squared 1
        self.steps += 1
        self._prior = self._fit()

    def prior(self) -> tuple[float, float]:
        """(alpha, beta): fitted across groups, or the cold-start prior (see module doc)."""
        return self._prior

    def posterior(self, group: Hashable) -> float:
        """Posterior mean agreement rate (a_g + alpha) / (n_g + alpha + beta).

        prior_mean for a group without trials.  Not gated by warm-up (for logging).
        """
        a, n, _ = self._counts.get(group, (0.0, 0.0, 0.0))
        if n <= 0:
            return self.prior_mean
        alpha, beta = self._prior
        return (a + alpha) / (n + alpha + beta)

    def trust(self, group: Hashable) -> float:
        """T_g = max(0, 2 r_g - 1); the cold-start trust during warm-up."""
        if self.warming_up:
            return self.cold_trust
        return max(0.0, 2.0 * self.posterior(group) - 1.0)

    def trusts(self) -> dict[Hashable, float]:
        """Trust of every group seen so far."""
        return {g: self.trust(g) for g in self._counts}

    def state_dict(self) -> dict[str, Any]:
        """Counts and step number, JSON-serialisable if the group ids are."""
        return {
            "steps": self.steps,
            "groups": [[g, a, n, q] for g, (a, n, q) in self._counts.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (hyperparameters come from the config)."""
        if set(state) != {"steps", "groups"}:
            raise ValueError(
                f"trust state must have the keys 'steps' and 'groups', got {sorted(state)}; "
                "was it written by TrustEstimator.state_dict()?"
            )
        counts = {}
        for row in state["groups"]:
            if len(row) != 4:
                raise ValueError(f"trust state rows are [group, a, n, q], got {row!r}")
            g, a, n, q = row
            counts[g] = [float(a), float(n), float(q)]
        self.steps = int(state["steps"])
        self._counts = counts
        self._prior = self._fit()
