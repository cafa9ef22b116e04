"""RSIPO's learning-signal switches end to end on the tiny model: hinted re-rolls of all-fail
groups ([hatch]), routing by pass rate ([route]), the critical step (teacher.critical),
contrastive skill writing and the curator (skills.contrastive, skills.curate), evaluation
with and without the library (skills.eval_both, `recursa eval --skills`), the sampled-episode
count, and a resume with every switch on."""

from __future__ import annotations

import json

import pytest
import torch

import recursa.distributed.local
import recursa.recipes.rsipo as rsipo
from recursa.algorithms.distill import imitation_loss
from recursa.config import load_config
from recursa.envs import EnvPool, StepResult, make_env, register_env
from recursa.errors import UserError
from recursa.generation import SamplingParams, sequence_logprobs
from recursa.recipes import grpo
from recursa.recipes.grpo import train_seeds
from recursa.recipes.rsipo import Attempt, Context, skill_hint, user_message
from recursa.rollout import render_prompt
from recursa.skills import ParsedSkill, SkillLibrary

from _rsipo_runs import FAST, VOLATILE, kill_in_update
from _rsipo_runs import cfg as _cfg
from _rsipo_runs import rows as _rows
from _rsipo_runs import train_rows as _train_rows
from _rsipo_runs import patch_rsipo

GOOD_SKILL = "Go east to reach the last room."


class ParityEnv:
    """Single-turn toy: every attempt at an even seed wins, at an odd seed fails (so each
    group is all-win or all-fail); has a reference answer (for the reference teacher)."""

    name = "toy-parity"
    system_prompt = None

    def reset(self, seed: int) -> str:
        self.seed = seed
        return f"Say anything. Item {seed % 7}."

    def reference(self) -> str:
        return "anything at all"

    def step(self, action_text: str) -> StepResult:
        won = self.seed % 2 == 0
        return StepResult("", float(won), True, {"success": won})


class CoinEnv:
    """Single-turn toy: a reply with an even number of characters wins (groups are mixed)."""

    name = "toy-coin"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return f"Reply. Item {seed % 5}."

    def step(self, action_text: str) -> StepResult:
        won = len(action_text or "") % 2 == 0
        return StepResult("", float(won), True, {"success": won})


register_env("toy-parity", ParityEnv, "toy: even seeds win, odd seeds fail (tests)")
register_env("toy-coin", CoinEnv, "toy: even-length replies win (tests)")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _valid(text):
    return lambda reply, w, c: ParsedSkill(text, True, "ok", len(text.split()), 0)


def _logp(model, prompt, actions):
    ids = torch.tensor([prompt + actions])
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), (torch.arange(ids.shape[1]) >= len(prompt)).float()[None])
    return logp[0, len(prompt):]


# ----------------------------------------------------------------------------- hinted re-rolls (hatch)

CORRIDOR = ["env.name=toy-corridor", "env.kwargs.max_steps=3", "agent.history_turns=1"]


def test_hinted_rerolls_train_under_the_unhinted_prompt_by_hand(tiny_policy, monkeypatch):
    """Each re-rolled turn becomes a row of the un-hinted prompt (exactly what a rollout without
    the hint renders) and the hinted episode's action ids; its token advantage is
    coef x min(pi(a|no hint) / pi(a|hint), cap) x (R - the group's mean reward), both log-probs
    computed here directly."""
    cfg = _cfg(*CORRIDOR, "train.prompts_per_step=2", "train.group_size=2", "hatch.enabled=true", "hatch.hint=oracle_walkthrough", "hatch.rerolls=2",
               "hatch.coef=0.5", "hatch.anneal=constant", "hatch.is_cap=1.5", "skills.enabled=false", "teacher.source=none", "teacher.lam=0")
    pool = EnvPool(lambda: make_env("toy-corridor", max_steps=3))
    sampling, gen, seeds = SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0), [1, 2]
    played = rsipo.play(tiny_policy, pool, seeds, None, sampling, gen, None, cfg, True, 1)
    assert not played.success.any()  # a random model never reaches the exit: both groups all-fail
    played.rewards = played.rewards - 0.2  # every episode scores -0.3 (three invalid actions): a lower baseline makes R - b != 0
    captured, real = [], rsipo.rollout_episodes
    patch_rsipo(monkeypatch, "rollout_episodes", lambda *a, **k: captured.append(real(*a, **k)) or captured[-1])
    hinted = rsipo.hinted_rerolls(tiny_policy, pool, played, seeds, None, SkillLibrary(":memory:"), sampling, gen, cfg, None, True, 0)
    (ero,) = captured
    assert hinted.episodes == len(ero.episodes) == 4 and hinted.metrics["hatch/groups"] == hinted.metrics["hatch/hinted_groups"] == 2
    tok, model, env = tiny_policy.tokenizer, tiny_policy.causal_lm, make_env("toy-corridor", max_steps=3)
    attempts = rsipo.episode_attempts(ero.episodes, 1, cfg.agent)
    r = 0
    nonzero = 0
    for i, (episode, attempt) in enumerate(zip(ero.episodes, attempts)):
        b = i // 2
        hint = rsipo.oracle_hint(env, seeds[b], True, 0, cfg.teacher.max_hint_chars)
        assert hint.startswith("Actions that win this game") and "go east" in hint
        baseline = played.rewards[b].mean().item()
        for turn, ctx in zip(episode.turns, attempt.contexts):
            row, adv = hinted.rows[r], hinted.advantages[r]
            first = row.action_mask.index(1)
            prompt, actions = row.token_ids[:first], row.token_ids[first:]
            assert actions == turn.action_ids and row.seed == seeds[b] and row.group == b
            assert prompt == render_prompt(tok, user_message(ctx, cfg.agent), None) and hint not in tok.decode(prompt)  # un-hinted
            assert turn.prompt_ids == render_prompt(tok, user_message(ctx, cfg.agent, hint), None)  # the rollout saw the hint
            w = torch.exp(_logp(model, prompt, actions) - _logp(model, turn.prompt_ids, actions)).clamp(max=1.5)
            want = 0.5 * w * (episode.total_reward - baseline)
            assert torch.allclose(adv, want, atol=1e-5), (adv, want)
            assert torch.allclose(torch.tensor(row.sample_logprobs[first:]), _logp(model, prompt, actions), atol=1e-5)  # the un-hinted old log-probs
            nonzero += bool(adv.abs().sum() > 0)
            r += 1
    assert r == len(hinted.rows) and nonzero > 0


def _won(task, texts, success=True, seed=0):
    return Attempt("household", seed, 1, 0, success, task, [], [[1]] * len(texts), list(texts))


def test_win_hints_show_the_most_alike_own_win_by_hand():
    """hatch.hint = win reads the replay buffer: the win whose task line shares the most
    (BM25-weighted) words with the failed game's, the most recent among equal ones; failed
    attempts never; None where no win shares a word."""
    heat = _won("heat some apple and put it in fridge", ["go to microwave 1", "heat apple 1 with microwave 1"])
    cool_old = _won("cool some potato and put it in cabinet", ["go to fridge 1", "cool potato 1 with fridge 1"])
    cool_new = _won("cool some potato and put it in cabinet", ["take potato 1", "cool potato 1 with fridge 1"])
    lost = _won("cool some egg and put it in shelf", ["look"], success=False)  # the very same task line, but a failure
    buffer = [heat, cool_old, lost, cool_new]
    got = rsipo.win_hints(["cool some egg and put it in shelf", "heat some mug and put it in table", "examine the lamp"], buffer, True, 600)
    assert got == ["Actions that won a similar game (cool some potato and put it in cabinet): take potato 1, cool potato 1 with fridge 1",
                   "Actions that won a similar game (heat some apple and put it in fridge): go to microwave 1, heat apple 1 with microwave 1",
                   None]  # "examine" and "lamp" are in no won task line
    assert rsipo.win_hints(["cool some egg"], [lost], True, 600) == [None]  # no win in the buffer
    (clipped,) = rsipo.win_hints(["heat some mug"], [heat], True, 40)
    assert len(clipped) == 40 and clipped.endswith("...")
    assert rsipo.win_hints(["Add 2 and 3."], [_won("Add 4 and 5.", ["9"])], False, 600) == ["A reply that was right on a similar task (Add 4 and 5.): 9"]


def test_hatch_win_hints_reach_the_rerolls(tiny_policy, monkeypatch):
    """In hinted_rerolls, hatch.hint = win re-rolls each all-fail group with its own-win hint
    (from the buffer it is given), and a game no win resembles is not re-rolled."""
    cfg = _cfg(*CORRIDOR, "train.prompts_per_step=2", "train.group_size=2", "hatch.enabled=true", "hatch.hint=win", "hatch.rerolls=2",
               "skills.enabled=false", "teacher.source=none", "teacher.lam=0")
    pool = EnvPool(lambda: make_env("toy-corridor", max_steps=3))
    sampling, gen, seeds = SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0), [1, 2]
    played = rsipo.play(tiny_policy, pool, seeds, None, sampling, gen, None, cfg, True, 1)
    assert not played.success.any()
    task = played.attempts[0].task
    hints = []
    real = rsipo.rollout_episodes
    patch_rsipo(monkeypatch, "rollout_episodes", lambda *a, **k: hints.append(k.get("hints")) or real(*a, **k))
    none = rsipo.hinted_rerolls(tiny_policy, pool, played, seeds, None, SkillLibrary(":memory:"), sampling, gen, cfg, None, True, 0, buffer=[])
    assert none.episodes == 0 and none.metrics["hatch/hinted_groups"] == 0 and hints == []  # no win yet: nothing to show, nothing re-rolled
    win = _won(task, ["go east", "go east"], seed=99)
    hinted = rsipo.hinted_rerolls(tiny_policy, pool, played, seeds, None, SkillLibrary(":memory:"), sampling, gen, cfg, None, True, 0, buffer=[win])
    want = f"Actions that won a similar game ({task}): go east, go east"
    assert hints == [[want, want]] and hinted.episodes == 4 and hinted.metrics["hatch/hinted_groups"] == 2


@pytest.mark.parametrize("env", ["toy-digits", "toy-corridor"])
def test_effect_rewards_in_the_recipe_play_the_related_games_and_count_them(tmp_path, monkeypatch, env):
    """skills.effect_games: every valid candidate is played on M of the step's other games with
    the skill in its prompts; the episodes count in episodes/sampled and budget/episodes (they
    are not trained on); each candidate's logged reward is the mean of R - b over those games."""
    text = "Write digits only, one digit per item."
    patch_rsipo(monkeypatch, "parse_skill", _valid(text))
    plays, steps = [], []
    real_play, real_step = rsipo.hinted_episode_rewards, rsipo.play
    patch_rsipo(monkeypatch, "hinted_episode_rewards", lambda policy, pool, seeds, hints, *a: plays.append((seeds, hints, r := real_play(policy, pool, seeds, hints, *a)))
                        or r)
    patch_rsipo(monkeypatch, "play", lambda policy, pool, seeds, *a: steps.append((list(seeds), p := real_step(policy, pool, seeds, *a))) or p)
    B, G, K, M = 3, 2, 2, 2
    sets = [f"env.name={env}", "train.steps=2", f"train.prompts_per_step={B}", f"train.group_size={G}", f"skills.candidates={K}", "skills.write_per_group=1",
            f"skills.effect_games={M}", "skills.length_penalty=0"]
    if env == "toy-corridor":
        sets += ["env.kwargs={max_steps = 3}"]
    run = rsipo.train(_cfg(*sets), tmp_path / "effect", log=lambda *_: None)
    rows, logged = _train_rows(run), _rows(run, "skills")
    total = 0
    for step, (row, (seeds, hints, rewards), (games, played_step)) in enumerate(zip(rows, plays, steps), start=1):
        sources = int(row["skills/sources"])
        assert len(seeds) == sources * K * M == row["skills/effect_episodes"] and all(h == skill_hint([text]) for h in hints)
        assert row["episodes/sampled"] == B * G + sources * K * M
        total += row["episodes/sampled"]
        assert row["budget/episodes"] == total and row["episodes/rescored"] == 0  # nothing replayed: the effect replaces the replay
        without = dict(zip(games, played_step.rewards.mean(dim=1).tolist()))  # each game's mean reward this step, without the skill
        records = [r for r in logged if r["step"] == step]
        for s in range(sources):
            mine, played = seeds[s * K * M : (s + 1) * K * M], rewards[s * K * M : (s + 1) * K * M]
            source_seed = records[s * K]["source_seed"]
            assert source_seed not in mine and set(mine) <= set(games) and records[s * K]["effect_games"] == M
            for k in range(K):
                want = sum(r - without[g] for r, g in zip(played[k * M : (k + 1) * M], mine[k * M : (k + 1) * M])) / M
                assert records[s * K + k]["reward"] == pytest.approx(want, abs=1e-6)
    assert len(plays) == 2


def test_hatch_in_the_recipe_counts_the_rerolls_and_trains_them(tmp_path, monkeypatch):
    patch_rsipo(monkeypatch, "parse_skill", _valid("Write digits only, one digit per item."))
    seen = []
    real = rsipo.update
    patch_rsipo(monkeypatch, "update", lambda policy, opt, batch, *a, **k: seen.append(batch) or real(policy, opt, batch, *a, **k))
    B, G, k = 3, 2, 3
    cfg = _cfg("env.name=toy-digits", "train.steps=2", f"train.prompts_per_step={B}", f"train.group_size={G}", "hatch.enabled=true", "hatch.hint=reflection",
               f"hatch.rerolls={k}", "skills.enabled=false", "teacher.source=none", "teacher.lam=0")
    rows = _train_rows(rsipo.train(cfg, tmp_path / "hatch", log=lambda *_: None))
    assert [r["hatch/coef"] for r in rows] == [1.0, 0.5]  # linear annealing over train.steps
    total = 0
    for row, batch in zip(rows, seen):
        groups = row["route/all_fail"]
        assert row["hatch/groups"] == row["hatch/hinted_groups"] == groups  # every all-fail group, each with its reflection
        assert row["episodes/sampled"] == B * G + groups * k and row["hatch/episodes"] == groups * k
        total += row["episodes/sampled"]
        assert row["budget/episodes"] == total
        assert len(batch) == B * G + groups * k  # one row per completion, then the hinted rows
        assert (batch.advantages[B * G :].abs().sum() > 0) == (groups > 0)  # digit fractions differ: R - b != 0
    assert sum(r["hatch/groups"] for r in rows) > 0
    grpo_rows = _train_rows(grpo.train(load_config(None, [*FAST, *CORRIDOR, "train.steps=1", f"train.prompts_per_step={B}", f"train.group_size={G}"]),
                                       tmp_path / "grpo", log=lambda *_: None))
    assert grpo_rows[0]["episodes/sampled"] == B * G == grpo_rows[0]["budget/episodes"]


def test_max_episodes_caps_the_rerolls_and_ends_the_run_early(tmp_path, monkeypatch):
    """toy-parity: the groups of odd seeds all fail, so the re-rolls a step wants are known in
    advance. train.max_episodes re-rolls only as many groups as the cap has room for, and the
    run ends after the last step whose B x G episodes fit, with its checkpoint and the after
    evaluation; resuming the finished run trains nothing more."""
    patch_rsipo(monkeypatch, "parse_skill", _valid("Write digits only, one digit per item."))
    B, G, k, cap = 4, 2, 2, 30
    cfg = _cfg("env.name=toy-parity", "train.steps=6", f"train.prompts_per_step={B}", f"train.group_size={G}", "hatch.enabled=true",
               "hatch.hint=reflection", f"hatch.rerolls={k}", "skills.enabled=false", "teacher.source=none", "teacher.lam=0",
               f"train.max_episodes={cap}", "eval.n=4", "eval.batch_size=4", "eval.before=false")
    want, total = [], 0  # (sampled, capped groups) per step, by hand
    for step in range(6):
        if total + B * G > cap:
            break
        failing = sum(s % 2 == 1 for s in train_seeds(cfg, step))
        rerolled = min(failing, (cap - total - B * G) // k)
        total += B * G + k * rerolled
        want.append((B * G + k * rerolled, failing - rerolled))
    assert 1 < len(want) < 6 and any(c for _, c in want)  # the cap ends the run early, after capping some re-rolls
    run = rsipo.train(cfg, tmp_path / "capped", log=lambda *_: None)
    rows = _train_rows(run)
    assert [(r["episodes/sampled"], r["hatch/capped_groups"]) for r in rows] == want
    assert rows[-1]["budget/episodes"] == total <= cap
    last = len(want)
    assert (run / "checkpoints" / f"step_{last:06d}").is_dir() and (run / "eval" / "after.json").exists()
    assert [r["step"] for r in _rows(run) if "eval/success_rate" in r] == [last]  # the after evaluation, at the last step trained
    rsipo.train(cfg, run, resume=True, log=lambda *_: None)
    assert len(_train_rows(run)) == last


def test_max_episodes_in_grpo_and_its_rules(tmp_path):
    """GRPO samples B x G episodes a step: a cap of 20 with B x G = 8 trains 2 steps of 6."""
    sets = [*FAST, *CORRIDOR, "train.steps=6", "train.prompts_per_step=2", "train.group_size=4", "train.max_episodes=20", "eval.n=2", "eval.batch_size=2"]
    run = grpo.train(load_config(None, sets), tmp_path / "grpo", log=lambda *_: None)
    rows = _train_rows(run)
    assert [r["budget/episodes"] for r in rows] == [8, 16] and (run / "eval" / "after.json").exists()
    with pytest.raises(UserError, match="holds no training step"):
        load_config(None, [*FAST, *CORRIDOR, "train.prompts_per_step=2", "train.group_size=4", "train.max_episodes=7"])
    with pytest.raises(UserError, match="inside an RL phase"):
        load_config(None, [*FAST, *CORRIDOR, "train.steps=8", "rloop.enabled=true", "train.max_episodes=64"])
    with pytest.raises(UserError, match="skills.effect_games"):
        _cfg(*CORRIDOR, "skills.effect_games=2", "skills.replay_reward=true", "train.max_episodes=64")
    with pytest.raises(UserError, match="last gate round"):
        _cfg(*CORRIDOR, "skills.in_context=true", 'gate.mode="gate"', "gate.skills_every=2", "train.max_episodes=64")


@pytest.mark.parametrize("hint", ["reflection", "skill"])
def test_hatch_hints_written_or_retrieved_by_the_policy(tmp_path, monkeypatch, hint):
    patch_rsipo(monkeypatch, "parse_skill", _valid(GOOD_SKILL))
    prompts = []
    real = rsipo.rollout_episodes
    spy = lambda *a, **kw: prompts.append(kw.get("hints")) or real(*a, **kw)  # noqa: E731
    patch_rsipo(monkeypatch, "rollout_episodes", spy)  # the hinted re-rolls
    monkeypatch.setattr(recursa.distributed.local, "rollout_episodes", spy)  # the step's own rollout, through the rollout backend
    cfg = _cfg(*CORRIDOR, "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "hatch.enabled=true", f"hatch.hint={hint}", "skills.candidates=2",
               "skills.write_per_group=1")
    (row,) = _train_rows(rsipo.train(cfg, tmp_path / hint, log=lambda *_: None))
    assert row["hatch/hinted_groups"] == row["hatch/groups"] == 2 and row["hatch/episodes"] == 4
    want = f"Advice from an earlier failed attempt at this game: {GOOD_SKILL}" if hint == "reflection" else skill_hint([GOOD_SKILL])
    assert prompts == [None, [want, want]]  # the step's rollout without hints, the re-rolls with them


# ----------------------------------------------------------------------------- routing by pass rate


def test_routing_gates_the_teacher_and_replays_stored_wins(tmp_path, monkeypatch):
    """toy-parity: groups of even seeds all win, of odd seeds all fail. With route.mode =
    pass_rate the teacher's trust is 0 on all-win rows and 1 (fixed) on all-fail rows, and each
    all-win group adds win_episodes stored successes as a supervised term: win_coef x the token
    mean of -log pi over their actions."""
    seen = {}
    real_update, real_set = rsipo.update, rsipo.set_advantages
    patch_rsipo(monkeypatch, "update", lambda policy, opt, batch, cfg, gen, step, imitation=None, **kw: seen.update(batch=batch, imitation=imitation)
                        or real_update(policy, opt, batch, cfg, gen, step, imitation, **kw))
    patch_rsipo(monkeypatch, "set_advantages", lambda *a: seen.update(args=a) or real_set(*a))
    B = 6
    base = ["env.name=toy-parity", "train.steps=1", f"train.prompts_per_step={B}", "train.group_size=2", "teacher.source=reference", "skills.enabled=false",
            "trust.mode=fixed"]
    cfg = _cfg(*base, "route.mode=pass_rate", "route.win_coef=0.5", "route.win_episodes=1")
    parity = [s % 2 == 0 for s in train_seeds(cfg, 0)]
    assert 0 < sum(parity) < B  # both routes present at this seed
    (row,) = _train_rows(rsipo.train(cfg, tmp_path / "drift", log=lambda *_: None))
    assert (row["route/all_win"], row["route/all_fail"], row["route/mixed"]) == (sum(parity), B - sum(parity), 0)
    batch, imitation = seen["batch"], seen["imitation"]
    _, played, _, _, wins, taught, _ = seen["args"]
    assert taught.trust_rows.tolist() == [0.0 if won else 1.0 for won in played.success.reshape(-1).tolist()]
    n, w = len(played.rows), len(wins.rows)
    assert w == sum(parity) and row["route/win_rows"] == w and len(batch) == n + w
    assert imitation.coef == 0.5 and imitation.weights[:n].abs().sum() == 0 and (imitation.weights[n:] > 0).any()
    logp = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(0))  # any log-probs
    term = imitation_loss(logp, imitation.weights, batch.action_mask)
    want = -(logp[n:] * batch.action_mask[n:]).sum() / batch.action_mask[n:].sum()
    assert term.item() == pytest.approx(want.item(), rel=1e-5)  # a token mean over the win rows only
    off = _train_rows(rsipo.train(_cfg(*base), tmp_path / "off", log=lambda *_: None))[0]
    assert off["route/all_win"] == row["route/all_win"] and "route/win_rows" not in off
    assert seen["args"][5].trust_rows.tolist() == [1.0] * n  # routing off: the teacher on every row


# ----------------------------------------------------------------------------- the critical step


def _attempt(seed, success, steps, group=0):
    return Attempt("toy-corridor", seed, 1, group, success, "Reach room 3.", [Context("Reach room 3.", o) for o, _ in steps], [[1]] * len(steps),
                   [a for _, a in steps])


def test_critical_row_weights_by_hand():
    won = _attempt(5, True, [("room 0", "go east"), ("room 1", "go east"), ("room 2", "go east")])
    left = _attempt(5, False, [("room 0", "go east"), ("room 1", "wait"), ("room 1", "wait")])
    other = _attempt(6, False, [("room 0", "wait"), ("room 0", "wait")])  # no win of seed 6 anywhere
    cfg = _cfg("teacher.critical=from", "teacher.critical_before=0.1", "teacher.critical_unmatched=0.5")
    weights, metrics = rsipo.critical_row_weights([won, left, other], [won, left, other], cfg)
    assert weights == [1.0, 1.0, 1.0, 0.1, 1.0, 1.0, 0.5, 0.5]
    assert metrics["teacher/critical_matched_frac"] == 0.5 and metrics["teacher/critical_turn_mean"] == 1.0
    at = rsipo.critical_row_weights([left], [won], _cfg("teacher.critical=at"))[0]
    assert at == [0.0, 1.0, 0.0]


def test_critical_step_in_the_recipe(tmp_path):
    """Every random-model episode fails and no winner exists: every row gets the unmatched weight."""
    cfg = _cfg(*CORRIDOR, "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "teacher.source=reference", "skills.enabled=false",
               "trust.mode=fixed", "teacher.critical=from", "teacher.critical_unmatched=0.5")
    (row,) = _train_rows(rsipo.train(cfg, tmp_path / "critical", log=lambda *_: None))
    assert row["teacher/critical_matched_frac"] == 0.0 and row["teacher/trust_applied_mean"] == 0.5


# ----------------------------------------------------------------------------- contrastive writing and the curator


def test_choose_contrasts_pairs_a_success_with_a_failure():
    def att(ok):
        return Attempt("e", 0, 1, 0, ok, "t", [Context(None, "o")], [[1]], ["r"])

    attempts = [att(x) for x in (False, True, False, True, False, False, False, False)]  # groups of 4: mixed, all-fail
    sources, partners = rsipo.choose_contrasts(attempts, 2, 4, 2, torch.Generator().manual_seed(0))
    assert len(sources) == 3 and not attempts[sources[0]].success and attempts[partners[0]].success and sources[0] < 4 and partners[0] < 4
    assert partners[1:] == [None, None] and all(4 <= j < 8 for j in sources[1:])


def test_skills_from_wins_only():
    """skills.sources = "wins": only successes are sources; a group that never won writes
    nothing, in plain and in contrastive writing (where a mixed group keeps its pair)."""
    def att(ok):
        return Attempt("e", 0, 1, 0, ok, "t", [Context(None, "o")], [[1]], ["r"])

    attempts = [att(x) for x in (False, True, False, True, False, False, False, False, True, True, True, True)]  # mixed, all-fail, all-win
    picked = rsipo.choose_sources(attempts, 3, 4, 2, torch.Generator().manual_seed(0), wins_only=True)
    assert sorted(picked[:2]) == [1, 3] and len(picked) == 4 and all(8 <= j < 12 for j in picked[2:])
    both = rsipo.choose_sources(attempts, 3, 4, 2, torch.Generator().manual_seed(0))
    assert len(both) == 6 and sum(4 <= j < 8 for j in both) == 2  # the default still writes from the all-fail group
    sources, partners = rsipo.choose_contrasts(attempts, 3, 4, 1, torch.Generator().manual_seed(0), wins_only=True)
    assert len(sources) == 2 and not attempts[sources[0]].success and partners[0] in (1, 3)  # the mixed group's pair
    assert sources[1] >= 8 and partners[1] is None  # the all-win group; the all-fail group wrote nothing
    assert rsipo.choose_sources([att(False)] * 4, 1, 4, 2, torch.Generator(), wins_only=True) == []


def test_skills_from_wins_only_in_the_recipe(tmp_path):
    """skills.sources = "wins" end to end on toy-parity (even seeds' groups all win, odd
    seeds' all fail): every candidate is written from a success, write_per_group sources per
    all-win group and none from the all-fail groups; the run finishes."""
    cfg = _cfg("env.name=toy-parity", "train.steps=2", "train.prompts_per_step=4", "train.group_size=2", "skills.sources=wins", "skills.candidates=2",
               "skills.write_per_group=1", "sampling.max_new_tokens=6")
    run = rsipo.train(cfg, tmp_path / "wins", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"skills/sources"' in line]
    assert len(rows) == 2 and all(r["skills/sources"] == r["route/all_win"] for r in rows)
    assert sum(r["route/all_fail"] for r in rows) > 0 and sum(r["route/all_win"] for r in rows) > 0  # both kinds of group occurred
    records = [json.loads(line) for line in (run / "skills.jsonl").read_text().splitlines()]
    assert len(records) == 2 * sum(r["skills/sources"] for r in rows) and all(r["source_success"] for r in records)


def test_contrastive_writing_in_the_recipe(tmp_path, monkeypatch):
    text = "When the item is odd, reply short, not long."
    patch_rsipo(monkeypatch, "parse_skill", _valid(text))
    prompts, real = [], rsipo.generate
    patch_rsipo(monkeypatch, "generate", lambda model, tok, ps, *a, **k: prompts.extend(tok.decode(p) for p in ps) or real(model, tok, ps, *a, **k))
    sources, real_trials = [], rsipo.agreement_trials
    patch_rsipo(monkeypatch, "agreement_trials", lambda g, d, o, is_source, t: sources.append(is_source) or real_trials(g, d, o, is_source, t))
    cfg = _cfg("env.name=toy-coin", "train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "skills.contrastive=true", "skills.candidates=2",
               "sampling.max_new_tokens=6", "skills.write_per_group=1")
    run = rsipo.train(cfg, tmp_path / "contrast", log=lambda *_: None)
    (row,) = _train_rows(run)
    mixed = int(row["route/mixed"])
    assert mixed > 0 and row["skills/contrastive_sources"] == mixed and row["skills/rule_form_frac"] == 1.0
    writing = [p for p in prompts if "Write one rule" in p]
    assert sum("SUCCESSFUL ATTEMPT" in p and "FAILED ATTEMPT" in p for p in writing) == mixed
    assert sum(r.get("contrast", False) for r in _rows(run, "skills")) == 2 * mixed
    (skill,) = SkillLibrary(run / "ledger.sqlite").active()
    assert (skill.source_outcome == "contrast") == bool(_rows(run, "skills")[0].get("contrast"))  # one text: the first admission's provenance
    last = _rows(run, "skills")[-1]  # the source the skill's id points to last: its trials skip it, and its partner when contrastive
    assert sum(sources[0]) == (2 if last.get("contrast") else 1)


def test_curator_rejects_single_actions_in_the_recipe(tmp_path, monkeypatch):
    patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: ParsedSkill("Go east." if len(reply) % 2 else GOOD_SKILL, True, "ok", 3, 0))
    cfg = _cfg(*CORRIDOR, "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "skills.curate=true", "skills.candidates=4")
    run = rsipo.train(cfg, tmp_path / "curate", log=lambda *_: None)
    (row,) = _train_rows(run)
    assert row["skills/invalid/curator_single_action"] > 0 and row["skills/valid"] > 0
    assert [s.text for s in SkillLibrary(run / "ledger.sqlite").active()] == [GOOD_SKILL]
    assert all(r["reward"] == -1.0 for r in _rows(run, "skills") if r["reason"] == "curator_single_action")  # the writer learns they are invalid


def test_curator_merges_near_duplicates_and_retires_useless_skills():
    cfg = _cfg("env.name=toy-corridor", "skills.curate=true", "skills.merge_threshold=0.5", "skills.retire_grace_steps=2", "skills.retire_min_trials=4")
    lib = SkillLibrary(":memory:")
    src = Attempt("toy-corridor", 3, 1, 0, False, "t", [Context("t", "o")], [[1]], ["wait"])
    first, how = rsipo.admit(lib, "Open the drawer before taking the key.", 0.1, src, "failure", cfg, 1)
    assert how == "added"
    assert rsipo.admit(lib, "open the drawer, then take the key", 0.05, src, "failure", cfg, 2) == (None, "dropped")  # lower reward: dropped
    merged, how = rsipo.admit(lib, "open the drawer, then take the key", 0.3, src, "failure", cfg, 2)
    assert how == "merged" and merged != first
    (active,) = lib.active()
    assert active.id == merged and active.parent_id == first and active.version == 2
    other, _ = rsipo.admit(lib, "Always read the map first when lost.", -0.2, src, "failure", cfg, 2)
    assert {s.id for s in lib.active()} == {merged, other}
    assert rsipo.retire_useless(lib, cfg, 3) == 0  # one step old: not measured yet
    assert rsipo.retire_useless(lib, cfg, 4) == 1 and [s.id for s in lib.active()] == [merged]  # replay reward -0.2 <= 0
    lib.record_trust(merged, 2.0, 5.0)  # agreement 2/5: 2 a/n - 1 < 0
    assert rsipo.retire_useless(lib, cfg, 5) == 1 and not lib.active()


# ----------------------------------------------------------------------------- skills at test time


def test_eval_both_records_the_library_effect(tmp_path, monkeypatch):
    text = "Write digits only, one digit per item."
    patch_rsipo(monkeypatch, "parse_skill", _valid(text))
    from recursa.recipes import common

    hints, real = [], common.evaluate
    monkeypatch.setattr(common, "evaluate", lambda *a, **k: hints.append(k["hints"]) or real(*a, **k))
    sets = ["env.name=toy-digits", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "skills.write_per_group=1", "skills.candidates=2",
            "eval.n=4", "eval.before=false", "skills.eval_both=true"]
    run = rsipo.train(_cfg(*sets), tmp_path / "plain", log=lambda *_: None)
    assert hints == [None, [skill_hint([text])] * 4]
    assert (run / "eval" / "after.json").exists() and json.loads((run / "eval" / "after_skills.json").read_text())["n"] == 4
    evals = [r for r in _rows(run) if "eval_skills/success_rate" in r or "eval/success_rate" in r]
    assert [("eval/success_rate" in r, "eval_skills/success_rate" in r) for r in evals] == [(True, False), (False, True)]
    hints.clear()
    run = rsipo.train(_cfg(*sets, "skills.in_context=true"), tmp_path / "in_context", log=lambda *_: None)
    assert hints == [[skill_hint([text])] * 4, None] and (run / "eval" / "after_no_skills.json").exists()


def test_cli_eval_with_a_runs_skills(tmp_path, monkeypatch, capsys):
    from recursa import evaluate as evaluate_module
    from recursa.cli import main

    text = "Write digits only, one digit per item."
    patch_rsipo(monkeypatch, "parse_skill", _valid(text))
    run = rsipo.train(_cfg("env.name=toy-digits", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "skills.write_per_group=1",
                           "skills.candidates=2"), tmp_path / "run", log=lambda *_: None)
    hints, real = [], evaluate_module.evaluate
    monkeypatch.setattr(evaluate_module, "evaluate", lambda *a, **k: hints.append(k.get("hints")) or real(*a, **k))
    out = tmp_path / "with.json"
    assert main(["eval", "--run", str(run), "--n", "3", "--skills", "on", "--json", str(out)]) == 0
    assert main(["eval", "--run", str(run), "--n", "3"]) == 0
    assert main(["eval", "--run", str(run), "--n", "3", "--skills", str(run), "--set", "run.threads=1"]) == 0
    assert hints == [[skill_hint([text])] * 3, None, [skill_hint([text])] * 3]
    assert json.loads(out.read_text())["label"] == "step_000001+skills" and "3 of 3 items shown one" in capsys.readouterr().out
    assert main(["eval", "--config", str(run / "config.toml"), "--n", "2", "--skills", "on"]) == 2  # no run to read a library from
    g = grpo.train(load_config(None, [*FAST, "env.name=toy-digits", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2"]), tmp_path / "g",
                   log=lambda *_: None)
    assert main(["eval", "--run", str(run), "--n", "2", "--skills", str(g)]) == 2  # a grpo run has no library
    assert "only rsipo runs keep a skill library" in capsys.readouterr().err


# ----------------------------------------------------------------------------- resume and config


def test_resume_with_every_signal_on(tmp_path, monkeypatch):
    """Crash in step 3's update, resume from the step-2 checkpoint: metrics (the sampled-episode
    count included), skills, replay, library and state equal those of an uninterrupted run."""
    patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: ParsedSkill(f"When in room {len(reply) % 3}, go east, not west.", True, "ok", 8, 0))
    cfg = _cfg("env.name=toy-coin", "sampling.max_new_tokens=6", "train.steps=3", "train.prompts_per_step=2", "train.group_size=4", "skills.candidates=2",
               "skills.write_per_group=1", "run.checkpoint_every=2", "trust.prior_mean=0.75", "hatch.enabled=true", "route.mode=pass_rate",
               "teacher.critical=from", "skills.contrastive=true", "skills.curate=true", "skills.retire_grace_steps=1")
    straight = rsipo.train(cfg, tmp_path / "straight", log=lambda *_: None)
    broken = tmp_path / "broken"
    kill_in_update(monkeypatch, cfg, broken)
    rsipo.train(cfg, broken, resume=True, log=lambda *_: None)
    a, b = _train_rows(straight), _train_rows(broken)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        x, y = ({k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in (x, y))
        assert x.keys() == y.keys() and all(x[k] == y[k] or (x[k] != x[k] and y[k] != y[k]) for k in x)
    assert sum(r["episodes/sampled"] for r in a) == a[-1]["budget/episodes"] >= 3 * 8
    for name in ("skills", "replay", "samples"):
        assert _rows(straight, name) == _rows(broken, name), name
    assert json.loads((straight / "checkpoints" / "step_000003" / "state.json").read_text()) == json.loads((broken / "checkpoints" / "step_000003" / "state.json").read_text())


def test_config_checks_of_the_signal_switches():
    with pytest.raises(UserError, match="hatch.hint = 'skill'"):
        _cfg("hatch.enabled=true", "hatch.hint=skill", "skills.in_context=true")
    with pytest.raises(UserError, match="hatch.hint = 'skill'"):
        _cfg("hatch.enabled=true", "hatch.hint=skill", "skills.enabled=false", "teacher.source=reference")
    with pytest.raises(UserError, match="teacher.critical"):
        _cfg("teacher.critical=from", "teacher.source=none", "teacher.lam=0")
    with pytest.raises(UserError, match="skills.contrastive"):
        _cfg("skills.contrastive=true", "skills.enabled=false", "teacher.source=reference")
    with pytest.raises(UserError, match="look at the test split"):
        _cfg("skills.eval_both=true", "gate.mode=log", "eval.n=4", "gate.max_test_looks=1")
    with pytest.raises(UserError, match="hatch.hint"):
        _cfg("hatch.hint=walkthrough")  # the oracle is labelled as such
    with pytest.raises(UserError, match="skills.replay_reward = false rewards none"):
        _cfg("skills.effect_games=1", "skills.replay_reward=false")
    with pytest.raises(UserError, match="teacher.mode"):
        _cfg("teacher.mode=kl")


def test_help_config_lists_the_new_switches(capsys):
    from recursa.cli import main

    assert main(["train", "--help-config", "--recipe", "rsipo"]) == 0
    out = capsys.readouterr().out
    for key in ("hatch.enabled", "hatch.hint", "hatch.rerolls", "hatch.anneal", "hatch.is_cap", "route.mode", "route.win_coef", "teacher.critical",
                "skills.contrastive", "skills.curate", "skills.merge_threshold", "skills.eval_both", "skills.effect_games", "teacher.divergence", "teacher.topk"):
        line = next(line for line in out.splitlines() if line.startswith(key + " "))
        assert len(line.split("#", 1)[1].strip()) > 20, key  # described
