"""Rewards without a verifier (`[[reward]] kind = ...`): the math against hand computations,
each kind's scorer against an independent computation on the tiny model, and GRPO runs of
2 steps with each kind, their config errors and their resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recursa.algorithms.self_reward import (
    agreement_bin,
    group_standardise,
    majority_vote,
    pearson,
    self_consistency,
    vote_key,
    yes_probability,
)
from recursa.algorithms.trust import TrustEstimator
from recursa.cli import main
from recursa.config import ModelConfig, load_config
from recursa.envs.arithmetic import ArithmeticEnv
from recursa.envs.base import last_number
from recursa.errors import UserError
from recursa.recipes import grpo, sft
from recursa.self_rewards import SelfConsistency, SelfJudge, SelfReward, is_verified
from recursa.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
EXAMPLES = sorted((ROOT / "examples" / "rewards").glob("*.toml"))
FAST = ["model.name=tiny-random", "run.threads=1", "eval.n=4", "train.steps=2"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _traj(group: int, completion: str, answer: str = "", success: bool = False, seed: int | None = None, prompt: str = "What is 2 + 2?",
          ids: list[int] | None = None) -> Trajectory:
    ids = ids or [1, 5, 6, 7, 8]
    return Trajectory("t", group if seed is None else seed, group, ids, [0, 0, 1, 1, 1][: len(ids)] + [1] * max(0, len(ids) - 5),
                      [0.0] * len(ids), float(success), success, completion_text=completion, prompt_text=prompt,
                      info={"answer": answer, "success": success})


# ----------------------------------------------------------------------------- math, by hand


def test_vote_key_canonical_numbers_and_text():
    assert vote_key("1,000") == vote_key("1000.0") == "1000"
    assert vote_key(" 7 ") == "7" and vote_key("-0") == "0"
    assert vote_key("a   b\n") == "a b"
    assert vote_key("") is None and vote_key("   ") is None and vote_key(None) is None


def test_majority_vote_by_hand():
    assert majority_vote(["3", "5", "3", None]) == ("3", 0.5)  # 2 of 4; the None counts in G
    assert majority_vote(["5", "3", "3", "5"]) == ("5", 0.5)  # a tie goes to the answer seen first
    assert majority_vote([None, None]) == (None, 0.0)
    assert majority_vote(["4"]) == ("4", 1.0)


def test_self_consistency_by_hand():
    groups = [0, 0, 1, 1, 0, 0, 1, 1]  # two groups, interleaved
    answers = ["3", "3", "7", "8", "5", None, "9", "7"]
    c = self_consistency(groups, answers, min_agreement=0.5)
    # group 0: "3" x2 of 4 -> label "3", share 1/2; group 1: "7" x2 of 4 -> label "7", share 1/2 (not below 0.5)
    assert c.labels == ["3", "7"] and c.shares == [0.5, 0.5] and c.members == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert c.rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert c.low == [False] * 8
    strict = self_consistency(groups, answers, min_agreement=0.6)  # both groups under 0.6: no label, reward 0
    assert strict.rewards == [0.0] * 8 and strict.low == [True] * 8
    assert strict.agree == c.agree  # the vote itself does not depend on the threshold
    none = self_consistency([0, 0], [None, None])
    assert none.rewards == [0.0, 0.0] and none.labels == [None] and none.shares == [0.0]
    with pytest.raises(ValueError):
        self_consistency([0], ["1", "2"])


def test_agreement_bins():
    assert [agreement_bin(s, 4) for s in (0.0, 0.24, 0.25, 0.5, 0.74, 0.75, 0.999, 1.0)] == [0, 0, 1, 2, 2, 3, 3, 3]
    assert agreement_bin(0.3, 1) == agreement_bin(1.0, 1) == 0
    with pytest.raises(ValueError):
        agreement_bin(1.5, 4)


def test_yes_probability_by_hand():
    p = yes_probability(torch.tensor([math.log(0.2), math.log(0.5)]), torch.tensor([math.log(0.6), math.log(0.5)]))
    assert p.tolist() == pytest.approx([0.2 / 0.8, 0.5])


def test_group_standardise_by_hand():
    values = [1.0, 3.0, 5.0, 5.0, 0.0, 10.0, 20.0]
    groups = ["a", "a", "b", "b", "c", "c", "c"]
    # a: mean 2, std 1 -> -1, 1; b: all equal -> 0, 0; c: mean 10, std sqrt(200/3) = 8.165 -> -1.2247, 0, 1.2247, clipped at 1.2
    assert group_standardise(values, groups, clip=1.2) == pytest.approx([-1.0, 1.0, 0.0, 0.0, -1.2, 0.0, 1.2])
    assert group_standardise(values, groups, clip=3.0)[4] == pytest.approx(-10 / math.sqrt(200 / 3))


def test_pearson_by_hand():
    # x = 1, 2, 3; y = 1, 2, 5: sxy = 4, sxx = 2, syy = 78/9 -> 4 / sqrt(2 * 78 / 9)
    assert pearson([1, 2, 3], [1, 2, 5]) == pytest.approx(4 / math.sqrt(2 * 78 / 9))
    assert pearson([1, 2], [3, 1]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1], [1])) and math.isnan(pearson([1, 1, 1], [0, 1, 2]))


def test_verified_tasks_are_a_seeded_share():
    share = sum(is_verified(s, 0.3) for s in range(4000)) / 4000
    assert 0.27 < share < 0.33
    assert [is_verified(s, 0.3) for s in range(50)] == [is_verified(s, 0.3) for s in range(50)]
    assert not any(is_verified(s, 0.0) for s in range(100)) and all(is_verified(s, 1.0) for s in range(100))


# ----------------------------------------------------------------------------- the scorers


def _two_groups() -> list[Trajectory]:
    """Task 0 (answer 4): replies 4, 4, 4, 5 -> label 4 (share 3/4), right. Task 1 (answer 2):
    9, 9, 2, 2 -> label 9 by the tie rule (share 1/2), wrong."""
    g0 = [_traj(0, f"it is {a}", "4", a == "4") for a in ("4", "4", "4", "5")]
    g1 = [_traj(1, f"{a}", "2", a == "2") for a in ("9", "9", "2", "2")]
    return g0 + g1


def test_self_consistency_scorer_by_hand():
    trajs = _two_groups()
    term = SelfConsistency("sc", last_number, min_agreement=0.6, penalty=0.1, verified_frac=1.0, bins=4, decay=0.9)
    out = term.score(trajs, [t.reward for t in trajs])
    # trials: bin 3 (share 3/4) one right label, bin 2 (share 1/2) one wrong one. Each bin has a
    # single trial, so the prior is not identified and stays the cold Beta(1, 1): posterior
    # 2/3 -> trust 1/3 in bin 3, 1/3 -> trust 0 in bin 2.
    assert out.values == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert out.advantage_offsets == [0.0] * 4 + [-0.1] * 4  # task 1 is below min_agreement 0.6
    m = out.metrics
    assert m["reward/sc/agreement"] == pytest.approx(0.625) and m["reward/sc/low_agreement"] == pytest.approx(0.5)
    assert m["reward/sc/label_accuracy"] == m["reward/sc/label_accuracy_all"] == pytest.approx(0.5)
    assert m["reward/sc/trust"] == pytest.approx(1 / 6)
    # the same counts by hand in a TrustEstimator
    hand = TrustEstimator(decay=0.9)
    hand.update({3: (1.0, 1.0), 2: (0.0, 1.0)})
    assert term.state_dict() == hand.state_dict()
    # a resumed scorer picks up the counts: the next step's trust equals the uninterrupted one's
    again = SelfConsistency("sc", last_number, 0.6, 0.1, 1.0, 4, 0.9)
    again.load_state_dict(json.loads(json.dumps(term.state_dict())))
    assert again.score(trajs, [0.0] * 8).values == term.score(trajs, [0.0] * 8).values


def _restrain_set(mode: str, weight: float, estimator: str = "grpo"):
    """The env's reward (weight 1) and a self_consistency entry (kappa 1/2, delta 0.1) over two
    groups of 4: task 0 answers 1, 2, 3, 4 (share 1/4: low agreement) with env rewards
    1, 0, 0, 0; task 1 answers 7, 7, 7, 8 (share 3/4, label 7) with env rewards 1, 0, 0, 0."""
    import functools

    from recursa.algorithms.advantages import compute_advantages
    from recursa.rewards import RewardSet, RewardTerm

    trajs = [_traj(0, a, "1", a == "1") for a in ("1", "2", "3", "4")] + [_traj(1, a, "8", a == "8") for a in ("8", "7", "7", "7")]
    for t, r in zip(trajs, [1.0, 0.0, 0.0, 0.0] * 2):
        t.reward = r
    sc = SelfConsistency("sc", last_number, 0.5, 0.1, 0.0, 4, 0.9, restrain=mode)
    rs = RewardSet([RewardTerm("env", "env", 1.0, None), RewardTerm("sc", "self_consistency", weight, None, sc)],
                   functools.partial(compute_advantages, estimator), 4)
    return rs, trajs


def _advantages(rs, trajs, estimator: str = "grpo") -> list[float]:
    """What the recipe does with a Scored: the estimator's advantage of the totals + the offsets."""
    from recursa.algorithms.advantages import compute_advantages
    from recursa.rewards import score_trajectories

    scored = score_trajectories(rs, trajs)
    adv = compute_advantages(estimator, torch.tensor([t.reward for t in trajs], dtype=torch.float32).view(2, 4))
    if scored.advantage_offsets is not None:
        adv = adv + torch.tensor(scored.advantage_offsets, dtype=torch.float32).view(2, 4)
    return adv.reshape(-1).tolist()


def test_restrain_add_and_paper_by_hand():
    """Issue 50's example. Task 0 (low agreement): totals = env = 1, 0, 0, 0 -> GRPO mean 1/4,
    unbiased std sqrt((9/16 + 3/16) / 3) = 1/2 -> 1.5, -0.5, -0.5, -0.5; 'add' adds -delta:
    1.4, -0.6, -0.6, -0.6; RESTRAIN's paper gives every rollout -delta (x the weight w).
    Task 1 (label 7): totals 1 + 0, 0 + w, 0 + w, 0 + w, the same in both modes: w = 1 is a
    constant group (advantage 0); w = 0.5: 1, .5, .5, .5 -> mean 5/8, std sqrt((9/64 + 3/64)
    / 3) = 1/4 -> 1.5, -0.5, -0.5, -0.5."""
    rs, trajs = _restrain_set("add", 1.0)
    assert _advantages(rs, trajs) == pytest.approx([1.4, -0.6, -0.6, -0.6, 0.0, 0.0, 0.0, 0.0], abs=1e-5)
    rs, trajs = _restrain_set("paper", 1.0)
    assert _advantages(rs, trajs) == pytest.approx([-0.1] * 4 + [0.0] * 4, abs=1e-6)
    rs, trajs = _restrain_set("paper", 0.5)
    assert _advantages(rs, trajs) == pytest.approx([-0.05] * 4 + [1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # an estimator that ranks a constant group (GOPO: 2, 0, -2 by sort order) still leaves -delta
    rs, trajs = _restrain_set("paper", 1.0, "gopo")
    assert _advantages(rs, trajs, "gopo") == pytest.approx([-0.1] * 4 + [2.0, 2 / 3, -2 / 3, -2.0], abs=1e-5)
    # delta = 0 in the paper's mode: the low group's advantage is exactly 0, its env rewards do not move it
    sc = SelfConsistency("sc", last_number, 0.5, 0.0, 0.0, 4, 0.9, restrain="paper")
    assert sc.score(trajs, [1.0, 0, 0, 0] * 2).advantage_targets == [0.0] * 4 + [None] * 4
    with pytest.raises(ValueError, match="restrain must be"):
        SelfConsistency("sc", last_number, 0.5, 0.0, 0.0, 4, 0.9, restrain="both")


def test_restrain_option_is_validated():
    ok = load_config(SMOKE, ['reward=[{kind = "self_consistency", min_agreement = 0.5, penalty = 0.1, restrain = "paper"}]'])
    assert ok.reward[0].option("restrain") == "paper"
    assert load_config(SMOKE, ['reward=[{kind = "self_consistency"}]']).reward[0].option("restrain") == "add"
    with pytest.raises(Exception, match="restrain"):
        load_config(SMOKE, ['reward=[{kind = "self_consistency", restrain = "replace"}]'])
    with pytest.raises(Exception, match="option of kind = 'self_consistency'"):
        load_config(SMOKE, ['reward=[{kind = "self_judge", restrain = "paper"}]'])


def test_self_consistency_without_verified_tasks_is_plain_ttrl():
    trajs = _two_groups()
    out = SelfConsistency("sc", last_number, 0.0, 0.0, 0.0, 4, 0.9).score(trajs, [0.0] * 8)
    assert out.values == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert out.advantage_offsets is None and "reward/sc/trust" not in out.metrics
    assert math.isnan(out.metrics["reward/sc/label_accuracy"])  # nothing verified ...
    assert out.metrics["reward/sc/label_accuracy_all"] == pytest.approx(0.5)  # ... but both tasks have a reference answer
    # a task without a reference answer is never verified, and not in label_accuracy_all either
    blank = [_traj(0, "4"), _traj(0, "4")]
    m = SelfConsistency("sc", last_number, 0.0, 0.0, 1.0, 4, 0.9).score(blank, [0.0, 0.0]).metrics
    assert math.isnan(m["reward/sc/label_accuracy"]) and math.isnan(m["reward/sc/label_accuracy_all"])


def _raw_logprob(model, ids: list[int], start: int) -> float:
    """sum_{t >= start} log p(ids[t] | ids[:t]) by a plain forward pass and log-softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=next(model.parameters()).device)).logits[0].double().cpu()
    logp = torch.log_softmax(logits, dim=-1)
    return float(sum(logp[t - 1, ids[t]] for t in range(start, len(ids))))


def test_self_judge_reads_yes_against_no(tiny_policy):
    judge = SelfJudge("judge", tiny_policy, "Task: {prompt}\nReply: {completion}\nCorrect? Answer Yes or No.", "You grade.", micro=3, chunk=7,
                      shared_prefix=True)
    trajs = [_traj(0, "4", "4", True), _traj(0, "five", "4"), _traj(1, "the answer is 12", "12", True, prompt="What is 7 + 5?")]
    out = judge.score(trajs, [1.0, 0.0, 1.0])
    model = tiny_policy.causal_lm
    for t, value, prompt in zip(trajs, out.values, judge.judge_prompts(trajs)):
        text = tiny_policy.tokenizer.decode(prompt)
        assert f"Task: {t.prompt_text}\nReply: {t.completion_text}" in text and "You grade." in text
        yes, no = _raw_logprob(model, prompt + judge.yes, len(prompt)), _raw_logprob(model, prompt + judge.no, len(prompt))
        assert value == pytest.approx(1 / (1 + math.exp(no - yes)), abs=1e-5)
    m = out.metrics
    assert m["reward/judge/verified_mean"] == pytest.approx(2 / 3)
    assert m["reward/judge/gap"] == pytest.approx(sum(out.values) / 3 - 2 / 3)
    assert m["reward/judge/corr"] == pytest.approx(pearson(out.values, [1.0, 0.0, 1.0]))
    # the same numbers without the shared-prefix forward
    plain = SelfJudge("judge", tiny_policy, judge.rubric, "You grade.", micro=16, chunk=512, shared_prefix=False)
    assert plain.score(trajs, [1.0, 0.0, 1.0]).values == pytest.approx(out.values, abs=1e-5)


def test_self_reward_is_the_standardised_log_ratio(tiny_policy):
    from recursa.models import load_policy

    sft_model = tiny_policy.causal_lm
    base_model = load_policy(ModelConfig(name="tiny-random", tiny={"seed": 1})).causal_lm  # another model: the log-ratio is not 0
    tok = tiny_policy.tokenizer
    prompt = tok.encode("What is 2 + 2?", add_special_tokens=False)
    replies = ["4", "it is 4", "5", "four", "9", "19 or 20"]
    trajs = []
    for i, r in enumerate(replies):
        reply = tok.encode(r, add_special_tokens=False)
        t = _traj(i // 3, r, "4", r == "4")
        t.token_ids, t.action_mask, t.sample_logprobs = prompt + reply, [0] * len(prompt) + [1] * len(reply), [0.0] * (len(prompt) + len(reply))
        trajs.append(t)
    term = SelfReward("sr", sft_model, base_model, tok.pad_token_id, clip=1.0, micro=4, chunk=5, shared_prefix=True)
    out = term.score(trajs, [t.reward for t in trajs])
    d = [_raw_logprob(sft_model, t.token_ids, len(prompt)) - _raw_logprob(base_model, t.token_ids, len(prompt)) for t in trajs]
    assert term.log_ratios(trajs).tolist() == pytest.approx(d, abs=1e-4)
    hand = []
    for g in (d[:3], d[3:]):  # per group: (d - mean) / population std, clipped at 1
        mean = sum(g) / 3
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / 3)
        hand += [max(-1.0, min(1.0, (x - mean) / std)) for x in g]
    assert out.values == pytest.approx(hand, abs=1e-4)
    assert out.metrics["reward/sr/log_ratio_mean"] == pytest.approx(sum(d) / 6, abs=1e-4)
    assert out.metrics["reward/sr/corr"] == pytest.approx(pearson(d, [t.reward for t in trajs]), abs=1e-4)


# ----------------------------------------------------------------------------- GRPO, end to end


def test_grpo_with_self_consistency_and_the_penalty_reaching_the_advantages(tmp_path):
    """Self-consistency alone (the env's weight 0), every group below min_agreement = 1 unless
    unanimous: a non-unanimous group gets reward 0 (advantage 0) plus the penalty -0.5, a
    unanimous one reward 1 for all (advantage 0). Checked on every logged sample."""
    run = tmp_path / "sc"
    B, G = 2, 4
    cfg = load_config(SMOKE, [*FAST, "run.log_samples=8", 'reward=[{func = "env", weight = 0.0}, {kind = "self_consistency", min_agreement = 1.0, '
                              'penalty = 0.5, verified_frac = 1.0}]'])
    grpo.train(cfg, run, log=lambda *_: None)
    rows = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        for key in ("agreement", "low_agreement", "trust"):
            assert 0.0 <= r[f"reward/self_consistency/{key}"] <= 1.0
        assert r["reward/env/mean"] == pytest.approx(r["reward/success_rate"])  # logged, weight 0
        assert r["reward/mean"] == pytest.approx(r["reward/self_consistency/mean"], abs=1e-6)
    env = ArithmeticEnv()
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = [s for s in samples if s["step"] == step]
        assert len(mine) == B * G
        for g in range(B):
            group = mine[g * G : (g + 1) * G]
            assert len({s["seed"] for s in group}) == 1
            votes = [vote_key(env.parse(s["completion"])) for s in group]
            unanimous = votes[0] is not None and len(set(votes)) == 1
            for s in group:
                assert s["advantage"] == pytest.approx(0.0 if unanimous else -0.5, abs=1e-6)
    saved = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert set(saved["rewards"]) == {"self_consistency"} and saved["rewards"]["self_consistency"]["steps"] == 2


def test_grpo_with_restrain_as_the_paper_defines_it(tmp_path):
    """restrain = 'paper', the env's reward kept (weight 1) and self_consistency at weight 2,
    kappa = 1: every non-unanimous group's samples get advantage -2 * 0.5 = -1 whatever their
    env rewards; a unanimous group keeps GRPO's advantage of its totals."""
    run = tmp_path / "sc"
    B, G = 2, 4
    cfg = load_config(SMOKE, [*FAST, "run.log_samples=8", 'reward=[{kind = "self_consistency", weight = 2.0, min_agreement = 1.0, '
                              'penalty = 0.5, restrain = "paper"}]'])
    grpo.train(cfg, run, log=lambda *_: None)
    env = ArithmeticEnv()
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    seen = 0
    for step in (1, 2):
        mine = [s for s in samples if s["step"] == step]
        assert len(mine) == B * G
        for g in range(B):
            group = mine[g * G : (g + 1) * G]
            votes = [vote_key(env.parse(s["completion"])) for s in group]
            if not (votes[0] is not None and len(set(votes)) == 1):
                seen += 1
                assert [s["advantage"] for s in group] == pytest.approx([-1.0] * G, abs=1e-6)
    assert seen > 0  # the tiny model's replies disagree


def test_grpo_with_self_judge_logs_it_next_to_the_verified_reward(tmp_path):
    run = tmp_path / "judge"
    cfg = load_config(SMOKE, [*FAST, 'reward=[{kind = "self_judge", weight = 2.0}]'])
    grpo.train(cfg, run, log=lambda *_: None)
    rows = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        judge, env = r["reward/self_judge/mean"], r["reward/env/mean"]
        assert 0.0 < judge < 1.0
        assert r["reward/self_judge/verified_mean"] == pytest.approx(env)  # every arithmetic task has its answer
        assert r["reward/self_judge/gap"] == pytest.approx(judge - env, abs=1e-6)
        assert r["reward/mean"] == pytest.approx(env + 2.0 * judge, abs=1e-5)
        assert "reward/self_judge/corr" in r


def test_self_consistency_on_a_jsonl_dataset_with_unlabelled_rows(tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1) if i % 2 else "", "split": "train"} for i in range(8)]
    rows += [{"prompt": f"What is {i} + 2?", "answer": str(i + 2), "split": "test"} for i in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    cfg = load_config(None, ["model.name=tiny-random", "run.threads=1", "train.steps=2", "train.prompts_per_step=4", "train.group_size=2",
                             "sampling.max_new_tokens=6", "eval.n=2", "data.source=jsonl", f"data.path='{data}'", "data.split_key=split",
                             'reward=[{kind = "self_consistency", verified_frac = 1.0}]'])
    grpo.train(cfg, run, log=lambda *_: None)
    rows = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(rows) == 2 and all("reward/self_consistency/agreement" in r for r in rows)


def test_dataset_answer_extraction_follows_its_scorer(tmp_path, monkeypatch):
    from recursa.envs.dataset import DatasetEnv

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(20)))
    assert DatasetEnv(str(data), scorer="last_number").parse("maybe 3, no: 1,000") == "1000"
    exact = DatasetEnv(str(data), scorer="exact")
    assert exact.parse("so <answer> blue  sky </answer>") == "blue sky" and exact.parse("  red\n car ") == "red car" and exact.parse(" ") is None
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "byo_pkg"))
    assert DatasetEnv(str(data), scorer="byo_tasks.rewards:brevity").parse is None


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """A tiny SFT warm start on arithmetic: pi_SFT of the self-reward runs."""
    out = tmp_path_factory.mktemp("sft") / "run"
    cfg = load_config(None, ["model.name=tiny-random", "run.threads=1", "data.n=8", "train.epochs=1", "train.batch_size=4", "train.lr=1e-3",
                             "eval.n=0"], recipe="sft")
    sft.train(cfg, out, log=lambda *_: None)
    return out


def test_grpo_with_self_reward_from_the_warm_start(tmp_path, sft_run):
    run = tmp_path / "sr"
    cfg = load_config(SMOKE, [*FAST, f"init.from_run='{sft_run}'", 'reward=[{func = "env", weight = 0.0}, {kind = "self_reward", clip = 2.0}]'])
    grpo.train(cfg, run, log=lambda *_: None)
    rows = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["reward/self_reward/log_ratio_mean"]) and r["reward/self_reward/log_ratio_mean"] != 0.0
        assert abs(r["reward/self_reward/mean"]) < 1e-6  # standardised within every group: each group's rewards sum to 0
        assert r["reward/std"] > 0


def test_self_reward_against_another_run_as_the_base(tmp_path, sft_run):
    first = tmp_path / "first"
    grpo.train(load_config(SMOKE, [*FAST, "train.steps=1", "eval.n=0"]), first, log=lambda *_: None)
    run = tmp_path / "sr"
    cfg = load_config(SMOKE, [*FAST, "train.steps=1", "eval.n=0", f"init.from_run='{sft_run}'", f"reward=[{{kind = 'self_reward', base = '{first}'}}]"])
    grpo.train(cfg, run, log=lambda *_: None)
    rows = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(rows) == 1 and math.isfinite(rows[0]["reward/self_reward/log_ratio_mean"]) and rows[0]["reward/self_reward/log_ratio_mean"] != 0.0


def test_self_consistency_resume_restores_the_label_accuracy_counts(tmp_path):
    sets = ["--set", "train.steps=3", "--set", "run.checkpoint_every=1", "--set", "eval.n=4", "--set", "run.threads=1",
            "--set", 'reward=[{kind = "self_consistency", verified_frac = 1.0, trust_decay = 0.5}]']
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", SMOKE, "--out", str(full), *sets]) == 0
    assert main(["train", SMOKE, "--out", str(part), *sets, "--set", "train.steps=1", "--set", "eval.after=false"]) == 0
    assert main(["train", "--resume", str(part), "--set", "train.steps=3", "--set", "eval.after=true"]) == 0
    state = lambda run: json.loads((run / "checkpoints" / "step_000003" / "state.json").read_text())["rewards"]  # noqa: E731
    assert state(part) == state(full) and state(full)["self_consistency"]["steps"] == 3
    drop = ("time/", "throughput/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]  # noqa: E731
    assert json.dumps(strip(_metrics(part))) == json.dumps(strip(_metrics(full)))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "sets, message",
    [
        (['reward=[{kind = "self_reward"}]'], "reward kind = 'self_reward' needs two models"),
        (['reward=[{kind = "self_judge", clip = 2.0}]'], "reward.clip is an option of kind = 'self_reward'"),
        (['reward=[{kind = "self_judge", func = "env"}]'], "takes no func"),
        (["reward=[{weight = 2.0}]"], "needs func"),
        (['reward=[{kind = "self_judge", rubric = "Is {answer} right?"}]'], "rubric"),
        (['reward=[{kind = "self_judge", rubric = "Is it right?"}]'], "must contain {completion}"),
        (['reward=[{kind = "self_consistency"}, {kind = "self_consistency"}]'], "two [[reward]] entries are named 'self_consistency'"),
        (["env.name=toy-corridor", "env.kwargs={}", 'reward=[{kind = "self_judge"}]'], "toy-corridor is a multi-turn game"),
        (["init.from_run='runs/x'", "reward=[{kind = 'self_reward', base = 'runs/x'}]"], "is the warm start init.from_run itself"),
    ],
)
def test_bad_self_reward_configs_are_one_line(sets, message, capsys):
    with pytest.raises(UserError) as err:
        load_config(SMOKE, sets)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_self_kinds_only_in_grpo():
    with pytest.raises(UserError, match="available in the grpo recipe, not in 'rsipo'"):
        load_config(str(ROOT / "examples" / "rsipo_smoke.toml"), ['reward=[{kind = "self_judge"}]'])


def test_self_consistency_needs_answer_extraction(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "byo_pkg"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(20)))
    sets = ["data.source=jsonl", f"data.path='{data}'", "data.scorer='byo_tasks.rewards:brevity'", 'reward=[{kind = "self_consistency"}]']
    with pytest.raises(UserError, match="votes on the answers a task extracts from replies, and data:d.jsonl extracts none"):
        load_config(None, sets)
    load_config(None, [*sets[:2], 'reward=[{kind = "self_consistency"}]'])  # the last-number scorer extracts answers


def test_a_missing_base_run_stops_with_one_line(tmp_path, sft_run, capsys):
    argv = ["train", SMOKE, "--out", str(tmp_path / "r"), "--set", "model.name=tiny-random", "--set", f"init.from_run='{sft_run}'",
            "--set", f"reward=[{{kind = 'self_reward', base = '{tmp_path / 'nope'}'}}]"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "reward.base = " in err and "no run there" in err and "\n" not in err


def test_default_rewards_are_unchanged_by_the_new_kinds(tmp_path):
    """A config without built-in kinds dumps no kind options and trains exactly as before:
    the same metrics with and without an explicit env entry of weight 1."""
    a, b = tmp_path / "a", tmp_path / "b"
    grpo.train(load_config(SMOKE, [*FAST]), a, log=lambda *_: None)
    grpo.train(load_config(SMOKE, [*FAST, 'reward=[{func = "env"}]']), b, log=lambda *_: None)
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "reward/env/"))}  # noqa: E731
    assert [keep(r) for r in _metrics(a)] == [keep(r) for r in _metrics(b)]
    assert "min_agreement" not in (b / "config.toml").read_text() and "rubric" not in (b / "config.toml").read_text()


# ----------------------------------------------------------------------------- the example configs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_configs_run_on_the_tiny_model(path, tmp_path, sft_run):
    sets = ["model.name=tiny-random", "run.threads=1", "eval.n=2", "sampling.max_new_tokens=6"]
    cfg = load_config(path, check=True)
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.env.name == "arithmetic"  # what the lead measures
    if cfg.recipe == "sft":
        sets += ["data.n=4", "train.batch_size=4"]
    else:
        sets += ["train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=8"]
        if cfg.init.from_run:
            sets.append(f"init.from_run='{sft_run}'")
    cfg = load_config(path, sets)
    module = sft if cfg.recipe == "sft" else grpo
    module.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert (tmp_path / "run" / "eval" / "after.json").exists()
