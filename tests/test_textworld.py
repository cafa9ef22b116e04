"""TextWorld adapter (`textworld:<generator>`): oracle, invalid actions, cache, limits, errors.

Needs `pip install textworld`. Generating a game takes 1-3 s, so the tests share one
module-wide cache folder and use a few small games.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("textworld", reason="TextWorld is not installed (pip install textworld)")

from recursa.envs import AgentEnv, list_envs, make_env, split_seed  # noqa: E402
from recursa.envs import textworld_env as tw_mod  # noqa: E402
from recursa.envs.textworld_env import TextWorldEnv, game_path  # noqa: E402
from recursa.errors import UserError  # noqa: E402

SMALL: dict[str, dict] = {
    "cooking": {},  # one room, one ingredient to take
    "coin_collector": {"level": 2},
    "treasure_hunter": {"level": 2},
    "simple": {"rewards": "sparse"},
}
HELD_OUT = [split_seed("test", i) for i in range(2)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("recursa-cache")


@pytest.fixture(scope="module")
def envs(cache):
    made: dict[str, TextWorldEnv] = {}

    def get(gen: str) -> TextWorldEnv:
        if gen not in made:
            made[gen] = TextWorldEnv(gen, cache_dir=cache, **SMALL[gen])
        return made[gen]

    yield get
    for env in made.values():
        env.close()


def test_small_settings_cover_every_generator():
    assert sorted(SMALL) == sorted(tw_mod.generator_names())


@pytest.mark.parametrize("gen", sorted(SMALL))
def test_walkthrough_wins_on_held_out_seeds(envs, gen):
    env = envs(gen)
    assert isinstance(env, AgentEnv)
    for seed in HELD_OUT:
        obs = env.reset(seed)
        assert env.task and "\n" not in env.task and obs.startswith(env.task)
        assert "$$" not in obs  # the banner is not part of the observation
        plan = env.walkthrough()
        assert plan, f"{gen} seed {seed}: no walkthrough"
        total = 0.0
        for i, action in enumerate(plan):
            result = env.step(action)
            total += result.reward
            assert not result.info["invalid"] and result.info["steps"] == i + 1
            assert result.done == (i == len(plan) - 1)
        assert result.info["won"] and result.info["success"] and result.reward == 1.0 and total == 1.0
        assert result.info["score"] == result.info["max_score"] > 0
        with pytest.raises(RuntimeError):
            env.step(plan[-1])


def test_invalid_action_leaves_state_and_costs_penalty(envs, cache):
    env = TextWorldEnv("cooking", cache_dir=cache, invalid_penalty=0.5, **SMALL["cooking"])
    try:
        env.reset(HELD_OUT[0])
        admissible = env.admissible_actions()
        look = env.step("look")
        for bad in ("xyzzy", "", "eat meal", "go north"):  # no meal yet; one room only
            assert bad not in admissible
            result = env.step(bad)
            assert result.info["invalid"] and result.reward == -0.5 and not result.done
            assert result.info["admissible"] == admissible
        assert env.step("look").obs == look.obs
        assert env.admissible_actions() == admissible
        assert not env.step("  LOOK ").info["invalid"]  # case/space-insensitive match
        for action in env.walkthrough():
            result = env.step(action)
        assert result.info["won"] and result.info["steps"] == 7 + len(env.walkthrough())
    finally:
        env.close()


def test_same_seed_same_game(envs, tmp_path):
    env = envs("coin_collector")
    seed = HELD_OUT[0]
    obs, task = env.reset(seed), env.task
    assert env.reset(seed) == obs
    # generated afresh in another cache: the same game
    with TextWorldEnv("coin_collector", cache_dir=tmp_path, **SMALL["coin_collector"]) as fresh:
        assert fresh.reset(seed) == obs and fresh.task == task
        assert fresh.last_generation_s is not None
        assert fresh.admissible_actions() == env.admissible_actions()
    assert env.reset(HELD_OUT[1]) != obs


def test_cache_reuses_generated_games(envs, cache, monkeypatch):
    env = envs("treasure_hunter")
    env.reset(HELD_OUT[0])
    path = env.game_file
    assert path == cache / "treasure_hunter" / path.parent.name / f"{HELD_OUT[0]}.z8"
    assert path.is_file() and path.with_suffix(".json").is_file()
    assert path == game_path("treasure_hunter", SMALL["treasure_hunter"], HELD_OUT[0], cache_dir=cache)
    mtime = path.stat().st_mtime_ns

    def no_generation(*args, **kwargs):
        raise AssertionError("the cached game was generated again")

    monkeypatch.setattr(tw_mod, "_generate", no_generation)
    with TextWorldEnv("treasure_hunter", cache_dir=cache, **SMALL["treasure_hunter"]) as second:
        second.reset(HELD_OUT[0])
        assert second.game_file == path and second.last_generation_s is None
    assert path.stat().st_mtime_ns == mtime
    # explicit defaults share the key; other options get their own folder
    assert game_path("cooking", {"recipe": 1, "go": 1}, 5, cache) == game_path("cooking", {}, 5, cache)
    assert game_path("cooking", {"recipe": 2, "take": 2}, 5, cache).parent != game_path("cooking", {}, 5, cache).parent
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # no leftovers


def test_cache_lives_under_recursa_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RECURSA_CACHE", str(tmp_path))
    path = game_path("coin_collector", {"level": 2}, 7)
    assert path.parent.parent == tmp_path / "textworld" / "coin_collector" and path.name == "7.z8"


def test_held_out_content_follows_the_split():
    options = tw_mod._check_options("cooking", {})
    assert tw_mod._settings_for("cooking", options, split_seed("train", 3))["split"] == "train"
    assert tw_mod._settings_for("cooking", options, split_seed("gate", 3))["split"] == "valid"
    assert tw_mod._settings_for("cooking", options, split_seed("test", 3))["split"] == "test"
    assert tw_mod._settings_for("cooking", {**options, "split": "all"}, 3)["split"] is None
    simple = tw_mod._check_options("simple", {})
    assert tw_mod._settings_for("simple", simple, split_seed("test", 0))["test"] is True
    assert tw_mod._settings_for("simple", simple, split_seed("gate", 0))["test"] is False


def test_step_limit_ends_unwon(envs, cache):
    with TextWorldEnv("cooking", cache_dir=cache, max_steps=3, **SMALL["cooking"]) as env:
        env.reset(HELD_OUT[0])
        results = [env.step("look"), env.step("dance"), env.step("inventory")]
        assert [r.done for r in results] == [False, False, True]
        assert not results[-1].info["won"] and results[-1].reward == 0.0 and results[-1].info["steps"] == 3


def test_errors():
    with pytest.raises(UserError, match="did you mean textworld:cooking"):
        make_env("textworld:cookin")
    with pytest.raises(UserError, match="did you mean recipe"):
        TextWorldEnv("cooking", recipes=2)
    with pytest.raises(UserError, match="go must be one of"):
        TextWorldEnv("cooking", go=4)
    with pytest.raises(UserError, match="take"):
        TextWorldEnv("cooking", recipe=1, take=2)
    with pytest.raises(UserError, match="level"):
        TextWorldEnv("coin_collector", level=301)
    with pytest.raises(UserError, match="True or False"):
        TextWorldEnv("cooking", cut="yes")
    with pytest.raises(UserError, match="seed"):
        TextWorldEnv("coin_collector").reset(-1)


def test_make_env_and_list_envs(cache):
    env = make_env("textworld:tw-coin_collector", cache_dir=cache, max_steps=9)
    assert isinstance(env, TextWorldEnv) and env.name == "textworld:coin_collector" and env.max_steps == 9
    assert any(spec == "textworld:<generator>" for spec, _ in list_envs())
    assert os.fspath(env.folder).startswith(os.fspath(cache))
