"""Tests for the built-in household env (recursa.envs.household)."""

from __future__ import annotations

import random

import pytest

from recursa.envs import AgentEnv, list_envs, make_env, split_seeds, system_prompt_of
from recursa.envs.household import OPTIONS, TASK_TYPES, HouseholdEnv
from recursa.errors import UserError

INFO_KEYS = {"won", "success", "invalid", "admissible", "steps", "score"}


def random_episode(env: HouseholdEnv, seed: int, policy_seed: int) -> tuple[list[str], list[str], bool]:
    """Play uniformly random admissible actions; return (actions, observations, won)."""
    rng = random.Random(policy_seed)
    observations = [env.reset(seed)]
    actions: list[str] = []
    while True:
        action = rng.choice(env.admissible_actions())
        result = env.step(action)
        actions.append(action)
        observations.append(result.obs)
        if result.done:
            return actions, observations, result.info["won"]


def play(env: HouseholdEnv, actions: list[str]):
    results = []
    for action in actions:
        assert action in env.admissible_actions(), action
        results.append(env.step(action))
    return results


# ------------------------------------------------------------------------ registry / API


def test_make_env_builds_household_and_it_is_an_agent_env():
    env = make_env("household", rooms=2)
    assert isinstance(env, HouseholdEnv)
    assert isinstance(env, AgentEnv)
    assert env.name == "household"
    assert system_prompt_of(env) is None
    assert env.max_steps == 30 and env.invalid_penalty == 0.0
    assert any(spec == "household" for spec, _ in list_envs())


def test_reset_sets_one_line_task_and_first_observation_states_it():
    env = HouseholdEnv()
    obs = env.reset(3)
    assert env.task.startswith("Your task is to: put ") and env.task.endswith(".")
    assert "\n" not in env.task
    assert env.task in obs and obs.startswith("You are in the middle of the ")
    assert env.task_type in TASK_TYPES
    assert env.admissible_actions() == sorted(env.admissible_actions())


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_task_layout_and_observations():
    a, b = HouseholdEnv(), HouseholdEnv()
    for seed in (0, 17, 1_000_000_005, 2_000_000_123):
        assert a.reset(seed) == b.reset(seed)
        assert a.task == b.task
        assert a.walkthrough() == b.walkthrough()
        assert a.admissible_actions() == b.admissible_actions()
        assert random_episode(a, seed, policy_seed=9) == random_episode(b, seed, policy_seed=9)


def test_different_seeds_vary_tasks_and_layouts():
    env = HouseholdEnv()
    tasks, firsts, types = set(), set(), set()
    for seed in range(60):
        firsts.add(env.reset(seed))
        tasks.add(env.task)
        types.add(env.task_type)
    assert types == set(TASK_TYPES)
    assert len(tasks) >= 35
    assert len(firsts) >= 50


def test_options_change_the_home():
    small, big = HouseholdEnv(rooms=1, distractors=0), HouseholdEnv(rooms=6, distractors=4)
    small.reset(5)
    big.reset(5)
    assert not any(a.startswith("go to ") and a.split()[-1].isalpha() for a in small.admissible_actions())
    assert len(big._ep.layout.rooms) == 6 and len(small._ep.layout.rooms) == 1
    env = HouseholdEnv(objects_per_room=7, rooms=2)
    env.reset(1)
    assert len(env._ep.layout.objects) == 14


# ---------------------------------------------------------------------------- walkthrough


def test_walkthrough_wins_on_200_seeds_across_splits():
    env = HouseholdEnv()
    types = set()
    for seed in split_seeds("train", 100) + split_seeds("test", 100):
        env.reset(seed)
        plan = env.walkthrough()
        assert plan and len(plan) <= env.max_steps
        results = play(env, plan)
        for i, result in enumerate(results):
            assert set(result.info) == INFO_KEYS
            assert result.info["steps"] == i + 1
            assert result.info["invalid"] is False
        last = results[-1]
        assert last.done and last.reward == 1.0 and last.info["won"] and last.info["success"]
        assert last.info["score"] == 1.0 and last.info["admissible"] == []
        assert all(r.reward == 0.0 and not r.done and not r.info["won"] for r in results[:-1])
        types.add(env.task_type)
    assert types == set(TASK_TYPES)


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_each_task_type_alone_wins_and_reads_right(task_type):
    env = HouseholdEnv(tasks=[task_type])
    adjective = {"heat_then_place": " hot ", "cool_then_place": " cool ", "clean_then_place": " clean "}
    for seed in split_seeds("gate", 30):
        env.reset(seed)
        assert env.task_type == task_type
        if task_type in adjective:
            assert adjective[task_type] in env.task
        plan = env.walkthrough()
        verbs = [a.split()[0] for a in plan]
        if task_type != "pick_and_place":
            assert verbs.count(task_type.split("_")[0]) == 1
        assert play(env, plan)[-1].info["won"]


@pytest.mark.parametrize(
    "options", [{"rooms": 1, "distractors": 0, "objects_per_room": 1}, {"rooms": 6, "distractors": 4}]
)
def test_walkthrough_wins_at_extreme_options(options):
    env = HouseholdEnv(**options)
    for seed in range(40):
        env.reset(seed)
        assert play(env, env.walkthrough())[-1].info["won"]


@pytest.mark.parametrize("options", [{"rooms": 1, "objects_per_room": 2, "distractors": 0, "max_steps": 12}, {}, {"rooms": 6, "distractors": 4, "max_steps": 200}])
def test_search_walkthrough_looks_until_it_sees_the_object_and_wins(options):
    env = HouseholdEnv(**options)
    for seed in split_seeds("train", 60):
        env.reset(seed)
        plan, shortest = env.search_walkthrough(), env.walkthrough()
        results = play(env, plan)
        assert results[-1].info["won"] and not any(r.info["invalid"] for r in results)
        assert len(plan) >= len(shortest)
        take = next(i for i, a in enumerate(plan) if a.startswith("take "))
        assert not any(a.startswith("take ") for a in plan[:take])  # nothing picked up while looking
        if options.get("rooms") == 1:  # one room: always the same order, the listed one without microwave, sink, stove
            looked = [a.removeprefix("go to ") for a in plan[:take] if a.startswith("go to ")]
            assert looked == ["cabinet 1", "countertop 1", "fridge 1"][: len(looked)]


def test_search_walkthrough_by_hand():
    env = HouseholdEnv(rooms=1, objects_per_room=2, distractors=0, tasks=["cool_then_place"], max_steps=12)
    env.reset(split_seeds("train", 1)[0])
    assert env.walkthrough() == ["go to countertop 1", "take bowl 1 from countertop 1", "go to fridge 1", "cool bowl 1 with fridge 1",
                                 "go to countertop 1", "put bowl 1 on countertop 1"]
    # the cabinet first (opened: no bowl in it), then the countertop, where the bowl is: the shortest plan from there
    assert env.search_walkthrough() == ["go to cabinet 1", "open cabinet 1", *env.walkthrough()]
    env.step("go to fridge 1")
    assert env.search_walkthrough()[:2] == ["go to cabinet 1", "open cabinet 1"]  # from the reset state, not the current one


def test_walkthrough_is_from_reset_state_even_mid_episode():
    env = HouseholdEnv()
    env.reset(11)
    plan = env.walkthrough()
    env.step(plan[0])
    env.step("look")
    assert env.walkthrough() == plan


def test_pick_and_place_goal_is_not_already_met():
    env = HouseholdEnv(tasks="pick_and_place")
    for seed in range(100):
        env.reset(seed)
        assert not env._satisfied()
        assert any(a.startswith("take ") for a in env.walkthrough())


# ------------------------------------------------------------------------- invalid actions


def test_invalid_actions_leave_state_unchanged_and_cost_the_penalty():
    env = HouseholdEnv(invalid_penalty=0.25, max_steps=100)
    env.reset(4)
    plan = env.walkthrough()
    play(env, plan[:2])  # somewhere mid-episode
    other_room_recs = [
        r for room, recs in env._ep.layout.room_receptacles.items() if room != env._ep.state.room for r in recs
    ]
    bad = ["fly to the moon", "", "take unicorn 1 from countertop 1", "put mug 1 on nothing 3", "heat"]
    bad += [f"go to {r}" for r in other_room_recs[:2]]
    for action in bad:
        before = (env.snapshot(), env.admissible_actions())
        steps = env._ep.steps
        result = env.step(action)
        assert result.obs == "Nothing happens."
        assert result.reward == -0.25 and not result.done
        assert result.info["invalid"] is True and result.info["won"] is False
        assert result.info["steps"] == steps + 1
        assert (env.snapshot(), env.admissible_actions()) == before
        assert result.info["admissible"] == before[1]
    look_before = env.step("look").obs
    env.step("dance")
    assert env.step("look").obs == look_before
    assert play(env, plan[2:])[-1].info["won"]  # still winnable after the invalid steps


def test_inadmissible_but_well_formed_actions_are_invalid():
    env = HouseholdEnv(tasks="heat_then_place")
    env.reset(2)
    state = env.snapshot()
    admissible = env.admissible_actions()
    # Nothing is held and no receptacle is reached yet: every take/put/open/heat is invalid.
    for action in ("open fridge 1", "heat potato 1 with microwave 1", "examine fridge 1", "close cabinet 1"):
        assert action not in admissible
        assert env.step(action).info["invalid"]
    assert env.snapshot() == state


def test_actions_are_matched_case_and_space_insensitively():
    env = HouseholdEnv()
    env.reset(8)
    first = env.walkthrough()[0]
    result = env.step("  " + first.upper().replace(" ", "   ") + ".\n")
    assert result.info["invalid"] is False


# ------------------------------------------------------------------------------ episode end


def test_step_limit_ends_episode_unwon():
    env = HouseholdEnv(max_steps=5, invalid_penalty=1.0)
    env.reset(0)
    rewards = [env.step(a).reward for a in ("look", "nonsense", "inventory", "look")]
    last = env.step("look")
    assert rewards == [0.0, -1.0, 0.0, 0.0]
    assert last.done and not last.info["won"] and not last.info["success"] and last.info["steps"] == 5
    assert last.reward == 0.0 and last.info["score"] == 0.0 and last.info["admissible"] == []
    with pytest.raises(RuntimeError):
        env.step("look")


def test_short_step_limit_cuts_the_walkthrough():
    env = HouseholdEnv(max_steps=3)
    env.reset(1)
    plan = env.walkthrough()
    assert len(plan) > 3
    results = [env.step(a) for a in plan[:3]]
    assert results[-1].done and not results[-1].info["won"]


def test_step_before_reset_raises():
    with pytest.raises(RuntimeError):
        HouseholdEnv().step("look")


# ----------------------------------------------------------------------------------- rules


def test_rules_carry_one_closed_hides_contents_and_heating_works():
    env = HouseholdEnv(tasks="heat_then_place")
    for seed in range(30):
        env.reset(seed)
        plan = env.walkthrough()
        take = next(i for i, a in enumerate(plan) if a.startswith("take "))
        if plan[take - 1].startswith("open "):
            break
    else:
        pytest.fail("no heat walkthrough starts by opening a container")
    obj = plan[take].split(" from ")[0][len("take ") :]
    container = plan[take - 1][len("open ") :]
    play(env, plan[: take - 1])
    assert env.step(f"examine {container}").obs == f"The {container} is closed."
    assert f"take {obj} from {container}" not in env.admissible_actions()
    assert obj in env.step(f"open {container}").obs
    play(env, [plan[take]])
    assert not any(a.startswith("take ") for a in env.admissible_actions())  # hands full
    assert env.step("inventory").obs == f"You are carrying: {'an' if obj[0] in 'aeiou' else 'a'} {obj}."
    assert env.step(f"examine {obj}").obs == f"There's nothing special about the {obj}."
    heat = next(a for a in plan if a.startswith("heat "))
    play(env, plan[take + 1 : plan.index(heat) + 1])
    assert env.step(f"examine {obj}").obs == f"The {obj} is hot."


def test_random_admissible_play_rarely_wins():
    env = HouseholdEnv()
    wins = sum(random_episode(env, seed, policy_seed=seed)[2] for seed in range(100))
    assert wins <= 20
    # ...yet winning is reachable by chance with a long enough horizon
    long_env = HouseholdEnv(rooms=1, distractors=0, objects_per_room=1, tasks="pick_and_place", max_steps=300)
    assert sum(random_episode(long_env, seed, policy_seed=seed)[2] for seed in range(30)) > 0


# ---------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "options",
    [
        {"rooms": 0},
        {"rooms": 7},
        {"rooms": "3"},
        {"rooms": True},
        {"objects_per_room": 0},
        {"objects_per_room": 11},
        {"distractors": -1},
        {"distractors": 5},
        {"tasks": ["fly"]},
        {"tasks": ""},
        {"tasks": []},
        {"tasks": 3},
        {"max_steps": 0},
        {"invalid_penalty": -0.5},
        {"invalid_penalty": "high"},
        {"system_prompt": 5},
    ],
)
def test_bad_options_raise_user_error(options):
    with pytest.raises(UserError, match="household"):
        HouseholdEnv(**options)
    with pytest.raises(UserError):
        make_env("household", **options)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(UserError, match="valid options: " + ", ".join(OPTIONS)):
        make_env("household", room=3)


def test_tasks_accepts_comma_string_and_bad_seed_is_user_error():
    env = HouseholdEnv(tasks="cool_then_place, clean_then_place")
    assert env.tasks == ("cool_then_place", "clean_then_place")
    with pytest.raises(UserError):
        env.reset(-1)


def test_goal_names_what_the_task_text_says():
    env = HouseholdEnv(tasks=["pick_and_place", "cool_then_place"])
    with pytest.raises(RuntimeError, match="reset"):
        env.goal
    seen = set()
    for seed in range(40):
        env.reset(seed)
        g = env.goal
        seen.add(g["task_type"])
        assert g["task_type"] == env.task_type
        assert g["obj_kind"] in env.task and g["rec_kind"] in env.task
        assert g["verb"] == (None if g["task_type"] == "pick_and_place" else "cool")
        if g["verb"]:
            assert f"cool {g['obj_kind']}" in env.task  # "put a cool bottle on the countertop"
            assert any(a.startswith("cool ") for a in env.walkthrough())
    assert seen == {"pick_and_place", "cool_then_place"}
