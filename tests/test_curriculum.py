"""Curricula (`[curriculum]`): the learning-progress, schedule, answer-form and balance-score math
against hand computations; the arms' seed routing (held-out items unchanged); the arm sampler's
and the tail table's bookkeeping and state; hints and bare prompts; the refusals; and the grpo,
rft and rsipo recipes end to end on the tiny model, with resume equal to an uninterrupted run."""

from __future__ import annotations

import json
import math
import random

import pytest

from recursa.agent import AgentConfig
from recursa.algorithms.curriculum import (
    answer_form,
    arm_probabilities,
    balance_score,
    best_candidate,
    draw_index,
    ema,
    learning_progress,
    schedule_arm,
)
from recursa.config import load_config
from recursa.curriculum import ArmSampler, Curriculum, StepTasks, TailTable, bare_rows, tail_hint
from recursa.envs import make_env, split_seed
from recursa.envs.arithmetic import ArithmeticEnv
from recursa.envs.arms import ArmsEnv, arm_of, arm_seed, route
from recursa.envs.dataset import task_factory
from recursa.errors import UserError
from recursa.generation import SamplingParams
from recursa.rollout import RolloutResult, rollout, rollout_episodes
from recursa.trajectory import Trajectory

from conftest import CorridorEnv

FAST = ["model.name=tiny-random", "run.threads=1", "sampling.max_new_tokens=5", "eval.n=2"]
ARITH_ARMS = ["curriculum.mode=progress", 'curriculum.arms=[{name = "easy", kwargs = {difficulty = 0}}, {name = "hard", kwargs = {difficulty = 2}}]']
HOUSEHOLD = 'env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, tasks = "pick_and_place", max_steps = 4}'
TIME_KEYS = ("time/", "throughput/")


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_rows(run) -> list[dict]:
    return [r for r in _rows(run) if "reward/mean" in r]


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def _curriculum_values(run) -> list[float]:
    return [v for r in _rows(run) for k, v in r.items() if k.startswith("curriculum/")]


# ----------------------------------------------------------------------------- learning progress, by hand


def test_ema_starts_at_the_first_observation_then_moves_by_its_rate():
    assert ema(None, 0.4, 0.5) == 0.4
    assert ema(0.4, 1.0, 0.5) == pytest.approx(0.7)  # 0.4 + 0.5 (1.0 - 0.4)
    assert ema(0.7, 0.0, 0.1) == pytest.approx(0.63)  # 0.7 + 0.1 (0 - 0.7)
    with pytest.raises(ValueError):
        ema(0.5, 1.0, 0.0)


def test_learning_progress_and_arm_probabilities_by_hand():
    lp = learning_progress([0.5, 0.2, 0.9], [0.3, 0.2, 0.5])
    assert lp == pytest.approx([0.2, 0.0, 0.4])
    # p_k = 0.1 / 3 + 0.9 LP_k / 0.6
    assert arm_probabilities(lp, 0.1) == pytest.approx([0.1 / 3 + 0.3, 0.1 / 3, 0.1 / 3 + 0.6])
    assert sum(arm_probabilities(lp, 0.1)) == pytest.approx(1.0)
    assert arm_probabilities([0.0, 0.0], 0.2) == [0.5, 0.5]  # no progress anywhere: uniform
    assert arm_probabilities(lp, 1.0) == pytest.approx([1 / 3] * 3)  # epsilon = 1: uniform
    # a forgotten skill (pass rate falling) is progress too
    assert learning_progress([0.2], [0.6]) == pytest.approx([0.4])


def test_an_arm_never_drawn_gets_the_largest_progress_of_the_others():
    assert learning_progress([0.5, None, 0.1], [0.3, None, 0.2]) == pytest.approx([0.2, 0.2, 0.1])
    assert learning_progress([None, None], [None, None]) == [0.0, 0.0]


def test_draw_index_is_the_inverse_cdf():
    probs = [0.2, 0.0, 0.5, 0.3]
    assert [draw_index(probs, u) for u in (0.0, 0.19, 0.2, 0.69, 0.7, 0.999)] == [0, 0, 2, 2, 3, 3]
    assert draw_index([0.5, 0.5 - 1e-12], 1 - 1e-13) == 1  # rounding below 1: the last arm with mass


def test_schedule_arm_by_steps_and_by_pass_rate_advances():
    assert [schedule_arm(s, [3, 5], 0, 3) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    assert schedule_arm(1, [3, 5], 1, 3) == 1  # a pass-rate advance moves on before step 3
    assert schedule_arm(4, [], 5, 3) == 2  # never past the last arm


def test_answer_form_hides_the_value_keeps_the_shape():
    assert answer_form("-12.5") == "-##.#"
    assert answer_form(" 1,024 ") == "#,###"
    assert answer_form("Paris 75") == "aaaaa ##"


# ----------------------------------------------------------------------------- B-STaR's balance score, by hand


def test_balance_score_by_hand():
    tasks = [
        [("a", True, True), ("a", True, True), ("b", True, False), ("c", True, True)],  # distinct a, b, c: 2 of 3 correct
        [("x", True, False), ("y", True, False)],  # nothing correct
        [(k, True, True) for k in "pqrst"],  # 5 distinct correct, n* = 4
    ]
    bs = balance_score(tasks, n_star=4)
    # bs = min(2/4, 1) * 2/3, 0, min(5/4, 1) * 1
    assert bs.score == pytest.approx((0.5 * 2 / 3 + 0.0 + 1.0) / 3)
    assert bs.exploration == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert bs.exploitation == pytest.approx((2 / 3 + 0.0 + 1.0) / 3)
    # selection by success: only correct samples selected, exploitation is 1 wherever something is selected
    only = [[(k, c, c) for k, _, c in t] for t in tasks]
    sel = balance_score(only, n_star=4)
    assert sel.score == pytest.approx((0.5 + 0.0 + 1.0) / 3) and sel.exploitation == pytest.approx(1.0)
    assert math.isnan(balance_score([[("x", False, False)]], 2).exploitation)


def test_balance_score_denominator_by_hand():
    """B-STaR's paper and release average bs_i over the queries with a selected response. n* = 4,
    only successes selected. One task with 4 distinct correct samples (bs = 1 x 1) and three with
    none: 'all' 1/4, 'selected' 1/1. Four tasks with 2 distinct correct samples each (bs = 2/4 x 1):
    1/2 under both, so the two denominators pick different settings."""
    solved_one = [[(k, True, True) for k in "abcd"]] + [[("x", False, False)] * 4 for _ in range(3)]
    solved_all = [[(k, k in "ac", k in "ac") for k in "abcd"] for _ in range(4)]
    assert balance_score(solved_one, 4).score == pytest.approx(0.25)
    assert balance_score(solved_one, 4, "selected").score == pytest.approx(1.0)
    assert balance_score(solved_all, 4).score == balance_score(solved_all, 4, "selected").score == pytest.approx(0.5)
    # the earlier hand-worked batch: bs = 1/3, 0 (two wrong samples, both selected), 1 -> every task has a selected sample
    mixed = [[("a", True, True), ("b", True, False), ("c", True, True)], [("x", True, False)], [(k, True, True) for k in "pqrst"]]
    assert balance_score(mixed, 4, "selected").score == pytest.approx(balance_score(mixed, 4).score) == pytest.approx((1 / 3 + 1) / 3)
    # a task with nothing selected leaves the mean; no task with one: 0, not NaN
    part = [[("a", True, True)], [("b", False, False)]]
    assert balance_score(part, 2).score == pytest.approx(0.25) and balance_score(part, 2, "selected").score == pytest.approx(0.5)
    assert balance_score([[("x", False, False)]], 2, "selected").score == 0.0
    with pytest.raises(ValueError, match="denominator"):
        balance_score(part, 2, "queries")


class _OneOrAllRollouts:
    """T = 0.5: the first probe task gets 4 distinct correct replies, the others one wrong reply;
    T = 1.0: every task 4 distinct replies, the 1st and 3rd correct."""

    name = "fake"

    def rollout(self, seeds, group_size, sampling, generator, system_prompt, hints=None):
        out = []
        for i, seed in enumerate(seeds):
            for k in range(group_size):
                if sampling.temperature == 0.5:
                    text, ok = ("abcd"[k % 4], True) if i == 0 else ("x", False)
                else:
                    text, ok = "abcd"[k % 4], k % 2 == 0
                out.append(Trajectory("fake", seed, i, [1, 2], [0, 1], [0.0, -1.0], float(ok), ok, text, "q"))
        return RolloutResult(out, None)


@pytest.mark.parametrize("denominator, want", [("all", (1.0, 0.5)), ("selected", (0.5, 1.0))])
def test_bstar_denominator_flips_the_choice(denominator, want):
    from recursa.recipes.rft import bstar_choice

    cfg = load_config(None, ["recipe=rft", "curriculum.bstar.enabled=true", "curriculum.bstar.temperatures=[0.5, 1.0]",
                             "curriculum.bstar.samples=[4]", "curriculum.bstar.probe_tasks=4", "curriculum.bstar.n_star=4",
                             "curriculum.bstar.selected=success", f"curriculum.bstar.denominator={denominator}"])
    choice = bstar_choice(_OneOrAllRollouts(), cfg, 0, None, False, lambda rng: split_seed("train", rng.randrange(100)))
    assert (choice.temperature, choice.balance.score) == pytest.approx(want)


def test_rft_with_bstar_selected_denominator_end_to_end(tmp_path):
    from recursa.recipes import rft

    sets = ["recipe=rft", *FAST, "env.name=toy-corridor", "env.kwargs={max_steps = 3}", "rft.tasks_per_round=2", "rft.group_size=2",
            "curriculum.bstar.enabled=true", "curriculum.bstar.temperatures=[0.7, 1.3]", "curriculum.bstar.samples=[2]",
            "curriculum.bstar.probe_tasks=2", "curriculum.bstar.selected=success", "curriculum.bstar.denominator=selected",
            "eval.after=false", "rft.rounds=1"]
    run = rft.train(load_config(None, sets), tmp_path / "sel", log=lambda *_: None)
    rows = _train_rows(run)
    assert len(rows) == 1 and rows[0]["curriculum/bstar_temperature"] in (0.7, 1.3)
    assert 0.0 <= rows[0]["curriculum/bstar_balance"] <= 1.0
    with pytest.raises(Exception, match="denominator"):
        load_config(None, ["recipe=rft", "curriculum.bstar.enabled=true", "curriculum.bstar.denominator=queries"])


def test_best_candidate_takes_the_first_of_equal_scores():
    assert best_candidate([0.2, 0.5, 0.5, 0.1]) == 1
    with pytest.raises(ValueError):
        best_candidate([])


class _FakeRollouts:
    """A rollout backend whose samples depend only on the temperature: at 0.5 every sample is
    the same correct reply; at 1.0 four distinct replies, the 1st and 3rd correct."""

    name = "fake"

    def rollout(self, seeds, group_size, sampling, generator, system_prompt, hints=None):
        out = []
        for i, seed in enumerate(seeds):
            for k in range(group_size):
                text, ok = ("a", True) if sampling.temperature == 0.5 else ("abcd"[k % 4], k % 2 == 0)
                out.append(Trajectory("fake", seed, i, [1, 2], [0, 1], [0.0, -1.0], float(ok), ok, text, "q"))
        return RolloutResult(out, None)


@pytest.mark.parametrize("selected, want", [("all", (0.5, 2, 0.5)), ("success", (1.0, 4, 1.0))])
def test_bstar_choice_picks_the_pair_a_hand_computation_picks(selected, want):
    """n* = 2. T = 0.5: one distinct correct reply, bs = 1/2 x 1 for G = 2 and 4. T = 1.0, G = 2:
    {a: right, b: wrong}; G = 4: {a, c right; b, d wrong}.
    all:     (0.5, 2) 0.5, (0.5, 4) 0.5, (1.0, 2) 1/2 x 1/2, (1.0, 4) 1 x 2/4 = 0.5 -> the first 0.5
    success: (0.5, 2) 0.5, (0.5, 4) 0.5, (1.0, 2) 1/2 x 1,   (1.0, 4) 1 x 1   = 1.0"""
    from recursa.recipes.rft import bstar_choice

    cfg = load_config(None, ["recipe=rft", "curriculum.bstar.enabled=true", "curriculum.bstar.temperatures=[0.5, 1.0]",
                             "curriculum.bstar.samples=[2, 4]", "curriculum.bstar.probe_tasks=3", "curriculum.bstar.n_star=2",
                             f"curriculum.bstar.selected={selected}"])
    choice = bstar_choice(_FakeRollouts(), cfg, 0, None, False, lambda rng: split_seed("train", rng.randrange(100)))
    assert (choice.temperature, choice.samples, choice.balance.score) == pytest.approx(want)
    assert choice.episodes == 2 * 3 * 4  # 2 temperatures x 3 probe tasks x max(samples)
    assert choice.metrics()["curriculum/bstar_temperature"] == want[0]


# ----------------------------------------------------------------------------- arms: seeds and envs


def test_arm_seeds_route_to_their_arm_and_held_out_seeds_to_the_base():
    assert route(arm_seed(2, 7, 3), 3) == (2, split_seed("train", 7))
    assert arm_of(arm_seed(0, 0, 2), 2) == 0 and arm_of(arm_seed(1, 9_999_999, 2), 2) == 1
    assert route(split_seed("test", 5), 3) == (None, split_seed("test", 5))
    with pytest.raises(ValueError):
        arm_seed(3, 0, 3)
    env = task_factory(load_config(None, ["env.kwargs={difficulty = 1}", "curriculum.mode=schedule", "curriculum.schedule_steps=[2]",
                                          "curriculum.arms=[{kwargs = {difficulty = 0}}, {kwargs = {difficulty = 4}}]"]))()
    assert isinstance(env, ArmsEnv)
    import pickle

    assert pickle.loads(pickle.dumps(task_factory(load_config(None, ["curriculum.mode=progress", "curriculum.arms=[{}, {}]"]))))().n_arms == 2  # Ray workers
    for raw in range(5):
        want = ArithmeticEnv(difficulty=4).reset(split_seed("train", raw))
        assert env.reset(arm_seed(1, raw, 2)) == want and env.difficulty == 4  # attributes are the playing env's
        assert env.reset(arm_seed(0, raw, 2)) == ArithmeticEnv(difficulty=0).reset(split_seed("train", raw))
    for seed in (split_seed("test", 3), split_seed("gate", 8)):  # held-out items: env.kwargs, the seed as given
        assert env.reset(seed) == ArithmeticEnv(difficulty=1).reset(seed) and env.difficulty == 1
        assert env.step(str(ArithmeticEnv(difficulty=1).item(seed).answer)).reward == 1.0


def test_off_leaves_the_task_factory_and_the_recipes_alone():
    cfg = load_config(None, [])
    assert not isinstance(task_factory(cfg)(), ArmsEnv)
    assert Curriculum.open(cfg, False, {}) is None
    assert task_factory(cfg).func.__name__ == "make_env"


# ----------------------------------------------------------------------------- the arm sampler


def _sampler(*sets):
    return ArmSampler(load_config(None, [*sets]).curriculum)


def test_arm_sampler_updates_the_averages_and_restores_them():
    s = _sampler("curriculum.mode=progress", "curriculum.arms=[{}, {}, {}]", "curriculum.fast_rate=0.5", "curriculum.slow_rate=0.1", "curriculum.epsilon=0.1")
    s.begin(0)
    assert s.probs == pytest.approx([1 / 3] * 3)
    seeds = [arm_seed(0, 1, 3), arm_seed(0, 2, 3), arm_seed(2, 1, 3)]
    s.observe(seeds, [[True, False], [False, False], [True, True]])  # arm 0: 1 of 4, arm 2: 2 of 2, arm 1 not drawn
    assert s.fast == [0.25, None, 1.0] and s.slow == [0.25, None, 1.0]
    s.observe([arm_seed(0, 3, 3)], [[True, True]])  # arm 0: 1.0 -> fast 0.25 + 0.5 x 0.75, slow 0.25 + 0.1 x 0.75
    assert s.fast[0] == pytest.approx(0.625) and s.slow[0] == pytest.approx(0.325)
    s.begin(1)
    lp = [0.3, 0.3, 0.0]  # arm 1 never drawn: the largest progress of the others
    assert s.probs == pytest.approx([0.1 / 3 + 0.9 * p / 0.6 for p in lp])
    m = s.metrics()
    assert m["curriculum/progress/arm0"] == pytest.approx(0.3) and "curriculum/pass_fast/arm1" not in m
    again = _sampler("curriculum.mode=progress", "curriculum.arms=[{}, {}, {}]", "curriculum.epsilon=0.1")
    again.load_state_dict(json.loads(json.dumps(s.state_dict())))
    again.begin(1)
    assert again.probs == s.probs
    wrong = _sampler("curriculum.mode=progress", "curriculum.arms=[{}, {}]")
    with pytest.raises(UserError, match="resume with the run's own"):
        wrong.load_state_dict(s.state_dict())


def test_draws_follow_the_probabilities_and_the_generator():
    s = _sampler("curriculum.mode=progress", "curriculum.arms=[{}, {}]")
    s.probs = [0.0, 1.0]
    assert all(arm_of(s.draw(random.Random(i)), 2) == 1 for i in range(20))
    s.probs = [0.5, 0.5]
    a = [s.draw(random.Random(7)) for _ in range(3)]
    assert a == [s.draw(random.Random(7)) for _ in range(3)]  # a seeded generator gives the same tasks


def test_schedule_moves_on_at_its_steps_or_at_the_pass_rate():
    s = _sampler("curriculum.mode=schedule", "curriculum.arms=[{}, {}, {}]", "curriculum.advance_at=0.75", "curriculum.fast_rate=1.0",
                 "curriculum.slow_rate=0.5")
    s.begin(0)
    assert s.probs == [1.0, 0.0, 0.0] and s.metrics()["curriculum/arm"] == 0
    s.observe([arm_seed(0, 1, 3)], [[True, False]])  # 0.5 < 0.75: stay
    s.begin(1)
    assert s.current == 0
    s.observe([arm_seed(0, 2, 3)], [[True, True, True, False]])  # fast = 0.75: move on
    s.begin(2)
    assert s.current == 1 and s.probs == [0.0, 1.0, 0.0]
    t = _sampler("curriculum.mode=schedule", "curriculum.arms=[{}, {}]", "curriculum.schedule_steps=[2]")
    t.begin(1)
    assert t.current == 0
    t.begin(2)
    assert t.current == 1


# ----------------------------------------------------------------------------- the tail table


def _tail(**over):
    sets = [f"curriculum.tail.{k}={v}" for k, v in {"enabled": "true", "min_attempts": 4, "max_offers": 2, "frac": 0.5, **over}.items()]
    return TailTable(load_config(None, ["recipe=rft", *sets]).curriculum.tail, multi_turn=False)


def test_tail_table_enters_offers_solves_and_drops_by_hand():
    t, env = _tail(), ArithmeticEnv()
    t.observe([11, 12, 13], [[False, False], [False, True], [False, False]], hinted=False)  # 2 attempts each: not yet
    assert t.table == {} and t.pending == {11: 2, 13: 2}
    t.observe([11, 13, 14], [[False, False], [False, False, False, False], [False] * 4], hinted=False)
    assert list(t.table) == [11, 13, 14] and t.pending == {} and t.entered == 3
    assert t.quota(4) == 2  # ceil(0.5 x 4)
    seeds, hints = t.offer(2, env)
    assert seeds == [11, 13] and all(h.startswith("Hint: the answer has the form") for h in hints)
    t.observe(seeds, [[False, True], [False, False]], hinted=True)  # 11 solved with its hint, 13 not
    m = t.metrics()
    assert m["curriculum/tail_solved_share"] == 0.5 and m["curriculum/tail_solved_cum"] == 0.5 and m["curriculum/tail_size"] == 2
    seeds, _ = t.offer(2, env)
    assert seeds == [14, 13]  # least offered first
    t.observe(seeds, [[False], [False]], hinted=True)  # 13's second failure: dropped (max_offers = 2)
    m = t.metrics()
    assert list(t.table) == [14] and t.dropped == 1 and m["curriculum/tail_solved_share"] == 0.0
    assert m["curriculum/tail_solved_cum"] == pytest.approx(1 / 3)  # 1 solved of 3 tasks offered so far
    again = _tail()
    again.load_state_dict(json.loads(json.dumps(t.state_dict())))
    assert again.table == t.table and again.state_dict() == t.state_dict()
    t.offer(0, env)
    assert "curriculum/tail_solved_share" not in t.metrics()  # nothing offered: nothing to measure


def test_tail_hints_read_the_oracle():
    env = ArithmeticEnv(difficulty=1)
    seed = split_seed("train", 3)
    answer = str(env.item(seed).answer)
    assert tail_hint(env, seed, "answer_form") == f"Hint: the answer has the form {'#' * len(answer) if answer[0] != '-' else '-' + '#' * (len(answer) - 1)} (each # is a digit, each a is a letter)."
    assert tail_hint(env, seed, "answer") == f"Hint: the correct answer is {answer}."
    tagged = ArithmeticEnv(answer_format="tag")
    assert "<" not in tail_hint(tagged, seed, "answer")  # the answer, not the tagged reply
    game = CorridorEnv(length=4)
    hint = tail_hint(game, 5, "walkthrough", steps=2)
    assert hint == "Hint: a winning play of this game starts with these actions: go east, go east"
    assert tail_hint(game, 5, "walkthrough", steps=0).count("go east") == len(game.walkthrough())
    with pytest.raises(UserError, match="needs a multi-turn game"):
        _tail(hint="walkthrough")


def test_bare_rows_are_the_rows_without_the_hint(tiny_policy):
    agent = AgentConfig(history_turns=1)
    sampling = SamplingParams(4, 1.0, 1.0, ())
    import torch

    def play(hints):
        g = torch.Generator().manual_seed(0)
        return rollout_episodes(tiny_policy, lambda: make_env("toy-corridor", length=3, max_steps=3), [5], 2, sampling, g, None, agent, hints=hints).episodes

    plain, hinted = play(None), play(["Hint: go east twice."])
    for e in plain:  # no hint: the bare rows are the episode's own rows, token for token
        assert [r.token_ids for r in bare_rows(e, tiny_policy.tokenizer, agent, None)] == [r.token_ids for r in e.rows()]
    for e in hinted:
        bare, rows = bare_rows(e, tiny_policy.tokenizer, agent, None), e.rows()
        assert len(bare) == len(rows)
        for b, r, turn in zip(bare, rows, e.turns):
            assert b.token_ids[-len(turn.action_ids):] == turn.action_ids and b.action_mask.count(1) == len(turn.action_ids)
            assert "Hint" in tiny_policy.tokenizer.decode(r.token_ids) and "Hint" not in tiny_policy.tokenizer.decode(b.token_ids)
    g = torch.Generator().manual_seed(0)
    (t,) = rollout(tiny_policy, ArithmeticEnv, [7], 1, sampling, g, "sys", hints=["Hint: two digits."]).trajectories
    (b,) = bare_rows(t, tiny_policy.tokenizer, agent, "sys")
    g = torch.Generator().manual_seed(0)
    (u,) = rollout(tiny_policy, ArithmeticEnv, [7], 1, sampling, g, "sys").trajectories
    first = u.action_mask.index(1)
    assert b.token_ids[: b.action_mask.index(1)] == u.token_ids[:first]  # the prompt the un-hinted rollout renders
    assert b.token_ids[b.action_mask.index(1):] == t.token_ids[t.action_mask.index(1):]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("sets, message", [
    (["curriculum.arms=[{}, {}]"], "are used by curriculum.mode"),
    (["curriculum.mode=progress", "curriculum.arms=[{}]"], "declare at least 2"),
    (["curriculum.mode=progress", 'curriculum.arms=[{name = "a"}, {name = "a"}]'], "distinct name"),
    (["curriculum.mode=progress", 'curriculum.arms=[{name = "a b"}, {}]'], "metric key"),
    (["curriculum.mode=progress", "curriculum.arms=[{}, {}]", "curriculum.slow_rate=0.6"], "must be below curriculum.fast_rate"),
    (["curriculum.mode=schedule", "curriculum.arms=[{}, {}, {}]", "curriculum.schedule_steps=[4]"], "schedule_steps"),
    (["curriculum.mode=schedule", "curriculum.arms=[{}, {}]", "curriculum.schedule_steps=[0]"], "increasing steps >= 1"),
    (["curriculum.mode=progress", "curriculum.arms=[{}, {}]", "curriculum.advance_at=0.5"], "options of curriculum.mode = 'schedule'"),
    (["curriculum.tail.enabled=true", "curriculum.tail.min_attempts=9", "train.group_size=8"], "min_attempts <= group_size"),
    (["curriculum.tail.enabled=true", "rollout.branch=random", "env.name=household"], "rollout.branch"),
    (["recipe=rsipo", "curriculum.tail.enabled=true"], "hatch"),
    (["curriculum.bstar.enabled=true"], "recipe = 'rft'"),
    (["recipe=rft", "curriculum.bstar.enabled=true", "curriculum.bstar.temperatures=[0.0]"], "temperatures"),
    (["recipe=rft", "curriculum.bstar.enabled=true", "curriculum.bstar.samples=[]"], "samples"),
])
def test_config_refusals_are_one_line(sets, message):
    with pytest.raises(UserError, match=message) as err:
        load_config(None, sets)
    assert "\n" not in str(err.value)


def test_a_bad_arm_option_or_hint_kind_fails_before_the_run_directory(tmp_path):
    from recursa.recipes import grpo

    cfg = load_config(None, [*FAST, "curriculum.mode=progress", 'curriculum.arms=[{name = "ok"}, {name = "bad", kwargs = {difficulty = 9}}]'])
    with pytest.raises(UserError, match="curriculum arm 'bad'"):
        grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    cfg = load_config(None, [*FAST, "curriculum.tail.enabled=true", "curriculum.tail.hint=walkthrough", "train.group_size=8"])
    with pytest.raises(UserError, match="needs a multi-turn game"):
        grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- recipes end to end


def test_grpo_learning_progress_with_tail_end_to_end(tmp_path):
    from recursa.recipes import grpo

    sets = [*FAST, *ARITH_ARMS, "train.steps=2", "train.prompts_per_step=4", "train.group_size=2", "curriculum.tail.enabled=true",
            "curriculum.tail.min_attempts=2"]
    run = grpo.train(load_config(None, sets), tmp_path / "run", log=lambda *_: None)
    rows = _train_rows(run)
    assert all(math.isfinite(v) for v in _curriculum_values(run))
    for r in rows:
        drawn = r["curriculum/arm_tasks/easy"] + r["curriculum/arm_tasks/hard"]
        assert drawn + r["curriculum/tail_offered"] == 4 and r["curriculum/arm_prob/easy"] + r["curriculum/arm_prob/hard"] == pytest.approx(1.0)
    # the random model fails every item: step 1's tasks join the table, step 2 re-offers ceil(0.25 x 4) = 1
    assert rows[0]["curriculum/tail_entered"] >= 1 and rows[1]["curriculum/tail_offered"] == 1
    assert "curriculum/tail_solved_share" in rows[1]
    state = json.loads(next((run / "checkpoints").glob("step_*")).joinpath("state.json").read_text())
    assert set(state["curriculum"]) == {"arms", "tail"}


def test_grpo_curriculum_resume_equals_the_uninterrupted_run(tmp_path):
    from recursa.recipes import grpo

    sets = [*FAST, "env.name=toy-corridor", "env.kwargs={max_steps = 3}", "curriculum.mode=progress",
            "curriculum.arms=[{kwargs = {length = 1}}, {kwargs = {length = 3}}]", "train.prompts_per_step=3", "train.group_size=2",
            "curriculum.tail.enabled=true", "curriculum.tail.min_attempts=2", "curriculum.tail.frac=0.3", "run.checkpoint_every=1",
            "eval.after=false", "train.lr=1e-3"]
    full = grpo.train(load_config(None, [*sets, "train.steps=3"]), tmp_path / "full", log=lambda *_: None)
    part = grpo.train(load_config(None, [*sets, "train.steps=1"]), tmp_path / "part", log=lambda *_: None)
    grpo.train(load_config(None, [*sets, "train.steps=3"]), part, resume=True, log=lambda *_: None)
    assert _strip(_train_rows(part)) == _strip(_train_rows(full))
    rows = _train_rows(full)
    assert any(r["curriculum/pass_rate/arm0"] > 0 for r in rows if "curriculum/pass_rate/arm0" in r)  # length 1: one step east, often won
    assert all(math.isfinite(v) for v in _curriculum_values(full))


def test_grpo_schedule_moves_to_the_next_arm_at_its_step(tmp_path):
    from recursa.recipes import grpo

    sets = [*FAST, "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "curriculum.mode=schedule", "curriculum.schedule_steps=[1]",
            'curriculum.arms=[{name = "easy", kwargs = {difficulty = 0}}, {name = "hard", kwargs = {difficulty = 3}}]']
    rows = _train_rows(grpo.train(load_config(None, sets), tmp_path / "run", log=lambda *_: None))
    assert [(r["curriculum/arm"], r["curriculum/arm_tasks/easy"], r["curriculum/arm_tasks/hard"]) for r in rows] == [(0, 2, 0), (1, 0, 2)]
    assert "curriculum/pass_rate/hard" not in rows[0] and "curriculum/pass_rate/hard" in rows[1]


def test_grpo_on_a_game_with_arms_and_walkthrough_hints(tmp_path):
    from recursa.recipes import grpo

    sets = [*FAST, "env.name=household", HOUSEHOLD, "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "curriculum.mode=progress",
            "curriculum.arms=[{kwargs = {rooms = 1}}, {kwargs = {rooms = 2, tasks = 'heat_then_place', max_steps = 6}}]",
            "curriculum.tail.enabled=true", "curriculum.tail.min_attempts=2", "curriculum.tail.frac=0.5"]
    run = grpo.train(load_config(None, sets), tmp_path / "run", log=lambda *_: None)
    rows = _train_rows(run)
    assert all(math.isfinite(v) for v in _curriculum_values(run)) and rows[1]["curriculum/tail_offered"] >= 1
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == 2


def test_rft_with_bstar_tail_and_arms_end_to_end_and_resume(tmp_path):
    from recursa.recipes import rft

    sets = ["recipe=rft", *FAST, "env.name=toy-corridor", "env.kwargs={max_steps = 3}", "rft.tasks_per_round=3", "rft.group_size=2",
            "curriculum.mode=progress", "curriculum.arms=[{kwargs = {length = 1}}, {kwargs = {length = 3}}]", "curriculum.tail.enabled=true",
            "curriculum.tail.min_attempts=2", "curriculum.bstar.enabled=true", "curriculum.bstar.temperatures=[0.7, 1.3]",
            "curriculum.bstar.samples=[2, 3]", "curriculum.bstar.probe_tasks=2", "run.checkpoint_every=1", "eval.after=false", "train.lr=1e-3"]
    full = rft.train(load_config(None, [*sets, "rft.rounds=3"]), tmp_path / "full", log=lambda *_: None)
    part = rft.train(load_config(None, [*sets, "rft.rounds=1"]), tmp_path / "part", log=lambda *_: None)
    rft.train(load_config(None, [*sets, "rft.rounds=3"]), part, resume=True, log=lambda *_: None)
    assert _strip(_train_rows(part)) == _strip(_train_rows(full))
    rows = _train_rows(full)
    assert all(r["curriculum/bstar_temperature"] in (0.7, 1.3) and r["curriculum/bstar_samples"] in (2, 3) for r in rows)
    assert all(math.isfinite(v) for v in _curriculum_values(full))
    # budget: each round's probe (2 temperatures x 2 tasks x 3) plus its B x G attempts at the chosen G
    spent = 0
    for r in rows:
        spent += 12 + 3 * int(r["curriculum/bstar_samples"])
        assert r["budget/episodes"] == spent and f"rft/pass@{int(r['curriculum/bstar_samples'])}" in r
    tasks = [json.loads(line) for line in (full / "tasks.jsonl").read_text().splitlines()]
    assert all("hinted" in t for t in tasks) and len(tasks) == 9


def test_rsipo_draws_its_tasks_from_the_arms(tmp_path):
    from recursa.recipes import rsipo

    sets = [*FAST, "train.steps=1", "curriculum.mode=schedule", "curriculum.schedule_steps=[5]",
            "curriculum.arms=[{name = 'two', kwargs = {rooms = 2}}, {name = 'one', kwargs = {rooms = 1}}]"]
    run = rsipo.train(load_config("examples/rsipo_smoke.toml", sets), tmp_path / "run", log=lambda *_: None)
    (row,) = _train_rows(run)
    assert row["curriculum/arm_tasks/two"] == 2 and row["curriculum/arm_prob/one"] == 0.0 and "curriculum/pass_rate/two" in row
    replay = [json.loads(line) for line in (run / "replay.jsonl").read_text().splitlines()]
    assert replay and all(arm_of(r["seed"], 2) == 0 for r in replay)


def test_held_out_evaluation_is_the_same_with_and_without_arms(tmp_path, tiny_policy):
    from recursa.evaluate import evaluate
    from recursa.envs import EnvPool

    plain = load_config(None, ["env.kwargs={difficulty = 1}"])
    arms = load_config(None, ["env.kwargs={difficulty = 1}", "curriculum.mode=progress", "curriculum.arms=[{kwargs = {difficulty = 3}}, {}]"])
    results = [evaluate(tiny_policy, EnvPool(task_factory(c)), "arithmetic", "test", 6, 4, None, seeds=list(range(split_seed("test", 0), split_seed("test", 6))))
               for c in (plain, arms)]
    assert [(i.seed, i.completion, i.reward) for i in results[0].items] == [(i.seed, i.completion, i.reward) for i in results[1].items]


def test_curriculum_tasks_put_the_tail_first_with_hints():
    cfg = load_config(None, ["curriculum.tail.enabled=true", "curriculum.tail.min_attempts=2", "train.group_size=2", "curriculum.tail.frac=0.5"])
    cur = Curriculum(cfg, multi_turn=False)
    env = ArithmeticEnv()
    first = cur.tasks(0, 4, env)
    from recursa.recipes.grpo import train_seeds

    assert first.seeds == train_seeds(load_config(None, ["train.prompts_per_step=4"]), 0) and first.hints is None  # no tail yet: train_seeds' tasks
    cur.observe(first, [[False, False]] * 4)
    second = cur.tasks(1, 4, env)
    assert second.kinds == ["tail", "tail", "fresh", "fresh"] and second.seeds[:2] == first.seeds[:2]
    assert second.hints[0].startswith("Hint:") and second.hints[2:] == [None, None]
    assert isinstance(second, StepTasks) and second.n_tail == 2


EXAMPLES = sorted((__import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "curriculum").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_configs_run_on_the_tiny_model(path, tmp_path):
    """The configs the lead measures (135M from an SFT warm start) load, and run one step on the
    tiny model without the warm start."""
    import importlib

    cfg = load_config(path)
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.init.from_run
    assert cfg.curriculum.mode != "off" or cfg.curriculum.bstar.enabled, f"{path.name} switches nothing on"
    sets = ["model.name=tiny-random", "init.from_run=''", "run.threads=1", "eval.n=2", "sampling.max_new_tokens=4", "eval.every=0"]
    if cfg.recipe == "rft":
        sets += ["rft.rounds=1", "rft.tasks_per_round=2", "rft.group_size=2", "curriculum.bstar.probe_tasks=1", "curriculum.bstar.samples=[2]"]
    else:
        sets += ["train.steps=1", "train.prompts_per_step=2", "train.group_size=8"]
    cfg = load_config(path, sets)
    run = importlib.import_module(f"recursa.recipes.{cfg.recipe}").train(cfg, tmp_path / "run", log=lambda *_: None)
    (row,) = _train_rows(run)
    assert all(math.isfinite(v) for v in _curriculum_values(run))
    if cfg.curriculum.mode != "off":
        assert sum(v for k, v in row.items() if k.startswith("curriculum/arm_tasks/")) >= 1
    if cfg.curriculum.bstar.enabled:  # the round's temperature is one of the candidates, and its probe was counted
        assert row["curriculum/bstar_temperature"] in cfg.curriculum.bstar.temperatures and row["curriculum/bstar_probe_episodes"] >= 1
