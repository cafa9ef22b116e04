"""Expert iteration: selection, its statistics, task scheduling, the recipe end to end."""

from __future__ import annotations

import json

import pytest

from recursa.config import load_config
from recursa.envs import split_of
from recursa.recipes import rft, sft
from recursa.recipes.rft import Attempt, attempt_stats, keep_solutions, round_seeds
from recursa.stats import pass_at_k


def _a(seed, success, key, reward=None):
    return Attempt(seed, float(success) if reward is None else reward, success, key, [])


def test_pass_at_k_by_hand():
    # n=4 attempts, c=1 success: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer failures than k
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_keep_solutions_cap_dedupe_best_first():
    attempts = [
        _a(1, True, "x", 0.5), _a(1, True, "y", 0.9), _a(1, True, "y", 0.9), _a(1, False, "z"),
        _a(2, True, "p"), _a(2, True, "q"), _a(2, True, "r"),
        _a(3, False, "n"),
    ]
    kept = keep_solutions(attempts, per_task_cap=2, dedupe=True)
    assert [(a.seed, a.key) for a in kept] == [(1, "y"), (1, "x"), (2, "p"), (2, "q")]
    assert len(keep_solutions(attempts, per_task_cap=0, dedupe=False)) == 6
    assert [(a.seed, a.key) for a in keep_solutions(attempts, per_task_cap=1, dedupe=True)] == [(1, "y"), (2, "p")]  # best-of-G


def test_keep_solutions_prefers_the_shortest_success():
    # two wins of task 1 with equal reward: the 2-turn one first, the 6-turn loop second
    long, short = Attempt(1, 1.0, True, "take | put | take | put | take | put", [], 6), Attempt(1, 1.0, True, "take | put", [], 2)
    assert [a.length for a in keep_solutions([long, short], per_task_cap=1, dedupe=True)] == [2]
    assert [a.length for a in keep_solutions([long, short], per_task_cap=1, dedupe=True, prefer_short=False)] == [6]


def test_attempt_stats_by_hand():
    # task 1: 1 of 4 succeed; task 2: 0 of 4. pass@1 = (0.25 + 0) / 2; pass@4 = (1 + 0) / 2.
    attempts = [_a(1, True, "a"), _a(1, False, "b"), _a(1, False, "b"), _a(1, False, "b")] + [_a(2, False, "c")] * 4
    st = attempt_stats(attempts, 4)
    assert st["rft/pass@1"] == pytest.approx(0.125)
    assert st["rft/pass@4"] == pytest.approx(0.5)
    assert st["rft/tasks_solved_frac"] == pytest.approx(0.5)
    assert st["rft/attempt_distinct_frac"] == pytest.approx((2 / 4 + 1 / 4) / 2)  # collapse shows as a low value
    assert st["rft/success_distinct_frac"] == pytest.approx(1.0)


def test_round_seeds_revisit_least_drawn_unsolved_first():
    cfg = load_config(None, ["recipe=rft", "rft.tasks_per_round=8", "rft.revisit_frac=0.25", "rft.max_revisits=2"])
    unsolved = {11: 3, 12: 1, 13: 2, 14: 1}  # 11 was drawn 3 times: over the limit
    seeds, n = round_seeds(cfg, 0, unsolved)
    assert n == 2 and seeds[:2] == [12, 14]
    assert len(set(seeds)) == 8 and all(split_of(s) == "train" for s in seeds)
    assert round_seeds(cfg, 0, unsolved) == (seeds, n)  # deterministic
    assert round_seeds(cfg, 1, {})[1] == 0


def test_rft_end_to_end_and_resume(tmp_path):
    base = ["recipe=rft", "model.name=tiny-random", "env.name=toy-digits", "rft.tasks_per_round=4", "rft.group_size=4",
            "sampling.max_new_tokens=4", "train.lr=1e-3", "eval.n=4", "rft.accumulate=true", "rft.per_task_cap=0"]
    straight = rft.train(load_config(None, base + ["rft.rounds=3"]), tmp_path / "a", log=lambda *_: None)
    part = rft.train(load_config(None, base + ["rft.rounds=2", "eval.after=false"]), tmp_path / "b", log=lambda *_: None)
    rft.train(load_config(None, base + ["rft.rounds=3"]), part, resume=True, log=lambda *_: None)

    def rows(run, key):
        return [m[key] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in m]

    assert rows(straight, "rft/pass@1") == rows(part, "rft/pass@1")
    assert rows(straight, "rft/buffer_rows") == rows(part, "rft/buffer_rows")
    assert rows(straight, "budget/episodes") == [16, 32, 48]
    kept = [json.loads(line) for line in (straight / "kept.jsonl").read_text().splitlines()]
    assert len(kept) == sum(rows(straight, "rft/kept_rows"))
    tasks = [json.loads(line) for line in (straight / "tasks.jsonl").read_text().splitlines()]
    assert len(tasks) == 12 and all(t["attempts"] == 4 for t in tasks)


def test_expert_iteration_sharpens_a_warm_started_policy(tmp_path):
    """From an SFT warm start whose samples (T = 0.2) win about a third of corridor games,
    one round of keep-the-wins fine-tuning makes the next round's samples win far more
    often (the classic expert-iteration effect, measured on fresh training games)."""
    warm = sft.train(
        load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=toy-corridor", "data.n=8", "train.epochs=2",
                           "train.batch_size=8", "train.lr=1e-3", "eval.n=0", "sampling.max_new_tokens=6"]),
        tmp_path / "sft", log=lambda *_: None,
    )
    cfg = load_config(None, [
        "recipe=rft", "model.name=tiny-random", "env.name=toy-corridor", f"init.from_run={warm}", "rft.rounds=2",
        "rft.tasks_per_round=8", "rft.group_size=4", "sampling.max_new_tokens=6", "sampling.temperature=0.2",
        "train.lr=1e-3", "train.batch_size=8", "eval.n=0",
    ])
    run = rft.train(cfg, tmp_path / "rft", log=lambda *_: None)
    rounds = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "rft/pass@1" in m]
    first, second = rounds[0]["rft/pass@1"], rounds[1]["rft/pass@1"]
    assert 0.05 < first < 0.7 and rounds[0]["rft/kept"] > 0
    assert second >= first + 0.3, (first, second)
