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

`train` is GRPO's step loop (recursa/recipes/loop.py, `train_loop`) run with the `RSIPO` recipe:
RSIPO's sampler (`attempts.play`), its own metrics, and the methods of `RSIPO_METHODS`, each a
plug-in in a module of its own under recursa/methods/, acting at the loop's hooks:

    curriculum, anchor, gate   GRPO's methods, as in a GRPO run (the gate also takes the in-context skills)
    replay   (attempts.py)     after_sample: the attempts join the buffer and replay.jsonl
    skills   (skills.py)       eval_hints / hints: in-context skills; rows: writing rows, the skills gate;
                               state: the library and the skills incumbent; close: skills.eval_both
    hatch    (hatch.py)        rows: hinted re-rolls of the all-fail groups
    wins     (wins.py)         rows: stored wins for the all-win groups
    teacher  (teacher.py)      shape: Delta, trust, `set_advantages` over every part, the imitation and
                               distribution terms; state: the trust counts

This module keeps the recipe's own parts: the step's metrics, the log line, and what a checkpoint
holds beyond the methods' state (the episode count). The math the methods call is in
recursa/algorithms/ (distill, trust, hinted, routing) and recursa/skills/ (writing, retrieval,
curator).

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

from pathlib import Path
from typing import Callable

import torch

from recursa.algorithms.losses import part_scales
from recursa.algorithms.routing import route_counts
from recursa.config import RSIPOConfig
from recursa.envs import system_prompt_of
from recursa.recipes.common import Progress, open_run
from recursa.recipes.loop import Recipe, StepTimes, train_loop
from recursa.rewards import RewardSet
from recursa.recipes.grpo import Imitation, UpdateStats, train_seeds, update, update_metrics  # noqa: F401  (tests and scripts import them from here)

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
    combine_imitation, set_advantages,
)
from recursa.algorithms.trust import agreement_trials  # noqa: F401
from recursa.generation import generate  # noqa: F401
from recursa.rollout import rollout_episodes  # noqa: F401
from recursa.skills import ParsedSkill, parse_skill  # noqa: F401

# ----------------------------------------------------------------------------- attempts and contexts


def term_scales(action_mask: torch.Tensor, n: int, agg: str) -> tuple[float, float]:
    """Factors on the advantages of the first n rows (policy) and of the rest (skill writing):
    `losses.part_scales` with two parts."""
    policy_scale, writing_scale = part_scales(action_mask, [n, action_mask.shape[0] - n], agg)
    return policy_scale, writing_scale


def step_metrics(played: Played, st: UpdateStats, n_batch: int, cfg: RSIPOConfig, opt_step: int, t: StepTimes) -> dict:
    """RSIPO's own metrics of one step: its attempts and rewards, the routes, the update's, and
    the times of its stages (the methods add theirs: skills/*, hatch/*, teacher/*, trust/*)."""
    rows, rewards = played.rows, played.rewards
    lengths = torch.tensor([r.num_action_tokens for r in rows], dtype=torch.float32, device="cpu")
    prompt_tokens = sum(len(r.token_ids) - r.num_action_tokens for r in rows)
    metrics = {
        **played.metrics,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "reward/success_rate": played.success.float().mean().item(),
        "reward/zero_std_groups": (rewards.std(dim=1) == 0).float().mean().item(),
        **route_counts(played.routes),
        "advantage/abs_mean": played.advantages.abs().mean().item(),
        **update_metrics(st, rows, n_batch, cfg, opt_step),
        "time/rollout_s": t.sampled - t.start,
        "time/skills_s": t.rows.get("skills", 0.0),
        "time/teacher_s": t.shaped - t.rows_done,
        "time/update_s": t.end - t.shaped,
        "time/step_s": t.end - t.start,
        "throughput/gen_tokens_per_s": played.gen_stats.generated_tokens / max(t.sampled - t.start, 1e-9),
        "throughput/tokens_per_s": (prompt_tokens + lengths.sum().item()) / max(t.end - t.start, 1e-9),
    }
    if cfg.hatch.enabled or cfg.route.mode != "off":
        metrics["time/hatch_s"] = t.rows.get("hatch", 0.0) + t.rows.get("wins", 0.0)
    return metrics


def summary(cfg: RSIPOConfig, done: int, m: dict, st, played, t, methods) -> str:
    return (f"step {done}/{cfg.train.steps}  reward {m['reward/mean']:.3f}  teacher share {m['teacher/share']:.3f}  skills {len(methods.find('skills').library)}  "
            f"episodes {m['episodes/sampled']}  rollout {m['time/rollout_s']:.1f}s  skills {m['time/skills_s']:.1f}s  "
            f"teacher {m['time/teacher_s']:.1f}s  update {m['time/update_s']:.1f}s")


def play_step(ctx, s) -> Played:
    """RSIPO's sample stage: B x G attempts of the step's tasks, scored, with GRPO's outcome advantages
    (no reward advantage offsets: self_consistency's penalty is GRPO's `play_replies` only)."""
    return play(ctx.policy, ctx.pool, s.seeds, s.hints, s.sampling, s.generator, s.system, ctx.cfg, ctx.multi_turn, s.step + 1, ctx.rollouts, ctx.reward_set)


# GRPO's methods that RSIPO's config can switch on, then RSIPO's own, in the order every hook
# calls them (rloop and algo.igrpo are options of the grpo recipe only). The replay buffer comes
# before the gate (a resumed gate's prompt rounds read its failures); the skills come after the
# gate (the skills gate joins the weights gate's lineage) and before hatch and wins, whose rows
# follow the writing rows; the teacher shapes the batch all of them made.
RSIPO_METHODS = ["curriculum", "anchor", "replay", "gate", "skills", "hatch", "wins", "teacher"]

RSIPO = Recipe(
    name="rsipo",
    methods=RSIPO_METHODS,
    open=lambda cfg, out, resume, log: open_run(cfg, out, resume, log, kl_reference=cfg.algo.kl_coef > 0, detail=f"; teacher {cfg.teacher.source}"),
    rewards=lambda cfg, run: RewardSet.from_config(cfg.reward),  # None: the env's reward alone
    play=lambda ctx, s: play_step(ctx, s),
    metrics=lambda *a: step_metrics(*a),
    summary=lambda *a: summary(*a),
    system_prompt=lambda cfg, pool: system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None,
    state=lambda cfg, reward_set, episodes: {"episodes": episodes},
    initial_state=lambda methods: {"trust": methods.find("teacher").trust.state_dict(), "skills": methods.find("skills").library.snapshot(), "episodes": 0},
    update=lambda *a, **k: update(*a, **k),  # looked up at each step, so a patched rsipo.update is the one called
)


def train(cfg: RSIPOConfig, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run the recipe into `out` (continuing from its last checkpoint when `resume`): the shared
    step loop (recipes/loop.py) with RSIPO's sampler, metrics and `RSIPO_METHODS`."""
    return train_loop(RSIPO, cfg, out, resume, progress, log)
