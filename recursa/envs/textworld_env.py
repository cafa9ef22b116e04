"""Adapter for Microsoft TextWorld's game generators (`textworld:<generator>` specs).

Generators (the challenges bundled with `pip install textworld`, all offline):

    textworld:cooking          tw-cooking (the First TextWorld Problems cooking games)
                               recipe=1..5, take=0..recipe, go=1|6|9|12, open, cook, cut,
                               drop (bools), recipe_seed=0, split="auto"|"train"|"valid"|"test"|"all"
    textworld:coin_collector   tw-coin_collector; level=1..300
    textworld:treasure_hunter  tw-treasure_hunter; level=1..30
    textworld:simple           tw-simple; rewards=dense|balanced|sparse, goal=brief|detailed|none,
                               test="auto"|True|False

plus `max_steps` (default 50) and `invalid_penalty` (default 0.0). The small defaults
(cooking: one room, one ingredient to take; level 1) make games an LLM can finish.

Seeds. The game for recursa seed s is generated with TextWorld seed s (`GameOptions.seeds
= s`, from which TextWorld draws its map/objects/quest/grammar seeds), so train, gate and
test games never share a seed. Some seeds admit no quest (QuestGenerationError, e.g. the
treasure hunter at some levels); then attempt k = 1, 2, ... uses the seeds drawn from
numpy.random.RandomState([s, k]): still a pure function of s. With split="auto" (the
default) cooking games draw their food from TextWorld's own split (train -> "train", gate ->
"valid", test -> "test"), and with test="auto" simple games use the test foods for test
seeds only, so held-out games hold held-out content too.

Cache. Generating a game takes ~1-3 s (the first in a process ~4-5 s, loading TextWorld's
knowledge base; cooking, coin collector and simple compile twice with Inform 7, once to
record the walkthrough), so each game is generated once and kept in

    $RECURSA_CACHE/textworld/<generator>/<options-hash>/<seed>.z8   (+ <seed>.json, the game's data)

(RECURSA_CACHE defaults to ~/.cache/recursa). The options hash covers the generator, its
options and the TextWorld version. Generation runs under a per-seed file lock and is
published by atomic renames (the .json first, then the .z8), so parallel workers never see
a half-written game and never generate the same game twice. The cached file is the game
from then on (cooking games compiled in two processes can differ byte-wise with the
PYTHONHASHSEED, though the walkthrough is the same).

Episodes follow the AgentEnv contract: `task` is the game's objective on one line;
admissible actions are TextWorld's `admissible_commands`; other actions are not sent to
the game (state unchanged, reward -invalid_penalty, info["invalid"]); reward 1.0 on the
step that wins, else 0 (the game's points are in info["score"] / info["max_score"]).
`walkthrough()` is the game's stored walkthrough, else the policy commands from the start
state, whichever first wins when replayed in a second, private copy of the game.

Speed: loading a cached game + reset ~20-50 ms, a step ~2-11 ms (one Jericho interpreter
per adapter, reused across games).

textworld is imported lazily here and nowhere else in recursa.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from recursa.envs.protocol import StepResult, match_admissible, one_line, split_of
from recursa.errors import UserError

try:  # POSIX: one generator per game across processes; elsewhere atomic renames only
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["GENERATORS", "TextWorldEnv", "game_path", "generator_names"]

_INSTALL = "pip install textworld"
_ATTEMPTS = 10  # seeds tried per game when a seed admits no quest

# generator -> (TextWorld challenge, default options)
GENERATORS: dict[str, tuple[str, dict[str, Any]]] = {
    "cooking": (
        "tw-cooking",
        {
            "recipe": 1,
            "take": 1,
            "go": 1,
            "open": False,
            "cook": False,
            "cut": False,
            "drop": False,
            "recipe_seed": 0,
            "split": "auto",
        },
    ),
    "coin_collector": ("tw-coin_collector", {"level": 1}),
    "treasure_hunter": ("tw-treasure_hunter", {"level": 1}),
    "simple": ("tw-simple", {"rewards": "balanced", "goal": "brief", "test": "auto"}),
}
_COOKING_SPLIT = {"train": "train", "gate": "valid", "test": "test"}


def _tw():
    try:
        import textworld
        import textworld.challenges
    except ImportError:
        raise UserError(f"textworld:<generator> envs need TextWorld; install it with: {_INSTALL}") from None
    return textworld


def generator_names() -> list[str]:
    """The generators available with the installed TextWorld."""
    challenges = _tw().challenges.CHALLENGES
    return [name for name, (challenge, _) in GENERATORS.items() if challenge in challenges]


# ------------------------------------------------------------------------------ options


def _int_in(gen: str, key: str, value: Any, lo: int, hi: int | None = None, choices: tuple[int, ...] = ()) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"textworld:{gen}: {key} must be an int, got {value!r}")
    if choices and value not in choices:
        raise UserError(f"textworld:{gen}: {key} must be one of {', '.join(map(str, choices))}, got {value}")
    if value < lo or (hi is not None and value > hi):
        upper = f"..{hi}" if hi is not None else " or more"
        raise UserError(f"textworld:{gen}: {key} must be in {lo}{upper}, got {value}")
    return value


def _bool(gen: str, key: str, value: Any, auto: bool = False) -> Any:
    if auto and value == "auto":
        return value
    if not isinstance(value, bool):
        allowed = '"auto", True or False' if auto else "True or False"
        raise UserError(f"textworld:{gen}: {key} must be {allowed}, got {value!r}")
    return value


def _choice(gen: str, key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise UserError(f"textworld:{gen}: {key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_options(gen: str, options: dict[str, Any]) -> dict[str, Any]:
    """Defaults filled in and every value checked; UserError on anything TextWorld would reject."""
    _, defaults = GENERATORS[gen]
    unknown = [k for k in options if k not in defaults]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(defaults), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UserError(
            f"textworld:{gen} has no option {unknown[0]!r}{hint}; options: {', '.join(defaults)}, "
            "max_steps, invalid_penalty"
        )
    out = {**defaults, **options}
    if gen == "cooking":
        _int_in(gen, "recipe", out["recipe"], 1, 5)
        _int_in(gen, "take", out["take"], 0, out["recipe"])
        _int_in(gen, "go", out["go"], 1, choices=(1, 6, 9, 12))
        _int_in(gen, "recipe_seed", out["recipe_seed"], 0)
        for key in ("open", "cook", "cut", "drop"):
            _bool(gen, key, out[key])
        _choice(gen, "split", out["split"], ("auto", "train", "valid", "test", "all"))
        if out["recipe_seed"] > 0 and not out["take"]:
            raise UserError(f"textworld:{gen}: recipe_seed > 0 needs take >= 1")
    elif gen == "coin_collector":
        _int_in(gen, "level", out["level"], 1, 300)
    elif gen == "treasure_hunter":
        _int_in(gen, "level", out["level"], 1, 30)
    elif gen == "simple":
        _choice(gen, "rewards", out["rewards"], ("dense", "balanced", "sparse"))
        _choice(gen, "goal", out["goal"], ("detailed", "brief", "none"))
        _bool(gen, "test", out["test"], auto=True)
    return out


def _settings_for(gen: str, options: dict[str, Any], seed: int) -> dict[str, Any]:
    """The challenge settings for one seed (resolves the "auto" split choices)."""
    settings = dict(options)
    if gen == "cooking":
        split = settings["split"]
        settings["split"] = _COOKING_SPLIT[split_of(seed)] if split == "auto" else (None if split == "all" else split)
    if gen == "simple" and settings["test"] == "auto":
        settings["test"] = split_of(seed) == "test"
    return settings


def _options_hash(gen: str, options: dict[str, Any]) -> str:
    textworld = _tw()
    key = json.dumps(
        {"generator": GENERATORS[gen][0], "options": options, "textworld": textworld.__version__}, sort_keys=True
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from recursa.runio import cache_dir as recursa_cache

    return recursa_cache() / "textworld"


def game_path(generator: str, options: dict[str, Any], seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the game for (generator, options, seed) is cached (options: as given to the env)."""
    gen = _generator(generator)
    checked = _check_options(gen, dict(options))
    return _cache_root(cache_dir) / gen / _options_hash(gen, checked) / f"{seed}.z8"


# ---------------------------------------------------------------------------- generation


def _generate(challenge: str, settings: dict[str, Any], seed: int, z8_path: str) -> None:
    """Build and compile the game for `seed` to `z8_path` (and its .json next to it)."""
    import numpy as np

    textworld = _tw()
    from textworld.generator import QuestGenerationError

    _, make, _ = textworld.challenges.CHALLENGES[challenge]
    last: Exception | None = None
    for attempt in range(_ATTEMPTS):
        options = textworld.GameOptions()
        if attempt == 0:
            options.seeds = int(seed)
        else:
            drawn = np.random.RandomState([int(seed), attempt]).randint(65635, size=4)
            options.seeds = dict(zip(("map", "objects", "quest", "grammar"), map(int, drawn)))
        options.path = z8_path
        options.file_ext = ".z8"
        options.force_recompile = True
        try:
            with _quiet():  # the challenges compile once to record their walkthrough
                game = make(settings=dict(settings), options=options)
        except QuestGenerationError as exc:
            last = exc
            continue
        textworld.generator.compile_game(game, options)
        return
    raise RuntimeError(f"{challenge}: no game could be generated for seed {seed} in {_ATTEMPTS} attempts: {last}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Jericho warns that every TextWorld game is "not fully supported": that is about its
    generic score/move detection, which TextWorld replaces with the game's own data."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not fully supported.*")
        yield


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _ensure_game(folder: Path, challenge: str, settings: dict[str, Any], seed: int) -> tuple[Path, float | None]:
    """The cached game for `seed` in `folder`, generated first if missing: (path, seconds spent generating or None)."""
    z8 = folder / f"{seed}.z8"
    if z8.is_file():
        return z8, None
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / f".{seed}.lock"):
        if z8.is_file():  # another worker made it while we waited
            return z8, None
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(dir=folder, prefix=f".{seed}.tmp-"))
        try:
            _generate(challenge, settings, seed, str(tmp / f"{seed}.z8"))
            os.replace(tmp / f"{seed}.json", folder / f"{seed}.json")
            os.replace(tmp / f"{seed}.z8", z8)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return z8, time.perf_counter() - start


# ------------------------------------------------------------------------------ the env


def _generator(name: str) -> str:
    name = str(name).strip()
    if name.startswith("tw-"):
        name = name[3:]
    if name in GENERATORS:
        return name
    close = difflib.get_close_matches(name, list(GENERATORS), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join('textworld:' + c for c in close)}?)" if close else ""
    raise UserError(f"unknown TextWorld generator {name!r}{hint}; generators: {', '.join(GENERATORS)}")


_END = re.compile(r"\s*\*\*\* The End \*\*\*.*", re.DOTALL)


def _clean(feedback: str) -> str:
    """Game output without the status-line prompt and the end-of-game menu."""
    text = _END.sub("\n\n*** The End ***", str(feedback or ""))
    lines = text.rstrip().splitlines()
    if lines and lines[-1].lstrip().startswith(">"):
        lines = lines[:-1]
    text = "\n".join(line.rstrip() for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


class TextWorldEnv:
    """One TextWorld generator as a recursa `AgentEnv` (see the module docstring)."""

    def __init__(
        self,
        generator: str,
        max_steps: int = 50,
        invalid_penalty: float = 0.0,
        system_prompt: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        **options: Any,
    ) -> None:
        textworld = _tw()
        gen = _generator(generator)
        challenge = GENERATORS[gen][0]
        if challenge not in textworld.challenges.CHALLENGES:
            raise UserError(
                f"textworld:{gen} needs the {challenge} challenge, which TextWorld {textworld.__version__} lacks"
            )
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise UserError(f"max_steps must be a positive int, got {max_steps!r}")
        if isinstance(invalid_penalty, bool) or not isinstance(invalid_penalty, (int, float)):
            raise UserError(f"invalid_penalty must be a number, got {invalid_penalty!r}")
        self.generator = gen
        self.challenge = challenge
        self.name = f"textworld:{gen}"
        self.options = _check_options(gen, options)
        self.max_steps = max_steps
        self.invalid_penalty = float(invalid_penalty)
        self.system_prompt = system_prompt
        self.folder = _cache_root(cache_dir) / gen / _options_hash(gen, self.options)
        self.task = ""
        self.seed: int | None = None
        self.game_file: Path | None = None
        self.last_generation_s: float | None = None  # seconds the last reset spent generating (None: cached)
        self._infos = textworld.EnvInfos(
            admissible_commands=True,
            won=True,
            lost=True,
            score=True,
            max_score=True,
            objective=True,
            description=True,
            feedback=True,
            extras=["walkthrough"],
        )
        self._env: Any = None  # the episode's game
        self._oracle: Any = None  # a second copy, for checking walkthroughs
        self._state: Any = None
        self._steps = 0
        self._done = False
        self._walkthroughs: dict[str, list[str] | None] = {}

    def game_file_for(self, seed: int) -> Path:
        """The cached game for `seed`, generated now if missing."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"seed must be an int, got {seed!r}")
        split_of(seed)  # a seed outside every split is a UserError
        settings = _settings_for(self.generator, self.options, seed)
        path, seconds = _ensure_game(self.folder, self.challenge, settings, seed)
        self.last_generation_s = seconds
        return path

    def _open(self, env: Any, path: Path, infos: Any) -> Any:
        textworld = _tw()
        with _quiet():
            if env is None:
                return textworld.start(str(path), request_infos=infos)
            env.load(str(path))
            return env

    def reset(self, seed: int) -> str:
        path = self.game_file_for(seed)
        if self._env is None or self.game_file != path:
            self._env = self._open(self._env, path, self._infos)
        self.seed, self.game_file = seed, path
        self._state = self._env.reset()
        self._steps = 0
        self._done = False
        self.task = one_line(self._state["objective"] or "")
        description = _clean(self._state["description"] or "")
        return f"{self.task}\n\n{description}" if self.task else description

    def admissible_actions(self) -> list[str] | None:
        if self._state is None:
            return None
        return list(self._state["admissible_commands"] or [])

    def _match(self, action: str) -> str | None:
        return match_admissible(action, self.admissible_actions())

    def _info(self, invalid: bool, action: str | None) -> dict[str, Any]:
        state = self._state
        won = bool(state["won"])
        return {
            "won": won,
            "success": won,
            "lost": bool(state["lost"]) and not won,
            "invalid": invalid,
            "admissible": self.admissible_actions(),
            "steps": self._steps,
            "score": float(state["score"] or 0),
            "max_score": float(state["max_score"] or 0),
            "action": action,
            "note": "",
        }

    def step(self, action_text: str) -> StepResult:
        if self._state is None:
            raise RuntimeError(f"{self.name}: call reset(seed) before step()")
        if self._done:
            raise RuntimeError(f"{self.name}: the episode is over; call reset(seed)")
        self._steps += 1
        action = self._match(action_text or "")
        if action is None:
            self._done = self._steps >= self.max_steps
            obs = f"'{str(action_text or '').strip()}' is not an admissible action here; nothing happens."
            return StepResult(obs, 0.0 - self.invalid_penalty, self._done, self._info(True, None))
        self._state, _, _ = self._env.step(action)
        info = self._info(False, action)
        self._done = info["won"] or info["lost"] or self._steps >= self.max_steps
        return StepResult(_clean(self._state["feedback"]), 1.0 if info["won"] else 0.0, self._done, info)

    # ------------------------------------------------------------------ the oracle

    def walkthrough(self) -> list[str] | None:
        """The stored walkthrough, else the start state's policy commands: the first that wins
        (every action admissible) when replayed in a private copy of the game."""
        if self.game_file is None:
            return None
        key = str(self.game_file)
        if key not in self._walkthroughs:
            textworld = _tw()
            infos = textworld.EnvInfos(
                admissible_commands=True, won=True, lost=True, policy_commands=True, extras=["walkthrough"]
            )
            self._oracle = self._open(self._oracle, self.game_file, infos)
            state = self._oracle.reset()
            candidates = [list(state.get("extra.walkthrough") or []), list(state.get("policy_commands") or [])]
            found = None
            for candidate in candidates:
                if candidate and self._wins(candidate):
                    found = candidate
                    break
            if len(self._walkthroughs) > 4096:
                self._walkthroughs.clear()
            self._walkthroughs[key] = found
        found = self._walkthroughs[key]
        return list(found) if found is not None else None

    def _wins(self, actions: list[str]) -> bool:
        state = self._oracle.reset()
        for action in actions:
            if action not in (state["admissible_commands"] or []):
                return False
            state, _, _ = self._oracle.step(action)
            if state["won"]:
                return True
            if state["lost"]:
                return False
        return False

    def close(self) -> None:
        for attr in ("_env", "_oracle"):
            env = getattr(self, attr, None)
            setattr(self, attr, None)
            if env is not None:
                with contextlib.suppress(Exception):
                    env.close()
        self._state = None

    def __enter__(self) -> "TextWorldEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
