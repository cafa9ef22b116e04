"""The demonstration anchor (recursa/anchor.py, `[anchor]`): its loss against a hand computation,
its draw of rows, and GRPO with it end to end on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from recursa.anchor import Anchor, make_anchor
from recursa.config import load_config
from recursa.envs import EnvPool
from recursa.envs.dataset import task_factory
from recursa.errors import UserError
from recursa.models import load_policy
from recursa.recipes.grpo import train

HOUSEHOLD = ['env.name="household"', 'env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, tasks = "pick_and_place", max_steps = 6}',
             "agent.history_turns=1", 'model.name="tiny-random"', "sampling.max_new_tokens=8", "run.threads=1"]


def _cfg(*extra: str):
    return load_config(None, [*HOUSEHOLD, *extra], recipe="grpo")


def _anchor(cfg):
    policy = load_policy(cfg.model)
    pool = EnvPool(task_factory(cfg))
    try:
        anchor, note = make_anchor(cfg, pool, policy.tokenizer)
    finally:
        pool.close()
    return policy, anchor, note


def test_anchor_gradient_is_coef_times_the_token_mean_nll_by_hand():
    """c x ( -sum of the target tokens' log-probs / their count ), each row scored alone with a
    log-softmax by hand: the anchor's gradient and returned NLL match it, micro-batched in twos."""
    cfg = _cfg("anchor.coef=0.3", "anchor.n=3", "anchor.rows=5")
    policy, anchor, note = _anchor(cfg)
    assert len(anchor.rows) >= 5 and "walkthrough" in note
    model = policy.causal_lm
    model.zero_grad(set_to_none=True)
    nll = anchor.backward(model, opt_step=7, micro_batch_size=2, logit_chunk=cfg.train.logit_chunk, device="cpu")
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    rows = [anchor.rows[i] for i in anchor.pick(7)]
    total_tokens = sum(sum(r.action_mask) for r in rows)
    summed = 0.0
    for r in rows:
        ids = torch.tensor([r.token_ids])
        logits = model(input_ids=ids).logits[0].float()  # (T, V)
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # log pi(x_t | x_<t), t >= 1
        mask = torch.tensor(r.action_mask[1:], dtype=torch.float32)
        row_nll = -(logp * mask).sum()
        (0.3 * row_nll / total_tokens).backward()
        summed += float(row_nll.detach())
    assert math.isclose(nll, summed / total_tokens, rel_tol=1e-5)
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)


def test_anchor_draws_distinct_rows_from_its_step_seed():
    rows = list(range(10))
    a = Anchor(rows, 1.0, per_step=4, seed=3, pad_id=0)
    first = a.pick(5)
    assert first == a.pick(5) and len(set(first)) == 4 and all(0 <= i < 10 for i in first)
    assert a.pick(6) != first and a.pick(7) != first  # other steps draw other rows
    assert Anchor(rows, 1.0, per_step=4, seed=4, pad_id=0).pick(5) != first  # so does another training seed
    draws = {tuple(sorted(a.pick(s))) for s in range(40)}
    assert len(draws) >= 30  # C(10, 4) = 210 subsets: forty steps do not keep drawing the same few
    counts = [sum(i in a.pick(s) for s in range(400)) for i in rows]
    assert min(counts) > 100 and max(counts) < 220  # each row in ~160 of 400 draws (4/10): none left out or favoured
    assert sorted(Anchor(rows[:3], 1.0, per_step=8, seed=0, pad_id=0).pick(0)) == [0, 1, 2]  # fewer rows than asked: all of them


def test_anchor_off_or_without_demonstrations():
    assert _anchor(_cfg())[1] is None  # coef 0: no anchor, nothing built
    with pytest.raises(UserError, match="no demonstrations"):
        _anchor(_cfg("anchor.coef=1.0", 'anchor.source="reference"'))  # a game has no reference answers


def test_grpo_with_the_anchor_learns_its_demonstrations_and_never_skips_a_step(tmp_path):
    """GRPO from the tiny random model: with the anchor, the demonstrations' NLL (logged as
    anchor/nll at every step) falls, although most groups of the random policy lose together
    and carry no advantage (train.skip_empty_steps would skip such steps without the anchor)."""
    sets = ["train.steps=4", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=8", "train.lr=3e-3",
            "train.skip_empty_steps=true", "eval.n=0", "anchor.coef=1.0", "anchor.n=2", "anchor.rows=16"]
    run = train(_cfg(*sets), tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    nll = [r["anchor/nll"] for r in rows if "anchor/nll" in r]
    assert len(nll) == 4 and all(math.isfinite(v) for v in nll)
    assert all(b < a for a, b in zip(nll, nll[1:])) and nll[-1] < 0.9 * nll[0], nll
    assert all(r.get("policy/skipped_steps", 0) == 0 for r in rows if "anchor/nll" in r)


def test_rsipo_with_the_anchor_learns_its_demonstrations(tmp_path):
    """RSIPO takes the same [anchor]: its update adds the term at every optimizer step, so the
    demonstrations' NLL falls over the run and is logged as anchor/nll."""
    from recursa.recipes.rsipo import train as rsipo_train

    sets = [*HOUSEHOLD, "train.steps=3", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=8", "train.lr=3e-3",
            "skills.enabled=false", 'teacher.source="none"', "teacher.lam=0", "eval.n=0", "anchor.coef=1.0", "anchor.n=2", "anchor.rows=16"]
    run = rsipo_train(load_config(None, sets, recipe="rsipo"), tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    nll = [r["anchor/nll"] for r in rows if "anchor/nll" in r]
    assert len(nll) == 3 and all(b < a for a, b in zip(nll, nll[1:])) and nll[-1] < 0.9 * nll[0], nll
