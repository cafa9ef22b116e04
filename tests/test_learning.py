"""Learning tests: the recipe must actually improve a policy (minutes; CI runs them)."""

from __future__ import annotations

import json

import pytest

from recursa.config import load_config
from recursa.recipes.grpo import train
from recursa.stats import paired_compare


@pytest.mark.slow
def test_tiny_model_learns_toy_task(tmp_path):
    """GRPO on the tiny random model raises held-out reward on the toy digits task
    (reward = fraction of digit characters) far above its starting point."""
    cfg = load_config(
        None,
        [
            "model.name=tiny-random",
            "env.name=toy-digits",
            "sampling.max_new_tokens=8",
            "train.steps=40",
            "train.prompts_per_step=4",
            "train.group_size=8",
            "train.micro_batch_size=32",
            "train.lr=3e-3",
            "eval.n=64",
            "eval.every=20",
        ],
    )
    run = train(cfg, tmp_path / "learn", log=lambda *_: None)
    before = json.loads((run / "eval" / "before.json").read_text())
    after = json.loads((run / "eval" / "after.json").read_text())
    assert before["mean_reward"] < 0.1
    assert after["mean_reward"] > before["mean_reward"] + 0.3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3
    cmp = paired_compare([i["success"] for i in before["items"]], [i["success"] for i in after["items"]])
    assert cmp["p_greater"] < 0.01


@pytest.mark.slow
def test_tiny_model_learns_toy_task_with_rebel(tmp_path):
    """REBEL (`algo.objective = "rebel"`, a regression of the sequences' log-ratio differences
    onto their reward differences, docs/objectives.md) raises held-out reward on the toy digits
    task as GRPO does, at the same settings."""
    cfg = load_config(
        None,
        [
            "model.name=tiny-random",
            "env.name=toy-digits",
            "algo.objective=rebel",
            "sampling.max_new_tokens=8",
            "train.steps=40",
            "train.prompts_per_step=4",
            "train.group_size=8",
            "train.micro_batch_size=32",
            "train.lr=3e-3",
            "eval.n=64",
            "eval.every=20",
        ],
    )
    run = train(cfg, tmp_path / "learn", log=lambda *_: None)
    before = json.loads((run / "eval" / "before.json").read_text())
    after = json.loads((run / "eval" / "after.json").read_text())
    assert before["mean_reward"] < 0.1
    assert after["mean_reward"] > before["mean_reward"] + 0.3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3
    cmp = paired_compare([i["success"] for i in before["items"]], [i["success"] for i in after["items"]])
    assert cmp["p_greater"] < 0.01
