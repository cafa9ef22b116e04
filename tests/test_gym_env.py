"""The gymnasium adapter (recursa/envs/gym_env.py): text observations, named actions, a won
FrozenLake, invalid actions, a missing install, two GRPO steps on the tiny model."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("gymnasium")

from recursa.envs import make_env  # noqa: E402
from recursa.errors import UserError  # noqa: E402

SPEC = "recursa.envs.gym_env:GymTextEnv"


def test_frozen_lake_is_played_by_name_and_won():
    env = make_env("gym:FrozenLake-v1", is_slippery=False, max_steps=10)
    obs = env.reset(0)
    assert env.name == "gym:FrozenLake-v1" and env.admissible_actions() == ["left", "down", "right", "up"]
    assert "SFFF" in obs and "\x1b" not in obs and "row 0, column 0" in obs and "goal G" in env.task
    results = [env.step(a) for a in ["down", "down", "right", "right", "down"]]
    assert "row 3, column 2" in results[-1].obs and not any(r.done for r in results)
    last = env.step("Right")  # matched to the list case-insensitively
    assert last.done and last.reward == 1.0 and last.info["won"] and last.info["steps"] == 6


def test_an_invalid_action_leaves_the_env_alone_and_max_steps_ends_it():
    env = make_env(SPEC, id="FrozenLake-v1", is_slippery=False, max_steps=2)
    env.reset(0)
    bad = env.step("jump")
    assert bad.info["invalid"] and bad.reward == -0.1 and "row 0, column 0" in bad.obs and not bad.done
    end = env.step("right")
    assert end.done and not end.info["won"] and "row 0, column 1" in end.obs


def test_blackjack_deals_each_seed_its_own_hand():
    env = make_env(SPEC, id="Blackjack-v1")
    hands = {env.reset(seed) + env.state_key() for seed in range(8)}
    assert len(hands) > 1 and env.admissible_actions() == ["stick", "hit"]


def test_bad_ids_kwargs_and_a_missing_install_are_one_line(monkeypatch):
    with pytest.raises(UserError, match="gymnasium cannot make 'NoSuchGame-v0'"):
        make_env(SPEC, id="NoSuchGame-v0")
    with pytest.raises(UserError, match="action_names lists 2"):
        make_env(SPEC, id="FrozenLake-v1", action_names=["a", "b"])
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(UserError, match="needs gymnasium: pip install gymnasium"):
        make_env(SPEC, id="FrozenLake-v1")


@pytest.mark.parametrize("episode", ["turn", "chat"])
def test_grpo_trains_two_steps_on_a_gymnasium_env(tmp_path, episode):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=gym:FrozenLake-v1", "env.kwargs.is_slippery=false", "env.kwargs.max_steps=3",
        f"agent.episode={episode}", "sampling.max_new_tokens=5", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "eval.n=2",
    ])
    run = train(cfg, tmp_path / episode, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2 and train_rows[0]["batch/rows"] == 2 * 2 * 3
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == 2


def test_the_family_is_listed():
    from recursa.envs import list_envs

    assert any(name == "gym:<id>" and "not installed" not in text for name, text in list_envs())
