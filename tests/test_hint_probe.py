"""benchmarks/hint_probe.py: the lost-game rule, its summary against hand values, and one run on
the tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _probe():
    spec = importlib.util.spec_from_file_location("hint_probe", REPO / "benchmarks" / "hint_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lost_games_are_the_groups_without_a_win():
    hp = _probe()
    assert hp.lost_games([False, False, True, False, False, False], 2) == [0, 2]
    assert hp.lost_games([True, True], 2) == []


def test_summary_of_hand_made_rerolls():
    hp = _probe()
    r = lambda task, seed, hinted, won, weights=(): {"task": task, "seed": seed, "hinted": hinted, "won": won, "weights": list(weights)}  # noqa: E731
    rerolls = [
        r("heat", 1, True, True, [0.5, 3.0]),  # a win: weights 0.5 and 3.0 (truncated to 2)
        r("heat", 1, True, False, [9.0]),  # a loss: its weights do not count
        r("heat", 2, True, True, [1.0]),
        r("cool", 3, True, False),
        r("cool", 4, False, False),  # no hint for this game: not played
    ]
    s = hp.summarise(rerolls, cap=2.0)
    assert (s["rerolls"], s["won"], s["games"], s["games_won"], s["unhinted_games"]) == (4, 2, 3, 2, 1)
    assert s["win_rate"] == 0.5 and s["by_task"] == {"heat": {"won": 2, "played": 3}, "cool": {"won": 0, "played": 1}}
    assert s["weight_mean"] == pytest.approx((0.5 + 2.0 + 1.0) / 3) and s["truncated_frac"] == pytest.approx(1 / 3)
    lo, hi = s["interval"]
    assert lo < 0.5 < hi
    empty = hp.summarise([r("cool", 4, False, False)], cap=2.0)
    assert empty["win_rate"] is None and empty["weight_mean"] is None and empty["unhinted_games"] == 1


def test_tiny_run_rerolls_every_lost_game_per_hint(tmp_path):
    hp = _probe()
    out = tmp_path / "probe"
    assert hp.main(["--tiny", "--games", "1", "--group-size", "2", "--rerolls", "2", "--hints", "none,win,alike_walkthrough,oracle_walkthrough", "--out", str(out)]) == 0
    rec = json.loads(out.with_suffix(".json").read_text())
    lost = sum(g["wins"] == 0 for g in rec["games"])
    assert lost == 4  # the tiny random model loses every household game
    h = rec["hints"]
    assert h["none"]["rerolls"] == h["oracle_walkthrough"]["rerolls"] == 2 * lost  # every lost game, k times
    assert h["win"]["rerolls"] == 0 and h["win"]["unhinted_games"] == lost  # no win to show
    assert all(x["hint"].startswith("Actions that win this game") for x in h["oracle_walkthrough"]["records"])
    assert h["alike_walkthrough"]["rerolls"] == 2 * lost and all(x["hint"].startswith("Actions that won a similar game") for x in h["alike_walkthrough"]["records"])
    md = out.with_suffix(".md").read_text()
    assert "| oracle_walkthrough |" in md and "| hint `none` | 8 |" in md  # every re-roll lost: each has a failure mode
    out.with_suffix(".md").unlink()
    assert hp.main(["--from-json", str(out.with_suffix(".json"))]) == 0 and out.with_suffix(".md").read_text() == md


def test_alike_walkthrough_is_the_library_game_that_reads_most_alike():
    from recursa.agent import win_hint
    from recursa.envs.base import split_seeds
    from recursa.envs.household import HouseholdEnv

    hp = _probe()
    env = HouseholdEnv(rooms=1, objects_per_room=2, distractors=0, tasks=hp.TASKS, max_steps=12)
    env.reset(split_seeds("train", hp.LIBRARY_GAMES)[2])
    task = env.task
    first = next(s for s in split_seeds("train", hp.LIBRARY_GAMES) if (env.reset(s), env.task)[1] == task)  # the first game with this task line
    env.reset(first)
    hint, none = hp.alike_walkthroughs([task, "zzz qqq"], HouseholdEnv, 600)
    assert hint == win_hint(task, env.walkthrough(), 600) and none is None


def test_failure_mode_reads_the_task_line_and_the_actions():
    hp = _probe()
    hot = "Your task is to: put a hot apple on the countertop."
    assert hp.failure_mode(hot, ["go to fridge 1", "open fridge 1"]) == "took nothing"
    assert hp.failure_mode(hot, ["go to cabinet 1", "take knife 1 from cabinet 1", "take apple 1 from fridge 1"]) == "took another object"
    assert hp.failure_mode(hot, ["take apple 1 from fridge 1", "go to countertop 1", "put apple 1 on countertop 1", "heat apple 1 with microwave 1"]) \
        == "placed it before the step"
    assert hp.failure_mode(hot, ["take apple 1 from fridge 1", "cool apple 1 with fridge 1", "put apple 1 on countertop 1"]) == "did the wrong step"
    assert hp.failure_mode(hot, ["take apple 1 from fridge 1", "heat apple 1 with microwave 1", "go to cabinet 1"]) == "other"
    assert hp.failure_mode(hot, ["take apple 1 from fridge 1", "go to countertop 1"]) == "other"  # ran out of turns
    plain = "Your task is to: put a cloth in the cabinet."
    assert hp.failure_mode(plain, ["take cloth 1 from countertop 1", "go to fridge 1"]) == "other"  # nothing to do to it first
    assert hp.failure_mode(plain, ["take mug 1 from countertop 1"]) == "took another object"
    assert hp.failure_mode("Look around.", ["take mug 1"]) == "other"  # not a household task line


def test_failure_table_counts_lost_hinted_rerolls_only():
    hp = _probe()
    lines = {("heat_then_place", 1): "Your task is to: put a hot apple on the countertop."}
    r = lambda hinted, won, actions: {"task": "heat_then_place", "seed": 1, "hinted": hinted, "won": won, "actions": actions}  # noqa: E731
    records = [r(True, False, ["take knife 1 from cabinet 1"]), r(True, False, ["take knife 1 from cabinet 1"]),
               r(True, False, []), r(True, True, ["take apple 1 from fridge 1"]),  # a win: not counted
               {"task": "heat_then_place", "seed": 1, "hinted": False, "won": False, "weights": []}]  # no hint: not played
    out = hp.failure_modes(records, lambda task, seed: lines[(task, seed)])
    assert out == {"heat_then_place": {**dict.fromkeys(hp.FAILURES, 0), "took another object": 2, "took nothing": 1}}


def test_eval_report_pairs_two_evaluations_and_names_the_failures(tmp_path):
    from recursa.envs.base import split_seeds

    hp = _probe()
    s = split_seeds("gate", 3)
    item = lambda seed, won, acts: {"seed": seed, "success": won, "completion": " | ".join(acts)}  # noqa: E731
    a = {"items": [item(s[0], True, ["x"]), item(s[1], False, ["go to fridge 1"]), item(s[2], False, ["take zzz 1 from cabinet 1"])]}
    b = {"items": [item(s[0], False, ["look"]), item(s[1], True, ["y"]), item(s[2], True, ["y"])]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    lines = hp.eval_report([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert lines[2].endswith("| 1/3 [0.06, 0.79] | - | 2 | 1 | 1 | 0 | 0 | 0 |")
    # b won 2 games a lost, lost 1 a won: McNemar exact p = 1.0; its one loss took nothing
    assert lines[3].endswith("| 2/3 [0.21, 0.94] | 2, 1, 1.000 | 1 | 1 | 0 | 0 | 0 | 0 |")
    # a benchmark run's result file: its final evaluation under "heldout", read the same way
    (tmp_path / "run.json").write_text(json.dumps({"recipe": "grpo", "heldout": b, "curve": []}))
    assert hp.eval_report([str(tmp_path / "a.json"), str(tmp_path / "run.json")])[3] == lines[3].replace("b.json", "run.json")
