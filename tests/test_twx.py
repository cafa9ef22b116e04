"""TextWorldExpress adapter (`twx:<game>`): oracle, invalid actions, folds, limits, errors.

Needs `pip install textworld-express`; the tests that start a game also need Java on PATH.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("textworld_express", reason="textworld-express is not installed (pip install textworld-express)")

from recursa.envs import AgentEnv, make_env, split_seed, split_seeds  # noqa: E402
from recursa.envs import twx as twx_mod  # noqa: E402
from recursa.envs.twx import TWXEnv, twx_fold_and_seed  # noqa: E402
from recursa.errors import UserError  # noqa: E402

needs_java = pytest.mark.skipif(
    shutil.which("java") is None, reason="Java is not on PATH (TextWorldExpress runs in a JVM)"
)

# A small setting of every game (defaults where the game has no size parameters).
SMALL: dict[str, dict] = {
    "coin": {"numLocations": 3, "numDistractorItems": 0, "includeDoors": False},
    "cookingworld": {"numLocations": 2, "numIngredients": 2, "numDistractorItems": 2, "includeDoors": False},
    "twc": {"numLocations": 1, "numItemsToPutAway": 2},
    "mapreader": {"numLocations": 4, "maxDistanceApart": 2},
    "arithmetic": {},
    "sorting": {},
    "simonsays": {},
    "peckingorder": {},
}


@pytest.fixture(scope="module")
def envs():
    made: dict[str, TWXEnv] = {}

    def get(game: str) -> TWXEnv:
        if game not in made:
            made[game] = TWXEnv(game, **SMALL[game])
        return made[game]

    yield get
    for env in made.values():
        env.close()


def test_small_settings_cover_every_installed_game():
    assert sorted(SMALL) == sorted(twx_mod.game_names())


@needs_java
@pytest.mark.parametrize("game", sorted(SMALL))
def test_walkthrough_wins_on_held_out_seeds(envs, game):
    env = envs(game)
    assert isinstance(env, AgentEnv)
    for seed in split_seeds("test", 4):
        obs = env.reset(seed)
        assert env.task and "\n" not in env.task and obs.startswith(env.task)
        plan = env.walkthrough()
        assert plan, f"{game} seed {seed}: no walkthrough"
        assert plan[0] != "look around"  # TWX's leading "look around" is dropped (the rest still wins)
        total = 0.0
        for i, action in enumerate(plan):
            assert action in env.admissible_actions()
            result = env.step(action)
            total += result.reward
            assert not result.info["invalid"]
            assert result.info["steps"] == i + 1
            assert result.done == (i == len(plan) - 1)
        assert result.info["won"] and result.info["success"] and result.reward == 1.0
        assert total == 1.0  # partial scores are not rewards
        assert result.info["score"] == 1.0


@needs_java
def test_walkthrough_does_not_disturb_the_episode(envs):
    env = envs("twc")
    env.reset(split_seed("test", 1))
    plan = env.walkthrough()
    first = env.step(plan[0])
    before = env.admissible_actions()
    assert env.walkthrough() == plan  # replays, then restores the state
    assert env.admissible_actions() == before
    for action in plan[1:]:
        result = env.step(action)
    assert result.info["won"] and first.info["steps"] == 1 and result.info["steps"] == len(plan)


@needs_java
def test_invalid_action_leaves_state_and_costs_penalty():
    with TWXEnv("coin", invalid_penalty=0.25, **SMALL["coin"]) as env:
        seed = split_seed("test", 2)
        env.reset(seed)
        admissible = env.admissible_actions()
        look = env.step("look around")
        blocked = next(d for d in ("move north", "move south", "move east", "move west") if d not in admissible)
        for bad in ("fly to the moon", "", blocked):
            assert bad not in admissible
            result = env.step(bad)
            assert result.info["invalid"] and result.reward == -0.25 and not result.done
            assert result.info["admissible"] == admissible
        assert env.step("look around").obs == look.obs
        assert env.admissible_actions() == admissible
        assert env.step("  LOOK   Around ").info["invalid"] is False  # case/space-insensitive match
        # the invalid steps were not sent: the walkthrough still wins from here
        for action in env.walkthrough():
            result = env.step(action)
        assert result.info["won"] and result.info["steps"] == 6 + len(env.walkthrough())


@needs_java
def test_same_seed_same_game_across_instances(envs):
    env = envs("cookingworld")
    with TWXEnv("cookingworld", **SMALL["cookingworld"]) as other:
        for seed in (3, split_seed("gate", 3), split_seed("test", 3)):
            obs = env.reset(seed)
            assert other.reset(seed) == obs and other.task == env.task
            assert other.admissible_actions() == env.admissible_actions()
            assert env.reset(seed) == obs  # resetting again replays the same game
        assert env.reset(split_seed("test", 4)) != env.reset(split_seed("test", 5))


@needs_java
def test_split_maps_to_twx_fold(envs, monkeypatch):
    env = envs("twc")
    calls = []
    original = env._env.reset

    def spy(**kwargs):
        calls.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(env._env, "reset", spy)
    for split, fold, game_set in (("train", "train", 1), ("gate", "dev", 2), ("test", "test", 3)):
        calls.clear()
        env.reset(split_seed(split, 7))
        assert calls and all(c["gameFold"] == fold and c["seed"] == 7 for c in calls)
        assert (env.fold, env.twx_seed) == (fold, 7)
        props = env._env.getGenerationProperties()
        assert props["gameSet"] == game_set and props["seed"] == 7
    assert twx_fold_and_seed(split_seed("test", 999_999_999)) == ("test", 999_999_999)
    # the same index in another fold is another game (different object pool)
    assert env.reset(split_seed("train", 7)) != env.reset(split_seed("test", 7))


@needs_java
def test_step_limit_ends_unwon(envs):
    with TWXEnv("coin", max_steps=3, **SMALL["coin"]) as env:
        env.reset(split_seed("test", 0))
        results = [env.step("inventory"), env.step("not an action"), env.step("inventory")]
        assert [r.done for r in results] == [False, False, True]
        assert not results[-1].info["won"] and results[-1].reward == 0.0 and results[-1].info["steps"] == 3
        with pytest.raises(RuntimeError):
            env.step("inventory")


@needs_java
def test_errors_on_bad_parameters():
    with pytest.raises(UserError, match="numLocations"):
        TWXEnv("coin", numLocation=3)  # a typo: suggestion in the message
    with pytest.raises(UserError, match="less than or equal"):
        TWXEnv("coin", numLocations=100)
    with pytest.raises(UserError, match="int or a bool"):
        TWXEnv("coin", numLocations="three")
    with pytest.raises(UserError, match="no parameter"):
        TWXEnv("arithmetic", numLocations=3)


def test_unknown_game_and_bad_arguments():
    with pytest.raises(UserError, match="did you mean twx:coin"):
        make_env("twx:coins")
    with pytest.raises(UserError, match="unknown TextWorldExpress game"):
        TWXEnv("zork")
    with pytest.raises(UserError, match="max_steps"):
        TWXEnv("coin", max_steps=0)


def test_missing_java_is_a_user_error(monkeypatch):
    monkeypatch.setattr(twx_mod.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="Java"):
        TWXEnv("coin")


@needs_java
def test_make_env_and_list_envs():
    from recursa.envs import list_envs

    with make_env("twx:arithmetic", max_steps=7) as env:
        assert isinstance(env, TWXEnv) and env.name == "twx:arithmetic" and env.max_steps == 7
    assert any(spec == "twx:<game>" for spec, _ in list_envs())
