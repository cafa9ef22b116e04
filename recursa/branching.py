"""Branching rollouts for multi-turn games (`rollout.branch`, GRPO).

    episodes  <- B x G root episodes (the step's rollout, unchanged)
    points    <- per group, its first `branch_sources` episodes, each with a branch turn t
                 (random | last | doubt: `recursa.algorithms.branching.branch_turn`)
    branches  <- per point, `branch_k` continuations: reset(seed), replay the source's first t
                 actions (`rollout_episodes(prefixes=...)`, no sampling), then sample from turn t on
    check     <- every replayed turn saw what the source saw (else the game is not deterministic)

A branch is a reset plus a replay, not a saved game state: this needs nothing from an env but
`reset(seed)` and `step(action)`, works the same in a Ray worker, and needs the game to be
deterministic, a pure function of the seed and the actions (recursa's own games are; a
TextWorldExpress or TextWorld game given the same seed is too). The Env protocol has no flag
that says so, so the replay is checked: every replayed observation and reward must equal the
source's, and the first sampled turn must start from the source's observation at turn t;
otherwise the step stops with a one-line error. A game that crashed or hung while replaying
(`envs.supervise`) is exempt: its episode fails as any crashed episode does.

The continuations sample through the recipe's rollout backend, so they use the step's random
streams (reproducible: every draw comes from the step generator) and shard across Ray workers
like other episodes. The K continuations of a point (and the source's turn t) share their
first prompt, which the update's shared-prefix pass (`train.shared_prefix`) and continuous
batching's prefix cache compute once. The advantage math is in
`recursa/algorithms/branching.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from recursa.algorithms.branching import BranchAdvantages, branch_advantages, branch_turn, turn_advantages
from recursa.errors import UserError
from recursa.generation import GenerationStats
from recursa.trajectory import Episode

_CRASHED = ("crashed", "timeout")  # a supervised game that failed (recursa.envs.supervise)


@dataclass(frozen=True)
class BranchPoint:
    group: int  # the task group b
    source: int  # the source episode's index among the step's episodes (b G + s)
    seed: int
    turn: int  # t: the continuations sample turn t onward
    prefix: tuple[str, ...]  # the source's actions of turns 0..t-1, replayed


@dataclass
class Branches:
    points: list[BranchPoint]  # b-major: point p = b S + s
    episodes: list[Episode]  # point p's K continuations at [p K, (p + 1) K); `group` is the task group b
    stats: GenerationStats


def branch_points(episodes: list[Episode], group_size: int, sources: int, mode: str, last: int, generator: torch.Generator) -> list[BranchPoint]:
    """One branch point for each of the first `sources` episodes of every group of
    `group_size` (episodes grouped b-major, as a rollout returns them)."""
    if len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} episodes do not form groups of {group_size}")
    points = []
    for b in range(len(episodes) // group_size):
        for s in range(sources):
            e = b * group_size + s
            source = episodes[e]
            t = branch_turn([turn.action_logprobs for turn in source.turns], mode, last, generator)
            points.append(BranchPoint(b, e, source.seed, t, tuple(turn.action for turn in source.turns[:t])))
    return points


def sample_branches(rollouts, episodes: list[Episode], group_size: int, sampling, generator: torch.Generator, system_prompt: str | None,
                    agent, rc) -> Branches:
    """The branch points of `episodes` (`rc`: the [rollout] section) and their `rc.branch_k`
    continuations each, played by `rollouts` (a rollout backend) and checked against their
    sources (`check_replay`)."""
    points = branch_points(episodes, group_size, rc.branch_sources, rc.branch, rc.branch_last, generator)
    k = rc.branch_k
    played = rollouts.episodes([p.seed for p in points], k, sampling, generator, system_prompt, agent, prefixes=[list(p.prefix) for p in points])
    continuations = [dataclasses.replace(e, group=points[i // k].group) for i, e in enumerate(played.episodes)]
    check_replay(episodes, points, continuations, k)
    return Branches(points, continuations, played.stats)


def check_replay(episodes: list[Episode], points: list[BranchPoint], continuations: list[Episode], k: int) -> None:
    """A one-line `UserError` unless each continuation's replayed turns saw the observations and
    rewards of its source's first t turns and its first sampled turn starts from the source's
    observation at turn t (crashed or hung games excepted)."""
    if len(continuations) != len(points) * k:
        raise ValueError(f"expected {len(points) * k} continuations for {len(points)} points, got {len(continuations)}")
    for i, cont in enumerate(continuations):
        point = points[i // k]
        if cont.finish_reason in _CRASHED:
            continue
        source = episodes[point.source]
        bad = None
        for u in range(point.turn + 1):
            if u >= len(cont.turns):
                bad = f"it ended after {len(cont.turns)} of the {point.turn} replayed actions"
            elif cont.turns[u].observation != source.turns[u].observation:
                bad = f"turn {u}'s observation differs"
            elif u < point.turn and cont.turns[u].reward != source.turns[u].reward:
                bad = f"turn {u}'s reward differs ({cont.turns[u].reward} vs {source.turns[u].reward})"
            if bad:
                break
        if bad:
            raise UserError(
                f"rollout.branch: replaying the first {point.turn} actions of a game of {cont.env!r} (seed {point.seed}) did not reproduce it "
                f"({bad}); branching needs games whose reset(seed) and step(action) are deterministic: set rollout.branch = 'off' for this env"
            )


def branch_metrics(branches: Branches, adv: BranchAdvantages) -> dict[str, float]:
    """branch/*: branch points, continuations, their mean branch turn and win rate, and the
    share of branch groups whose branch advantage is not all zero."""
    n = len(branches.points)
    inner = adv.branch.reshape(n, -1)  # (points, K + 1)
    return {
        "branch/branches": float(n),
        "branch/episodes": float(len(branches.episodes)),
        "branch/turn_mean": sum(p.turn for p in branches.points) / max(n, 1),
        "branch/success_rate": sum(e.won for e in branches.episodes) / max(len(branches.episodes), 1),
        "branch/nonzero_frac": (inner != 0).any(dim=1).float().mean().item() if n else float("nan"),
    }


def branched_advantages(branches: Branches, episodes: list[Episode], rewards: torch.Tensor, continued: torch.Tensor, estimator,
                    weight: float) -> tuple[BranchAdvantages, list[float], list[list[float]]]:
    """The step's advantages with branches: A_E and A_B from the roots' returns `rewards  # (B, G)`
    and the continuations' `continued  # (B, S, K)`, and for `episodes + branches.episodes`
    each episode's A_E and each sampled turn's branch term (`algorithms.branching.turn_advantages`)."""
    B, S, K = continued.shape
    adv = branch_advantages(estimator, rewards, continued)
    source_turns = [[p.turn for p in branches.points[b * S : (b + 1) * S]] for b in range(B)]
    sampled = [max(0, len(e.turns) - (e.branch_turn or 0)) for e in branches.episodes]
    outer, terms = turn_advantages(adv, [len(e.turns) for e in episodes], source_turns, sampled, weight)
    return adv, outer, terms
