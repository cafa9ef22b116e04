"""The environment protocol, seed splits, the env registry and answer-extraction helpers.

An environment hands out one episode per integer seed: `reset(seed)` returns the first
observation (for single-turn tasks, the user message) and `step(action_text)` scores the
model's reply. An item is a pure function of the env's configuration and the seed, so a
seed names a task item forever.

Seeds are split into disjoint ranges so training never sees a held-out item:

    train: [0, 1e9)      gate: [1e9, 2e9)      test: [2e9, 3e9)

`split_seed("gate", 5)` is the sixth gate item; `split_of(seed)` recovers the split.

Specs understood by `make_env`:

    arithmetic            the built-in arithmetic env (recursa.envs.arithmetic)
    rg:<dataset>          a reasoning-gym dataset, e.g. rg:basic_arithmetic
    twx:<game>            a TextWorldExpress game, e.g. twx:coin (recursa.envs.twx)
    textworld:<generator> a generated TextWorld game, e.g. textworld:cooking (recursa.envs.textworld_env)
    pkg.module:factory    your own env: `factory(**kwargs)` returns an object following `Env`
                          or `AgentEnv` (imported by module path, so it works in Ray workers)
    <name>                an env registered by an installed package under the `recursa.envs`
                          entry-point group, or in this process with `register_env`
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Protocol, runtime_checkable

from recursa.errors import UserError

__all__ = [
    "SPLITS",
    "SPLIT_SIZE",
    "AgentEnv",
    "Env",
    "EnvPool",
    "StepResult",
    "check_env",
    "env_factory",
    "extract_answer",
    "resolve_factory",
    "last_number",
    "list_envs",
    "list_reasoning_gym_datasets",
    "make_env",
    "split_of",
    "split_seed",
    "split_seeds",
    "system_prompt_of",
]


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


# ------------------------------------------------------------------------- answer parsing

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A number: optional minus (not when glued to a preceding word/digit, so "5-3" reads 3),
# then thousands-grouped digits or plain digits, then an optional decimal part.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])|(?:(?<![\w.])-)?\.\d+")


def extract_answer(text: str) -> str | None:
    """The stripped content of the last <answer>...</answer> tag in `text`, or None."""
    matches = _ANSWER_TAG.findall(text or "")
    return matches[-1].strip() if matches else None


def normalise_number(text: str) -> str | None:
    """Canonical form of a number string ("1,000" -> "1000", "-0" -> "0", "2.50" -> "2.5")."""
    cleaned = text.strip().replace(",", "")
    if cleaned.startswith("+"):
        cleaned = cleaned[1:]
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == 0:
        return "0"
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def last_number(text: str) -> str | None:
    """The last integer or decimal in `text`, normalised (see `normalise_number`), or None."""
    matches = _NUMBER.findall(text or "")
    for match in reversed(matches):
        value = normalise_number(match)
        if value is not None:
            return value
    return None


def one_line(text: str) -> str:
    """Collapse all whitespace to single spaces (task lines, observations in logs)."""
    return " ".join(str(text).split())


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


class EnvPool:
    """Env instances kept for reuse across rollouts. Some adapters are costly to create
    (a TextWorldExpress adapter starts a JVM), so a run creates each instance once and
    resets it for every new episode. `take(n)` returns n distinct instances.

    With `supervision` (recursa.envs.supervise), each instance is a `SupervisedEnv`: a game
    that crashes or hangs is restarted and its episode fails; `restarts` counts them and
    `metrics()` reports the count since the last call as env/restarts."""

    def __init__(self, factory: Callable[[], "Env"], supervision=None):
        self.factory = factory
        self.envs: list[Env] = []
        self.supervision = supervision
        self.restarts = 0
        self.failures: list[str] = []  # what each restart was for, oldest first
        self._reported = 0

    def take(self, n: int) -> list["Env"]:
        while len(self.envs) < n:
            if self.supervision is not None:
                from recursa.envs.supervise import SupervisedEnv

                self.envs.append(SupervisedEnv(self.factory, self, self.supervision))
            else:
                self.envs.append(self.factory())
        return self.envs[:n]

    def metrics(self) -> dict[str, float]:
        """{"env/restarts": games restarted since the last call} (supervised pools; else {})."""
        if self.supervision is None:
            return {}
        new, self._reported = self.restarts - self._reported, self.restarts
        return {"env/restarts": float(new)}

    def close(self) -> None:
        for env in self.envs:
            close = getattr(env, "close", None)
            if callable(close):
                close()
        self.envs = []


def as_pool(envs: "EnvPool | Callable[[], Env]") -> EnvPool:
    return envs if isinstance(envs, EnvPool) else EnvPool(envs)


# ------------------------------------------------------------------------------- registry

_BUILTINS: dict[str, str] = {
    "arithmetic": "built-in arithmetic; kwargs: difficulty=0..4, answer_format=last_number|tag|exact",
    "household": "ALFWorld-style home, multi-turn; kwargs: rooms, objects_per_room, distractors, tasks, max_steps",
}
_RG_PREFIX = "rg:"
_TWX_PREFIX = "twx:"
_TW_PREFIX = "textworld:"
_PREFIXES = (_RG_PREFIX, _TWX_PREFIX, _TW_PREFIX)
_CUSTOM: dict[str, tuple[Callable[..., "Env"], str]] = {}


ENTRY_POINT_GROUP = "recursa.envs"
_FACTORY_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_factory_spec(spec: str) -> bool:
    """Whether `spec` names a factory by import path, 'pkg.module:attr' (and not a built-in
    family such as 'rg:<dataset>')."""
    return isinstance(spec, str) and not spec.startswith(_PREFIXES) and bool(_FACTORY_SPEC.match(spec.strip()))


def entry_point_envs() -> dict[str, str]:
    """name -> 'pkg.module:attr' of every env an installed package registers under the
    `recursa.envs` entry-point group (pyproject: [project.entry-points."recursa.envs"])."""
    from importlib.metadata import entry_points

    out: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, ep.value)
    return out


def import_object(target: str, what: str):
    """The object 'pkg.module:attr' names; a one-line `UserError` naming `what` when the
    module cannot be imported or lacks the attribute."""
    import importlib

    module_name, _, attr = target.strip().partition(":")
    if not module_name or not attr:
        raise UserError(f"{what} = {target!r}: expected 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{what} = {target!r}: cannot import module {module_name!r} ({one_line(exc)}); install the package or put it on PYTHONPATH") from None
    except Exception as exc:  # the module's own code failed while importing
        raise UserError(f"{what} = {target!r}: importing {module_name!r} failed: {type(exc).__name__}: {one_line(exc)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{what} = {target!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_factory(spec: str) -> Callable[..., "Env"] | None:
    """The user factory `spec` names, or None for a built-in spec: an in-process registration
    (`register_env`), a 'pkg.module:attr' path, or an entry point of the `recursa.envs` group."""
    spec = spec.strip()
    if spec in _CUSTOM:
        return _CUSTOM[spec][0]
    if is_factory_spec(spec):
        factory = import_object(spec, "env.name")
    elif spec in _BUILTINS or spec.startswith(_PREFIXES):
        return None
    else:
        target = entry_point_envs().get(spec)
        if target is None:
            return None
        factory = import_object(target, f"env.name = {spec!r}: entry point")
    if not callable(factory):
        raise UserError(f"env.name = {spec!r} names a {type(factory).__name__} object, not a function or class that builds an env")
    return factory


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


def check_env(spec: str, kwargs: dict | None = None) -> None:
    """Config-load check of a user env spec ('pkg.module:attr' or an entry-point name): the
    factory imports, builds an env with `kwargs`, and the env follows the protocol; else a
    one-line `UserError` naming what is missing. Built-in and in-process specs are left to
    `make_env`."""
    if not isinstance(spec, str) or spec.strip() in _CUSTOM:
        return
    factory = resolve_factory(spec)
    if factory is None:
        return
    env = _build(spec, factory, kwargs or {})
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _build(spec: str, factory: Callable[..., "Env"], kwargs: dict) -> "Env":
    try:
        env = factory(**kwargs)
    except UserError:
        raise
    except TypeError as exc:
        if kwargs:
            raise UserError(f"env.name = {spec!r}: the factory does not accept env.kwargs {sorted(kwargs)} ({one_line(exc)})") from None
        raise UserError(f"env.name = {spec!r}: the factory raised TypeError: {one_line(exc)}") from None
    except Exception as exc:
        raise UserError(f"env.name = {spec!r}: the factory raised {type(exc).__name__}: {one_line(exc)}") from None
    gaps = protocol_gaps(env)
    if gaps:
        raise UserError(
            f"env.name = {spec!r} built a {type(env).__name__} that does not follow recursa's Env protocol: it lacks {', '.join(gaps)} "
            "(an env needs name, reset(seed) -> str and step(action_text) -> StepResult)"
        )
    return env


def register_env(name: str, factory: Callable[..., "Env"], description: str = "") -> None:
    """Make `make_env(name, **kwargs)` call `factory(**kwargs)`: the hook for a user's own
    tasks (an env is anything with `name`, `reset(seed)` and `step(action_text)`)."""
    if name in _BUILTINS or name.startswith(_PREFIXES):
        raise ValueError(f"{name!r} is a built-in env spec; register your env under another name")
    _CUSTOM[name] = (factory, description or "user-registered env")


def _reasoning_gym_available() -> bool:
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        return False
    return True


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def list_reasoning_gym_datasets() -> list[str]:
    """All reasoning-gym dataset names (sorted); [] when reasoning-gym is not installed."""
    if not _reasoning_gym_available():
        return []
    from recursa.envs.reasoning_gym import dataset_names

    return dataset_names()


def list_envs() -> list[tuple[str, str]]:
    """(spec, one-line description) for every env family `make_env` understands."""
    rows = list(_BUILTINS.items()) + [(k, d) for k, (_, d) in _CUSTOM.items()]
    rows += [(k, f"entry point ({ENTRY_POINT_GROUP}): {v}") for k, v in sorted(entry_point_envs().items()) if k not in _CUSTOM and k not in _BUILTINS]
    names = list_reasoning_gym_datasets()
    if names:
        rows.append(
            (
                "rg:<name>",
                f"reasoning-gym procedural datasets ({len(names)} available, e.g. rg:basic_arithmetic); "
                "kwargs go to the dataset config",
            )
        )
    else:
        rows.append(("rg:<name>", "reasoning-gym datasets (not installed: pip install 'recursa[envs]')"))
    if _installed("textworld_express"):
        from textworld_express import GAME_NAMES

        rows.append(
            (
                "twx:<game>",
                f"TextWorldExpress games ({', '.join(GAME_NAMES)}; needs Java); kwargs: TWX game parameters "
                "(e.g. numLocations=3), max_steps, invalid_penalty",
            )
        )
    else:
        rows.append(("twx:<game>", "TextWorldExpress games (not installed: pip install textworld-express; needs Java)"))
    if _installed("textworld"):
        from recursa.envs.textworld_env import GENERATORS

        rows.append(
            (
                "textworld:<generator>",
                f"generated TextWorld games ({', '.join(GENERATORS)}), cached on disk; kwargs: generator "
                "options (e.g. recipe=2, level=3), max_steps, invalid_penalty",
            )
        )
    else:
        rows.append(("textworld:<generator>", "generated TextWorld games (not installed: pip install textworld)"))
    rows.append(("pkg.module:factory", "your own env: factory(**env.kwargs) returns an object with name, reset(seed), step(action_text)"))
    return rows


def env_factory(spec: str, **kwargs: Any) -> Callable[[], Env]:
    """A picklable zero-argument factory of the env `make_env(spec, **kwargs)` builds, for
    another process (a Ray rollout worker): a registered env's own factory with its kwargs
    (so the worker needs its module importable, not the registration), else `make_env`."""
    if isinstance(spec, str) and spec.strip() in _CUSTOM:
        return functools.partial(_CUSTOM[spec.strip()][0], **kwargs)
    return functools.partial(make_env, spec, **kwargs)  # a 'pkg.module:attr' or entry-point spec is re-imported by name there


def make_env(spec: str, **kwargs: Any) -> Env:
    """Build the env named by `spec` ("arithmetic", "rg:<dataset>", "twx:<game>",
    "textworld:<generator>", "pkg.module:factory", an entry-point or registered name) with `kwargs`. An option the env does not
    take, or a value it refuses, is a one-line UserError naming env.kwargs."""
    try:
        return _make_env(spec, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"env {spec!r} cannot be built with kwargs {kwargs!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}): "
                        "fix env.kwargs (or --env-arg)") from None


def _make_env(spec: str, **kwargs: Any) -> Env:
    if not isinstance(spec, str):
        raise UserError(f"env spec must be a string like 'arithmetic' or 'rg:basic_arithmetic', got {spec!r}")
    spec = spec.strip()
    if spec == "arithmetic":
        from recursa.envs.arithmetic import ArithmeticEnv

        return ArithmeticEnv(**kwargs)
    if spec == "household":
        from recursa.envs.household import HouseholdEnv

        return HouseholdEnv(**kwargs)
    factory = resolve_factory(spec)  # register_env, 'pkg.module:attr', or a `recursa.envs` entry point
    if factory is not None:
        return _build(spec, factory, kwargs) if spec not in _CUSTOM else factory(**kwargs)
    if spec.startswith(_RG_PREFIX):
        if not _reasoning_gym_available():
            raise UserError(f"env {spec!r} needs reasoning-gym; install it with: pip install 'recursa[envs]'")
        from recursa.envs.reasoning_gym import ReasoningGymEnv

        return ReasoningGymEnv(spec[len(_RG_PREFIX) :].strip(), **kwargs)
    if spec.startswith(_TWX_PREFIX):
        from recursa.envs.twx import TWXEnv

        return TWXEnv(spec[len(_TWX_PREFIX) :].strip(), **kwargs)
    if spec.startswith(_TW_PREFIX):
        from recursa.envs.textworld_env import TextWorldEnv

        return TextWorldEnv(spec[len(_TW_PREFIX) :].strip(), **kwargs)
    named = list(_BUILTINS) + list(_CUSTOM) + sorted(entry_point_envs())
    known = named + ["rg:<dataset>", "twx:<game>", "textworld:<generator>", "pkg.module:factory"]
    close = difflib.get_close_matches(spec, named, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UserError(f"unknown env {spec!r}{hint}; known: {', '.join(known)}; run `recursa envs` to list them")
