"""The OpenEnv adapter (recursa/envs/openenv_env.py): a guessing env served by a real OpenEnv
server on localhost (uvicorn in a thread) and the same class in process, played to a win by
bisection; invalid actions, max_steps, a dead URL and a missing install; two GRPO steps on the
tiny model through the server."""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
from typing import Any, Optional

import pytest

pytest.importorskip("openenv")

from openenv.core.env_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State  # noqa: E402

from recursa.envs import make_env  # noqa: E402
from recursa.errors import UserError  # noqa: E402


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str


class GuessEnvironment(Environment):
    """Guess a number in 1..16 drawn from the reset seed; each wrong guess is told higher or lower."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, high: int = 16):
        super().__init__()
        self.high, self.target, self.moves = high, 1, 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.target, self.moves = random.Random(seed).randint(1, self.high), 0
        return GuessObservation(message=f"Guess my number between 1 and {self.high}.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self.moves += 1
        if not action.guess.strip().isdigit():
            return GuessObservation(message="Say a number.", reward=0.0)
        guess = int(action.guess)
        if guess == self.target:
            return GuessObservation(message="Right!", reward=1.0, done=True)
        return GuessObservation(message="higher" if guess < self.target else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return State(step_count=self.moves)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="guess", description="Find the number: reply with one number.")


CLASS_SPEC = f"openenv:{__name__}:GuessEnvironment"


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _bisect(env, seed: int):
    obs = env.reset(seed)
    assert obs == "Guess my number between 1 and 16."
    lo, hi, guesses = 1, 16, []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        r = env.step(str(guess))
        if r.done:
            return r, guesses
        lo, hi = (guess + 1, hi) if r.obs == "higher" else (lo, guess - 1)


@pytest.mark.parametrize("where", ["server", "class"])
def test_a_guessing_env_is_won_by_bisection_and_the_seed_fixes_the_number(where, server_url):
    env = make_env(f"openenv:{server_url}" if where == "server" else CLASS_SPEC, max_steps=8)
    try:
        assert env.task == "Find the number: reply with one number." and env.admissible_actions() is None
        result, guesses = _bisect(env, 7)
        assert result.info["won"] and result.reward == 1.0 and result.obs == "Right!" and len(guesses) <= 5
        assert guesses[-1] == random.Random(7).randint(1, 16)  # the env drew the number from recursa's seed
        assert _bisect(env, 7)[1] == guesses
        assert len({_bisect(env, s)[1][-1] for s in range(8)}) > 1
    finally:
        env.close()


def test_json_actions_invalid_replies_and_max_steps(server_url):
    env = make_env(f"openenv:{server_url}", max_steps=3, action_field=None, env_kwargs=None)
    env.reset(0)
    assert env.field == "guess"
    env.field = None  # the reply is then the action as JSON, as for an action with several fields
    bad = env.step("eight")
    assert bad.info["invalid"] and bad.reward == -0.1 and not bad.done and "JSON" in bad.info["note"]
    refused = env.step('{"guess": 3, "extra": 1}')  # the server's Action model forbids extra fields
    assert refused.info["invalid"] and "refused" in refused.info["note"] and refused.obs == "Guess my number between 1 and 16."
    last = env.step(json.dumps({"guess": "99"}))
    assert last.done and not last.info["won"] and last.info["note"] == "max_steps" and last.obs == "lower"
    env.close()


def test_a_dead_url_bad_kwargs_and_a_missing_install_are_one_line(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(UserError, match=f"no OpenEnv server answers at http://127.0.0.1:{port}/schema"):
        make_env(f"openenv:http://127.0.0.1:{port}", timeout=2)
    with pytest.raises(UserError, match="action_field 'move' is not a field of the env's action"):
        make_env(CLASS_SPEC, action_field="move")
    with pytest.raises(UserError, match="not an openenv Environment subclass"):
        make_env(f"openenv:{__name__}:GuessAction")
    monkeypatch.setitem(sys.modules, "openenv", None)
    with pytest.raises(UserError, match="needs openenv-core: pip install openenv-core"):
        make_env(CLASS_SPEC)


def test_grpo_trains_two_steps_through_the_server(tmp_path, server_url):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", f"env.name=openenv:{server_url}", "env.kwargs.max_steps=3",
        "sampling.max_new_tokens=5", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "eval.n=2",
    ])
    run = train(cfg, tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2 and train_rows[0]["batch/rows"] == 2 * 2 * train_rows[0]["episode/turns_mean"]
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == 2


def test_the_family_is_listed():
    from recursa.envs import list_envs

    assert any(name == "openenv:<url-or-class>" and "not installed" not in text for name, text in list_envs())
