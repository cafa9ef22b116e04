"""The RSIPO recipe (recursive self-improving policy optimization), written out.

    for step in range(steps):
        seeds      <- B training seeds (as GRPO)
        [in context <- skills.in_context: per task, the library's best skill, shown to the policy in its own
                      prompts (after the task line / the question, where the teacher's hint goes)]
        rollout    -> B x G attempts: single-turn completions, or multi-turn episodes (one row per turn),
                      in this process or on Ray workers (`distributed`, recursa/distributed/)
        outcome    <- A_outcome from rewards (B, G)                       (+ GiGPO's step term, games)
        buffer     <- this step's attempts join the replay buffer (replay.jsonl, for resume)
        write      <- per group up to `skills.write_per_group` attempts (a success and a failure, where
                      present) are shown to the policy, which samples K candidate skills for each in one
                      batched generate call; parse_skill drops malformed ones (counted, never fatal)
        replay     <- r(s) = mean_tau' y(tau') clip(D(s, tau'), -c, c) over M replayed attempts of other
                      seeds, D = mean over tau''s action tokens of log pi_old(a | ctx + s) - log pi_old(a | ctx);
                      length / invalid penalties; normalised within the K candidates -> the advantage of
                      the writing tokens (x skills.coef); the best candidate enters the library
        [skills gate <- gate.skills_every: the library with this round's new skills vs the incumbent library,
                      both in context, on gate probes half failed / half solved by the incumbent
                      (recipes/gating.py SkillGate); a rejection restores the incumbent library]
        retrieve   <- per task (group): the library's best skill, BM25 over task text + first observation
        teacher    <- Delta_t = log pi_old(a_t | ctx + hint) - log pi_old(a_t | ctx) on every row with a hint
                      (the hint: a skill | the walkthrough or reference answer | a successful sibling)
        trust      <- T_g of each skill group from the agreement trials of earlier steps; this step's trials
                      (sign of mean Delta vs sign of A_outcome) then update the decayed counts
        advantages <- A_t = A_outcome + lam T_g psi(Delta_t)        (or SEED-like imitation weights)
        update     <- grpo.update on one batch: PPO-clip on the action tokens and on the writing tokens
        evaluate, gate, checkpoint (with the trust state and a snapshot of the skill library)

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
  Centred, the applied trust doubled (0.21) with no held-out difference (README, RSIPO section).
* The update aggregates the action rows and the writing rows in one call; their advantages are
  rescaled (`term_scales`) so that the loss is L_policy + coef * L_writing, each averaged over its
  own tokens, and the writing rows never dilute the policy's gradient.

Devices: rewards, outcome advantages, successes and the skills' replay rewards are host
statistics (built from Python values); the teacher's log-probs, Delta, trust per row and the
token advantages live on the policy's device with the batch, and the host statistics are moved
there explicitly where they join them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from recursa.agent import AgentConfig, render_turn
from recursa.algorithms.advantages import compute_advantages
from recursa.algorithms.distill import (
    correlation,
    group_normalise,
    group_offsets,
    pass_rate_weights,
    psi,
    seed_imitation_weights,
    skill_rewards,
    teacher_shift,
    token_advantages,
)
from recursa.algorithms.trust import TrustEstimator, agreement_trials
from recursa.config import RSIPOConfig
from recursa.envs import EnvPool, system_prompt_of
from recursa.generation import SamplingParams, generate, sequence_logprobs, shared_prefix_logprobs
from recursa.models import Policy
from recursa.distributed.rollouts import make_rollouts
from recursa.recipes.common import Progress, eval_before, open_run, run_eval, step_generator
from recursa.recipes.gating import SkillGate, WeightsGate
from recursa.recipes.grpo import Imitation, episode_rows, train_seeds, update, update_metrics
from recursa.rollout import render_prompt, with_hint
from recursa.skills import SkillLibrary, SkillWritingStats, parse_skill, render_trajectory_for_skill, retrieve, retrieve_many, skill_writing_prompt
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
def score_actions(policy: Policy, pairs: list[tuple[list[int], list[int]]], cfg: RSIPOConfig) -> list[torch.Tensor]:
    """log pi(a_t | prompt, a_<t) of every (prompt_ids, action_ids) pair under the current
    weights, no gradient: one (len(action_ids),) tensor per pair. Micro-batched, pairs with
    equal prompts side by side (so the shared-prefix path computes each prompt once)."""
    model = policy.causal_lm
    was_training = model.training
    model.eval()
    logprobs = shared_prefix_logprobs if cfg.train.shared_prefix else sequence_logprobs
    pad = policy.tokenizer.pad_token_id
    device, host = policy.device, torch.device("cpu")
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
    out: list[torch.Tensor] = [torch.zeros(0, device=device)] * len(pairs)
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
        logp, _ = logprobs(model, ids, attn, act, cfg.sampling.temperature, cfg.train.logit_chunk)  # (n, width)
        for j, i in enumerate(idx):
            p, a = pairs[i]
            out[i] = logp[j, len(p) : len(p) + len(a)].clone()
    if was_training:
        model.train()
    return out


def teacher_logprobs(policy: Policy, rows: list[Trajectory], contexts: list[Context], hints: list[str | None], cfg: RSIPOConfig, system: str | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(teacher, student) log-probs of every row's action tokens, at the current weights, no
    gradient: log pi(a_t | context + hint) and log pi(a_t | context), zeros where the hint is
    None. The student context is the row's own prompt ids; the teacher's is the same user
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
    scores = score_actions(policy, pairs, cfg)
    teacher = [torch.zeros(r.num_action_tokens, device=policy.device) for r in rows]
    student = [torch.zeros(r.num_action_tokens, device=policy.device) for r in rows]
    for k, i in enumerate(which):
        student[i], teacher[i] = scores[2 * k], scores[2 * k + 1]
    return teacher, student


# ----------------------------------------------------------------------------- skills


def skill_hint(texts: list[str]) -> str:
    if len(texts) == 1:
        return f"Useful skill from earlier attempts: {texts[0]}"
    return "Useful skills from earlier attempts:\n" + "\n".join(f"- {t}" for t in texts)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def choose_sources(attempts: list[Attempt], groups: int, size: int, per_group: int, gen: torch.Generator) -> list[int]:
    """Attempt indices that get skills written: per group up to `per_group`, a success and a
    failure where present (`alternate`)."""
    chosen = []
    for b in range(groups):
        members = list(range(b * size, (b + 1) * size))
        chosen.extend(alternate(members, [attempts[i].success for i in members], per_group, gen))
    return chosen


@dataclass
class Writing:
    """The K candidate skills written for each source attempt (candidate k of source j at j*K + k)."""

    sources: list[int]
    prompts: list[list[int]]  # per source: the writing prompt ids (with the prefill)
    samples: list  # generation.Sample, K per source
    parsed: list[ParsedSkill]


def write_skills(policy: Policy, attempts: list[Attempt], sources: list[int], cfg: RSIPOConfig, system: str | None, gen: torch.Generator, stats: SkillWritingStats) -> Writing:
    """The policy reads each source attempt and its outcome and samples K candidate skills
    (one batched generate call, n = K); every reply is parsed, malformed ones counted."""
    sc, tok = cfg.skills, policy.tokenizer
    prefill = tok.encode(MARKER, add_special_tokens=False) if sc.prefill else []
    prompts = []
    for j in sources:
        a = attempts[j]
        steps = [(c.observation, t) for c, t in zip(a.contexts, a.texts)] if a.contexts[0].task is not None else [("(the task above)", a.texts[0])]
        text = render_trajectory_for_skill(a.task, steps, a.success, sc.trajectory_chars)
        prompts.append(render_prompt(tok, skill_writing_prompt(text, a.success, sc.max_words), system) + prefill)
    samples = []
    if prompts:
        params = SamplingParams(sc.max_new_tokens, sc.temperature, cfg.sampling.top_p, ("\n",) if sc.prefill else ())
        samples = generate(policy.causal_lm, tok, prompts, params, n=sc.candidates, generator=gen)
    parsed = [parse_skill(tok.decode(s.token_ids, skip_special_tokens=True), sc.max_words, sc.max_chars) for s in samples]
    for p in parsed:
        stats.add(p)
    return Writing(sources, prompts, samples, parsed)


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
class SkillStep:
    """What one step's skill writing produced for the update and the logs."""

    rows: list[Trajectory] = field(default_factory=list)  # writing prompt + candidate tokens, trained when rewarded
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0, device="cpu"))  # (len(rows),) coef x group-normalised reward, host
    admitted: dict[int, int] = field(default_factory=dict)  # skill id -> the attempt it was written from
    log: list[dict] = field(default_factory=list)  # one record per candidate (skills.jsonl)
    metrics: dict[str, float] = field(default_factory=dict)


def learn_skills(policy: Policy, attempts: list[Attempt], buffer: list[Attempt], library: SkillLibrary, cfg: RSIPOConfig, system: str | None,
                 gen: torch.Generator, step: int) -> SkillStep:
    """Write K candidates for each chosen attempt, reward them by replay, admit each source's
    best candidate to the library (with provenance), and make the writing rows."""
    sc, K = cfg.skills, cfg.skills.candidates
    stats = SkillWritingStats()
    sources = choose_sources(attempts, cfg.train.prompts_per_step, cfg.train.group_size, sc.write_per_group, gen)
    writing = write_skills(policy, attempts, sources, cfg, system, gen, stats)
    replay: list[torch.Tensor | None] = [None] * len(sources)
    replayed = [0] * len(sources)
    if sc.replay_reward:
        replay, replayed = replay_rewards(policy, writing, attempts, buffer, cfg, system, gen)
    out, advantages = SkillStep(), []
    for s, j in enumerate(sources):
        src, cands, r = attempts[j], writing.parsed[s * K : (s + 1) * K], replay[s]
        valid = [k for k in range(K) if cands[k].valid]
        if not sc.replay_reward:
            best = valid[0] if valid else None
        else:  # the highest replay reward, if the candidate was replayed at all and clears the bar
            best = max(valid, key=lambda k: (float(r[k]), -k)) if (r is not None and valid) else None
            if best is not None and sc.admit_min_reward is not None and float(r[best]) <= sc.admit_min_reward:
                best = None
        if best is not None:
            sid = library.add(cands[best].text, cfg.env.name, src.seed, step, "success" if src.success else "failure",
                              replay_reward=None if r is None else float(r[best]), created_step=step)
            out.admitted[sid] = j
        adv = group_normalise(r) * sc.coef if (r is not None and sc.coef > 0) else None  # (K,)
        prompt = writing.prompts[s]
        for k in range(K):
            sample = writing.samples[s * K + k]
            if adv is not None and sample.token_ids:
                out.rows.append(Trajectory(cfg.env.name, src.seed, -1, prompt + sample.token_ids, [0] * len(prompt) + [1] * len(sample.token_ids),
                                           [0.0] * len(prompt) + sample.logprobs, float(r[k]), False, finish_reason=sample.finish_reason))
                advantages.append(float(adv[k]))
            out.log.append({"source_seed": src.seed, "source_success": src.success, "candidate": k, "text": cands[k].text, "valid": cands[k].valid,
                            "reason": cands[k].reason, "words": cands[k].words, "reward": None if r is None else float(r[k]),
                            "admitted": k == best, "replayed": replayed[s]})
    out.advantages = torch.tensor(advantages, dtype=torch.float32, device="cpu")
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
    return out


# ----------------------------------------------------------------------------- teacher contexts


def skill_query(task: str, observation: str) -> str:
    """What a task's skills are retrieved by: its task line (single-turn: the question) and
    its first observation."""
    return f"{task} {observation}"


def library_hints(library: SkillLibrary, pool: EnvPool, seeds: list[int], cfg: RSIPOConfig, multi_turn: bool) -> list[str | None]:
    """Per seed, the hint its task is shown with under `skills.in_context`: the library's
    best skills for the task, retrieved as for the teacher; None where none matches. Reads
    each task by resetting one env of the pool (no env is reset for an empty library)."""
    if not len(library):
        return [None] * len(seeds)
    env = pool.take(1)[0]
    queries = []
    for seed in seeds:
        obs = env.reset(seed)
        queries.append(skill_query(env.task if multi_turn else obs, obs))
    found = retrieve_many(library, queries, cfg.skills.retrieve_k, family=cfg.env.name, method=cfg.skills.retrieval)
    return [skill_hint([s.text for s in f]) if f else None for f in found]


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


# ----------------------------------------------------------------------------- the loop


def term_scales(action_mask: torch.Tensor, n: int, agg: str) -> tuple[float, float]:
    """Factors on the advantages of the first n rows (policy) and of the rest (skill writing)
    that turn one aggregation over all rows into the sum of two, each over its own rows:
    token-mean divides by tokens, the seq-mean modes by rows. (1, 1) without writing rows.
    Exact for one mini-batch per epoch; with more, each mini-batch is split in the batch's
    proportions, not its own."""
    if n == action_mask.shape[0]:
        return 1.0, 1.0
    if agg == "token-mean":
        a, b = float(action_mask[:n].sum()), float(action_mask[n:].sum())
    else:
        a, b = float(n), float(action_mask.shape[0] - n)
    return (a + b) / a, (a + b) / b


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


def train(cfg: RSIPOConfig, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run the recipe into `out` (continuing from its last checkpoint when `resume`)."""
    run = open_run(cfg, out, resume, log, kl_reference=cfg.algo.kl_coef > 0, detail=f"; teacher {cfg.teacher.source}")
    pool, store, policy, optimizer, multi_turn = run.pool, run.store, run.policy, run.optimizer, run.multi_turn
    system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None
    library = SkillLibrary(store.db)  # the `skills` table of the run's ledger.sqlite
    trust = _make_trust(cfg)
    buffer: deque[Attempt] = deque(maxlen=cfg.skills.buffer_size)
    start_step, opt_step = run.start_step, run.opt_steps
    if run.state:
        state = run.state
        library.restore(state["skills"])  # the library as it was at the checkpoint
        trust.load_state_dict(state["trust"])
        buffer.extend(Attempt.from_json(r) for r in store.read_jsonl("replay"))
        log(f"restored {len(library)} skills and {len(buffer)} replayable attempts (step {start_step}/{cfg.train.steps})")
    else:  # a new run (or one resumed before its first checkpoint) starts with an empty library
        library.restore([])
    # skills.in_context: the policy sees its library's skill for each task in rollouts and in every evaluation
    hints_for = (lambda seeds: library_hints(library, pool, seeds, cfg, multi_turn)) if cfg.skills.in_context else None
    gate = WeightsGate(cfg, store, pool, start_step, log, hints=hints_for) if cfg.gate.mode != "off" else None
    if gate is not None:
        gate.start(policy, optimizer, f"{cfg.model.name}{run.origin}")
    skill_gate = None
    if gate is not None and cfg.gate.skills_every:  # the same lineage, truncated once by the WeightsGate
        skill_gate = SkillGate(cfg, pool, gate.lineage, library, lambda lib, seeds: library_hints(lib, pool, seeds, cfg, multi_turn),
                               run.state.get("skills_incumbent"), log)
    rollouts = make_rollouts(cfg, policy, pool, log)  # in this process, or on Ray workers
    eval_before(run, cfg, progress, log, hints=hints_for)

    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    tc, sc = cfg.teacher, cfg.skills
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        gen = step_generator(cfg.train.seed, step)
        seeds = train_seeds(cfg, step)
        episode_metrics = {}
        shown = hints_for(seeds) if hints_for is not None else None  # (B,) the skill hint in each task's prompts, or None

        # ---- rollout and outcome advantages (as GRPO) ----------------------------------
        if multi_turn:
            ero = rollouts.episodes(seeds, G, sampling, gen, system, cfg.agent, hints=shown)
            gen_stats = ero.stats
            rewards = torch.tensor([e.total_reward for e in ero.episodes], dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
            advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
            rows, row_adv, episode_metrics = episode_rows(ero.episodes, advantages, cfg)  # one row per turn
            attempts = episode_attempts(ero.episodes, step + 1, cfg.agent, shown)
        else:
            ro = rollouts.rollout(seeds, G, sampling, gen, system, hints=shown)
            gen_stats = ro.stats
            rows = ro.trajectories
            rewards = torch.tensor([t.reward for t in rows], dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
            advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
            row_adv = advantages.view(-1)
            attempts = completion_attempts(rows, step + 1, shown)
        row_attempt = [a for a, att in enumerate(attempts) for _ in att.contexts]  # (rows,) attempt of each row
        row_context = [c for att in attempts for c in att.contexts]
        success = torch.tensor([a.success for a in attempts], device="cpu").view(B, G)  # (B, G)
        buffer.extend(attempts)
        store.append_jsonl("replay", step + 1, [a.to_json() for a in attempts])
        t1 = time.perf_counter()

        # ---- skills: write K candidates per chosen attempt, reward them by replay, admit the best
        skills = learn_skills(policy, attempts, list(buffer), library, cfg, system, gen, step + 1) if sc.enabled else SkillStep()
        if skills.log:
            store.append_jsonl("skills", step + 1, skills.log)
        if shown is not None:
            skills.metrics["skills/in_context_frac"] = sum(h is not None for h in shown) / len(shown)
        # ---- gate the library's changes: the incumbent vs the candidate library in context, on gate probes
        if skill_gate is not None and ((step + 1) % cfg.gate.skills_every == 0 or step + 1 == cfg.train.steps):
            skills.metrics.update(skill_gate.check(policy, step + 1))
            skills.metrics["skills/library_size"] = float(len(library))
        t2 = time.perf_counter()

        # ---- teacher: Delta on every row whose task has a hint ---------------------------
        dev = policy.device
        batch = collate(rows + skills.rows, torch.zeros(len(rows) + len(skills.rows), device="cpu"), policy.tokenizer.pad_token_id, dev)
        n = len(rows)
        mask = batch.action_mask[:n]  # (n, L) the policy rows' action tokens
        delta = torch.zeros_like(mask)  # (n, L)
        trust_rows = torch.zeros(n, device=dev)  # (n,) T_g (x the pass-rate weight) of each row's teacher
        has_hint = torch.zeros(n, dtype=torch.bool, device=dev)
        teacher_metrics: dict[str, float] = {}
        if tc.source != "none":
            hints, groups = teacher_hints(attempts, cfg, library, pool, multi_turn, G)
            row_hints = [hints[a] for a in row_attempt]
            teacher, student = teacher_logprobs(policy, rows, row_context, row_hints, cfg, system)
            logp_teacher, logp_student = torch.zeros_like(mask), torch.zeros_like(mask)  # (n, L), aligned on the action tokens
            logp_teacher[mask.bool()], logp_student[mask.bool()] = torch.cat(teacher), torch.cat(student)
            delta = teacher_shift(logp_teacher, logp_student, mask)  # (n, L)
            has_hint = torch.tensor([h is not None for h in row_hints], device=dev)
            for sid in {g for g in groups if isinstance(g, int)}:
                library.record_use(sid, step + 1, sum(len(attempts[a].contexts) for a in range(len(attempts)) if groups[a] == sid))
            # trust from earlier steps' trials (fixed: OPID-like), x sqrt(p(1-p)) with SC-SDPO weighting
            attempt_trust = torch.tensor([0.0 if g is None else (cfg.trust.fixed if cfg.trust.mode == "fixed" else trust.trust(g)) for g in groups], device=dev)
            if tc.weighting == "pass_rate":
                attempt_trust = attempt_trust * pass_rate_weights(success).reshape(-1).to(dev)
            trust_rows = attempt_trust[row_attempt]
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
            outcome = advantages.reshape(-1).to(dev)  # (attempts,)
            is_source = [skills.admitted.get(g) == a for a, g in enumerate(groups)]
            trials = agreement_trials(groups, mean_delta.tolist(), outcome.tolist(), is_source, cfg.trust.threshold)
            trust.update(trials)
            counts_now = {g: (a_g, n_g) for g, a_g, n_g, _ in trust.state_dict()["groups"]}
            for g in trials:
                if isinstance(g, int):  # the skill's decayed counts, as of its latest trial
                    library.record_trust(g, *counts_now[g])
            teacher_metrics = teacher_summary(delta, mask, has_hint, mean_delta, outcome, attempt_hint, trust_rows, trust, trials)
        t3 = time.perf_counter()

        # ---- token advantages: A_t = A_outcome + lam T_g psi(Delta_t) -------------------------
        teacher_mask = mask * has_hint[:, None]  # (n, L)
        route = "failed" if tc.route == "failed" else None
        row_success = torch.tensor([attempts[a].success for a in row_attempt], device=dev)
        lam_adv = tc.lam if tc.mode == "advantage" else 0.0
        psi_values = psi(delta, teacher_mask, tc.clip, tc.scale, tc.negative_scale)  # (n, L)
        token_adv, shares = token_advantages(row_adv.to(dev), psi_values, trust_rows, lam_adv, mask, route, row_success)  # (n, L)
        # loss = L_policy (over the action tokens) + coef * L_writing (over the writing tokens): the update
        # aggregates all rows at once, and the per-token loss is linear in A, so scaling each part's
        # advantages by its share of the aggregation's denominator keeps the two terms apart
        policy_scale, writing_scale = term_scales(batch.action_mask, n, cfg.algo.agg)
        adv = torch.zeros_like(batch.action_mask)  # (N, L) policy rows, then writing rows
        adv[:n] = token_adv * policy_scale
        if skills.rows:
            adv[n:] = skills.advantages.to(dev)[:, None] * batch.action_mask[n:] * writing_scale
        batch.advantages = adv
        imitation = None
        if tc.mode == "imitation" and tc.source != "none":
            weights = seed_imitation_weights(delta, teacher_mask, tc.imitation_temperature) * trust_rows[:, None]  # (n, L)
            if route == "failed":
                weights = weights * (~row_success).float()[:, None]
            full = torch.zeros_like(batch.action_mask)
            full[:n] = weights * term_scales(batch.action_mask, n, "token-mean")[0]  # the imitation term is a token mean
            imitation = Imitation(full, tc.lam)
            teacher_metrics["teacher/imitation_weight_mean"] = (weights.sum() / teacher_mask.sum().clamp_min(1)).item()

        st = update(policy, optimizer, batch, cfg, gen, opt_step, imitation)
        opt_step += st.opt_steps
        t4 = time.perf_counter()

        lengths = torch.tensor([t.num_action_tokens for t in rows], dtype=torch.float32, device="cpu")
        prompt_tokens = sum(len(t.token_ids) - t.num_action_tokens for t in rows)
        metrics = {
            **episode_metrics,
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "reward/success_rate": success.float().mean().item(),
            "reward/zero_std_groups": (rewards.std(dim=1) == 0).float().mean().item(),
            "advantage/abs_mean": advantages.abs().mean().item(),
            "advantage/outcome_abs": shares["outcome_abs"],
            "advantage/teacher_abs": shares["teacher_abs"],
            "teacher/share": shares["teacher_share"],
            **teacher_metrics,
            **skills.metrics,
            "budget/episodes": (step + 1) * B * G,
            **update_metrics(st, rows, len(batch), cfg, opt_step),
            "time/rollout_s": t1 - t0,
            "time/skills_s": t2 - t1,
            "time/teacher_s": t3 - t2,
            "time/update_s": t4 - t3,
            "time/step_s": t4 - t0,
            "throughput/gen_tokens_per_s": gen_stats.generated_tokens / max(t1 - t0, 1e-9),
            "throughput/tokens_per_s": (prompt_tokens + lengths.sum().item()) / max(t4 - t0, 1e-9),
            **rollouts.metrics(),
        }
        store.log_metrics(step + 1, metrics)
        store.log_samples(step + 1, [
            {"seed": t.seed, "prompt": t.prompt_text, "completion": t.completion_text, "reward": t.reward, "advantage": float(row_adv[i])}
            for i, t in list(enumerate(rows))[: cfg.run.log_samples]
        ])
        if progress:
            progress("train", step + 1, cfg.train.steps)
        log(
            f"step {step + 1}/{cfg.train.steps}  reward {metrics['reward/mean']:.3f}  teacher share {shares['teacher_share']:.3f}  "
            f"skills {len(library)}  rollout {t1 - t0:.1f}s  skills {t2 - t1:.1f}s  teacher {t3 - t2:.1f}s  update {t4 - t3:.1f}s"
        )
        done = step + 1
        if gate is not None and (done % cfg.gate.every == 0 or done == cfg.train.steps):
            store.log_metrics(done, gate.check(policy, optimizer, done, progress))
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps and cfg.eval.n > 0:
            r = run_eval(policy, cfg, pool, store, done, f"step_{done:04d}", progress, gate, hints=hints_for)
            log(f"eval @ {done}: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}]")
        if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == cfg.train.steps:
            saved = {"opt_steps": opt_step, "trust": trust.state_dict(), "skills": library.snapshot()}
            if skill_gate is not None:
                saved["skills_incumbent"] = skill_gate.incumbent  # the last accepted library, for a resumed skills gate
            store.save_checkpoint(done, policy, optimizer, saved)

    rollouts.close()
    if cfg.train.steps == 0 and store.latest_checkpoint() is None:
        store.save_checkpoint(0, policy, optimizer, {"opt_steps": 0, "trust": trust.state_dict(), "skills": library.snapshot()})
    if cfg.eval.after and cfg.eval.n > 0 and not (out / "eval" / "after.json").exists():
        r = run_eval(policy, cfg, pool, store, cfg.train.steps, "after", progress, gate, hints=hints_for)
        log(f"after: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")
    store.close()
    pool.close()
    return out
