"""The step loop the GRPO and RSIPO recipes share (`train_loop`), parameterised by a `Recipe`:
how the recipe samples and scores a step, what its own metrics are, and the named list of
methods (recursa/methods/) that do everything else.

    for step in range(steps):
        1 tasks      <- a method's (the curriculum's), else B seeds of the train split;
                        methods may set the prompts' hints (iGRPO's drafts, RSIPO's in-context skills)
        2 sample     -> recipe.play: B x G rollouts, scored, with outcome advantages
                        methods see them (the replay buffer, the prompt gate's failures)
        3 rows       <- every method's extra rows after the policy's own (skill writing, hinted
                        re-rolls, stored wins), in the methods' order
        4 shape      <- collate; one method may set token advantages over the whole batch and
                        add imitation / distillation terms (RSIPO's teacher and trust)
        5 update     <- grpo.update (+ a method's update term: the anchor)
        6 publish    -> the new weights to the rollout engine
        7 record     -> metrics, samples; the methods' end of step (gates, RLoop's fine-tune);
                        the checkpoint with every method's state; the evaluation every eval.every steps

The loop never names a method; a recipe is a `Recipe` value (recipes/grpo.py `GRPO`,
recipes/rsipo.py `RSIPO`). Every random draw of step k comes from the generator seeded by
(train.seed, k), drawn in the order above, so a resumed run replays an uninterrupted one.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from recursa.algorithms.objectives import Outcomes
from recursa.apo_reference import open_reference_sample
from recursa.config import OUTCOME_OBJECTIVES
from recursa.distributed.rollouts import make_rollouts
from recursa.engines import make_engine
from recursa.envs import split_seed
from recursa.generation import SamplingParams
from recursa.methods.base import RunContext, StepEnd, StepInputs, check_methods, open_methods
from recursa.recipes.common import Progress, budget_left, check_finite, ends_run, eval_before, mid_eval, mid_eval_due, mid_eval_missing, run_eval, step_generator
from recursa.trajectory import collate


def train_seeds(cfg, step: int) -> list[int]:
    """B training-task seeds for `step`: a seeded shuffle of the train range, disjoint
    from every held-out range by construction."""
    rng = random.Random(cfg.train.seed * 7919 + step)
    return [split_seed("train", rng.randrange(10_000_000)) for _ in range(cfg.train.prompts_per_step)]


def step_outcomes(cfg, played, seeds=None, reference=None) -> Outcomes | None:
    """What the sequence objectives ('rebel', 'nft', 'apo') read of each sequence's outcome; None for the others.
    `reference` (recursa.apo_reference.ReferenceSample, algo.apo_values = 'reference'): A*-PO's V*
    of each of the step's task `seeds` from the stored sample of the reference policy."""
    if cfg.algo.objective not in OUTCOME_OBJECTIVES:
        return None
    B, G = played.rewards.shape
    values = None
    if reference is not None:
        if seeds is None or len(seeds) != B:
            raise ValueError(f"V* from the reference sample needs the step's {B} task seeds, got {None if seeds is None else len(seeds)}")
        values = reference.values(seeds, cfg.algo.apo_value_beta)  # (B,)
    return Outcomes(played.rewards, torch.tensor(played.success, dtype=torch.float32, device="cpu").view(B, G),
                    torch.tensor(played.row_seq, dtype=torch.long, device="cpu"), values)


@dataclass
class StepTimes:
    """perf_counter stamps of one step (`rows`: seconds each method's rows took)."""

    start: float = 0.0
    sampled: float = 0.0  # after sampling and the methods' after_sample
    rows: dict = field(default_factory=dict)
    rows_done: float = 0.0
    shaped: float = 0.0
    updated: float = 0.0  # after the update and the methods' after_update, before publishing
    end: float = 0.0  # after publishing


@dataclass
class Recipe:
    """What differs between the recipes that share `train_loop`."""

    name: str
    methods: list[str]  # the built-in methods a run of this recipe may plug in, in hook order
    open: Callable[[Any, Path, bool, Callable], Any]  # (cfg, out, resume, log) -> recipes.common.OpenedRun
    rewards: Callable[[Any, Any], Any]  # (cfg, run) -> rewards.RewardSet or None
    play: Callable  # (ctx: RunContext, s: StepInputs) -> the step's Played (rows as .trajs, .row_advantages; .episodes sampled)
    metrics: Callable  # (played, stats, n_batch, cfg, opt_step, times: StepTimes) -> the step's own metrics
    summary: Callable  # (cfg, done, metrics, stats, played, times, methods) -> the step's log line
    system_prompt: Callable[[Any, Any], str | None]  # (cfg, pool) -> the system prompt rollouts use, re-read after every step
    state: Callable[[Any, Any, int], dict] = lambda cfg, reward_set, episodes: {}  # the recipe's own checkpoint state
    initial_state: Callable[[Any], dict] = lambda methods: {}  # the state of a train.steps = 0 run's step-0 checkpoint
    update: Callable | None = None  # grpo.update (a recipe may wrap it)


def train_loop(recipe: Recipe, cfg, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run `recipe` into `out` (continuing from its last checkpoint when `resume`)."""
    user = getattr(cfg, "methods", None) or {}  # [methods.<name>] tables (the grpo recipe's)
    check_methods(recipe.methods, cfg, user)  # a method's bad setting fails before the run directory is touched
    run = recipe.open(cfg, out, resume, log)
    pool, store, policy, optimizer = run.pool, run.store, run.policy, run.optimizer
    start_step, opt_step = run.start_step, run.opt_steps
    reward_set = recipe.rewards(cfg, run)  # None: the env's reward alone
    apo_reference = open_reference_sample(cfg, out, run, reward_set, recipe.system_prompt(cfg, pool), log)  # A*-PO's stage 1 (algo.apo_values = 'reference'), else None
    engine = make_engine(cfg.rollout, policy)  # samples rollouts and decodes evaluations
    rollouts = make_rollouts(cfg, policy, pool, log, engine)  # in this process (through the engine), or on Ray workers
    ctx = RunContext(cfg, run, engine, rollouts, reward_set, log, progress)
    methods = open_methods(recipe.methods, ctx, user)
    methods.open()
    gate, hints_for = methods.gate, methods.eval_hints  # the test-look recorder; the hints every evaluation shows
    eval_before(run, cfg, progress, log, hints=hints_for, engine=engine)
    if mid_eval_missing(cfg, store, start_step, cfg.train.steps):  # resumed at a checkpoint whose evaluation was cut off
        mid_eval(policy, cfg, pool, store, start_step, progress, gate, log, hints=hints_for, engine=engine)

    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    system = recipe.system_prompt(cfg, pool)
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    extra = methods.extra_episodes(cfg)  # episodes the methods sample per step beyond B x G (iGRPO's drafts)
    sampled_total = int(run.state.get("episodes", start_step * (B * G + extra)))  # budget/episodes: every episode sampled so far
    last = start_step  # the last step trained (train.max_episodes can end the run before train.steps)
    for step in range(start_step, cfg.train.steps):
        if not budget_left(cfg, sampled_total):  # resumed at a checkpoint the cap ended the run at
            break
        t = StepTimes(start=time.perf_counter())
        gen = step_generator(cfg.train.seed, step)
        # 1. tasks: a method's (the curriculum's), else a seeded shuffle of the train split; the methods' hints
        tasks = methods.tasks(step, B, pool.take(1)[0])
        seeds, hints = (train_seeds(cfg, step), None) if tasks is None else (tasks.seeds, tasks.hints)
        methods.begin_step(step)
        hints, hint_metrics = methods.hints(step, seeds, hints, sampling, gen, system)
        s = StepInputs(step, seeds, hints, sampling, gen, system)
        # 2. sample, score, outcome advantages
        played_from = pool.mark()
        played = recipe.play(ctx, s)
        pool.check_played(played_from, f"training step {step + 1}")  # a game broken for the whole step: stop before its update
        sample_metrics = methods.after_sample(step, played)
        t.sampled = time.perf_counter()
        # 3. the methods' extra rows, in order
        room = None if cfg.train.max_episodes is None else cfg.train.max_episodes - sampled_total - played.episodes - extra
        parts = methods.rows(s, played, room, t.rows)
        rows = played.trajs + [r for _, x in parts for r in x.rows]
        t.rows_done = time.perf_counter()
        # 4. the batch, shaped by a method (token advantages, imitation and distillation terms)
        advantages = played.row_advantages if len(rows) == len(played.trajs) else torch.cat([played.row_advantages, torch.zeros(len(rows) - len(played.trajs), device="cpu")])  # host, as the outcome advantages
        batch = collate(rows, advantages, policy.tokenizer.pad_token_id, policy.device)
        shaping = methods.shape(s, batch, played)
        t.shaped = time.perf_counter()
        # 5. update (+ the methods' loss terms), then 6. publish the new weights to the engine
        st = recipe.update(policy, optimizer, batch, cfg, gen, opt_step, shaping.imitation, learner=run.learner, outcomes=step_outcomes(cfg, played, seeds, apo_reference),
                    anchor=methods.update_term(), distillation=shaping.distillation)
        check_finite(step + 1, loss=st.loss, grad_norm=st.grad_norm)
        opt_step += st.opt_steps
        update_metrics_ = methods.after_update(step, played, st)
        t.updated = time.perf_counter()
        engine.load_weights(policy)
        t.end = time.perf_counter()
        # 7. record: metrics, samples, then the methods' end of step (gates, phases), checkpoint, evaluation
        n_sampled = played.episodes + extra + sum(x.episodes for _, x in parts)
        sampled_total += n_sampled
        metrics = {**recipe.metrics(played, st, len(batch), cfg, opt_step, t), **hint_metrics, **sample_metrics,
                   **{k: v for _, x in parts for k, v in x.metrics.items()}, **shaping.metrics, **update_metrics_,
                   "episodes/sampled": n_sampled,  # every episode this step sampled: B x G, iGRPO's drafts, branch continuations, RSIPO's re-rolls
                   "budget/episodes": sampled_total, **rollouts.metrics(), **pool.metrics()}  # env/restarts: games that crashed or hung this step
        store.log_metrics(step + 1, metrics)
        store.log_samples(step + 1, [
            {"seed": r.seed, "prompt": r.prompt_text, "completion": r.completion_text, "reward": r.reward, "advantage": float(played.row_advantages[i])}
            for i, r in list(enumerate(played.trajs))[: cfg.run.log_samples]
        ])
        if progress:
            progress("train", step + 1, cfg.train.steps)
        log(recipe.summary(cfg, step + 1, metrics, st, played, t, methods))
        done = last = step + 1
        final = ends_run(cfg, done, sampled_total, log)
        end = StepEnd(done, final, gen, opt_step)
        methods.end_step(end, store.log_metrics)
        opt_step = end.opt_step
        system = recipe.system_prompt(cfg, pool)  # a system prompt the prompt gate admitted is the run's from the next step on
        if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or final:
            state = {"opt_steps": opt_step, **recipe.state(cfg, reward_set, sampled_total), **methods.state_dict()}
            store.save_checkpoint(done, policy, optimizer, state)
        if not final and mid_eval_due(cfg, done, cfg.train.steps):  # after the checkpoint: a kill during the evaluation loses no training
            mid_eval(policy, cfg, pool, store, done, progress, gate, log, hints=hints_for, engine=engine)
        if final:
            break

    rollouts.close()
    if cfg.train.steps == 0 and store.latest_checkpoint() is None:
        store.save_checkpoint(0, policy, optimizer, {"opt_steps": 0, **recipe.initial_state(methods)})
    if cfg.eval.after and cfg.eval.n > 0 and not (out / "eval" / "after.json").exists():
        r = run_eval(policy, cfg, pool, store, last, "after", progress, gate, hints=hints_for, engine=engine)
        log(f"after: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")
    methods.close()
    engine.close()
    store.close()
    pool.close()
    return out
