"""The rollout backend's parts that run anywhere: a request for one batch of rollouts, its
play on one policy and env pool, the split of groups over workers and the merge of their
results, and the in-process backend (`LocalRollouts`). The Ray backend
(`recursa.distributed.ray_rollout`) runs these same parts on its workers;
`recursa.distributed.rollouts.make_rollouts` picks one backend for a run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from recursa.agent import AgentConfig
from recursa.envs import EnvPool
from recursa.generation import GenerationStats, SamplingParams, generators_from, group_seeds
from recursa.models import Policy
from recursa.rollout import EpisodeRollout, RolloutResult, rollout, rollout_episodes


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout call without its random streams: G episodes of each seed's task."""

    seeds: list[int]
    group_size: int
    sampling: SamplingParams
    system_prompt: str | None
    agent: AgentConfig | None = None  # None: single-turn tasks (`rollout`); set: multi-turn games (`rollout_episodes`)
    hints: list[str | None] | None = None  # per seed (RSIPO's skills.in_context)
    prefixes: list[list[str]] | None = None  # per seed: actions replayed after reset (games; rollout.branch, recursa/branching.py)

    def shard(self, lo: int, hi: int) -> "RolloutRequest":
        """The request for seeds[lo:hi] (and their hints and prefixes)."""
        return dataclasses.replace(self, seeds=self.seeds[lo:hi], hints=None if self.hints is None else self.hints[lo:hi],
                                   prefixes=None if self.prefixes is None else self.prefixes[lo:hi])


Result = RolloutResult | EpisodeRollout


def play(policy: Policy, pool: EnvPool, request: RolloutRequest, generator, engine=None) -> Result:
    """Run `request` on `policy` and `pool` with `generator` (one generator, or one per seed).
    The single place where a backend, local or in a worker, calls the rollout functions: a
    rollout engine (`recursa.engines`, the `engine=` argument of both functions) is passed
    here, and made next to the policy it serves (`LocalRollouts.__init__`, `RolloutWorker.setup`)."""
    r = request
    if r.agent is None:
        return rollout(policy, pool, r.seeds, r.group_size, r.sampling, generator, r.system_prompt, hints=r.hints, engine=engine)
    return rollout_episodes(policy, pool, r.seeds, r.group_size, r.sampling, generator, r.system_prompt, r.agent, hints=r.hints, engine=engine,
                            prefixes=r.prefixes)


def shard_bounds(n_groups: int, n_workers: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [lo, hi) shards of n_groups groups over at most n_workers
    workers (no empty shard): 5 groups on 2 workers -> [(0, 2), (2, 5)]."""
    k = min(n_groups, n_workers)
    return [(w * n_groups // k, (w + 1) * n_groups // k) for w in range(k)]


def merge(parts: list[Result], offsets: list[int]) -> Result:
    """Concatenate shard results in order; group indices are shifted by each shard's first
    group (`offsets`), so the merge equals the unsplit call's result."""
    stats = GenerationStats()
    for p in parts:
        for f in dataclasses.fields(GenerationStats):
            setattr(stats, f.name, getattr(stats, f.name) + getattr(p.stats, f.name))
    if isinstance(parts[0], EpisodeRollout):
        episodes = [dataclasses.replace(e, group=e.group + off) for p, off in zip(parts, offsets) for e in p.episodes]
        return EpisodeRollout(episodes, stats, max(p.turns for p in parts))  # turns = batched calls = the longest episode
    trajectories = [dataclasses.replace(t, group=t.group + off) for p, off in zip(parts, offsets) for t in p.trajectories]
    return RolloutResult(trajectories, stats)


class RolloutBackend(Protocol):
    name: str

    def rollout(self, seeds: list[int], group_size: int, sampling: SamplingParams, generator: torch.Generator, system_prompt: str | None,
                hints: list[str | None] | None = None) -> RolloutResult:
        """`group_size` single-turn episodes per seed, grouped (as `recursa.rollout.rollout`)."""
        ...

    def episodes(self, seeds: list[int], group_size: int, sampling: SamplingParams, generator: torch.Generator, system_prompt: str | None,
                 agent: AgentConfig, hints: list[str | None] | None = None, prefixes: list[list[str]] | None = None) -> EpisodeRollout:
        """`group_size` game episodes per seed, grouped (as `recursa.rollout.rollout_episodes`); with
        `prefixes`, each seed's episodes first replay its action prefix (branching)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Metrics of the last call for the step's metrics line (distributed/*, time/*)."""
        ...

    def close(self) -> None:
        ...


class LocalRollouts:
    """Rollouts in this process, on the recipe's policy and env pool (`distributed.backend = "none"`)."""

    name = "local"

    def __init__(self, policy: Policy, pool: EnvPool, streams: str = "step", engine=None):
        if streams not in ("step", "group"):
            raise ValueError(f"streams must be 'step' or 'group', got {streams!r}")
        self.policy, self.pool, self.streams, self.engine = policy, pool, streams, engine

    def _call(self, request: RolloutRequest, generator: torch.Generator) -> Result:
        if self.streams == "group":
            generator = generators_from(group_seeds(generator, len(request.seeds)))
        return play(self.policy, self.pool, request, generator, self.engine)

    def rollout(self, seeds, group_size, sampling, generator, system_prompt, hints=None) -> RolloutResult:
        return self._call(RolloutRequest(list(seeds), group_size, sampling, system_prompt, None, hints), generator)

    def episodes(self, seeds, group_size, sampling, generator, system_prompt, agent, hints=None, prefixes=None) -> EpisodeRollout:
        return self._call(RolloutRequest(list(seeds), group_size, sampling, system_prompt, agent, hints, prefixes), generator)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
