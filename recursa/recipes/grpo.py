"""The GRPO-family recipe, the stages of a step (`train`):

    for step in range(steps):
        1 tasks      <- B training seeds (a seeded shuffle of the train split), or a method's
                        (the curriculum's arms and tail re-offers); methods may set the prompts'
                        hints (iGRPO's best drafts)
        2 sample     -> B x G trajectories (token ids, action masks, sampler log-probs); for
                        multi-turn games B x G episodes, one training row per turn; in this
                        process or on Ray workers (recursa/distributed/); with rollout.branch,
                        K continuations from a turn of each group's first episodes
        3 score      <- the env's reward, or the weighted sum of the [[reward]] entries
                        (recursa/rewards.py, recursa/self_rewards.py)
        4 advantages <- algo.advantage by name (recursa.plugins.ADVANTAGES) over each group
                        (+ GiGPO's step term for games; with branches, the branch term)
        5 update     <- epochs x mini-batches of algo.objective's loss by name
                        (recursa.plugins.OBJECTIVES: PPO-clip by default; SPO, GPG, REBEL, NFT,
                        A*-PO), minus algo.entropy_coef x the entropy, plus a method's update
                        term (the anchor), micro-batched with gradient accumulation, each
                        distinct prompt computed once per micro-batch
        6 publish    -> the new weights to the rollout engine
        7 record     -> metrics and samples; the methods' end of step (RLoop's fine-tune at a
                        phase's end, the prompt round, the weights gate); the checkpoint with
                        every method's state; the evaluation every eval.every steps

The loop itself is `recipes/loop.py:train_loop`, which RSIPO shares; this module gives it
GRPO's sampling and scoring (`play_step`: `play_games`, `play_replies`), its metrics and
checkpoint state (the `GRPO` recipe below), and holds the update. The optional methods are
plug-ins (recursa/methods/, `GRPO_METHODS` below, and the user's [methods.<name>] tables):
each implements the hooks of `recursa.methods.Method` it needs, and the loop calls them at
the stage each hook names without knowing which are on.

Every random draw of step k comes from a generator seeded by (train.seed, k), so a run
resumed from a checkpoint replays exactly what an uninterrupted run would have done.

Devices: rewards and advantages are computed on the host from the envs' Python floats
(statistics, logged with `.item()`); `collate` puts the batch (ids, masks, advantages) on
the policy's device, and everything the update makes from it stays there.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from recursa.algorithms.advantages import compute_advantages
from recursa.algorithms.distill import distribution_loss, imitation_loss
from recursa.algorithms.gigpo import step_advantages
from recursa.algorithms.losses import entropy_bonus, truncated_is_weights
from recursa.algorithms.objectives import SEQUENCE_LOSSES, MicroBatch, Outcomes, sequence_sums, sequence_weights
from recursa.anchor import Anchor
from recursa.branching import branch_metrics, branched_advantages, sample_branches
from recursa.config import OUTCOME_OBJECTIVES, GRPOConfig, tis_cap_of
from recursa.distributed.ddp import SINGLE, DataParallel, SingleProcess
from recursa.distributed.precision import learner_forward  # issue 47
from recursa.generation import GenerationStats, SamplingParams, prefix_lengths, sequence_logprobs, shared_prefix_logprobs
from recursa.models import Policy
from recursa.plugins import OBJECTIVES
from recursa.recipes.common import Progress, check_finite, lr_at, open_run, step_generator  # noqa: F401  (step_generator: benchmarks import it from here)
from recursa.rewards import RewardSet, score_episodes, score_trajectories
from recursa.self_rewards import SelfRewardContext
from recursa.trajectory import Episode, TrainBatch, Trajectory
from recursa.recipes.loop import Recipe, StepTimes, step_outcomes, train_loop, train_seeds  # noqa: F401  (the shared loop; train_seeds and step_outcomes live there)


@dataclass
class UpdateStats:
    loss: float = 0.0
    clip_frac: float = 0.0
    ratio_max: float = 0.0
    kl: float = 0.0
    approx_kl_old: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    opt_steps: int = 0
    skipped_steps: int = 0  # steps with a zero gradient left out (train.skip_empty_steps)
    rows_run: int = 0  # rows forwarded (summed over epochs); fewer than rows x epochs when zero-advantage rows are skipped
    logprob_mismatch: float = float("nan")  # mean |logp_engine - logp_trainer| at the rollout's weights over action tokens (see `update`)
    tis_weight_mean: float = float("nan")  # mean truncated importance weight (rollout.tis_cap), over the tokens it weighted
    tis_clip_frac: float = 0.0  # share of those tokens whose weight was truncated at the cap
    anchor_nll: float = 0.0  # mean NLL per target token of the demonstration anchor's rows (anchor.coef > 0), averaged over optimizer steps
    distill: float = 0.0  # the distribution term's value before its coef, token mean of w_t D_t (RSIPO teacher.mode "distribution"), averaged over optimizer steps


@dataclass
class Imitation:
    """An extra loss term, coef x the token mean of -w_t log pi(a_t) over the mini-batch's
    action tokens (`distill.imitation_loss`): RSIPO's SEED-like self-teacher."""

    weights: torch.Tensor  # (N, L) aligned with the batch, 0 off the action tokens
    coef: float

    def to(self, device: torch.device | str) -> "Imitation":
        return Imitation(self.weights.detach().to(device), self.coef)


@dataclass
class Distillation:
    """An extra loss term, coef x the token mean of w_t D_t over the mini-batch's action tokens,
    D_t the divergence between the student's next-token distribution and the teacher's, both
    collapsed onto the teacher's top-k tokens plus a tail (`distill.distribution_loss`):
    RSIPO's full-distribution self-teacher (`teacher.mode = "distribution"`)."""

    ids: torch.Tensor  # (N, L, k) long: the teacher's k most likely tokens at each action position (0 elsewhere)
    teacher: torch.Tensor  # (N, L, k) their log-probs under the teacher
    weights: torch.Tensor  # (N, L) w_t, 0 where a token has no term
    coef: float
    kind: str  # "forward", "reverse" or "jsd" (`distill.DIVERGENCES`)

    def to(self, device: torch.device | str) -> "Distillation":
        return Distillation(self.ids.to(device), self.teacher.to(device), self.weights.to(device), self.coef, self.kind)


def update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    cfg: GRPOConfig,
    generator: torch.Generator,
    opt_step: int,
    imitation: Imitation | None = None,
    learner: DataParallel | SingleProcess = SINGLE,
    outcomes: Outcomes | None = None,
    anchor: Anchor | None = None,
    distillation: Distillation | None = None,
) -> UpdateStats:
    """epochs x mini-batches of the objective's loss on one rollout batch; returns averaged stats.

    `batch.advantages` is (N,) per row or (N, L) per token; `imitation` adds its term to
    the loss (RSIPO), as does `distillation` (RSIPO's full-distribution teacher). Without these
    generalisations this is the GRPO update. With a
    `DataParallel` learner every rank runs its slice of each mini-batch's rows and rank 0
    steps (`recursa.distributed.ddp`); the stats are the whole batch's, on rank 0.

    `algo.objective` names the micro-batch loss in `recursa.plugins.OBJECTIVES` (PPO-clip by
    default, or an objective of yours); 'rebel', 'nft' and 'apo' read `outcomes` instead of the
    advantage. The sequence objectives ('rebel',
    'apo', `SEQUENCE_LOSSES`) are losses L(S) of whole sequences' log-ratios: before every
    optimizer step S is computed for every sequence at the current weights, and each row's
    loss is weighted by dL/dS of its sequence (`objectives.sequence_weights`), which gives
    L's exact gradient however the rows are split into micro-batches.

    The engine's log-probs (`batch.sample_logprobs`) are compared with the trainer's own at
    the rollout's weights (`logprob_mismatch`: over every row when the old log-probs are
    recomputed up front or no row is run, else over the rows the update runs), and with
    `rollout.tis_cap` they weight each token's surrogate by min(exp(logp_trainer -
    logp_engine), cap) (truncated importance sampling, `losses.truncated_is_weights`)."""
    tc, ac = cfg.train, cfg.algo
    objective = OBJECTIVES.get(ac.objective)  # the micro-batch loss (recursa.plugins: a built-in, or yours by name)
    sequence_objective = ac.objective in SEQUENCE_LOSSES
    if ac.objective in OUTCOME_OBJECTIVES and outcomes is None:
        raise ValueError(f"algo.objective = {ac.objective!r} reads the rollout's outcomes: pass outcomes=Outcomes(...)")
    learner.announce("update", batch=batch, generator=generator.get_state(), opt_step=opt_step, imitation=imitation, outcomes=outcomes,
                     distillation=distillation)
    learner.share_weights(policy)  # workers start from rank 0's weights (a rollback or resume included)
    model = learner.model(policy)  # issue 47: the FSDP2 learner runs the forwards on its sharded copy
    temperature = cfg.sampling.temperature
    n = len(batch)
    logprobs = learner_forward(shared_prefix_logprobs if tc.shared_prefix else sequence_logprobs, tc)  # issue 47: train.precision / activation_checkpointing
    # With one optimizer step per epoch, every forward of the first epoch runs at the rollout's
    # weights, so the first epoch's own log-probs (detached) are the old policy's: no separate
    # scoring pass over the batch. Later epochs read them back (`first_epoch_old`); a row is run
    # in every epoch or in none (the live rows do not depend on the epoch), and with one
    # mini-batch the rows are in the same (length) order in every epoch, so a data-parallel rank
    # runs the same micro-batches in every epoch and reads back only its own rows.
    first_epoch = tc.mini_batches == 1 and not sequence_objective
    first_epoch_old = None
    if tc.old_logprobs == "sampling":
        logp_old_all = batch.sample_logprobs
    elif first_epoch:
        logp_old_all = None  # on-policy: the current forward, detached, is the old policy
        if tc.epochs > 1:
            first_epoch_old = torch.zeros(batch.action_mask.shape, dtype=torch.float32, device=batch.device)
    else:
        logp_old_all = _score(logprobs, model, batch, temperature, tc.micro_batch_size, tc.logit_chunk, learner)
    logp_ref_all = None
    if ac.needs_reference:
        with policy.reference_context() as ref:
            logp_ref_all = _score(logprobs, ref, batch, temperature, tc.micro_batch_size, tc.logit_chunk, learner)
    if outcomes is not None:
        outcomes = outcomes.to(batch.device)
    if distillation is not None and distillation.coef == 0:
        distillation = None
    if distillation is not None:
        distillation = distillation.to(batch.device)
    extra = dict(imitation=imitation, distillation=distillation)  # the extra terms, which also make a row live
    # what marks a row as live (a zero row adds nothing to the gradient): its advantage, NFT's
    # group weight, or a sequence objective's dL/dS (set before every optimizer step below)
    signal = batch.advantages
    if ac.objective == "nft":
        rate = outcomes.success.mean(dim=1, keepdim=True).expand_as(outcomes.success)  # (B, G): each group's pass rate
        positive, pass_rate = outcomes.per_row(outcomes.success), outcomes.per_row(rate)  # (N,), (N,)
        signal = pass_rate * (1.0 - pass_rate)  # 0 in groups of one verdict, which NFT leaves out
    seq_weight, seq_value = None, 0.0

    # rollout/logprob_mismatch, the trainer's own log-probs at the rollout's weights against the
    # engine's: recomputed old log-probs give them for every row up front; otherwise each run
    # row's first forward does (before any optimizer step), or one scoring pass when the update
    # runs no row at all (every advantage zero)
    trainer_logp_all = logp_old_all if tc.old_logprobs == "recompute" else None
    if trainer_logp_all is None and not sequence_objective and not _live_rows(signal, cfg, **extra).any():
        trainer_logp_all = _score(logprobs, model, batch, temperature, tc.micro_batch_size, tc.logit_chunk)
    gap = _EngineGap(batch.device, tis_cap_of(cfg))
    if trainer_logp_all is not None:
        gap.mismatch(trainer_logp_all, batch.sample_logprobs, batch.action_mask)

    model.train()
    out = UpdateStats()
    n_stats = 0
    ent_sum, ent_tokens = 0.0, 0.0
    groups = prompt_groups(batch)
    by_length = _length_order(batch, groups) if tc.mini_batches == 1 else None
    for epoch in range(tc.epochs):
        # shuffle whole prompt groups, so the rows of a group share micro-batches (and prefills)
        perm = torch.randperm(len(groups), generator=generator, device="cpu")
        # One mini-batch: its gradient is the sum over all its rows whatever their order, so the
        # micro-batches are cut from the rows sorted by length instead (the shuffle is still drawn,
        # leaving the generator where it was): rows of similar length pad to less (issue 46)
        order = by_length if by_length is not None else torch.cat([groups[int(g)] for g in perm])  # (N,) on the batch's device
        for m in range(tc.mini_batches):
            mb_idx = order[m * n // tc.mini_batches : (m + 1) * n // tc.mini_batches]  # every row, also when n % mini_batches != 0 (games)
            if out.opt_steps:
                learner.share_weights(policy)  # every rank runs this mini-batch at the weights after the last step
            if sequence_objective:  # S of every sequence at the current weights -> each row's weight dL/dS (one mini-batch: config rule)
                seq_value, seq_weight = _sequence_weights(policy, batch, cfg, outcomes, logp_old_all, logp_ref_all, out.opt_steps, learner)
                signal = seq_weight
            num_tokens = int(batch.action_mask[mb_idx].sum().item())
            for g in optimizer.param_groups:
                g["lr"] = lr_at(cfg, opt_step)
            optimizer.zero_grad(set_to_none=True)
            # Rows with zero advantage add nothing to the policy gradient (their clipped
            # surrogate is 0 whatever the ratio), so without a KL term they are not run at
            # all; they still count in the aggregation's denominators, so the gradient is
            # exactly the full batch's. Zero-variance groups are common late in training.
            work = mb_idx[_live_rows(signal, cfg, idx=mb_idx, **extra)]
            out.rows_run += len(work)
            if len(work) == 0 and tc.skip_empty_steps and (anchor is None or anchor.empty()):  # a zero gradient: no AdamW step on momentum alone
                out.skipped_steps += 1
                continue
            mine = learner.shard(work, tc.micro_batch_size)  # this rank's run of whole micro-batches (all of them in one process)
            for lo in range(0, len(mine), tc.micro_batch_size):
                idx = mine[lo : lo + tc.micro_batch_size]
                mb = batch.select(idx)
                L = mb.input_ids.shape[1]
                at_ids = None if distillation is None else distillation.ids[idx, :L]  # the student's log-probs at the teacher's top-k ids
                logp, ent, *student_k = logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask, temperature, tc.logit_chunk, with_entropy=True,
                                                 entropy_grad=ac.entropy_coef > 0, at_ids=at_ids)
                if logp_old_all is not None:
                    logp_old = logp_old_all[idx, :L]
                elif epoch == 0:
                    logp_old = logp.detach()
                    if first_epoch_old is not None:
                        first_epoch_old[idx, :L] = logp_old.float()
                else:
                    logp_old = first_epoch_old[idx, :L]
                # the trainer's log-probs at the rollout's weights: the old policy when recomputed,
                # else this forward's as long as no optimizer step has been taken yet
                trainer_old = logp_old if tc.old_logprobs == "recompute" else (logp.detach() if out.opt_steps == 0 else None)
                token_weights = None
                if trainer_old is not None:
                    if epoch == 0 and trainer_logp_all is None:
                        gap.mismatch(trainer_old, mb.sample_logprobs[:, :L], mb.action_mask)
                    token_weights = gap.tis_weights(trainer_old, mb.sample_logprobs[:, :L], mb.action_mask)
                inputs = MicroBatch(
                    logp, logp_old, mb.action_mask, mb.advantages, None if logp_ref_all is None else logp_ref_all[idx, :L], token_weights,
                    num_tokens=num_tokens, num_seqs=len(mb_idx), norm_len=cfg.sampling.max_new_tokens,
                )
                if ac.objective == "nft":
                    inputs.positive, inputs.pass_rate = positive[idx], pass_rate[idx]
                if sequence_objective:
                    inputs.seq_weight, inputs.seq_share = seq_weight[idx], seq_value * len(idx) / len(work)
                loss, st = objective(inputs, ac)
                if ac.entropy_coef > 0:
                    loss = loss + entropy_bonus(ent, mb.action_mask, ac.entropy_coef, ac.agg, num_tokens=num_tokens, num_seqs=len(mb_idx),
                                                norm_len=cfg.sampling.max_new_tokens)
                if imitation is not None and imitation.coef > 0:
                    weights = imitation.weights[idx, :L]
                    loss = loss + imitation.coef * imitation_loss(logp, weights, mb.action_mask, num_tokens=num_tokens)
                if distillation is not None:
                    term = distribution_loss(student_k[0], distillation.teacher[idx, :L], distillation.weights[idx, :L], mb.action_mask, distillation.kind,
                                             num_tokens=num_tokens)
                    loss = loss + distillation.coef * term
                    out.distill += term.item()
                loss.backward()
                w = float(mb.action_mask.sum().item()) / max(num_tokens, 1)
                out.loss += loss.item()
                out.clip_frac += st["clip_frac"] * w
                out.kl += st["kl"] * w
                out.approx_kl_old += st["approx_kl_old"] * w
                out.ratio_max = max(out.ratio_max, st["ratio_max"])
                ent_sum += float((ent * mb.action_mask).sum().item())
                ent_tokens += float(mb.action_mask.sum().item())
            if len(work) == 0:  # nothing to run: the gradient is exactly zero (AdamW still steps)
                for p in model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            if anchor is not None:  # the demonstration anchor's term (recursa/anchor.py), once per optimizer step
                out.anchor_nll += anchor.backward(model, opt_step, tc.micro_batch_size, tc.logit_chunk, batch.device)
            # clip the global norm and step (data-parallel: the gradients summed onto rank 0 first)
            out.grad_norm += learner.step(optimizer, [p for p in model.parameters() if p.requires_grad], tc.max_grad_norm)
            opt_step += 1
            out.opt_steps += 1
            n_stats += 1
    out.loss, out.clip_frac, out.kl, out.approx_kl_old, out.distill, ent_sum, ent_tokens = learner.sum_stats(
        [out.loss, out.clip_frac, out.kl, out.approx_kl_old, out.distill, ent_sum, ent_tokens])
    out.ratio_max = learner.max_stat(out.ratio_max)
    for name in ("loss", "clip_frac", "kl", "approx_kl_old", "grad_norm", "anchor_nll", "distill"):
        setattr(out, name, getattr(out, name) / max(n_stats, 1))
    out.entropy = ent_sum / ent_tokens if ent_tokens else float("nan")  # over the rows run
    gap.report(out)
    return out


class _EngineGap:
    """The engine's log-probs against the trainer's at the rollout's weights: their mean absolute
    difference (`rollout/logprob_mismatch`) and, with `rollout.tis_cap`, the truncated importance
    weights min(exp(logp_trainer - logp_engine), cap) of each token's surrogate. The sums stay on
    the batch's device and are read once, at the end of the update."""

    def __init__(self, device: torch.device, cap: float | None):
        self.cap = cap
        # |logp_trainer - logp_engine| sum, its tokens, TIS weight sum, truncated tokens, weighted tokens
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def mismatch(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> None:
        self.sums[0] += ((trainer - engine).abs() * mask).sum()
        self.sums[1] += mask.sum()

    def tis_weights(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        if self.cap is None:
            return None
        weights = truncated_is_weights(trainer, engine, mask, self.cap)
        on = mask.bool()
        self.sums[2] += weights[on].sum()
        self.sums[3] += (weights[on] >= self.cap).sum()
        self.sums[4] += on.sum()
        return weights

    def report(self, out: UpdateStats) -> None:
        mismatch_sum, mismatch_tokens, tis_sum, tis_clipped, tis_tokens = self.sums.tolist()
        out.logprob_mismatch = mismatch_sum / mismatch_tokens if mismatch_tokens else float("nan")
        if tis_tokens:
            out.tis_weight_mean, out.tis_clip_frac = tis_sum / tis_tokens, tis_clipped / tis_tokens


def _sequence_weights(policy: Policy, batch: TrainBatch, cfg: GRPOConfig, outcomes: Outcomes, logp_old_all: torch.Tensor,
                      logp_ref_all: torch.Tensor | None, opt_steps: int, learner) -> tuple[float, torch.Tensor]:
    """A sequence objective at the current weights: (L(S), dL/dS of each row's sequence  # (N,)).
    S = the sequence's summed log-ratio over its action tokens, to the sampling policy (REBEL)
    or the reference (A*-PO). Before the first optimizer step of an update with recomputed old
    log-probs, the current policy is the old one; otherwise one scoring pass gives it."""
    tc, ac = cfg.train, cfg.algo
    model = learner.model(policy)  # issue 47: the FSDP2 learner runs the forwards on its sharded copy
    if opt_steps == 0 and tc.old_logprobs == "recompute":
        current = logp_old_all
    else:
        logprobs = learner_forward(shared_prefix_logprobs if tc.shared_prefix else sequence_logprobs, tc)  # issue 47: train.precision / activation_checkpointing
        current = _score(logprobs, model, batch, cfg.sampling.temperature, tc.micro_batch_size, tc.logit_chunk, learner)
        model.train()
    base = logp_ref_all if ac.objective == "apo" else logp_old_all
    seq_logratio = sequence_sums(current - base, batch.action_mask, outcomes.row_seq, outcomes.rewards.numel())  # (B * G,)
    value, grad = sequence_weights(lambda s: SEQUENCE_LOSSES[ac.objective](s, outcomes, ac), seq_logratio)
    return value, grad[outcomes.row_seq]


def _live_rows(signal: torch.Tensor, cfg: GRPOConfig, imitation: Imitation | None = None, idx: torch.Tensor | None = None,
               distillation: Distillation | None = None) -> torch.Tensor:
    """Which rows (of `idx`, default all) `update` runs, a bool (len,): those with a nonzero
    `signal` (per row (N,) or per token (N, L); the advantages for PPO-clip), imitation weight
    or distillation weight. Every row when `train.skip_zero_advantage` is off or a KL term or
    entropy bonus reads every row."""
    n = len(signal) if idx is None else len(idx)
    if not (cfg.train.skip_zero_advantage and cfg.algo.kl_coef == 0 and cfg.algo.entropy_coef == 0):
        return torch.ones(n, dtype=torch.bool, device=signal.device)
    sig = signal if idx is None else signal[idx]
    live = sig != 0
    live = live.any(dim=1) if live.dim() == 2 else live
    for term in (imitation, distillation):
        if term is not None and term.coef > 0:
            weights = term.weights if idx is None else term.weights[idx]
            live = live | (weights != 0).any(dim=1)
    return live


def update_metrics(st: UpdateStats, rows: list[Trajectory], n_batch: int, cfg, opt_step: int) -> dict:
    """The update's metrics (loss/policy, policy/*) and the sampled completions' (completion/*);
    `n_batch` rows were in the update's batch, `opt_step` counts optimizer steps so far."""
    lengths = torch.tensor([t.num_action_tokens for t in rows], dtype=torch.float32, device="cpu")
    return {
        "loss/policy": st.loss,
        "policy/kl": st.kl,
        "policy/approx_kl_old": st.approx_kl_old,
        "policy/clip_frac": st.clip_frac,
        "policy/ratio_max": st.ratio_max,
        "policy/entropy": st.entropy,
        "batch/rows_run_frac": st.rows_run / max(n_batch * cfg.train.epochs, 1),
        "policy/grad_norm": st.grad_norm,
        "policy/lr": lr_at(cfg, opt_step - 1),
        **({"policy/skipped_steps": st.skipped_steps} if cfg.train.skip_empty_steps else {}),
        "completion/len_mean": lengths.mean().item(),
        "completion/len_max": lengths.max().item(),
        "completion/truncated_frac": sum(t.finish_reason == "length" for t in rows) / len(rows),
        "rollout/logprob_mismatch": st.logprob_mismatch,
        **({"rollout/tis_weight_mean": st.tis_weight_mean, "rollout/tis_clip_frac": st.tis_clip_frac} if tis_cap_of(cfg) is not None else {}),
    }


def episode_rows(episodes: list[Episode], advantages: torch.Tensor | list[float], cfg: GRPOConfig,
                 extra: list[list[float]] | None = None) -> tuple[list[Trajectory], torch.Tensor, dict]:
    """One training row per sampled turn, its advantage = the episode's group advantage
    (`advantages`, one per episode, e.g. `(B, G)`, broadcast over every action token of every
    turn) plus, with GiGPO, weight x the step advantage of that turn, plus `extra[e][u]` for
    sampled turn u of episode e when given (the branch term, `rollout.branch`). A branch
    continuation's replayed turns make no rows and join no GiGPO step group; the episode
    metrics are over the ordinary episodes. Returns rows, (rows,) advantages and episode metrics."""
    sampled = [e.turns[e.branch_turn or 0:] for e in episodes]
    step_adv = [[0.0] * len(turns) for turns in sampled]
    if cfg.algo.step_advantage == "gigpo":
        step_adv = step_advantages(
            [e.group for e in episodes],
            [[t.anchor for t in turns] for turns in sampled],
            [[t.reward for t in turns] for turns in sampled],
            gamma=cfg.algo.gigpo_gamma,
            norm=cfg.algo.gigpo_norm,
        )
    flat = advantages.view(-1) if isinstance(advantages, torch.Tensor) else advantages
    rows, row_adv = [], []
    for e, episode in enumerate(episodes):
        for t, row in enumerate(episode.rows()):
            rows.append(row)
            a = float(flat[e]) + cfg.algo.gigpo_weight * step_adv[e][t]
            row_adv.append(a if extra is None else a + extra[e][t])
    n_steps = max(sum(len(a) for a in step_adv), 1)
    roots = [e for e in episodes if e.branch_turn is None]
    metrics = {
        "episode/success_rate": sum(e.won for e in roots) / len(roots),
        "episode/turns_mean": sum(len(e.turns) for e in roots) / len(roots),
        "episode/invalid_rate": sum(e.invalid_rate for e in roots) / len(roots),
        "episode/step_adv_abs_mean": sum(abs(a) for sa in step_adv for a in sa) / n_steps,
        "batch/rows": len(rows),
    }
    return rows, torch.tensor(row_adv, dtype=torch.float32, device="cpu"), metrics


def prompt_groups(batch: TrainBatch) -> list[torch.Tensor]:
    """Row indices grouped by identical prompt (the tokens before the first action token),
    on the batch's device."""
    first = prefix_lengths(batch.action_mask).tolist()
    host_ids = batch.input_ids.tolist()  # one copy to the host
    index: dict[tuple, list[int]] = {}
    for i in range(len(batch)):
        index.setdefault(tuple(host_ids[i][: first[i]]), []).append(i)
    return [torch.tensor(rows, dtype=torch.long, device=batch.device) for rows in index.values()]


def _length_order(batch: TrainBatch, groups: list[torch.Tensor]) -> torch.Tensor:
    """The rows, whole prompt groups kept together, by decreasing prompt length then
    completion length: consecutive micro-batches then hold prompts and completions of
    similar length, so the shared-prefix forward's left-padded prompts and right-padded
    completions waste little. Ties keep the groups' first-row order (deterministic)."""
    first = prefix_lengths(batch.action_mask)
    real = batch.attention_mask.sum(dim=1)
    keys = [(-int(first[g[0]]), -int((real[g] - first[g]).max()), int(g[0])) for g in groups]
    return torch.cat([groups[i] for i in sorted(range(len(groups)), key=keys.__getitem__)])


@torch.no_grad()
def _score(logprobs, model, batch: TrainBatch, temperature: float, micro: int, chunk: int,
           learner: DataParallel | SingleProcess = SINGLE) -> torch.Tensor:
    """Log-probs of the batch's action tokens under `model` with the update's own
    log-prob function, (N, L), no gradient; data-parallel, each rank scores its slice of
    the rows and the table is summed across ranks."""
    model.eval()
    out = torch.zeros_like(batch.sample_logprobs)
    rows = learner.shard(torch.arange(len(batch), device=batch.device), micro)
    for lo in range(0, len(rows), micro):
        idx = rows[lo : lo + micro]
        mb = batch.select(idx)
        logp, _ = logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask, temperature, chunk)
        out[idx, : logp.shape[1]] = logp
    return learner.sum_rows(out)


@dataclass
class Played:
    """One step's rollouts, scored and turned into training rows: what the update, the step's
    metrics, the curriculum and RLoop's harvest read."""

    trajs: list[Trajectory]  # the training rows: one per reply (single-turn) or per sampled turn (games)
    row_advantages: torch.Tensor  # (rows,)
    rewards: torch.Tensor  # (B, G): each sampled sequence's training reward
    advantages: torch.Tensor  # (B, G), or (B, G + S K) with branch continuations
    success: list[bool]  # (B G,): each root sequence's verdict
    row_seq: list[int]  # (rows,): the root sequence each row belongs to
    gen_stats: GenerationStats
    sampled_at: float  # time.perf_counter() when sampling ended (scoring counts as update time)
    root_rows: int  # the first root_rows rows are the roots' (branch continuations' rows follow)
    harvest: list  # what RLoop harvests: the episodes played (continuations included), or the trajectories
    episode_metrics: dict = dataclasses.field(default_factory=dict)
    reward_metrics: dict = dataclasses.field(default_factory=dict)
    branches: object | None = None  # branching.Branches when rollout.branch is on
    failures: list = dataclasses.field(default_factory=list)  # (context, reply) of the failed root sequences, what prompt proposals read
    parts: dict = dataclasses.field(default_factory=dict)  # what a method made of the step for the later ones (methods.base)

    @property
    def wins(self) -> list[list[bool]]:
        """(B, G): each group's verdicts, for the curriculum."""
        B, G = self.rewards.shape
        return [self.success[i * G : (i + 1) * G] for i in range(B)]

    @property
    def episodes(self) -> int:
        """Episodes sampled: B x G, and the branch continuations."""
        return self.rewards.numel() + (len(self.branches.episodes) if self.branches is not None else 0)


def play_games(rollouts, seeds: list[int], cfg: GRPOConfig, sampling: SamplingParams, gen: torch.Generator, system_prompt: str | None,
               hints: list[str] | None, reward_set: RewardSet | None, step: int) -> Played:
    """A step of a multi-turn game: G episodes of each game seed form a group; the episode's
    advantage is broadcast over every action token of every turn (+ GiGPO's step term when
    asked), and each turn is one training row. With `rollout.branch`, K continuations from a
    turn of each group's first episodes are played too (recursa/branching.py). The failed
    episodes' last observations and actions are its `failures` (what the prompt gate reads)."""
    B, G = len(seeds), cfg.train.group_size
    ero = rollouts.episodes(seeds, G, sampling, gen, system_prompt, cfg.agent, hints=hints)
    episodes, gen_stats = ero.episodes, ero.stats
    branches = None
    if cfg.rollout.branch != "off":
        branches = sample_branches(rollouts, episodes, G, sampling, gen, system_prompt, cfg.agent, cfg.rollout)
        gen_stats = GenerationStats(*(a + b for a, b in zip(dataclasses.astuple(gen_stats), dataclasses.astuple(branches.stats))))
    sampled_at = time.perf_counter()
    played = episodes + (branches.episodes if branches is not None else [])  # the roots first, then the continuations
    totals, reward_metrics = [e.total_reward for e in played], {}
    if reward_set is not None:  # [[reward]]: each function scores the episode's action transcript at its end
        scored = score_episodes(reward_set, episodes)  # reward/* describe the step's own episodes
        totals, reward_metrics = scored.totals, scored.metrics
        if branches is not None:  # a continuation's transcript is the whole game, its replayed actions included
            totals = totals + score_episodes(reward_set, branches.episodes).totals
    rewards = torch.tensor(totals[: B * G], dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
    check_finite(step + 1, rewards=rewards)  # an env's NaN reward is named, never trained on
    if branches is None:
        advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
        trajs, row_advantages, episode_metrics = episode_rows(episodes, advantages, cfg)
    else:  # A_E over each seed's roots and continuations, + w A_B within each branch from its branch turn on
        continued = torch.tensor(totals[B * G :], dtype=torch.float32, device="cpu").view(B, cfg.rollout.branch_sources, cfg.rollout.branch_k)  # (B, S, K)
        check_finite(step + 1, rewards=continued)
        estimator = functools.partial(compute_advantages, cfg.algo.advantage)
        branch_adv, outer, terms = branched_advantages(branches, episodes, rewards, continued, estimator, cfg.rollout.branch_weight)
        advantages = branch_adv.episode  # (B, G + S K)
        trajs, row_advantages, episode_metrics = episode_rows(played, outer, cfg, terms)
        episode_metrics.update(branch_metrics(branches, branch_adv))
    failures = [(f"{e.task} {e.turns[-1].observation}", " | ".join(t.action for t in e.turns[-3:])) for e in episodes if not e.won and e.turns]
    return Played(
        trajs, row_advantages, rewards, advantages,
        success=[e.won for e in episodes],
        row_seq=[e for e, episode in enumerate(episodes) for _ in episode.turns],  # episode.rows(): one row per turn (roots; no branches with these objectives)
        gen_stats=gen_stats, sampled_at=sampled_at, root_rows=sum(len(e.turns) for e in episodes), harvest=played,
        episode_metrics=episode_metrics, reward_metrics=reward_metrics, branches=branches, failures=failures,
    )


def play_replies(rollouts, seeds: list[int], cfg: GRPOConfig, sampling: SamplingParams, gen: torch.Generator, system_prompt: str | None,
                 hints: list[str] | None, reward_set: RewardSet | None, step: int) -> Played:
    """A step of a single-turn task: G replies to each prompt form a group, one training row
    each. With [[reward]], each reply's reward is the weighted sum of the reward functions, and
    a function's own advantage term (self-consistency's low-agreement penalty) is added to the
    group advantage. The failed replies are its `failures`."""
    B, G = len(seeds), cfg.train.group_size
    ro = rollouts.rollout(seeds, G, sampling, gen, system_prompt, hints=hints)
    trajs = ro.trajectories
    sampled_at = time.perf_counter()
    offsets, reward_metrics = None, {}
    if reward_set is not None:  # [[reward]]: each trajectory's reward becomes the weighted sum
        scored = score_trajectories(reward_set, trajs)
        reward_metrics, offsets = scored.metrics, scored.advantage_offsets
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
    check_finite(step + 1, rewards=rewards)  # an env's NaN reward is named, never trained on
    advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
    if offsets is not None:  # a reward's own advantage term (self_consistency's penalty for low agreement)
        advantages = advantages + torch.tensor(offsets, dtype=torch.float32, device="cpu").view(B, G)
    return Played(
        trajs, advantages.view(-1), rewards, advantages,
        success=[t.success for t in trajs],
        row_seq=list(range(len(trajs))),
        gen_stats=ro.stats, sampled_at=sampled_at, root_rows=len(trajs), harvest=trajs,
        reward_metrics=reward_metrics, failures=[(t.prompt_text, t.completion_text) for t in trajs if not t.success],
    )


def open_rewards(cfg: GRPOConfig, run) -> RewardSet | None:
    """The [[reward]] entries as a RewardSet (None: the env's reward alone), restored from the
    checkpoint; rewards without a verifier read the policy and one env of the task."""
    builtin = any(e.kind != "func" for e in cfg.reward)
    reward_set = RewardSet.from_config(cfg.reward, SelfRewardContext(cfg, run.policy, run.pool.take(1)[0], run.init_dir) if builtin else None)
    if reward_set is not None and run.state.get("rewards"):
        reward_set.load_state_dict(run.state["rewards"])  # self_consistency's label-accuracy counts at the checkpoint
    return reward_set


def step_metrics(played: Played, st: UpdateStats, cfg: GRPOConfig, opt_step: int, t0: float, tp: float, t2: float) -> dict:
    """A step's own metrics: its episodes and rewards, the update's, and its times (t0 the
    step's start, tp the publish's start, t2 its end)."""
    trajs, rewards, t1 = played.trajs, played.rewards, played.sampled_at
    lengths = torch.tensor([t.num_action_tokens for t in trajs], dtype=torch.float32, device="cpu")
    prompt_tokens = sum(len(t.token_ids) - t.num_action_tokens for t in trajs)
    root_rows = trajs[: played.root_rows]  # the roots' rows come first
    return {
        **played.episode_metrics,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        **played.reward_metrics,
        "reward/success_rate": sum(t.success for t in root_rows) / len(root_rows),
        "reward/zero_std_groups": (rewards.std(dim=1) == 0).float().mean().item(),
        "advantage/abs_mean": played.advantages.abs().mean().item(),
        **update_metrics(st, trajs, len(trajs), cfg, opt_step),
        "time/rollout_s": t1 - t0,
        "time/update_s": t2 - t1,
        "time/publish_s": t2 - tp,  # part of time/update_s: the new weights reaching the rollout engine
        "time/step_s": t2 - t0,
        "throughput/gen_tokens_per_s": played.gen_stats.generated_tokens / max(t1 - t0, 1e-9),
        "throughput/tokens_per_s": (prompt_tokens + lengths.sum().item()) / max(t2 - t0, 1e-9),
    }


# The optional methods a GRPO run may plug in, in the order every hook calls them
# (recursa/methods/: each enabled by its own config section; yours by [methods.<name>]).
GRPO_METHODS = ["curriculum", "rloop", "igrpo", "anchor", "gate"]


def open_grpo_run(cfg: GRPOConfig, out: Path, resume: bool, log: Callable[[str], None]):
    branching = cfg.rollout.branch != "off"
    single_turn_error = (f"rollout.branch = {cfg.rollout.branch!r} branches multi-turn games, but this task is single-turn (one reply per episode, "
                         "nothing to replay): set rollout.branch = 'off', or train on a game such as env.name = 'household'") if branching else None
    return open_run(cfg, out, resume, log, kl_reference=cfg.algo.needs_reference, single_turn_error=single_turn_error)


def play_step(ctx, s) -> Played:
    """Stage 2-4 of a GRPO step: sample, score, outcome advantages (games or single-turn replies)."""
    play = play_games if ctx.multi_turn else play_replies
    played = play(ctx.rollouts, s.seeds, ctx.cfg, s.sampling, s.generator, s.system, s.hints, ctx.reward_set, s.step)
    check_finite(s.step + 1, advantages=played.row_advantages)
    return played


def grpo_state(cfg: GRPOConfig, reward_set: RewardSet | None, episodes: int) -> dict:
    """The recipe's own checkpoint state: the rewards' (self_consistency's counts), and the episode count when branches make it vary."""
    saved = reward_set.state_dict() if reward_set is not None else {}
    return {**({"rewards": saved} if saved else {}), **({"episodes": episodes} if cfg.rollout.branch != "off" else {})}


GRPO = Recipe(
    name="grpo",
    methods=GRPO_METHODS,
    open=open_grpo_run,
    rewards=open_rewards,
    play=play_step,
    metrics=lambda played, st, n_batch, cfg, opt_step, t: step_metrics(played, st, cfg, opt_step, t.start, t.updated, t.end),
    summary=lambda cfg, done, m, st, played, t, methods: (
        f"step {done}/{cfg.train.steps}  reward {m['reward/mean']:.3f}  len {m['completion/len_mean']:.1f}  "
        f"clip {st.clip_frac:.3f}  rollout {played.sampled_at - t.start:.1f}s  update {t.end - played.sampled_at:.1f}s"),
    system_prompt=lambda cfg, pool: cfg.model.system_prompt or None,
    state=grpo_state,
    update=lambda *a, **k: update(*a, **k),  # looked up at each step, so a patched grpo.update is the one called
)


def train(cfg: GRPOConfig, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run the recipe into `out` (continuing from its last checkpoint when `resume`): the shared loop
    (recipes/loop.py) with GRPO's sampling, metrics and `GRPO_METHODS`."""
    return train_loop(GRPO, cfg, out, resume, progress, log)
