"""Expert iteration (rejection-sampling fine-tuning), written out.

    for round in range(rounds):
        [probe   <- curriculum.bstar: a probe batch sampled at each candidate temperature picks
                    the round's temperature and G by B-STaR's balance score]
        tasks    <- B training seeds: a share `revisit_frac` re-drawn from earlier unsolved
                    tasks (at most `max_revisits` times each), the rest fresh ([curriculum]:
                    fresh tasks drawn from the arms, and a share re-offered from the
                    never-solved tail with a hint, recursa/curriculum.py)
        sample   -> B x G attempts with the current policy (episodes, for games), in this
                    process or on Ray workers (`distributed`, recursa/distributed/)
        keep     <- per task: the successes, best reward first, then shortest first
                    (`prefer_short`), identical solutions dropped (`dedupe`), at most
                    `per_task_cap` of them
        report   <- pass@1 and pass@G of the attempts, share of tasks solved, diversity of
                    the attempts and of the kept solutions (an exploration collapse shows
                    as falling diversity while pass@1 rises)
        finetune <- `train.epochs` passes of token-mean NLL over the kept solutions' own
                    tokens (this round's, or every round's so far with `accumulate`); a
                    success on a hinted tail task is imitated under the bare prompt
        evaluate <- every `eval.every` rounds, and before / after
        checkpoint

This is the loop of STaR / ReST-EM / RFT without rationalisation: what is imitated is
exactly what the policy sampled (token ids, never re-tokenized), so a round is a
conservative step toward the policy's own successful behaviour. For games every turn of a
kept episode is a row, except turns whose action was invalid (`drop_invalid_turns`).

The kept solutions and the per-task outcomes are logged to kept.jsonl and tasks.jsonl in
the run directory; a resumed run rebuilds its buffer and its unsolved-task pool from them.
Every random draw of round r comes from a generator seeded by (train.seed, r).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from recursa.algorithms.curriculum import BalanceScore, balance_score, best_candidate
from recursa.config import RFTConfig
from recursa.curriculum import Curriculum, StepTasks, bare_rows, check_curriculum, plain_draw
from recursa.distributed.ddp import SINGLE, DataParallel, SingleProcess
from recursa.distributed.rollouts import RolloutBackend, make_rollouts
from recursa.engines import make_engine
from recursa.envs import split_seed
from recursa.envs.base import system_prompt_of
from recursa.generation import SamplingParams
from recursa.recipes.common import (
    check_finite,
    eval_before,
    mid_eval,
    mid_eval_due,
    mid_eval_missing,
    open_run,
    Progress,
    batch_order,
    run_eval,
    step_generator,
    supervised_step,
)
from recursa.methods.gating import WeightsGate
from recursa.stats import pass_at_k
from recursa.trajectory import Episode, Trajectory, collate


@dataclass
class Attempt:
    """One sampled attempt at a task, reduced to what selection needs."""

    seed: int
    reward: float
    success: bool
    key: str  # the solution's identity: the actions taken (games) or the reply text
    rows: list[Trajectory]  # what fine-tuning would imitate
    length: int = 0  # turns taken (games) or reply tokens (single-turn): shorter wins ties
    source: Episode | Trajectory | None = None  # the episode or completion itself (to render its prompts again)


def round_seeds(cfg: RFTConfig, round_index: int, unsolved: dict[int, int], n: int | None = None,
                draw: Callable[[random.Random], int] | None = None, exclude: set[int] | frozenset = frozenset()) -> tuple[list[int], int]:
    """The round's n (default B) task seeds and how many were revisits. `unsolved` maps an
    unsolved task's seed to the times it was drawn; the least-drawn are revisited first.
    `draw` makes a fresh seed from the round's generator (default: uniform over the train
    split; a curriculum draws from its arms); seeds in `exclude` are never drawn (the tail
    tasks re-offered with a hint)."""
    rc = cfg.rft
    n = rc.tasks_per_round if n is None else n
    rng = random.Random(cfg.train.seed * 7919 + round_index)
    quota = int(round(rc.revisit_frac * n))
    pool = sorted((k, s) for s, k in unsolved.items() if k <= rc.max_revisits and s not in exclude)
    revisits = [s for _, s in pool[:quota]]
    fresh: list[int] = []
    while len(revisits) + len(fresh) < n:
        seed = draw(rng) if draw is not None else split_seed("train", rng.randrange(10_000_000))
        if seed not in unsolved and seed not in fresh and seed not in exclude:
            fresh.append(seed)
    return revisits + fresh, len(revisits)


def keep_solutions(attempts: list[Attempt], per_task_cap: int, dedupe: bool, prefer_short: bool = True) -> list[Attempt]:
    """Per task: successes, best reward first (then, with `prefer_short`, shortest first;
    otherwise in sampling order), duplicates dropped, at most `per_task_cap`."""
    by_task: dict[int, list[Attempt]] = defaultdict(list)
    for a in attempts:
        if a.success:
            by_task[a.seed].append(a)
    kept = []
    for seed, wins in by_task.items():
        wins = sorted(wins, key=lambda a: (-a.reward, a.length if prefer_short else 0))
        if dedupe:
            seen, unique = set(), []
            for a in wins:
                if a.key not in seen:
                    seen.add(a.key)
                    unique.append(a)
            wins = unique
        kept.extend(wins[:per_task_cap] if per_task_cap else wins)
    return kept


def attempt_stats(attempts: list[Attempt], group_size: int) -> dict[str, float]:
    """pass@1, pass@G, solved share and diversity over a round's B x G attempts."""
    by_task: dict[int, list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_task[a.seed].append(a)
    tasks = list(by_task.values())
    wins = [[a for a in t if a.success] for t in tasks]
    n_wins = sum(len(w) for w in wins)
    return {
        "rft/pass@1": sum(pass_at_k(len(t), len(w), 1) for t, w in zip(tasks, wins)) / len(tasks),
        f"rft/pass@{group_size}": sum(pass_at_k(len(t), len(w), len(t)) for t, w in zip(tasks, wins)) / len(tasks),
        "rft/tasks_solved_frac": sum(bool(w) for w in wins) / len(tasks),
        "rft/attempt_distinct_frac": sum(len({a.key for a in t}) / len(t) for t in tasks) / len(tasks),
        "rft/success_distinct_frac": (sum(len({a.key for a in w}) for w in wins) / n_wins) if n_wins else float("nan"),
    }


def sample_attempts(rollouts: RolloutBackend, cfg: RFTConfig, seeds: list[int], gen: torch.Generator, multi_turn: bool,
                    hints: list[str | None] | None = None, group_size: int | None = None, temperature: float | None = None) -> tuple[list[Attempt], dict]:
    """B x G attempts with the current policy (played by `rollouts`, in this process through the rollout engine or on Ray workers); returns them and episode metrics.
    `hints[i]`: shown in seed i's prompts (tail guidance); G and the temperature default to rft.group_size and sampling.temperature."""
    rc = cfg.rft
    G = rc.group_size if group_size is None else group_size
    temperature = cfg.sampling.temperature if temperature is None else temperature
    sampling = SamplingParams(cfg.sampling.max_new_tokens, temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    system_prompt = cfg.model.system_prompt or None
    if multi_turn:
        ero = rollouts.episodes(seeds, G, sampling, gen, system_prompt, cfg.agent, hints=hints)
        n = len(ero.episodes)
        metrics = {
            "episode/success_rate": sum(e.won for e in ero.episodes) / n,
            "episode/turns_mean": sum(len(e.turns) for e in ero.episodes) / n,
            "episode/invalid_rate": sum(e.invalid_rate for e in ero.episodes) / n,
        }
        return episode_attempts(ero.episodes, rc.drop_invalid_turns), metrics
    ro = rollouts.rollout(seeds, G, sampling, gen, system_prompt, hints=hints)
    return completion_attempts(ro.trajectories), {}


def unhint_successes(attempts: list[Attempt], hinted: set[int], env, tokenizer, cfg: RFTConfig, multi_turn: bool) -> int:
    """Give each success on a hinted (tail) task the rows of its bare prompt (`bare_rows`: the
    same action ids, the prompt without the hint), so fine-tuning imitates the solution as an
    answer to the task itself (STaR's rationalization). Returns how many attempts changed."""
    changed = 0
    for a in attempts:
        if a.seed not in hinted or not a.success or a.source is None:
            continue
        env.reset(a.seed)  # the env's own system prompt for this item, as the rollout used it
        system = system_prompt_of(env) or cfg.model.system_prompt or None
        rows = bare_rows(a.source, tokenizer, cfg.agent, system)
        a.rows = [r for r in rows if not (multi_turn and cfg.rft.drop_invalid_turns and r.info["invalid"])]
        changed += 1
    return changed


@dataclass
class BStarChoice:
    """The round's sampling settings chosen on the probe batch, and what the probe cost."""

    temperature: float
    samples: int
    balance: BalanceScore
    episodes: int  # probe episodes sampled

    def metrics(self) -> dict[str, float]:
        out = {"curriculum/bstar_temperature": self.temperature, "curriculum/bstar_samples": float(self.samples),
               "curriculum/bstar_balance": self.balance.score, "curriculum/bstar_exploration": self.balance.exploration,
               "curriculum/bstar_probe_episodes": float(self.episodes)}
        if self.balance.exploitation == self.balance.exploitation:  # NaN when nothing was selected
            out["curriculum/bstar_exploitation"] = self.balance.exploitation
        return out


def bstar_choice(rollouts: RolloutBackend, cfg: RFTConfig, round_index: int, gen: torch.Generator, multi_turn: bool,
                 draw: Callable[[random.Random], int]) -> BStarChoice:
    """B-STaR's configuration search: `probe_tasks` fresh training tasks, max(samples)
    attempts each at every candidate temperature; each (temperature, G) pair is scored by
    the balance score of each task's first G attempts (`algorithms.curriculum.balance_score`),
    and the best pair wins (ties: the earlier temperature, then the earlier G)."""
    bc = cfg.curriculum.bstar
    rng = random.Random(f"bstar probe {cfg.train.seed} {round_index}")  # a stream of its own, not the round's tasks
    seeds = [draw(rng) for _ in range(bc.probe_tasks)]
    width = max(bc.samples)
    candidates: list[tuple[float, int, BalanceScore]] = []
    for temperature in bc.temperatures:
        attempts, _ = sample_attempts(rollouts, cfg, seeds, gen, multi_turn, group_size=width, temperature=temperature)
        for g in bc.samples:
            tasks = [[(a.key, bc.selected == "all" or a.success, a.success) for a in attempts[i * width : i * width + g]] for i in range(len(seeds))]
            candidates.append((temperature, g, balance_score(tasks, bc.n_star, bc.denominator)))
    t, g, score = candidates[best_candidate([c[2].score for c in candidates])]
    return BStarChoice(t, g, score, len(bc.temperatures) * len(seeds) * width)


def episode_attempts(episodes: list[Episode], drop_invalid_turns: bool) -> list[Attempt]:
    """One attempt per played episode: its actions as the key, its sampled turns as the rows
    (without the turns whose action was invalid, with `drop_invalid_turns`)."""
    out = []
    for e in episodes:
        rows = [r for r in e.rows() if not (drop_invalid_turns and r.info["invalid"])]
        out.append(Attempt(e.seed, e.total_reward, e.won, " | ".join(t.action for t in e.turns), rows, len(e.turns), e))
    return out


def completion_attempts(trajs: list[Trajectory]) -> list[Attempt]:
    """One attempt per sampled completion: its text as the key, itself as the row."""
    return [Attempt(t.seed, t.reward, t.success, t.completion_text.strip(), [t], t.num_action_tokens, t) for t in trajs]


def row_record(r: Trajectory) -> dict:
    """What a kept row's log line holds (kept.jsonl, RLoop's harvest.jsonl): enough to imitate it again."""
    return {"seed": r.seed, "token_ids": r.token_ids, "action_mask": r.action_mask, "reward": r.reward, "text": r.completion_text}


def row_from_record(d: dict, env: str) -> Trajectory:
    """The row `row_record` wrote, as a Trajectory to collate (no sampling log-probs)."""
    n = len(d["token_ids"])
    return Trajectory(env, d["seed"], 0, d["token_ids"], d["action_mask"], [0.0] * n, d["reward"], True, d["text"], "", "kept", {})


def finetune(policy, optimizer, rows: list[Trajectory], cfg, gen: torch.Generator, opt_step: int,
             learner: DataParallel | SingleProcess = SINGLE) -> tuple[int, float]:
    """`cfg.train.epochs` passes over `rows` in shuffled batches of `cfg.train.batch_size`
    (`cfg.train` a SupervisedConfig: this recipe's, or RLoop's fine-tune settings); returns
    the optimizer step count and mean loss."""
    pad = policy.tokenizer.pad_token_id
    losses = []
    for _ in range(cfg.train.epochs):
        for idx in batch_order(len(rows), cfg.train.batch_size, gen):
            chosen = [rows[int(i)] for i in idx]
            st = supervised_step(policy, optimizer, collate(chosen, torch.zeros(len(chosen), device="cpu"), pad, policy.device), cfg, opt_step, learner)
            opt_step += 1
            check_finite(opt_step, loss=st.loss, grad_norm=st.grad_norm)
            losses.append(st.loss)
    return opt_step, (sum(losses) / len(losses) if losses else float("nan"))


def train(cfg: RFTConfig, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run expert iteration into `out` (continuing from its last checkpoint when `resume`)."""
    rc = cfg.rft
    check_curriculum(cfg)  # a bad arm option or tail hint fails before the run directory is touched
    run = open_run(cfg, out, resume, log)
    pool, store, policy, optimizer, multi_turn = run.pool, run.store, run.policy, run.optimizer, run.multi_turn
    start, opt_step = run.start_step, run.opt_steps
    # the buffer and the unsolved-task pool, rebuilt from the run's own logs
    buffer = [row_from_record(d, cfg.env.name) for d in store.read_jsonl("kept")] if rc.accumulate else []
    unsolved: dict[int, int] = {}
    for d in store.read_jsonl("tasks"):
        if d["successes"]:
            unsolved.pop(d["seed"], None)
        else:
            unsolved[d["seed"]] = unsolved.get(d["seed"], 0) + 1
    engine = make_engine(cfg.rollout, policy)  # samples attempts and decodes evaluations
    gate = WeightsGate(cfg, store, pool, start, log, engine=engine) if cfg.gate.mode != "off" else None
    if gate is not None:
        gate.start(policy, optimizer, f"{cfg.model.name}{run.origin}")
    rollouts = make_rollouts(cfg, policy, pool, log, engine)  # in this process (through the engine), or on Ray workers
    curriculum = Curriculum.open(cfg, multi_turn, run.state)  # arms and tail guidance; None when both are off
    bstar = cfg.curriculum.bstar.enabled
    tail = curriculum.tail if curriculum is not None else None
    sampled_total = int(run.state.get("episodes", start * rc.tasks_per_round * rc.group_size))  # budget/episodes (B-STaR's probes included)
    eval_before(run, cfg, progress, log, engine=engine)

    if mid_eval_missing(cfg, store, start, rc.rounds):  # resumed at a checkpoint whose evaluation was cut off
        mid_eval(policy, cfg, pool, store, start, progress, gate, log, engine=engine, unit="round ")

    for rnd in range(start, rc.rounds):
        t0 = time.perf_counter()
        gen = step_generator(cfg.train.seed, rnd)
        G, temperature, choice = rc.group_size, cfg.sampling.temperature, None
        draw = None
        if curriculum is not None:
            curriculum.begin(rnd)
            draw = curriculum.draw
        if bstar:  # a probe batch at every candidate temperature picks this round's temperature and G
            choice = bstar_choice(rollouts, cfg, rnd, gen, multi_turn, curriculum.draw if curriculum is not None else plain_draw)
            G, temperature = choice.samples, choice.temperature
            sampled_total += choice.episodes
        tail_seeds, tail_hints = curriculum.offer(rc.tasks_per_round, pool.take(1)[0]) if curriculum is not None else ([], [])
        rest, n_revisit = round_seeds(cfg, rnd, unsolved, n=rc.tasks_per_round - len(tail_seeds), draw=draw,
                                      exclude=set(tail.table) if tail is not None else frozenset())
        seeds, n_tail = tail_seeds + rest, len(tail_seeds)
        hints = tail_hints + [None] * len(rest) if tail_seeds else None
        played_from = pool.mark()
        attempts, episode_metrics = sample_attempts(rollouts, cfg, seeds, gen, multi_turn, hints=hints, group_size=G, temperature=temperature)
        pool.check_played(played_from, f"round {rnd + 1}")  # a game broken for the whole round: nothing of it is kept
        sampled_total += len(attempts)
        if tail_seeds:  # a success on a hinted task is imitated under its bare prompt
            unhint_successes(attempts, set(tail_seeds), pool.take(1)[0], policy.tokenizer, cfg, multi_turn)
        t1 = time.perf_counter()

        kept = keep_solutions(attempts, rc.per_task_cap, rc.dedupe, rc.prefer_short)
        wins = [a for a in attempts if a.success]
        solved = {a.seed for a in wins}
        for s in seeds:
            if s in solved:
                unsolved.pop(s, None)
            else:
                unsolved[s] = unsolved.get(s, 0) + 1
        store.append_jsonl("tasks", rnd + 1, [
            {"seed": s, "attempts": sum(a.seed == s for a in attempts), "successes": sum(a.seed == s and a.success for a in attempts),
             "revisit": n_tail <= i < n_tail + n_revisit, **({"hinted": i < n_tail} if tail is not None else {})}
            for i, s in enumerate(seeds)
        ])
        new_rows = [r for a in kept for r in a.rows]
        store.append_jsonl("kept", rnd + 1, [row_record(r) for r in new_rows])
        buffer = buffer + new_rows if rc.accumulate else new_rows
        loss = float("nan")
        if buffer:
            opt_step, loss = finetune(policy, optimizer, buffer, cfg, gen, opt_step, run.learner)
            engine.load_weights(policy)
        t2 = time.perf_counter()

        metrics = {
            **episode_metrics,
            **attempt_stats(attempts, G),
            "rft/kept": len(kept),
            "rft/kept_rows": len(new_rows),
            "rft/kept_tasks": len({a.seed for a in kept}),
            "rft/kept_len_mean": sum(a.length for a in kept) / len(kept) if kept else float("nan"),
            "rft/success_len_mean": sum(a.length for a in wins) / len(wins) if wins else float("nan"),
            "rft/buffer_rows": len(buffer),
            "rft/revisits": n_revisit,
            "rft/revisits_solved": sum(s in solved for s in seeds[n_tail : n_tail + n_revisit]),
            "rft/unsolved_pool": len(unsolved),
            "reward/mean": sum(a.reward for a in attempts) / len(attempts),
            "budget/episodes": sampled_total,
            "sft/loss": loss,
            "time/rollout_s": t1 - t0,
            "time/update_s": t2 - t1,
            "time/step_s": t2 - t0,
            **rollouts.metrics(),
            **pool.metrics(),  # env/restarts: games that crashed or hung this step
        }
        if choice is not None:
            metrics.update(choice.metrics())
        if curriculum is not None:  # the arms learn from the fresh tasks, the tail table from every task
            kinds = ["tail"] * n_tail + ["revisit"] * n_revisit + ["fresh"] * (len(seeds) - n_tail - n_revisit)
            curriculum.observe(StepTasks(seeds, hints, kinds), [[a.success for a in attempts[i * G : (i + 1) * G]] for i in range(len(seeds))])
            metrics.update(curriculum.metrics())
        store.log_metrics(rnd + 1, metrics)
        store.log_samples(rnd + 1, [{"seed": a.seed, "completion": a.key, "reward": a.reward} for a in kept[: cfg.run.log_samples]])
        if progress:
            progress("rounds", rnd + 1, rc.rounds)
        log(
            f"round {rnd + 1}/{rc.rounds}  pass@1 {metrics['rft/pass@1']:.3f}  pass@{G} {metrics[f'rft/pass@{G}']:.3f}  "
            f"kept {len(kept)} ({len(new_rows)} rows)  loss {loss:.4f}  sample {t1 - t0:.1f}s  finetune {t2 - t1:.1f}s"
        )
        done = rnd + 1
        if gate is not None and (done % cfg.gate.every == 0 or done == rc.rounds):
            store.log_metrics(done, gate.check(policy, optimizer, done, progress))
        if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == rc.rounds:
            state = {"opt_steps": opt_step, **({"episodes": sampled_total} if bstar else {}),
                     **({"curriculum": curriculum.state_dict()} if curriculum is not None else {})}
            store.save_checkpoint(done, policy, optimizer, state)
        if mid_eval_due(cfg, done, rc.rounds):  # after the checkpoint: a kill during the evaluation loses no training
            mid_eval(policy, cfg, pool, store, done, progress, gate, log, engine=engine, unit="round ")

    rollouts.close()
    if rc.rounds == 0 and store.latest_checkpoint() is None:
        store.save_checkpoint(0, policy, optimizer, {"opt_steps": 0})
    if cfg.eval.after and cfg.eval.n > 0 and not (out / "eval" / "after.json").exists():
        r = run_eval(policy, cfg, pool, store, rc.rounds, "after", progress, gate, engine=engine)
        log(f"after: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")
    engine.close()
    store.close()
    pool.close()
    return out
