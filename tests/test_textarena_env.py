"""The TextArena adapter (recursa/envs/textarena_env.py): GuessTheNumber played to a win by
bisection, the seed fixes the item, a missing install, two GRPO steps on the tiny model."""

from __future__ import annotations

import json
import re
import sys

import pytest

pytest.importorskip("textarena")

from recursa.envs import make_env  # noqa: E402
from recursa.errors import UserError  # noqa: E402

SPEC = "recursa.envs.textarena_env:TextArenaEnv"


def _bisect(env, seed):
    obs = env.reset(seed)
    lo, hi = 1, int(re.search(r"between 1 and (\d+)", obs).group(1))
    guesses = []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        r = env.step(f"[{guess}]")
        if r.done:
            return r, guesses
        assert "[Player]" not in r.obs or f"[{guess}]" in r.obs  # only what the game added since the last move
        if "higher" in r.obs:
            lo = guess + 1
        else:
            hi = guess - 1


def test_guess_the_number_is_won_by_bisection_and_the_seed_fixes_the_number():
    env = make_env("ta:GuessTheNumber-v0", max_steps=10)
    assert env.name == "ta:GuessTheNumber-v0" and env.admissible_actions() is None
    result, guesses = _bisect(env, 3)
    assert result.info["won"] and result.reward > 0 and len(guesses) <= 5
    again, same = _bisect(env, 3)
    assert same == guesses  # a pure function of the seed
    numbers = {tuple(_bisect(env, s)[1]) for s in range(6)}
    assert len(numbers) > 1


def test_invalid_moves_count_and_max_steps_ends_the_game_unwon():
    env = make_env(SPEC, game="GuessTheNumber-v0", max_steps=3)
    _, guesses = _bisect(env, 0)
    wrong = [g for g in range(1, 21) if g != guesses[-1]][:2]
    env.reset(0)
    bad = env.step("no guess here")
    assert bad.info["invalid"] and not bad.done and "invalid move" in bad.obs
    results = [env.step(f"[{g}]") for g in wrong]
    assert [r.done for r in results] == [False, True] and not results[-1].info["invalid"]
    assert not results[-1].info["won"] and results[-1].reward == 0.0 and results[-1].info["note"] == "max_steps"


def test_unknown_games_and_a_missing_install_are_one_line(monkeypatch):
    with pytest.raises(UserError, match="textarena cannot make 'NoSuchGame-v0'"):
        make_env(SPEC, game="NoSuchGame-v0")
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(UserError, match="needs textarena: pip install textarena"):
        make_env(SPEC, game="GuessTheNumber-v0")


@pytest.mark.parametrize("episode", ["turn", "chat"])
def test_grpo_trains_two_steps_on_a_textarena_game(tmp_path, episode):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=ta:GuessTheNumber-v0", "env.kwargs.max_steps=3",
        f"agent.episode={episode}", "sampling.max_new_tokens=5", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "eval.n=2",
    ])
    run = train(cfg, tmp_path / episode, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2 and train_rows[0]["batch/rows"] == 2 * 2 * train_rows[0]["episode/turns_mean"]  # one row per move
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == 2


def test_the_family_is_listed():
    from recursa.envs import list_envs

    assert any(name == "ta:<game>" and "not installed" not in text for name, text in list_envs())
