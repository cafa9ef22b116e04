"""RSIPO's hinted re-rolls of all-fail groups ([hatch]): a hint (the policy's reflection, a
skill, the walkthrough, a winning episode of the same task) is shown while sampling; the re-rolls
are trained under the un-hinted prompt with a truncated importance weight.

A plug-in of RSIPO's step (recursa/recipes/rsipo.py): its extra rows follow the policy's own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from recursa.agent import clip_hint as _clip, win_hint
from recursa.algorithms.hinted import all_failed, anneal, hinted_token_advantages, truncated_importance_weights
from recursa.config import RSIPOConfig
from recursa.envs import EnvPool
from recursa.generation import SamplingParams, generate
from recursa.models import Policy
from recursa.rewards import RewardSet, score_episodes, score_trajectories
from recursa.rollout import render_prompt, rollout, rollout_episodes
from recursa.skills import (
    BM25Index,
    SkillLibrary,
    parse_skill,
    retrieve_many,
    skill_writing_prompt,
)
from recursa.skills.writing import MARKER
from recursa.trajectory import Trajectory
from recursa.methods.attempts import Attempt, Played, completion_attempts, episode_attempts, score_actions, user_message
from recursa.methods.skills import attempt_text, skill_hint, skill_query
from recursa.methods.base import Extra, Method

# ----------------------------------------------------------------------------- attempts and contexts



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


class HatchMethod(Method):
    """[hatch] as a plug-in: the all-fail groups' hinted re-rolls, rows after the skill writing's."""

    name = "hatch"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return bool(getattr(getattr(cfg, "hatch", None), "enabled", False))

    def rows(self, s, played, room):
        ctx = self.ctx
        library = ctx.find("skills").library
        hinted = hinted_rerolls(ctx.policy, ctx.pool, played, s.seeds, s.hints, library, s.sampling, s.generator, ctx.cfg, s.system, ctx.multi_turn,
                                s.step, ctx.reward_set, played.parts["buffer"], room)
        played.parts["hatch"] = hinted
        return Extra(hinted.rows, hinted.episodes, hinted.metrics)
