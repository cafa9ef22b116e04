"""benchmarks/teacher_probe.py: the critical-turn pairing, its summary, and its scores against
a forward pass of the model by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from recursa.envs import StepResult
from recursa.envs.base import EnvPool
from recursa.recipes.rsipo import Attempt, Context

REPO = Path(__file__).resolve().parent.parent


def _probe():
    spec = importlib.util.spec_from_file_location("teacher_probe", REPO / "benchmarks" / "teacher_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _attempt(seed: int, success: bool, steps: list[tuple[str, str]]) -> Attempt:
    ctxs = [Context("Your task is to: x.", obs, ["a", "b"], []) for obs, _ in steps]
    return Attempt("toy", seed, 0, 0, success, "Your task is to: x.", ctxs, [[1]] * len(steps), [act for _, act in steps])


def test_critical_pairs_pair_each_failure_with_the_first_winner_it_left_from_a_shared_state():
    tp = _probe()
    G = 4
    group0 = [
        _attempt(1, False, [("s0", "a"), ("s1", "b"), ("s2", "b")]),  # left winner 1 at turn 1
        _attempt(1, True, [("s0", "a"), ("s1", "a")]),
        _attempt(1, False, [("s0", "b")]),  # left winner 1 at turn 0
        _attempt(1, True, [("s0", "a"), ("s1", "a")]),
    ]
    group1 = [
        _attempt(2, False, [("s0", "a"), ("s9", "a")]),  # same action, another observation: no verdict with winner 5 ...
        _attempt(2, True, [("s0", "a"), ("s1", "a")]),
        _attempt(2, True, [("s0", "b")]),  # ... so it pairs with winner 6 at turn 0
        _attempt(2, False, [("s0", "a"), ("s1", "a"), ("s2", "b")]),  # winner 5's whole path, then more: never left it; left 6 at 0
    ]
    group2 = [_attempt(3, False, [("s0", "a")])] * G  # no winner: no pair
    assert tp.critical_pairs(group0 + group1 + group2, G) == [(0, 1, 1), (2, 1, 0), (4, 6, 0), (7, 6, 0)]


def test_summary_of_hand_made_critical_turns():
    tp = _probe()
    turns = [
        {"student_win": -1.0, "student_fail": -0.5, "teacher_win": -0.2, "teacher_fail": -0.9, "delta_at": -0.4, "delta_before": 0.1, "delta_after": None,
         "win_action": "go", "walkthrough_action": "go"},
        {"student_win": -0.3, "student_fail": -0.6, "teacher_win": -0.3, "teacher_fail": -0.3, "delta_at": 0.2, "delta_before": None, "delta_after": -0.1,
         "win_action": "go", "walkthrough_action": "stay"},
    ]
    episodes = [{"delta": 0.1, "advantage": 0.5}, {"delta": -0.1, "advantage": -0.5}, {"delta": 0.3, "advantage": 0.5}]
    s = tp.summarise(turns, episodes)
    assert s["critical_turns"] == 2
    assert s["student_prefers_win"] == 0.5 and s["teacher_prefers_win"] == 0.5  # a tie is not a preference
    # margins: student -0.5 and +0.3, teacher +0.7 and 0 -> shifts +1.2 and -0.3
    assert s["margin_shift"] == pytest.approx(0.45) and s["margin_shift_median"] == pytest.approx(0.45)
    assert (s["flips_to_win"], s["flips_to_fail"]) == (1, 1)  # the first turns to the win, the second away (a tie)
    # only the first turn's walkthrough action is the winner's: the student did not prefer it there, the teacher did
    assert (s["walkthrough_is_win"], s["student_prefers_win_there"], s["teacher_prefers_win_there"]) == (1, 0, 1)
    assert s["delta_critical"] == pytest.approx(-0.1) and s["delta_before"] == pytest.approx(0.1) and s["delta_after"] == pytest.approx(-0.1)
    # deltas 0.1, -0.1, 0.3 (mean 0.1) against 0.5, -0.5, 0.5 (mean 1/6): sxy = 0.2, sxx = 0.08, syy = 2/3
    assert s["corr_delta_advantage"] == pytest.approx(0.2 / (0.08 * 2 / 3) ** 0.5)
    assert tp.pearson([1.0, 1.0, 1.0], [0.0, 1.0, 2.0]) is None and tp.pearson([1.0, 2.0], [1.0, 2.0]) is None


class ParityEnv:
    """Two turns; the game is won when the first action has an even number of characters, so a
    random policy wins about half its episodes and fails and wins share the first state."""

    name = "toy-parity"
    system_prompt = None

    def reset(self, seed: int) -> str:
        self.task, self.turn, self.first = "Your task is to: say something even.", 0, ""
        return "Room 0."

    def admissible_actions(self) -> list[str]:
        return ["go", "stay"]

    def walkthrough(self) -> list[str]:
        return ["go", "go"]

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            self.first = action_text or ""
        done = self.turn >= 2
        won = done and len(self.first) % 2 == 0
        return StepResult(f"Room {self.turn}.", float(won), done, {"won": won, "success": won, "invalid": False, "admissible": self.admissible_actions()})


def test_probe_scores_equal_a_forward_pass_by_hand():
    """On the tiny model: every critical-turn record's four log-probs are the model's own
    log-probabilities of those action tokens after those prompts (a plain forward pass), and
    Delta at the critical turn is the teacher's minus the student's per-token mean."""
    from recursa.config import load_config
    from recursa.models import load_policy
    from recursa.recipes.rsipo import episode_attempts, teacher_hints, user_message
    from recursa.rollout import render_prompt

    tp = _probe()
    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=tiny-random", "agent.history_turns=1", "sampling.max_new_tokens=4", "train.micro_batch_size=5",
                             "skills.enabled=false", 'teacher.source="sibling"'], recipe="rsipo")
    policy = load_policy(cfg.model)
    pools = {"parity": EnvPool(ParityEnv)}
    summary, games = tp.probe(policy, cfg, pools, {"parity": [11, 12, 13]}, ["sibling", "reference"], 4, log=lambda _: None)
    assert [g["seed"] for g in games] == [11, 12, 13] and all(g["group_size"] == 4 for g in games)
    turns = summary["sibling"]["turns"]
    assert summary["sibling"]["critical_turns"] == len(turns) > 0  # some group both won and failed
    mixed = sum(0 < g["wins"] < 4 for g in games)
    assert summary["reference"]["episodes_with_text"] == 4 * mixed  # the walkthrough: every episode of a group that won and failed

    model, tok = policy.causal_lm.eval(), policy.tokenizer

    def logp(prompt: list[int], action: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + action])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits.float() / cfg.sampling.temperature, dim=-1)[0]
        return lp[torch.arange(len(prompt) - 1, len(prompt) + len(action) - 1), torch.tensor(action)]

    # rebuild the first record's state: the rollout is seeded, so play it again the same way
    from recursa.distributed.rollouts import LocalRollouts
    from recursa.generation import SamplingParams

    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    ro = LocalRollouts(policy, EnvPool(ParityEnv)).episodes([11, 12, 13], 4, sampling, torch.Generator().manual_seed(0), None, cfg.agent)
    attempts = episode_attempts(ro.episodes, 0, cfg.agent)
    i, j, t = tp.critical_pairs(attempts, 4)[0]
    rec = turns[0]
    assert (rec["seed"], rec["turn"], rec["failed_action"], rec["win_action"]) == (attempts[i].seed, t, attempts[i].texts[t], attempts[j].texts[t])
    assert rec["walkthrough_action"] == ["go", "go"][t]
    hints, _ = teacher_hints(attempts, cfg, None, pools["parity"], True, 4)
    ctx = attempts[i].contexts[t]
    bare = render_prompt(tok, user_message(ctx, cfg.agent), None)
    hinted = render_prompt(tok, user_message(ctx, cfg.agent, hints[i]), None)
    assert rec["student_fail"] == pytest.approx(logp(bare, attempts[i].actions[t]).sum().item(), rel=1e-3, abs=1e-3)
    assert rec["student_win"] == pytest.approx(logp(bare, attempts[j].actions[t]).sum().item(), rel=1e-3, abs=1e-3)
    assert rec["teacher_fail"] == pytest.approx(logp(hinted, attempts[i].actions[t]).sum().item(), rel=1e-3, abs=1e-3)
    assert rec["teacher_win"] == pytest.approx(logp(hinted, attempts[j].actions[t]).sum().item(), rel=1e-3, abs=1e-3)
    want = (logp(hinted, attempts[i].actions[t]) - logp(bare, attempts[i].actions[t])).mean().item()
    assert rec["delta_at"] == pytest.approx(want, rel=1e-3, abs=1e-3)
