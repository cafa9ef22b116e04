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
from recursa.trajectory import Trajectory

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


# ---------------------------------------------------------------- self-imitation (source = "successes")

class CoinEnv:
    """Toy single-turn task the tiny random model wins about half the time: a reply wins when
    the sum of its character codes is even."""

    name = "toy-coin"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return f"Say anything. Item {seed % 7}."

    def step(self, action_text: str):
        from recursa.envs import StepResult

        won = sum(map(ord, action_text or "")) % 2 == 0
        return StepResult("", float(won), True, {"success": won})


def _register_coin():
    from recursa.envs import register_env

    register_env("toy-coin", CoinEnv, "toy: a reply wins when its character codes sum to an even number (tests)")


def _row(seed: int, ids: list[int], text: str = "") -> Trajectory:
    return Trajectory("toy", seed, 0, ids, [0] + [1] * (len(ids) - 1), [0.0] * len(ids), 1.0, True, completion_text=text)


def test_successes_draw_evenly_across_strata_and_keep_distinct_wins():
    a = Anchor([], 1.0, per_step=6, seed=0, pad_id=0, keys=[], capacity=3)
    assert a.empty() and a.pick(0) == []
    wins = [("pick", (1, ("a",)), [_row(1, [5, 6])]), ("pick", (1, ("a",)), [_row(1, [5, 6])]),  # the same win twice: kept once
            ("pick", (2, ("b",)), [_row(2, [5, 7])]), ("heat", (3, ("c", "d")), [_row(3, [8, 9]), _row(3, [8, 9, 10])])]
    assert a.observe(wins) == 3
    assert a.keys == ["heat", "heat", "pick", "pick"]  # strata in name order, each in arrival order
    for step in range(20):  # 6 rows asked, 3 a stratum, but heat and pick have only 2 each: all four rows
        assert sorted(a.pick(step)) == [0, 1, 2, 3]
    more = [("pick", (k, ("x",)), [_row(k, [5, k])]) for k in range(10, 14)]
    assert a.observe(more) == 4
    pick_rows = [r.seed for r, k in zip(a.rows, a.keys) if k == "pick"]
    assert pick_rows == [11, 12, 13]  # capacity 3 a stratum, oldest out first
    for step in range(20):
        chosen = a.pick(step)
        assert len(chosen) == 5 and sum(a.keys[i] == "heat" for i in chosen) == 2  # heat gives all it has, pick its 3
    b = Anchor([], 1.0, per_step=1, seed=0, pad_id=0, keys=[], capacity=3)
    b.observe(wins + more)
    firsts = {b.keys[b.pick(s)[0]] for s in range(30)}
    assert firsts == {"heat", "pick"}  # one row a step: the seeded order gives each stratum its turn


def test_successes_survive_a_checkpoint():
    import json as _json

    a = Anchor([], 1.0, per_step=4, seed=5, pad_id=0, keys=[], capacity=2)
    a.observe([("", (k, ("go east", "go east")), [_row(k, [1, 2, 3]), _row(k, [1, 2, 3, 4])]) for k in range(3)])
    state = _json.loads(_json.dumps(a.state_dict()))  # through state.json
    b = Anchor([], 1.0, per_step=4, seed=5, pad_id=0, keys=[], capacity=2)
    b.load_state_dict(state)
    assert [r.token_ids for r in b.rows] == [r.token_ids for r in a.rows] and b.keys == a.keys
    assert [r.action_mask for r in b.rows] == [r.action_mask for r in a.rows]
    assert all(b.pick(s) == a.pick(s) for s in range(10))
    assert b.observe([("", (2, ("go east", "go east")), [_row(2, [1, 2, 3])])]) == 0  # identities restored: a kept win is not added again


def test_won_episodes_groups_rows_by_episode():
    from recursa.anchor import won_episodes

    rows = [_row(7, [1, 2], "go east"), _row(7, [1, 3], "go west"), _row(8, [1, 4], "wait"), _row(9, [1, 5], "go east"), _row(9, [1, 6], "x")]
    got = won_episodes(rows, [0, 0, 1, 2, 2], [True, False, True], lambda seed: f"arm{seed % 2}")
    assert [(k, ident, [r.token_ids for r in rs]) for k, ident, rs in got] == [
        ("arm1", (7, ("go east", "go west")), [[1, 2], [1, 3]]), ("arm1", (9, ("go east", "x")), [[1, 5], [1, 6]])]


def test_grpo_self_imitation_keeps_wins_per_arm_and_imitates_them(tmp_path):
    """GRPO on a toy task the tiny model wins half the time, with two curriculum arms: the first
    step has nothing to imitate (anchor/nll 0), every later step imitates the earlier wins,
    at most n per arm, and a resumed run restores them from the checkpoint."""
    _register_coin()
    sets = ['model.name="tiny-random"', 'env.name="toy-coin"', "sampling.max_new_tokens=4", "train.steps=3", "train.prompts_per_step=2",
            "train.group_size=4", "train.micro_batch_size=8", "train.lr=1e-3", "eval.n=0", "curriculum.mode=progress",
            'curriculum.arms=[{name = "a"}, {name = "b"}]', "anchor.coef=1.0", 'anchor.source="successes"', "anchor.n=3", "anchor.rows=4",
            "run.checkpoint_every=1", "run.threads=1"]
    run = train(load_config(None, sets, recipe="grpo"), tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "anchor/nll" in line]
    assert len(rows) == 3 and rows[0]["anchor/nll"] == 0.0 and rows[0]["anchor/wins_added"] > 0
    assert all(r["anchor/nll"] > 0 for r in rows[1:])
    assert all(r["anchor/rows"] <= 2 * 3 for r in rows)  # 2 arms x 3 wins x 1 row (single-turn)
    state = json.loads(sorted((run / "checkpoints").glob("step_*"))[-1].joinpath("state.json").read_text())
    kept = state["anchor"]
    assert set(kept) <= {"a", "b"} and all(len(v) <= 3 for v in kept.values())
    assert sum(len(v) for v in kept.values()) == rows[-1]["anchor/rows"]


def test_self_imitation_is_refused_where_it_is_not_wired():
    with pytest.raises(Exception, match="option of the grpo recipe"):
        load_config(None, ["anchor.coef=1.0", 'anchor.source="successes"'], recipe="rsipo")


def test_a_data_parallel_learner_refuses_the_anchor_in_one_line(monkeypatch):
    from recursa.anchor import check_anchor
    from recursa.distributed import ddp

    monkeypatch.setattr(ddp, "active", lambda: True)
    check_anchor(_cfg())  # coef 0: nothing to refuse
    with pytest.raises(UserError, match="data-parallel learner"):
        check_anchor(_cfg("anchor.coef=0.1"))
