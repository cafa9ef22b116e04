"""Extending recursa from a package of one's own: an objective and a training method, each
one definition in tests/byo_pkg/byo_tasks/plugins.py, found through the package's entry
points (as `pip install` would leave them) and through in-process registration; the
registries' own rules."""

from __future__ import annotations

import json

import pytest
import torch

from recursa.config import load_config
from recursa.errors import UserError
from recursa.plugins import METHODS, OBJECTIVES
from recursa.recipes import grpo
from recursa.registry import Registry
from test_byo import byo  # noqa: F401  (the fixture: the byo-tasks package installed with its entry points)

TINY = ["model.name=tiny-random", "run.threads=1", "sampling.max_new_tokens=4", "train.steps=2", "train.prompts_per_step=2",
        "train.group_size=2", "train.micro_batch_size=4", "eval.n=2", "eval.batch_size=2", "run.checkpoint_every=1"]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_objective_and_a_method_from_an_installed_package_train_and_resume(byo, tmp_path):  # noqa: F811  (the fixture)
    from byo_tasks import plugins

    assert OBJECTIVES.path("byo_reinforce") == "byo_tasks.plugins:reinforce" and "success_streak" in METHODS.names()
    sets = [*TINY, "algo.objective=byo_reinforce", "methods.success_streak.threshold=0.0", "train.skip_zero_advantage=false"]  # every row runs
    cfg = load_config(None, sets)
    assert cfg.methods == {"success_streak": {"threshold": 0.0}}
    before = plugins.CALLS["objective"]
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert plugins.CALLS["objective"] > before  # the update called the package's loss
    streak = [r["streak/steps"] for r in _rows(run) if "streak/steps" in r]
    assert streak == [1, 2]  # threshold 0: every step extends the streak
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["success_streak"] == 2  # the method's state is in the checkpoint
    # carried on from its last checkpoint (step 2) to step 3, the method restores its streak from the checkpoint
    cfg3 = load_config(None, [*sets, "train.steps=3"])
    again = grpo.train(cfg3, run, resume=True, log=lambda *_: None)
    assert [r["streak/steps"] for r in _rows(again) if "streak/steps" in r] == [1, 2, 3]


def test_a_method_registered_in_process_runs_and_its_name_is_checked(tmp_path, monkeypatch):
    from recursa.methods import Method

    seen = []

    class Tasks(Method):
        def tasks(self, step, n, env):  # the method chooses the step's tasks
            from recursa.curriculum import StepTasks
            from recursa.envs import split_seed

            seen.append(step)
            return StepTasks([split_seed("train", 7)] * n, None, ["fresh"] * n)

    monkeypatch.setattr(METHODS, "_registered", dict(METHODS._registered))
    METHODS.register("same_task", Tasks)
    cfg = load_config(None, [*TINY, "methods.same_task={}", "run.log_samples=8"])
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert seen == [0, 1]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["seed"] for s in samples} == {7}
    with pytest.raises(UserError, match=r"methods.nope: no training method of that name is registered"):
        load_config(None, [*TINY, "methods.nope={}"])
    with pytest.raises(UserError, match=r"'curriculum' is a built-in method, switched on by its own config section"):
        load_config(None, [*TINY, "methods.curriculum={}"])


def test_a_registry_knows_names_before_it_imports_them():
    reg = Registry("widget", "widgets.name", None, {"json_loads": ("json:loads", "the json module's loads")})
    assert "json_loads" in reg and reg.path("json_loads") == "json:loads" and reg.check("json_loads") == "json_loads"
    assert reg.get("json_loads")("[1]") == [1]
    reg.register("double", lambda x: 2 * x)
    assert reg.names() == ["json_loads", "double"] and reg.get("double")(4) == 8 and reg.path("double") is None
    reg.register("dumps", "json:dumps")
    assert reg.get("dumps")([1]) == "[1]"
    with pytest.raises(ValueError, match="built-in widget"):
        reg.register("json_loads", len)
    with pytest.raises(ValueError, match="already a registered widget"):
        reg.register("double", len)
    reg.register("double", len, replace=True)
    assert reg.get("double")("abc") == 3
    with pytest.raises(UserError, match=r"widgets.name = 'dubble': no widget of that name \(did you mean double\?\)"):
        reg.get("dubble")
    broken = Registry("widget", "widgets.name", None, {"gone": ("json:nothing_here", "")})
    with pytest.raises(UserError, match="has no attribute 'nothing_here'"):
        broken.get("gone")


def test_a_reward_function_registered_by_name_scores_the_run(tmp_path, monkeypatch):
    from recursa.plugins import REWARDS

    calls = []

    def length_bonus(prompts, completions, **fields):
        calls.append(len(completions))
        return [0.1 * len(c) for c in completions]

    monkeypatch.setattr(REWARDS, "_registered", dict(REWARDS._registered))
    REWARDS.register("length_bonus", length_bonus)
    path = tmp_path / "cfg.toml"
    path.write_text('[[reward]]\nfunc = "length_bonus"\nweight = 0.5\n')
    cfg = load_config(path, [*TINY, "train.steps=1"])
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert calls == [4]  # one call per step, one value per completion (2 tasks x 2)
    assert any("reward/length_bonus/mean" in r for r in _rows(run))
    path.write_text('[[reward]]\nfunc = "no_such_reward"\n')
    with pytest.raises(UserError, match=r"reward.0.func: .*must be 'env', 'package.module:function' or a registered reward function's name"):
        load_config(path, TINY)


def test_a_method_adds_rows_and_shapes_the_batch_of_a_grpo_run(tmp_path, monkeypatch):
    """The hooks RSIPO's methods use, from a user method in a GRPO run: `rows` appends rows after
    the policy's own (their episodes count in episodes/sampled and budget/episodes), `shape`
    sets the whole batch's token advantages before the update sees it."""
    from recursa.methods import Method
    from recursa.methods.base import Extra, Shaping

    seen = []

    class Copies(Method):
        def rows(self, s, played, room):
            played.parts["copies"] = played.trajs[:2]
            return Extra(played.trajs[:2], episodes=3, metrics={"copies/rows": 2.0})

        def shape(self, s, batch, played):
            n = len(played.trajs)
            assert len(batch) == n + 2 and batch.advantages.shape == (n + 2,)
            assert batch.advantages[n:].abs().sum() == 0  # extra rows start at advantage 0
            batch.advantages = batch.action_mask * 0.5  # (N, L) per token
            seen.append(batch)
            return Shaping(metrics={"copies/shaped": 1.0})

    monkeypatch.setattr(METHODS, "_registered", dict(METHODS._registered))
    METHODS.register("copies", Copies)
    real, updates = grpo.update, []
    monkeypatch.setattr(grpo, "update", lambda policy, opt, batch, *a, **k: updates.append(batch.advantages.clone()) or real(policy, opt, batch, *a, **k))
    cfg = load_config(None, [*TINY, "methods.copies={}"])
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    assert [r["episodes/sampled"] for r in rows] == [B * G + 3] * 2 and [r["budget/episodes"] for r in rows] == [B * G + 3, 2 * (B * G + 3)]
    assert all(r["copies/rows"] == 2.0 and r["copies/shaped"] == 1.0 for r in rows)
    assert len(updates) == 2 and all(torch.equal(u, b.action_mask * 0.5) for u, b in zip(updates, seen))


def test_two_methods_cannot_both_shape_a_batch():
    from recursa.methods.base import Method, Methods, RunContext, Shaping

    class Shaper(Method):
        def shape(self, s, batch, played):
            return Shaping()

    ctx = RunContext(None, None, None, None, None, print)
    assert isinstance(Methods([Shaper(ctx)]).shape(None, None, None), Shaping)
    with pytest.raises(ValueError, match="2 methods shape the batch's advantages; a batch takes one"):
        Methods([Shaper(ctx), Shaper(ctx)]).shape(None, None, None)
