"""Rewards without a verifier: the pure math of the three `[[reward]]` kinds that score a
completion from the policy's own behaviour (`recursa/self_rewards.py` runs the models).

Self-consistency (TTRL; Zuo et al. 2025). The G answers of one task vote; the most common
answer m_g is the pseudo-label, and a sample earns 1 when its answer is m_g:

    a_i  = the answer the task extracts from completion i (None: no answer), as a vote key
    m_g  = argmax_a #{i in g : a_i = a}      ties: the answer that appears first in the group
    s_g  = #{i in g : a_i = m_g} / G          majority share; None answers count in G
    r_i  = 1[a_i = m_g]                       (0 for every sample of a group without answers)

Low agreement (RESTRAIN; Yu et al. 2025, "negative rollout penalization"). A majority
backed by few samples is often wrong, and reinforcing it trains the policy toward a
spurious vote. A group with s_g < kappa (`min_agreement`) gets no pseudo-label: r_i = 0
for all its samples, so its group-relative advantage is 0; with a penalty delta > 0 each
of its samples also gets -delta added to its advantage after the estimator, which lowers
the probability of every completion of a task the policy cannot agree on (RESTRAIN's
uniform negative advantage). RESTRAIN's two other components, soft pseudo-labels weighted
by vote frequency and offline prompt weights from the base model's consistency, are not
implemented.

Reliability from a few verified tasks. Where a task's reference answer may be read (a
seeded share of the tasks, `verified_frac`), the pseudo-label is checked against it; the
checks are agreement trials of `recursa.algorithms.trust.TrustEstimator`, grouped by the
majority share's bin, b(s) = min(floor(s * bins), bins - 1). Its empirical-Bayes posterior
r_b of the label accuracy in bin b gives the trust T_b = max(0, 2 r_b - 1), and the
pseudo-reward becomes T_b(s_g) * r_i. Why 2r - 1: with a label that is right with
probability r, a sample that agrees is rewarded for the right reason with probability r
and for the wrong one with 1 - r, so the expected sign of the signal is r - (1 - r).

Self-judging: the policy reads a rubric prompt holding the task and its own reply and the
score is its probability of answering "Yes" rather than "No",

    p = P(Yes) / (P(Yes) + P(No)) = sigmoid(log P(Yes) - log P(No)),

each verdict's log-probability summed over its tokens (a verdict may be several tokens).

Self-rewarding (implicit reward, as in DPO's reparameterisation): the log-ratio of the
warm start to the base model, summed over the completion's tokens,

    d_i = sum_t [ log pi_SFT(y_t | x, y_<t) - log pi_base(y_t | x, y_<t) ],

standardised within its group and clipped: r_i = clip((d_i - mean_g d) / std_g d, -c, c)
(population std; 0 for a group whose d are all equal). The sum grows with length; the
per-group standardisation keeps one long completion from setting the scale of every group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from recursa.answers import normalise_number

__all__ = [
    "Consistency",
    "agreement_bin",
    "group_standardise",
    "majority_vote",
    "pearson",
    "self_consistency",
    "vote_key",
    "yes_probability",
]


def vote_key(answer: str | None) -> str | None:
    """The form in which answers vote: a number in its canonical form ("1,000" = "1000.0"),
    other text with its whitespace collapsed; None for no answer or an empty one."""
    if answer is None:
        return None
    number = normalise_number(answer)
    if number is not None:
        return number
    text = " ".join(answer.split())
    return text or None


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, float]:
    """(m, s): the most common non-None answer (ties: the one that appears first) and its
    share of all len(answers) samples; (None, 0.0) when no sample has an answer."""
    counts: dict[str, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return None, 0.0
    best = max(counts.values())
    label = next(a for a in answers if a is not None and counts[a] == best)  # first to reach the top count in sample order
    return label, best / len(answers)


@dataclass
class Consistency:
    """`self_consistency`'s result: per item and per group (groups in order of first appearance)."""

    rewards: list[float]  # (N,) 1 for a sample agreeing with its group's label, else 0 (0 in low-agreement groups)
    agree: list[bool]  # (N,) a_i = m_g, whatever the threshold
    low: list[bool]  # (N,) the item's group is below min_agreement
    group_ids: list[Hashable]  # (K,) each group once
    labels: list[str | None]  # (K,) m_g
    shares: list[float]  # (K,) s_g
    members: list[list[int]]  # (K,) item indices of each group


def self_consistency(groups: Sequence[Hashable], answers: Sequence[str | None], min_agreement: float = 0.0) -> Consistency:
    """Majority-vote pseudo-rewards of N samples (see the module doc).

    groups   # (N,) the task group of each sample (any hashable; the G samples of a task share it)
    answers  # (N,) each sample's vote key (`vote_key`), None for no answer
    A group whose majority share is below `min_agreement` gets reward 0 on every sample."""
    if len(groups) != len(answers):
        raise ValueError(f"groups and answers must have the same length, got {len(groups)} and {len(answers)}")
    if not 0 <= min_agreement <= 1:
        raise ValueError(f"min_agreement must be in [0, 1], got {min_agreement}")
    order: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        order.setdefault(g, []).append(i)
    n = len(groups)
    rewards, agree, low = [0.0] * n, [False] * n, [False] * n
    labels, shares = [], []
    for members in order.values():
        label, share = majority_vote([answers[i] for i in members])
        labels.append(label)
        shares.append(share)
        below = share < min_agreement
        for i in members:
            agree[i] = label is not None and answers[i] == label
            low[i] = below
            rewards[i] = 1.0 if agree[i] and not below else 0.0
    return Consistency(rewards, agree, low, list(order), labels, shares, list(order.values()))


def agreement_bin(share: float, bins: int) -> int:
    """The bin of a majority share s in [0, 1]: min(floor(s * bins), bins - 1)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if not 0 <= share <= 1:
        raise ValueError(f"a majority share is in [0, 1], got {share}")
    return min(int(math.floor(share * bins)), bins - 1)


def yes_probability(logp_yes: torch.Tensor, logp_no: torch.Tensor) -> torch.Tensor:
    """P(Yes) / (P(Yes) + P(No)) = sigmoid(logp_yes - logp_no), elementwise.

    logp_yes, logp_no  # (N,) log-probabilities of the whole verdicts"""
    return torch.sigmoid(logp_yes - logp_no)


def group_standardise(values: Sequence[float], groups: Sequence[Hashable], clip: float) -> list[float]:
    """(v_i - mean_g v) / std_g v clipped to [-clip, clip], per group g (population std over
    the group's items; 0 for every item of a group whose values are all equal)."""
    if len(values) != len(groups):
        raise ValueError(f"values and groups must have the same length, got {len(values)} and {len(groups)}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(values)
    for idx in members.values():
        vals = [float(values[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        if std <= 1e-12 * max(1.0, abs(mean)):
            continue
        for i, v in zip(idx, vals):
            out[i] = max(-clip, min(clip, (v - mean) / std))
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of two equal-length sequences; NaN with fewer than 2 pairs or when
    either has zero variance (the correlation is not defined)."""
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    n = len(x)
    if n < 2:
        return float("nan")
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx <= 0 or syy <= 0:
        return float("nan")
    return sxy / math.sqrt(sxx * syy)
