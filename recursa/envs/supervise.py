"""Games that die: a supervised env restarts a crashed or hung game and fails the episode.

Some games run outside Python (TextWorldExpress in a JVM reached through py4j, TextWorld's
interpreter); the process can die or stop answering mid-run. :class:`SupervisedEnv` wraps
one env instance of an :class:`~recursa.envs.base.EnvPool`:

* a ``reset`` or ``step`` that raises (the game process is gone: py4j's network error, a
  broken pipe, EOF) or, with ``step_timeout``, does not return within that many seconds,
  is a *game failure*: the instance is closed, a fresh one is built from the pool's
  factory, and the pool's ``restarts`` count goes up;
* a failed ``step`` ends the episode: it returns ``done = True``, reward 0 and
  ``info["failure"]`` = ``"crashed"`` or ``"timeout"`` (``info["failure_detail"]`` says what
  happened), which the rollout records as the episode's finish reason;
* a failed ``reset`` is retried once on the fresh instance;
* past ``max_restarts`` restarts in one pool the run stops with a one-line error: a game
  that fails every time is broken, not unlucky.

A timed-out call runs in a helper thread that is abandoned once the instance is closed
(closing a TextWorldExpress env shuts its JVM down, which ends the call); a pure-Python env
stuck in a loop keeps its thread, so a step timeout is meant for games in other processes.
Without a timeout the calls run directly in the caller's thread, at no cost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from recursa.errors import UserError

__all__ = ["GameFailure", "Supervision", "SupervisedEnv"]


class GameFailure(Exception):
    """A game call that crashed or timed out (`kind` is "crashed" or "timeout")."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass
class Supervision:
    """How an EnvPool supervises its games: `step_timeout` seconds per reset/step (None: no
    limit) and at most `max_restarts` restarts in the pool's life."""

    step_timeout: float | None = None
    max_restarts: int = 100


def _call(fn: Callable, args: tuple, timeout: float | None) -> Any:
    if timeout is None:
        try:
            return fn(*args)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 -- any error from the game is a crash of the game
            raise GameFailure("crashed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run, name="recursa-env-call", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise GameFailure("timeout", f"no answer within env.step_timeout = {timeout:g} s")
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, UserError):
            raise exc
        raise GameFailure("crashed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
    return box["value"]


NEVER_STEPPED = 8  # a pool whose first this many steps all failed, none returning, has a broken env: stop, do not train on it


class SupervisedEnv:
    """One env instance of a pool, restarted when its game crashes or hangs (see the module
    doc). Every other attribute (name, task, max_steps, admissible_actions, walkthrough,
    state_key, ...) is the current instance's."""

    def __init__(self, factory: Callable[[], Any], pool: Any, supervision: Supervision):
        object.__setattr__(self, "_factory", factory)
        object.__setattr__(self, "_pool", pool)
        object.__setattr__(self, "_sup", supervision)
        object.__setattr__(self, "_env", factory())
        object.__setattr__(self, "_steps", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_env"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._env, name, value)

    @property
    def inner(self) -> Any:
        """The env instance playing now."""
        return self._env

    def _restart(self, failure: GameFailure) -> None:
        pool = self._pool
        pool.restarts += 1
        pool.failures.append(str(failure))
        old = self._env
        close = getattr(old, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 -- the game is already broken
                pass
        if pool.restarts > self._sup.max_restarts:
            raise UserError(
                f"games crashed or hung {pool.restarts} times (env.max_restarts = {self._sup.max_restarts}); last: {failure}: "
                "the env is broken (check its installation, e.g. Java for twx:), or raise env.max_restarts / env.step_timeout"
            )
        object.__setattr__(self, "_env", self._factory())

    def reset(self, seed: int) -> str:
        object.__setattr__(self, "_steps", 0)
        for attempt in range(2):
            try:
                obs = _call(self._env.reset, (seed,), self._sup.step_timeout)
            except GameFailure as failure:
                self._restart(failure)
                if attempt == 1:
                    raise UserError(f"the game failed twice in a row on reset({seed}) ({failure}): the env cannot start this item; check the env") from None
                continue
            if not isinstance(obs, str):  # a bug of the env, not a crash of one game: no restart hides it (issue 49)
                raise UserError(f"env {getattr(self._env, 'name', type(self._env).__name__)!r}: reset({seed}) returned a {type(obs).__name__}, "
                                "not the first observation as a string: fix the env's reset")
            return obs
        raise AssertionError("unreachable")

    def step(self, action_text: str):
        from recursa.envs.protocol import StepResult

        object.__setattr__(self, "_steps", self._steps + 1)
        try:
            result = _call(self._env.step, (action_text,), self._sup.step_timeout)
        except GameFailure as failure:
            pool = self._pool
            if not pool.steps_ok and pool.restarts + 1 >= NEVER_STEPPED:
                raise UserError(f"env {getattr(self._env, 'name', type(self._env).__name__)!r}: step failed on each of its first {pool.restarts + 1} calls "
                                f"and never once returned (last: {failure}): the env is broken; fix its step") from None
            self._restart(failure)
            info = {"success": False, "won": False, "invalid": False, "admissible": None, "steps": self._steps, "score": 0.0,
                    "answer": "", "parsed": None, "note": f"game {failure.kind}", "failure": failure.kind, "failure_detail": failure.detail}
            return StepResult(f"(the game {failure.kind} and was restarted; this episode counts as failed)", 0.0, True, info)
        self._pool.steps_ok += 1
        return result

    def close(self) -> None:
        close = getattr(self._env, "close", None)
        if callable(close):
            close()
