"""Multi-turn rollouts, agent prompting, GiGPO, scripted baselines, the recipe on a game."""

from __future__ import annotations

import json

import pytest
import torch

import recursa.engines as engines_mod
from recursa.agent import AgentConfig, parse_action, render_turn
from recursa.algorithms.gigpo import discounted_returns, step_advantages
from recursa.config import load_config
from recursa.envs import make_env
from recursa.evaluate import evaluate_scripted
from recursa.generation import SamplingParams
from recursa.recipes.grpo import train
from recursa.rollout import rollout_episodes


def test_parse_action_exact_fuzzy_invalid():
    cfg = AgentConfig()
    adm = ["go east", "go west", "take key from table"]
    assert parse_action("Go East.", adm, cfg).action == "go east"
    assert parse_action("Action: go west\nbecause...", adm, cfg).action == "go west"
    p = parse_action("take the key from table", adm, cfg)
    assert p.matched and p.fuzzy and p.action == "take key from table"
    assert not parse_action("take the key from table", adm, AgentConfig(fuzzy=False)).matched
    p = parse_action("dance wildly", adm, cfg)
    assert not p.matched and p.action == "dance wildly"


def test_render_turn_keeps_task_and_last_k_turns():
    cfg = AgentConfig(history_turns=2, max_obs_chars=50)
    hist = [(f"obs {i}", f"act {i}") for i in range(5)]
    text = render_turn("Your task is to: win.", "x" * 500, ["a", "b"], hist, cfg)
    assert text.startswith("Your task is to: win.")
    assert "act 4" in text and "act 3" in text and "act 2" not in text
    assert "x" * 51 not in text  # clipped
    assert "- a" in text and cfg.instruction in text


def test_discounted_returns_by_hand():
    # r = [0, 0, 1], gamma = 0.5: R = [0.25, 0.5, 1]
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]


def test_gigpo_step_advantages_by_hand():
    # Two episodes of group 0 both start in state "s0"; episode 0 wins in 2 steps, episode 1
    # does not. gamma = 1: returns at s0 are 1 and 0 -> mean 0.5, unbiased std = 0.7071.
    # A_S(s0) = +0.7071 for episode 0 and -0.7071 for episode 1; every other state is
    # visited once -> 0. Episode 2 is in another group and never shares an anchor.
    adv = step_advantages(
        groups=[0, 0, 1],
        anchors=[["s0", "s1"], ["s0", "s2"], ["s0"]],
        rewards=[[0.0, 1.0], [0.0, 0.0], [1.0]],
        gamma=1.0,
    )
    assert adv[0][0] == pytest.approx(0.5 / 0.70710678, abs=1e-5)
    assert adv[1][0] == pytest.approx(-0.5 / 0.70710678, abs=1e-5)
    assert adv[0][1] == adv[1][1] == adv[2][0] == 0.0
    centred = step_advantages([0, 0], [["s"], ["s"]], [[1.0], [0.0]], gamma=1.0, norm="none")
    assert centred == [[0.5], [-0.5]]
    with pytest.raises(ValueError):
        step_advantages([0], [["a", "b"]], [[1.0]])


def test_oracle_wins_and_random_is_worse():
    factory = lambda: make_env("toy-corridor")  # noqa: E731
    oracle = evaluate_scripted("oracle", factory, "toy-corridor", "test", 20)
    assert oracle.success_rate == 1.0 and oracle.invalid_rate == 0.0
    rnd = evaluate_scripted("random", factory, "toy-corridor", "test", 50, seed=1)
    assert rnd.success_rate < 1.0 and rnd.mean_steps > oracle.mean_steps


def test_episode_rollout_is_token_in_token_out(tiny_policy, monkeypatch):
    recorded = []
    real = engines_mod.generate  # what the native engine samples with

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        recorded.append(([list(p) for p in args[2]], [list(s.token_ids) for s in out]))
        return out

    monkeypatch.setattr(engines_mod, "generate", spy)
    tok = tiny_policy.tokenizer
    ro = rollout_episodes(
        tiny_policy, lambda: make_env("toy-corridor", max_steps=3), [1, 2], 2,
        SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0), None, AgentConfig(),
    )
    assert len(ro.episodes) == 4 and ro.turns == 3  # every random-model episode runs to the step limit
    assert len(recorded) == 3
    retokenizes_differently = 0
    for j, ep in enumerate(ro.episodes):
        assert len(ep.turns) == 3 and not ep.won and ep.finish_reason == "max_steps"
        for k, (turn, row) in enumerate(zip(ep.turns, ep.rows())):
            prompts, samples = recorded[k]  # call k generated turn k of every live episode, in order
            assert turn.prompt_ids == prompts[j] and turn.action_ids == samples[j]
            assert row.token_ids == turn.prompt_ids + turn.action_ids
            assert sum(row.action_mask) == len(turn.action_ids)
            if tok.encode(tok.decode(turn.action_ids), add_special_tokens=False) != turn.action_ids:
                retokenizes_differently += 1
    assert retokenizes_differently > 0  # the case that re-tokenizing would get wrong was exercised
    # the next turn's prompt shows the previous action in the history
    ep = ro.episodes[0]
    assert f"Action: {ep.turns[0].action}" in tok.decode(ep.turns[1].prompt_ids)


@pytest.mark.parametrize("step_adv", ["none", "gigpo"])
def test_recipe_on_a_multiturn_game(tmp_path, step_adv):
    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=toy-corridor", "env.kwargs.max_steps=3",
        "sampling.max_new_tokens=5", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
        f"algo.step_advantage={step_adv}", "eval.n=4", "train.lr=1e-3",
    ])
    run = train(cfg, tmp_path / step_adv, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2
    assert train_rows[0]["batch/rows"] == 2 * 2 * 3 and "episode/invalid_rate" in train_rows[0]
    after = json.loads((run / "eval" / "after.json").read_text())
    assert after["n"] == 4 and after["mean_steps"] == 3.0 and "invalid_rate" in after
