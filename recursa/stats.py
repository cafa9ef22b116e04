"""Small, dependency-light statistics for evaluating policies.

Everything here is a pure function of its arguments. Only numpy and the
standard library are used, except :func:`clopper_pearson`, which imports
``scipy.stats`` lazily for the beta quantile.

Conventions used throughout
---------------------------
Paired comparisons always compare a FIRST system (before / incumbent) with a
SECOND system (after / candidate) on the same items:

* ``b`` = number of items only the SECOND (after, candidate) system solves;
* ``c`` = number of items only the FIRST (before, incumbent) system solves.

A positive difference ``after_rate - before_rate = (b - c) / n`` means the
second system is better, and the one-sided alternative ``"greater"`` is the
hypothesis that the second system is better.
"""

from __future__ import annotations

import math
import operator
from statistics import NormalDist
from typing import Sequence

import numpy as np

__all__ = [
    "wilson_interval",
    "bootstrap_mean_ci",
    "mcnemar_exact",
    "paired_compare",
    "clopper_pearson",
    "pass_at_k",
]

# Up to this many discordant pairs the binomial tail is summed exactly with
# integers; above it, in log space with lgamma (relative error ~1e-12).
_EXACT_BINOMIAL_MAX_N = 10_000


def _check_confidence(confidence: float) -> float:
    """Return ``confidence`` as a float, or raise if it is not in (0, 1)."""
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return confidence


def _check_counts(k: int, n: int) -> tuple[int, int]:
    """Validate a success count ``k`` out of ``n`` trials; return them as ints."""
    k, n = operator.index(k), operator.index(n)
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    return k, n


def _z_two_sided(confidence: float) -> float:
    """Standard-normal quantile z with P(-z < Z < z) = ``confidence``."""
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion.

    With p = successes / n and z the two-sided normal quantile,
    centre = (p + z^2 / 2n) / (1 + z^2 / n) and
    half-width = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2).
    The ends are exactly 0.0 when successes == 0 and exactly 1.0 when
    successes == n.  With no trials (n == 0) nothing is known: (0.0, 1.0).
    """
    k, n = _check_counts(successes, n)
    confidence = _check_confidence(confidence)
    if n == 0:
        return (0.0, 1.0)
    z = _z_two_sided(confidence)
    p = k / n
    z2n = z * z / n
    centre = (p + z2n / 2.0) / (1.0 + z2n)
    half = z / (1.0 + z2n) * math.sqrt(p * (1.0 - p) / n + z2n / (4.0 * n))
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return (lo, hi)


def bootstrap_mean_ci(
    values: Sequence[float],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval for the mean of ``values``.

    Draws ``n_boot`` resamples (with replacement, same size as ``values``) from
    ``numpy.random.default_rng(seed)``, takes each resample's mean, and returns
    the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of those means
    (numpy's default linear interpolation).  The same inputs always give the
    same interval.  Raises ValueError for empty or non-finite input.
    """
    confidence = _check_confidence(confidence)
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("bootstrap_mean_ci needs at least one value")
    if not np.all(np.isfinite(x)):
        raise ValueError("bootstrap_mean_ci needs finite values")
    n_boot = operator.index(n_boot)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    n = x.size
    # Resample in row chunks so memory stays bounded for long value lists.
    rows_per_chunk = max(1, (1 << 22) // n)
    means = np.empty(n_boot, dtype=np.float64)
    for start in range(0, n_boot, rows_per_chunk):
        stop = min(n_boot, start + rows_per_chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = x[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return (float(lo), float(hi))


def _binom_half_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2), summed exactly (or in log space for huge n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if n <= _EXACT_BINOMIAL_MAX_N:
        total, term = 0, 1  # term = comb(n, i), updated incrementally
        for i in range(k + 1):
            total += term
            term = term * (n - i) // (i + 1)
        return total / (1 << n)  # int / int true division is correctly rounded
    log_terms = np.array(
        [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(k + 1)]
    )
    m = float(log_terms.max())
    log_cdf = m + math.log(float(np.exp(log_terms - m).sum())) - n * math.log(2.0)
    return min(1.0, math.exp(log_cdf))


def mcnemar_exact(b: int, c: int, alternative: str = "two-sided") -> float:
    """Exact (binomial) McNemar test p-value from the discordant counts.

    Convention: ``b`` = items only the SECOND (after / candidate) system
    solves, ``c`` = items only the FIRST (before / incumbent) system solves.
    Under H0 (both systems equally good) and conditional on the b + c
    discordant items, b ~ Binomial(b + c, 1/2).

    * ``"greater"``: H1 = the second system is better; p = P(X >= b).
    * ``"less"``: H1 = the second system is worse; p = P(X <= b).
    * ``"two-sided"``: p = min(1, 2 * min(P(X >= b), P(X <= b))).  Because the
      null distribution is symmetric this equals the "sum of outcomes no more
      likely than b" definition used by ``scipy.stats.binomtest``.

    When there are no discordant items (b + c == 0) the p-value is 1.0.
    """
    b, c = operator.index(b), operator.index(c)
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be 'two-sided', 'greater' or 'less', got {alternative!r}")
    n = b + c
    if n == 0:
        return 1.0
    p_less = _binom_half_cdf(b, n)
    p_greater = _binom_half_cdf(n - b, n)  # P(X >= b) = P(X <= n - b) by symmetry
    if alternative == "greater":
        return p_greater
    if alternative == "less":
        return p_less
    return min(1.0, 2.0 * min(p_less, p_greater))


def _newcombe_paired_ci(
    both: int, b: int, c: int, neither: int, confidence: float
) -> tuple[float, float]:
    """Newcombe (1998) method 10 interval for after_rate - before_rate.

    ``both``/``neither`` are the concordant counts; ``b`` (only after solves)
    and ``c`` (only before solves) the discordant ones.  Combines the Wilson
    intervals of the two marginal rates with the phi correlation between them,
    using Newcombe's corrected phi: with D = both*neither - b*c, phi uses
    D - n/2 when D > n/2, 0 when 0 <= D <= n/2, and D when D < 0; phi = 0 if
    any margin is empty.
    """
    n = both + b + c + neither
    after_k, before_k = both + b, both + c
    p1, p2 = after_k / n, before_k / n
    l1, u1 = wilson_interval(after_k, n, confidence)
    l2, u2 = wilson_interval(before_k, n, confidence)
    margins = (after_k, n - after_k, before_k, n - before_k)
    det = both * neither - b * c
    if min(margins) == 0:
        phi = 0.0
    else:
        if det > n / 2:
            num = det - n / 2
        elif det >= 0:
            num = 0.0
        else:
            num = float(det)
        phi = num / math.sqrt(math.prod(float(m) for m in margins))
    diff = p1 - p2
    d_lo = (p1 - l1) ** 2 - 2.0 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    d_hi = (u1 - p1) ** 2 - 2.0 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    lo = diff - math.sqrt(max(0.0, d_lo))
    hi = diff + math.sqrt(max(0.0, d_hi))
    return (max(-1.0, lo), min(1.0, hi))


def paired_compare(before: Sequence[bool], after: Sequence[bool]) -> dict:
    """Compare two systems' per-item successes on the same items (paired).

    ``before[i]`` / ``after[i]`` say whether the FIRST / SECOND system solved
    item i.  Returns a dict with:

    * ``n``, ``before_rate``, ``after_rate``, ``diff`` (= after - before);
    * ``both``, ``neither``: concordant counts;
    * ``b``: items only AFTER solves; ``c``: items only BEFORE solves;
    * ``p_two_sided``, ``p_greater`` (H1: after better), ``p_less``: exact
      McNemar p-values (see :func:`mcnemar_exact`);
    * ``diff_ci95``: (lo, hi), a 95% interval on ``diff`` by Newcombe's (1998)
      method 10 (Wilson score intervals of the two marginal rates combined
      with their phi correlation).  Unlike the Wald interval it stays inside
      [-1, 1] and does not collapse to zero width when b = c = 0.
    """
    if len(before) != len(after):
        raise ValueError(f"before and after differ in length: {len(before)} vs {len(after)}")
    if len(before) == 0:
        raise ValueError("paired_compare needs at least one item")
    pairs = [(bool(x), bool(y)) for x, y in zip(before, after)]
    n = len(pairs)
    both = sum(1 for x, y in pairs if x and y)
    b = sum(1 for x, y in pairs if y and not x)
    c = sum(1 for x, y in pairs if x and not y)
    neither = n - both - b - c
    return {
        "n": n,
        "before_rate": (both + c) / n,
        "after_rate": (both + b) / n,
        "diff": (b - c) / n,
        "both": both,
        "neither": neither,
        "b": b,
        "c": c,
        "p_two_sided": mcnemar_exact(b, c, "two-sided"),
        "p_greater": mcnemar_exact(b, c, "greater"),
        "p_less": mcnemar_exact(b, c, "less"),
        "diff_ci95": _newcombe_paired_ci(both, b, c, neither, 0.95),
    }


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson ("exact") interval for a binomial proportion k / n.

    lo = Beta quantile at alpha/2 with shape (k, n - k + 1), or 0 when k == 0;
    hi = Beta quantile at 1 - alpha/2 with shape (k + 1, n - k), or 1 when k == n.
    With no trials (n == 0) the interval is (0.0, 1.0).
    """
    k, n = _check_counts(k, n)
    confidence = _check_confidence(confidence)
    if n == 0:
        return (0.0, 1.0)
    from scipy.stats import beta  # lazy: keeps `import recursa.stats` light

    alpha = 1.0 - confidence
    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2.0, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1.0 - alpha / 2.0, k + 1, n - k))
    return (lo, hi)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n attempts with c successes (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k), the chance that k attempts drawn without replacement from
    the n include a success. Needs 1 <= k <= n."""
    c, n = _check_counts(c, n)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n}, got k = {k!r}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
