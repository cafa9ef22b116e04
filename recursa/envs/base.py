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
    gym:<id>              a gymnasium env with text rendering, e.g. gym:FrozenLake-v1 (recursa.envs.gym_env)
    ta:<game>             a single-player TextArena game, e.g. ta:GuessTheNumber-v0 (recursa.envs.textarena_env)
    vf:<taskset>          a verifiers environment: its tasks, rewards and multi-turn run() (recursa.envs.verifiers_env)
    openenv:<url-or-class> an OpenEnv env: a running server's URL, or an Environment class pkg.module:Class (recursa.envs.openenv_env)
    harness:pkg.module:fn an agent harness written against the OpenAI client, played through recursa's endpoint (recursa.serve)
    pkg.module:factory    your own env: `factory(**kwargs)` returns an object following `Env`
                          or `AgentEnv` (imported by module path, so it works in Ray workers)
    <name>                an env registered by an installed package under the `recursa.envs`
                          entry-point group, or in this process with `register_env`
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Callable

from recursa.answers import extract_answer, last_number, normalise_number  # noqa: F401  (answer parsing, re-exported for the envs)
from recursa.envs.protocol import (  # noqa: F401  (the protocol, splits and action matching, re-exported)
    SPLIT_SIZE, SPLITS, AgentEnv, Env, StepResult, answer_extractor, is_agent_env, match_admissible, normalize_action, protocol_gaps, split_of,
    split_seed, split_seeds, system_prompt_of,
)
from recursa.errors import UserError
from recursa.plugins import ENVS
from recursa.registry import entry_point_table, import_object, is_import_path, one_line  # noqa: F401  (re-exported)

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
        self.steps_ok = 0  # game steps that returned (supervised pools)
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

    def mark(self) -> tuple[int, int]:
        """(game steps that returned, restarts) so far: the point `check_played` compares with."""
        return self.steps_ok, self.restarts

    def check_played(self, since: tuple[int, int], what: str) -> None:
        """A one-line UserError when games failed since `since` (a `mark()`) and not one step
        returned: a game that broke mid-run and stays broken (issue 49). Its episodes would all
        be 'crashed', reward 0: training on them moves the weights on no signal (Adam's momentum
        alone), and an evaluation of them records a success rate no model earned. So `what`
        (a training step, an evaluation) is refused before anything of it is written; the run
        keeps its last checkpoint and resumes from it once the env works. A game that fails now
        and then still plays (one step returning is enough)."""
        ok, restarts = since
        if self.supervision is None or self.restarts == restarts or self.steps_ok != ok:
            return
        last = self.failures[-1] if self.failures else "?"
        raise UserError(
            f"every game of {what} failed ({self.restarts - restarts} crashed or hung, none returned a step; last: {last}): the env broke "
            f"mid-run, so nothing of {what} is recorded; fix the env (a training run then continues from its last checkpoint: `recursa train --resume RUN_DIR`)"
        )

    def close(self) -> None:
        for env in self.envs:
            close = getattr(env, "close", None)
            if callable(close):
                close()
        self.envs = []


def as_pool(envs: "EnvPool | Callable[[], Env]") -> EnvPool:
    return envs if isinstance(envs, EnvPool) else EnvPool(envs)


# ------------------------------------------------------------------------------- registry

# The table of envs by name: import paths, so that naming an env imports its adapter alone
# (and validating a config imports none). Families take the part after their prefix as the
# adapter's first argument.
_BUILTINS: dict[str, str] = {name: e.description for name, e in ENVS.builtins().items()}
_RG_PREFIX = "rg:"
_TWX_PREFIX = "twx:"
_TW_PREFIX = "textworld:"
_GYM_PREFIX, _TA_PREFIX = "gym:", "ta:"  # issue 48: other ecosystems' envs (docs/gym.md, docs/textarena.md)
_VF_PREFIX, _OPENENV_PREFIX = "vf:", "openenv:"  # issue 48: docs/verifiers.md, docs/openenv.md
_HARNESS_PREFIX = "harness:"  # issue 48: an OpenAI-client harness (recursa/serve.py, docs/serve.md)
_PREFIXES = (_RG_PREFIX, _TWX_PREFIX, _TW_PREFIX, _GYM_PREFIX, _TA_PREFIX, _VF_PREFIX, _OPENENV_PREFIX, _HARNESS_PREFIX)
_FAMILIES = {_RG_PREFIX: "recursa.envs.reasoning_gym:ReasoningGymEnv", _TWX_PREFIX: "recursa.envs.twx:TWXEnv",
             _TW_PREFIX: "recursa.envs.textworld_env:TextWorldEnv", _GYM_PREFIX: "recursa.envs.gym_env:GymTextEnv",
             _TA_PREFIX: "recursa.envs.textarena_env:TextArenaEnv", _VF_PREFIX: "recursa.envs.verifiers_env:verifiers_env",
             _OPENENV_PREFIX: "recursa.envs.openenv_env:OpenEnvEnv", _HARNESS_PREFIX: "recursa.serve:harness_env"}

ENTRY_POINT_GROUP = ENVS.group


def _custom() -> dict:
    """The envs registered in this process (`register_env`): name -> registry entry."""
    return ENVS.registered()


def is_factory_spec(spec: str) -> bool:
    """Whether `spec` names a factory by import path, 'pkg.module:attr' (and not a built-in
    family such as 'rg:<dataset>')."""
    return isinstance(spec, str) and not spec.startswith(_PREFIXES) and is_import_path(spec)


def entry_point_envs() -> dict[str, str]:
    """name -> 'pkg.module:attr' of every env an installed package registers under the
    `recursa.envs` entry-point group (pyproject: [project.entry-points."recursa.envs"])."""
    return entry_point_table(ENTRY_POINT_GROUP)


def resolve_factory(spec: str) -> Callable[..., "Env"] | None:
    """The user factory `spec` names, or None for a built-in spec: an in-process registration
    (`register_env`), a 'pkg.module:attr' path, or an entry point of the `recursa.envs` group."""
    spec = spec.strip()
    if spec in _custom():
        return ENVS.get(spec)
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


def check_env(spec: str, kwargs: dict | None = None) -> None:
    """Config-load check of a user env spec ('pkg.module:attr' or an entry-point name): the
    factory imports, builds an env with `kwargs`, and the env follows the protocol; else a
    one-line `UserError` naming what is missing. Built-in and in-process specs are left to
    `make_env`."""
    if not isinstance(spec, str) or spec.strip() in _custom():
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
    ENVS.register(name, factory, description=description or "user-registered env", replace=True)


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
    return import_object("recursa.envs.reasoning_gym:dataset_names", "env.name")()


def list_envs() -> list[tuple[str, str]]:
    """(spec, one-line description) for every env family `make_env` understands."""
    custom = _custom()
    rows = list(_BUILTINS.items()) + [(k, e.description) for k, e in custom.items()]
    rows += [(k, f"entry point ({ENTRY_POINT_GROUP}): {v}") for k, v in sorted(entry_point_envs().items()) if k not in custom and k not in _BUILTINS]
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
        GENERATORS = import_object("recursa.envs.textworld_env:GENERATORS", "env.name")
        rows.append(
            (
                "textworld:<generator>",
                f"generated TextWorld games ({', '.join(GENERATORS)}), cached on disk; kwargs: generator "
                "options (e.g. recipe=2, level=3), max_steps, invalid_penalty",
            )
        )
    else:
        rows.append(("textworld:<generator>", "generated TextWorld games (not installed: pip install textworld)"))
    rows.append(("gym:<id>", "a gymnasium env with text rendering, named actions (docs/gym.md)" if _installed("gymnasium")
                 else "gymnasium envs (not installed: pip install gymnasium)"))
    rows.append(("ta:<game>", "a single-player TextArena game (docs/textarena.md)" if _installed("textarena")
                 else "single-player TextArena games (not installed: pip install textarena)"))
    rows.append(("vf:<taskset>", "a verifiers environment: its tasks, weighted rewards, multi-turn run() and tools (docs/verifiers.md)" if _installed("verifiers")
                 else "verifiers environments (not installed: pip install verifiers)"))
    rows.append(("openenv:<url-or-class>", "an OpenEnv env: a running server (openenv:http://host:port) or pkg.module:Class in process (docs/openenv.md)"
                 if _installed("openenv") else "OpenEnv envs (not installed: pip install openenv-core)"))
    rows.append(("harness:pkg.module:fn", "an agent harness fn(base_url, seed) -> reward that calls the OpenAI client, trained through recursa's endpoint (docs/serve.md)"))
    rows.append(("pkg.module:factory", "your own env: factory(**env.kwargs) returns an object with name, reset(seed), step(action_text)"))
    return rows


def env_factory(spec: str, **kwargs: Any) -> Callable[[], Env]:
    """A picklable zero-argument factory of the env `make_env(spec, **kwargs)` builds, for
    another process (a Ray rollout worker): a registered env's own factory with its kwargs
    (so the worker needs its module importable, not the registration), else `make_env`."""
    if isinstance(spec, str) and spec.strip() in _custom():
        return functools.partial(ENVS.get(spec.strip()), **kwargs)
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
    if spec in _BUILTINS:
        return ENVS.get(spec)(**kwargs)
    factory = resolve_factory(spec)  # register_env, 'pkg.module:attr', or a `recursa.envs` entry point
    if factory is not None:
        return _build(spec, factory, kwargs) if spec not in _custom() else factory(**kwargs)
    for prefix, path in _FAMILIES.items():
        if spec.startswith(prefix):
            if prefix == _RG_PREFIX and not _reasoning_gym_available():
                raise UserError(f"env {spec!r} needs reasoning-gym; install it with: pip install 'recursa[envs]'")
            return import_object(path, "env.name")(spec[len(prefix) :].strip(), **kwargs)
    named = list(_BUILTINS) + list(_custom()) + sorted(entry_point_envs())
    known = named + ["rg:<dataset>", "twx:<game>", "textworld:<generator>", "gym:<id>", "ta:<game>", "vf:<taskset>", "openenv:<url-or-class>", "harness:pkg.module:fn", "pkg.module:factory"]
    close = difflib.get_close_matches(spec, named, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UserError(f"unknown env {spec!r}{hint}; known: {', '.join(known)}; run `recursa envs` to list them")
