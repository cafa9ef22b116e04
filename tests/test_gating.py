"""Gated weights in the recipes: rollback on rejection, log mode, lineage, looks, resume."""

from __future__ import annotations

import json

import pytest
import torch

from recursa.config import ModelConfig, load_config
from recursa.errors import UserError
from recursa.lineage import Lineage
from recursa.models import load_policy
from recursa.recipes import grpo, rft
from recursa.store import RunStore

DIGITS = ["model.name=tiny-random", "env.name=toy-digits", "sampling.max_new_tokens=8", "train.prompts_per_step=4",
          "train.group_size=8", "train.micro_batch_size=32"]


def _lineage(run):
    store = RunStore(run)
    lin = Lineage(store.db)
    return store, lin


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_rejected_candidates_roll_back_to_the_incumbent(tmp_path):
    """Two rounds whose candidates cannot beat the untrained model on the gate items (both
    solve none) are rejected, and the run ends with exactly the initial weights."""
    cfg = load_config(None, DIGITS + ["train.steps=2", "train.lr=1e-3", "eval.n=0", "gate.mode=gate", "gate.every=1", "gate.n=8"])
    run = grpo.train(cfg, tmp_path / "g", log=lambda *_: None)
    store, lin = _lineage(run)
    assert lin.counts()["weights"] == {"accepted": 0, "rejected": 2}
    assert lin.incumbent("weights").is_root
    final = load_policy(ModelConfig(name="tiny-random"), weights_dir=run / "checkpoints" / "step_000002")
    assert _same_weights(final, load_policy(ModelConfig(name="tiny-random")))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["gate/rolled_back"] for r in rows if "gate/rolled_back" in r] == [1.0, 1.0]
    store.close()


def test_log_mode_records_but_keeps_training(tmp_path):
    cfg = load_config(None, DIGITS + ["train.steps=2", "train.lr=1e-3", "eval.n=0", "gate.mode=log", "gate.every=1", "gate.n=8"])
    run = grpo.train(cfg, tmp_path / "g", log=lambda *_: None)
    store, lin = _lineage(run)
    assert lin.counts()["weights"]["rejected"] == 2
    final = load_policy(ModelConfig(name="tiny-random"), weights_dir=run / "checkpoints" / "step_000002")
    assert not _same_weights(final, load_policy(ModelConfig(name="tiny-random")))
    store.close()


def test_gate_rounds_use_fresh_disjoint_gate_items(tmp_path):
    cfg = load_config(None, DIGITS + ["train.steps=3", "train.lr=1e-3", "eval.n=0", "gate.mode=log", "gate.every=1", "gate.n=5"])
    run = grpo.train(cfg, tmp_path / "g", log=lambda *_: None)
    store, lin = _lineage(run)
    spans = [c.payload["seeds"] for c in lin.candidates("weights") if not c.is_root]
    assert spans == [[1_000_000_000 + 5 * r, 1_000_000_000 + 5 * r + 4] for r in range(3)]
    store.close()


def test_resume_truncates_the_lineage(tmp_path):
    base = DIGITS + ["train.lr=1e-3", "eval.n=0", "gate.mode=log", "gate.every=1", "gate.n=4", "run.checkpoint_every=1"]
    straight = grpo.train(load_config(None, base + ["train.steps=3"]), tmp_path / "a", log=lambda *_: None)
    part = grpo.train(load_config(None, base + ["train.steps=2"]), tmp_path / "b", log=lambda *_: None)
    grpo.train(load_config(None, base + ["train.steps=3"]), part, resume=True, log=lambda *_: None)
    sa, la = _lineage(straight)
    sb, lb = _lineage(part)
    key = [(c.step, c.accepted, c.stats.get("b"), c.stats.get("c")) for c in la.candidates("weights")]
    assert key == [(c.step, c.accepted, c.stats.get("b"), c.stats.get("c")) for c in lb.candidates("weights")]
    sa.close()
    sb.close()


def test_test_looks_are_capped_up_front():
    with pytest.raises(UserError, match="look at the test split 4 times"):
        load_config(None, ["gate.mode=gate", "train.steps=10", "eval.every=3", "gate.max_test_looks=3"])
    load_config(None, ["gate.mode=off", "train.steps=10", "eval.every=3", "gate.max_test_looks=3"])  # ungated: no cap


def test_expert_iteration_rounds_are_gated(tmp_path):
    cfg = load_config(None, ["recipe=rft", "model.name=tiny-random", "env.name=toy-digits", "rft.rounds=2", "rft.tasks_per_round=4",
                             "rft.group_size=4", "sampling.max_new_tokens=4", "eval.n=0", "gate.mode=gate", "gate.every=1", "gate.n=4"])
    run = rft.train(cfg, tmp_path / "r", log=lambda *_: None)
    store, lin = _lineage(run)
    assert sum(lin.counts()["weights"].values()) == 2
    store.close()


@pytest.mark.slow
def test_gated_grpo_accepts_real_gains_and_reports_the_test_gain(tmp_path):
    """GRPO learns the digits task; the first gated round is accepted on fresh gate items,
    later rounds that cannot improve on a perfect incumbent are rejected, and the test-split
    gain is recorded with its interval."""
    cfg = load_config(None, DIGITS + ["train.steps=20", "train.lr=3e-3", "eval.n=64", "gate.mode=gate", "gate.every=10", "gate.n=64"])
    run = grpo.train(cfg, tmp_path / "g", log=lambda *_: None)
    store, lin = _lineage(run)
    first = [c for c in lin.candidates("weights") if not c.is_root][0]
    assert first.accepted and first.stats["p_value"] < 1e-3
    (look,) = lin.test_looks()
    assert look.label == "after" and look.gain > 0.5 and look.ci_lo > 0
    store.close()
    from recursa.lineage import show_lineage

    tree, png = show_lineage(run)
    assert "ACCEPTED" in tree and png.exists()


def test_prompt_proposal_parsing_and_request():
    from recursa.recipes.gating import parse_prompt_proposal, prompt_proposal_request

    req = prompt_proposal_request("Reply with one action.", [("Your task is to: reach room 3.", "dance")], 200)
    assert "Current instruction: Reply with one action." in req and "Answered: dance" in req and req.endswith("INSTRUCTION:")
    assert parse_prompt_proposal("Sure!\nINSTRUCTION: Always copy one action exactly from the list.", 200) == "Always copy one action exactly from the list."
    assert parse_prompt_proposal("INSTRUCTION: ���� ��", 200) is None
    assert parse_prompt_proposal("INSTRUCTION: " + "word " * 100, 50) is None  # over the hard cap
    assert parse_prompt_proposal(None, 50) is None


def _fake_scores(monkeypatch, good: str):
    """Scores that depend only on the prompt text: `good` solves every item, others none."""
    from recursa.evaluate import EvalItem, summarize
    from recursa.recipes.gating import PromptGate

    def score(self, policy, text, split, seeds, label):
        return summarize([EvalItem(s, float(text == good), text == good) for s in seeds], "toy", split, label, "m", "model", 0.0)

    monkeypatch.setattr(PromptGate, "_score", score)
    monkeypatch.setattr(PromptGate, "propose", lambda self, policy, failures, gen: ([good, "Wander around aimlessly please."], 1))


def test_prompt_round_selects_gates_and_adopts(tmp_path, monkeypatch):
    good = "Reply with go east, exactly as written."
    _fake_scores(monkeypatch, good)
    base = ["model.name=tiny-random", "env.name=toy-corridor", "sampling.max_new_tokens=4", "train.prompts_per_step=2",
            "train.group_size=2", "eval.n=0", "gate.mode=gate", "gate.every=100", "gate.n=16", "gate.prompt_every=1",
            "gate.prompt_select_n=4", "run.checkpoint_every=1"]
    cfg = load_config(None, base + ["train.steps=1"])
    run = grpo.train(cfg, tmp_path / "p", log=lambda *_: None)
    assert cfg.agent.instruction == good  # adopted: rollouts and evaluations now use it
    store, lin = _lineage(run)
    (cand,) = [c for c in lin.candidates("prompt") if not c.is_root]
    assert cand.accepted and cand.payload["text"] == good and cand.payload["selection_rate"] == 1.0
    assert cand.payload["seeds"][0] >= 1_500_000_000  # prompt rounds use their own part of the gate split
    store.close()
    resumed = load_config(None, base + ["train.steps=1"])
    grpo.train(resumed, run, resume=True, log=lambda *_: None)
    assert resumed.agent.instruction == good  # a resumed run restores the admitted prompt


def test_prompt_round_in_log_mode_never_adopts(tmp_path, monkeypatch):
    good = "Reply with go east, exactly as written."
    _fake_scores(monkeypatch, good)
    cfg = load_config(None, ["model.name=tiny-random", "env.name=toy-corridor", "sampling.max_new_tokens=4", "train.prompts_per_step=2",
                             "train.group_size=2", "eval.n=0", "gate.mode=log", "gate.every=100", "gate.n=16", "gate.prompt_every=1",
                             "gate.prompt_select_n=4", "train.steps=1"])
    original = cfg.agent.instruction
    grpo.train(cfg, tmp_path / "p", log=lambda *_: None)
    assert cfg.agent.instruction == original
