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
                      GRPO (methods/gating.py PromptGate; with skills.in_context, scored with the skills shown)]
        [skills gate <- gate.skills_every: the library with this round's new skills vs the incumbent library,
                      both in context, on gate probes half failed / half solved by the incumbent
                      (methods/gating.py SkillGate); a rejection restores the incumbent library]
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

`train` is that loop. Each phase lives in a module of its own under recursa/methods/: the attempts
and the rollout (`attempts.play`), skill writing and replay (`skills.learn_skills`), hinted re-rolls
(`hatch.hinted_rerolls`), stored wins (`wins.win_rows`), the teacher and trust (`teacher.teach`,
`teacher.distillation_term`); this module keeps the loop, the token advantages (`set_advantages`),
the step's metrics and the final evaluations. The math they call is in recursa/algorithms/ (distill,
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

import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from recursa.algorithms.distill import psi, seed_imitation_weights, token_advantages
from recursa.algorithms.losses import part_scales
from recursa.algorithms.routing import group_routes, route_counts
from recursa.anchor import check_anchor, make_anchor
from recursa.config import RSIPOConfig
from recursa.curriculum import Curriculum, check_curriculum
from recursa.engines import make_engine
from recursa.envs import system_prompt_of
from recursa.generation import SamplingParams
from recursa.models import Policy
from recursa.distributed.rollouts import make_rollouts
from recursa.recipes.common import Progress, budget_left, check_finite, ends_run, eval_before, mid_eval, mid_eval_due, mid_eval_missing, open_run, run_eval, step_generator
from recursa.methods.gating import PromptGate, SkillGate, WeightsGate
from recursa.rewards import RewardSet
from recursa.recipes.grpo import Imitation, UpdateStats, train_seeds, update, update_metrics
from recursa.skills import SkillLibrary
from recursa.trajectory import collate

# RSIPO's phases, each in a module of recursa/methods/; their names stay importable from here
from recursa.methods.attempts import (  # noqa: F401
    Context, user_message, Attempt, episode_attempts, failure_of, completion_attempts, score_actions, Played, play,
)
from recursa.methods.skills import (  # noqa: F401
    skill_hint, alternate, choose_sources, choose_contrasts, Writing, attempt_text, episode_actions, curated, write_skills, replay_rewards, EffectGames, effect_rewards, hinted_episode_rewards, SkillStep, admit, retire_useless, learn_skills, skill_query, task_hints, library_hints,
)
from recursa.methods.hatch import (  # noqa: F401
    HintedStep, reflection_hints, oracle_hint, win_hints, hatch_hints, hinted_rerolls,
)
from recursa.methods.wins import (  # noqa: F401
    WinStep, win_rows,
)
from recursa.methods.teacher import (  # noqa: F401
    teacher_logprobs, teacher_hints, TeacherStep, critical_row_weights, teach, distillation_term, make_trust, teacher_summary,
)
from recursa.algorithms.trust import agreement_trials  # noqa: F401
from recursa.generation import generate  # noqa: F401
from recursa.rollout import rollout_episodes  # noqa: F401
from recursa.skills import ParsedSkill, parse_skill  # noqa: F401

# ----------------------------------------------------------------------------- attempts and contexts


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


def term_scales(action_mask: torch.Tensor, n: int, agg: str) -> tuple[float, float]:
    """Factors on the advantages of the first n rows (policy) and of the rest (skill writing):
    `losses.part_scales` with two parts."""
    policy_scale, writing_scale = part_scales(action_mask, [n, action_mask.shape[0] - n], agg)
    return policy_scale, writing_scale


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
    trust = make_trust(cfg)
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
