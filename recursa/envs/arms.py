"""Several parameterisations of one env behind one instance: the arms of a task curriculum.

With `curriculum.mode` on, every env of the run's pool is an `ArmsEnv`: it holds the env built
from `env.kwargs` (the base) and, built on first use, one env per arm (`env.kwargs` with the
arm's `kwargs` merged over them). Which one plays an episode is a pure function of the seed:

    train index i = raw * K + k   ->   arm k, whose env resets to split_seed("train", raw)
    a gate or test seed           ->   the base env, with the seed unchanged

so an item is still a pure function of its seed (in this process or a Ray worker), held-out
evaluation and the gate play exactly the items they play without a curriculum, and every part
of a recipe that reads a training task (rollouts, hints, references, replays) reads the arm's
task without knowing about arms. `arm_seed(k, raw, K)` is the seed of arm k's item `raw`
(raw < 1e7, so K <= 100 arms fit in the train split).

Everything else (name, task, max_steps, admissible_actions, walkthrough, reference, parse,
state_key, system_prompt, ...) is the attribute of the env that played the last reset (the
base before any). Each arm's env is built once per instance, when a seed first routes to it:
a pool of N instances builds at most N x (K + 1) games (for TextWorldExpress, a JVM each).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from recursa.envs.base import SPLIT_SIZE, env_factory, split_seed

__all__ = ["ARM_ITEMS", "ArmsEnv", "arm_of", "arm_seed", "arms_factory", "route"]

ARM_ITEMS = 10_000_000  # raw item indices per arm


def arm_seed(arm: int, raw: int, n_arms: int) -> int:
    """The training seed of arm `arm`'s item `raw` among `n_arms` arms."""
    if not 0 <= arm < n_arms:
        raise ValueError(f"arm must be in [0, {n_arms}), got {arm}")
    if not 0 <= raw < ARM_ITEMS:
        raise ValueError(f"raw must be in [0, {ARM_ITEMS}), got {raw}")
    return split_seed("train", raw * n_arms + arm)


def route(seed: int, n_arms: int) -> tuple[int | None, int]:
    """(the arm, the seed its env resets to) for a training seed; (None, seed) for any other."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SPLIT_SIZE:
        return None, seed
    return seed % n_arms, split_seed("train", seed // n_arms)


def arm_of(seed: int, n_arms: int) -> int | None:
    """The arm a seed's task comes from (None: a held-out seed, played by the base env)."""
    return route(seed, n_arms)[0]


class ArmsEnv:
    """One env slot with a base env and one env per arm (see the module doc)."""

    def __init__(self, base: Callable[[], Any], arms: list[Callable[[], Any]]):
        if not arms:
            raise ValueError("ArmsEnv needs at least one arm")
        object.__setattr__(self, "_arm_factories", list(arms))
        object.__setattr__(self, "_arm_envs", [None] * len(arms))
        object.__setattr__(self, "_base", base())
        object.__setattr__(self, "_current", self._base)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_current"), name)

    @property
    def n_arms(self) -> int:
        return len(self._arm_factories)

    def env_for(self, seed: int) -> tuple[Any, int]:
        """(the env that plays `seed`, the seed it resets to), building the arm's env on first use."""
        arm, inner = route(seed, self.n_arms)
        if arm is None:
            return self._base, inner
        if self._arm_envs[arm] is None:
            self._arm_envs[arm] = self._arm_factories[arm]()
        return self._arm_envs[arm], inner

    def reset(self, seed: int) -> str:
        env, inner = self.env_for(seed)
        object.__setattr__(self, "_current", env)
        return env.reset(inner)

    def step(self, action_text: str):
        return self._current.step(action_text)

    def close(self) -> None:
        for env in [self._base, *self._arm_envs]:
            close = getattr(env, "close", None) if env is not None else None
            if callable(close):
                close()


def arms_factory(spec: str, kwargs: dict, arm_kwargs: list[dict]) -> Callable[[], ArmsEnv]:
    """A picklable zero-argument factory of `ArmsEnv`s for `make_env(spec, ...)`: the base with
    `kwargs`, arm k with `{**kwargs, **arm_kwargs[k]}`."""
    return functools.partial(ArmsEnv, env_factory(spec, **kwargs), [env_factory(spec, **{**kwargs, **a}) for a in arm_kwargs])
