"""Held-out evaluation with confidence intervals.

Greedy decoding on the first `n` seeds of a held-out split (never the training range).
Success rates get a Wilson interval; mean reward, mean steps and the invalid-action rate
get a seeded percentile bootstrap. Two evaluations on the same items are compared with
the exact McNemar test (`recursa.stats.paired_compare`).

Single-turn tasks play one step per item. Multi-turn games (`AgentEnv`) play whole
episodes, with the model (`evaluate`) or with a scripted baseline (`evaluate_scripted`):
`oracle` follows the game's walkthrough and must win every held-out game (a check of the
adapter), `random` picks an admissible action uniformly.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from recursa.agent import AgentConfig
from recursa.envs.base import Env, EnvPool, as_pool, split_of, split_seeds
from recursa.errors import UserError
from recursa.generation import SamplingParams
from recursa.models import Policy
from recursa.rollout import is_agent_env, rollout, rollout_episodes
from recursa.stats import bootstrap_mean_ci, wilson_interval


@dataclass
class EvalItem:
    seed: int
    reward: float
    success: bool
    completion: str = ""  # the reply (single-turn) or the actions taken, joined by " | "
    steps: int = 1
    invalid_rate: float = 0.0


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
    policy: str = "model"
    mean_steps: float = 1.0
    mean_steps_ci95: tuple[float, float] = (1.0, 1.0)
    invalid_rate: float = 0.0
    invalid_rate_ci95: tuple[float, float] = (0.0, 0.0)
    seconds: float = 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        for key in ("ci95", "mean_reward_ci95", "mean_steps_ci95", "invalid_rate_ci95"):
            d[key] = list(getattr(self, key))
        return d

    def save(self, path: Path) -> None:
        """Written atomically (temporary file, fsync, rename): a kill never leaves it torn."""
        from recursa.runio import atomic_write_json

        atomic_write_json(Path(path), self.to_json())

    @classmethod
    def load(cls, path: Path) -> "EvalResult":
        """An evaluation written by `save`; a missing, unreadable or malformed file is a
        UserError naming it."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: no such evaluation file; pass a JSON written by `recursa eval --json` or a run's eval/*.json")
        try:
            d = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise UserError(f"{path} is not valid JSON ({type(exc).__name__}): pass an evaluation written by `recursa eval --json`") from None
        if not isinstance(d, dict) or not isinstance(d.get("items"), list):
            raise UserError(f"{path} is not an evaluation (no list of items): pass a JSON written by `recursa eval --json`")
        try:
            result = cls._from_dict(d)
            for i in result.items:
                if isinstance(i.seed, bool) or not isinstance(i.seed, int) or not isinstance(i.success, bool):
                    raise ValueError(f"item {i.seed!r}: seed must be an integer and success true/false")
            return result
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise UserError(f"{path} is a malformed evaluation ({type(exc).__name__}: {str(exc)[:80]}): pass a JSON written by `recursa eval --json`") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "EvalResult":
        known = set(cls.__dataclass_fields__)
        d = {k: v for k, v in d.items() if k in known}
        d["items"] = [EvalItem(**{k: v for k, v in i.items() if k in EvalItem.__dataclass_fields__}) for i in d.get("items", [])]
        for key in ("ci95", "mean_reward_ci95", "mean_steps_ci95", "invalid_rate_ci95"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


def summarize(items: list[EvalItem], env: str, split: str, label: str, model: str, policy: str, seconds: float) -> EvalResult:
    """Rates and intervals over per-item results."""
    n = len(items)
    successes = sum(i.success for i in items)
    rewards = [i.reward for i in items]
    steps = [float(i.steps) for i in items]
    invalid = [i.invalid_rate for i in items]

    def ci(values):
        return bootstrap_mean_ci(values) if values else (0.0, 0.0)

    return EvalResult(
        env=env,
        split=split,
        n=n,
        mean_reward=sum(rewards) / max(n, 1),
        success_rate=successes / max(n, 1),
        ci95=wilson_interval(successes, n),
        mean_reward_ci95=ci(rewards),
        items=items,
        label=label,
        model=model,
        policy=policy,
        mean_steps=sum(steps) / max(n, 1),
        mean_steps_ci95=ci(steps),
        invalid_rate=sum(invalid) / max(n, 1),
        invalid_rate_ci95=ci(invalid),
        seconds=seconds,
    )


def evaluate(
    policy: Policy,
    envs: EnvPool | Callable[[], Env],
    env_name: str,
    split: str,
    n: int,
    max_new_tokens: int,
    system_prompt: str | None,
    batch_size: int = 64,
    stop: tuple[str, ...] = (),
    label: str = "",
    progress: Callable[[int, int], None] | None = None,
    agent: AgentConfig | None = None,
    seeds: list[int] | None = None,
    hints: list[str | None] | None = None,
    engine=None,
) -> EvalResult:
    """Greedy evaluation of the model on the first `n` seeds of `split` (or on `seeds`,
    which must then be `n` seeds of `split`: the gate scores fresh gate items each round).
    `hints`, one per seed (or None), are shown to the policy in its prompts (RSIPO's
    `skills.in_context`; see `recursa.rollout`). `engine` decodes (None: the native sampler;
    see `recursa.engines`), and must hold `policy`'s current weights."""
    if seeds is None:
        seeds = split_seeds(split, n)
    elif len(seeds) != n or any(split_of(s) != split for s in seeds):
        raise ValueError(f"evaluate: expected {n} seeds of the {split} split")
    if hints is not None and len(hints) != n:
        raise ValueError(f"evaluate: expected one hint (or None) per seed, got {len(hints)} for {n} seeds")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    pool = as_pool(envs)
    multi_turn = is_agent_env(pool.take(1)[0])
    items: list[EvalItem] = []
    start = time.perf_counter()
    played_from = pool.mark()
    for lo in range(0, n, batch_size):
        chunk = seeds[lo : lo + batch_size]
        chunk_hints = hints[lo : lo + batch_size] if hints is not None else None
        if multi_turn:
            result = rollout_episodes(policy, pool, chunk, 1, params, None, system_prompt, agent or AgentConfig(), hints=chunk_hints, engine=engine)
            items.extend(
                EvalItem(e.seed, e.total_reward, e.won, " | ".join(t.action for t in e.turns), len(e.turns), e.invalid_rate)
                for e in result.episodes
            )
        else:
            result = rollout(policy, pool, chunk, 1, params, None, system_prompt, hints=chunk_hints, engine=engine)
            items.extend(EvalItem(t.seed, t.reward, t.success, t.completion_text) for t in result.trajectories)
        if progress is not None:
            progress(len(items), n)
    pool.check_played(played_from, f"the evaluation {label!r}" if label else "the evaluation")  # no success rate of games that never ran
    return summarize(items, env_name, split, label, policy.name, "model", time.perf_counter() - start)


def evaluate_scripted(
    kind: str,
    envs: EnvPool | Callable[[], Env],
    env_name: str,
    split: str,
    n: int,
    seed: int = 0,
    label: str = "",
) -> EvalResult:
    """Play held-out games with a scripted policy: "oracle" (the walkthrough) or "random"
    (a uniformly random admissible action, from a generator seeded by `seed`)."""
    if kind not in ("oracle", "random"):
        raise UserError(f"unknown policy {kind!r}: choose model, random or oracle")
    env = as_pool(envs).take(1)[0]
    if not is_agent_env(env):
        raise UserError(f"--policy {kind} needs a multi-turn game with admissible actions; {env_name!r} is a single-turn task")
    rng = random.Random(seed)
    items = []
    start = time.perf_counter()
    for s in split_seeds(split, n):
        env.reset(s)
        plan = list(env.walkthrough() or []) if kind == "oracle" else None
        if kind == "oracle" and not plan:
            raise UserError(f"{env_name} has no walkthrough for seed {s}: the oracle baseline is not available for this game")
        admissible = env.admissible_actions()
        total, steps, invalid, won, actions = 0.0, 0, 0, False, []
        while True:
            if kind == "oracle":
                action = plan.pop(0) if plan else "look"
            else:
                action = rng.choice(admissible) if admissible else "look"
            result = env.step(action)
            actions.append(action)
            total += result.reward
            steps += 1
            invalid += bool(result.info.get("invalid", False))
            admissible = result.info.get("admissible", admissible)
            if result.done:
                won = bool(result.info.get("won", result.info.get("success", False)))
                break
        items.append(EvalItem(s, total, won, " | ".join(actions), steps, invalid / max(steps, 1)))
    return summarize(items, env_name, split, label or kind, kind, kind, time.perf_counter() - start)
