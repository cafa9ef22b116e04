"""The RSIPO recipe (recursive self-improving policy optimization), written out.

    for step in range(steps):
        seeds      <- B training seeds (as GRPO; [curriculum] arms drawn by learning progress or a schedule)
        [in context <- skills.in_context: per task, the library's best skill, shown to the policy in its own
                      prompts (after the task line / the question, where the teacher's hint goes)]
        rollout    -> B x G attempts: single-turn completions, or multi-turn episodes (one row per turn),
                      in this process or on Ray workers (`distributed`, recursa/distributed/)
        outcome    <- A_outcome from rewards (B, G)                       (+ GiGPO's step term, games)
        buffer     <- this step's attempts join the replay buffer (replay.jsonl, for resume)
        routes     <- each group is all_fail, mixed or all_win (route/* metrics; [route] acts on them)
        write      <- per group up to `skills.write_per_group` attempts (a success and a failure, where
                      present, or with skills.sources = "wins" successes only; with skills.contrastive one
                      success/failure pair, shown together) are shown to the
                      policy, which samples K candidate skills for each in one batched generate call; parse_skill
                      drops malformed ones (counted, never fatal), and with skills.curate so does the curator
                      (single actions of the episode, fragments)
        replay     <- r(s) = mean_tau' y(tau') clip(D(s, tau'), -c, c) over M replayed attempts of other
                      seeds, D = mean over tau''s action tokens of log pi_old(a | ctx + s) - log pi_old(a | ctx);
                      length / invalid penalties; normalised within the K candidates -> the advantage of
                      the writing tokens (x skills.coef); the best candidate enters the library (skills.curate:
                      a near-duplicate replaces its skill only with a higher reward; useless skills retire)
        [prompt round <- gate.prompt_every: the policy reads its recent failures and proposes a revised
                      prompt (the games' instruction, or the system prompt), gated like weights as in
                      GRPO (recipes/gating.py PromptGate; with skills.in_context, scored with the skills shown)]
        [skills gate <- gate.skills_every: the library with this round's new skills vs the incumbent library,
                      both in context, on gate probes half failed / half solved by the incumbent
                      (recipes/gating.py SkillGate); a rejection restores the incumbent library]
        [hatch     <- hatch.enabled: k hinted episodes of each all-fail game, trained under the un-hinted
                      prompt with coef(step) x truncated importance weight x (R - group mean)]
        [wins      <- route.mode = pass_rate: stored winning episodes, a supervised term per all-win group]
        retrieve   <- per task (group): the library's best skill, BM25 over task text + first observation
        teacher    <- Delta_t = log pi_old(a_t | ctx + hint) - log pi_old(a_t | ctx) on every row with a hint
                      (the hint: a skill | the walkthrough or reference answer | a successful sibling)
        trust      <- T_g of each skill group from the agreement trials of earlier steps; this step's trials
                      (sign of mean Delta vs sign of A_outcome) then update the decayed counts; T_g is then
                      gated per route ([route]) and weighted by the critical step (teacher.critical)
        advantages <- A_t = A_outcome + lam T_g psi(Delta_t)        (or SEED-like imitation weights, or
                      the full-distribution term: the hinted teacher's top-k next-token distribution)
        update     <- grpo.update on one batch: PPO-clip on the action tokens, the writing tokens and the
                      hinted rows, each part averaged over its own tokens; imitation terms (SEED-like, wins);
                      the distribution term lam T_g D_t (SDPO / OPSD)
        evaluate, gate, checkpoint (with the trust state and a snapshot of the skill library)

`train` is that loop; each phase is a function below (`play`, `learn_skills`, `hinted_rerolls`,
`win_rows`, `teach`, `set_advantages`, `distillation_term`), and the math they call is in recursa/algorithms/ (distill,
trust, hinted, routing) and recursa/skills/ (writing, retrieval, curator).

Every random draw of step k comes from the generator seeded by (train.seed, k); the library and
the trust counts are restored from the checkpoint and the replay buffer from replay.jsonl, so a
resumed run replays what an uninterrupted run would have done.

Where this departs from the spec's letter, and why:
* Trust is predictive: the T_g used at step k comes from the trials of steps < k, so a skill has
  the cold-start trust (0 by default) in its first step, and a step's Delta never vouches for itself.
* The replay buffer holds this step's attempts too (other seeds only are replayed), so skills
  written at step 1 already have evidence.
* A skill is retrieved per task (once per group, shared by its G attempts and all their turns),
  so an attempt's trials and trust refer to one skill: the top-ranked one when retrieve_k > 1.
* Both log-probs of Delta are recomputed at the rollout's weights by the update's log-prob
  function, not taken from the sampler, so Delta is exactly 0 when the hint is empty.
* With skills.in_context the policy acted on its prompt with a skill in it; Delta still
  compares the context with the teacher's hint to the bare context (never a context with
  two hints), so for a skill teacher the teacher side is exactly the row's own prompt and
  the student side is the prompt re-rendered without the skill; a replayed attempt is
  likewise scored with the candidate skill vs with no skill, whatever it was shown.
* `teacher.center = "group"` (off by default, as the spec writes Delta raw) takes each attempt's
  Delta relative to the mean over its group's hinted attempts before the trust trials, psi and
  the imitation gate. On twx:twc the walkthrough teacher's raw Delta was negative on average in
  every step (a hint lowers every action's log-prob) while often ranking a group's attempts as
  the outcome did; the raw sign test agreed in 66% of trials and the applied trust averaged 0.10.
  Centred, the applied trust doubled (0.21) with no held-out difference (docs/rsipo.md).
* The update aggregates the action rows, the writing rows and the hinted rows in one call; their
  advantages are rescaled (`losses.part_scales`) so that the loss is L_policy + coef * L_writing +
  L_hinted, each averaged over its own tokens, and no part dilutes another's gradient.
* Hinted re-rolls (hatch) are trained under the un-hinted prompt the policy would have seen (with
  skills.in_context, the one with its in-context skill; the hatch hint replaces it while sampling).
  They are extra sampled episodes: `episodes/sampled` and `budget/episodes` count them. They do
  not join the replay buffer (whose attempts are what the policy played unaided). So do the
  episodes that try candidate skills on related games (skills.effect_games), which are not
  trained on at all: they only reward the candidates.
* The critical step (teacher.critical) weights the teacher's trust on each turn of a failed episode;
  single-turn tasks have one turn, so it changes nothing there.

Devices: rewards, outcome advantages, successes and the skills' replay rewards are host
statistics (built from Python values); the teacher's log-probs, Delta, trust per row and the
token advantages live on the policy's device with the batch, and the host statistics are moved
there explicitly where they join them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from recursa.agent import AgentConfig, clip_hint as _clip, render_turn, win_hint
from recursa.algorithms.advantages import compute_advantages
from recursa.algorithms.distill import (
    correlation,
    group_normalise,
    group_offsets,
    pass_rate_weights,
    penalised,
    psi,
    seed_imitation_weights,
    skill_effect,
    skill_rewards,
    teacher_shift,
    token_advantages,
)
from recursa.algorithms.hinted import all_failed, anneal, hinted_token_advantages, truncated_importance_weights
from recursa.algorithms.losses import part_scales
from recursa.algorithms.routing import ALL_WIN, critical_weights, divergence_turn, group_routes, route_counts, route_gate
from recursa.algorithms.trust import TrustEstimator, agreement_trials
from recursa.anchor import check_anchor, make_anchor
from recursa.config import RSIPOConfig
from recursa.curriculum import Curriculum, check_curriculum
from recursa.engines import make_engine
from recursa.envs import EnvPool, system_prompt_of
from recursa.generation import GenerationStats, SamplingParams, generate, sequence_logprobs, shared_prefix_logprobs
from recursa.models import Policy
from recursa.distributed.rollouts import LocalRollouts, RolloutBackend, make_rollouts
from recursa.recipes.common import Progress, budget_left, check_finite, ends_run, eval_before, mid_eval, mid_eval_due, mid_eval_missing, open_run, run_eval, step_generator
from recursa.recipes.gating import PromptGate, SkillGate, WeightsGate
from recursa.rewards import RewardSet, score_episodes, score_trajectories
from recursa.recipes.grpo import Distillation, Imitation, UpdateStats, episode_rows, train_seeds, update, update_metrics
from recursa.rollout import render_prompt, rollout, rollout_episodes, with_hint
from recursa.skills import (
    BM25Index,
    SkillLibrary,
    SkillWritingStats,
    contrastive_writing_prompt,
    parse_skill,
    related,
    render_trajectory_for_skill,
    retrieve,
    retrieve_many,
    skill_writing_prompt,
)
from recursa.skills.curator import junk_reason, near_duplicate, retire_reason, rule_form, single_action
from recursa.skills.writing import MARKER, ParsedSkill
from recursa.trajectory import Trajectory, collate

# ----------------------------------------------------------------------------- attempts and contexts


@dataclass
class Context:
    """What one turn's user message was rendered from, so it can be rendered again with a hint."""

    task: str | None  # a game's task line; None for single-turn tasks (the message is the observation)
    observation: str
    admissible: list[str] | None = None
    history: list[tuple[str, str]] = field(default_factory=list)  # the (observation, action) pairs shown
    hint: str | None = None  # the skill hint the policy itself was shown (skills.in_context), None otherwise


def user_message(ctx: Context, agent: AgentConfig, hint: str | None = None) -> str:
    """The turn's user message with `hint` after the task line (games) or after the question,
    and no other hint: `user_message(ctx, agent, ctx.hint)` is the message the policy acted
    on, `user_message(ctx, agent)` the bare one."""
    if ctx.task is None:
        return with_hint(ctx.observation, hint)
    return render_turn(ctx.task, ctx.observation, ctx.admissible, ctx.history, agent, hint=hint)


@dataclass
class Attempt:
    """One trajectory of a step (a completion or a whole episode), as the teacher, the skill
    writer and the replay buffer see it. Its rows are its turns, in order."""

    env: str
    seed: int
    step: int  # completed-step number of the step that played it (1 = the first)
    group: int
    success: bool
    task: str  # a game's task line, or the single-turn prompt
    contexts: list[Context]
    actions: list[list[int]]  # sampled token ids per turn
    texts: list[str]  # per turn: the action sent to the game, or the reply

    def to_json(self) -> dict:
        d = asdict(self)
        for c in d["contexts"]:  # no hint key without skills.in_context: replay.jsonl as before the option
            if c["hint"] is None:
                del c["hint"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Attempt":
        contexts = [Context(c["task"], c["observation"], c["admissible"], [tuple(h) for h in c["history"]], c.get("hint")) for c in d["contexts"]]
        return cls(d["env"], d["seed"], d["step"], d["group"], d["success"], d["task"], contexts, d["actions"], d["texts"])


def episode_attempts(episodes, step: int, agent: AgentConfig, hints: list[str | None] | None = None) -> list[Attempt]:
    """One attempt per episode; `hints[g]`: the hint shown to group g's episodes (in_context)."""
    out = []
    for e in episodes:
        keep = agent.history_turns
        hint = hints[e.group] if hints is not None else None
        contexts = [
            Context(e.task, t.observation, t.admissible, [(u.observation, u.action) for u in e.turns[max(0, k - keep) : k]] if keep else [], hint)
            for k, t in enumerate(e.turns)
        ]
        out.append(Attempt(e.env, e.seed, step, e.group, e.won, e.task, contexts, [t.action_ids for t in e.turns], [t.action for t in e.turns]))
    return out


def failure_of(a: Attempt) -> tuple[str, str]:
    """A failed attempt as the prompt gate's proposals read it (as GRPO's): a game's task and
    last observation with its last three actions, or a single-turn prompt with its reply."""
    if a.contexts[-1].task is None:
        return a.task, a.texts[-1]
    return f"{a.task} {a.contexts[-1].observation}", " | ".join(a.texts[-3:])


def completion_attempts(trajs: list[Trajectory], step: int, hints: list[str | None] | None = None) -> list[Attempt]:
    """One attempt per completion; `hints[g]`: the hint shown to group g (in_context)."""
    out = []
    for t in trajs:
        first = t.action_mask.index(1)
        ctx = Context(None, t.prompt_text, hint=hints[t.group] if hints is not None else None)
        out.append(Attempt(t.env, t.seed, step, t.group, t.success, t.prompt_text, [ctx], [t.token_ids[first:]], [t.completion_text]))
    return out


# ----------------------------------------------------------------------------- scoring


@torch.no_grad()
def score_actions(policy: Policy, pairs: list[tuple[list[int], list[int]]], cfg: RSIPOConfig, topk: int = 0):
    """log pi(a_t | prompt, a_<t) of every (prompt_ids, action_ids) pair under the current
    weights, no gradient: one (len(action_ids),) tensor per pair. Micro-batched, pairs with
    equal prompts side by side (so the shared-prefix path computes each prompt once). With
    `topk = k` also the k most likely tokens at each action position: (scores, tops), tops[i]
    = (ids, log-probs), each (len(action_ids), k)."""
    model = policy.causal_lm
    was_training = model.training
    model.eval()
    logprobs = shared_prefix_logprobs if cfg.train.shared_prefix else sequence_logprobs
    pad = policy.tokenizer.pad_token_id
    device, host = policy.device, torch.device("cpu")
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
    out: list[torch.Tensor] = [torch.zeros(0, device=device)] * len(pairs)
    tops: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.zeros((0, topk), dtype=torch.long, device=device), torch.zeros((0, topk), device=device))] * len(pairs)
    for lo in range(0, len(order), cfg.train.micro_batch_size):
        idx = order[lo : lo + cfg.train.micro_batch_size]
        width = max(len(pairs[i][0]) + len(pairs[i][1]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long, device=host)  # padded on the host, moved once
        attn = torch.zeros((len(idx), width), dtype=torch.long, device=host)
        act = torch.zeros((len(idx), width), dtype=torch.float32, device=host)
        for j, i in enumerate(idx):
            p, a = pairs[i]
            ids[j, : len(p) + len(a)] = torch.tensor(p + a, dtype=torch.long, device=host)
            attn[j, : len(p) + len(a)] = 1
            act[j, len(p) : len(p) + len(a)] = 1
        ids, attn, act = ids.to(device), attn.to(device), act.to(device)
        logp, _, *top = logprobs(model, ids, attn, act, cfg.sampling.temperature, cfg.train.logit_chunk, topk=topk)  # (n, width) [, ((n, width, k),) * 2]
        for j, i in enumerate(idx):
            p, a = pairs[i]
            out[i] = logp[j, len(p) : len(p) + len(a)].clone()
            if topk:
                tops[i] = (top[0][0][j, len(p) : len(p) + len(a)].clone(), top[0][1][j, len(p) : len(p) + len(a)].clone())
    if was_training:
        model.train()
    return (out, tops) if topk else out


def teacher_logprobs(policy: Policy, rows: list[Trajectory], contexts: list[Context], hints: list[str | None], cfg: RSIPOConfig, system: str | None,
                     topk: int = 0):
    """(teacher, student) log-probs of every row's action tokens, at the current weights, no
    gradient: log pi(a_t | context + hint) and log pi(a_t | context), zeros where the hint is
    None; with `topk = k` a third list, the teacher's k most likely tokens at each action
    position, (ids, log-probs) of shape (actions, k) per row (zeros where the hint is None).
    The student context is the row's own prompt ids; the teacher's is the same user
    message rendered again with the hint inserted, through the same chat template; the action
    ids are the row's, untouched. A row whose policy saw a skill in context (ctx.hint) has the
    bare message re-rendered as its student context, so Delta is always hint vs no hint (and
    a skill teacher with that same skill scores exactly the row's prompt)."""
    tok = policy.tokenizer
    pairs, which = [], []
    for i, (row, ctx, hint) in enumerate(zip(rows, contexts, hints)):
        if hint is None:
            continue
        first = row.action_mask.index(1)
        actions = row.token_ids[first:]
        pairs.append((row.token_ids[:first] if ctx.hint is None else render_prompt(tok, user_message(ctx, cfg.agent), system), actions))
        pairs.append((render_prompt(tok, user_message(ctx, cfg.agent, hint), system), actions))
        which.append(i)
    scores, tops = score_actions(policy, pairs, cfg, topk) if topk else (score_actions(policy, pairs, cfg), None)
    teacher = [torch.zeros(r.num_action_tokens, device=policy.device) for r in rows]
    student = [torch.zeros(r.num_action_tokens, device=policy.device) for r in rows]
    top = [(torch.zeros((r.num_action_tokens, topk), dtype=torch.long, device=policy.device), torch.zeros((r.num_action_tokens, topk), device=policy.device))
           for r in rows] if topk else None
    for k, i in enumerate(which):
        student[i], teacher[i] = scores[2 * k], scores[2 * k + 1]
        if topk:
            top[i] = tops[2 * k + 1]
    return (teacher, student, top) if topk else (teacher, student)


# ----------------------------------------------------------------------------- skills


def skill_hint(texts: list[str]) -> str:
    if len(texts) == 1:
        return f"Useful skill from earlier attempts: {texts[0]}"
    return "Useful skills from earlier attempts:\n" + "\n".join(f"- {t}" for t in texts)


def alternate(candidates: list[int], success: list[bool], n: int, gen: torch.Generator) -> list[int]:
    """Up to n of `candidates`, alternately a success and a failure, each drawn at random,
    continuing with the other kind when one runs out."""
    order = torch.randperm(len(candidates), generator=gen, device="cpu").tolist()
    wins = [candidates[k] for k in order if success[k]]
    losses = [candidates[k] for k in order if not success[k]]
    picked: list[int] = []
    while len(picked) < n and (wins or losses):
        first, second = (wins, losses) if len(picked) % 2 == 0 else (losses, wins)
        picked.append((first or second).pop(0))
    return picked


def choose_sources(attempts: list[Attempt], groups: int, size: int, per_group: int, gen: torch.Generator, wins_only: bool = False) -> list[int]:
    """Attempt indices that get skills written: per group up to `per_group`, a success and a
    failure where present (`alternate`); with `wins_only` (skills.sources = "wins") only
    successes, so a group that never won writes nothing."""
    chosen = []
    for b in range(groups):
        members = [i for i in range(b * size, (b + 1) * size) if attempts[i].success or not wins_only]
        chosen.extend(alternate(members, [attempts[i].success for i in members], per_group, gen))
    return chosen


def choose_contrasts(attempts: list[Attempt], groups: int, size: int, per_group: int, gen: torch.Generator,
                     wins_only: bool = False) -> tuple[list[int], list[int | None]]:
    """skills.contrastive: per group with a success and a failure, one pair (the failure is the
    source, the success its partner); per other group, up to `per_group` single attempts as
    `choose_sources` picks them (with `wins_only`, an all-fail group writes nothing).
    Returns (sources, partners), partner None for a single."""
    sources, partners = [], []
    for b in range(groups):
        members = list(range(b * size, (b + 1) * size))
        outcomes = [attempts[i].success for i in members]
        if any(outcomes) and not all(outcomes):
            win, loss = alternate(members, outcomes, 2, gen)  # a success first, then a failure
            sources.append(loss)
            partners.append(win)
        elif not (wins_only and not any(outcomes)):
            picked = alternate(members, outcomes, per_group, gen)
            sources.extend(picked)
            partners.extend([None] * len(picked))
    return sources, partners


@dataclass
class Writing:
    """The K candidate skills written for each source attempt (candidate k of source j at j*K + k)."""

    sources: list[int]
    prompts: list[list[int]]  # per source: the writing prompt ids (with the prefill)
    samples: list  # generation.Sample, K per source
    parsed: list[ParsedSkill]
    partners: list[int | None] = field(default_factory=list)  # per source: the success shown beside it (skills.contrastive), or None


def attempt_text(a: Attempt, chars: int) -> str:
    """An attempt as the skill writer (or the reflection writer) reads it."""
    steps = [(c.observation, t) for c, t in zip(a.contexts, a.texts)] if a.contexts[0].task is not None else [("(the task above)", a.texts[0])]
    return render_trajectory_for_skill(a.task, steps, a.success, chars)


def episode_actions(a: Attempt) -> list[str]:
    """The actions an attempt took and was offered (a single-turn attempt: its reply): what a
    skill that only restates one action would repeat (`curator.single_action`)."""
    offered = [x for c in a.contexts for x in (c.admissible or [])]
    return [*a.texts, *offered]


def curated(p: ParsedSkill, actions: list[str]) -> ParsedSkill:
    """skills.curate: a valid candidate that restates one action or is a junk fragment
    becomes invalid, with the curator's reason."""
    if not p.valid:
        return p
    reason = "single_action" if single_action(p.text, actions) else junk_reason(p.text)
    return ParsedSkill(None, False, f"curator_{reason}") if reason else p


def write_skills(policy: Policy, attempts: list[Attempt], sources: list[int], cfg: RSIPOConfig, system: str | None, gen: torch.Generator, stats: SkillWritingStats,
                 partners: list[int | None] | None = None) -> Writing:
    """The policy reads each source attempt and its outcome (with skills.contrastive, a
    failure beside a success of the same game) and samples K candidate skills (one batched
    generate call, n = K); every reply is parsed (and curated), malformed ones counted."""
    sc, tok = cfg.skills, policy.tokenizer
    partners = partners if partners is not None else [None] * len(sources)
    prefill = tok.encode(MARKER, add_special_tokens=False) if sc.prefill else []
    prompts = []
    for j, p in zip(sources, partners):
        a = attempts[j]
        if p is None:
            message = skill_writing_prompt(attempt_text(a, sc.trajectory_chars), a.success, sc.max_words)
        else:
            message = contrastive_writing_prompt(attempt_text(attempts[p], sc.trajectory_chars // 2), attempt_text(a, sc.trajectory_chars // 2), sc.max_words)
        prompts.append(render_prompt(tok, message, system) + prefill)
    samples = []
    if prompts:
        params = SamplingParams(sc.max_new_tokens, sc.temperature, cfg.sampling.top_p, ("\n",) if sc.prefill else ())
        samples = generate(policy.causal_lm, tok, prompts, params, n=sc.candidates, generator=gen)
    parsed = [parse_skill(tok.decode(s.token_ids, skip_special_tokens=True), sc.max_words, sc.max_chars) for s in samples]
    if sc.curate:
        K = sc.candidates
        actions = [episode_actions(attempts[j]) + (episode_actions(attempts[p]) if p is not None else []) for j, p in zip(sources, partners)]
        parsed = [curated(x, actions[i // K]) for i, x in enumerate(parsed)]
    for p in parsed:
        stats.add(p)
    return Writing(sources, prompts, samples, parsed, list(partners))

def replay_rewards(policy: Policy, writing: Writing, attempts: list[Attempt], buffer: list[Attempt], cfg: RSIPOConfig, system: str | None, gen: torch.Generator) -> tuple[list[torch.Tensor | None], list[int]]:
    """Replay reward of every candidate (see the module doc): per source, a (K,) tensor of
    penalised rewards, or None when the buffer holds no attempt of another seed; and the
    number of attempts replayed per source. Each replayed attempt is scored on at most
    `skills.replay_turns` of its turns (a seeded random subset)."""
    sc, tok, K = cfg.skills, policy.tokenizer, cfg.skills.candidates
    plans = []  # per source: [(buffer index, [turn indices])]
    for j in writing.sources:
        src = attempts[j]
        pool = [i for i, b in enumerate(buffer) if b.env == src.env and b.seed != src.seed]
        plan = []
        for i in alternate(pool, [buffer[i].success for i in pool], sc.replay_size, gen):
            n_turns = len(buffer[i].contexts)
            turns = sorted(int(t) for t in torch.randperm(n_turns, generator=gen, device="cpu")[: sc.replay_turns])
            plan.append((i, turns))
        plans.append(plan)

    pairs: list[tuple[list[int], list[int]]] = []
    slot: dict[tuple, int] = {}  # (hint or None, buffer index, turn) -> index into pairs

    def need(hint: str | None, i: int, t: int) -> None:
        if (hint, i, t) not in slot:
            slot[(hint, i, t)] = len(pairs)
            pairs.append((render_prompt(tok, user_message(buffer[i].contexts[t], cfg.agent, hint), system), list(buffer[i].actions[t])))

    for s, plan in enumerate(plans):
        for k in range(K):
            p = writing.parsed[s * K + k]
            for i, turns in plan:
                for t in turns:
                    need(None, i, t)
                    if p.valid:
                        need(skill_hint([p.text]), i, t)
    scores = score_actions(policy, pairs, cfg)  # on the policy's device
    device = policy.device

    rewards: list[torch.Tensor | None] = []
    for s, plan in enumerate(plans):
        if not plan:
            rewards.append(None)
            continue
        means, outcomes, lengths, invalid = [], [], [], []
        outcome = torch.tensor([1.0 if buffer[i].success else -1.0 for i, _ in plan], device=device)
        for k in range(K):
            p = writing.parsed[s * K + k]
            d = []
            if p.valid:
                for i, turns in plan:
                    diff = torch.cat([scores[slot[(skill_hint([p.text]), i, t)]] - scores[slot[(None, i, t)]] for t in turns])
                    d.append(diff.mean())
            means.append(torch.stack(d) if d else torch.zeros(0, device=device))
            outcomes.append(outcome if d else torch.zeros(0, device=device))
            lengths.append(p.words)
            invalid.append(not p.valid)
        rewards.append(skill_rewards(means, outcomes, lengths, invalid, sc.replay_clip, sc.max_words, sc.length_penalty, sc.invalid_reward))
    return rewards, [len(p) for p in plans]



@dataclass
class EffectGames:
    """skills.effect_games: what trying candidate skills on the step's games needs. The games
    are deterministic, so a game's episodes without the candidate are its group's this step."""

    seeds: list[int]  # (B,) the step's games, one per group
    queries: list[str]  # (B,) each game as skill retrieval reads it (`skill_query`)
    baselines: torch.Tensor  # (B,) each game's mean reward this step, without the candidate (host)
    play: Callable[[list[int], list[str]], list[float]]  # (seeds, hints) -> the reward of one episode per pair, the hint in its prompts


def effect_rewards(writing: Writing, games: EffectGames, cfg: RSIPOConfig) -> tuple[list[torch.Tensor | None], list[int], int]:
    """Effect reward of every candidate (`distill.skill_effect`, penalised like the replay
    reward): each valid candidate is played once, shown in the prompt, on the `skills.effect_games`
    games of the step most related to its source's game (`skills.related`, never that game
    itself); its reward is the mean over them of R - b. Returns per source the (K,) rewards (None
    when there is no other game), the games each source's candidates were tried on, and the
    episodes played."""
    sc, K, G = cfg.skills, cfg.skills.candidates, cfg.train.group_size
    plans = []
    for j in writing.sources:
        b = j // G  # the source's group: its game
        same = {i for i, seed in enumerate(games.seeds) if seed == games.seeds[b]}
        plans.append(related(games.queries[b], games.queries, sc.effect_games, same))
    jobs = [(s, k, m) for s, plan in enumerate(plans) for k in range(K) if writing.parsed[s * K + k].valid for m in plan]
    played = games.play([games.seeds[m] for _, _, m in jobs], [skill_hint([writing.parsed[s * K + k].text]) for s, k, _ in jobs]) if jobs else []
    got = dict(zip(jobs, played))
    rewards: list[torch.Tensor | None] = []
    for s, plan in enumerate(plans):
        if not plan:
            rewards.append(None)
            continue
        cands = writing.parsed[s * K : (s + 1) * K]
        raw = [skill_effect(torch.tensor([got[(s, k, m)] for m in plan], device="cpu"), games.baselines[plan]).item() if p.valid else 0.0
               for k, p in enumerate(cands)]
        rewards.append(penalised(raw, [p.words for p in cands], [not p.valid for p in cands], sc.max_words, sc.length_penalty, sc.invalid_reward))
    return rewards, [len(p) for p in plans], len(jobs)


def hinted_episode_rewards(policy: Policy, pool: EnvPool, seeds: list[int], hints: list[str], sampling: SamplingParams, gen: torch.Generator,
                           system: str | None, cfg: RSIPOConfig, multi_turn: bool, reward_set: RewardSet | None) -> list[float]:
    """One sampled episode (or completion) per (seed, hint), the hint in its prompts as an
    in-context skill is shown; their rewards (the [[reward]] sum when set)."""
    if multi_turn:
        episodes = rollout_episodes(policy, pool, seeds, 1, sampling, gen, system, cfg.agent, hints=hints).episodes
        return [e.total_reward for e in episodes] if reward_set is None else score_episodes(reward_set, episodes).totals
    trajs = rollout(policy, pool, seeds, 1, sampling, gen, system, hints=hints).trajectories
    if reward_set is not None:
        score_trajectories(reward_set, trajs)
    return [t.reward for t in trajs]


@dataclass
class SkillStep:
    """What one step's skill writing produced for the update and the logs."""

    rows: list[Trajectory] = field(default_factory=list)  # writing prompt + candidate tokens, trained when rewarded
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0, device="cpu"))  # (len(rows),) coef x group-normalised reward, host
    admitted: dict[int, int] = field(default_factory=dict)  # skill id -> the attempt it was written from
    partners: dict[int, int] = field(default_factory=dict)  # skill id -> the success shown beside that attempt (skills.contrastive)
    log: list[dict] = field(default_factory=list)  # one record per candidate (skills.jsonl)
    metrics: dict[str, float] = field(default_factory=dict)
    rescored: int = 0  # buffer attempts replayed (re-scored, not played again)
    episodes: int = 0  # episodes played to try candidates on related games (skills.effect_games)


def admit(library: SkillLibrary, text: str, reward: float | None, src: Attempt, outcome: str, cfg: RSIPOConfig, step: int) -> tuple[int | None, str]:
    """Enter a candidate in the library: (its skill id, "added"), or with skills.curate and an
    active near-duplicate, (the new version's id, "merged") when its replay reward beats the
    duplicate's, else (None, "dropped")."""
    sc = cfg.skills
    if sc.curate:
        dup = near_duplicate(text, library.active(cfg.env.name), sc.merge_threshold)
        if dup is not None:
            if reward is None or (dup.replay_reward is not None and reward <= dup.replay_reward):
                return None, "dropped"
            return library.add(text, cfg.env.name, src.seed, step, outcome, parent_id=dup.id, replay_reward=reward, created_step=step), "merged"
    return library.add(text, cfg.env.name, src.seed, step, outcome, replay_reward=reward, created_step=step), "added"


def retire_useless(library: SkillLibrary, cfg: RSIPOConfig, step: int) -> int:
    """skills.curate: remove every active skill whose measured utility is <= 0; returns how many."""
    sc, retired = cfg.skills, 0
    for s in library.active(cfg.env.name):
        if retire_reason(s, step, sc.retire_min_trials, sc.retire_grace_steps) is not None:
            library.remove(s.id, step)
            retired += 1
    return retired


def learn_skills(policy: Policy, attempts: list[Attempt], buffer: list[Attempt], library: SkillLibrary, cfg: RSIPOConfig, system: str | None,
                 gen: torch.Generator, step: int, games: EffectGames | None = None) -> SkillStep:
    """Write K candidates for each chosen attempt (or success/failure pair), reward them by
    replay (or, with skills.effect_games, by their effect on the step's `games`), admit each
    source's best candidate to the library (with provenance; curated with skills.curate), and
    make the writing rows."""
    sc, K = cfg.skills, cfg.skills.candidates
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    stats = SkillWritingStats()
    if sc.contrastive:
        sources, partners = choose_contrasts(attempts, B, G, sc.write_per_group, gen, sc.sources == "wins")
    else:
        sources, partners = choose_sources(attempts, B, G, sc.write_per_group, gen, sc.sources == "wins"), None
    writing = write_skills(policy, attempts, sources, cfg, system, gen, stats, partners)
    replay: list[torch.Tensor | None] = [None] * len(sources)
    replayed, tried, effect_episodes = [0] * len(sources), [0] * len(sources), 0
    if sc.replay_reward and sc.effect_games:
        if games is None:
            raise ValueError("skills.effect_games > 0: learn_skills needs the step's games (EffectGames)")
        replay, tried, effect_episodes = effect_rewards(writing, games, cfg)
    elif sc.replay_reward:
        replay, replayed = replay_rewards(policy, writing, attempts, buffer, cfg, system, gen)
    out, advantages = SkillStep(episodes=effect_episodes), []
    admissions = {"added": 0, "merged": 0, "dropped": 0}
    for s, j in enumerate(sources):
        src, cands, r, partner = attempts[j], writing.parsed[s * K : (s + 1) * K], replay[s], writing.partners[s]
        valid = [k for k in range(K) if cands[k].valid]
        if not sc.replay_reward:
            best = valid[0] if valid else None
        else:  # the highest replay reward, if the candidate was replayed at all and clears the bar
            best = max(valid, key=lambda k: (float(r[k]), -k)) if (r is not None and valid) else None
            if best is not None and sc.admit_min_reward is not None and float(r[best]) <= sc.admit_min_reward:
                best = None
        if best is not None:
            outcome = "contrast" if partner is not None else ("success" if src.success else "failure")
            sid, how = admit(library, cands[best].text, None if r is None else float(r[best]), src, outcome, cfg, step)
            admissions[how] += 1
            if sid is not None:  # (a text admitted again from another source now points there)
                out.admitted[sid] = j
                out.partners.pop(sid, None)
                if partner is not None:
                    out.partners[sid] = partner
        adv = group_normalise(r) * sc.coef if (r is not None and sc.coef > 0) else None  # (K,)
        prompt = writing.prompts[s]
        for k in range(K):
            sample = writing.samples[s * K + k]
            if adv is not None and sample.token_ids:
                out.rows.append(Trajectory(cfg.env.name, src.seed, -1, prompt + sample.token_ids, [0] * len(prompt) + [1] * len(sample.token_ids),
                                           [0.0] * len(prompt) + sample.logprobs, float(r[k]), False, finish_reason=sample.finish_reason))
                advantages.append(float(adv[k]))
            record = {"source_seed": src.seed, "source_success": src.success, "candidate": k, "text": cands[k].text, "valid": cands[k].valid,
                      "reason": cands[k].reason, "words": cands[k].words, "reward": None if r is None else float(r[k]),
                      "admitted": k == best, "replayed": replayed[s]}
            if sc.effect_games:
                record["effect_games"] = tried[s]  # the related games each candidate of this source was played on
            if partner is not None:
                record["contrast"] = True  # written from this failure beside a success of the same game
            out.log.append(record)
    retired = retire_useless(library, cfg, step) if sc.curate else 0
    out.advantages = torch.tensor(advantages, dtype=torch.float32, device="cpu")
    out.rescored = sum(replayed)
    rewarded = torch.tensor([c["reward"] for c in out.log if c["valid"] and c["reward"] is not None], device="cpu")
    words = torch.tensor([float(p.words) for p in writing.parsed if p.valid], device="cpu")
    out.metrics = {
        **stats.metrics(),
        "skills/sources": float(len(sources)),
        "skills/admitted": float(len(set(out.admitted))),
        "skills/library_size": float(len(library)),
        "skills/replay_reward_mean": rewarded.mean().item() if rewarded.numel() else float("nan"),
        "skills/replay_reward_max": rewarded.max().item() if rewarded.numel() else float("nan"),
        "skills/replayed_mean": sum(replayed) / max(len(replayed), 1),
        "skills/len_words_mean": words.mean().item() if words.numel() else float("nan"),
        "skills/writing_rows": float(len(out.rows)),
    }
    if sc.effect_games:
        out.metrics["skills/effect_episodes"] = float(effect_episodes)
    if sc.contrastive:
        valid_texts = [p.text for p in writing.parsed if p.valid]
        out.metrics["skills/contrastive_sources"] = float(sum(p is not None for p in writing.partners))
        out.metrics["skills/rule_form_frac"] = sum(rule_form(t) for t in valid_texts) / len(valid_texts) if valid_texts else float("nan")
    if sc.curate:
        out.metrics.update({"skills/merged": float(admissions["merged"]), "skills/merge_dropped": float(admissions["dropped"]), "skills/retired": float(retired)})
    return out

# ----------------------------------------------------------------------------- teacher contexts


def skill_query(task: str, observation: str) -> str:
    """What a task's skills are retrieved by: its task line (single-turn: the question) and
    its first observation."""
    return f"{task} {observation}"


def task_hints(library: SkillLibrary, pool: EnvPool, seeds: list[int], retrieve_k: int, retrieval: str, family: str, multi_turn: bool) -> list[str | None]:
    """Per seed, the library's best skills for its task as a hint (`skill_hint`), retrieved as
    for the teacher; None where none matches. Reads each task by resetting one env of the pool
    (no env is reset for an empty library). Also what `recursa eval --skills` shows."""
    if not len(library):
        return [None] * len(seeds)
    env = pool.take(1)[0]
    queries = []
    for seed in seeds:
        obs = env.reset(seed)
        queries.append(skill_query(env.task if multi_turn else obs, obs))
    found = retrieve_many(library, queries, retrieve_k, family=family, method=retrieval)
    return [skill_hint([s.text for s in f]) if f else None for f in found]


def library_hints(library: SkillLibrary, pool: EnvPool, seeds: list[int], cfg: RSIPOConfig, multi_turn: bool) -> list[str | None]:
    """Per seed, the hint its task is shown with under `skills.in_context` (`task_hints` with
    the run's retrieval settings)."""
    return task_hints(library, pool, seeds, cfg.skills.retrieve_k, cfg.skills.retrieval, cfg.env.name, multi_turn)


def teacher_hints(attempts: list[Attempt], cfg: RSIPOConfig, library: SkillLibrary, pool: EnvPool, multi_turn: bool, G: int) -> tuple[list[str | None], list]:
    """Per attempt: the teacher's hint text (None: no teacher for it) and its trust group
    (a skill id, 'reference', 'sibling', or None)."""
    tc, n = cfg.teacher, len(attempts)
    hints: list[str | None] = [None] * n
    groups: list = [None] * n
    if tc.source == "skill":
        for b in range(0, n, G):
            first = attempts[b]
            found = retrieve(library, skill_query(first.task, first.contexts[0].observation), cfg.skills.retrieve_k, family=cfg.env.name, method=cfg.skills.retrieval)
            if found:
                for i in range(b, b + G):
                    hints[i], groups[i] = skill_hint([s.text for s in found]), found[0].id
    elif tc.source == "reference":
        env = pool.take(1)[0]
        for b in range(0, n, G):
            env.reset(attempts[b].seed)
            if multi_turn:
                plan = env.walkthrough()
                text = f"A sequence of actions that wins this game from the start: {', '.join(plan)}" if plan else None
            else:
                ref = env.reference() if hasattr(env, "reference") else None
                text = f"A correct answer: {ref}" if ref else None
            for i in range(b, b + G):
                hints[i], groups[i] = (_clip(text, tc.max_hint_chars), "reference") if text else (None, None)
    elif tc.source == "sibling":
        for i, a in enumerate(attempts):
            b = i - i % G
            sib = next((j for j in range(b, b + G) if j != i and attempts[j].success), None)
            if sib is not None:
                done = attempts[sib].texts
                text = f"Actions of a successful attempt at this game: {', '.join(done)}" if multi_turn else f"A successful answer to this task: {done[0]}"
                hints[i], groups[i] = _clip(text, tc.max_hint_chars), "sibling"
    return hints, groups



# ----------------------------------------------------------------------------- rollout


@dataclass
class Played:
    """One step's rollout as every later phase reads it."""

    attempts: list[Attempt]  # B x G, grouped
    rows: list[Trajectory]  # the training rows: one per completion, or one per turn of a game
    row_adv: torch.Tensor  # (rows,) outcome advantage of each row (+ GiGPO's step term), host
    rewards: torch.Tensor  # (B, G) host
    advantages: torch.Tensor  # (B, G) outcome advantages, host
    success: torch.Tensor  # (B, G) bool, host
    row_attempt: list[int]  # (rows,) the attempt of each row
    row_context: list[Context]  # (rows,) what each row's user message was rendered from
    metrics: dict  # episode/* metrics (games)
    gen_stats: GenerationStats


def play(policy: Policy, pool: EnvPool, seeds: list[int], shown: list[str | None] | None, sampling: SamplingParams, gen: torch.Generator,
         system: str | None, cfg: RSIPOConfig, multi_turn: bool, step: int, rollouts: RolloutBackend | None = None,
         reward_set: RewardSet | None = None) -> Played:
    """B x G attempts of the step's tasks (`shown`: the in-context skill of each task, or None)
    and their outcome advantages, as GRPO computes them; `rollouts` plays them (None: this
    process, the native sampler); `reward_set`: the [[reward]] functions (None: the env's reward)."""
    rollouts = rollouts or LocalRollouts(policy, pool)
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    metrics = {}
    if multi_turn:
        ero = rollouts.episodes(seeds, G, sampling, gen, system, cfg.agent, hints=shown)
        gen_stats = ero.stats
        totals = [e.total_reward for e in ero.episodes]
        if reward_set is not None:
            scored = score_episodes(reward_set, ero.episodes)
            totals = scored.totals
            metrics.update(scored.metrics)
        rewards = torch.tensor(totals, dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
        check_finite(step, rewards=rewards)  # an env's NaN reward is named, never trained on
        advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
        rows, row_adv, episode_metrics = episode_rows(ero.episodes, advantages, cfg)  # one row per turn
        metrics.update(episode_metrics)
        attempts = episode_attempts(ero.episodes, step, cfg.agent, shown)
    else:
        ro = rollouts.rollout(seeds, G, sampling, gen, system, hints=shown)
        gen_stats = ro.stats
        rows = ro.trajectories
        if reward_set is not None:
            metrics.update(score_trajectories(reward_set, rows).metrics)
        rewards = torch.tensor([t.reward for t in rows], dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
        check_finite(step, rewards=rewards)  # an env's NaN reward is named, never trained on
        advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
        row_adv = advantages.view(-1)
        attempts = completion_attempts(rows, step, shown)
    row_attempt = [a for a, att in enumerate(attempts) for _ in att.contexts]
    row_context = [c for att in attempts for c in att.contexts]
    success = torch.tensor([a.success for a in attempts], device="cpu").view(B, G)  # (B, G)
    return Played(attempts, rows, row_adv, rewards, advantages, success, row_attempt, row_context, metrics, gen_stats)


# ----------------------------------------------------------------------------- hinted re-rolls (hatch)


@dataclass
class HintedStep:
    """The hinted re-rolls of one step's all-fail groups, as rows under the un-hinted prompt."""

    rows: list[Trajectory] = field(default_factory=list)  # un-hinted prompt ids + the hinted episode's action ids
    advantages: list[torch.Tensor] = field(default_factory=list)  # per row, (action tokens,) coef x w_t x (R - b), host
    episodes: int = 0  # episodes played (sampled) for the re-rolls
    metrics: dict[str, float] = field(default_factory=dict)


def reflection_hints(policy: Policy, attempts: list[Attempt], cfg: RSIPOConfig, system: str | None, gen: torch.Generator) -> list[str | None]:
    """hatch.hint = reflection: the policy reads each failed attempt and writes one piece of
    advice (the skill-writing prompt for a failure, one sample each, skills.* settings); None
    where the reply does not parse."""
    sc, tok = cfg.skills, policy.tokenizer
    prefill = tok.encode(MARKER, add_special_tokens=False) if sc.prefill else []
    prompts = [render_prompt(tok, skill_writing_prompt(attempt_text(a, sc.trajectory_chars), False, sc.max_words), system) + prefill for a in attempts]
    if not prompts:
        return []
    params = SamplingParams(sc.max_new_tokens, sc.temperature, cfg.sampling.top_p, ("\n",) if sc.prefill else ())
    samples = generate(policy.causal_lm, tok, prompts, params, n=1, generator=gen)
    parsed = [parse_skill(tok.decode(s.token_ids, skip_special_tokens=True), sc.max_words, sc.max_chars) for s in samples]
    return [f"Advice from an earlier failed attempt at this game: {p.text}" if p.valid else None for p in parsed]


def oracle_hint(env, seed: int, multi_turn: bool, steps: int, limit: int) -> str | None:
    """hatch.hint = oracle_walkthrough (an ablation): the first `steps` actions of the game's
    walkthrough (all of it for 0), or a single-turn task's reference answer; None without one."""
    env.reset(seed)
    if multi_turn:
        plan = list(env.walkthrough() or [])
        plan = plan[:steps] if steps else plan
        return _clip(f"Actions that win this game, in order from the start: {', '.join(plan)}", limit) if plan else None
    ref = env.reference() if hasattr(env, "reference") else None
    return _clip(f"A correct answer: {ref}", limit) if ref else None


def win_hints(tasks: list[str], buffer: list[Attempt], multi_turn: bool, limit: int) -> list[str | None]:
    """hatch.hint = win: for each failed game's task line, what the policy itself did in the
    winning attempt of the replay buffer whose task line reads most alike (BM25 over task
    lines; among equal scores the most recent), clipped to `limit` characters; None where no
    win shares a word with it. Unlike the walkthrough, a deployed agent has these: they are
    its own earlier episodes (the same game's, when it once won it)."""
    wins = [a for a in reversed(buffer) if a.success]  # newest first, so a tie goes to the most recent win
    if not wins:
        return [None] * len(tasks)
    index = BM25Index().build([a.task for a in wins])
    out: list[str | None] = []
    for task in tasks:
        top = index.top_k(task, 1)
        if not top or top[0][1] <= 0:
            out.append(None)
            continue
        a = wins[top[0][0]]
        out.append(win_hint(a.task, a.texts, limit) if multi_turn
                   else _clip(f"A reply that was right on a similar task ({a.task}): {a.texts[0] if a.texts else ''}", limit))
    return out


def hatch_hints(policy: Policy, played: Played, groups: list[int], library: SkillLibrary, pool: EnvPool, cfg: RSIPOConfig, system: str | None,
                gen: torch.Generator, multi_turn: bool, buffer: list[Attempt] | None = None) -> list[str | None]:
    """The hint each all-fail group in `groups` is re-rolled with (None: no re-roll);
    `buffer`: the replay buffer, which hatch.hint = win reads."""
    hc, G = cfg.hatch, cfg.train.group_size
    firsts = [played.attempts[b * G] for b in groups]
    if hc.hint == "win":
        return win_hints([a.task for a in firsts], buffer or [], multi_turn, cfg.teacher.max_hint_chars)
    if hc.hint == "skill":
        found = retrieve_many(library, [skill_query(a.task, a.contexts[0].observation) for a in firsts], cfg.skills.retrieve_k, family=cfg.env.name,
                              method=cfg.skills.retrieval) if len(library) else [[] for _ in groups]
        return [skill_hint([s.text for s in f]) if f else None for f in found]
    if hc.hint == "reflection":  # on one failed attempt of each group, drawn at random
        picks = [b * G + int(torch.randint(G, (1,), generator=gen, device="cpu")) for b in groups]
        return reflection_hints(policy, [played.attempts[i] for i in picks], cfg, system, gen)
    env = pool.take(1)[0]
    return [oracle_hint(env, a.seed, multi_turn, hc.walkthrough_steps, cfg.teacher.max_hint_chars) for a in firsts]


def hinted_rerolls(policy: Policy, pool: EnvPool, played: Played, seeds: list[int], shown: list[str | None] | None, library: SkillLibrary,
                   sampling: SamplingParams, gen: torch.Generator, cfg: RSIPOConfig, system: str | None, multi_turn: bool, step: int,
                   reward_set: RewardSet | None = None, buffer: list[Attempt] | None = None, room: int | None = None) -> HintedStep:
    """hatch: re-roll k attempts of each all-fail group with a hint, score their action tokens
    with and without it, and make rows under the un-hinted prompt with the advantage of
    `recursa.algorithms.hinted` (step: 0 for the first step, for the annealing; buffer: the
    replay buffer, for hatch.hint = win; room: the episodes train.max_episodes has left, which
    re-rolls the first room // k hinted groups only)."""
    hc, tok, G = cfg.hatch, policy.tokenizer, cfg.train.group_size
    groups = [b for b, failed in enumerate(all_failed(played.success).tolist()) if failed]
    hints = hatch_hints(policy, played, groups, library, pool, cfg, system, gen, multi_turn, buffer) if groups else []
    chosen = [(b, h) for b, h in zip(groups, hints) if h is not None]
    keep = len(chosen) if room is None else max(room, 0) // hc.rerolls
    chosen, capped = chosen[:keep], chosen[keep:]
    coef = anneal(hc.coef, step, cfg.train.steps if hc.anneal_steps is None else hc.anneal_steps, hc.anneal)
    out = HintedStep(metrics={"hatch/groups": float(len(groups)), "hatch/hinted_groups": float(len(chosen)), "hatch/coef": coef,
                              **({"hatch/capped_groups": float(len(capped))} if room is not None else {})})
    if not chosen:
        return out
    k, re_seeds, re_hints = hc.rerolls, [seeds[b] for b, _ in chosen], [h for _, h in chosen]
    bare = [shown[b] for b, _ in chosen] if shown is not None else None  # what the policy sees without the hatch hint
    if multi_turn:
        episodes = rollout_episodes(policy, pool, re_seeds, k, sampling, gen, system, cfg.agent, hints=re_hints).episodes
        attempts = episode_attempts(episodes, step + 1, cfg.agent, bare)
        hinted_prompts = [[t.prompt_ids for t in e.turns] for e in episodes]
        rewards = [e.total_reward for e in episodes] if reward_set is None else score_episodes(reward_set, episodes).totals
    else:
        trajs = rollout(policy, pool, re_seeds, k, sampling, gen, system, hints=re_hints).trajectories
        if reward_set is not None:  # the re-rolls are scored like the step's own attempts
            score_trajectories(reward_set, trajs)
        attempts = completion_attempts(trajs, step + 1, bare)
        hinted_prompts = [[t.token_ids[: t.action_mask.index(1)] if 1 in t.action_mask else t.token_ids] for t in trajs]
        rewards = [t.reward for t in trajs]
    pairs, rows, group_of = [], [], []
    for i, a in enumerate(attempts):
        for ctx, actions, hinted in zip(a.contexts, a.actions, hinted_prompts[i]):
            prompt = render_prompt(tok, user_message(ctx, cfg.agent, ctx.hint), system)  # the un-hinted prompt
            pairs += [(prompt, list(actions)), (hinted, list(actions))]
            rows.append((prompt, list(actions), i))
    scores = score_actions(policy, pairs, cfg)  # log pi_old under the un-hinted and the hinted prompt, per row
    width = max([len(a) for _, a, _ in rows] + [1])
    host = torch.device("cpu")  # the hinted rows' advantages are built on the host, like the outcome advantages
    mask = torch.zeros(len(rows), width, device=host)  # (rows, width) the action tokens, left-aligned
    logp_u, logp_h = torch.zeros(len(rows), width, device=host), torch.zeros(len(rows), width, device=host)
    for r, (_, actions, _) in enumerate(rows):
        n = len(actions)
        mask[r, :n] = 1
        logp_u[r, :n], logp_h[r, :n] = scores[2 * r].cpu(), scores[2 * r + 1].cpu()
    baseline = played.rewards.mean(dim=1)  # (B,) the un-hinted group's mean reward
    row_reward = torch.tensor([rewards[i] for _, _, i in rows], dtype=torch.float32, device=host)  # (rows,) R
    row_base = torch.tensor([float(baseline[chosen[i // k][0]]) for _, _, i in rows], dtype=torch.float32, device=host)  # (rows,) b
    weights = truncated_importance_weights(logp_u, logp_h, mask, hc.is_cap)  # (rows, width)
    adv = hinted_token_advantages(row_reward, row_base, weights, coef, mask)  # (rows, width)
    for r, (prompt, actions, i) in enumerate(rows):
        b = chosen[i // k][0]
        out.rows.append(Trajectory(cfg.env.name, seeds[b], b, prompt + actions, [0] * len(prompt) + [1] * len(actions),
                                   [0.0] * len(prompt) + logp_u[r, : len(actions)].tolist(), rewards[i], attempts[i].success))
        out.advantages.append(adv[r, : len(actions)].clone())
    keep = mask.bool()
    out.episodes = len(attempts)
    out.metrics.update({
        "hatch/episodes": float(len(attempts)),
        "hatch/wins": float(sum(a.success for a in attempts)),
        "hatch/win_rate": sum(a.success for a in attempts) / len(attempts),
        "hatch/reward_gain": sum(rewards[i] - float(baseline[chosen[i // k][0]]) for i in range(len(attempts))) / len(attempts),
        "hatch/is_weight_mean": weights[keep].mean().item() if keep.any() else float("nan"),
        "hatch/is_truncated_frac": (logp_u - logp_h >= math.log(hc.is_cap))[keep].float().mean().item() if keep.any() else float("nan"),
        "hatch/logp_gain": (logp_h - logp_u)[keep].mean().item() if keep.any() else float("nan"),
        "hatch/adv_abs_mean": adv[keep].abs().mean().item() if keep.any() else float("nan"),
        "hatch/rows": float(len(rows)),
    })
    return out


# ----------------------------------------------------------------------------- stored successes (route: all-win groups)


@dataclass
class WinStep:
    """Stored winning episodes replayed as a supervised term for the step's all-win groups."""

    rows: list[Trajectory] = field(default_factory=list)  # the exact prompt ids the policy acted on + its action ids
    metrics: dict[str, float] = field(default_factory=dict)


def win_rows(policy: Policy, buffer: list[Attempt], routes: torch.Tensor, cfg: RSIPOConfig, system: str | None, gen: torch.Generator) -> WinStep:
    """route.mode = pass_rate: route.win_episodes winning attempts of the replay buffer (any
    game, drawn at random) per all-win group, one row per turn."""
    rc = cfg.route
    n_groups = int((routes == ALL_WIN).sum())
    if rc.mode != "pass_rate" or rc.win_coef == 0 or n_groups == 0:
        return WinStep()
    wins = [a for a in buffer if a.success]
    order = torch.randperm(len(wins), generator=gen, device="cpu").tolist()[: n_groups * rc.win_episodes]
    rows = []
    for i in order:
        a = wins[i]
        for ctx, actions in zip(a.contexts, a.actions):
            prompt = render_prompt(policy.tokenizer, user_message(ctx, cfg.agent, ctx.hint), system)
            rows.append(Trajectory(a.env, a.seed, -1, prompt + list(actions), [0] * len(prompt) + [1] * len(actions), [0.0] * (len(prompt) + len(actions)), 1.0, True))
    return WinStep(rows, {"route/win_episodes": float(len(order)), "route/win_rows": float(len(rows))})


# ----------------------------------------------------------------------------- teacher


@dataclass
class TeacherStep:
    """The self-teacher's verdict on one step's policy rows."""

    delta: torch.Tensor  # (n, L) Delta_t on the action tokens (centred with teacher.center)
    trust_rows: torch.Tensor  # (n,) the trust applied to each row (x pass-rate, route and critical-step weights)
    has_hint: torch.Tensor  # (n,) bool: the row's task had a teacher hint
    metrics: dict[str, float] = field(default_factory=dict)
    top_ids: torch.Tensor | None = None  # (n, L, k) teacher.mode "distribution": the hinted teacher's k most likely tokens per action position
    top_logp: torch.Tensor | None = None  # (n, L, k) their log-probs under the teacher


def critical_row_weights(attempts: list[Attempt], buffer: list[Attempt], cfg: RSIPOConfig) -> tuple[list[float], dict[str, float]]:
    """teacher.critical: per row, the weight of the teacher term (`routing.critical_weights`):
    each failed attempt is compared with the latest winning attempt of its game (same env and
    seed; the buffer holds this step's attempts too); successful attempts keep weight 1."""
    tc = cfg.teacher
    winners: dict[tuple[str, int], Attempt] = {}
    for a in buffer:  # oldest first: the latest win of each game wins
        if a.success:
            winners[(a.env, a.seed)] = a
    weights: list[float] = []
    failed = matched = 0
    turns = []
    for a in attempts:
        if a.success:
            weights += [1.0] * len(a.contexts)
            continue
        failed += 1
        won = winners.get((a.env, a.seed))
        turn = None
        if won is not None:
            turn = divergence_turn([(c.observation, t) for c, t in zip(a.contexts, a.texts)], [(c.observation, t) for c, t in zip(won.contexts, won.texts)])
        if turn is not None:
            matched += 1
            turns.append(turn)
        weights += critical_weights(len(a.contexts), turn, tc.critical, tc.critical_before, tc.critical_unmatched)
    metrics = {
        "teacher/critical_matched_frac": matched / failed if failed else float("nan"),
        "teacher/critical_turn_mean": sum(turns) / len(turns) if turns else float("nan"),
    }
    return weights, metrics


def teach(policy: Policy, played: Played, skills: SkillStep, library: SkillLibrary, trust: TrustEstimator, pool: EnvPool, buffer: list[Attempt],
          routes: torch.Tensor, mask: torch.Tensor, cfg: RSIPOConfig, system: str | None, multi_turn: bool, step: int) -> TeacherStep:
    """Delta on every policy row whose task has a teacher hint (`mask  # (n, L)`: their action
    tokens), the trust applied to each row, and this step's agreement trials (which update
    `trust` and the library's counts, for later steps)."""
    tc, dev, G = cfg.teacher, policy.device, cfg.train.group_size
    n = mask.shape[0]
    if tc.source == "none":
        return TeacherStep(torch.zeros_like(mask), torch.zeros(n, device=dev), torch.zeros(n, dtype=torch.bool, device=dev))
    attempts, row_attempt = played.attempts, played.row_attempt
    hints, groups = teacher_hints(attempts, cfg, library, pool, multi_turn, G)
    row_hints = [hints[a] for a in row_attempt]
    topk = tc.topk if tc.mode == "distribution" else 0
    teacher, student, *tops = teacher_logprobs(policy, played.rows, played.row_context, row_hints, cfg, system, topk)
    logp_teacher, logp_student = torch.zeros_like(mask), torch.zeros_like(mask)  # (n, L), aligned on the action tokens
    logp_teacher[mask.bool()], logp_student[mask.bool()] = torch.cat(teacher), torch.cat(student)
    top_ids = top_logp = None
    if topk:  # (n, L, k), aligned on the action tokens like Delta
        top_ids = torch.zeros((*mask.shape, topk), dtype=torch.long, device=dev)
        top_logp = torch.zeros((*mask.shape, topk), device=dev)
        top_ids[mask.bool()], top_logp[mask.bool()] = torch.cat([i for i, _ in tops[0]]), torch.cat([v for _, v in tops[0]])
    delta = teacher_shift(logp_teacher, logp_student, mask)  # (n, L)
    has_hint = torch.tensor([h is not None for h in row_hints], device=dev)
    for sid in {g for g in groups if isinstance(g, int)}:
        library.record_use(sid, step, sum(len(attempts[a].contexts) for a in range(len(attempts)) if groups[a] == sid))
    # trust from earlier steps' trials (fixed: OPID-like), x sqrt(p(1-p)) with SC-SDPO weighting, x the route's gate
    attempt_trust = torch.tensor([0.0 if g is None else (cfg.trust.fixed if cfg.trust.mode == "fixed" else trust.trust(g)) for g in groups], device=dev)
    if tc.weighting == "pass_rate":
        attempt_trust = attempt_trust * pass_rate_weights(played.success).reshape(-1).to(dev)
    if cfg.route.mode == "pass_rate":
        rc = cfg.route
        attempt_trust = attempt_trust * route_gate(routes, rc.teacher_all_fail, rc.teacher_mixed, rc.teacher_all_win).repeat_interleave(G).to(dev)
    trust_rows = attempt_trust[row_attempt]
    metrics: dict[str, float] = {}
    if tc.critical != "off":  # the failed episodes' turns from where they left a winning path
        weights, metrics = critical_row_weights(attempts, buffer, cfg)
        trust_rows = trust_rows * torch.tensor(weights, device=dev)  # (n,)
        metrics["teacher/critical_rows_frac"] = sum(w > 0 for w in weights) / max(len(weights), 1)
    # this step's agreement trials: sign of the attempt's mean Delta vs its outcome advantage
    row_attempt_idx = torch.tensor(row_attempt, device=dev)  # (n,)
    sums = torch.zeros(len(attempts), device=dev).index_add(0, row_attempt_idx, (delta * mask).sum(1))
    counts = torch.zeros(len(attempts), device=dev).index_add(0, row_attempt_idx, mask.sum(1))
    mean_delta = sums / counts.clamp_min(1)  # (attempts,)
    attempt_hint = torch.tensor([h is not None for h in hints], device=dev)  # (attempts,)
    if tc.center == "group":  # Delta relative to the group's hinted attempts, like A_outcome
        offset = group_offsets(mean_delta, attempt_hint, G)  # (attempts,)
        mean_delta = mean_delta - offset
        delta = (delta - offset[row_attempt_idx][:, None]) * mask * has_hint[:, None]
    outcome = played.advantages.reshape(-1).to(dev)  # (attempts,)
    is_source = [skills.admitted.get(g) == a or skills.partners.get(g) == a for a, g in enumerate(groups)]  # the skill agrees with them by construction
    trials = agreement_trials(groups, mean_delta.tolist(), outcome.tolist(), is_source, cfg.trust.threshold)
    trust.update(trials)
    counts_now = {g: (a_g, n_g) for g, a_g, n_g, _ in trust.state_dict()["groups"]}
    for g in trials:
        if isinstance(g, int):  # the skill's decayed counts, as of its latest trial
            library.record_trust(g, *counts_now[g])
    metrics.update(teacher_summary(delta, mask, has_hint, mean_delta, outcome, attempt_hint, trust_rows, trust, trials))
    return TeacherStep(delta, trust_rows, has_hint, metrics, top_ids, top_logp)


# ----------------------------------------------------------------------------- advantages


def combine_imitation(terms: list[tuple[torch.Tensor, float]]) -> Imitation | None:
    """One imitation term from several (weights, coef): coef x weights when there is one,
    else the coefficient-weighted sum of the weights with coef 1."""
    if not terms:
        return None
    if len(terms) == 1:
        return Imitation(*terms[0])
    return Imitation(sum(c * w for w, c in terms), 1.0)


def set_advantages(batch, played: Played, skills: SkillStep, hinted: HintedStep, wins: WinStep, taught: TeacherStep, cfg: RSIPOConfig) -> tuple[Imitation | None, dict, dict]:
    """Fill `batch.advantages  # (N, L)`: the policy rows' A_t = A_outcome + lam T_g psi(Delta_t),
    the writing rows' coef x normalised replay reward, the hinted rows' coef x w_t x (R - b),
    0 on the win rows; each part scaled to be averaged over its own tokens (`part_scales`).
    Returns the imitation term (SEED-like teacher, wins), the advantage shares and metrics."""
    tc, dev = cfg.teacher, batch.device
    n = len(played.rows)
    parts = [n, len(skills.rows), len(hinted.rows), len(wins.rows)]
    bounds = [(sum(parts[:i]), sum(parts[: i + 1])) for i in range(len(parts))]
    mask = batch.action_mask[:n]  # (n, L)
    teacher_mask = mask * taught.has_hint[:, None]  # (n, L)
    route = "failed" if tc.route == "failed" else None
    row_success = torch.tensor([played.attempts[a].success for a in played.row_attempt], device=dev)
    lam_adv = tc.lam if tc.mode == "advantage" else 0.0
    psi_values = psi(taught.delta, teacher_mask, tc.clip, tc.scale, tc.negative_scale)  # (n, L)
    token_adv, shares = token_advantages(played.row_adv.to(dev), psi_values, taught.trust_rows, lam_adv, mask, route, row_success)  # (n, L)
    scales = part_scales(batch.action_mask, parts, cfg.algo.agg)
    adv = torch.zeros_like(batch.action_mask)  # (N, L) policy rows, writing rows, hinted rows, win rows
    adv[:n] = token_adv * scales[0]
    lo, hi = bounds[1]
    if skills.rows:
        adv[lo:hi] = skills.advantages.to(dev)[:, None] * batch.action_mask[lo:hi] * scales[1]
    lo, hi = bounds[2]
    if hinted.rows:
        block = torch.zeros_like(batch.action_mask[lo:hi])
        block[batch.action_mask[lo:hi].bool()] = torch.cat(hinted.advantages).to(dev)
        adv[lo:hi] = block * scales[2]
    batch.advantages = adv
    # imitation terms, each a token mean over its own rows
    terms, metrics = [], {}
    token_scales = part_scales(batch.action_mask, parts, "token-mean")
    if tc.mode == "imitation" and tc.source != "none":
        weights = seed_imitation_weights(taught.delta, teacher_mask, tc.imitation_temperature) * taught.trust_rows[:, None]  # (n, L)
        if route == "failed":
            weights = weights * (~row_success).float()[:, None]
        full = torch.zeros_like(batch.action_mask)
        full[:n] = weights * token_scales[0]
        terms.append((full, tc.lam))
        metrics["teacher/imitation_weight_mean"] = (weights.sum() / teacher_mask.sum().clamp_min(1)).item()
    lo, hi = bounds[3]
    if wins.rows:
        full = torch.zeros_like(batch.action_mask)
        full[lo:hi] = batch.action_mask[lo:hi] * token_scales[3]
        terms.append((full, cfg.route.win_coef))
    return combine_imitation(terms), shares, metrics


def distillation_term(batch, played: Played, taught: TeacherStep, cfg: RSIPOConfig) -> tuple[Distillation | None, dict]:
    """teacher.mode = "distribution" (SDPO / OPSD): the loss term lam x token mean of w_t D_t
    over the policy rows' action tokens (`distill.distribution_loss`), with w_t the row's
    applied trust (pass-rate, route and critical-step weights included) on the rows whose task
    had a hint, only the failed ones under teacher.route = "failed"; the writing, hinted and win
    rows get none. Averaged over the policy rows' own tokens, like the imitation term."""
    tc = cfg.teacher
    if tc.mode != "distribution" or tc.source == "none" or taught.top_ids is None:
        return None, {}
    n, (N, L) = len(played.rows), batch.action_mask.shape
    mask = batch.action_mask[:n]  # (n, L)
    w = mask * taught.has_hint[:, None] * taught.trust_rows[:, None]  # (n, L)
    if tc.route == "failed":
        row_success = torch.tensor([played.attempts[a].success for a in played.row_attempt], device=batch.device)
        w = w * (~row_success).float()[:, None]
    scale = part_scales(batch.action_mask, [n, N - n], "token-mean")[0]
    k = taught.top_ids.shape[-1]
    ids = torch.zeros((N, L, k), dtype=torch.long, device=batch.device)
    logp = torch.zeros((N, L, k), device=batch.device)
    weights = torch.zeros((N, L), device=batch.device)
    ids[:n], logp[:n], weights[:n] = taught.top_ids, taught.top_logp, w * scale
    on = mask.bool() & (w > 0)
    covered = torch.logsumexp(taught.top_logp[on], dim=-1).exp() if on.any() else torch.zeros(0)
    metrics = {
        "teacher/distill_weight_mean": (w.sum() / (mask * taught.has_hint[:, None]).sum().clamp_min(1)).item(),
        "teacher/distill_topk_mass": covered.mean().item() if covered.numel() else float("nan"),  # the teacher's mass on its top-k
    }
    return Distillation(ids, logp, weights, tc.lam, tc.divergence), metrics


# ----------------------------------------------------------------------------- the loop


def term_scales(action_mask: torch.Tensor, n: int, agg: str) -> tuple[float, float]:
    """Factors on the advantages of the first n rows (policy) and of the rest (skill writing):
    `losses.part_scales` with two parts."""
    policy_scale, writing_scale = part_scales(action_mask, [n, action_mask.shape[0] - n], agg)
    return policy_scale, writing_scale


def _make_trust(cfg: RSIPOConfig) -> TrustEstimator:
    t = cfg.trust
    return TrustEstimator(t.decay, t.prior_mean, t.prior_strength, t.min_strength, t.max_strength, t.warmup_steps)


def _stats(x: torch.Tensor) -> tuple[float, float, float]:
    """(mean, std, abs mean) of a 1-D tensor, nan when empty (std: 0 for one value)."""
    if x.numel() == 0:
        return float("nan"), float("nan"), float("nan")
    return x.mean().item(), (x.std().item() if x.numel() > 1 else 0.0), x.abs().mean().item()


def teacher_summary(delta, mask, has_hint, mean_delta, outcome, attempt_hint, trust_rows, trust: TrustEstimator, trials: dict) -> dict[str, float]:
    """teacher/* and trust/* metrics of one step."""
    d_mean, d_std, d_abs = _stats(delta[mask.bool() & has_hint[:, None]])
    n_trials = sum(k for _, k in trials.values())
    seen = trust.trusts()
    alpha, beta = trust.prior()
    return {
        "teacher/rows_frac": has_hint.float().mean().item(),
        "teacher/delta_mean": d_mean,
        "teacher/delta_std": d_std,
        "teacher/delta_abs_mean": d_abs,
        "teacher/corr_delta_adv": correlation(mean_delta[attempt_hint], outcome[attempt_hint]) if attempt_hint.any() else float("nan"),
        "teacher/trust_applied_mean": trust_rows[has_hint].mean().item() if has_hint.any() else float("nan"),
        "trust/groups": float(len(seen)),
        "trust/mean": sum(seen.values()) / len(seen) if seen else float("nan"),
        "trust/max": max(seen.values()) if seen else float("nan"),
        "trust/min": min(seen.values()) if seen else float("nan"),
        "trust/prior_strength": alpha + beta,
        "trust/prior_mean": alpha / (alpha + beta),
        "trust/trials": float(n_trials),
        "trust/agreement": sum(a for a, _ in trials.values()) / n_trials if n_trials else float("nan"),
    }


def step_metrics(played: Played, skills: SkillStep, hinted: HintedStep, wins: WinStep, taught: TeacherStep, shares: dict, extra: dict, routes: torch.Tensor,
                 st: UpdateStats, n_batch: int, cfg: RSIPOConfig, opt_step: int, episodes: int, times: list[float]) -> dict:
    """Every metric of one step (`times`: the perf_counter at the start of the step and after
    rollout, skills, hatch, teacher and update)."""
    t0, t1, t2, t3, t4, t5 = times
    rows, rewards = played.rows, played.rewards
    lengths = torch.tensor([t.num_action_tokens for t in rows], dtype=torch.float32, device="cpu")
    prompt_tokens = sum(len(t.token_ids) - t.num_action_tokens for t in rows)
    metrics = {
        **played.metrics,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "reward/success_rate": played.success.float().mean().item(),
        "reward/zero_std_groups": (rewards.std(dim=1) == 0).float().mean().item(),
        **route_counts(routes),
        "advantage/abs_mean": played.advantages.abs().mean().item(),
        "advantage/outcome_abs": shares["outcome_abs"],
        "advantage/teacher_abs": shares["teacher_abs"],
        "teacher/share": shares["teacher_share"],
        **taught.metrics,
        **extra,
        **skills.metrics,
        **hinted.metrics,
        **wins.metrics,
        "episodes/sampled": len(played.attempts) + hinted.episodes + skills.episodes,
        "episodes/rescored": skills.rescored,
        "budget/episodes": episodes,
        **update_metrics(st, rows, n_batch, cfg, opt_step),
        "time/rollout_s": t1 - t0,
        "time/skills_s": t2 - t1,
        "time/teacher_s": t4 - t3,
        "time/update_s": t5 - t4,
        "time/step_s": t5 - t0,
        "throughput/gen_tokens_per_s": played.gen_stats.generated_tokens / max(t1 - t0, 1e-9),
        "throughput/tokens_per_s": (prompt_tokens + lengths.sum().item()) / max(t5 - t0, 1e-9),
    }
    if cfg.hatch.enabled or cfg.route.mode != "off":
        metrics["time/hatch_s"] = t3 - t2
    return metrics


def final_evals(policy: Policy, cfg: RSIPOConfig, run, library: SkillLibrary, multi_turn: bool, gate, hints_for, progress, log, engine,
                step: int) -> None:
    """eval/after.json (with the in-context skills when skills.in_context); with skills.eval_both
    also the other library setting on the same weights: eval/after_skills.json (library in the
    prompts) or eval/after_no_skills.json (none), logged as eval_skills/* metrics at `step`
    (the last step trained)."""
    out, store, pool = run.store.path, run.store, run.pool
    if not (cfg.eval.after and cfg.eval.n > 0):
        return
    if not (out / "eval" / "after.json").exists():
        r = run_eval(policy, cfg, pool, store, step, "after", progress, gate, hints=hints_for, engine=engine)
        log(f"after: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")
    if cfg.skills.eval_both:
        label = "after_no_skills" if cfg.skills.in_context else "after_skills"
        other = None if cfg.skills.in_context else (lambda seeds: library_hints(library, pool, seeds, cfg, multi_turn))
        if not (out / "eval" / f"{label}.json").exists():
            r = run_eval(policy, cfg, pool, store, step, label, progress, gate, hints=other, prefix="eval_skills", engine=engine)
            log(f"{label}: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")


def train(cfg: RSIPOConfig, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run the recipe into `out` (continuing from its last checkpoint when `resume`)."""
    check_curriculum(cfg)  # a bad arm option or tail hint fails before the run directory is touched
    check_anchor(cfg)  # a data-parallel learner refuses the anchor before the run directory is touched
    run = open_run(cfg, out, resume, log, kl_reference=cfg.algo.kl_coef > 0, detail=f"; teacher {cfg.teacher.source}")
    pool, store, policy, optimizer, multi_turn = run.pool, run.store, run.policy, run.optimizer, run.multi_turn
    system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None
    library = SkillLibrary(store.db)  # the `skills` table of the run's ledger.sqlite
    trust = _make_trust(cfg)
    buffer: deque[Attempt] = deque(maxlen=cfg.skills.buffer_size)
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    opt_step, episodes = run.opt_steps, int(run.state.get("episodes", run.start_step * B * G))
    played_before: list[Attempt] = []  # every attempt of the steps before a resume
    if run.state:
        library.restore(run.state["skills"])  # the library as it was at the checkpoint
        trust.load_state_dict(run.state["trust"])
        played_before = [Attempt.from_json(r) for r in store.read_jsonl("replay")]
        buffer.extend(played_before)
        log(f"restored {len(library)} skills and {len(buffer)} replayable attempts (step {run.start_step}/{cfg.train.steps})")
    else:  # a new run (or one resumed before its first checkpoint) starts with an empty library
        library.restore([])
    # skills.in_context: the policy sees its library's skill for each task in rollouts and in every evaluation
    hints_for = (lambda seeds: library_hints(library, pool, seeds, cfg, multi_turn)) if cfg.skills.in_context else None
    engine = make_engine(cfg.rollout, policy)  # samples rollouts and decodes evaluations (skills and teacher use the trainer's module)
    gate = WeightsGate(cfg, store, pool, run.start_step, log, hints=hints_for, engine=engine) if cfg.gate.mode != "off" else None
    if gate is not None:
        gate.start(policy, optimizer, f"{cfg.model.name}{run.origin}")
    skill_gate = None
    if gate is not None and cfg.gate.skills_every:  # the same lineage, truncated once by the WeightsGate
        skill_gate = SkillGate(cfg, pool, gate.lineage, library, lambda lib, seeds: library_hints(lib, pool, seeds, cfg, multi_turn),
                               run.state.get("skills_incumbent"), log, engine=engine)
    prompts = None
    if gate is not None and cfg.gate.prompt_every:  # prompt rounds; a resumed run's PromptGate re-applies the admitted prompt
        prompts = PromptGate(cfg, store, pool, gate.lineage, multi_turn, log, engine=engine, hints=hints_for)
        system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None
    failures: deque[tuple[str, str]] = deque((failure_of(a) for a in played_before if not a.success), maxlen=4)  # recent failures (restored on resume), what prompt proposals read
    rollouts = make_rollouts(cfg, policy, pool, log, engine)  # in this process (through the engine), or on Ray workers
    curriculum = Curriculum.open(cfg, multi_turn, run.state)  # curriculum arms (recursa/curriculum.py); None when off
    anchor, note = make_anchor(cfg, pool, policy.tokenizer)  # demonstrations imitated at every optimizer step (recursa/anchor.py); None when off
    if anchor is not None:
        log(note)
    eval_before(run, cfg, progress, log, hints=hints_for, engine=engine)

    if mid_eval_missing(cfg, store, run.start_step, cfg.train.steps):  # resumed at a checkpoint whose evaluation was cut off
        mid_eval(policy, cfg, pool, store, run.start_step, progress, gate, log, hints=hints_for, engine=engine)

    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    reward_set = RewardSet.from_config(cfg.reward)  # None: the env's reward alone
    last = run.start_step  # the last step trained (train.max_episodes can end the run before train.steps)
    for step in range(run.start_step, cfg.train.steps):
        if not budget_left(cfg, episodes):  # resumed at a checkpoint the cap ended the run at
            break
        times = [time.perf_counter()]
        gen = step_generator(cfg.train.seed, step)
        tasks = curriculum.tasks(step, B, pool.take(1)[0]) if curriculum is not None else None  # the arms' tasks (no tail guidance here: see [hatch])
        seeds = train_seeds(cfg, step) if tasks is None else tasks.seeds
        shown = hints_for(seeds) if hints_for is not None else None  # (B,) the skill hint in each task's prompts, or None

        # ---- rollout and outcome advantages (as GRPO); the attempts join the replay buffer
        played = play(policy, pool, seeds, shown, sampling, gen, system, cfg, multi_turn, step + 1, rollouts, reward_set)
        buffer.extend(played.attempts)
        store.append_jsonl("replay", step + 1, [a.to_json() for a in played.attempts])
        failures.extend(failure_of(a) for a in played.attempts if not a.success)
        routes = group_routes(played.success)  # (B,) all_fail / mixed / all_win
        times.append(time.perf_counter())

        # ---- skills: write K candidates per chosen attempt, reward them by replay, admit the best
        games = None
        if cfg.skills.effect_games:  # candidates are tried on the step's games; each game's group is its reward without them
            games = EffectGames(seeds, [skill_query(a.task, a.contexts[0].observation) for a in played.attempts[::G]], played.rewards.mean(dim=1),
                                lambda s, h: hinted_episode_rewards(policy, pool, s, h, sampling, gen, system, cfg, multi_turn, reward_set))
        skills = learn_skills(policy, played.attempts, list(buffer), library, cfg, system, gen, step + 1, games) if cfg.skills.enabled else SkillStep()
        if skills.log:
            store.append_jsonl("skills", step + 1, skills.log)
        if shown is not None:
            skills.metrics["skills/in_context_frac"] = sum(h is not None for h in shown) / len(shown)
        # ---- gate the library's changes: the incumbent vs the candidate library in context, on gate probes
        if skill_gate is not None and ((step + 1) % cfg.gate.skills_every == 0 or step + 1 == cfg.train.steps):
            skills.metrics.update(skill_gate.check(policy, step + 1))
            skills.metrics["skills/library_size"] = float(len(library))
        times.append(time.perf_counter())

        # ---- all-fail groups: hinted re-rolls (hatch); all-win groups: stored successes (route)
        room = None if cfg.train.max_episodes is None else cfg.train.max_episodes - episodes - len(played.attempts) - skills.episodes
        hinted = hinted_rerolls(policy, pool, played, seeds, shown, library, sampling, gen, cfg, system, multi_turn, step, reward_set, list(buffer),
                                room) if cfg.hatch.enabled else HintedStep()
        wins = win_rows(policy, list(buffer), routes, cfg, system, gen)
        times.append(time.perf_counter())

        # ---- teacher: Delta on every row whose task has a hint, the trust applied, this step's trials
        rows = played.rows + skills.rows + hinted.rows + wins.rows  # the policy's rows first; each part is averaged over its own tokens
        batch = collate(rows, torch.zeros(len(rows), device="cpu"), policy.tokenizer.pad_token_id, policy.device)
        taught = teach(policy, played, skills, library, trust, pool, list(buffer), routes, batch.action_mask[: len(played.rows)], cfg, system, multi_turn, step + 1)
        times.append(time.perf_counter())

        # ---- token advantages, then one update on the policy, writing, hinted and win rows
        imitation, shares, extra = set_advantages(batch, played, skills, hinted, wins, taught, cfg)
        distillation, distill_metrics = distillation_term(batch, played, taught, cfg)
        extra.update(distill_metrics)
        check_finite(step + 1, **{"advantages (outcome x teacher scale)": batch.advantages})
        st = update(policy, optimizer, batch, cfg, gen, opt_step, imitation, learner=run.learner, anchor=anchor, distillation=distillation)
        check_finite(step + 1, loss=st.loss, grad_norm=st.grad_norm)
        opt_step += st.opt_steps
        episodes += len(played.attempts) + hinted.episodes + skills.episodes
        engine.load_weights(policy)  # the rollout engine samples the next step with the new weights
        times.append(time.perf_counter())

        metrics = {**step_metrics(played, skills, hinted, wins, taught, shares, extra, routes, st, len(batch), cfg, opt_step, episodes, times),
                   **rollouts.metrics(), **pool.metrics()}
        if anchor is not None:
            metrics["anchor/nll"] = st.anchor_nll  # the demonstrations' NLL per target token, before each optimizer step's update
        if distillation is not None:
            metrics["loss/distill"] = st.distill  # the distribution term before lam: token mean of w_t D_t, during the update
        if curriculum is not None:  # the arms' pass-rate averages learn from this step's groups
            curriculum.observe(tasks, played.success.tolist())
            metrics.update(curriculum.metrics())
        store.log_metrics(step + 1, metrics)
        store.log_samples(step + 1, [
            {"seed": t.seed, "prompt": t.prompt_text, "completion": t.completion_text, "reward": t.reward, "advantage": float(played.row_adv[i])}
            for i, t in list(enumerate(played.rows))[: cfg.run.log_samples]
        ])
        if progress:
            progress("train", step + 1, cfg.train.steps)
        log(
            f"step {step + 1}/{cfg.train.steps}  reward {metrics['reward/mean']:.3f}  teacher share {shares['teacher_share']:.3f}  skills {len(library)}  "
            f"episodes {metrics['episodes/sampled']}  rollout {metrics['time/rollout_s']:.1f}s  skills {metrics['time/skills_s']:.1f}s  "
            f"teacher {metrics['time/teacher_s']:.1f}s  update {metrics['time/update_s']:.1f}s"
        )
        done = last = step + 1
        final = ends_run(cfg, done, episodes, log)
        if prompts is not None and done % cfg.gate.prompt_every == 0 and failures:
            store.log_metrics(done, prompts.check(policy, done, list(failures), gen))
            system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None  # an admitted system prompt is the run's from now on
        if gate is not None and (done % cfg.gate.every == 0 or final):
            store.log_metrics(done, gate.check(policy, optimizer, done, progress))
        if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or final:
            saved = {"opt_steps": opt_step, "trust": trust.state_dict(), "skills": library.snapshot(), "episodes": episodes}
            if skill_gate is not None:
                saved["skills_incumbent"] = skill_gate.incumbent  # the last accepted library, for a resumed skills gate
            if curriculum is not None:
                saved["curriculum"] = curriculum.state_dict()
            store.save_checkpoint(done, policy, optimizer, saved)
        if not final and mid_eval_due(cfg, done, cfg.train.steps):  # after the checkpoint: a kill during the evaluation loses no training
            mid_eval(policy, cfg, pool, store, done, progress, gate, log, hints=hints_for, engine=engine)
        if final:
            break

    rollouts.close()
    if cfg.train.steps == 0 and store.latest_checkpoint() is None:
        store.save_checkpoint(0, policy, optimizer, {"opt_steps": 0, "trust": trust.state_dict(), "skills": library.snapshot(), "episodes": 0})
    final_evals(policy, cfg, run, library, multi_turn, gate, hints_for, progress, log, engine, step=last)
    engine.close()
    store.close()
    pool.close()
    return out
