"""RSIPO's skills: the policy writes candidate skills from chosen attempts, each candidate is
rewarded by replay (how much it raises the log-probability of earlier successful actions and
lowers it in failed ones) or by its effect on related games, the best enters the library, and the
library's skill for a task is retrieved into prompts.

`SkillsMethod` ("skills") is the plug-in that runs them in RSIPO's step (recursa/recipes/rsipo.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from recursa.algorithms.distill import (
    group_normalise,
    penalised,
    skill_effect,
    skill_rewards,
)
from recursa.config import RSIPOConfig
from recursa.envs import EnvPool
from recursa.generation import SamplingParams, generate
from recursa.models import Policy
from recursa.rewards import RewardSet, score_episodes, score_trajectories
from recursa.rollout import render_prompt, rollout, rollout_episodes
from recursa.skills import (
    SkillLibrary,
    SkillWritingStats,
    contrastive_writing_prompt,
    parse_skill,
    related,
    render_trajectory_for_skill,
    retrieve_many,
    skill_writing_prompt,
)
from recursa.skills.curator import junk_reason, near_duplicate, retire_reason, rule_form, single_action
from recursa.skills.writing import MARKER, ParsedSkill
from recursa.trajectory import Trajectory
from recursa.methods.attempts import Attempt, score_actions, user_message
from recursa.methods.base import Extra, Method
from recursa.methods.gating import SkillGate
from recursa.recipes.common import run_eval

# ----------------------------------------------------------------------------- attempts and contexts



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


class SkillsMethod(Method):
    """RSIPO's skill library as a plug-in: it holds the library (restored from the checkpoint),
    shows its skill for each task in the policy's prompts and evaluations (skills.in_context),
    writes and rewards candidates after sampling (their writing rows join the update), gates the
    library's changes (gate.skills_every, `gating.SkillGate`), and at the end evaluates the final
    weights with the other library setting too (skills.eval_both)."""

    name = "skills"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return hasattr(cfg, "skills")  # an RSIPO config (skills.enabled = false still counts episodes/rescored and keeps the library)

    def library_hints(self, library: SkillLibrary, seeds: list[int]) -> list[str | None]:
        return library_hints(library, self.ctx.pool, seeds, self.ctx.cfg, self.ctx.multi_turn)

    def eval_hints(self):
        # skills.in_context: the policy sees its library's skill for each task in rollouts and in every evaluation
        return (lambda seeds: self.library_hints(self.library, seeds)) if self.ctx.cfg.skills.in_context else None

    def open(self) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        self.library = SkillLibrary(ctx.store.db)  # the `skills` table of the run's ledger.sqlite
        self.library.restore(ctx.run.state["skills"] if ctx.run.state else [])  # as at the checkpoint; a new run starts empty
        if ctx.run.state:
            ctx.log(f"restored {len(self.library)} skills (step {ctx.start_step}/{cfg.train.steps})")
        self.gate = None
        gate = ctx.find("gate")
        if gate is not None and cfg.gate.skills_every:  # the weights gate's lineage, truncated once by the WeightsGate
            self.gate = SkillGate(cfg, ctx.pool, gate.weights.lineage, self.library, self.library_hints, ctx.run.state.get("skills_incumbent"),
                                  ctx.log, engine=ctx.engine)
        self.last = ctx.start_step

    def hints(self, step, seeds, hints, sampling, generator, system_prompt):
        # the in-context skill of each task, or none: RSIPO takes no tail hints from the curriculum (see [hatch])
        shown = self.eval_hints()
        return (shown(seeds), {}) if shown is not None else (None, {})

    def rows(self, s, played, room):
        ctx, cfg = self.ctx, self.ctx.cfg
        G = cfg.train.group_size
        games = None
        if cfg.skills.effect_games:  # candidates are tried on the step's games; each game's group is its reward without them
            games = EffectGames(s.seeds, [skill_query(a.task, a.contexts[0].observation) for a in played.attempts[::G]], played.rewards.mean(dim=1),
                                lambda seeds, h: hinted_episode_rewards(ctx.policy, ctx.pool, seeds, h, s.sampling, s.generator, s.system, cfg,
                                                                        ctx.multi_turn, ctx.reward_set))
        buffer = played.parts["buffer"]
        skills = learn_skills(ctx.policy, played.attempts, buffer, self.library, cfg, s.system, s.generator, s.step + 1, games) if cfg.skills.enabled else SkillStep()
        if skills.log:
            ctx.store.append_jsonl("skills", s.step + 1, skills.log)
        if s.hints is not None:
            skills.metrics["skills/in_context_frac"] = sum(h is not None for h in s.hints) / len(s.hints)
        # gate the library's changes: the incumbent vs the candidate library in context, on gate probes
        if self.gate is not None and ((s.step + 1) % cfg.gate.skills_every == 0 or s.step + 1 == cfg.train.steps):
            skills.metrics.update(self.gate.check(ctx.policy, s.step + 1))
            skills.metrics["skills/library_size"] = float(len(self.library))
        played.parts["skills"] = skills
        return Extra(skills.rows, skills.episodes, {**skills.metrics, "episodes/rescored": skills.rescored})

    def end_step(self, end):
        self.last = end.done
        return {}

    def state_dict(self) -> dict:
        out = {"skills": self.library.snapshot()}
        if self.gate is not None:
            out["skills_incumbent"] = self.gate.incumbent  # the last accepted library, for a resumed skills gate
        return out

    def close(self) -> None:
        """skills.eval_both: the final weights with the other library setting too, eval/after_skills.json
        (library in the prompts) or eval/after_no_skills.json (none), as eval_skills/* at the last step."""
        ctx, cfg = self.ctx, self.ctx.cfg
        if not (cfg.eval.after and cfg.eval.n > 0 and cfg.skills.eval_both):
            return
        label = "after_no_skills" if cfg.skills.in_context else "after_skills"
        other = None if cfg.skills.in_context else (lambda seeds: self.library_hints(self.library, seeds))
        if not (ctx.store.path / "eval" / f"{label}.json").exists():
            r = run_eval(ctx.policy, cfg, ctx.pool, ctx.store, self.last, label, ctx.progress, ctx.methods.gate, hints=other, prefix="eval_skills",
                         engine=ctx.engine)
            ctx.log(f"{label}: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")
