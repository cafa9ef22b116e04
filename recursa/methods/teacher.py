"""RSIPO's self-teacher: the policy re-scores its sampled actions with a hint in its context
(a skill, the walkthrough or reference answer, a successful sibling); Delta_t, the log-probability
gain, becomes a token advantage scaled by the empirical-Bayes trust of its skill group, or an
imitation weight, or (teacher.mode = 'distribution') a distillation term toward the hinted top-k.

`TeacherMethod` ("teacher") is the plug-in that shapes RSIPO's batch (recursa/recipes/rsipo.py):
the token advantages of every part (`set_advantages`), the imitation and distillation terms,
and the trust counts it checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recursa.agent import clip_hint as _clip
from recursa.algorithms.distill import (
    psi,
    seed_imitation_weights,
    token_advantages,
    correlation,
    group_offsets,
    pass_rate_weights,
    teacher_shift,
)
from recursa.algorithms.losses import part_scales
from recursa.algorithms.routing import critical_weights, divergence_turn, route_gate
from recursa.algorithms.trust import TrustEstimator, agreement_trials
from recursa.config import RSIPOConfig
from recursa.envs import EnvPool
from recursa.models import Policy
from recursa.recipes.grpo import Distillation, Imitation
from recursa.recipes.common import check_finite
from recursa.methods.base import Method, Shaping
from recursa.rollout import render_prompt
from recursa.skills import (
    SkillLibrary,
    retrieve,
)
from recursa.trajectory import Trajectory
from recursa.methods.attempts import Attempt, Context, Played, score_actions, user_message
from recursa.methods.skills import SkillStep, skill_hint, skill_query
from recursa.methods.hatch import HintedStep
from recursa.methods.wins import WinStep

# ----------------------------------------------------------------------------- attempts and contexts



def student_pairs(tok, rows: list[Trajectory], contexts: list[Context], hints: list[str | None], cfg: RSIPOConfig, system: str | None) -> list[tuple[list[int], list[int]]]:
    """(student prompt ids, action ids) of every row with a hint, in row order: the row's own
    prompt, or the bare message re-rendered where the policy saw a skill in context."""
    pairs = []
    for row, ctx, hint in zip(rows, contexts, hints):
        if hint is None:
            continue
        first = row.action_mask.index(1)
        pairs.append((row.token_ids[:first] if ctx.hint is None else render_prompt(tok, user_message(ctx, cfg.agent), system), row.token_ids[first:]))
    return pairs


def pull_metrics(teacher: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """How far an update moved the student toward a fixed teacher on the same tokens (1-D
    tensors of log-probs, one entry per token): the mean |teacher - student| before and after,
    and the share of the tokens where teacher != student before whose student log-prob moved
    toward the teacher's (sign(after - before) == sign(teacher - before)); nan when empty."""
    if teacher.numel() == 0:
        return {"teacher/abs_gap_before": float("nan"), "teacher/abs_gap_after": float("nan"), "teacher/toward_frac": float("nan")}
    gap = teacher - before
    moved = after - before
    live = (gap != 0) & (moved != 0)
    toward = ((torch.sign(moved) == torch.sign(gap)) & live).sum().item() / live.sum().item() if live.any() else float("nan")
    return {"teacher/abs_gap_before": gap.abs().mean().item(), "teacher/abs_gap_after": (teacher - after).abs().mean().item(), "teacher/toward_frac": toward}


def teacher_logprobs(policy: Policy, rows: list[Trajectory], contexts: list[Context], hints: list[str | None], cfg: RSIPOConfig, system: str | None,
                     topk: int = 0, topk_from: str = "teacher", students: list[tuple[list[int], list[int]]] | None = None):
    """(teacher, student) log-probs of every row's action tokens, at the current weights, no
    gradient: log pi(a_t | context + hint) and log pi(a_t | context), zeros where the hint is
    None; with `topk = k` a third list, the teacher's k most likely tokens at each action
    position, (ids, log-probs) of shape (actions, k) per row (zeros where the hint is None);
    `topk_from = "student"`: the ids are the student's k most likely (SDPO), the log-probs the teacher's at them.
    The student context is the row's own prompt ids; the teacher's is the same user
    message rendered again with the hint inserted, through the same chat template; the action
    ids are the row's, untouched. A row whose policy saw a skill in context (ctx.hint) has the
    bare message re-rendered as its student context, so Delta is always hint vs no hint (and
    a skill teacher with that same skill scores exactly the row's prompt)."""
    tok = policy.tokenizer
    pairs, which = [], []
    students = student_pairs(tok, rows, contexts, hints, cfg, system) if students is None else students  # `student_pairs` of these rows, when the caller has them
    for i, (ctx, hint) in enumerate(zip(contexts, hints)):
        if hint is None:
            continue
        prompt, actions = students[len(which)]
        pairs.append((prompt, actions))
        pairs.append((render_prompt(tok, user_message(ctx, cfg.agent, hint), system), actions))
        which.append(i)
    if topk and topk_from == "student":  # the student's top-k ids, then the teacher's log-probs at them
        s_scores, s_tops = score_actions(policy, pairs[0::2], cfg, topk)
        t_scores, t_tops = score_actions(policy, pairs[1::2], cfg, at_ids=[ids for ids, _ in s_tops])
        scores, tops = [x for st in zip(s_scores, t_scores) for x in st], [x for st in zip(s_tops, t_tops) for x in st]
    else:
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
class TeacherStep:
    """The self-teacher's verdict on one step's policy rows."""

    delta: torch.Tensor  # (n, L) Delta_t on the action tokens (centred with teacher.center)
    trust_rows: torch.Tensor  # (n,) the trust applied to each row (x pass-rate, route and critical-step weights)
    has_hint: torch.Tensor  # (n,) bool: the row's task had a teacher hint
    metrics: dict[str, float] = field(default_factory=dict)
    top_ids: torch.Tensor | None = None  # (n, L, k) teacher.mode "distribution": the hinted teacher's k most likely tokens per action position
    top_logp: torch.Tensor | None = None  # (n, L, k) their log-probs under the teacher
    pull: tuple | None = None  # teacher.measure_pull: (student pairs, teacher log-probs, student log-probs), the log-probs (tokens,) concatenated over the pairs


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
    students = student_pairs(policy.tokenizer, played.rows, played.row_context, row_hints, cfg, system)
    teacher, student, *tops = teacher_logprobs(policy, played.rows, played.row_context, row_hints, cfg, system, topk, tc.topk_from, students)
    logp_teacher, logp_student = torch.zeros_like(mask), torch.zeros_like(mask)  # (n, L), aligned on the action tokens
    logp_teacher[mask.bool()], logp_student[mask.bool()] = torch.cat(teacher), torch.cat(student)
    top_ids = top_logp = None
    if topk:  # (n, L, k), aligned on the action tokens like Delta
        top_ids = torch.zeros((*mask.shape, topk), dtype=torch.long, device=dev)
        top_logp = torch.zeros((*mask.shape, topk), device=dev)
        top_ids[mask.bool()], top_logp[mask.bool()] = torch.cat([i for i, _ in tops[0]]), torch.cat([v for _, v in tops[0]])
    pull = None
    if tc.measure_pull:  # the hinted rows' tokens, to score again after the update
        hinted = [i for i, h in enumerate(row_hints) if h is not None]
        empty = torch.zeros(0, device=dev)
        pull = (students, torch.cat([teacher[i] for i in hinted]) if hinted else empty, torch.cat([student[i] for i in hinted]) if hinted else empty)
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
    return TeacherStep(delta, trust_rows, has_hint, metrics, top_ids, top_logp, pull)


# ----------------------------------------------------------------------------- advantages


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


def make_trust(cfg: RSIPOConfig) -> TrustEstimator:
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


class TeacherMethod(Method):
    """RSIPO's self-teacher and trust as a plug-in: after the batch is collated it computes
    Delta on the policy's hinted rows and the trust applied to them, sets the token advantages
    of every part (the policy's rows, then the skills', hatch's and the stored wins' rows), and
    returns the imitation and distillation terms the update adds."""

    name = "teacher"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return hasattr(cfg, "teacher")  # an RSIPO config (teacher.source = 'none' still sets the token advantages)

    def open(self) -> None:
        self.trust = make_trust(self.ctx.cfg)
        if self.ctx.run.state:
            self.trust.load_state_dict(self.ctx.run.state["trust"])
        self.distilling = False
        self.pull = None

    def shape(self, s, batch, played):
        ctx, cfg = self.ctx, self.ctx.cfg
        skills, hinted, wins = played.parts.get("skills", SkillStep()), played.parts.get("hatch", HintedStep()), played.parts.get("wins", WinStep())
        library = ctx.find("skills").library
        taught = teach(ctx.policy, played, skills, library, self.trust, ctx.pool, played.parts["buffer"], played.routes, batch.action_mask[: len(played.rows)],
                       cfg, s.system, ctx.multi_turn, s.step + 1)
        imitation, shares, extra = set_advantages(batch, played, skills, hinted, wins, taught, cfg)
        distillation, distill_metrics = distillation_term(batch, played, taught, cfg)
        extra.update(distill_metrics)
        check_finite(s.step + 1, **{"advantages (outcome x teacher scale)": batch.advantages})
        self.distilling = distillation is not None
        self.pull = taught.pull
        metrics = {"advantage/outcome_abs": shares["outcome_abs"], "advantage/teacher_abs": shares["teacher_abs"], "teacher/share": shares["teacher_share"],
                   **taught.metrics, **extra}
        return Shaping(imitation, distillation, metrics)

    def after_update(self, step, played, stats) -> dict:
        # the distribution term before lam: token mean of w_t D_t, during the update
        metrics = {"loss/distill": stats.distill} if self.distilling else {}
        if self.pull is not None:  # teacher.measure_pull: the same tokens under the updated student
            pairs, teacher, before = self.pull
            scores = score_actions(self.ctx.policy, pairs, self.ctx.cfg) if pairs else []
            after = torch.cat(scores) if scores else torch.zeros(0, device=teacher.device)
            metrics.update(pull_metrics(teacher, before, after))
            self.pull = None
        return metrics

    def state_dict(self) -> dict:
        return {"trust": self.trust.state_dict()}

