"""Adapter for TextWorldExpress games (`twx:<game>` specs), e.g. `twx:coin`, `twx:cookingworld`.

TextWorldExpress (pip install textworld-express; needs Java >= 8 on PATH) simulates
text games in a JVM. One adapter owns one JVM (started in the constructor, ~0.8 s) and
reuses it for every reset; `close()` stops it. An adapter is not thread-safe: use one
per worker.

Game parameters are passed as keyword arguments and become TWX's "key=value,..."
parameter string, e.g. `make_env("twx:coin", numLocations=3, includeDoors=False)`;
bools become 0/1. Unknown names and out-of-range values are reported by TWX itself and
raised as `UserError`.

Seeds and folds. TWX draws every game from (gameFold, seed): the fold picks the pool of
objects/ingredients/numbers the generator draws from (gameSet 1/2/3 in the generation
properties), the seed seeds the generator. Any int seed is accepted in any fold; TWX's
`getValidSeeds{Train,Dev,Test}()` lists (0-999, 10000-10999, 20000-20999) are only the
benchmark's conventional ranges and are not enforced. recursa maps

    train seed s -> (fold "train", seed s)
    gate  seed s -> (fold "dev",   seed s - 1e9)
    test  seed s -> (fold "test",  seed s - 2e9)

i.e. the TWX seed is the item's index within its split. Held-out (test) items therefore
come from TWX's test fold only. The same index in two folds gives different games in
general (different object pools), but games with little content (coin, mapreader with
few locations) can coincide across folds by construction.

Episodes. `reset(seed)` returns the task description and the first observation; `task`
is the task description on one line. `step(action)` sends only admissible actions
(TWX's `validActions`, sorted; matched after lower-casing and collapsing whitespace) to the
game; anything else leaves the game untouched, costs `invalid_penalty` and sets
info["invalid"]. Reward is 1.0 on the step where TWX reports task success, else 0 (TWX's
partial score is in info["score"]). The episode ends on success, on task failure
(info["lost"]) or after `max_steps` steps (invalid ones included).

Speed (measured on the 2-core development machine): JVM start + load ~0.7-0.9 s per adapter; reset
~1.5-6 ms; step ~0.3-0.6 ms (py4j round trips dominate). Resets skip TWX's gold path
(it doubles the cost of a cookingworld reset); `walkthrough()` regenerates the game with
it, checks it by replay and restores the episode, a few ms.

textworld_express is imported lazily here and nowhere else in recursa.
"""

from __future__ import annotations

import difflib
import re
import shutil
from typing import Any

from recursa.envs.protocol import SPLIT_SIZE, StepResult, match_admissible, one_line, split_of
from recursa.errors import UserError

__all__ = ["FOLDS", "TWXEnv", "game_names", "twx_fold_and_seed"]

# recursa split -> TWX gameFold
FOLDS: dict[str, str] = {"train": "train", "gate": "dev", "test": "test"}
_LOOK = "look around"
_NO_STEP_LIMIT = 10**9  # recursa enforces max_steps itself
_INSTALL = "pip install textworld-express"


def _twx():
    try:
        import textworld_express
    except ImportError:
        raise UserError(f"twx:<game> envs need TextWorldExpress; install it with: {_INSTALL}") from None
    return textworld_express


def game_names() -> list[str]:
    """The games the installed TextWorldExpress provides."""
    return list(_twx().GAME_NAMES)


def twx_fold_and_seed(seed: int) -> tuple[str, int]:
    """(TWX gameFold, TWX seed) for a recursa seed: the fold of its split, its index in it."""
    split = split_of(seed)
    return FOLDS[split], seed - SPLIT_SIZE * ("train", "gate", "test").index(split)


def _param_string(game: str, params: dict[str, Any]) -> str:
    parts = []
    for key, value in params.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)):
            raise UserError(f"twx:{game}: bad parameter name {key!r}")
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int):
            raise UserError(f"twx:{game}: parameter {key} must be an int or a bool, got {value!r}")
        parts.append(f"{key}={value}")
    return ",".join(parts)


def _known_params(message: str) -> list[str]:
    """Parameter names listed in TWX's "Unrecognized property name" message."""
    match = re.search(r"Known properties:\s*(.*?)\.?\s*$", message)
    if not match:
        return []
    names = [n.strip() for n in match.group(1).split(",") if n.strip()]
    if names == ["None"]:
        return []
    # TWX 1.1.0 glues "None" onto the last name for some games ("verboseNone").
    return [n[:-4] if n.endswith("None") and len(n) > 4 else n for n in names]


class TWXEnv:
    """One TextWorldExpress game family as a recursa `AgentEnv` (see the module docstring)."""

    def __init__(
        self,
        game: str,
        max_steps: int = 50,
        invalid_penalty: float = 0.0,
        system_prompt: str | None = None,
        **params: Any,
    ) -> None:
        twx = _twx()
        games = list(twx.GAME_NAMES)
        if game not in games:
            close = difflib.get_close_matches(str(game), games, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join('twx:' + c for c in close)}?)" if close else ""
            raise UserError(f"unknown TextWorldExpress game {game!r}{hint}; games: {', '.join(games)}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise UserError(f"max_steps must be a positive int, got {max_steps!r}")
        if isinstance(invalid_penalty, bool) or not isinstance(invalid_penalty, (int, float)):
            raise UserError(f"invalid_penalty must be a number, got {invalid_penalty!r}")
        self.param_string = _param_string(game, params)
        if shutil.which("java") is None:
            raise UserError(
                "twx:<game> envs need Java (>= 8) on PATH for the TextWorldExpress JVM; install it, "
                "e.g. apt-get install -y default-jre-headless"
            )
        self.game = game
        self.name = f"twx:{game}"
        self.params = dict(params)
        self.max_steps = max_steps
        self.invalid_penalty = float(invalid_penalty)
        self.system_prompt = system_prompt
        self.task = ""
        self.fold: str | None = None
        self.twx_seed: int | None = None
        self.seed: int | None = None
        self._env = twx.TextWorldExpressEnv(envStepLimit=_NO_STEP_LIMIT)
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        self._infos: dict[str, Any] | None = None
        self._history: list[str] = []  # admissible actions sent since reset
        self._steps = 0
        self._done = False
        self._walkthroughs: dict[int, list[str] | None] = {}

    # ------------------------------------------------------------------ JVM side

    def _load(self) -> None:
        try:
            self._env.load(self.game, self.param_string)
        except ValueError as exc:
            message = str(exc).strip()
            bad = re.search(r"Unrecognized property name \((.*?)\)", message)
            if bad:
                known = _known_params(message)
                close = difflib.get_close_matches(bad.group(1), known, n=3, cutoff=0.5)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise UserError(
                    f"twx:{self.game} has no parameter {bad.group(1)!r}{hint}; "
                    f"parameters: {', '.join(known) or 'none'}"
                ) from None
            raise UserError(f"twx:{self.game}: bad parameters {self.param_string!r}: {message}") from None
        # TWX accepts some malformed values silently and then fails to generate: probe once.
        obs, _ = self._env.reset(seed=0, gameFold="train", generateGoldPath=False)
        if str(obs).startswith("ERROR"):
            raise UserError(f"twx:{self.game}: bad parameters {self.param_string!r}: {obs}")

    def _start(self, fold: str, twx_seed: int, gold: bool = False) -> dict[str, Any]:
        # The gold path costs up to 2x a reset and does not change the game (the tests replay
        # walkthroughs from gold-path resets in episodes started without one), so only
        # walkthrough() asks for it.
        _, infos = self._env.reset(seed=twx_seed, gameFold=fold, generateGoldPath=gold)
        if str(infos.get("observation", "")).startswith("ERROR"):
            raise RuntimeError(f"TWX could not generate {self.name} seed {twx_seed}: {infos['observation']}")
        return infos

    def close(self) -> None:
        """Stop the JVM (the adapter cannot be used afterwards)."""
        env = getattr(self, "_env", None)
        if env is not None:
            self._env = None
            try:
                env.close()
            except Exception:
                pass

    def __enter__(self) -> "TWXEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- the episode

    def reset(self, seed: int) -> str:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"seed must be an int, got {seed!r}")
        if self._env is None:
            raise RuntimeError(f"{self.name}: the env was closed")
        fold, twx_seed = twx_fold_and_seed(seed)
        infos = self._start(fold, twx_seed)
        self.seed, self.fold, self.twx_seed = seed, fold, twx_seed
        self._infos = infos
        self._history = []
        self._steps = 0
        self._done = False
        self.task = one_line(infos.get("taskDescription", ""))
        return f"{self.task}\n\n{str(infos['observation']).strip()}"

    def admissible_actions(self) -> list[str] | None:
        if self._infos is None:
            return None
        return sorted({str(a) for a in self._infos.get("validActions", []) if str(a).strip()})

    def _match(self, action: str) -> str | None:
        return match_admissible(action, self.admissible_actions())

    def _info(self, invalid: bool, won: bool, lost: bool, action: str | None) -> dict[str, Any]:
        infos = self._infos or {}
        return {
            "won": won,
            "success": won,
            "lost": lost,
            "invalid": invalid,
            "admissible": self.admissible_actions(),
            "steps": self._steps,
            "score": float(infos.get("score", 0.0)),
            "score_raw": float(infos.get("scoreRaw", 0.0)),
            "action": action,
            "fold": self.fold,
            "twx_seed": self.twx_seed,
            "note": "",
        }

    def step(self, action_text: str) -> StepResult:
        if self._infos is None or self._env is None:
            raise RuntimeError(f"{self.name}: call reset(seed) before step()")
        if self._done:
            raise RuntimeError(f"{self.name}: the episode is over; call reset(seed)")
        self._steps += 1
        action = self._match(action_text or "")
        if action is None:
            timeout = self._steps >= self.max_steps
            self._done = timeout
            obs = f"'{str(action_text or '').strip()}' is not an admissible action here; nothing happens."
            return StepResult(obs, 0.0 - self.invalid_penalty, timeout, self._info(True, False, False, None))
        obs, _, _, infos = self._env.step(action)
        self._infos = infos
        self._history.append(action)
        won = bool(infos.get("tasksuccess"))
        lost = bool(infos.get("taskfailure")) and not won
        self._done = won or lost or self._steps >= self.max_steps
        return StepResult(str(obs).strip(), 1.0 if won else 0.0, self._done, self._info(False, won, lost, action))

    # ------------------------------------------------------------------ the oracle

    def _gold(self) -> list[str]:
        """TWX's gold action sequence for the current game (clobbers the game state)."""
        self._start(self.fold, self.twx_seed, gold=True)
        return [str(a) for a in self._env.getGoldActionSequence()]

    def _wins(self, actions: list[str]) -> bool:
        """Replay `actions` from the start of the current game (clobbers the game state)."""
        infos = self._start(self.fold, self.twx_seed)
        for action in actions:
            if action not in {str(a) for a in infos.get("validActions", [])}:
                return False
            _, _, _, infos = self._env.step(action)
            if infos.get("tasksuccess"):
                return True
            if infos.get("taskfailure"):
                return False
        return False

    def walkthrough(self) -> list[str] | None:
        """TWX's gold action sequence for the current game, without its leading "look around"
        when the rest still wins (checked by replaying it, then restoring the episode)."""
        if self._infos is None or self.seed is None:
            return None
        if self.seed not in self._walkthroughs:
            found: list[str] | None = None
            try:
                gold = self._gold()
                candidates = [gold[1:], gold] if gold and gold[0] == _LOOK else [gold]
                for candidate in candidates:
                    if candidate and self._wins(candidate):
                        found = candidate
                        break
            finally:
                self._restore()
            if len(self._walkthroughs) > 4096:
                self._walkthroughs.clear()
            self._walkthroughs[self.seed] = found
        found = self._walkthroughs[self.seed]
        return list(found) if found is not None else None

    def _restore(self) -> None:
        """Bring the game back to the current episode's state (TWX games are deterministic)."""
        infos = self._start(self.fold, self.twx_seed)
        for action in self._history:
            _, _, _, infos = self._env.step(action)
        self._infos = infos
