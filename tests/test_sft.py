"""The SFT recipe end to end on the tiny model, its resume, and warm starts (init.from_run)."""

from __future__ import annotations

import json

import pytest
import torch

from recursa.config import ModelConfig, load_config
from recursa.errors import UserError
from recursa.models import load_policy
from recursa.recipes import grpo, sft
from recursa.recipes.common import init_weights_dir
from recursa.trajectory import collate

CORRIDOR = ["recipe=sft", "model.name=tiny-random", "env.name=toy-corridor", "data.n=16", "train.batch_size=8", "train.lr=1e-3", "sampling.max_new_tokens=6"]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_supervised_loss_is_token_mean_nll_of_targets(tiny_policy):
    """The reported loss equals -mean log p(target) computed directly from the logits."""
    from recursa.recipes.common import make_optimizer, supervised_step
    from recursa.trajectory import Trajectory

    cfg = load_config(None, ["recipe=sft", "model.name=tiny-random", "train.micro_batch_size=1", "train.lr=1e-9"])
    policy = load_policy(ModelConfig(name="tiny-random"))
    rows = [
        Trajectory("t", 0, 0, [5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, 1.0, True),
        Trajectory("t", 1, 0, [9, 10, 11], [0, 1, 1], [0.0] * 3, 1.0, True),
    ]
    batch = collate(rows, torch.zeros(2), policy.tokenizer.pad_token_id)
    with torch.no_grad():
        total = 0.0
        for r in rows:
            logits = policy.causal_lm(torch.tensor([r.token_ids])).logits[0]  # (L, V)
            logp = torch.log_softmax(logits, -1)
            total -= sum(float(logp[t - 1, r.token_ids[t]]) for t in range(1, len(r.token_ids)) if r.action_mask[t])
    st = supervised_step(policy, make_optimizer([p for p in policy.model.parameters()], cfg), batch, cfg, 0)
    assert st.tokens == 4 and st.rows == 2
    assert st.loss == pytest.approx(total / 4, rel=1e-4)


def test_sft_teaches_the_corridor(tmp_path):
    """Imitating walkthroughs takes the tiny random model from 0 wins to most held-out games."""
    cfg = load_config(None, CORRIDOR + ["train.epochs=3", "eval.n=16"])
    run = sft.train(cfg, tmp_path / "sft", log=lambda *_: None)
    before = json.loads((run / "eval" / "before.json").read_text())
    after = json.loads((run / "eval" / "after.json").read_text())
    assert before["success_rate"] == 0.0
    assert after["success_rate"] >= 0.75
    losses = [m["sft/loss"] for m in _metrics(run) if "sft/loss" in m]
    assert losses[-1] < losses[0] - 1.0
    demos = json.loads((run / "demos.json").read_text())
    assert demos["items"] == 16 and all(s < 1_000_000_000 for s in demos["seeds"])


def test_sft_resume_replays_the_uninterrupted_run(tmp_path):
    straight = sft.train(load_config(None, CORRIDOR + ["train.epochs=2", "eval.n=0"]), tmp_path / "a", log=lambda *_: None)
    part = sft.train(load_config(None, CORRIDOR + ["train.epochs=1", "eval.n=0"]), tmp_path / "b", log=lambda *_: None)
    sft.train(load_config(None, CORRIDOR + ["train.epochs=2", "eval.n=0"]), part, resume=True, log=lambda *_: None)
    la = [m["sft/loss"] for m in _metrics(straight)]
    lb = [m["sft/loss"] for m in _metrics(part)]
    assert len(la) == len(lb) == 12  # 41 rows in batches of 8: 6 optimizer steps per epoch
    assert lb == pytest.approx(la, rel=1e-5)


def test_grpo_warm_start_from_sft_run(tmp_path):
    src = sft.train(load_config(None, CORRIDOR + ["train.epochs=1", "eval.n=0"]), tmp_path / "sft", log=lambda *_: None)
    ckpt = init_weights_dir(load_config(None, [f"init.from_run={src}", "model.name=tiny-random"]))
    assert ckpt is not None and ckpt.parent == src / "checkpoints"
    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=toy-corridor", f"init.from_run={src}", "train.steps=0", "eval.n=0",
    ])
    run = grpo.train(cfg, tmp_path / "grpo", log=lambda *_: None)
    warm = load_policy(ModelConfig(name="tiny-random"), weights_dir=run / "checkpoints" / "step_000000")
    cold = load_policy(ModelConfig(name="tiny-random"))
    trained = load_policy(ModelConfig(name="tiny-random"), weights_dir=ckpt)
    for (name, w), t, c in zip(warm.model.named_parameters(), trained.model.parameters(), cold.model.parameters()):
        assert torch.equal(w, t), name
    assert any(not torch.equal(t, c) for t, c in zip(trained.model.parameters(), cold.model.parameters()))


def test_warm_start_errors(tmp_path):
    with pytest.raises(UserError, match="no run there"):
        grpo.train(load_config(None, ["model.name=tiny-random", f"init.from_run={tmp_path / 'missing'}"]), tmp_path / "x", log=lambda *_: None)
    src = sft.train(load_config(None, CORRIDOR + ["train.epochs=1", "eval.n=0"]), tmp_path / "sft", log=lambda *_: None)
    with pytest.raises(UserError, match="set model.name to match"):
        grpo.train(load_config(None, [f"init.from_run={src}"]), tmp_path / "y", log=lambda *_: None)
    with pytest.raises(UserError, match="init.checkpoint = 99"):
        init_weights_dir(load_config(None, [f"init.from_run={src}", "model.name=tiny-random", "init.checkpoint='99'"]))
    with pytest.raises(UserError, match="'last' or a step number"):
        load_config(None, ["init.checkpoint=latest"])


def test_lora_checkpoint_merges_into_a_full_warm_start(tmp_path):
    """A LoRA run's adapters, used as the base of a full-weight run, give the same outputs."""
    lora = ModelConfig(name="tiny-random", lora={"r": 4, "alpha": 8.0})
    policy = load_policy(lora)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # make the adapters matter
    from recursa.models import save_weights

    save_weights(policy, tmp_path / "ckpt")
    merged = load_policy(ModelConfig(name="tiny-random"), base_dir=tmp_path / "ckpt")
    assert not merged.is_lora
    x = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        want = policy.causal_lm(x).logits
        got = merged.causal_lm(x).logits
        base = load_policy(ModelConfig(name="tiny-random")).causal_lm(x).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(base, want, atol=1e-3)
