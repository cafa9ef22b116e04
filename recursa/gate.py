"""The acceptance gate: paired tests deciding whether a candidate replaces the incumbent.

A candidate (new weights, a new skill library, a new prompt) is run on the same held-out
gate items as the incumbent, and is accepted only when all three criteria hold:

1. **Significance.** The candidate is better with one-sided p-value <= alpha_t.
   Binary outcomes (solved / not solved) use the exact McNemar test on the discordant
   pairs (McNemar 1947; exact binomial form: given D = b + c discordant items,
   b ~ Binomial(D, 1/2) under H0, p = P(X >= b)). Continuous scores use a paired
   percentile bootstrap of the mean difference (Efron & Tibshirani 1993, ch. 13):
   accept when its one-sided lower bound at level 1 - alpha_t exceeds delta.
2. **Effect size.** The net gain per item, (b - c) / n (binary) or the bootstrap lower
   bound of the mean difference (continuous), is at least delta.
3. **Regression budget.** Among the n_inc items the incumbent solves, the candidate
   newly fails c of them. Optionally c <= k (a hard count cap), and optionally the
   one-sided Clopper-Pearson (1934) upper bound of the regression rate c / n_inc at
   `regression_confidence` is <= rho, i.e. the gate demands *evidence* that regressions
   are rare, not merely a small observed count. With n_inc == 0 nothing can regress and
   the budget holds.

Counting convention (as in recursa.stats): b = items only the candidate solves,
c = items only the incumbent solves.

Error budget over rounds (alpha spending)
-----------------------------------------
A self-improvement run tests a new candidate every round, so a constant level alpha lets
false accepts pile up (after T useless candidates the chance of at least one false accept
is 1 - (1 - alpha)^T). With ``spending="basel"`` round t (1-based) is tested at
alpha_t = 6 alpha / (pi^2 t^2); since sum_{t>=1} 1/t^2 = pi^2 / 6, the levels sum to
alpha, and by the union bound the probability of *ever* accepting a useless candidate is
at most alpha over an unbounded run. This is a fixed alpha-spending sequence in the sense
of alpha-investing / online testing (Foster & Stine 2008; Javanmard & Montanari 2018),
without the "wealth" that those procedures earn back on rejections: it is the simplest
schedule that is valid for any number of rounds and any dependence between rounds. When
K candidates compete in one round the level is further split by Bonferroni: alpha_t / K.

The bound holds per gate kind. A run spends one such sequence for each kind it gates (the
weights gate, the prompt gate, RSIPO's skills gate), each with the full ``gate.alpha``, so
by the union bound a run that gates weights, prompts and skills accepts a useless change of
any kind with probability at most 3 alpha (k alpha for k kinds). To hold the whole run to
alpha, set ``gate.alpha`` to alpha / k.

Where this departs from the textbook
------------------------------------
* The exact McNemar test is conditional on D and conservative (its true size is below
  alpha because the binomial is discrete); we keep it rather than the mid-p or the
  chi-square version because a gate must not accept more often than promised.
* The bootstrap lower bound is the plain percentile bound; for small n it under-covers
  a little (like a z interval without the t correction). It also cannot resolve a tail
  smaller than 1 / n_boot, so `continuous_gate` refuses n_boot < 1 / alpha_t.
* The Newcombe (1998, method 10) interval on the gain is recorded for the report only;
  the decision uses the exact p-value and the point gain.
* The regression budget is a separate acceptance criterion, not part of the test's
  level: requiring more conditions can only lower the false-accept rate.

Fresh gate items
----------------
Scores used to *select* a candidate (best of K on some items) are biased upward on those
items (the winner's curse), so they are never reused for acceptance: the caller must
score incumbent and candidate on gate items not seen during selection.
:func:`fresh_gate_seeds` allocates such items deterministically from the gate split,
skipping every seed the caller reports as used.

Sample size
-----------
:func:`mcnemar_power` computes the power of the exact one-sided McNemar test exactly
(a sum over the number of discordant pairs), and :func:`sample_size_paired` /
:func:`sample_size_for_gain` return the number of gate items needed for a given power.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from recursa.envs.base import SPLIT_SIZE, split_seed
from recursa.stats import bootstrap_mean_ci, clopper_pearson, mcnemar_exact, paired_compare

__all__ = [
    "GateConfig",
    "GateDecision",
    "ContinuousGateDecision",
    "alpha_at",
    "regression_upper_bound",
    "binary_gate",
    "continuous_gate",
    "mcnemar_power",
    "sample_size_paired",
    "sample_size_for_gain",
    "fresh_gate_seeds",
]

Spending = Literal["constant", "basel"]

# Relative distance from alpha below which a float binomial tail is re-checked exactly: when
# alpha equals an attainable tail (alpha = P(Bin(30, 1/2) >= 20)) the float tail can land a
# hair above it, and the gate (exact integer sums) counts p == alpha as significant.
_TIE_RTOL = 1e-9


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _check_open_unit(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value}")
    return value


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class GateConfig:
    """How strict the gate is. Validated on construction.

    alpha: total false-accept budget of the run (constant spending: per round), in (0, 0.5).
    delta: minimum net gain per item: (b - c) / n must be >= delta for binary outcomes;
        the bootstrap lower bound of the mean difference must be > delta for scores.
    max_regressions: k, the most incumbent-solved items the candidate may newly fail;
        None = no count cap.
    regression_rate: rho in (0, 1], the most the one-sided Clopper-Pearson upper bound
        of the regression rate c / n_inc may be; None = off.
    regression_confidence: confidence of that upper bound, in (0.5, 1).
    spending: "constant" (alpha_t = alpha) or "basel" (alpha_t = 6 alpha / (pi^2 t^2)).
    candidates_per_round: K, candidates tested per round (Bonferroni: alpha_t / K).
    """

    alpha: float = 0.05
    delta: float = 0.0
    max_regressions: int | None = None
    regression_rate: float | None = None
    regression_confidence: float = 0.95
    spending: Spending = "constant"
    candidates_per_round: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"gate alpha must be in (0, 0.5), got {self.alpha}; 0.05 is usual")
        if not math.isfinite(self.delta):
            raise ValueError(f"gate delta must be a finite number, got {self.delta}")
        if self.max_regressions is not None:
            _check_int("gate max_regressions", self.max_regressions, 0)
        if self.regression_rate is not None and not 0.0 < self.regression_rate <= 1.0:
            raise ValueError(
                f"gate regression_rate must be in (0, 1] or None (off), got {self.regression_rate}"
            )
        if not 0.5 < self.regression_confidence < 1.0:
            raise ValueError(
                f"gate regression_confidence must be in (0.5, 1), got {self.regression_confidence}"
            )
        if self.spending not in ("constant", "basel"):
            raise ValueError(f"gate spending must be 'constant' or 'basel', got {self.spending!r}")
        _check_int("gate candidates_per_round", self.candidates_per_round, 1)


def alpha_at(cfg: GateConfig, t: int, k_candidates: int | None = None) -> float:
    """The per-test level of round ``t`` (1-based), Bonferroni-split over the candidates.

    constant: alpha_t = alpha / K;  basel: alpha_t = 6 alpha / (pi^2 t^2) / K,
    with K = ``k_candidates`` (default ``cfg.candidates_per_round``).
    Summed over t >= 1 and the K candidates, the basel levels total alpha.
    """
    t = _check_int("round t (1-based)", t, 1)
    k = cfg.candidates_per_round if k_candidates is None else _check_int("k_candidates", k_candidates, 1)
    if cfg.spending == "basel":
        return 6.0 * cfg.alpha / (math.pi**2 * t * t) / k
    return cfg.alpha / k


# --------------------------------------------------------------------- regression budget


def regression_upper_bound(regressions: int, n_solved: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound of the regression rate ``regressions / n_solved``.

    hi = Beta quantile at ``confidence`` with shape (c + 1, n - c), or 1 when c == n:
    P(rate <= hi) >= confidence. This is the upper end of the two-sided interval at level
    2 * confidence - 1, which is how it is computed with recursa.stats.clopper_pearson.
    With n_solved == 0 the bound is 1.0 (nothing is known).
    """
    confidence = _check_open_unit("confidence", confidence)
    if confidence <= 0.5:
        raise ValueError(f"a one-sided upper bound needs confidence in (0.5, 1), got {confidence}")
    return clopper_pearson(regressions, n_solved, 2.0 * confidence - 1.0)[1]


def _regression_failures(regressions: int, n_solved: int, upper: float | None, cfg: GateConfig) -> list[str]:
    """Reasons the regression budget fails (empty when it holds)."""
    failures = []
    if cfg.max_regressions is not None and regressions > cfg.max_regressions:
        failures.append(f"{regressions} regressions > max_regressions {cfg.max_regressions}")
    if cfg.regression_rate is not None and upper is not None and upper > cfg.regression_rate:
        failures.append(
            f"regression-rate upper bound {upper:.4f} > regression_rate {cfg.regression_rate:g} "
            f"({regressions}/{n_solved} incumbent-solved items lost, "
            f"{cfg.regression_confidence:.0%} one-sided Clopper-Pearson)"
        )
    return failures


def _bool_array(name: str, values: Sequence[bool]) -> np.ndarray:
    """(n,) bool array; entries must be bools or 0/1."""
    x = np.asarray(values)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of per-item outcomes, got shape {x.shape}")
    if x.dtype != np.bool_:
        if x.size and not (np.issubdtype(x.dtype, np.number) and np.isin(x, (0, 1)).all()):
            raise ValueError(f"{name} must hold booleans (solved or not) or 0/1, got other {x.dtype} values")
        x = x.astype(bool)
    return x


def _check_paired(incumbent: np.ndarray, candidate: np.ndarray) -> int:
    if incumbent.shape != candidate.shape:
        raise ValueError(
            f"incumbent and candidate must be scored on the same items: "
            f"{incumbent.shape[0]} vs {candidate.shape[0]} outcomes"
        )
    if incumbent.size == 0:
        raise ValueError("the gate needs at least one item")
    return int(incumbent.size)


# -------------------------------------------------------------------------- binary gate


@dataclass(frozen=True)
class GateDecision:
    """Every number the binary gate used, and the verdict.

    n: items; b / c: items only the candidate / only the incumbent solves;
    p_value: exact one-sided McNemar P(X >= b), X ~ Bin(b + c, 1/2);
    alpha_t: the level it was compared with; gain: (b - c) / n; delta: the required gain;
    gain_ci95: Newcombe 95% interval on the gain (reported, not used);
    regressions: c; n_incumbent_solved: n_inc; regression_upper: one-sided
    Clopper-Pearson bound of c / n_inc (None when n_inc == 0);
    reason: one line naming the failed criteria, or why it was accepted.
    """

    accepted: bool
    reason: str
    n: int
    b: int
    c: int
    p_value: float
    alpha_t: float
    gain: float
    delta: float
    gain_ci95: tuple[float, float]
    regressions: int
    n_incumbent_solved: int
    regression_upper: float | None
    t: int
    k_candidates: int


def binary_gate(
    incumbent: Sequence[bool],
    candidate: Sequence[bool],
    cfg: GateConfig,
    t: int = 1,
    k_candidates: int | None = None,
) -> GateDecision:
    """Decide on a candidate from paired per-item successes on the same gate items.

    ``incumbent[i]`` / ``candidate[i]``: whether each system solved gate item i, shape (n,).
    Accept iff  p = mcnemar_exact(b, c, "greater") <= alpha_t  (alpha_t = alpha_at(cfg, t, K))
    and  (b - c) / n >= delta  and the regression budget holds:
    c <= max_regressions (if set) and, when n_inc > 0, the one-sided Clopper-Pearson upper
    bound of c / n_inc at regression_confidence <= regression_rate (if set).
    """
    inc, cand = _bool_array("incumbent", incumbent), _bool_array("candidate", candidate)
    n = _check_paired(inc, cand)
    alpha_t = alpha_at(cfg, t, k_candidates)
    cmp = paired_compare(inc.tolist(), cand.tolist())
    b, c = cmp["b"], cmp["c"]
    p_value = mcnemar_exact(b, c, "greater")
    gain = (b - c) / n
    n_solved = int(inc.sum())
    upper = regression_upper_bound(c, n_solved, cfg.regression_confidence) if n_solved else None

    failures = []
    if p_value > alpha_t:
        failures.append(f"p={p_value:.4g} > alpha_t={alpha_t:.4g} (b={b}, c={c})")
    if gain < cfg.delta:
        failures.append(f"gain {gain:.4f} < delta {cfg.delta:g}")
    failures += _regression_failures(c, n_solved, upper, cfg)
    if failures:
        reason = "rejected: " + "; ".join(failures)
    else:
        reason = (
            f"accepted: p={p_value:.4g} <= alpha_t={alpha_t:.4g}, gain {gain:.4f} >= delta "
            f"{cfg.delta:g}, {c} regressions of {n_solved}"
        )
    return GateDecision(
        accepted=not failures,
        reason=reason,
        n=n,
        b=b,
        c=c,
        p_value=p_value,
        alpha_t=alpha_t,
        gain=gain,
        delta=cfg.delta,
        gain_ci95=cmp["diff_ci95"],
        regressions=c,
        n_incumbent_solved=n_solved,
        regression_upper=upper,
        t=operator.index(t),
        k_candidates=cfg.candidates_per_round if k_candidates is None else k_candidates,
    )


# ---------------------------------------------------------------------- continuous gate


@dataclass(frozen=True)
class ContinuousGateDecision:
    """Every number the continuous gate used, and the verdict.

    n: items; mean_diff: mean of candidate - incumbent; lower_bound: the alpha_t quantile
    of n_boot paired-bootstrap means of that difference (one-sided lower bound at level
    1 - alpha_t); delta: what it had to exceed; regressions: items with incumbent >=
    solved_threshold and candidate < solved_threshold; n_incumbent_solved: items with
    incumbent >= solved_threshold; regression_upper as in GateDecision; seed: bootstrap seed.
    """

    accepted: bool
    reason: str
    n: int
    mean_diff: float
    lower_bound: float
    alpha_t: float
    delta: float
    n_boot: int
    seed: int
    solved_threshold: float
    regressions: int
    n_incumbent_solved: int
    regression_upper: float | None
    t: int
    k_candidates: int


def _float_array(name: str, values: Sequence[float]) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of per-item scores, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} scores must be finite (no NaN or inf)")
    return x


def continuous_gate(
    incumbent: Sequence[float],
    candidate: Sequence[float],
    cfg: GateConfig,
    t: int = 1,
    k_candidates: int | None = None,
    n_boot: int = 10_000,
    seed: int = 0,
    solved_threshold: float = 1.0,
) -> ContinuousGateDecision:
    """Decide on a candidate from paired per-item scores on the same gate items.

    d = candidate - incumbent, shape (n,). Resample items with replacement n_boot times
    (numpy.random.default_rng(seed)); L = the alpha_t quantile of the resampled means of
    d. Accept iff L > delta and the regression budget holds, where an item counts as
    solved by a system when its score >= solved_threshold, n_inc = #{incumbent solved}
    and regressions = #{incumbent solved, candidate not}. Equal systems give L = 0, so
    they are rejected at delta = 0.
    """
    inc, cand = _float_array("incumbent", incumbent), _float_array("candidate", candidate)
    n = _check_paired(inc, cand)
    alpha_t = alpha_at(cfg, t, k_candidates)
    n_boot = _check_int("n_boot", n_boot, 1)
    if n_boot * alpha_t < 1.0:
        raise ValueError(
            f"n_boot={n_boot} bootstrap resamples cannot resolve the alpha_t={alpha_t:.3g} tail; "
            f"pass n_boot >= {math.ceil(10.0 / alpha_t)} (10 / alpha_t)"
        )
    diff = cand - inc
    # The two-sided interval at 1 - 2 alpha_t has the alpha_t quantile as its lower end.
    lower = bootstrap_mean_ci(diff, confidence=1.0 - 2.0 * alpha_t, n_boot=n_boot, seed=seed)[0]
    mean_diff = float(diff.mean())
    solved = inc >= solved_threshold
    n_solved = int(solved.sum())
    regressions = int((solved & (cand < solved_threshold)).sum())
    upper = regression_upper_bound(regressions, n_solved, cfg.regression_confidence) if n_solved else None

    failures = []
    if not lower > cfg.delta:
        failures.append(
            f"bootstrap lower bound {lower:.4g} <= delta {cfg.delta:g} "
            f"(mean diff {mean_diff:.4g}, level {1.0 - alpha_t:.4g})"
        )
    failures += _regression_failures(regressions, n_solved, upper, cfg)
    if failures:
        reason = "rejected: " + "; ".join(failures)
    else:
        reason = (
            f"accepted: bootstrap lower bound {lower:.4g} > delta {cfg.delta:g} at level "
            f"{1.0 - alpha_t:.4g}, {regressions} regressions of {n_solved}"
        )
    return ContinuousGateDecision(
        accepted=not failures,
        reason=reason,
        n=n,
        mean_diff=mean_diff,
        lower_bound=lower,
        alpha_t=alpha_t,
        delta=cfg.delta,
        n_boot=n_boot,
        seed=seed,
        solved_threshold=float(solved_threshold),
        regressions=regressions,
        n_incumbent_solved=n_solved,
        regression_upper=upper,
        t=operator.index(t),
        k_candidates=cfg.candidates_per_round if k_candidates is None else k_candidates,
    )


# ------------------------------------------------------------------ power and sample size


def _critical_b(d_max: int, alpha: float) -> np.ndarray:
    """crit[D] = the smallest b with mcnemar_exact(b, D - b, "greater") <= alpha, shape (d_max + 1,).

    crit[D] = D + 1 when even b = D is not significant (D small). The tail
    P(X >= b), X ~ Bin(D, 1/2), is evaluated in floating point (scipy) and re-checked
    with the exact integer sum of recursa.stats wherever it lies within a relative
    1e-9 of alpha, so a tie (p == alpha) is decided as binary_gate decides it.
    """
    from scipy.stats import binom  # lazy: keeps `import recursa.gate` light

    d = np.arange(d_max + 1)

    def tail(b: np.ndarray) -> np.ndarray:  # P(X >= b) for each D, b in [0, D + 1]
        return binom.sf(b - 1, d, 0.5)

    # isf gives the smallest k with P(X > k) <= alpha up to rounding; b = k + 1.
    guess = np.clip(binom.isf(alpha, d, 0.5).astype(np.int64) + 1, 0, d + 1)
    cands = np.stack([np.clip(guess + s, 0, d + 1) for s in (-1, 0, 1)])  # (3, d_max + 1)
    ok = np.stack([tail(cb) <= alpha for cb in cands]) | (cands == d + 1)
    crit = cands[np.argmax(ok, axis=0), d]  # first candidate that rejects
    near = np.zeros(d.shape, dtype=bool)
    for b in (crit, crit - 1):
        tb = tail(b)
        near |= (b >= 0) & (b <= d) & (np.abs(tb - alpha) <= _TIE_RTOL * alpha)
    for i in np.flatnonzero(near):
        di = int(i)
        b = int(crit[i])
        while b > 0 and mcnemar_exact(b - 1, di - b + 1, "greater") <= alpha:
            b -= 1
        while b <= di and mcnemar_exact(b, di - b, "greater") > alpha:
            b += 1
        crit[i] = b
    return crit


def _reject_given_d(crit: np.ndarray, r: float) -> np.ndarray:
    """g[D] = P(b >= crit[D] | D) for b | D ~ Binomial(D, r), shape like ``crit``."""
    from scipy.stats import binom

    return binom.sf(crit - 1, np.arange(crit.size), r)


def _power(n: int, q: float, g: np.ndarray) -> float:
    """Exact power sum_D P(D) g[D] with D ~ Binomial(n, q) (see mcnemar_power); needs g.size > n."""
    from scipy.stats import binom

    if q == 0.0:
        return 0.0
    # D outside n q +- (40 sd + 40) has probability far below 1e-100: skip it.
    half = 40.0 * math.sqrt(n * q * (1.0 - q)) + 40.0
    d = np.arange(max(0, math.floor(n * q - half)), min(n, math.ceil(n * q + half)) + 1)
    return float(min(1.0, binom.pmf(d, n, q) @ g[d]))


def _check_discordance(p10: float, p01: float) -> tuple[float, float]:
    p10, p01 = float(p10), float(p01)
    if not (0.0 <= p10 <= 1.0 and 0.0 <= p01 <= 1.0 and p10 + p01 <= 1.0):
        raise ValueError(
            f"discordance probabilities need p10, p01 >= 0 and p10 + p01 <= 1, got p10={p10}, p01={p01}"
        )
    return p10, p01


def mcnemar_power(n: int, p10: float, p01: float, alpha: float) -> float:
    """Exact power of the one-sided exact McNemar test (candidate better) on n paired items.

    Each item is independently "only the candidate solves" with probability p10,
    "only the incumbent solves" with p01, concordant otherwise. Then
    D = b + c ~ Binomial(n, p10 + p01) and b | D ~ Binomial(D, p10 / (p10 + p01)), so

        power = sum_{D=0}^{n} P(D) * P(b >= crit[D] | D),

    where crit[D] is the smallest b with mcnemar_exact(b, D - b, "greater") <= alpha.
    """
    n = _check_int("n", n, 0)
    p10, p01 = _check_discordance(p10, p01)
    alpha = _check_open_unit("alpha", alpha)
    q = p10 + p01
    if q == 0.0:
        return 0.0
    return _power(n, q, _reject_given_d(_critical_b(n, alpha), p10 / q))


def sample_size_paired(
    p_incumbent_only: float,
    p_candidate_only: float,
    alpha: float,
    power: float,
    max_n: int = 1_000_000,
) -> int:
    """Smallest number of paired gate items at which the exact McNemar gate reaches ``power``.

    p_incumbent_only = p01 (the c-rate), p_candidate_only = p10 (the b-rate); note the
    order (incumbent first) differs from :func:`mcnemar_power`'s (p10, p01), so pass
    them by keyword.

    Exact power is not monotone in n: the discreteness of the binomial gives it a
    saw-tooth (p10 = 0.6, p01 = 0.3, alpha = 0.05: power 0.093 at n = 6, 0.077 at n = 7),
    so a plain bisection can return an n above the first n that reaches the target. The
    random number of discordant pairs smooths the saw-tooth as n grows; it matters most
    when the systems disagree on most items (at p10 + p01 = 0.95 bisection overshot the
    smallest n by up to 20 items, at n ~ 180). The search therefore (1) doubles n until
    power >= target, (2) bisects to a crossing n* with power(n*) >= target >
    power(n* - 1), then (3) scans [n* - max(50, n*/4), n*) and returns the smallest n
    there with power >= target. A dip wider than that window would be missed.
    """
    p10, p01 = _check_discordance(p_candidate_only, p_incumbent_only)
    alpha = _check_open_unit("alpha", alpha)
    power = _check_open_unit("power", power)
    max_n = _check_int("max_n", max_n, 1)
    if p10 <= p01:
        raise ValueError(
            f"the candidate must be truly better (p_candidate_only > p_incumbent_only) for power "
            f"to exceed alpha, got {p10} <= {p01}"
        )

    q, r = p10 + p01, p10 / (p10 + p01)
    lo, hi = 0, 1  # power(lo) < target (power(0) = 0)
    while _power(hi, q, _reject_given_d(_critical_b(hi, alpha), r)) < power:
        if hi >= max_n:
            raise ValueError(f"power {power} is not reached with max_n={max_n} items; raise max_n")
        lo, hi = hi, min(2 * hi, max_n)
    g = _reject_given_d(_critical_b(hi, alpha), r)  # (hi + 1,), valid for every n <= hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _power(mid, q, g) >= power:
            hi = mid
        else:
            lo = mid
    best = hi
    for m in range(hi - 1, max(0, hi - max(50, hi // 4)) - 1, -1):
        if m > 0 and _power(m, q, g) >= power:
            best = m
    return best


def sample_size_for_gain(
    p_incumbent: float,
    gain: float,
    alpha: float,
    power: float,
    discordance: float | None = None,
) -> int:
    """Gate items needed to accept a candidate whose true solve rate is p_incumbent + gain.

    The discordance probabilities must satisfy p10 - p01 = gain. With ``discordance`` None
    the two systems are assumed to fail independently on each item:
    p10 = (p + gain)(1 - p), p01 = p (1 - p - gain). Real systems are positively
    correlated across items (easy items are easy for both), which lowers p10 + p01 and
    therefore the n needed, so the independence answer is conservative. If the disagreement
    rate q = P(the two systems differ on an item) is known, pass it as ``discordance``:
    p10 = (q + gain) / 2, p01 = (q - gain) / 2 (needs gain <= q <= 1).
    """
    p = float(p_incumbent)
    gain = float(gain)
    if not (0.0 <= p <= 1.0 and 0.0 < gain and p + gain <= 1.0):
        raise ValueError(
            f"need 0 <= p_incumbent, 0 < gain and p_incumbent + gain <= 1, got p={p}, gain={gain}"
        )
    if discordance is None:
        p10, p01 = (p + gain) * (1.0 - p), p * (1.0 - p - gain)
    else:
        q = float(discordance)
        if not gain <= q <= 1.0:
            raise ValueError(f"discordance must be in [gain, 1] = [{gain}, 1], got {q}")
        p10, p01 = (q + gain) / 2.0, (q - gain) / 2.0
    return sample_size_paired(p_incumbent_only=p01, p_candidate_only=p10, alpha=alpha, power=power)


# ------------------------------------------------------------------------ fresh gate items


def fresh_gate_seeds(round_index: int, n: int, used: set[int], start: int = 0) -> list[int]:
    """n gate-split seeds for round ``round_index`` (0-based), none of them in ``used``.

    Round r walks the gate split from index start + r * n upwards (split_seed("gate", i)
    for i = start + r * n, start + r * n + 1, ...) and takes the first n seeds not in
    ``used``; with a fixed n and nothing used, round r gets exactly the block
    [start + r * n, start + (r + 1) * n). ``start`` keeps the rounds off the split's first
    items (a run whose held-out evaluation is the gate split's first ``eval.n``). Pure: the
    caller adds the returned seeds (and every seed scored during selection) to ``used``.
    """
    round_index = _check_int("round_index", round_index, 0)
    n = _check_int("n", n, 0)
    start = _check_int("start", start, 0)
    seeds: list[int] = []
    i = start + round_index * n
    while len(seeds) < n:
        if i >= SPLIT_SIZE:
            raise ValueError(f"the gate split has no {n} unused seeds left from index {start + round_index * n}")
        seed = split_seed("gate", i)
        if seed not in used:
            seeds.append(seed)
        i += 1
    return seeds
