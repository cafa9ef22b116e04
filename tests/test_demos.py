"""Demonstrations: prompt format, target masks, and the train-seeds-only rule."""

from __future__ import annotations

import json

import pytest

from recursa.agent import AgentConfig, render_turn
from recursa.config import load_config
from recursa.demos import build_demos, jsonl_demos, reference_demos, require_train_seeds, transcript_row, walkthrough_demos
from recursa.envs import EnvPool, make_env, split_seed, split_seeds
from recursa.envs.household import HouseholdEnv
from recursa.errors import UserError
from recursa.rollout import render_prompt


def _targets(row, tok) -> str:
    return tok.decode([t for t, m in zip(row.token_ids, row.action_mask) if m], skip_special_tokens=False)


def test_require_train_seeds_rejects_held_out():
    require_train_seeds(split_seeds("train", 3), "x")
    for split in ("gate", "test"):
        with pytest.raises(UserError, match=f"in the {split} split"):
            require_train_seeds([1, split_seed(split, 7)], "walkthrough demonstrations")


def test_walkthrough_rows_match_the_rollout_prompt(tiny_policy):
    tok = tiny_policy.tokenizer
    agent = AgentConfig(history_turns=1)
    env = make_env("toy-corridor")
    seeds = split_seeds("train", 4)
    demos = walkthrough_demos(env, seeds, tok, "Be brief.", agent)
    assert demos.items == 4 and not demos.dropped
    first = [r for r in demos.rows if r.seed == seeds[0]]
    check = make_env("toy-corridor")
    obs = check.reset(seeds[0])
    history = []
    for row, action in zip(first, check.walkthrough()):
        prompt = render_prompt(tok, render_turn(check.task, obs, check.admissible_actions(), history, agent), "Be brief.")
        k = len(prompt)
        assert row.token_ids[:k] == prompt and not any(row.action_mask[:k])
        assert all(row.action_mask[k:])
        assert _targets(row, tok) == action + tok.eos_token  # the action, then the end-of-turn token
        history.append((obs, action))
        obs = check.step(action).obs
    assert len(first) == len(history) >= 2  # one row per walkthrough step (the corridor is 2-3 rooms long)


def test_walkthrough_refuses_held_out_seeds(tiny_policy):
    with pytest.raises(UserError, match="test split"):
        walkthrough_demos(make_env("toy-corridor"), [0, split_seed("test", 0)], tiny_policy.tokenizer, None, AgentConfig())


def test_walkthrough_that_does_not_win_is_dropped(tiny_policy):
    class Broken:
        name = "broken"
        task, max_steps, invalid_penalty = "Win.", 3, 0.0

        def reset(self, seed):
            return "start"

        def admissible_actions(self):
            return ["wait"]

        def walkthrough(self):
            return ["wait"]

        def step(self, action):
            from recursa.envs import StepResult

            return StepResult("still", 0.0, True, {"won": False, "invalid": False, "admissible": ["wait"]})

    demos = walkthrough_demos(Broken(), [0, 1], tiny_policy.tokenizer, None, AgentConfig())
    assert demos.rows == [] and demos.dropped["walkthrough does not win"] == 2


def test_reference_demos_score_and_drop(tiny_policy):
    tok = tiny_policy.tokenizer
    env = make_env("arithmetic", difficulty=0)
    demos = reference_demos(env, split_seeds("train", 5), tok, None)
    assert demos.items == 5
    for row in demos.rows:
        assert _targets(row, tok) == str(env.item(row.seed).answer) + tok.eos_token

    class Wrong:
        name = "wrong"

        def reset(self, seed):
            return "1 + 1?"

        def reference(self):
            return "3"

        def step(self, text):
            from recursa.envs import StepResult

            return StepResult("", 0.0, True, {"success": text == "2"})

    demos = reference_demos(Wrong(), [0, 1], tok, None)
    assert demos.rows == [] and demos.dropped["reference does not score"] == 2
    with pytest.raises(UserError, match="test split"):
        reference_demos(env, [split_seed("test", 1)], tok, None)


def test_transcript_masks_every_assistant_turn(tiny_policy):
    tok = tiny_policy.tokenizer
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "go east"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "go west"},
    ]
    row = transcript_row(messages, tok, "Be brief.")
    assert _targets(row, tok) == f"go east{tok.eos_token}go west{tok.eos_token}"
    text = tok.decode(row.token_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.")  # the configured system prompt is prepended


def test_jsonl_demos_enforce_train_seeds_and_report_lines(tmp_path, tiny_policy):
    tok = tiny_policy.tokenizer
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "seed": 5}
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "seed": 6}) + "\n")
    demos = jsonl_demos(p, tok, None)
    assert demos.items == 2 and [r.seed for r in demos.rows] == [5, 6]
    p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "seed": split_seed("gate", 2)}) + "\n")
    with pytest.raises(UserError, match=r"d.jsonl:2: seed .* gate split"):
        jsonl_demos(p, tok, None)
    p.write_text('{"messages": "nope"}\n')
    with pytest.raises(UserError, match="d.jsonl:1"):
        jsonl_demos(p, tok, None)
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    with pytest.raises(UserError, match="no assistant message"):
        jsonl_demos(p, tok, None)


def test_build_demos_auto_source(tiny_policy):
    cfg = load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=toy-corridor", "data.n=3", "data.start=10"])
    demos = build_demos(cfg, EnvPool(lambda: make_env("toy-corridor")), tiny_policy.tokenizer)
    assert demos.source == "walkthrough" and {r.seed for r in demos.rows} == set(split_seeds("train", 3, start=10))
    cfg = load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=arithmetic", "data.n=3"])
    assert build_demos(cfg, EnvPool(lambda: make_env("arithmetic")), tiny_policy.tokenizer).source == "reference"
    with pytest.raises(UserError, match="data.path"):
        load_config(None, ["recipe=sft", "data.source=jsonl"])


def test_hinted_games_are_spread_evenly():
    from recursa.demos import hinted_games

    assert hinted_games(6, 0.5) == [1, 3, 5]
    assert hinted_games(4, 1.0) == [0, 1, 2, 3]
    assert hinted_games(5, 0.0) == []
    assert hinted_games(3, 0.34) == [2]  # round(3 x 0.34) = 1 game
    assert len(hinted_games(32, 0.25)) == 8


def test_alike_game_is_another_game_sharing_words():
    from recursa.demos import alike_game

    tasks = ["put a hot apple on the table.", "put a cool apple in the fridge.", "put a hot apple on the table.", "zzz"]
    assert alike_game(tasks, 0) == 2 and alike_game(tasks, 2) == 0  # the same task line, never the game itself
    assert alike_game(tasks, 1) in (0, 2)
    assert alike_game(tasks, 3) is None  # no other game shares a word
    assert alike_game(["only one"], 0) is None


def test_win_hinted_rows_show_another_games_walkthrough(tiny_policy):
    from recursa.agent import win_hint
    from recursa.demos import alike_game

    tok, agent = tiny_policy.tokenizer, AgentConfig(history_turns=1)
    kwargs = dict(rooms=1, objects_per_room=2, distractors=0, max_steps=12)
    seeds = split_seeds("train", 6)
    plain = walkthrough_demos(make_env("household", **kwargs), seeds, tok, None, agent)
    demos = walkthrough_demos(make_env("household", **kwargs), seeds, tok, None, agent, win_hints=0.5, hint_chars=600)
    assert demos.items == plain.items == 6 and demos.hinted == 3  # games 1, 3, 5
    assert demos.rows[: len(plain.rows)] == plain.rows  # the bare rows come first, unchanged
    extra = demos.rows[len(plain.rows) :]
    assert {r.seed for r in extra} == {seeds[1], seeds[3], seeds[5]}
    env = make_env("household", **kwargs)
    tasks, plans = [], []
    for s in seeds:
        env.reset(s)
        tasks.append(env.task)
        plans.append(env.walkthrough())
    for i in (1, 3, 5):
        j = alike_game(tasks, i)
        assert j is not None and j != i
        hint = win_hint(tasks[j], plans[j], 600)
        assert hint.startswith(f"Actions that won a similar game ({tasks[j]}): {plans[j][0]}, ")
        rows = [r for r in extra if r.seed == seeds[i]]
        bare = [r for r in plain.rows if r.seed == seeds[i]]
        assert len(rows) == len(bare) == len(plans[i])
        obs, history = env.reset(seeds[i]), []
        for row, base, action in zip(rows, bare, plans[i]):
            prompt = render_prompt(tok, render_turn(env.task, obs, env.admissible_actions(), history, agent, hint=hint), None)
            assert row.token_ids[: len(prompt)] == prompt and not any(row.action_mask[: len(prompt)])
            assert _targets(row, tok) == _targets(base, tok) == action + tok.eos_token
            assert row.info["hint"] == hint
            history.append((obs, action))
            obs = env.step(action).obs
    clipped = walkthrough_demos(make_env("household", **kwargs), seeds[:2], tok, None, agent, win_hints=1.0, hint_chars=40)
    assert all(len(r.info["hint"]) == 40 and r.info["hint"].endswith("...") for r in clipped.rows if "hint" in r.info)
    assert "also with a hint" in demos.summary()


def test_win_hints_need_walkthroughs(tiny_policy):
    with pytest.raises(UserError, match="win_hints"):
        load_config(None, ["recipe=sft", "data.source=reference", "data.win_hints=0.5"])
    cfg = load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=arithmetic", "data.n=3", "data.win_hints=0.5"])
    with pytest.raises(UserError, match="single-turn"):
        build_demos(cfg, EnvPool(lambda: make_env("arithmetic")), tiny_policy.tokenizer)


def test_search_demos_demonstrate_the_searching_play(tiny_policy):
    kwargs = {"rooms": 1, "objects_per_room": 2, "distractors": 0, "max_steps": 12}
    seeds = split_seeds("train", 6)
    agent = AgentConfig(history_turns=1)
    tok = tiny_policy.tokenizer
    demos = walkthrough_demos(make_env("household", **kwargs), seeds, tok, None, agent, search=True)
    env = make_env("household", **kwargs)
    plans = [(env.reset(s), env.search_walkthrough())[1] for s in seeds]
    shortest = [(env.reset(s), env.walkthrough())[1] for s in seeds]
    assert demos.items == 6 and [r.info["action"] for r in demos.rows] == [a for p in plans for a in p]
    assert plans != shortest  # some of the six games' objects are not in the first place looked
    cfg = load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=household", "data.n=2", 'data.walkthrough="search"'])
    built = build_demos(cfg, EnvPool(lambda: make_env("household")), tok)
    env = make_env("household")
    assert [r.info["action"] for r in built.rows] == [a for s in split_seeds("train", 2) for a in (env.reset(s), env.search_walkthrough())[1]]


class _NoSearchGame(HouseholdEnv):
    search_walkthrough = None  # a multi-turn game that only knows its shortest walkthrough


def test_search_demos_need_a_game_that_can_search(tiny_policy):
    with pytest.raises(UserError, match="data.walkthrough"):
        load_config(None, ["recipe=sft", "data.source=reference", 'data.walkthrough="search"'])
    cfg = load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=arithmetic", "data.n=3", 'data.walkthrough="search"'])
    with pytest.raises(UserError, match="single-turn"):
        build_demos(cfg, EnvPool(lambda: make_env("arithmetic")), tiny_policy.tokenizer)
    with pytest.raises(UserError, match="search_walkthrough"):
        walkthrough_demos(_NoSearchGame(), split_seeds("train", 1), tiny_policy.tokenizer, None, AgentConfig(), search=True)
