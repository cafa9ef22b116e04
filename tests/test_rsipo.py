"""The RSIPO recipe: prompt re-rendering with a skill, teacher and replay scoring against
direct log-prob calls, the loop end to end on the tiny model (single-turn and games), the
ablation configs, resume, malformed skills, and equality with GRPO when the teacher is off."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

import recursa.recipes.rsipo as rsipo
from recursa.agent import AgentConfig
from recursa.config import load_config
from recursa.envs import make_env
from recursa.generation import Sample, SamplingParams, generate, sequence_logprobs
from recursa.models import load_policy
from recursa.recipes import grpo
from recursa.recipes.rsipo import (
    Attempt,
    Context,
    EffectGames,
    Writing,
    choose_sources,
    completion_attempts,
    effect_rewards,
    episode_attempts,
    replay_rewards,
    score_actions,
    skill_hint,
    teacher_logprobs,
    user_message,
)
from recursa.rollout import render_prompt, rollout, rollout_episodes
from recursa.skills import ParsedSkill, SkillLibrary

from _rsipo_runs import FAST, VOLATILE, kill_in_update
from _rsipo_runs import cfg as _cfg
from _rsipo_runs import rows as _rows
from _rsipo_runs import train_rows as _train_rows
from _rsipo_runs import patch_rsipo

REPO = Path(__file__).resolve().parent.parent
ABLATIONS = sorted((REPO / "examples" / "rsipo_ablations").glob("*.toml"))


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _same(a, b) -> bool:
    """Equal, with NaN equal to NaN (metrics of steps without a teacher are NaN)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread in this module: on a shared 2-core machine the tiny model runs many
    times faster on one thread than on two (the recipes set run.threads themselves)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


GOOD_SKILL = "Go east to reach the last room."


def _bench():
    """benchmarks/rsipo_vs_grpo.py as a module (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rsipo_vs_grpo", REPO / "benchmarks" / "rsipo_vs_grpo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _always_valid(reply, max_words, max_chars):
    """A stand-in for parse_skill: every reply reads as GOOD_SKILL (the tiny random model
    writes junk that BM25 would never retrieve for the corridor's task)."""
    return ParsedSkill(GOOD_SKILL, True, "ok", len(GOOD_SKILL.split()), 0)


@pytest.fixture
def corridor_episodes(tiny_policy):
    ro = rollout_episodes(
        tiny_policy, lambda: make_env("toy-corridor", max_steps=3), [1, 2], 2,
        SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0), None, AgentConfig(history_turns=1),
    )
    return ro.episodes


# ----------------------------------------------------------------------------- contexts


def test_rerendered_context_is_the_exact_prompt(tiny_policy, corridor_episodes):
    tok = tiny_policy.tokenizer
    agent = AgentConfig(history_turns=1)
    attempts = episode_attempts(corridor_episodes, 1, agent)
    for episode, attempt in zip(corridor_episodes, attempts):
        assert len(attempt.contexts) == len(episode.turns) == 3
        for turn, ctx in zip(episode.turns, attempt.contexts):
            assert render_prompt(tok, user_message(ctx, agent), None) == turn.prompt_ids
    # single-turn: the user message is the observation itself
    ro = rollout(tiny_policy, lambda: make_env("toy-digits"), [3, 4], 2, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0), None)
    for traj, attempt in zip(ro.trajectories, completion_attempts(ro.trajectories, 1)):
        first = traj.action_mask.index(1)
        assert render_prompt(tok, user_message(attempt.contexts[0], agent), None) == traj.token_ids[:first]
        assert attempt.actions[0] == traj.token_ids[first:]


def test_hint_follows_the_task_line_and_survives_truncation():
    agent = AgentConfig(history_turns=2, max_obs_chars=40)
    ctx = Context("Your task is to: reach room 3.", "x" * 500, ["go east", "wait"], [("y" * 300, "wait")])
    hint = skill_hint(["Always go east first, never wait when the exit is east of you."])
    text = user_message(ctx, agent, hint)
    assert text.startswith("Your task is to: reach room 3.\n\n" + hint + "\n\n")
    assert "x" * 41 not in text and "- go east" in text
    assert user_message(ctx, agent) == user_message(ctx, agent, None) and hint not in user_message(ctx, agent)
    single = Context(None, "Write digits. Item 3.")
    assert user_message(single, agent, hint) == "Write digits. Item 3.\n\n" + hint


def test_attempt_json_round_trip(corridor_episodes):
    attempts = episode_attempts(corridor_episodes, 4, AgentConfig(history_turns=1))
    again = [Attempt.from_json(json.loads(json.dumps(a.to_json()))) for a in attempts]
    assert again == attempts


def test_choose_sources_takes_a_success_and_a_failure_per_group():
    def att(ok):
        return Attempt("e", 0, 1, 0, ok, "t", [Context(None, "o")], [[1]], ["r"])

    attempts = [att(x) for x in (False, True, False, False, False, False, False, False)]  # groups of 4
    picked = choose_sources(attempts, 2, 4, 2, torch.Generator().manual_seed(0))
    assert picked[0] == 1 and not attempts[picked[1]].success and picked[1] < 4  # group 0: its one success, then a failure
    assert len(picked) == 4 and all(4 <= j < 8 for j in picked[2:]) and picked[2] != picked[3]  # group 1: all failed
    assert choose_sources(attempts, 2, 4, 0, torch.Generator()) == []


# ----------------------------------------------------------------------------- skills in context


def test_skills_in_context_is_off_by_default_and_leaves_prompts_alone(tiny_policy):
    assert _cfg().skills.in_context is False
    params, envs = SamplingParams(max_new_tokens=4), lambda: make_env("toy-digits")
    plain = rollout(tiny_policy, envs, [3, 4], 2, params, torch.Generator().manual_seed(0), None)
    nones = rollout(tiny_policy, envs, [3, 4], 2, params, torch.Generator().manual_seed(0), None, hints=[None, None])
    assert [t.token_ids for t in plain.trajectories] == [t.token_ids for t in nones.trajectories]


def test_skills_in_context_put_the_hint_in_the_policys_prompts(tiny_policy):
    """Single-turn: the hint follows the question (where the teacher's goes), for the
    hinted seed's whole group only; games: after the task line of every turn. The attempts
    remember the hint, so the prompt re-renders exactly; the teacher's student context is
    the bare message and a teacher with the same skill scores exactly the row's prompt."""
    tok = tiny_policy.tokenizer
    hint = skill_hint([GOOD_SKILL])
    hint_ids = tok.encode(hint, add_special_tokens=False)
    params, gen = SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0)
    ro = rollout(tiny_policy, lambda: make_env("toy-digits"), [3, 4], 2, params, gen, None, hints=[hint, None])
    attempts = completion_attempts(ro.trajectories, 1, [hint, None])
    for traj, attempt in zip(ro.trajectories, attempts):
        first = traj.action_mask.index(1)
        ctx = attempt.contexts[0]
        assert ctx.hint == (hint if traj.group == 0 else None) and traj.prompt_text == ctx.observation  # the question, without the hint
        assert render_prompt(tok, user_message(ctx, AgentConfig(), ctx.hint), None) == traj.token_ids[:first]
        shown = any(traj.token_ids[i : i + len(hint_ids)] == hint_ids for i in range(first))
        assert shown == (traj.group == 0)
    agent = AgentConfig(history_turns=1)
    ero = rollout_episodes(tiny_policy, lambda: make_env("toy-corridor", max_steps=3), [1, 2], 2, params, gen, None, agent, hints=[None, hint])
    for episode, attempt in zip(ero.episodes, episode_attempts(ero.episodes, 1, agent, [None, hint])):
        for turn, ctx in zip(episode.turns, attempt.contexts):
            assert ctx.hint == (hint if episode.group == 1 else None)
            assert render_prompt(tok, user_message(ctx, agent, ctx.hint), None) == turn.prompt_ids
            assert (hint in tok.decode(turn.prompt_ids)) == (episode.group == 1)
    cfg = _cfg("env.name=toy-digits")
    rows, contexts = ro.trajectories, [a.contexts[0] for a in attempts]
    teacher, student = teacher_logprobs(tiny_policy, rows, contexts, [hint] * len(rows), cfg, None)
    model = tiny_policy.causal_lm
    for row, ctx, lt, ls in zip(rows, contexts, teacher, student):
        first = row.action_mask.index(1)
        bare = render_prompt(tok, user_message(ctx, cfg.agent), None)
        with torch.no_grad():
            for prompt, got in ((render_prompt(tok, user_message(ctx, cfg.agent, hint), None), lt), (bare, ls)):
                ids = torch.tensor([prompt + row.token_ids[first:]])
                want, _ = sequence_logprobs(model, ids, torch.ones_like(ids), (torch.arange(ids.shape[1]) >= len(prompt)).float()[None])
                assert torch.allclose(got, want[0, len(prompt):], atol=1e-5)
        if ctx.hint is not None:
            assert render_prompt(tok, user_message(ctx, cfg.agent, hint), None) == row.token_ids[:first]  # the teacher: the row's own prompt
    # with topk the teacher's (ids, log-probs) sit at the same action positions as its Delta's log-probs
    teacher_k, student_k, top = teacher_logprobs(tiny_policy, rows, contexts, [hint] * len(rows), cfg, None, topk=64)  # an eighth of the tiny vocab: some sampled tokens land in it
    hits = 0
    for row, lt, lt_k, ls, ls_k, (ids, logp) in zip(rows, teacher, teacher_k, student, student_k, top):
        torch.testing.assert_close(lt_k, lt, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ls_k, ls, atol=1e-5, rtol=1e-5)
        first = row.action_mask.index(1)
        hit = ids == torch.tensor(row.token_ids[first:])[:, None]
        hits += int(hit.sum())
        torch.testing.assert_close(logp[hit], lt[:, None].expand_as(logp)[hit], atol=1e-5, rtol=1e-5)
    assert hits > 0


def test_teacher_topk_from_the_student(tiny_policy):
    """teacher.topk_from = 'student' (SDPO): the ids are the student's (bare context) k most likely
    tokens at each action position and the log-probs the hinted teacher's at those ids, both
    checked against a full softmax of each context's logits."""
    tok = tiny_policy.tokenizer
    hint = skill_hint([GOOD_SKILL])
    ro = rollout(tiny_policy, lambda: make_env("toy-digits"), [3, 4], 2, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0), None)
    attempts = completion_attempts(ro.trajectories, 1, [None, None])
    cfg = _cfg("env.name=toy-digits", "teacher.mode=distribution", "teacher.topk_from=student")
    rows, contexts = ro.trajectories, [a.contexts[0] for a in attempts]
    k = 8
    teacher, student, top = teacher_logprobs(tiny_policy, rows, contexts, [hint] * len(rows), cfg, None, topk=k, topk_from="student")
    model = tiny_policy.causal_lm
    for row, ctx, (ids, logp) in zip(rows, contexts, top):
        first = row.action_mask.index(1)
        actions = row.token_ids[first:]
        full = {}
        for name, prompt in (("student", render_prompt(tok, user_message(ctx, cfg.agent), None)), ("teacher", render_prompt(tok, user_message(ctx, cfg.agent, hint), None))):
            x = torch.tensor([prompt + actions])
            with torch.no_grad():
                logits = model(input_ids=x).logits[0].float() / cfg.sampling.temperature
            full[name] = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(actions)], dim=-1)  # (actions, V)
        want_ids = full["student"].topk(k, dim=-1).indices
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(logp.cpu(), full["teacher"].gather(-1, want_ids), atol=1e-4, rtol=1e-4)
    # the default keeps the teacher's own top-k
    _, _, top_t = teacher_logprobs(tiny_policy, rows, contexts, [hint] * len(rows), cfg, None, topk=k)
    assert any(not torch.equal(a, b) for (a, _), (b, _) in zip(top, top_t))


def test_rsipo_distribution_with_the_students_topk_end_to_end(tmp_path):
    path = REPO / "examples" / "rsipo_ablations" / "opsd_distribution.toml"
    cfg = load_config(path, ["train.steps=1", "eval.n=0", "run.threads=1", "train.group_size=2", "skills.candidates=2", "teacher.topk_from=student"])
    (row,) = _train_rows(rsipo.train(cfg, tmp_path / "sdpo_topk", log=lambda *_: None))
    assert row["loss/distill"] > 0 and 0 < row["teacher/distill_topk_mass"] <= 1
    with pytest.raises(Exception, match="topk_from"):
        load_config(path, ["teacher.topk_from=both"])


def test_recipe_with_skills_in_context(tmp_path, monkeypatch):
    """A skill admitted at step 1 is in the policy's prompts at step 2 (and in the replay
    buffer's contexts); step 1, with an empty library, is the run without the option."""
    text = "Write digits only, one digit per item."
    patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: ParsedSkill(text, True, "ok", len(text.split()), 0))
    sets = ["env.name=toy-digits", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "skills.write_per_group=1", "skills.candidates=2",
            "eval.n=4", "eval.before=false"]
    from recursa.recipes import common

    evaluated, real = [], common.evaluate
    monkeypatch.setattr(common, "evaluate", lambda *a, **k: evaluated.append(k["hints"]) or real(*a, **k))
    on = rsipo.train(_cfg(*sets, "skills.in_context=true"), tmp_path / "on", log=lambda *_: None)
    off = rsipo.train(_cfg(*sets, "train.steps=1"), tmp_path / "off", log=lambda *_: None)
    assert evaluated == [[skill_hint([text])] * 4, None]  # the held-out evaluation after training shows the skill too
    first, second = _train_rows(on)
    assert first["skills/in_context_frac"] == 0.0 and second["skills/in_context_frac"] == 1.0
    assert "skills/in_context_frac" not in _train_rows(off)[0]
    assert {k: v for k, v in _stable(first).items() if k != "skills/in_context_frac"} == _stable(_train_rows(off)[0])
    replay = _rows(on, "replay")
    assert all("hint" not in c for r in replay if r["step"] == 1 for c in r["contexts"])
    assert all(c["hint"] == skill_hint([text]) for r in replay if r["step"] == 2 for c in r["contexts"])
    assert all("hint" not in c for r in _rows(off, "replay") for c in r["contexts"])


# ----------------------------------------------------------------------------- teacher and replay scoring


def test_teacher_delta_equals_two_direct_logprob_calls(tiny_policy, corridor_episodes):
    """Delta of every action token = sequence_logprobs with the skill in the prompt minus
    sequence_logprobs of the row as sampled, both computed here directly."""
    cfg = _cfg("env.name=toy-corridor", "agent.history_turns=1", "train.micro_batch_size=3")
    tok = tiny_policy.tokenizer
    attempts = episode_attempts(corridor_episodes, 1, cfg.agent)
    rows = [r for e in corridor_episodes for r in e.rows()]
    contexts = [c for a in attempts for c in a.contexts]
    hint = skill_hint([GOOD_SKILL])
    hints = [hint if i % 3 != 1 else None for i in range(len(rows))]
    teacher, student = teacher_logprobs(tiny_policy, rows, contexts, hints, cfg, None)
    model = tiny_policy.causal_lm
    for row, ctx, h, lt, ls in zip(rows, contexts, hints, teacher, student):
        n = row.num_action_tokens
        if h is None:
            assert torch.equal(lt, torch.zeros(n)) and torch.equal(ls, torch.zeros(n))
            continue
        first = row.action_mask.index(1)
        prompt_t = render_prompt(tok, user_message(ctx, cfg.agent, h), None)
        assert len(prompt_t) > first
        with torch.no_grad():
            ids_t = torch.tensor([prompt_t + row.token_ids[first:]])
            want_t, _ = sequence_logprobs(model, ids_t, torch.ones_like(ids_t), (torch.arange(ids_t.shape[1]) >= len(prompt_t)).float()[None])
            ids_s = torch.tensor([row.token_ids])
            want_s, _ = sequence_logprobs(model, ids_s, torch.ones_like(ids_s), torch.tensor([row.action_mask], dtype=torch.float32))
        assert torch.allclose(lt, want_t[0, len(prompt_t):], atol=1e-5)
        assert torch.allclose(ls, want_s[0, first:], atol=1e-5)
        assert (lt - ls).abs().max() > 0  # the skill changed the context, so the teacher differs


def test_score_actions_same_with_and_without_shared_prefix(tiny_policy):
    tok = tiny_policy.tokenizer
    p1, p2 = render_prompt(tok, "first question", None), render_prompt(tok, "second, longer question here", None)
    pairs = [(p1, [11, 12, 13]), (p2, [14]), (p1, [15, 16]), (p2, [17, 18, 19, 20])]
    shared = score_actions(tiny_policy, pairs, _cfg("train.shared_prefix=true", "train.micro_batch_size=3"))
    naive = score_actions(tiny_policy, pairs, _cfg("train.shared_prefix=false", "train.micro_batch_size=1"))
    assert [len(x) for x in shared] == [3, 1, 2, 4]
    for a, b in zip(shared, naive):
        assert torch.allclose(a, b, atol=1e-5)


def test_replay_reward_by_hand(tiny_policy):
    """r(s) = mean_tau' y(tau') clip(D(s, tau'), -c, c) with D the mean over tau''s scored
    action tokens of log pi(a | ctx + s) - log pi(a | ctx); an invalid candidate gets
    invalid_reward; a candidate's advantage is normalised within its K."""
    cfg = _cfg("skills.candidates=2", "skills.replay_size=2", "skills.replay_turns=5", "skills.replay_clip=0.001", "skills.max_words=3", "skills.length_penalty=0.5", "skills.invalid_reward=-2")
    agent = cfg.agent
    source = Attempt("toy-digits", 5, 1, 0, True, "Write digits. Item 1.", [Context(None, "Write digits. Item 1.")], [[40, 41]], ["12"])
    buffer = [
        Attempt("toy-digits", 5, 1, 0, False, "same seed: never replayed", [Context(None, "Write digits. Item 1.")], [[42]], ["x"]),
        Attempt("toy-digits", 7, 1, 1, True, "Write digits. Item 4.", [Context(None, "Write digits. Item 4.")], [[43, 44, 45]], ["3"]),
        Attempt("toy-digits", 8, 1, 1, False, "Write digits. Item 9.", [Context(None, "Write digits. Item 9.")], [[46, 47]], ["ab"]),
        Attempt("other-env", 9, 1, 2, True, "other family", [Context(None, "Other.")], [[48]], ["y"]),
    ]
    text = "Write only the digits of the answer."  # 7 words: 4 over max_words
    parsed = [ParsedSkill(text, True, "ok", 7, 4), ParsedSkill(None, False, "empty")]
    writing = Writing([0], [[1, 2]], [Sample(0, [5], [0.0], "eos"), Sample(0, [6], [0.0], "eos")], parsed)
    rewards, replayed = replay_rewards(tiny_policy, writing, [source], buffer, cfg, None, torch.Generator().manual_seed(0))
    assert replayed == [2]
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    terms = []
    for item, y in ((buffer[1], 1.0), (buffer[2], -1.0)):
        means = []
        for hint in (skill_hint([text]), None):
            prompt = render_prompt(tok, user_message(item.contexts[0], agent, hint), None)
            ids = torch.tensor([prompt + item.actions[0]])
            with torch.no_grad():
                logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), (torch.arange(ids.shape[1]) >= len(prompt)).float()[None])
            means.append(logp[0, len(prompt):])
        d = (means[0] - means[1]).mean().item()
        terms.append(y * max(-0.001, min(0.001, d)))
    want = sum(terms) / 2 - 0.5 * 4
    assert rewards[0][0].item() == pytest.approx(want, abs=1e-6)
    assert rewards[0][1].item() == -2.0


def test_effect_reward_by_hand():
    """skills.effect_games: each valid candidate is played once on each of the M games most
    related to its source's game (never that game), shown in the prompt; its reward is the mean
    of R - b (b: the game's mean reward without it), minus the length penalty; an invalid one
    gets invalid_reward and is never played."""
    cfg = _cfg("train.prompts_per_step=4", "train.group_size=2", "skills.candidates=3", "skills.effect_games=2", "skills.max_words=6",
               "skills.length_penalty=0.5", "skills.invalid_reward=-2")
    good, plain = "Heat the egg in the microwave first.", "Look around the kitchen now."
    parsed = [ParsedSkill(good, True, "ok", 7, 0), ParsedSkill(plain, True, "ok", 5, 0), ParsedSkill(None, False, "empty")]
    writing = Writing([2], [[1]], [Sample(0, [5], [0.0], "eos")] * 3, parsed)  # source attempt 2: group 1, the second game
    queries = ["cool some apple and put it in fridge", "heat some egg and put it in table", "heat some mug and put it in shelf", "clean some cup and put it in sink"]
    baselines = torch.tensor([0.5, 0.0, 0.25, 1.0])
    calls = []

    def play(seeds, hints):  # a game's reward: 1 for the heating advice on a heating game, else 0
        calls.append(list(zip(seeds, hints)))
        return [1.0 if ("microwave" in h and seed in (11, 12)) else 0.0 for seed, h in zip(seeds, hints)]

    rewards, tried, episodes = effect_rewards(writing, EffectGames([10, 11, 12, 13], queries, baselines, play), cfg)
    # the games related to "heat some egg ...": game 2 (heat, the most shared terms) then the others by score; never game 1 itself
    (jobs,) = calls
    assert [seed for seed, _ in jobs] == [12, 10, 12, 10] and tried == [2] and episodes == 4
    assert all(skill_hint([good]) == h for _, h in jobs[:2]) and all(skill_hint([plain]) == h for _, h in jobs[2:])
    # good: ((1 - 0.25) + (0 - 0.5)) / 2 = 0.125, minus 0.5 x (7 - 6) = -0.375; plain: ((0 - 0.25) + (0 - 0.5)) / 2 = -0.375; invalid: -2
    assert rewards[0].tolist() == pytest.approx([-0.375, -0.375, -2.0])


# ----------------------------------------------------------------------------- the loop end to end


def test_recipe_single_turn_end_to_end(tmp_path):
    cfg = _cfg("env.name=toy-digits", "train.steps=2", "train.prompts_per_step=2", "train.group_size=4", "eval.n=4", "run.checkpoint_every=1")
    run = rsipo.train(cfg, tmp_path / "digits", log=lambda *_: None)
    rows = _train_rows(run)
    assert len(rows) == 2
    for r in rows:
        assert r["skills/written"] == 2 * 2 * 4 and r["skills/sources"] == 4  # 2 groups x 2 sources x K = 4
        for key in ("teacher/share", "teacher/rows_frac", "trust/prior_strength", "skills/valid_frac", "skills/library_size", "loss/policy"):
            assert key in r, key
    written = _rows(run, "skills")
    assert len(written) == 2 * 16 and {w["step"] for w in written} == {1, 2}
    assert len(_rows(run, "replay")) == 2 * 8
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    lib = SkillLibrary(run / "ledger.sqlite")
    assert state["skills"] == lib.snapshot() and len(lib) == rows[-1]["skills/library_size"]
    assert set(state["trust"]) == {"steps", "groups"} and state["trust"]["steps"] == 2
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == 4


@pytest.mark.parametrize("env", ["toy-corridor", "toy-digits"])
def test_recipe_with_the_skill_teacher(tmp_path, monkeypatch, env):
    """With every written skill readable: the best candidate enters the library, is
    retrieved for the tasks, the teacher scores Delta on their rows, the trust counts get
    trials where the outcome advantage is not 0, and with the cold-start trust above 0 the
    teacher term enters the token advantages."""
    text = GOOD_SKILL if env == "toy-corridor" else "Write digits only, one digit per item."
    G = 2 if env == "toy-corridor" else 4
    patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: ParsedSkill(text, True, "ok", len(text.split()), 0))
    cfg = _cfg(f"env.name={env}", "env.kwargs.max_steps=3" if env == "toy-corridor" else "env.kwargs={}", "agent.history_turns=1", "train.steps=2",
               "train.prompts_per_step=2", f"train.group_size={G}", "skills.write_per_group=1", "skills.candidates=2", "trust.prior_mean=0.75",
               "sampling.max_new_tokens=8")
    from recursa.report import write_report

    run = rsipo.train(cfg, tmp_path / env, log=lambda *_: None)
    first, second = _train_rows(run)
    turns = 3 if env == "toy-corridor" else 1
    assert first.get("batch/rows", 2 * G) == 2 * G * turns
    assert first["skills/admitted"] == 1 and first["skills/library_size"] == 1  # one text: deduplicated
    assert first["teacher/rows_frac"] == 1.0  # written this step and retrieved for both tasks at once
    assert first["teacher/delta_abs_mean"] > 0
    assert first["teacher/trust_applied_mean"] == pytest.approx(0.5)  # cold-start trust 2 * 0.75 - 1
    assert first["teacher/share"] > 0 and first["advantage/teacher_abs"] > 0
    if env == "toy-digits":  # rewards differ within groups: attempts make agreement trials
        assert first["trust/trials"] > 0 and first["trust/groups"] == 1 and 0 <= first["trust/mean"] <= 1
    else:  # every random-model episode fails alike: A_outcome = 0, no trials
        assert first["trust/trials"] == 0
    assert second["skills/writing_rows"] == 2 * 2
    lib = SkillLibrary(run / "ledger.sqlite")
    (skill,) = lib.active()
    assert skill.text == text and skill.family == env and skill.source_step == 1
    assert skill.uses == 2 * (2 * G * turns)  # every row of both steps
    assert (skill.trust_trials > 0) == (env == "toy-digits")
    report = write_report(run).read_text()
    assert "plots/teacher.png" in report and "plots/trust.png" in report and "plots/skills.png" in report


def test_calibrated_trust_starts_at_zero_and_fixed_trust_does_not(tmp_path, monkeypatch):
    patch_rsipo(monkeypatch, "parse_skill", _always_valid)
    base = ["env.name=toy-corridor", "env.kwargs.max_steps=3", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "skills.candidates=2"]
    calibrated = _train_rows(rsipo.train(_cfg(*base), tmp_path / "cal", log=lambda *_: None))[0]
    fixed = _train_rows(rsipo.train(_cfg(*base, "trust.mode=fixed"), tmp_path / "fix", log=lambda *_: None))[0]
    assert calibrated["teacher/rows_frac"] == fixed["teacher/rows_frac"] == 1.0
    assert calibrated["teacher/share"] == 0.0 and calibrated["teacher/trust_applied_mean"] == 0.0  # prior mean 1/2: trust 0
    assert fixed["teacher/share"] > 0 and fixed["teacher/trust_applied_mean"] == 1.0


def test_malformed_skills_never_crash_a_step(tmp_path, monkeypatch, tiny_policy):
    """Whatever the writer produces (nothing, a placeholder, junk, repetition, another
    script, an overlong rule, a preamble only), the step completes: every candidate is
    counted by reason, none enters the library, the writing tokens are still trained."""
    tok = tiny_policy.tokenizer
    replies = ["", "\n\n", "<rule>", "Use the " + "a" * 60 + " key", "go go go go go go go", "日本語のテキストです。", "word " * 100, "Here is a rule:"]
    real = rsipo.generate

    def junk(model, tokenizer, prompts, params, n=1, generator=None, stats=None):
        out = real(model, tokenizer, prompts, params, n=n, generator=generator, stats=stats)
        for i, s in enumerate(out):
            s.token_ids = tok.encode(replies[i % len(replies)], add_special_tokens=False)
            s.logprobs = [-1.0] * len(s.token_ids)
        return out

    patch_rsipo(monkeypatch, "generate", junk)
    cfg = _cfg("env.name=toy-digits", "train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "skills.candidates=8", "skills.write_per_group=1",
               "skills.max_chars=200")
    run = rsipo.train(cfg, tmp_path / "junk", log=lambda *_: None)
    (row,) = _train_rows(run)
    assert row["skills/written"] == 16 and row["skills/valid"] == 0 and row["skills/library_size"] == 0
    reasons = {k.split("/")[-1] for k in row if k.startswith("skills/invalid/")}
    assert {"empty", "placeholder", "junk", "repetitive", "non_ascii", "too_long"} <= reasons
    assert row["skills/writing_rows"] == 14  # the empty replies have no token to train
    assert all(not w["admitted"] and w["reward"] == -1.0 for w in _rows(run, "skills"))


@pytest.mark.parametrize("path", [REPO / "examples" / "rsipo_smoke.toml", *ABLATIONS], ids=lambda p: p.stem)
def test_example_configs_run_one_step(tmp_path, path):
    cfg = load_config(path, ["train.steps=1", "eval.n=0", "run.threads=1", "train.group_size=2", "skills.candidates=2"])
    run = rsipo.train(cfg, tmp_path / path.stem, log=lambda *_: None)
    (row,) = _train_rows(run)
    name = path.stem
    assert ("teacher/rows_frac" in row) == (name not in ("grpo", "rerolls"))
    assert ("skills/written" in row) == (name not in ("grpo", "opsd", "opsd_centered", "opsd_distribution", "sdpo", "rerolls"))
    if name in ("opsd", "opsd_centered", "opsd_distribution"):
        assert row["teacher/rows_frac"] == 1.0  # every household game has a walkthrough
    assert ("loss/distill" in row) == (name == "opsd_distribution")
    if name == "opsd_distribution":
        assert row["loss/distill"] > 0 and row["teacher/distill_weight_mean"] == 1.0 and 0 < row["teacher/distill_topk_mass"] <= 1
    if name == "seed":
        assert "teacher/imitation_weight_mean" in row
    if name == "no_replay":
        assert row["skills/writing_rows"] == 0 and row["skills/replayed_mean"] == 0
    assert ("hatch/groups" in row) == (name in ("hatch", "hatch_oracle", "drift", "signals", "signals_wins", "rerolls"))
    assert ("teacher/critical_matched_frac" in row) == (name in ("opid_critical", "signals", "signals_wins"))
    # B x G, plus the hinted re-rolls and the episodes that try candidate skills
    assert row["episodes/sampled"] == cfg.train.prompts_per_step * 2 + row.get("hatch/episodes", 0) + row.get("skills/effect_episodes", 0)
    if row.get("hatch/episodes"):
        assert row["hatch/wins"] == round(row["hatch/win_rate"] * row["hatch/episodes"]) and row["hatch/wins"].is_integer()
    assert ("skills/effect_episodes" in row) == (name == "effect")


def test_ablation_configs_cover_the_spec():
    names = {p.stem for p in ABLATIONS}
    assert names == {"grpo", "opsd", "opsd_centered", "opsd_distribution", "effect", "sdpo", "opid", "seed", "srpo", "scsdpo", "no_replay",
                     "hatch", "hatch_oracle", "drift", "opid_critical", "contrastive", "curated", "signals", "signals_wins", "rerolls"}
    switches = {
        "grpo": lambda c: c.teacher.source == "none" and c.teacher.lam == 0 and not c.skills.enabled,
        "opsd": lambda c: c.teacher.source == "reference" and c.teacher.center == "none",
        "opsd_centered": lambda c: c.teacher.source == "reference" and c.teacher.center == "group",
        "effect": lambda c: c.skills.effect_games > 0 and c.skills.replay_reward,
        "opsd_distribution": lambda c: c.teacher.source == "reference" and c.teacher.mode == "distribution" and c.trust.mode == "fixed",
        "sdpo": lambda c: c.teacher.source == "sibling",
        "opid": lambda c: c.trust.mode == "fixed" and c.trust.fixed == 1.0,
        "seed": lambda c: c.teacher.mode == "imitation",
        "srpo": lambda c: c.teacher.route == "failed",
        "scsdpo": lambda c: c.teacher.weighting == "pass_rate",
        "no_replay": lambda c: c.skills.enabled and not c.skills.replay_reward,
        "hatch": lambda c: c.hatch.enabled and c.hatch.hint == "reflection" and c.route.mode == "off",
        "hatch_oracle": lambda c: c.hatch.enabled and c.hatch.hint == "oracle_walkthrough",
        "drift": lambda c: c.route.mode == "pass_rate" and c.hatch.enabled and c.route.win_coef > 0,
        "opid_critical": lambda c: c.trust.mode == "fixed" and c.teacher.critical == "from",
        "contrastive": lambda c: c.skills.contrastive and not c.skills.curate,
        "curated": lambda c: c.skills.curate and not c.skills.contrastive,
        "signals": lambda c: c.hatch.enabled and c.route.mode == "pass_rate" and c.teacher.critical == "from" and c.skills.contrastive and c.skills.curate
        and c.skills.eval_both,
        "signals_wins": lambda c: c.hatch.enabled and c.route.mode == "pass_rate" and c.teacher.critical == "from" and c.trust.mode == "calibrated"
        and c.skills.sources == "wins" and c.skills.admit_min_reward == 0.0 and c.skills.eval_both,
        "rerolls": lambda c: c.hatch.enabled and c.route.mode == "pass_rate" and c.teacher.source == "none" and not c.skills.enabled,
    }
    for p in ABLATIONS:
        assert switches[p.stem](load_config(p)), p.stem


def test_sibling_and_reference_teachers_on_single_turn(tmp_path):
    sib = _train_rows(rsipo.train(_cfg("env.name=toy-digits", "train.steps=1", "train.group_size=4", "teacher.source=sibling", "skills.enabled=false",
                                       "sampling.temperature=3.0"), tmp_path / "sib", log=lambda *_: None))[0]
    ref = _train_rows(rsipo.train(_cfg("env.name=arithmetic", "train.steps=1", "train.group_size=2", "teacher.source=reference", "skills.enabled=false"),
                                  tmp_path / "ref", log=lambda *_: None))[0]
    assert ref["teacher/rows_frac"] == 1.0 and ref["trust/groups"] in (0.0, 1.0)
    assert 0.0 <= sib["teacher/rows_frac"] <= 1.0


def test_pull_metrics_by_hand():
    """Teacher -1, -2, -3, -4 (log-probs); student -2, -2, -1, -5 before and -1.5, -2, -2, -4.5
    after: |gap| 1, 0, 2, 1 -> 1.0 before; 0.5, 0, 1, 0.5 -> 0.5 after. Token 2 has no gap;
    tokens 1, 3, 4 moved toward the teacher (+, -, + against gaps +, -, +): 3 of 3."""
    from recursa.methods.teacher import pull_metrics

    t = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    m = pull_metrics(t, torch.tensor([-2.0, -2.0, -1.0, -5.0]), torch.tensor([-1.5, -2.0, -2.0, -4.5]))
    assert m == pytest.approx({"teacher/abs_gap_before": 1.0, "teacher/abs_gap_after": 0.5, "teacher/toward_frac": 1.0})
    away = pull_metrics(t, torch.tensor([-2.0, -2.0, -1.0, -5.0]), torch.tensor([-2.5, -1.0, -2.0, -5.0]))  # token 1 away, 2 no gap, 3 toward, 4 unmoved
    assert away["teacher/toward_frac"] == pytest.approx(0.5) and away["teacher/abs_gap_after"] == pytest.approx((1.5 + 1.0 + 1.0 + 1.0) / 4)
    empty = pull_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert all(v != v for v in empty.values())  # nan


def test_measure_pull_scores_the_taught_tokens_after_the_update(tmp_path):
    """teacher.measure_pull: before the update the gap is the raw Delta (center none), so its
    mean |.| is teacher/delta_abs_mean. The tiny model fails every item, so the outcome
    advantage is 0 and, with trust fixed at 1, the update follows the teacher's term alone: it
    at lr 1e-5 (first order) it must close the gap on most tokens. Off by default, the keys are absent."""
    sets = ("env.name=arithmetic", "train.steps=1", "train.group_size=2", "teacher.source=reference", "skills.enabled=false", "trust.mode=fixed", "train.lr=1e-5")
    on = _train_rows(rsipo.train(_cfg(*sets, "teacher.measure_pull=true"), tmp_path / "on", log=lambda *_: None))[0]
    assert on["reward/mean"] == 0.0
    assert on["teacher/abs_gap_before"] == pytest.approx(on["teacher/delta_abs_mean"], rel=1e-5)
    assert on["teacher/abs_gap_after"] < on["teacher/abs_gap_before"]
    assert on["teacher/toward_frac"] > 0.5
    off = _train_rows(rsipo.train(_cfg(*sets), tmp_path / "off", log=lambda *_: None))[0]
    assert "teacher/abs_gap_after" not in off and off["teacher/delta_abs_mean"] == pytest.approx(on["teacher/delta_abs_mean"])


def test_centred_delta_reaches_the_trust_trials(tmp_path, monkeypatch):
    """teacher.center = group: the mean Delta the trust trials see sums to 0 over each group's
    hinted attempts (raw, it does not)."""
    seen = []
    real = rsipo.agreement_trials

    def spy(groups, mean_delta, outcome, is_source, threshold):
        seen.append(list(mean_delta))
        return real(groups, mean_delta, outcome, is_source, threshold)

    patch_rsipo(monkeypatch, "agreement_trials", spy)
    G = 4
    for center in ("none", "group"):
        rsipo.train(_cfg("env.name=arithmetic", "train.steps=1", "train.prompts_per_step=2", f"train.group_size={G}", "teacher.source=reference",
                         "skills.enabled=false", f"teacher.center={center}"), tmp_path / center, log=lambda *_: None)
    raw, centred = (torch.tensor(m).reshape(-1, G) for m in seen)  # every arithmetic item has a reference answer
    assert raw.sum(dim=1).abs().max() > 1e-3
    assert torch.allclose(centred, raw - raw.mean(dim=1, keepdim=True), atol=1e-5)


@pytest.mark.parametrize("env", ["toy-digits", "toy-corridor"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, monkeypatch, env):
    """Crash in step 3's update (after that step admitted skills, grew the replay buffer and
    updated trust), resume from the step-2 checkpoint: every metric, written skill, replayed
    attempt, the library and the trust state equal those of an uninterrupted run."""
    patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: ParsedSkill(f"Write digits, go east, reach room {len(reply) % 3}.", True, "ok", 7, 0))
    game = ["env.kwargs.max_steps=3"] if env == "toy-corridor" else ["sampling.max_new_tokens=8"]
    cfg = _cfg(f"env.name={env}", *game, "train.steps=3", "train.prompts_per_step=2", "train.group_size=4", "skills.candidates=2",
               "skills.write_per_group=1", "run.checkpoint_every=2", "trust.prior_mean=0.75", "skills.buffer_size=12")
    straight = rsipo.train(cfg, tmp_path / "straight", log=lambda *_: None)

    broken = tmp_path / "broken"
    kill_in_update(monkeypatch, cfg, broken)
    assert max(r["step"] for r in _rows(broken, "skills")) == 3  # step 3 got as far as writing skills
    rsipo.train(cfg, broken, resume=True, log=lambda *_: None)

    a, b = _train_rows(straight), _train_rows(broken)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        x, y = _stable(x), _stable(y)
        assert x.keys() == y.keys()
        assert all(_same(x[k], y[k]) for k in x), [k for k in x if not _same(x[k], y[k])]
    assert a[-1]["teacher/rows_frac"] > 0 and a[-1]["teacher/share"] > 0  # the state that must be restored was in use
    if env == "toy-digits":
        assert a[1]["trust/trials"] > 0 and a[-1]["trust/groups"] > 0
    for name in ("skills", "replay", "samples"):
        assert _rows(straight, name) == _rows(broken, name), name
    assert SkillLibrary(straight / "ledger.sqlite").snapshot() == SkillLibrary(broken / "ledger.sqlite").snapshot()
    sa = json.loads((straight / "checkpoints" / "step_000003" / "state.json").read_text())
    sb = json.loads((broken / "checkpoints" / "step_000003" / "state.json").read_text())
    assert sa == sb


# ----------------------------------------------------------------------------- equality with GRPO


def test_teacher_off_and_skills_off_is_exactly_grpo(tmp_path):
    """lam = 0, no teacher, no skills: the same rollouts, losses and final weights as
    recipes/grpo.py, for a single-turn task and for a game with GiGPO."""
    for env, extra in (("toy-digits", []), ("toy-corridor", ["env.kwargs.max_steps=3", "algo.step_advantage=gigpo"])):
        sets = [*FAST, f"env.name={env}", "train.steps=2", "train.prompts_per_step=2", "train.group_size=4", *extra]
        g = grpo.train(load_config(None, sets), tmp_path / f"grpo_{env}", log=lambda *_: None)
        r = rsipo.train(load_config(None, [*sets, "teacher.source=none", "teacher.lam=0", "skills.enabled=false"], recipe="rsipo"), tmp_path / f"rsipo_{env}", log=lambda *_: None)
        for x, y in zip(_train_rows(g), _train_rows(r)):
            for k in ("reward/mean", "loss/policy", "policy/grad_norm", "policy/clip_frac", "policy/entropy", "batch/rows_run_frac"):
                assert _same(x[k], y[k]), (env, k, x[k], y[k])
            assert y["teacher/share"] == 0.0
        from safetensors.torch import load_file

        wg = load_file(g / "checkpoints" / "step_000002" / "model.safetensors")
        wr = load_file(r / "checkpoints" / "step_000002" / "model.safetensors")
        assert wg.keys() == wr.keys() and all(torch.equal(wg[k], wr[k]) for k in wg), env


def _toy_batch(policy, seed=0):
    from recursa.trajectory import Trajectory, collate

    tok = policy.tokenizer
    prompts = [render_prompt(tok, f"question {i} " * (i + 1), None) for i in range(2)]
    samples = generate(policy.causal_lm, tok, prompts, SamplingParams(max_new_tokens=6), n=3, generator=torch.Generator().manual_seed(seed))
    trajs = []
    for s in samples:
        p = prompts[s.prompt_index]
        trajs.append(Trajectory("t", 0, s.prompt_index, p + s.token_ids, [0] * len(p) + [1] * len(s.token_ids), [0.0] * len(p) + s.logprobs, 0.0, False))
    return collate(trajs, torch.linspace(-1.0, 1.0, len(trajs)), tok.pad_token_id)


def _grads(policy, batch, cfg, imitation=None, **kw):
    model = policy.causal_lm
    saved = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    got = {}
    opt.register_step_pre_hook(lambda *a, **k: got.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    grpo.update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0, imitation, **kw)
    model.load_state_dict(saved)
    return got


def test_per_token_advantages_broadcast_give_the_per_row_gradient():
    policy = load_policy(load_config(None, ["model.name=tiny-random"]).model)
    batch = _toy_batch(policy)
    cfg = load_config(None, ["model.name=tiny-random", "train.max_grad_norm=1e9", "train.micro_batch_size=4"])
    rows = _grads(policy, batch, cfg)
    per_token = copy.deepcopy(batch)
    per_token.advantages = batch.advantages[:, None] * batch.action_mask  # (N, L), 0 off the actions
    tokens = _grads(policy, per_token, cfg)
    assert rows.keys() == tokens.keys() and rows
    assert all(torch.equal(rows[k], tokens[k]) for k in rows)


def test_imitation_term_gradient_by_hand():
    """With zero advantages the update's gradient is coef x the gradient of the token mean
    of -w_t log pi(a_t), computed here directly with autograd."""
    policy = load_policy(load_config(None, ["model.name=tiny-random"]).model)
    batch = _toy_batch(policy, seed=1)
    batch.advantages = torch.zeros_like(batch.advantages)
    weights = torch.rand(batch.action_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.action_mask
    cfg = load_config(None, ["model.name=tiny-random", "train.max_grad_norm=1e9", "train.micro_batch_size=2", "train.shared_prefix=false"])
    got = _grads(policy, batch, cfg, grpo.Imitation(weights, 0.5))
    model = policy.causal_lm
    model.zero_grad()
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    (0.5 * -(weights * logp).sum() / batch.action_mask.sum()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    for k in got:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=1e-4), k


def _teacher_topk(batch, k, seed):
    """A made-up teacher: the top-k of a random next-token distribution at every action
    position, (ids, log-probs) of shape (N, L, k), 0 elsewhere; some rows without a term."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((*batch.input_ids.shape, 64), generator=gen) * 2
    logp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    on = batch.action_mask.bool()[..., None]
    weights = torch.rand(batch.action_mask.shape, generator=gen) * batch.action_mask
    weights[0] = 0  # a row the term does not reach
    return torch.where(on, ids, 0), torch.where(on, logp, 0.0), weights


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
def test_distribution_term_gradient_by_hand(shared, kind):
    """With zero advantages the update's gradient is coef x the gradient of the token mean of
    w_t D_t (`distill.distribution_loss`), computed here with autograd on the student's
    log-probs at the teacher's ids over the whole batch, whatever the micro-batches."""
    from recursa.algorithms.distill import distribution_loss

    policy = load_policy(load_config(None, ["model.name=tiny-random"]).model)
    batch = _toy_batch(policy, seed=3)
    batch.advantages = torch.zeros_like(batch.advantages)
    ids, teacher, weights = _teacher_topk(batch, 4, seed=5)
    cfg = load_config(None, ["model.name=tiny-random", "train.max_grad_norm=1e9", "train.micro_batch_size=2", f"train.shared_prefix={str(shared).lower()}"])
    got = _grads(policy, batch, cfg, distillation=grpo.Distillation(ids, teacher, weights, 0.5, kind))
    model = policy.causal_lm
    model.zero_grad()
    _, _, student = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, at_ids=ids)
    (0.5 * distribution_loss(student, teacher, weights, batch.action_mask, kind)).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    for k in got:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=1e-4), k
    model.zero_grad()


def test_distribution_term_learns_its_teacher():
    """Only the distribution term (zero advantages), the same batch five times: the student's
    divergence from the teacher's top-k distribution falls at every update."""
    policy = load_policy(load_config(None, ["model.name=tiny-random"]).model)
    batch = _toy_batch(policy, seed=4)
    batch.advantages = torch.zeros_like(batch.advantages)
    ids, teacher, weights = _teacher_topk(batch, 4, seed=6)
    cfg = load_config(None, ["model.name=tiny-random", "train.micro_batch_size=3", "train.lr=1e-2", "train.warmup_steps=0"])
    opt = torch.optim.AdamW(policy.causal_lm.parameters())  # the update sets the learning rate
    term = grpo.Distillation(ids, teacher, (weights > 0).float() * batch.action_mask, 1.0, "forward")
    seen = [grpo.update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), i, distillation=term).distill for i in range(5)]
    assert all(b < a for a, b in zip(seen, seen[1:])), seen
    assert seen[-1] < 0.7 * seen[0], seen


def test_update_trains_every_row_when_mini_batches_do_not_divide_the_rows():
    """Games and skill-writing rows make the row count arbitrary: with 5 rows and 2
    mini-batches, both optimizer steps run and together they cover all 5 rows."""
    policy = load_policy(load_config(None, ["model.name=tiny-random"]).model)
    batch = _toy_batch(policy).select(torch.arange(5))
    cfg = load_config(None, ["model.name=tiny-random", "train.mini_batches=2", "train.skip_zero_advantage=false"])
    st = grpo.update(policy, torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-3), batch, cfg, torch.Generator().manual_seed(0), 0)
    assert st.opt_steps == 2 and st.rows_run == 5


def test_weights_gate_runs_with_rsipo(tmp_path):
    cfg = _cfg("env.name=toy-digits", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "gate.mode=gate", "gate.every=1", "gate.n=4",
               "skills.candidates=2")
    run = rsipo.train(cfg, tmp_path / "gated", log=lambda *_: None)
    gates = [r for r in _rows(run) if "gate/accepted" in r]
    assert [r["step"] for r in gates] == [1, 2] and all(r["gate/candidate_rate"] >= 0 for r in gates)


def test_term_scales_by_hand():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)  # rows 0-1 policy, row 2 writing
    assert rsipo.term_scales(mask, 2, "token-mean") == (4 / 3, 4.0)
    assert rsipo.term_scales(mask, 2, "seq-mean-token-mean") == (1.5, 3.0)
    assert rsipo.term_scales(mask, 3, "token-mean") == (1.0, 1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_writing_rows_do_not_dilute_the_policy_gradient(agg):
    """Rows appended to the batch (skill writing) with zero advantage: after term_scales the
    policy rows' gradient is exactly that of the policy rows alone."""
    policy = load_policy(load_config(None, ["model.name=tiny-random"]).model)
    batch = _toy_batch(policy, seed=3)
    cfg = load_config(None, ["model.name=tiny-random", "train.max_grad_norm=1e9", "train.micro_batch_size=8", f"algo.agg={agg}", "train.skip_zero_advantage=false"])
    alone = _grads(policy, batch.select(torch.arange(4)), cfg)
    both = copy.deepcopy(batch)
    scale, _ = rsipo.term_scales(both.action_mask, 4, agg)
    both.advantages = torch.cat([batch.advantages[:4] * scale, torch.zeros(2)])
    mixed = _grads(policy, both, cfg)
    assert alone.keys() == mixed.keys() and alone
    for k in alone:
        assert torch.allclose(alone[k], mixed[k], atol=1e-7, rtol=1e-4), k


def test_kl_to_the_reference_with_rsipo(tmp_path, monkeypatch):
    patch_rsipo(monkeypatch, "parse_skill", _always_valid)
    cfg = _cfg("env.name=toy-digits", "train.steps=1", "train.group_size=4", "train.epochs=2", "algo.kl_coef=0.1", "skills.candidates=2")
    (row,) = _train_rows(rsipo.train(cfg, tmp_path / "kl", log=lambda *_: None))
    assert row["policy/kl"] > 0 and row["skills/writing_rows"] > 0  # the second epoch moved away from the reference


# ----------------------------------------------------------------------------- config


def test_config_rejects_inconsistent_switches():
    from recursa.errors import UserError

    with pytest.raises(UserError, match="skills.enabled"):
        _cfg("skills.enabled=false")
    with pytest.raises(UserError, match="teacher.lam"):
        _cfg("teacher.source=none", "skills.enabled=false")
    with pytest.raises(UserError, match="unknown key"):
        _cfg("skills.candidate=3")
    cfg = load_config(None, ["teacher.source=none", "teacher.lam=0", "skills.enabled=false"], recipe="rsipo")
    assert cfg.recipe == "rsipo" and cfg.run.out is None  # the CLI then writes to runs/rsipo


def test_cli_describes_the_rsipo_config(capsys):
    from recursa.cli import main

    assert main(["train", "--help-config", "--recipe", "rsipo"]) == 0
    out = capsys.readouterr().out
    for key in ("teacher.source", "teacher.lam", "trust.mode", "skills.write_per_group", "skills.coef", "skills.replay_size"):
        assert key in out


# ----------------------------------------------------------------------------- learning and the benchmark


@pytest.mark.slow
def test_rsipo_learns_toy_task(tmp_path):
    """The full recipe (skills written, replayed, retrieved; calibrated self-teacher) on the
    tiny random model raises held-out reward on toy-digits as GRPO does (tests/test_learning.py)."""
    cfg = _cfg("env.name=toy-digits", "sampling.max_new_tokens=8", "train.steps=40", "train.prompts_per_step=4", "train.group_size=8",
               "train.micro_batch_size=32", "train.lr=3e-3", "eval.n=64", "eval.every=20")
    run = rsipo.train(cfg, tmp_path / "learn", log=lambda *_: None)
    before = json.loads((run / "eval" / "before.json").read_text())
    after = json.loads((run / "eval" / "after.json").read_text())
    assert before["mean_reward"] < 0.1 and after["mean_reward"] > before["mean_reward"] + 0.3
    rows = _train_rows(run)
    assert max(r["teacher/rows_frac"] for r in rows) > 0 and max(r["skills/library_size"] for r in rows) > 0  # the machinery was in play


def test_benchmark_script_tiny(tmp_path):
    """The self-improvement benchmark end to end on the tiny model: one result file per run,
    the summary layout (recipes.<name>.seeds[].heldout.items[]), warm_start paired with every
    seed, curves in sampled episodes, and a rerun that reuses every committed result."""
    import subprocess
    import sys

    cmd = [sys.executable, str(REPO / "benchmarks" / "rsipo_vs_grpo.py"), "--tiny", "--recipes", "warm_start,grpo,rsipo", "--seeds", "0,1",
           "--steps", "2", "--eval-n", "4", "--eval-every", "1", "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "toy_corridor.json").read_text())
    assert data["env"] == "toy-corridor" and data["budget"]["episodes"] == 2 * 2 * 4 and data["budget"]["split"] == "test"
    assert list(data["recipes"]) == ["warm_start", "grpo", "rsipo"] and data["recipes"]["grpo"]["recipe"] == "grpo"
    ws = data["recipes"]["warm_start"]["seeds"]
    assert [s["seed"] for s in ws] == [0, 1] and ws[0]["heldout"]["items"] == ws[1]["heldout"]["items"] and ws[0]["episodes"] == 0
    for name in ("grpo", "rsipo"):
        for s in data["recipes"][name]["seeds"]:
            assert [p["episodes"] for p in s["curve"]] == [8, 16] and s["heldout"]["n"] == 4 and s["episodes"] >= 16
            assert [i["seed"] for i in s["heldout"]["items"]] == [i["seed"] for i in ws[0]["heldout"]["items"]]  # the same games
            assert not (tmp_path / "runs" / "toy_corridor" / f"{name}_seed{s['seed']}" / "checkpoints").exists()
        assert data["comparisons"][name]["vs_warm_start"]["n"] == 8
    assert data["comparisons"]["rsipo"]["vs_grpo"]["n"] == 8 and "vs_grpo" not in data["comparisons"]["warm_start"]
    assert sorted(p.name for p in (tmp_path / "out" / "toy_corridor").glob("*.json")) == [
        "grpo_seed0.json", "grpo_seed1.json", "rsipo_seed0.json", "rsipo_seed1.json", "warm_start_seed0.json"]
    assert (tmp_path / "out" / "toy_corridor.md").read_text().startswith("# Self-improvement on toy-corridor")
    assert (tmp_path / "out" / "toy_corridor.png").stat().st_size > 1000

    shutil.rmtree(tmp_path / "runs")  # the committed result files alone rebuild everything
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("committed result") == 6, again.stdout[-3000:] + again.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
    assert json.loads((tmp_path / "out" / "toy_corridor.json").read_text())["comparisons"] == data["comparisons"]

    # a later invocation for other recipes keeps the earlier ones in the summary when their
    # comparison settings match (a pilot's tagged runs), and leaves them out when they do not
    report = [*cmd[:4], "warm_start", *cmd[5:], "--report"]
    assert subprocess.run(report, cwd=REPO, capture_output=True, text=True, timeout=300).returncode == 0
    assert list(json.loads((tmp_path / "out" / "toy_corridor.json").read_text())["recipes"]) == ["warm_start", "grpo", "rsipo"]
    other = [x if x != "2" else "3" for x in report]  # --steps 3: other runs
    assert subprocess.run(other, cwd=REPO, capture_output=True, text=True, timeout=300).returncode == 0
    assert list(json.loads((tmp_path / "out" / "toy_corridor.json").read_text())["recipes"]) == ["warm_start"]

    # one piece of the benchmark (one recipe, one seed, as a queue runs it) rewrites the summary
    # with every committed seed and the warm start, not only with what it ran
    piece = [*cmd[:4], "grpo", cmd[5], "1", *cmd[7:]]
    assert subprocess.run(piece, cwd=REPO, capture_output=True, text=True, timeout=300).returncode == 0
    assert not (tmp_path / "runs").exists()  # nothing was retrained
    summary = json.loads((tmp_path / "out" / "toy_corridor.json").read_text())
    assert summary["seeds"] == [0, 1] and list(summary["recipes"]) == ["warm_start", "grpo", "rsipo"]
    assert [s["seed"] for s in summary["recipes"]["warm_start"]["seeds"]] == [0, 1]
    assert [s["seed"] for s in summary["recipes"]["grpo"]["seeds"]] == [0, 1]
    assert summary["comparisons"] == data["comparisons"]


def test_benchmark_run_cut_off_resumes_where_it_stopped(tmp_path):
    """A benchmark run killed after its first checkpoint (a sitting's end) resumes from it on
    the next invocation instead of starting over, and its result equals an uninterrupted
    run's; the wall time adds up both pieces."""
    import os
    import subprocess
    import sys

    def bench(out: str, fault: str | None = None):
        cmd = [sys.executable, str(REPO / "benchmarks" / "rsipo_vs_grpo.py"), "--tiny", "--recipes", "grpo", "--seeds", "0", "--steps", "2",
               "--eval-n", "4", "--eval-every", "1", "--out", str(tmp_path / out), "--runs-dir", str(tmp_path / f"runs_{out}")]
        env = {k: v for k, v in os.environ.items() if k != "RECURSA_FAULT_AT"} | ({"RECURSA_FAULT_AT": fault} if fault else {})
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)

    cut = bench("cut", fault="checkpoint.recorded@1")
    assert cut.returncode != 0 and not (tmp_path / "cut" / "toy_corridor" / "grpo_seed0.json").exists()
    resumed = bench("cut")
    assert resumed.returncode == 0 and "resuming the interrupted run" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    whole = bench("whole")
    assert whole.returncode == 0 and "resuming" not in whole.stdout
    a, b = (json.loads((tmp_path / d / "toy_corridor" / "grpo_seed0.json").read_text()) for d in ("cut", "whole"))
    assert a["pieces"] == 2 and b["pieces"] == 1 and a["wall_s"] > 0
    assert a["spec"] == b["spec"] and a["heldout"]["items"] == b["heldout"]["items"]
    assert [(p["episodes"], p["items"]) for p in a["curve"]] == [(p["episodes"], p["items"]) for p in b["curve"]]



def test_benchmark_extends_a_kept_run_to_more_steps(tmp_path):
    """--extend-from: a run trained further from a kept shorter run's last checkpoint equals the
    longer run trained whole (curve and held-out games), keeps the shorter run's final
    evaluation as its mid-run point, counts both pieces' wall time and says where it came
    from; the shorter run's directory is left as it was. A committed result of other settings
    under the same name is never replaced without --replace."""
    import subprocess
    import sys

    def bench(steps: str, *extra: str, check: bool = True):
        cmd = [sys.executable, str(REPO / "benchmarks" / "rsipo_vs_grpo.py"), "--tiny", "--recipes", "grpo", "--seeds", "0", "--steps", steps,
               "--eval-n", "4", "--eval-every", "1", "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs"), *extra]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    bench("2", "--keep-checkpoints", "--tag", "@short")
    short_dir = tmp_path / "runs" / "toy_corridor" / "grpo@short_seed0"
    (short_dir / "eval" / "after_wise0.5.json").write_text((short_dir / "eval" / "after.json").read_text())  # the shorter run's weights, evaluated another way
    before = sorted((p.relative_to(short_dir), p.stat().st_size) for p in short_dir.rglob("*") if p.is_file() and p.name != ".recursa.lock")
    out = bench("3", "--tag", "@long", "--extend-from", "@short").stdout
    assert "going on from step 2" in out
    long_dir = tmp_path / "runs" / "toy_corridor" / "grpo@long_seed0"
    assert sorted(p.name for p in (long_dir / "eval").glob("*.json")) == ["after.json", "step_0001.json", "step_0002.json"]  # no after_wise0.5.json
    bench("3", "--tag", "@whole")
    games = tmp_path / "out" / "toy_corridor"
    ext, whole, short = (json.loads((games / f"grpo@{t}_seed0.json").read_text()) for t in ("long", "whole", "short"))
    assert ext["spec"] == whole["spec"] and ext["heldout"]["items"] == whole["heldout"]["items"]
    assert [(p["episodes"], p["items"]) for p in ext["curve"]] == [(p["episodes"], p["items"]) for p in whole["curve"]]
    assert [p["step"] for p in ext["curve"]] == [1, 2, 3]
    assert [(i["seed"], i["success"]) for i in ext["curve"][1]["items"]] == [(i["seed"], i["success"]) for i in short["heldout"]["items"]]
    assert ext["extended_from"] == {"run": str(short_dir), "steps": 2} and ext["pieces"] == 2 and "extended_from" not in whole
    assert sorted((p.relative_to(short_dir), p.stat().st_size) for p in short_dir.rglob("*") if p.is_file() and p.name != ".recursa.lock") == before

    # refusals, each one line: a source of other settings, a source without its checkpoint,
    # and a committed result of other settings under the same name
    bad = bench("3", "--tag", "@x", "--extend-from", "@whole", check=False)
    assert bad.returncode != 0 and "with 3 steps, not fewer than 3" in bad.stderr
    bad = bench("4", "--tag", "@long", "--set", "train.lr=0.5", check=False)
    assert bad.returncode != 0 and "holds a result of other settings" in bad.stderr and "--replace" in bad.stderr
    assert json.loads((games / "grpo@long_seed0.json").read_text()) == ext

def test_benchmark_interpolated_weights_are_a_recipe_of_their_own(tmp_path):
    """--interpolate: each trained run's final weights moved toward the warm start are
    evaluated on the same held-out games and written as <name>+wise<alpha>; a committed run
    whose weights are gone is trained again for them, its committed file left unchanged, and
    the new file says whether the retrained run won the same games."""
    import subprocess
    import sys

    def bench(*extra: str):
        cmd = [sys.executable, str(REPO / "benchmarks" / "rsipo_vs_grpo.py"), "--tiny", "--recipes", "warm_start,grpo", "--seeds", "0", "--steps", "2",
               "--eval-n", "4", "--eval-every", "1", "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs"), *extra]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    bench("--interpolate", "0.5")
    games = tmp_path / "out" / "toy_corridor"
    run = json.loads((games / "grpo_seed0.json").read_text())
    half = json.loads((games / "grpo+wise0.5_seed0.json").read_text())
    assert half["interpolate"] == {"alpha": 0.5, "of": "grpo", "of_success_rate": run["heldout"]["success_rate"]}
    assert [i["seed"] for i in half["heldout"]["items"]] == [i["seed"] for i in run["heldout"]["items"]]  # the same games
    assert half["episodes"] == run["episodes"] and half["curve"][0]["episodes"] == run["episodes"]
    assert half["spec"]["sets"][-1] == "interpolate=0.5" and half["spec"]["sets"][:-1] == run["spec"]["sets"]
    assert not (tmp_path / "runs" / "toy_corridor" / "grpo_seed0" / "checkpoints").exists()  # removed once evaluated
    summary = json.loads((tmp_path / "out" / "toy_corridor.json").read_text())
    assert list(summary["recipes"]) == ["warm_start", "grpo", "grpo+wise0.5"]
    assert summary["comparisons"]["grpo+wise0.5"]["vs_warm_start"]["n"] == 4 and summary["comparisons"]["grpo+wise0.5"]["vs_grpo"]["n"] == 4

    committed_run = (games / "grpo_seed0.json").read_bytes()
    out = bench("--interpolate", "0.25")  # the weights were not kept: trained again
    assert "training it again" in out and "the same games as" in out, out[-3000:]
    assert (games / "grpo_seed0.json").read_bytes() == committed_run
    quarter = json.loads((games / "grpo+wise0.25_seed0.json").read_text())
    assert quarter["interpolate"]["trained_again"]["same_items"] is True  # the tiny run is deterministic
    shutil.rmtree(tmp_path / "runs")
    out = bench("--interpolate", "0.25,0.5")  # everything committed: nothing runs
    assert not (tmp_path / "runs").exists() and "committed result" in out
    assert list(json.loads((tmp_path / "out" / "toy_corridor.json").read_text())["recipes"]) == ["warm_start", "grpo", "grpo+wise0.25", "grpo+wise0.5"]


def test_benchmark_success_by_task_type():
    """household's held-out games are labelled by the task type the env draws (the warm start
    saw two of four), and final successes are pooled per label over seeds."""
    bench = _bench()
    from recursa.envs import make_env

    seeds = [2_000_000_000 + i for i in range(6)]
    labels = bench.item_groups(bench.HOUSEHOLD, seeds)
    env = make_env("household", rooms=1, objects_per_room=2, distractors=0, tasks=["pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place"], max_steps=12)
    for seed in seeds:
        env.reset(seed)
        assert labels[seed] == env.task_type
    assert bench.item_groups(bench.TWX_TWC, seeds) == {}
    result = {"recipes": {"grpo": {"seeds": [
        {"heldout": {"items": [{"seed": 1, "success": True}, {"seed": 2, "success": False}]}},
        {"heldout": {"items": [{"seed": 1, "success": True}, {"seed": 2, "success": True}]}},
    ]}}}
    assert bench.by_group(result, {1: "heat", 2: "cool"}) == {"grpo": {"cool": [1, 2], "heat": [2, 2]}}


def test_benchmark_cluster_bootstrap_and_pairs():
    bench = _bench()
    a = {(0, 10): False, (1, 10): False, (0, 11): True, (1, 11): True, (0, 12): False}
    b = {(0, 10): True, (1, 10): True, (0, 11): True, (1, 11): False, (2, 99): True}
    x, y, games = bench.pairs(a, b)
    assert (x, y, games) == ([False, True, False, True], [True, True, True, False], [10, 11, 10, 11])
    # game 10 gains 2 of 2 pairs, game 11 loses 1 of 2: diff = (2 - 1) / 4. Resampling two games gives
    # {10, 10}: 4/4 (prob 1/4), one of each: 1/4 (prob 1/2), {11, 11}: -2/4 (prob 1/4), so p(diff <= 0) = 1/4
    boot = bench.cluster_bootstrap(x, y, games, reps=4000)
    assert boot["ci95"] == (-0.5, 1.0) and abs(boot["p_greater"] - 0.25) < 0.03
    cmp = bench.compare(a, b)
    assert cmp["n"] == 4 and cmp["b"] == 2 and cmp["c"] == 1 and cmp["diff"] == 0.25


def test_benchmark_takes_each_ablations_switches_from_its_example_config():
    bench = _bench()
    budget = bench.TWX_TWC["rsipo"]
    assert bench.recipe_spec("opid", bench.TWX_TWC) == ("rsipo", [*budget, 'trust.mode="fixed"', "trust.fixed=1.0"])
    assert bench.recipe_spec("srpo", bench.TWX_TWC) == ("rsipo", [*budget, 'teacher.route="failed"'])
    assert bench.recipe_spec("opsd", bench.TWX_TWC) == ("rsipo", ['teacher.source="reference"', "skills.enabled=false"])
    assert bench.recipe_spec("no_replay", bench.TWX_TWC) == ("rsipo", [*budget, "skills.replay_reward=false"])
    for name in bench.ABLATIONS:  # every entry is a valid rsipo config with the agent setting
        recipe, sets = bench.recipe_spec(name, bench.TWX_TWC)
        load_config(None, [*bench.TWX_TWC["sets"], *sets, "init.from_run="], recipe=recipe)


def test_benchmark_pins_the_warm_start_by_its_weights(tmp_path):
    """A warm start retrained later writes a config.toml with keys recursa added since: its id
    stays the pinned one while the weights are byte-identical, and changes when they differ."""
    import hashlib
    bench = _bench()
    ws = tmp_path / "ws"
    (ws / "checkpoints" / "step_000020").mkdir(parents=True)
    (ws / "config.toml").write_text('recipe = "sft"\n')
    (ws / "checkpoints" / "step_000020" / "model.safetensors").write_bytes(b"weights")
    game = {"warm_start": str(ws), "warm_start_cmd": "recursa train x.toml", "pin": tmp_path / "res" / "g" / "warm_start_pin.json"}
    first = hashlib.sha256(b'recipe = "sft"\n').hexdigest()[:16]
    assert bench.warm_start_id(game) == first  # no pin yet: the config's hash
    bench.pin_warm_start(game)
    pin = json.loads(game["pin"].read_text())
    assert pin["config_sha"] == first and pin["weights_sha256"] == hashlib.sha256(b"model.safetensors" + b"weights").hexdigest()
    (ws / "config.toml").write_text('recipe = "sft"\n[log]\nreport_to = []\n')  # retrained: a newer config dump
    assert bench.warm_start_id(game) == first and bench.pin_mismatch(game) is None
    (ws / "config.toml").write_text('recipe = "sft"\n')  # retrained by the same config into other bytes: kept, with a warning
    (ws / "checkpoints" / "step_000020" / "model.safetensors").write_bytes(b"other weights")
    assert bench.warm_start_id(game) == first
    warning = bench.pin_mismatch(game)
    assert warning.startswith("warning: ") and "\n" not in warning and pin["weights_sha256"][:12] in warning
    (ws / "config.toml").write_text('recipe = "sft"\n[log]\nreport_to = []\n')
    assert bench.pin_mismatch(game) is None  # another config: a new id, nothing to warn about
    assert bench.warm_start_id(game) == hashlib.sha256(b'recipe = "sft"\n[log]\nreport_to = []\n').hexdigest()[:16]
    bench.pin_warm_start(game)  # an existing pin is never rewritten
    assert json.loads(game["pin"].read_text()) == pin
    import shutil

    shutil.rmtree(ws)  # gone (a later sitting): a --report still matches the committed runs by the pin
    assert bench.warm_start_id(game) == first
    game["pin"].unlink()
    assert bench.warm_start_id(game) is None  # neither the warm start nor a pin: nothing to match


def test_benchmark_summary_compares_with_the_named_grpo_baseline():
    """rsipo_vs_grpo's summary pairs every recipe with the baseline it is given (a pilot's
    tagged GRPO): hand-counted wins and losses, and the episodes to reach its final success."""
    bench = _bench()

    def run(seed, final, mid=None):
        items = [{"seed": g, "success": s} for g, s in enumerate(final)]
        curve = ([{"episodes": 128, "items": [{"seed": g, "success": s} for g, s in enumerate(mid)]}] if mid else []) + [{"episodes": 256, "items": items}]
        return {"seed": seed, "episodes": 256, "heldout": {"items": items}, "curve": curve}

    ws = [1, 0, 0, 0, 1, 0]
    result = {"baseline": "grpo@lr1e-5", "recipes": {
        "warm_start": {"seeds": [dict(run(0, ws), episodes=0), dict(run(1, ws), episodes=0)]},
        "grpo@lr1e-5": {"seeds": [run(0, [1, 1, 0, 0, 0, 0]), run(1, [1, 0, 0, 0, 1, 0])]},
        "grpo@progress": {"seeds": [run(0, [1, 1, 1, 0, 1, 0], mid=[1, 1, 0, 0, 1, 0]), run(1, [1, 1, 1, 1, 1, 0], mid=[1, 0, 1, 0, 1, 0])]},
    }}
    c = bench.summarise(result)
    assert "vs_grpo" not in c["grpo@lr1e-5"] and c["grpo@lr1e-5"]["vs_warm_start"]["b"] == 1 and c["grpo@lr1e-5"]["vs_warm_start"]["c"] == 1
    vs = c["grpo@progress"]["vs_grpo"]  # seed 0: +2 (games 2, 4) -0; seed 1: +3 (games 1, 2, 3) -0
    assert (vs["b"], vs["c"], vs["n"]) == (5, 0, 12) and vs["diff"] == pytest.approx(5 / 12)
    assert c["grpo@progress"]["pooled"][:2] == [9, 12]
    assert c["grpo@progress"]["episodes_to_grpo_final"] == 128  # 6/12 at 128 >= the baseline's 5/12
    result["baseline"] = "grpo"  # no such recipe: no comparison with GRPO at all
    assert "vs_grpo" not in bench.summarise(result)["grpo@progress"]


def test_benchmark_table_reports_a_zero_bootstrap_p_as_below_one_over_the_resamples():
    """Every resample of a clear gain is above 0: the clustered bootstrap's p prints as < 1/reps."""
    bench = _bench()
    x, y = [False] * 20, [True] * 10 + [False] * 10  # 10 games gained, none lost
    boot = bench.cluster_bootstrap(x, y, list(range(20)), reps=1000)
    assert boot["p_greater"] == 0 and boot["reps"] == 1000
    text = bench._fmt_cmp({"diff": 0.5, "diff_ci95": [0.3, 0.7], "p_greater": 0.001, "cluster_ci95": list(boot["ci95"]),
                           "cluster_p_greater": boot["p_greater"], "cluster_reps": boot["reps"]})
    assert "p<0.001)" in text and "p=0)" not in text


def test_benchmark_names_the_game_when_it_is_not_the_env():
    """Summaries of household from the light warm start say so in their title; a game named
    after its env (twx:twc -> twx_twc, toy-corridor -> toy_corridor) is not repeated."""
    name = _bench()._game_name
    assert name({"env": "household", "game": "household_light"}) == "household (household_light)"
    assert name({"env": "household", "game": "household"}) == "household"
    assert name({"env": "twx:twc", "game": "twx_twc"}) == "twx:twc"
    assert name({"env": "toy-corridor", "game": "toy_corridor"}) == "toy-corridor"
    assert name({"env": "household"}) == "household"  # a summary written before the field existed


def test_benchmark_summary_table_shows_the_update_diagnostics():
    """The summary's diagnostics table carries the update's clipped share, KL to the rollout
    policy and entropy (step means, averaged over seeds by hand), '-' for a run that did not
    log them, and leaves out metrics that are not on its list."""
    bench = _bench()

    def run(seed, diag):
        items = [{"seed": g, "success": s} for g, s in enumerate([1, 0, 1, 0])]
        return {"seed": seed, "episodes": 256, "wall_s": 60.0, "diagnostics": diag,
                "heldout": {"items": items, "success_rate": 0.5}, "curve": [{"episodes": 256, "items": items}]}

    result = {"budget": {"steps": 8, "prompts_per_step": 4, "group_size": 8, "episodes": 256, "eval_n": 4, "split": "test"},
              "warm_start": "runs/ws", "seeds": [0, 1], "env": "household", "game": "household_light", "recipes": {
                  "grpo": {"seeds": [run(0, {"policy/clip_frac": 0.01, "policy/grad_norm": 0.7}), run(1, {"policy/clip_frac": 0.02})]},
                  "grpo@old": {"seeds": [run(0, {"reward/mean": 0.25})]}}}
    result["comparisons"] = bench.summarise(result)
    text = bench.table(result)
    header = next(line for line in text.splitlines() if line.startswith("| recipe | policy/clip_frac"))
    assert header.split(" | ")[1:] == ["policy/clip_frac", "reward/mean |"]  # policy/grad_norm is not reported
    assert "| grpo | 0.015 | - |" in text and "| grpo@old | - | 0.250 |" in text


def test_benchmark_diagnostics_count_the_hinted_rerolls(tmp_path):
    """The run's hinted re-rolls and their wins are totals over its steps (by hand: 4 + 8 + 0
    re-rolls, 0 + 2 + 0 won), beside the step means of every hatch/ metric."""
    bench = _bench()
    rows = [{"step": 1, "hatch/episodes": 4.0, "hatch/win_rate": 0.0, "reward/mean": 0.25},
            {"step": 2, "hatch/episodes": 8.0, "hatch/win_rate": 0.25, "reward/mean": 0.5},
            {"step": 3, "reward/mean": 0.75},  # no all-failed group: nothing re-rolled
            {"step": 4, "hatch/episodes": 0.0, "hatch/win_rate": 0.0}]
    out = bench.diagnostics(rows, tmp_path)
    assert out["hatch/episodes_total"] == 12 and out["hatch/wins_total"] == 2
    assert out["hatch/win_rate"] == round(0.25 / 3, 6) and out["reward/mean"] == 0.5
    assert "hatch/episodes_total" not in bench.diagnostics([{"step": 1, "reward/mean": 0.5}], tmp_path)
    counted = [{"step": 1, "hatch/episodes": 3.0, "hatch/wins": 1.0, "hatch/win_rate": 1 / 3}]  # logged count, not a rounded product
    assert bench.diagnostics(counted + rows[1:2], tmp_path)["hatch/wins_total"] == 3
