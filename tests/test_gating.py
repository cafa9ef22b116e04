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

from _rsipo_runs import patch_rsipo

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


def test_gate_rounds_skip_the_held_out_items_of_a_run_evaluated_on_the_gate_split(tmp_path):
    """eval.split = "gate" (a pilot on the dev fold) holds out the gate split's first eval.n
    items; the gate's rounds start after them, so the gate never selects on what is reported."""
    cfg = load_config(None, DIGITS + ["train.steps=2", "train.lr=1e-3", "eval.n=4", "eval.split=gate", "eval.before=false",
                                      "gate.mode=log", "gate.every=1", "gate.n=5"])
    run = grpo.train(cfg, tmp_path / "g", log=lambda *_: None)
    store, lin = _lineage(run)
    spans = [c.payload["seeds"] for c in lin.candidates("weights") if not c.is_root]
    assert spans == [[1_000_000_000 + 4 + 5 * r, 1_000_000_000 + 4 + 5 * r + 4] for r in range(2)]
    held_out = {i["seed"] for i in json.loads((run / "eval" / "after.json").read_text())["items"]}
    assert held_out == set(range(1_000_000_000, 1_000_000_004))
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
    from recursa.methods.gating import parse_prompt_proposal, prompt_proposal_request

    req = prompt_proposal_request("Reply with one action.", [("Your task is to: reach room 3.", "dance")], 200)
    assert "Current instruction: Reply with one action." in req and "Answered: dance" in req and req.endswith("INSTRUCTION:")
    assert parse_prompt_proposal("Sure!\nINSTRUCTION: Always copy one action exactly from the list.", 200) == "Always copy one action exactly from the list."
    assert parse_prompt_proposal("INSTRUCTION: ���� ��", 200) is None
    assert parse_prompt_proposal("INSTRUCTION: " + "word " * 100, 50) is None  # over the hard cap
    assert parse_prompt_proposal(None, 50) is None


def _fake_scores(monkeypatch, good: str):
    """Scores that depend only on the prompt text: `good` solves every item, others none."""
    from recursa.evaluate import EvalItem, summarize
    from recursa.methods.gating import PromptGate

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


def test_grpo_single_turn_plays_the_admitted_system_prompt_from_the_next_step(tmp_path, monkeypatch):
    """On a single-turn task the prompt gate admits a system prompt; GRPO's next step samples
    under it (it once kept the run's first prompt for training and showed the admitted one only
    to evaluations), and a resumed run plays it too."""
    good = "Reply with go east, exactly as written."
    _fake_scores(monkeypatch, good)
    seen: list[str | None] = []
    real = grpo.play_replies

    def play_replies(rollouts, seeds, cfg, sampling, gen, system_prompt, *args, **kwargs):
        seen.append(system_prompt)
        return real(rollouts, seeds, cfg, sampling, gen, system_prompt, *args, **kwargs)

    monkeypatch.setattr(grpo, "play_replies", play_replies)
    base = ["model.name=tiny-random", "env.name=toy-digits", "sampling.max_new_tokens=4", "train.prompts_per_step=2", "train.group_size=2",
            "eval.n=0", "gate.mode=gate", "gate.every=100", "gate.n=16", "gate.prompt_every=1", "gate.prompt_select_n=4", "run.checkpoint_every=1"]
    cfg = load_config(None, base + ["train.steps=2"])
    run = grpo.train(cfg, tmp_path / "single", log=lambda *_: None)
    assert seen == ["You are a helpful assistant.", good] and cfg.model.system_prompt == good
    resumed = load_config(None, base + ["train.steps=3"])
    grpo.train(resumed, run, resume=True, log=lambda *_: None)
    assert seen[-1] == good


def test_prompt_round_in_log_mode_never_adopts(tmp_path, monkeypatch):
    good = "Reply with go east, exactly as written."
    _fake_scores(monkeypatch, good)
    cfg = load_config(None, ["model.name=tiny-random", "env.name=toy-corridor", "sampling.max_new_tokens=4", "train.prompts_per_step=2",
                             "train.group_size=2", "eval.n=0", "gate.mode=log", "gate.every=100", "gate.n=16", "gate.prompt_every=1",
                             "gate.prompt_select_n=4", "train.steps=1"])
    original = cfg.agent.instruction
    grpo.train(cfg, tmp_path / "p", log=lambda *_: None)
    assert cfg.agent.instruction == original


def test_rsipo_prompt_round_adopts_and_the_next_step_plays_it(tmp_path, monkeypatch):
    """RSIPO's prompt rounds (gate.prompt_every): on a game the admitted instruction is what
    the next step's episodes are rendered with; on a single-turn task the admitted system
    prompt is what the next step plays (and writes skills) with; a resumed run restores it."""
    from recursa.recipes import rsipo

    good = "Reply with go east, exactly as written."
    _fake_scores(monkeypatch, good)
    seen: list[tuple[str | None, str]] = []
    real_play = rsipo.play

    def play(policy, pool, seeds, shown, sampling, gen, system, cfg, *args, **kwargs):
        seen.append((system, cfg.agent.instruction))
        return real_play(policy, pool, seeds, shown, sampling, gen, system, cfg, *args, **kwargs)

    patch_rsipo(monkeypatch, "play", play)
    base = ["model.name=tiny-random", "sampling.max_new_tokens=4", "train.prompts_per_step=2", "train.group_size=2", "run.threads=1",
            "skills.candidates=2", "skills.write_per_group=1", "eval.n=0", "gate.mode=gate", "gate.every=100", "gate.n=16",
            "gate.prompt_every=1", "gate.prompt_select_n=4", "run.checkpoint_every=1"]
    game = base + ["env.name=toy-corridor", "env.kwargs.max_steps=3"]
    cfg = load_config(None, game + ["train.steps=2"], recipe="rsipo")
    original = cfg.agent.instruction
    run = rsipo.train(cfg, tmp_path / "game", log=lambda *_: None)
    assert [i for _, i in seen] == [original, good] and cfg.agent.instruction == good
    store, lin = _lineage(run)
    first, second = [c for c in lin.candidates("prompt") if not c.is_root]
    assert first.accepted and first.payload["text"] == good and first.step == 1
    assert not second.accepted and second.step == 2  # the same text again cannot beat itself
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["prompt/accepted"] for r in rows if "prompt/accepted" in r] == [1.0, 0.0]
    store.close()
    resumed = load_config(None, game + ["train.steps=3"], recipe="rsipo")
    rsipo.train(resumed, run, resume=True, log=lambda *_: None)
    assert resumed.agent.instruction == good and seen[-1][1] == good

    seen.clear()
    single = load_config(None, base + ["env.name=toy-digits", "train.steps=2"], recipe="rsipo")
    rsipo.train(single, tmp_path / "single", log=lambda *_: None)
    assert [s for s, _ in seen] == ["You are a helpful assistant.", good] and single.model.system_prompt == good


def test_rsipo_prompt_round_scores_with_the_skills_in_context(tmp_path, monkeypatch):
    """With skills.in_context every prompt-gate item is evaluated with the skill hint the
    policy is shown for it (the same hints function as rollouts and evaluations)."""
    from recursa.evaluate import EvalItem, summarize
    from recursa.methods import gating
    from recursa.recipes import rsipo

    calls = []

    def evaluate(policy, pool, env, split, n, max_new_tokens, system_prompt, **kw):
        calls.append((kw["label"], kw["hints"], kw["seeds"]))
        return summarize([EvalItem(s, 0.0, False) for s in kw["seeds"]], env, split, kw["label"], "m", "model", 0.0)

    monkeypatch.setattr(gating, "evaluate", evaluate)
    monkeypatch.setattr(gating.PromptGate, "propose", lambda self, policy, failures, gen: (["Walk east, one room at a time."], 0))
    patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: rsipo.ParsedSkill("Go east to reach the last room.", True, "ok", 7, 0))
    cfg = load_config(None, ["model.name=tiny-random", "env.name=toy-corridor", "env.kwargs.max_steps=3", "sampling.max_new_tokens=4",
                             "train.prompts_per_step=2", "train.group_size=2", "run.threads=1", "skills.candidates=2", "skills.write_per_group=1",
                             "skills.in_context=true", "skills.replay_reward=false", "eval.n=0", "gate.mode=log", "gate.every=100", "gate.n=4",
                             "gate.prompt_every=1", "gate.prompt_select_n=2", "train.steps=1"], recipe="rsipo")
    rsipo.train(cfg, tmp_path / "r", log=lambda *_: None)
    prompt_calls = [c for c in calls if c[0].startswith("prompt")]
    assert [c[0] for c in prompt_calls] == ["prompt selection", "prompt candidate", "prompt incumbent"]
    for _, hints, seeds in prompt_calls:
        assert hints is not None and len(hints) == len(seeds) and any(h is not None for h in hints)


# ----------------------------------------------------------------------------- the skill library

GOOD = "Write digits only, one digit per item."
BAD = "Write every digit twice, then stop."
SKILLS = ["model.name=tiny-random", "env.name=toy-digits", "sampling.max_new_tokens=4", "train.prompts_per_step=2", "train.group_size=2",
          "train.micro_batch_size=4", "run.threads=1", "eval.n=0", "skills.in_context=true", "gate.mode=gate", "gate.every=100", "gate.n=32",
          "gate.skills_every=1", "gate.skills_screen=64", "gate.spending=constant"]
SKILLS_REGION = 1_000_000_000 + 750_000_000  # split_seed("gate", SKILLS_GATE_BASE)


def _skill_learning(monkeypatch, texts: dict[int, str]):
    """learn_skills admits texts[step] at each step (no writing, no replay)."""
    from recursa.recipes import rsipo

    def learn(policy, attempts, buffer, library, cfg, system, gen, step, games=None):
        out = rsipo.SkillStep()
        if step in texts:
            out.admitted[library.add(texts[step], cfg.env.name, attempts[0].seed, step, "success", created_step=step)] = 0
        out.metrics = {"skills/library_size": float(len(library))}
        return out

    patch_rsipo(monkeypatch, "learn_skills", learn)


def _skill_scores(monkeypatch, calls: list | None = None):
    """Scores that depend only on the library in context and the seed: with no skill the
    policy solves the even seeds; GOOD solves everything; BAD solves every odd seed but
    breaks every fourth even one (seed % 8 == 0)."""
    from recursa.evaluate import EvalItem, summarize
    from recursa.methods.gating import SkillGate

    def score(self, policy, library, seeds, label):
        texts = {s.text for s in library.active()}
        if calls is not None:
            calls.append((label, sorted(texts), list(seeds)))

        def ok(seed):
            if BAD in texts:
                return seed % 2 == 1 or seed % 8 != 0
            return GOOD in texts or seed % 2 == 0

        return summarize([EvalItem(s, float(ok(s)), ok(s)) for s in seeds], "toy", "gate", label, "m", "model", 0.0)

    monkeypatch.setattr(SkillGate, "_score", score)


def _skill_rounds(lin):
    return [c for c in lin.candidates("skills") if not c.is_root]


def test_draw_probes_and_the_stratified_gain_by_hand():
    from recursa.methods.gating import draw_probes, stratified_gain

    screened = [(10, True), (11, False), (12, True), (13, True), (14, False), (15, True)]
    assert draw_probes(screened, 4) == ([11, 14], [10, 12])
    assert draw_probes(screened, 5) == ([11, 14], [10, 12])  # 3 failed wanted, 2 exist: fewer, not made up from the solved side
    assert draw_probes([(1, True), (2, True)], 4) == ([], [1, 2])
    # an incumbent solving 90% of the screen; the candidate gains 2 of 10 failed probes and loses 1 of 10 solved ones:
    # (b - c) / n = +0.05 on the probes, but over the population 0.1 * 0.2 - 0.9 * 0.1 = -0.07
    failed, solved = list(range(10)), list(range(10, 20))
    inc = {s: s >= 10 for s in failed + solved}
    cand = {**inc, 0: True, 1: True, 10: False}
    assert stratified_gain(10, 90, inc, cand, failed, solved) == pytest.approx(0.1 * 0.2 - 0.9 * 0.1)
    assert stratified_gain(0, 100, inc, cand, [], solved) == pytest.approx(-0.1)


def test_a_helpful_skill_is_admitted_on_half_failed_half_solved_probes(tmp_path, monkeypatch):
    from recursa.recipes import rsipo
    from recursa.skills import SkillLibrary

    calls = []
    _skill_learning(monkeypatch, {1: GOOD})
    _skill_scores(monkeypatch, calls)
    run = rsipo.train(load_config(None, SKILLS + ["train.steps=1"], recipe="rsipo"), tmp_path / "s", log=lambda *_: None)
    store, lin = _lineage(run)
    (cand,) = _skill_rounds(lin)
    assert cand.accepted and cand.stats["b"] == 16 and cand.stats["c"] == 0
    p = cand.payload
    assert [a["text"] for a in p["added"]] == [GOOD] and p["removed"] == []
    assert p["screen"] == [SKILLS_REGION, SKILLS_REGION + 63] and p["screen_solved"] == 32
    assert len(p["probes_failed"]) == len(p["probes_solved"]) == 16  # half failed, half solved by the incumbent
    assert all(s % 2 == 1 for s in p["probes_failed"]) and all(s % 2 == 0 for s in p["probes_solved"])
    assert all(SKILLS_REGION <= s < SKILLS_REGION + 64 for s in p["probes_failed"] + p["probes_solved"])
    # screen and incumbent with the incumbent (empty) library, the candidate with GOOD; the incumbent is re-scored on the probes
    assert [(label.split(" @")[0], texts) for label, texts, _ in calls] == [("skills screen", []), ("skills incumbent", []), ("skills candidate", [GOOD])]
    assert calls[1][2] == calls[2][2] == p["probes_failed"] + p["probes_solved"]
    assert [s.text for s in SkillLibrary(store.db).active()] == [GOOD]
    gate_row = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "skills/gate_accepted" in r]
    assert gate_row[0]["skills/gate_accepted"] == 1.0 and gate_row[0]["skills/gate_probes_solved"] == 16.0
    store.close()


def test_regressions_beyond_the_budget_reject_and_restore_the_library(tmp_path, monkeypatch):
    """BAD fixes all 16 failed probes but loses 4 of the 16 solved ones: significant
    (p = 0.006), yet over max_regressions = 2; the library goes back to the incumbent."""
    from recursa.recipes import rsipo
    from recursa.skills import SkillLibrary

    _skill_learning(monkeypatch, {1: BAD})
    _skill_scores(monkeypatch)
    run = rsipo.train(load_config(None, SKILLS + ["train.steps=1", "gate.max_regressions=2"], recipe="rsipo"), tmp_path / "s", log=lambda *_: None)
    store, lin = _lineage(run)
    (cand,) = _skill_rounds(lin)
    assert not cand.accepted and cand.stats["b"] == 16 and cand.stats["c"] == 4 and cand.stats["p_value"] < 0.01
    assert "4 regressions > max_regressions 2" in cand.reason and "p=" not in cand.reason  # the budget alone rejected it
    lib = SkillLibrary(store.db)
    assert lib.active() == []  # the incumbent: the empty library
    (row,) = lib.all()
    assert row.text == BAD and row.removed_step == 1  # kept as a removed row: provenance, and its id is never reused
    state = json.loads((run / "checkpoints" / "step_000001" / "state.json").read_text())
    assert state["skills"] == lib.snapshot() and state["skills_incumbent"] == []
    store.close()


def test_a_rejected_change_restores_a_nonempty_incumbent(tmp_path, monkeypatch):
    """Step 1 admits GOOD; step 2 adds BAD, which the probes (all solved by the incumbent:
    the failed side is empty, so the round has fewer probes) reject; GOOD stays, with the
    usage it gained since."""
    from recursa.recipes import rsipo
    from recursa.skills import SkillLibrary

    _skill_learning(monkeypatch, {1: GOOD, 2: BAD})
    _skill_scores(monkeypatch)
    run = rsipo.train(load_config(None, SKILLS + ["train.steps=2"], recipe="rsipo"), tmp_path / "s", log=lambda *_: None)
    store, lin = _lineage(run)
    first, second = _skill_rounds(lin)
    assert first.accepted and not second.accepted and second.parent_id == first.id
    assert second.payload["probes_failed"] == [] and len(second.payload["probes_solved"]) == 16 and second.stats["c"] == 2
    assert second.payload["screen"][0] == first.payload["screen"][1] + 1  # the next block of the skills region
    lib = SkillLibrary(store.db)
    (good,) = lib.active()
    assert good.text == GOOD and good.uses > 0  # retrieved by the teacher in both steps; the counts survive the restore
    assert [s.text for s in lib.all() if s.removed_step == 2] == [BAD]
    store.close()


def test_skills_log_mode_records_but_keeps(tmp_path, monkeypatch):
    from recursa.recipes import rsipo
    from recursa.skills import SkillLibrary

    _skill_learning(monkeypatch, {1: BAD})
    _skill_scores(monkeypatch)
    cfg = load_config(None, SKILLS + ["train.steps=1", "gate.max_regressions=2", "gate.mode=log"], recipe="rsipo")
    run = rsipo.train(cfg, tmp_path / "s", log=lambda *_: None)
    store, lin = _lineage(run)
    (cand,) = _skill_rounds(lin)
    assert not cand.accepted and lin.incumbent("skills").is_root
    assert [s.text for s in SkillLibrary(store.db).active()] == [BAD]
    store.close()


def test_skills_gate_resumes_with_its_incumbent_and_a_consistent_lineage(tmp_path, monkeypatch):
    """Log mode keeps the rejected BAD in the library, so the checkpoint's library is not the
    incumbent (still the empty root): a resumed run must take the incumbent from the
    checkpoint, gate BAD + GOOD at step 2 as the uninterrupted run does, and keep one root."""
    from recursa.recipes import rsipo
    from recursa.skills import SkillLibrary

    _skill_learning(monkeypatch, {1: BAD, 2: GOOD})
    _skill_scores(monkeypatch)
    base = SKILLS + ["gate.every=1", "gate.mode=log", "gate.max_regressions=2", "run.checkpoint_every=1"]
    straight = rsipo.train(load_config(None, base + ["train.steps=2"], recipe="rsipo"), tmp_path / "a", log=lambda *_: None)
    part = rsipo.train(load_config(None, base + ["train.steps=1"], recipe="rsipo"), tmp_path / "b", log=lambda *_: None)
    rsipo.train(load_config(None, base + ["train.steps=2"], recipe="rsipo"), part, resume=True, log=lambda *_: None)
    sa, la = _lineage(straight)
    sb, lb = _lineage(part)

    def key(lin):
        return [(c.step, c.accepted, c.parent_id, c.stats.get("b"), c.stats.get("c"), c.payload) for c in lin.candidates("skills")]

    assert key(la) == key(lb) and len(key(la)) == 3  # the root and two rounds, once each
    assert [a["text"] for a in lb.candidates("skills")[-1].payload["added"]] == [BAD, GOOD]
    assert SkillLibrary(sa.db).snapshot() == SkillLibrary(sb.db).snapshot()
    sa.close()
    sb.close()


def test_library_gating_needs_the_skills_in_context():
    with pytest.raises(UserError, match="gate.skills_every > 0 needs skills.in_context = true"):
        load_config(None, ["gate.mode=gate", "gate.skills_every=1"], recipe="rsipo")
    with pytest.raises(UserError, match="gate.mode"):
        load_config(None, ["skills.in_context=true", "gate.skills_every=1"], recipe="rsipo")
    with pytest.raises(UserError, match="only the rsipo recipe"):
        load_config(None, ["gate.mode=gate", "gate.skills_every=1"])
    with pytest.raises(UserError, match="skills.in_context = true shows"):
        load_config(None, ["teacher.source=none", "teacher.lam=0", "skills.enabled=false", "skills.in_context=true"], recipe="rsipo")
    cfg = load_config(None, ["gate.mode=log", "gate.skills_every=2", "skills.in_context=true"], recipe="rsipo")
    assert cfg.gate.skills_every == 2 and cfg.gate.skills_screen is None
