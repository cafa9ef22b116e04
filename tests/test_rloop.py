"""RLoop (`[rloop]`, an option of the GRPO recipe): the harvest selection and the phase
arithmetic by hand, the reset + fine-tune against the same steps done by hand, the recipe end
to end on the tiny model (single-turn and a game, two phases), resume equal to the
uninterrupted run, and the refusals of bad settings."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recursa.config import load_config
from recursa.envs import StepResult, register_env
from recursa.errors import UserError
from recursa.models import load_policy, restore_weights
from recursa.recipes import grpo, sft
from recursa.recipes.common import make_optimizer, step_generator
from recursa.recipes.rft import Attempt, finetune
from recursa.methods.rloop import RLoop, cap_harvest, phase_of, reset_source, select_successes
from recursa.store import RunStore
from recursa.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
FAST = ["model.name=tiny-random", "run.threads=1", "sampling.max_new_tokens=4", "train.lr=1e-3", "eval.n=2", "eval.batch_size=2"]
VOLATILE = ("time/", "throughput/")


class CoinEnv:
    """Single-turn toy task that the tiny random model solves about half the time: success
    when the reply's first character has an even code point."""

    name = "toy-coin"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return f"Say something. Item {random.Random(seed).randint(0, 9)}."

    def step(self, action_text: str) -> StepResult:
        won = bool(action_text) and ord(action_text[0]) % 2 == 0
        return StepResult("", float(won), True, {"success": won})


register_env("toy-coin", CoinEnv, "toy: success when the reply's first character is even (tests)")
COIN = [*FAST, "env.name=toy-coin", "train.prompts_per_step=4", "train.group_size=4", "train.micro_batch_size=8",
        "rloop.enabled=true", "rloop.rl_steps=2", "rloop.sft_lr=1e-3", "rloop.sft_batch_size=4"]


def _rows(run: Path, name: str = "metrics") -> list[dict]:
    path = run / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    def norm(v):
        return "nan" if isinstance(v, float) and v != v else v

    return [{k: norm(v) for k, v in _stable(r).items()} for r in a] == [{k: norm(v) for k, v in _stable(r).items()} for r in b]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


# ----------------------------------------------------------------------------- by hand


def _a(seed: int, success: bool, key: str, length: int = 1) -> Attempt:
    return Attempt(seed, float(success), success, key, [], length)


def test_select_successes_by_hand():
    # seed 1: 2 of 4 won (pass rate 0.5), two distinct wins; seed 2: 4 of 4 (1.0), three distinct
    # wins of lengths 3, 1, 2; seed 3: 0 of 4
    attempts = [_a(1, True, "x"), _a(1, True, "y"), _a(1, False, "n"), _a(1, False, "n"),
                _a(2, True, "p", 3), _a(2, True, "q", 1), _a(2, True, "q", 1), _a(2, True, "r", 2),
                *[_a(3, False, "m")] * 4]
    every = select_successes(attempts, per_task_cap=0, max_pass_rate=1.0)
    assert [(a.seed, a.key) for a in every] == [(1, "x"), (1, "y"), (2, "q"), (2, "r"), (2, "p")]  # duplicates dropped, shortest first
    assert [(a.seed, a.key) for a in select_successes(attempts, per_task_cap=1, max_pass_rate=1.0)] == [(1, "x"), (2, "q")]
    assert [(a.seed, a.key) for a in select_successes(attempts, per_task_cap=2, max_pass_rate=0.5)] == [(1, "x"), (1, "y")]  # the easy task gives none
    assert select_successes(attempts, per_task_cap=2, max_pass_rate=0.25) == []


def test_phase_arithmetic_by_hand():
    # rl_steps = 3: steps 1-3 are phase 0, 4-6 phase 1
    assert [phase_of(s, 3) for s in range(1, 8)] == [0, 0, 0, 1, 1, 1, 2]
    assert reset_source(2, "phase") == 2 and reset_source(2, "init") == 0 and reset_source(2, "none") is None
    h = [{"seed": i} for i in range(5)]
    assert cap_harvest(h, 3) == h[2:] and cap_harvest(h, 0) == h and cap_harvest(h, 9) == h


def _coin_rows(n: int) -> list[Trajectory]:
    """n hand-made single-turn successes (prompt tokens, then 3 reply tokens)."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt, reply = [rng.randrange(5, 200) for _ in range(6)], [rng.randrange(5, 200) for _ in range(3)]
        out.append(Trajectory("toy-coin", 100 + i, i, prompt + reply, [0] * 6 + [1] * 3, [0.0] * 9, 1.0, True, f"r{i}", "p"))
    return out


@pytest.mark.parametrize("reset", ["phase", "init", "none"])
def test_refresh_is_a_reset_then_the_expert_iteration_update(tmp_path, reset):
    """Phase 0 starts from W0, phase 1 from W1 (both recorded by `begin`); the RL weights at the
    end of phase 1 are W1 + noise. `refresh` must equal, weight for weight: restore W1 (phase) /
    W0 (init) / nothing (none), a fresh AdamW, then rft.finetune on the harvest with the step's
    generator; the harvest is emptied (accumulate off) and the optimizer state cleared."""
    cfg = load_config(None, [*COIN, "train.steps=4", f"rloop.reset={reset}", "rloop.sft_epochs=2"])
    store = RunStore(tmp_path / "run")
    policy = load_policy(cfg.model)
    optimizer = make_optimizer([p for p in policy.model.parameters() if p.requires_grad], cfg)
    loop = RLoop.open(cfg, store, 0, multi_turn=False, log=lambda *_: None)

    def nudge(scale: float) -> None:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))

    loop.begin(0, policy, optimizer)  # W0
    nudge(0.01)
    loop.begin(2, policy, optimizer)  # W1
    # phase: W1 recorded and W0 removed (no checkpoint could resume into phase 0); init: only W0
    assert loop.phase_dir(1).exists() == (reset == "phase") and loop.phase_dir(0).exists() == (reset == "init")
    nudge(0.02)  # RL's work in phase 1
    rl_weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    rows = _coin_rows(5)
    metrics = loop.harvest(4, rows)
    assert metrics == {"rloop/phase": 2, "rloop/harvested": 5, "rloop/harvest_size": 5, "rloop/harvest_rows": 5}
    optimizer.state[next(iter(policy.model.parameters()))]["junk"] = torch.ones(1)  # RL's moments: must not reach the fine-tune

    opt_step, refreshed = loop.refresh(policy, optimizer, 4, step_generator(0, 3), 10)
    assert opt_step == 10 + 2 * 2 and refreshed["rloop/sft_steps"] == 4 and refreshed["rloop/sft_rows"] == 5  # 2 epochs x ceil(5 / 4) batches
    assert refreshed["rloop/reset"] == float(reset != "none") and loop.buffer == [] and len(optimizer.state) == 0

    by_hand = load_policy(cfg.model)
    if reset == "none":
        by_hand.model.load_state_dict(rl_weights)
    else:
        restore_weights(by_hand, loop.phase_dir({"phase": 1, "init": 0}[reset]))
    opt = make_optimizer([p for p in by_hand.model.parameters() if p.requires_grad], cfg)
    step, loss = finetune(by_hand, opt, [r for r in _coin_rows(5)], loop.sft, step_generator(0, 3), 10)
    assert step == opt_step and loss == pytest.approx(refreshed["rloop/sft_loss"], rel=1e-6)
    for (name, a), b in zip(policy.model.state_dict().items(), by_hand.model.state_dict().values()):
        assert torch.equal(a, b), name
    store.close()


# ----------------------------------------------------------------------------- end to end


def test_grpo_with_rloop_on_a_single_turn_task(tmp_path):
    """Two phases of two steps: each step's successes join the harvest (harvest.jsonl), each
    phase ends with a fine-tune on its own harvest, the budget counts only the RL episodes."""
    run = grpo.train(load_config(None, [*COIN, "train.steps=4", "run.checkpoint_every=1"]), tmp_path / "run", log=lambda *_: None)
    rows = _rows(run)
    steps = [r for r in rows if "reward/mean" in r]
    boundaries = [r for r in rows if "rloop/sft_loss" in r]
    assert [r["budget/episodes"] for r in steps] == [16, 32, 48, 64] and all(r["episodes/sampled"] == 16 for r in steps)
    assert [r["rloop/phase"] for r in steps] == [1, 1, 2, 2] and [r["step"] for r in boundaries] == [2, 4]
    harvest = _rows(run, "harvest")
    assert len(harvest) == sum(r["rloop/harvested"] for r in steps) > 0
    assert all(r["reward"] == 1.0 and len(r["rows"]) == 1 for r in harvest)
    for k, b in enumerate(boundaries):  # the phase's own harvest (accumulate off)
        phase = [r for r in harvest if 2 * k < r["step"] <= 2 * k + 2]
        assert b["rloop/sft_successes"] == len(phase) == b["rloop/sft_rows"] == steps[2 * k + 1]["rloop/harvest_size"]
        assert b["rloop/reset"] == 1.0 and (b["rloop/sft_steps"] > 0) == bool(phase)
    assert steps[2]["rloop/harvest_size"] == steps[2]["rloop/harvested"]  # emptied at the boundary
    # the fine-tune changed the weights the boundary step's checkpoint holds; phase 1 starts from them
    assert sorted(p.name for p in (run / "rloop").iterdir()) == ["phase_000", "phase_001"]
    w1 = load_file(str(run / "rloop" / "phase_001" / "model.safetensors"))
    ckpt2 = _weights(run / "checkpoints" / "step_000002")
    assert all(torch.equal(w1[k], ckpt2[k]) for k in ckpt2)
    assert (run / "eval" / "after.json").exists()


def test_grpo_with_rloop_on_a_game_from_a_warm_start(tmp_path):
    """A corridor game from an SFT warm start, reset = 'init': the harvest holds whole won
    episodes (one row per valid turn), every fine-tune starts from the warm start's weights
    (the only phase directory), and accumulate keeps the harvest over both phases."""
    warm = sft.train(load_config(None, ["recipe=sft", "model.name=tiny-random", "run.threads=1", "env.name=toy-corridor", "data.n=8",
                                        "train.epochs=2", "train.batch_size=8", "train.lr=1e-3", "eval.n=0", "sampling.max_new_tokens=6"]),
                     tmp_path / "sft", log=lambda *_: None)
    cfg = load_config(None, [*FAST, "env.name=toy-corridor", f"init.from_run={warm}", "sampling.max_new_tokens=6", "sampling.temperature=0.2",
                             "train.prompts_per_step=4", "train.group_size=4", "train.lr=1e-5", "train.steps=4", "eval.n=0", "rloop.enabled=true", "rloop.rl_steps=2",
                             "rloop.reset=init", "rloop.accumulate=true", "rloop.per_task_cap=0", "rloop.sft_lr=1e-3"])
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    steps = [r for r in _rows(run) if "reward/mean" in r]
    boundaries = [r for r in _rows(run) if "rloop/sft_loss" in r]
    harvest = _rows(run, "harvest")
    assert harvest and all(1 <= len(r["rows"]) <= r["key"].count(" | ") + 1 and "go east" in r["key"] for r in harvest)
    assert any(len(r["rows"]) > 1 for r in harvest)  # whole episodes, one row per valid turn
    assert [b["rloop/sft_successes"] for b in boundaries] == [steps[1]["rloop/harvest_size"], len(harvest)]  # accumulated
    assert [b["rloop/sft_rows"] for b in boundaries] == [sum(len(r["rows"]) for r in harvest if r["step"] <= 2), sum(len(r["rows"]) for r in harvest)]
    assert sorted(p.name for p in (run / "rloop").iterdir()) == ["phase_000"]
    w0 = load_file(str(run / "rloop" / "phase_000" / "model.safetensors"))
    warm_w = _weights(sorted((warm / "checkpoints").glob("step_*"))[-1])
    assert all(torch.equal(w0[k], warm_w[k]) for k in warm_w)  # W0 is the warm start


def test_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """Killed in step 4's update (after step 4 harvested), resumed from the step-3 checkpoint
    in the middle of phase 1: the harvest of step 3 is rebuilt from harvest.jsonl, the reset
    goes to the phase-1 weights on disk, and every metric, the harvest and the final weights
    equal those of the uninterrupted run."""
    cfg = load_config(None, [*COIN, "train.steps=4", "run.checkpoint_every=3", "eval.n=0"])
    straight = grpo.train(cfg, tmp_path / "straight", log=lambda *_: None)

    broken = tmp_path / "broken"
    real, calls = grpo.update, []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo, "update", crash)
    with pytest.raises(KeyboardInterrupt):
        grpo.train(cfg, broken, log=lambda *_: None)
    monkeypatch.setattr(grpo, "update", real)
    assert max(r["step"] for r in _rows(broken, "harvest")) == 4  # the killed step got as far as harvesting
    grpo.train(cfg, broken, resume=True, log=lambda *_: None)

    assert _same_rows(_rows(straight), _rows(broken))
    assert _rows(straight, "harvest") == _rows(broken, "harvest")
    a, b = _weights(straight / "checkpoints" / "step_000004"), _weights(broken / "checkpoints" / "step_000004")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(r.get("rloop/sft_steps", 0) > 0 for r in _rows(straight))  # a fine-tune ran in the compared stretch


def test_rloop_resets_lora_adapters(tmp_path):
    """Under LoRA the phase weights are the adapters (the base stays frozen); the fine-tune
    starts from the phase's adapters."""
    run = grpo.train(load_config(None, [*COIN, "train.steps=2", "rloop.rl_steps=1", "model.lora={r = 4}", "eval.n=0"]), tmp_path / "run",
                     log=lambda *_: None)
    assert (run / "rloop" / "phase_001" / "adapter_model.safetensors").exists() and not (run / "rloop" / "phase_001" / "model.safetensors").exists()
    assert [r["rloop/reset"] for r in _rows(run) if "rloop/reset" in r] == [1.0, 1.0]


def test_resume_without_the_phase_weights_is_refused(tmp_path):
    cfg = load_config(None, [*COIN, "train.steps=4", "run.checkpoint_every=3", "eval.n=0"])
    part = grpo.train(load_config(None, [*COIN, "train.steps=3", "run.checkpoint_every=3", "eval.n=0", "eval.after=false"]), tmp_path / "run",
                      log=lambda *_: None)
    shutil.rmtree(part / "rloop" / "phase_001")
    with pytest.raises(UserError, match="phase_001") as err:
        grpo.train(cfg, part, resume=True, log=lambda *_: None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("sets, match", [
    (["rloop.enabled=true", "rloop.rl_steps=5", "train.steps=4"], "rloop.rl_steps = 5 is more than train.steps = 4"),
    (["rloop.rl_steps=0"], "rl_steps"),
    (["rloop.reset=start"], "reset"),
    (["rloop.sft_lr=0"], "sft_lr"),
    (["rloop.max_pass_rate=1.5"], "max_pass_rate"),
    (["recipe=rsipo", "rloop.enabled=true"], "rloop"),
    (["gate.prompt_every=2"], "gate.prompt_every > 0 gates prompt proposals, but gate.mode = 'off'"),
])
def test_bad_settings_are_one_line_errors(sets, match):
    with pytest.raises(UserError, match=match) as err:
        load_config(None, sets)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_a_bad_rloop_setting(tmp_path, capsys):
    from recursa.cli import main

    code = main(["train", str(ROOT / "examples" / "smoke.toml"), "--out", str(tmp_path / "r"), "--set", "rloop.enabled=true", "--set", "rloop.rl_steps=9"])
    assert code == 2 and "rloop.rl_steps = 9" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
