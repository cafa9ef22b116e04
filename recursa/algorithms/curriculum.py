"""Curriculum math: learning-progress arm probabilities, the easy-to-hard schedule, the
answer-form hint, and B-STaR's balance score. Pure functions of plain numbers; the state that
feeds them and the recipes that call them are in `recursa.curriculum`.

Learning progress (after Kanitscheider et al., 2021, "Multi-task curriculum learning in a
complex, visual, hard-exploration domain"). Each arm k (a set of task parameters) keeps two
exponential moving averages of its pass rate r_k (successes / attempts of the arm's tasks in a
step), updated only at steps where the arm was drawn:

    f_k <- f_k + a_fast (r_k - f_k)        s_k <- s_k + a_slow (r_k - s_k)        a_slow < a_fast

The absolute learning progress is LP_k = |f_k - s_k|: large where the pass rate is moving, up
or down (a forgotten skill counts as much as a new one). Tasks are drawn from arm k with

    p_k = epsilon / K + (1 - epsilon) LP_k / sum_j LP_j        (uniform when every LP_j = 0)

Departures, and why:
* Both averages start at the arm's first observed pass rate (not at 0), so an arm does not
  show progress merely for having been measured once.
* An arm never drawn yet has no averages; its LP is taken as the largest LP of the arms that
  have them (0 if none), so every arm is tried early instead of waiting on the epsilon floor.
* No reweighting toward low pass rates (the paper's second step): the epsilon floor is the
  only exploration term, which keeps the rule one line.

B-STaR's balance score (Zeng et al., 2024, "B-STaR: Monitoring and Balancing Exploration and
Exploitation in Self-Taught Reasoners"). For task i with distinct selected samples S_i, of which
n_i are correct:

    bs_i = min(n_i / n*, 1) * n_i / |S_i|      (0 when nothing is selected)
    BS   = mean of bs_i over the probe tasks      (denominator "all", the default)
    BS   = mean of bs_i over the tasks with |S_i| > 0      (denominator "selected"; 0 if none)

The first factor is exploration (how many distinct correct samples, saturating at n*), the
second exploitation (how much of what is selected is correct). Samples are deduplicated by
their text before counting, as B-STaR's own selection does. B-STaR's paper and release
average over the queries that have a selected response ("selected"); recursa's default keeps
a task with nothing selected in the mean at 0 ("all"), so a setting that solves fewer tasks
cannot score higher for it. The two can choose different settings: with only the successes
selected, one task solved by 4 distinct correct samples of 4 (n* = 4) and three unsolved
scores 1/4 under "all" and 1 under "selected", four tasks with 2 correct samples each 1/2
under both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

__all__ = [
    "BalanceScore",
    "answer_form",
    "arm_probabilities",
    "balance_score",
    "best_candidate",
    "draw_index",
    "ema",
    "learning_progress",
    "schedule_arm",
]


def ema(average: float | None, observation: float, rate: float) -> float:
    """average + rate (observation - average); the observation itself when there is no average yet."""
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    if average is None:
        return float(observation)
    return float(average + rate * (observation - average))


def learning_progress(fast: Sequence[float | None], slow: Sequence[float | None]) -> list[float]:
    """|fast_k - slow_k| per arm; an arm with no averages (None) gets the largest LP of the others (0 if none)."""
    if len(fast) != len(slow):
        raise ValueError(f"fast and slow must have one entry per arm, got {len(fast)} and {len(slow)}")
    if any((f is None) != (s is None) for f, s in zip(fast, slow)):
        raise ValueError("an arm has a fast average but no slow one (or the reverse)")
    seen = [abs(f - s) for f, s in zip(fast, slow) if f is not None]
    top = max(seen, default=0.0)
    return [top if f is None else abs(f - s) for f, s in zip(fast, slow)]


def arm_probabilities(progress: Sequence[float], epsilon: float) -> list[float]:
    """p_k = epsilon / K + (1 - epsilon) LP_k / sum(LP); uniform when sum(LP) = 0."""
    k = len(progress)
    if k == 0:
        raise ValueError("need at least one arm")
    if not 0 <= epsilon <= 1:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    if any(not p >= 0 for p in progress):
        raise ValueError(f"learning progress must be >= 0, got {list(progress)}")
    total = sum(progress)
    if total == 0:
        return [1.0 / k] * k
    return [epsilon / k + (1 - epsilon) * p / total for p in progress]


def draw_index(probs: Sequence[float], u: float) -> int:
    """The index i with cdf(i - 1) <= u < cdf(i) for a uniform u in [0, 1) (inverse-CDF sampling);
    the last index with positive probability when rounding leaves u above the total."""
    if not 0 <= u < 1:
        raise ValueError(f"u must be in [0, 1), got {u}")
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    return max(i for i, p in enumerate(probs) if p > 0)


def schedule_arm(step: int, schedule_steps: Sequence[int], advanced: int, n_arms: int) -> int:
    """The arm of the easy-to-hard schedule at `step` (0 = the first step): the number of
    `schedule_steps` entries <= step, or `advanced` (the arm pass-rate advances reached) if
    that is further on; never past the last arm."""
    by_steps = sum(1 for s in schedule_steps if s <= step)
    return min(n_arms - 1, max(by_steps, advanced))


def answer_form(answer: str) -> str:
    """The shape of a reference answer without its value: each digit -> '#', each letter -> 'a',
    everything else (sign, point, separators, spaces) kept: '-12.5' -> '-##.#'."""
    return "".join("#" if c.isdigit() else "a" if c.isalpha() else c for c in str(answer).strip())


@dataclass(frozen=True)
class BalanceScore:
    score: float  # BS, the mean of bs_i over the tasks
    exploration: float  # mean of min(n_i / n*, 1)
    exploitation: float  # mean of n_i / |S_i| over the tasks with a selected sample (NaN if none)


def balance_score(tasks: Sequence[Sequence[tuple[Hashable, bool, bool]]], n_star: int, denominator: str = "all") -> BalanceScore:
    """B-STaR's balance score of a probe batch. `tasks[i]` lists task i's samples as
    (key, selected, correct): samples with equal keys are one response (the first occurrence
    counts), `selected` says whether selection keeps it, `correct` whether it is right.
    `denominator`: "all" averages bs_i over every task, "selected" over the tasks with a
    selected sample (B-STaR's paper and release; 0 when no task has one)."""
    if n_star < 1:
        raise ValueError(f"n_star must be >= 1, got {n_star}")
    if denominator not in ("all", "selected"):
        raise ValueError(f"denominator must be 'all' or 'selected', got {denominator!r}")
    if not tasks:
        raise ValueError("need at least one task")
    scores, explore, exploit = [], [], []
    for samples in tasks:
        distinct: dict[Hashable, tuple[bool, bool]] = {}
        for key, selected, correct in samples:
            distinct.setdefault(key, (bool(selected), bool(correct)))
        chosen = [correct for selected, correct in distinct.values() if selected]
        n_correct = sum(chosen)
        e = min(n_correct / n_star, 1.0)
        explore.append(e)
        if chosen:
            x = n_correct / len(chosen)
            exploit.append(x)
            scores.append(e * x)
        else:
            scores.append(0.0)
    scored = len(scores) if denominator == "all" else len(exploit)  # exploit: one entry per task with a selected sample
    return BalanceScore(
        score=sum(scores) / scored if scored else 0.0,
        exploration=sum(explore) / len(explore),
        exploitation=sum(exploit) / len(exploit) if exploit else float("nan"),
    )


def best_candidate(scores: Sequence[float]) -> int:
    """The index of the highest score; ties go to the earliest."""
    if not scores:
        raise ValueError("need at least one candidate")
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:
            best = i
    return best
