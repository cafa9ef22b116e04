"""RLoop, an option of the GRPO recipe (`[rloop] enabled = true`), not a recipe of its own:
RL phases alternating with rejection-sampling fine-tuning from a starting point.

    W_0 <- the run's starting weights (the warm start, or the model's own)
    for phase k = 0, 1, ...:
        RL       <- `rl_steps` GRPO steps from W_k, written out in recipes/grpo.py; each step's
                    successes (whole episodes for games, completions for single-turn tasks) join
                    the harvest: per task the shortest distinct successes, at most
                    `per_task_cap`, and only from tasks whose pass rate that step was at most
                    `max_pass_rate` (RUN_DIR/harvest.jsonl)
        reset    <- the weights go back to W_k (reset = "phase"), to W_0 ("init"), or stay as
                    RL left them ("none"); the optimizer state is cleared
        refine   <- `sft_epochs` passes of token-mean NLL over the harvest's rows at `sft_lr`
                    (`rft.finetune`, the expert-iteration update); the optimizer state is
                    cleared again, so the next phase's RL starts like a new run from W_{k+1}
        W_{k+1}  <- the refined weights (after any gate rollback at the boundary step), kept
                    on disk as RUN_DIR/rloop/phase_K until no checkpoint or reset needs them

The harvest of a phase is what its RL found, not what RL made of the weights: RL explores,
the fine-tune keeps what worked on a policy that never drifted with RL (the reset), and the
next phase explores from there. This follows RLoop (Zeng et al., 2025, "an self-improving
framework for reinforcement learning with iterative policy initialization"), where the
expert set of each iteration refines that iteration's initial policy. Departures: the
harvest is filtered per step (by the step's own pass rate of each task), not over the
whole phase; the fine-tune has no KL term; reset = "init" and "none" are variants.

Determinism: the fine-tune draws its shuffles from the boundary step's generator, after
that step's own draws; the harvest is rebuilt from harvest.jsonl and W_k read from disk, so
a run resumed from any checkpoint does what the uninterrupted run did. A phase that
harvested nothing is still reset: the next phase starts from the same point (reset =
"phase") with fresh tasks. The fine-tune samples nothing, so `episodes/sampled` and
`budget/episodes` count only the RL steps' episodes.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from recursa.config import GRPOConfig, SupervisedConfig
from recursa.distributed.ddp import SINGLE, DataParallel, SingleProcess
from recursa.errors import UserError
from recursa.models import Policy, restore_weights
from recursa.recipes.rft import Attempt, completion_attempts, episode_attempts, finetune, keep_solutions, row_from_record, row_record
from recursa.runio import inside_tree
from recursa.store import RunStore, finished_checkpoints, write_weights
from recursa.methods.base import Method, StepEnd
from recursa.trajectory import Episode, Trajectory


def phase_of(step: int, rl_steps: int) -> int:
    """The phase (0 = the first) that step `step` (1 = the run's first step) belongs to."""
    return (step - 1) // rl_steps


def reset_source(phase: int, reset: str) -> int | None:
    """Whose starting weights the fine-tune at the end of `phase` begins from: that phase's
    own (reset = "phase"), the run's (phase 0, "init"), or none, the RL weights ("none")."""
    return {"phase": phase, "init": 0, "none": None}[reset]


def select_successes(attempts: list[Attempt], per_task_cap: int, max_pass_rate: float) -> list[Attempt]:
    """The successes one step adds to the harvest: tasks whose pass rate among the step's
    attempts is above `max_pass_rate` give none; the others' successes as expert iteration
    keeps them (`rft.keep_solutions`: best reward, then shortest, first; duplicates dropped;
    at most `per_task_cap` per task, 0 = all)."""
    tried: dict[int, list[bool]] = {}
    for a in attempts:
        tried.setdefault(a.seed, []).append(a.success)
    hard = {seed for seed, wins in tried.items() if sum(wins) / len(wins) <= max_pass_rate}
    return keep_solutions([a for a in attempts if a.seed in hard], per_task_cap, dedupe=True, prefer_short=True)


def cap_harvest(harvest: list[dict], max_harvest: int) -> list[dict]:
    """The most recent `max_harvest` harvested successes (all of them for 0)."""
    return harvest[-max_harvest:] if max_harvest and len(harvest) > max_harvest else harvest


class RLoop:
    """The RLoop state of one GRPO run: the harvest (successes, as harvest.jsonl records) and
    the phases' starting weights on disk. The recipe calls `begin` at the top of every step,
    `harvest` once the step's rollouts are played, and `refresh` when `due`."""

    def __init__(self, cfg: GRPOConfig, store: RunStore, multi_turn: bool, log: Callable[[str], None] = print):
        self.cfg, self.rc, self.store, self.multi_turn, self.log = cfg, cfg.rloop, store, multi_turn, log
        tc = cfg.train
        # the fine-tune's settings as the supervised update reads them (the run's AdamW, its micro-batching and clipping)
        self.sft = SimpleNamespace(train=SupervisedConfig(
            lr=self.rc.sft_lr, epochs=self.rc.sft_epochs, batch_size=self.rc.sft_batch_size, micro_batch_size=tc.micro_batch_size,
            max_grad_norm=tc.max_grad_norm, logit_chunk=tc.logit_chunk, warmup_steps=0, seed=tc.seed,
        ))
        self.buffer: list[dict] = []  # harvested successes, oldest first: {"seed", "reward", "length", "key", "rows": [row records]}

    @classmethod
    def open(cls, cfg: GRPOConfig, store: RunStore, start_step: int, multi_turn: bool, log: Callable[[str], None] = print) -> "RLoop":
        """The state at `start_step` (0 for a new run): the harvest rebuilt from harvest.jsonl
        (already cut back to the checkpoint), and the current phase's reset weights checked."""
        loop = cls(cfg, store, multi_turn, log)
        rc = loop.rc
        phase_start = (start_step // rc.rl_steps) * rc.rl_steps  # the step the current phase began after
        loop.buffer = cap_harvest([d for d in store.read_jsonl("harvest") if rc.accumulate or d["step"] > phase_start], rc.max_harvest)
        source = reset_source(start_step // rc.rl_steps, rc.reset)
        if source is not None and not loop._records(start_step) and not loop.phase_dir(source).exists():
            raise UserError(
                f"rloop: {loop.phase_dir(source)} (the weights the current phase resets to) is missing from the run directory: "
                "resume from a checkpoint of a later phase, or start the run again"
            )
        if start_step:
            log(f"rloop: phase {start_step // rc.rl_steps + 1}, {len(loop.buffer)} harvested successes restored")
        return loop

    def phase_dir(self, phase: int) -> Path:
        return self.store.path / "rloop" / f"phase_{phase:03d}"

    def _records(self, step: int) -> bool:
        """Whether `begin(step)` writes the starting weights of a phase: a phase's first step
        does (reset = "phase"), and the run's first step ("phase" and "init")."""
        rc = self.rc
        return step % rc.rl_steps == 0 and (rc.reset == "phase" or (rc.reset == "init" and step == 0))

    def begin(self, step: int, policy: Policy, optimizer: torch.optim.Optimizer) -> None:
        """Before step `step` (0-based) is played: a phase's first step records the weights it
        starts from (reset = "phase"; "init" records only the run's start), then phase
        directories nothing can need any more are removed."""
        rc = self.rc
        if not self._records(step):
            return
        phase = step // rc.rl_steps
        write_weights(self.phase_dir(phase), policy, optimizer)
        if rc.reset == "phase":
            self._prune(phase)

    def _prune(self, current: int) -> None:
        """Remove phase_J for J < the current phase unless a resume could need it: a resume
        from the oldest finished checkpoint (at step s) resets to phase s // rl_steps or later."""
        done = finished_checkpoints(self.store.path)
        oldest = int(done[0].name.split("_")[1]) // self.rc.rl_steps if done else current
        for d in sorted((self.store.path / "rloop").glob("phase_*")):
            suffix = d.name.split("_")[1]
            if suffix.isdigit() and int(suffix) < min(oldest, current):
                shutil.rmtree(d, ignore_errors=True)

    def harvest(self, step: int, played: list[Episode] | list[Trajectory]) -> dict[str, float]:
        """Add step `step`'s (1-based) successes to the harvest and to harvest.jsonl; returns
        rloop/* metrics. `played`: the step's episodes (games) or completions."""
        rc = self.rc
        attempts = episode_attempts(played, drop_invalid_turns=True) if self.multi_turn else completion_attempts(played)
        kept = [a for a in select_successes(attempts, rc.per_task_cap, rc.max_pass_rate) if a.rows]  # a game won only by invalid turns teaches nothing
        records = [{"seed": a.seed, "reward": a.reward, "length": a.length, "key": a.key, "rows": [row_record(r) for r in a.rows]} for a in kept]
        self.store.append_jsonl("harvest", step, records)
        self.buffer = cap_harvest(self.buffer + records, rc.max_harvest)
        return {
            "rloop/phase": phase_of(step, rc.rl_steps) + 1,
            "rloop/harvested": len(records),
            "rloop/harvest_size": len(self.buffer),
            "rloop/harvest_rows": sum(len(d["rows"]) for d in self.buffer),
        }

    def due(self, done: int) -> bool:
        """Whether the step that made `done` steps ends a phase (the run's last step only with `final_sft`)."""
        return done % self.rc.rl_steps == 0 and (done < self.cfg.train.steps or self.rc.final_sft)

    def refresh(self, policy: Policy, optimizer: torch.optim.Optimizer, done: int, gen: torch.Generator, opt_step: int,
                learner: DataParallel | SingleProcess = SINGLE) -> tuple[int, dict[str, float]]:
        """The end of the phase that step `done` closes: reset the weights (`reset`), clear the
        optimizer state, fine-tune on the harvest, clear it again. Returns the optimizer step
        count and the rloop/* metrics of the fine-tune."""
        rc = self.rc
        t0 = time.perf_counter()
        phase = phase_of(done, rc.rl_steps)
        source = reset_source(phase, rc.reset)
        rows = [row_from_record(r, self.cfg.env.name) for d in self.buffer for r in d["rows"]]
        if source is not None:
            restore_weights(policy, inside_tree(self.store.path, self.phase_dir(source)))  # no file of the phase's weights leads out of the run (issue 49)
        optimizer.state.clear()  # the fine-tune starts with fresh moments (those of RL belong to other weights)
        first = opt_step
        loss = float("nan")
        if rows:
            opt_step, loss = finetune(policy, optimizer, rows, self.sft, gen, opt_step, learner)
        optimizer.state.clear()  # and so does the next phase's RL
        successes = len(self.buffer)
        if not rc.accumulate:
            self.buffer = []
        where = {"phase": f"the weights phase {phase + 1} started from", "init": "the run's starting weights", "none": "the RL weights"}[rc.reset]
        if rows:
            self.log(f"rloop: phase {phase + 1} ends at step {done}: {successes} harvested successes ({len(rows)} rows), fine-tuned from {where} "
                     f"for {opt_step - first} steps, loss {loss:.4f}")
        else:
            self.log(f"rloop: phase {phase + 1} ends at step {done} with nothing harvested: the next phase starts from {where}, not fine-tuned")
        return opt_step, {
            "rloop/sft_loss": loss,
            "rloop/sft_rows": len(rows),
            "rloop/sft_successes": successes,
            "rloop/sft_steps": opt_step - first,
            "rloop/reset": float(source is not None),
            "time/rloop_s": time.perf_counter() - t0,
        }


class RLoopMethod(Method):
    name = "rloop"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.rloop.enabled

    def open(self) -> None:
        ctx = self.ctx
        self.loop = RLoop.open(ctx.cfg, ctx.store, ctx.start_step, ctx.multi_turn, ctx.log)

    def begin_step(self, step: int) -> None:
        self.loop.begin(step, self.ctx.policy, self.ctx.optimizer)  # a phase's first step keeps the weights the phase will reset to

    def after_sample(self, step: int, played) -> dict:
        return self.loop.harvest(step + 1, played.harvest)  # the step's successes, for the phase's fine-tune

    def end_step(self, end: StepEnd) -> dict:
        if not self.loop.due(end.done):
            return {}
        ctx = self.ctx  # the RL phase ends: reset, fine-tune on its harvest, and the next phase starts there
        end.opt_step, refreshed = self.loop.refresh(ctx.policy, ctx.optimizer, end.done, end.generator, end.opt_step, ctx.run.learner)
        ctx.store.log_metrics(end.done, refreshed)
        ctx.engine.load_weights(ctx.policy)
        return {}
