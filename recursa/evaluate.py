"""Held-out evaluation with confidence intervals.

Greedy decoding on the first `n` seeds of a held-out split (never the training range).
Success rates get a Wilson interval, mean rewards a seeded percentile bootstrap. Two
evaluations on the same items are compared with the exact McNemar test
(`recursa.stats.paired_compare`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from recursa.envs.base import Env, split_seeds
from recursa.generation import SamplingParams
from recursa.models import Policy
from recursa.rollout import rollout
from recursa.stats import bootstrap_mean_ci, wilson_interval


@dataclass
class EvalItem:
    seed: int
    reward: float
    success: bool
    completion: str = ""


@dataclass
class EvalResult:
    env: str
    split: str
    n: int
    mean_reward: float
    success_rate: float
    ci95: tuple[float, float]
    mean_reward_ci95: tuple[float, float]
    items: list[EvalItem] = field(default_factory=list)
    label: str = ""
    model: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        d["mean_reward_ci95"] = list(self.mean_reward_ci95)
        return d

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "EvalResult":
        d = json.loads(Path(path).read_text())
        d["items"] = [EvalItem(**i) for i in d.get("items", [])]
        d["ci95"] = tuple(d["ci95"])
        d["mean_reward_ci95"] = tuple(d.get("mean_reward_ci95", (float("nan"), float("nan"))))
        return cls(**d)


def evaluate(
    policy: Policy,
    make_env: Callable[[], Env],
    env_name: str,
    split: str,
    n: int,
    max_new_tokens: int,
    system_prompt: str | None,
    batch_size: int = 64,
    stop: tuple[str, ...] = (),
    label: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Greedy evaluation on the first `n` seeds of `split`."""
    seeds = split_seeds(split, n)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    items: list[EvalItem] = []
    start = time.perf_counter()
    for lo in range(0, n, batch_size):
        chunk = seeds[lo : lo + batch_size]
        result = rollout(policy, make_env, chunk, 1, params, None, system_prompt)
        items.extend(EvalItem(t.seed, t.reward, t.success, t.completion_text) for t in result.trajectories)
        if progress is not None:
            progress(len(items), n)
    successes = sum(i.success for i in items)
    rewards = [i.reward for i in items]
    return EvalResult(
        env=env_name,
        split=split,
        n=len(items),
        mean_reward=sum(rewards) / max(len(rewards), 1),
        success_rate=successes / max(len(items), 1),
        ci95=wilson_interval(successes, len(items)),
        mean_reward_ci95=bootstrap_mean_ci(rewards) if rewards else (0.0, 0.0),
        items=items,
        label=label,
        model=policy.name,
        seconds=time.perf_counter() - start,
    )

