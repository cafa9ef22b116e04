"""Advantages of branching rollouts (`rollout.branch`; the sampling side is `recursa/branching.py`).

A step samples B task groups of G episodes ("roots"). From S source episodes of each group
(its first S: the G episodes are exchangeable) one turn t is chosen, the game is reset and
the source's first t actions replayed (the games are deterministic), and K continuations are
sampled from turn t on. The source's own turns from t and the K continuations are K + 1
independent plays from the same state: a *branch group*.

Choosing the branch turn t of a source episode with n turns:

    random   t uniform in {1, ..., n - 1} (a branch shares at least one turn); t = 0 when n = 1
    last     t = max(0, n - last): the continuations re-decide the last `last` turns
    doubt    t = argmin_u  mean_k log pi(a_{u,k})  over the turns u whose reply has tokens:
             the turn whose sampled action the policy itself found least likely per token
             (the sampler's log-probs; earliest on ties, 0 when no turn has tokens)

Every episode, root or continuation, is a whole game of its seed (the continuations' returns
include the replayed turns' rewards), so two advantages apply:

* the episode advantage A_E: the outcome estimator (`algo.advantage`) over the *extended
  group* of the seed, its G roots and its S x K continuations, ``(B, G + S K)``. As in
  Tree-GRPO's inter-tree advantage, every complete play of the seed is compared with the
  others.
* the branch advantage A_B: the same estimator within each branch group, ``(B, S, K + 1)``,
  index 0 the source, 1..K its continuations. Every member of a branch group shares the
  prefix, so its reward differences come from the turns after it (intra-tree advantage,
  as in Tree-GRPO, BranPO and reset-based RRPO).

The advantage of a sampled turn u of episode e is

    A(e, u) = A_E(e) + w * A_B(e) * [u >= t(e)]

where t(e) is the branch turn of a source or a continuation, and A_B(e) = 0 for a root that is
no source. A continuation's replayed turns (u < t) are not rows at all: the shared prefix is
trained once, in its source episode, with that episode's A_E only, never again for each
continuation. Departure: Tree-GRPO trains every leaf's whole path (prefix tokens once per
leaf); here prefix tokens appear once, and only the turns whose futures were compared get
the branch term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MODES = ("random", "last", "doubt")


def mean_logprob(logprobs: list[float]) -> float:
    """Mean of a reply's per-token log-probs (0.0 for a reply with no tokens)."""
    return sum(logprobs) / len(logprobs) if logprobs else 0.0


def doubt_turn(turn_logprobs: list[list[float]]) -> int:
    """The turn whose sampled reply has the lowest mean token log-prob (earliest on ties);
    turns without tokens are skipped, and 0 is returned when no turn has tokens."""
    best, best_value = 0, float("inf")
    for u, logprobs in enumerate(turn_logprobs):
        if logprobs and mean_logprob(logprobs) < best_value:
            best, best_value = u, mean_logprob(logprobs)
    return best


def branch_turn(turn_logprobs: list[list[float]], mode: str, last: int, generator: torch.Generator) -> int:
    """The branch turn t of a source episode (one log-prob list per turn), by `mode`; 'random'
    draws one integer from `generator` whenever the episode has two turns or more."""
    n = len(turn_logprobs)
    if n == 0:
        raise ValueError("an episode without turns cannot be branched")
    if mode == "random":
        return 1 + int(torch.randint(n - 1, (1,), generator=generator, device="cpu")) if n > 1 else 0
    if mode == "last":
        if last < 1:
            raise ValueError(f"last must be >= 1, got {last}")
        return max(0, n - last)
    if mode == "doubt":
        return doubt_turn(turn_logprobs)
    raise ValueError(f"unknown branch mode {mode!r}; choose one of {MODES}")


@dataclass
class BranchAdvantages:
    episode: torch.Tensor  # (B, G + S K) A_E over the extended group: the G roots, then source s's K continuations at G + s K + j
    branch: torch.Tensor  # (B, S, K + 1) A_B within each branch group: [.., 0] the source, [.., 1 + j] continuation j


def branch_advantages(estimator: Callable[[torch.Tensor], torch.Tensor], rewards: torch.Tensor, continuations: torch.Tensor) -> BranchAdvantages:
    """A_E and A_B (module doc) from the roots' returns `rewards  # (B, G)` and the
    continuations' `continuations  # (B, S, K)`, the sources being roots 0..S-1 of each group.
    `estimator` maps (N, M) returns to (N, M) advantages (e.g. `advantages.grpo`)."""
    if rewards.dim() != 2 or continuations.dim() != 3 or continuations.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards must be (B, G) and continuations (B, S, K), got {tuple(rewards.shape)} and {tuple(continuations.shape)}")
    B, G = rewards.shape
    _, S, K = continuations.shape
    if S > G:
        raise ValueError(f"{S} sources per group but only {G} episodes")
    extended = torch.cat([rewards, continuations.reshape(B, S * K)], dim=1)  # (B, G + S K)
    groups = torch.cat([rewards[:, :S].unsqueeze(-1), continuations], dim=2)  # (B, S, K + 1)
    inner = estimator(groups.reshape(B * S, K + 1)).reshape(B, S, K + 1)
    return BranchAdvantages(estimator(extended), inner)


def turn_advantages(adv: BranchAdvantages, root_turns: list[int], source_turns: list[list[int]], continuation_turns: list[int],
                    weight: float) -> tuple[list[float], list[list[float]]]:
    """Per episode A_E, and per sampled turn the branch term w A_B [u >= t], for the roots
    (b G + g, `root_turns` turns each) followed by the continuations ((b S + s) K + j,
    `continuation_turns` sampled turns each, all from the branch turn on); `source_turns[b][s]`
    is the branch turn t of source s of group b. Returns (A_E per episode, terms per turn)."""
    B, width = adv.episode.shape
    _, S, K1 = adv.branch.shape
    K = K1 - 1
    G = width - S * K
    if len(root_turns) != B * G or len(continuation_turns) != B * S * K or len(source_turns) != B or any(len(t) != S for t in source_turns):
        raise ValueError("root_turns, source_turns and continuation_turns must match the advantages' (B, G, S, K)")
    outer, terms = [], []
    for b in range(B):
        for g in range(G):
            outer.append(float(adv.episode[b, g]))
            n = root_turns[b * G + g]
            if g < S:
                t, a = source_turns[b][g], weight * float(adv.branch[b, g, 0])
                terms.append([a if u >= t else 0.0 for u in range(n)])
            else:
                terms.append([0.0] * n)
    for b in range(B):
        for s in range(S):
            for j in range(K):
                outer.append(float(adv.episode[b, G + s * K + j]))
                terms.append([weight * float(adv.branch[b, s, 1 + j])] * continuation_turns[(b * S + s) * K + j])
    return outer, terms
