"""Curricula over training tasks, as the recipes use them (`[curriculum]`, docs/curriculum.md).

    cur = Curriculum.open(cfg, multi_turn, run.state, env)     # None when [curriculum] is off
    tasks = cur.tasks(step, B, env)          # this step's seeds, their hints, what each one is
    ...  roll out tasks.seeds (with tasks.hints), score  ...
    cur.observe(tasks, wins)                 # wins[i]: the successes of seed i's attempts
    metrics.update(cur.metrics())            # curriculum/*
    state["curriculum"] = cur.state_dict()   # in the checkpoint: a resumed run draws what an uninterrupted one would

Two parts, each on its own switch:

* Arms (`curriculum.mode`, `ArmSampler`): the user declares arms, each a set of env options
  over `env.kwargs`. A training seed names its arm (`recursa.envs.arms`: the run's envs route
  training seeds to the arm's settings and held-out seeds to `env.kwargs`), so drawing a task
  from arm k is drawing a seed of arm k. 'progress' draws arm k with the learning-progress
  probability of `recursa.algorithms.curriculum` from the arms' pass-rate averages; 'schedule'
  takes every task from one arm, in declared order.
* Tail guidance (`curriculum.tail`, `TailTable`, after GSI, Ding et al. 2024, "Mitigating tail
  narrowing in LLM self-improvement via Socratic-guided sampling"): a training task with
  `min_attempts` attempts and no success joins a table; each step a share of the tasks are
  re-offered from it with a hint in the prompt (`tail_hint`: the walkthrough's first actions,
  the reference answer's form, or the answer, all PRIVILEGED: they read the task's oracle). A
  task solved with its hint leaves the table; one that fails `max_offers` times is dropped.
  GRPO trains on the hinted attempts as sampled (the hint is in the row's prompt, so the update
  stays on-policy); expert iteration imitates a hinted success under the bare prompt
  (`bare_rows`, STaR's rationalization), since imitation has no ratio to correct. RSIPO's
  `[hatch]` is the off-policy variant (bare prompt, per-token importance weights,
  recursa/algorithms/hinted.py), for all-fail groups of the current step.

Every random draw comes from a generator seeded by (train.seed, step), as `train_seeds` draws
its seeds; with both parts off no recipe calls this module.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from recursa.agent import AgentConfig, render_turn
from recursa.algorithms.curriculum import answer_form, arm_probabilities, draw_index, ema, learning_progress, schedule_arm
from recursa.envs.arms import ARM_ITEMS, arm_of, arm_seed
from recursa.envs.base import split_seed
from recursa.errors import UserError
from recursa.rollout import render_prompt
from recursa.trajectory import Episode, Trajectory

__all__ = ["ArmSampler", "Curriculum", "StepTasks", "TailTable", "bare_rows", "check_curriculum", "plain_draw", "tail_hint"]

MAX_HINT_CHARS = 600  # a tail hint is clipped to this many characters


def plain_draw(rng: random.Random) -> int:
    """A training seed drawn uniformly, as `recipes.grpo.train_seeds` draws each of its seeds."""
    return split_seed("train", rng.randrange(ARM_ITEMS))


@dataclass
class StepTasks:
    """One step's (round's) training tasks."""

    seeds: list[int]
    hints: list[str | None] | None  # per seed, the hint in its prompt; None when no task has one
    kinds: list[str]  # per seed: "tail" (re-offered with a hint), "revisit" (rft's unhinted re-draws), "fresh"

    @property
    def n_tail(self) -> int:
        return sum(k == "tail" for k in self.kinds)


# ----------------------------------------------------------------------------- arms


class ArmSampler:
    """The arms' pass-rate averages and this step's arm probabilities (see the module doc)."""

    def __init__(self, cc, state: dict | None = None):
        self.mode, self.names = cc.mode, cc.arm_names()
        self.k = len(self.names)
        self.fast_rate, self.slow_rate, self.epsilon = cc.fast_rate, cc.slow_rate, cc.epsilon
        self.schedule_steps, self.advance_at = list(cc.schedule_steps), cc.advance_at
        self.fast: list[float | None] = [None] * self.k
        self.slow: list[float | None] = [None] * self.k
        self.advanced = 0  # schedule: the arm pass-rate advances have reached
        self.current = 0  # schedule: this step's arm
        self.probs = [1.0 / self.k] * self.k
        self._drawn = [0] * self.k
        self._rates: dict[int, float] = {}
        if state:
            self.load_state_dict(state)

    def begin(self, step: int) -> None:
        """Fix the arm probabilities of `step` (0 = the first step) from the averages so far."""
        if self.mode == "schedule":
            self.current = schedule_arm(step, self.schedule_steps, self.advanced, self.k)
            self.probs = [1.0 if i == self.current else 0.0 for i in range(self.k)]
        else:
            self.probs = arm_probabilities(learning_progress(self.fast, self.slow), self.epsilon)
        self._drawn, self._rates = [0] * self.k, {}

    def draw(self, rng: random.Random) -> int:
        """A training seed of an arm drawn with this step's probabilities."""
        arm = draw_index(self.probs, rng.random())
        return arm_seed(arm, rng.randrange(ARM_ITEMS), self.k)

    def observe(self, seeds: list[int], wins: list[list[bool]]) -> None:
        """Update the averages of the arms of `seeds` with this step's pass rates, then (schedule)
        move on when the current arm's fast average reached `advance_at`."""
        hits: dict[int, list[int]] = {}
        for seed, w in zip(seeds, wins):
            arm = arm_of(seed, self.k)
            if arm is not None:
                self._drawn[arm] += 1
            if arm is not None and w:
                h = hits.setdefault(arm, [0, 0])
                h[0] += sum(bool(x) for x in w)
                h[1] += len(w)
        for arm, (won, n) in sorted(hits.items()):
            rate = won / n
            self._rates[arm] = rate
            self.fast[arm] = ema(self.fast[arm], rate, self.fast_rate)
            self.slow[arm] = ema(self.slow[arm], rate, self.slow_rate)
        if self.mode == "schedule" and self.advance_at is not None and self.current in self._rates:
            if self.fast[self.current] >= self.advance_at:
                self.advanced = max(self.advanced, self.current + 1)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.mode == "schedule":
            out["curriculum/arm"] = float(self.current)
        progress = learning_progress(self.fast, self.slow)
        for i, name in enumerate(self.names):
            out[f"curriculum/arm_prob/{name}"] = self.probs[i]
            out[f"curriculum/arm_tasks/{name}"] = float(self._drawn[i])
            if i in self._rates:
                out[f"curriculum/pass_rate/{name}"] = self._rates[i]
            if self.fast[i] is not None:
                out[f"curriculum/pass_fast/{name}"] = self.fast[i]
                out[f"curriculum/pass_slow/{name}"] = self.slow[i]
                out[f"curriculum/progress/{name}"] = progress[i]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "fast": list(self.fast), "slow": list(self.slow), "advanced": self.advanced}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state.get("names", [])) != self.names:
            raise UserError(f"the checkpoint's curriculum arms are {state.get('names')}, this config's {self.names}: resume with the run's own [curriculum]")
        self.fast, self.slow = list(state["fast"]), list(state["slow"])
        self.advanced = int(state.get("advanced", 0))


# ----------------------------------------------------------------------------- tail guidance


def tail_hint(env, seed: int, kind: str, steps: int = 0) -> str | None:
    """The hint a never-solved task is re-offered with (PRIVILEGED: read from the task's oracle);
    None when the env has no oracle for it. `kind`: 'walkthrough' (the first `steps` actions of
    the game's walkthrough, all for 0), 'answer_form' (`answer_form` of the reference answer) or
    'answer' (the reference answer). Resets `env` to `seed`."""
    env.reset(seed)
    if kind == "walkthrough":
        plan = list(env.walkthrough() or [])
        shown = plan[:steps] if steps else plan
        text = f"Hint: a winning play of this game starts with these actions: {', '.join(shown)}" if shown else None
    else:
        reference = getattr(env, "reference", None)
        ref = reference() if callable(reference) else None
        if not ref:
            return None
        parse = getattr(env, "parse", None)
        answer = (parse(ref) if callable(parse) else None) or ref
        if kind == "answer":
            text = f"Hint: the correct answer is {answer}."
        else:
            text = f"Hint: the answer has the form {answer_form(answer)} (each # is a digit, each a is a letter)."
    if text is None:
        return None
    text = " ".join(text.split())
    return text if len(text) <= MAX_HINT_CHARS else text[: MAX_HINT_CHARS - 3] + "..."


class TailTable:
    """Training tasks never solved in `min_attempts` attempts, re-offered with a hint (see the module doc).

    `table` maps a seed to [offers so far, order of entry]; `pending` counts the attempts of
    unsolved tasks not yet in the table (expert iteration revisits them)."""

    def __init__(self, tc, multi_turn: bool, state: dict | None = None):
        kind = tc.hint
        if kind == "auto":
            kind = "walkthrough" if multi_turn else "answer_form"
        if kind == "walkthrough" and not multi_turn:
            raise UserError("curriculum.tail.hint = 'walkthrough' needs a multi-turn game, but this task is single-turn: use 'answer_form', 'answer' or 'auto'")
        if kind != "walkthrough" and multi_turn:
            raise UserError(f"curriculum.tail.hint = {kind!r} reads a single-turn task's reference answer, but this task is a game: use 'walkthrough' or 'auto'")
        self.kind, self.tc = kind, tc
        self.table: dict[int, list[int]] = {}
        self.pending: dict[int, int] = {}
        self.order = self.entered = self.offered = self.solved = self.dropped = 0
        self._now = {"offered": 0, "solved": 0}
        if state:
            self.load_state_dict(state)

    def quota(self, n: int) -> int:
        """Tasks of a step of n that are re-offered from the table (at most ceil(frac x n))."""
        return min(len(self.table), math.ceil(self.tc.frac * n))

    def offer(self, n: int, env) -> tuple[list[int], list[str]]:
        """Up to n table tasks, least offered first (then oldest), with their hints; a task its
        env has no hint for is dropped from the table."""
        self._now = {"offered": 0, "solved": 0}
        seeds, hints = [], []
        for seed in sorted(self.table, key=lambda s: tuple(self.table[s])):
            if len(seeds) == n:
                break
            hint = tail_hint(env, seed, self.kind, self.tc.walkthrough_steps)
            if hint is None:
                del self.table[seed]
                self.dropped += 1
                continue
            seeds.append(seed)
            hints.append(hint)
        return seeds, hints

    def observe(self, seeds: list[int], wins: list[list[bool]], hinted: bool) -> None:
        """Record the outcomes of re-offered (`hinted`) or ordinary tasks."""
        for seed, w in zip(seeds, wins):
            won = any(w)
            if hinted:
                entry = self.table.get(seed)
                if entry is None:
                    continue
                self._now["offered"] += 1
                if entry[0] == 0:
                    self.offered += 1  # a task offered for the first time
                if won:
                    self._now["solved"] += 1
                    self.solved += 1
                    del self.table[seed]
                else:
                    entry[0] += 1
                    if entry[0] >= self.tc.max_offers:
                        del self.table[seed]
                        self.dropped += 1
            elif won:
                self.pending.pop(seed, None)
            elif seed not in self.table:
                attempts = self.pending.pop(seed, 0) + len(w)
                if attempts >= self.tc.min_attempts:
                    self.table[seed] = [0, self.order]
                    self.order += 1
                    self.entered += 1
                else:
                    self.pending[seed] = attempts

    def metrics(self) -> dict[str, float]:
        out = {
            "curriculum/tail_size": float(len(self.table)),
            "curriculum/tail_offered": float(self._now["offered"]),
            "curriculum/tail_entered": float(self.entered),
            "curriculum/tail_dropped": float(self.dropped),
        }
        if self._now["offered"]:
            out["curriculum/tail_solved_share"] = self._now["solved"] / self._now["offered"]
        if self.offered:
            out["curriculum/tail_solved_cum"] = self.solved / self.offered
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "table": [[s, *v] for s, v in self.table.items()],
            "pending": [[s, n] for s, n in self.pending.items()],
            "order": self.order, "entered": self.entered, "offered": self.offered, "solved": self.solved, "dropped": self.dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.table = {int(s): [int(o), int(k)] for s, o, k in state["table"]}
        self.pending = {int(s): int(n) for s, n in state["pending"]}
        for key in ("order", "entered", "offered", "solved", "dropped"):
            setattr(self, key, int(state[key]))


def bare_rows(source: Episode | Trajectory, tokenizer, agent: AgentConfig, system: str | None) -> list[Trajectory]:
    """The training rows of a hinted attempt with each prompt rendered again without the hint:
    the same action ids, the prompt the policy sees without guidance (a game's rows as
    `Episode.rows()` makes them, a single-turn completion as one row). Without a hint in the
    first place this returns the attempt's own rows, token for token."""
    if isinstance(source, Trajectory):
        first = source.action_mask.index(1) if 1 in source.action_mask else len(source.token_ids)
        prompt = render_prompt(tokenizer, source.prompt_text, system)
        actions = source.token_ids[first:]
        return [dataclasses.replace(source, token_ids=prompt + actions, action_mask=[0] * len(prompt) + [1] * len(actions),
                                    sample_logprobs=[0.0] * len(prompt) + source.sample_logprobs[first:])]
    rows = []
    for row in source.rows():
        k = row.info["turn"]
        turn = source.turns[k]
        history = [(u.observation, u.action) for u in source.turns[:k]]
        prompt = render_prompt(tokenizer, render_turn(source.task, turn.observation, turn.admissible, history, agent), system)
        rows.append(dataclasses.replace(row, token_ids=prompt + turn.action_ids, action_mask=[0] * len(prompt) + [1] * len(turn.action_ids),
                                        sample_logprobs=[0.0] * len(prompt) + turn.action_logprobs))
    return rows


# ----------------------------------------------------------------------------- both


def check_curriculum(cfg) -> None:
    """Fail before the run directory is touched, with a one-line error: build (and close) each
    arm's env once, so a bad arm option names its arm instead of failing when its first task is
    drawn; and check that an explicit tail hint kind fits the task (a walkthrough needs a game,
    an answer a single-turn task). Nothing to do with [curriculum] off."""
    from recursa.envs.base import make_env
    from recursa.envs.dataset import task_factory
    from recursa.rollout import is_agent_env

    cc = cfg.curriculum
    if cc.mode != "off":
        for name, arm in zip(cc.arm_names(), cc.arms):
            try:
                env = make_env(cfg.env.name, **{**cfg.env.kwargs, **arm.kwargs})
            except UserError as exc:
                raise UserError(f"curriculum arm {name!r} (kwargs {arm.kwargs}): {exc}") from None
            _close(env)
    if cc.tail.enabled and cc.tail.hint != "auto":
        env = task_factory(cfg)()
        multi_turn = is_agent_env(env)
        _close(env)
        TailTable(cc.tail, multi_turn)  # raises on a hint kind the task cannot give


def _close(env) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


class Curriculum:
    """The run's curriculum: `arms` (None when curriculum.mode = 'off') and `tail` (None when
    curriculum.tail is off)."""

    def __init__(self, cfg, multi_turn: bool, state: dict | None = None):
        cc = cfg.curriculum
        state = state or {}
        self.seed = cfg.train.seed
        self.arms = ArmSampler(cc, state.get("arms")) if cc.mode != "off" else None
        self.tail = TailTable(cc.tail, multi_turn, state.get("tail")) if cc.tail.enabled else None

    @classmethod
    def open(cls, cfg, multi_turn: bool, run_state: dict) -> "Curriculum | None":
        """The run's curriculum, restored from the checkpoint's state; None when every part is off."""
        cc = cfg.curriculum
        if cc.mode == "off" and not cc.tail.enabled:
            return None
        return cls(cfg, multi_turn, run_state.get("curriculum"))

    def begin(self, step: int) -> None:
        """Fix this step's arm probabilities (call before `draw`)."""
        if self.arms is not None:
            self.arms.begin(step)

    def draw(self, rng: random.Random) -> int:
        """A fresh training seed: from an arm drawn by the curriculum, or uniform without arms."""
        return self.arms.draw(rng) if self.arms is not None else plain_draw(rng)

    def offer(self, n: int, env) -> tuple[list[int], list[str]]:
        """Tail tasks re-offered in a step of n tasks, with their hints ([] without tail guidance)."""
        if self.tail is None:
            return [], []
        return self.tail.offer(self.tail.quota(n), env)

    def tasks(self, step: int, n: int, env) -> StepTasks:
        """A GRPO / RSIPO step's n tasks: the tail re-offers first, then fresh draws from the
        generator `train_seeds` uses for this step."""
        self.begin(step)
        tail_seeds, tail_hints = self.offer(n, env)
        rng = random.Random(self.seed * 7919 + step)
        fresh = [self.draw(rng) for _ in range(n - len(tail_seeds))]
        hints = tail_hints + [None] * len(fresh) if tail_seeds else None
        return StepTasks(tail_seeds + fresh, hints, ["tail"] * len(tail_seeds) + ["fresh"] * len(fresh))

    def observe(self, tasks: StepTasks, wins: list[list[bool]]) -> None:
        """Record a step's outcomes: `wins[i]` holds the success of each attempt at tasks.seeds[i].
        Arms learn from fresh tasks only (revisits and hinted tasks are not a fair sample)."""
        kinds = tasks.kinds
        if self.tail is not None:
            pick = lambda want: [i for i, k in enumerate(kinds) if k in want]  # noqa: E731
            hinted, other = pick(("tail",)), pick(("revisit", "fresh"))
            self.tail.observe([tasks.seeds[i] for i in hinted], [wins[i] for i in hinted], hinted=True)
            self.tail.observe([tasks.seeds[i] for i in other], [wins[i] for i in other], hinted=False)
        if self.arms is not None:
            fresh = [i for i, k in enumerate(kinds) if k == "fresh"]
            self.arms.observe([tasks.seeds[i] for i in fresh], [wins[i] for i in fresh])

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.arms is not None:
            out.update(self.arms.metrics())
        if self.tail is not None:
            out.update(self.tail.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.arms is not None:
            out["arms"] = self.arms.state_dict()
        if self.tail is not None:
            out["tail"] = self.tail.state_dict()
        return out
