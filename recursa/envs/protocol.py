"""The environment protocol: what an env is (`Env`, `AgentEnv`, `StepResult`), the seed
splits that keep training off the held-out items, and the matching of a typed action to a
game's admissible ones. The bottom of the envs package: every adapter (arithmetic,
household, reasoning-gym, TextWorldExpress, TextWorld) and the env supervision build on it,
and it imports none of them (the registry and the env pool are in `recursa.envs.base`).

Seeds are split into disjoint ranges so training never sees a held-out item:

    train: [0, 1e9)      gate: [1e9, 2e9)      test: [2e9, 3e9)

`split_seed("gate", 5)` is the sixth gate item; `split_of(seed)` recovers the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from recursa.errors import UserError
from recursa.registry import one_line  # noqa: F401  (re-exported for the adapters)


@dataclass
class StepResult:
    """What one `Env.step` returns.

    `info` always holds: success (bool), answer (str, the reference answer), parsed
    (str | None, what was read from the reply), note (str, "" unless something went wrong).
    """

    obs: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """A (possibly multi-turn) text environment.

    Implementations may also set `system_prompt: str | None`, the system message the
    rollout should use (None: the rollout's short default); read it with
    `system_prompt_of(env)`. Single-turn tasks end on the first step (done=True). A
    single-turn env may offer `reference() -> str | None`, a reply that solves the item
    just reset (SFT's demonstrations; `recursa.demos` checks that it scores), and
    `parse(reply) -> str | None`, the answer it reads in a reply whatever the current item
    (what the self-consistency reward votes on, `recursa.self_rewards`).
    """

    name: str

    def reset(self, seed: int) -> str:
        """Start the episode for `seed`; return the first observation."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply the model's reply; return the next observation, reward and done flag."""
        ...


@runtime_checkable
class AgentEnv(Env, Protocol):
    """A multi-turn text game (TextWorldExpress, TextWorld, the built-in household).

    Contract, beyond `Env`:

    * `reset(seed)` returns the first observation and sets `task`, one line stating the
      goal (the prompt keeps it even when history is truncated).
    * `step(action)` takes one action string. An action that is not admissible (when the
      game lists admissible actions) leaves the game state unchanged, returns reward
      `-invalid_penalty` and info["invalid"] = True. After `max_steps` steps the episode
      ends with done = True and won = False.
    * `StepResult.info` always holds: won (bool), success (bool, = won), invalid (bool),
      admissible (list[str] | None, the actions admissible in the new state), steps (int,
      steps taken so far), score (float, the game's own score when it has one).
    * `admissible_actions()` lists the actions admissible now (None when the game has no
      such list); `walkthrough()` returns a list of actions that wins from the state right
      after `reset` (the oracle; None when the game cannot provide one).
    * Optional: `state_key()` returns a string that names the current game state; the
      rollout uses it as GiGPO's anchor (two turns taken from equal keys are grouped).
      Without it, the observation text the policy acted on is the anchor.
    * Branching rollouts (`rollout.branch`, `recursa.branching`) assume the game is
      deterministic: `reset(seed)` followed by the same actions gives the same observations
      and rewards. A branch replays a sampled episode's first actions that way, and a replay
      that differs stops the run with a one-line error.
    """

    task: str
    max_steps: int
    invalid_penalty: float

    def admissible_actions(self) -> list[str] | None:
        ...

    def walkthrough(self) -> list[str] | None:
        ...


def system_prompt_of(env: Any) -> str | None:
    """The env's `system_prompt` attribute, or None when it has none."""
    value = getattr(env, "system_prompt", None)
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------------------- seed splits

SPLITS: tuple[str, ...] = ("train", "gate", "test")
SPLIT_SIZE = 1_000_000_000
_SPLIT_BASE = {name: i * SPLIT_SIZE for i, name in enumerate(SPLITS)}


def _check_split(split: str) -> int:
    if split not in _SPLIT_BASE:
        raise UserError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    return _SPLIT_BASE[split]


def split_seed(split: str, index: int) -> int:
    """The seed of item `index` of `split` (train: index, gate: 1e9 + index, test: 2e9 + index)."""
    base = _check_split(split)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < SPLIT_SIZE:
        raise UserError(f"split index must be an int in [0, {SPLIT_SIZE}), got {index!r}")
    return base + index


def split_seeds(split: str, n: int, start: int = 0) -> list[int]:
    """Seeds of items start .. start+n-1 of `split`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise UserError(f"number of seeds must be a non-negative int, got {n!r}")
    if n == 0:
        _check_split(split)
        return []
    first = split_seed(split, start)
    split_seed(split, start + n - 1)  # validates the end of the range
    return list(range(first, first + n))


def split_of(seed: int) -> str:
    """The split a seed belongs to (the inverse of `split_seed`)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < len(SPLITS) * SPLIT_SIZE:
        raise UserError(
            f"seed {seed!r} is outside every split; seeds are ints in [0, {len(SPLITS) * SPLIT_SIZE})"
        )
    return SPLITS[seed // SPLIT_SIZE]


def is_agent_env(env: Env) -> bool:
    """Multi-turn games expose admissible actions and a walkthrough (see `AgentEnv`)."""
    return hasattr(env, "admissible_actions") and hasattr(env, "walkthrough")


def answer_extractor(env) -> Callable[[str], str | None] | None:
    """The env's answer extraction, `parse(reply) -> str | None` (arithmetic, reasoning-gym,
    a [data] task with scorer 'exact' or 'last_number', your env if it has one), or None."""
    fn = getattr(env, "parse", None)
    return fn if callable(fn) else None


def normalize_action(action: str) -> str:
    """Lower-case and collapse whitespace: how adapters compare an action to the list."""
    return " ".join(str(action).lower().split())


def match_admissible(action: str, admissible: list[str] | None) -> str | None:
    """The admissible action equal to `action` after `normalize_action`, else None."""
    wanted = normalize_action(action)
    for candidate in admissible or []:
        if normalize_action(candidate) == wanted:
            return candidate
    return None


_ENV_METHODS = ("reset", "step")
_AGENT_METHODS = ("admissible_actions", "walkthrough")


def protocol_gaps(env: Any) -> list[str]:
    """What `env` lacks to follow `Env` (name, reset(seed), step(action_text)); [] when
    nothing. An env that has some of `AgentEnv`'s members must have all of them."""
    gaps = [f"{m}()" for m in _ENV_METHODS if not callable(getattr(env, m, None))]
    if not isinstance(getattr(env, "name", None), str):
        gaps.append("a str attribute 'name'")
    agentish = [m for m in _AGENT_METHODS if callable(getattr(env, m, None))]
    if agentish:
        gaps += [f"{m}() (AgentEnv)" for m in _AGENT_METHODS if m not in agentish]
        gaps += [f"attribute {a!r} (AgentEnv)" for a in ("max_steps", "invalid_penalty") if not hasattr(env, a)]
    return gaps
