"""The plug-in protocol of a training method, and the registry of methods.

A recipe's loop runs the stages every recipe shares (choose tasks -> sample -> score ->
advantages -> update -> publish -> record). An optional method (a curriculum, a
demonstration anchor, RLoop's phases, iGRPO's drafts, the gates, or a method of your own)
plugs into those stages by implementing only the hooks it needs of `Method`; the loop calls
every enabled method at each hook, in a fixed order, and never names one. A method keeps
its own state and says what of it goes into a checkpoint.

The hooks, in the order a step calls them (each default does nothing):

    open(run)                      once, after the run opened (restore state from run.state)
    tasks(step, n, env)            the step's tasks (a `curriculum.StepTasks`), or None
    begin_step(step)               before sampling
    hints(step, seeds, hints, ...) replace the prompts' hints before sampling; -> (hints, metrics)
    after_sample(step, played)     the step's rollouts, scored; -> metrics
    rows(s, played, room)          extra training rows after the policy's own (skill writing,
                                   hinted re-rolls, stored wins): an `Extra` (rows, the episodes
                                   sampled for them, metrics), or None; `s` is the step's
                                   `StepInputs`, `room` the episodes train.max_episodes leaves;
                                   unless a method shapes the batch, extra rows have advantage 0
    shape(s, batch, played)        the collated batch (the policy's rows, then every method's
                                   extra rows in order): set `batch.advantages` per token and
                                   return a `Shaping` (imitation / distillation terms, metrics),
                                   or None; one method at most shapes a batch (RSIPO's teacher)
    update_term()                  an extra loss term the update adds at every optimizer step
    after_update(step, played, s)  after the update and before publishing; -> metrics
    end_step(end)                  after the step's metrics are logged: gates, phase ends; a
                                   method that changes the weights publishes them to the
                                   engine and advances end.opt_step; -> metrics logged at the step
    state_dict()                   what goes into the checkpoint's state (a dict, or None)
    close()                        at the end of the run, after the final evaluation (a method
                                   may evaluate the final weights its own way here)

`eval_hints()`, asked once before any method opens, gives the hints every evaluation shows
its items (RSIPO's skills.in_context: the library's skill for each task), or None; the loop
passes them to every evaluation and each method finds them as `ctx.eval_hints`. A method that
needs a sibling's state (the skills gate needs the library, hinted re-rolls the replay
buffer) finds the sibling by name with `ctx.find(name)`, which sees the methods opened
before it; what a method makes of one step for the methods after it (a `SkillStep`, a
`HintedStep`) it leaves in `played.parts[name]`.

`extra_episodes(cfg)` counts the episodes a method samples beyond B x G per step (iGRPO's
drafts), for `budget/episodes`. `watches_evals` marks the method whose `look` records each
held-out evaluation as a test look (the weights gate).

Methods are found by name in `METHODS` (recursa/registry.py: built-in import paths, your
own by `METHODS.register` or a `recursa.methods` entry point). A config enables the built-in
ones with their own sections (`[curriculum]`, `[anchor]`, ...; each method's `enabled(cfg)`
reads them) and a method of yours with a table `[methods.<name>]` whose keys are its
options (docs/extending.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable



@dataclass
class RunContext:
    """What a method may use for the whole run (filled by the recipe before `open`)."""

    cfg: Any
    run: Any  # recipes.common.OpenedRun: pool, store, policy, optimizer, multi_turn, state, learner
    engine: Any  # the rollout engine (publishes weights, decodes evaluations)
    rollouts: Any  # the rollout backend (in this process or on Ray workers)
    reward_set: Any  # rewards.RewardSet, or None for the env's reward alone
    log: Callable[[str], None]
    progress: Any = None
    options: dict = field(default_factory=dict)  # a user method's [methods.<name>] table
    eval_hints: Callable | None = None  # seeds -> the hint each evaluation item is shown (set before `open`), or None
    methods: Any = None  # the run's `Methods` (set before `open`); `find` looks a sibling up in it

    def find(self, name: str):
        """The enabled method called `name`, or None (a sibling opened before the caller, or any after `open`)."""
        return self.methods.find(name) if self.methods is not None else None

    @property
    def policy(self):
        return self.run.policy

    @property
    def optimizer(self):
        return self.run.optimizer

    @property
    def store(self):
        return self.run.store

    @property
    def pool(self):
        return self.run.pool

    @property
    def multi_turn(self) -> bool:
        return self.run.multi_turn

    @property
    def start_step(self) -> int:
        return self.run.start_step


@dataclass
class StepInputs:
    """What a step sampled from, as the hooks after sampling read it."""

    step: int  # 0-based
    seeds: list[int]  # (B,) the step's tasks
    hints: list | None  # (B,) the hint shown with each task while sampling, or None
    sampling: Any  # generation.SamplingParams
    generator: Any  # the step's torch.Generator
    system: str | None  # the system prompt the step sampled with


@dataclass
class Extra:
    """A method's extra training rows for the step (`rows`)."""

    rows: list = field(default_factory=list)  # Trajectory rows, appended after the policy's own and the earlier methods'
    episodes: int = 0  # episodes sampled for them (counted in episodes/sampled and budget/episodes)
    metrics: dict = field(default_factory=dict)


@dataclass
class Shaping:
    """A method's shaping of the collated batch (`shape`): the update's extra loss terms."""

    imitation: Any = None  # recipes.grpo.Imitation, or None
    distillation: Any = None  # recipes.grpo.Distillation, or None
    metrics: dict = field(default_factory=dict)


@dataclass
class StepEnd:
    """What `end_step` sees of a finished step, and what it may change."""

    done: int  # the step just finished (1-based)
    final: bool  # the run's last step
    generator: Any  # the step's torch.Generator
    opt_step: int  # optimizer steps so far (a method that fine-tunes advances it, and publishes the new weights itself)


class Method:
    """A training method as a plug-in; see the module docstring for the hooks."""

    name = "method"
    watches_evals = False

    @classmethod
    def enabled(cls, cfg) -> bool:
        """Whether `cfg` switches this method on (a user method: always, once named)."""
        return True

    @classmethod
    def check(cls, cfg) -> None:
        """Refuse a config this method cannot run, before the run directory is touched."""

    @classmethod
    def extra_episodes(cls, cfg) -> int:
        return 0

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    def open(self) -> None: ...

    def tasks(self, step: int, n: int, env):
        return None

    def begin_step(self, step: int) -> None: ...

    def hints(self, step: int, seeds: list[int], hints: list[str] | None, sampling, generator, system_prompt) -> tuple[list[str] | None, dict]:
        return hints, {}

    def after_sample(self, step: int, played) -> dict:
        return {}

    def eval_hints(self):
        return None

    def rows(self, s: StepInputs, played, room: int | None) -> Extra | None:
        return None

    def shape(self, s: StepInputs, batch, played) -> Shaping | None:
        return None

    def update_term(self):
        return None

    def after_update(self, step: int, played, stats) -> dict:
        return {}

    def end_step(self, end: StepEnd) -> dict | list[dict]:
        """Metrics to record at the step: one dict, or a list of rows recorded one by one."""
        return {}

    def state_dict(self) -> dict | None:
        return None

    def close(self) -> None: ...


class Methods:
    """The enabled methods of a run, called in order at each hook."""

    def __init__(self, methods: list[Method]):
        self.methods = methods
        self.eval_hints = None

    def __iter__(self):
        return iter(self.methods)

    def find(self, name: str):
        return next((m for m in self.methods if m.name == name), None)

    def open(self) -> None:
        """Tell every method the evaluation hints and its siblings, then open them in order."""
        self.eval_hints = next((h for m in self.methods if (h := m.eval_hints()) is not None), None)
        for m in self.methods:
            m.ctx.eval_hints, m.ctx.methods = self.eval_hints, self
        for m in self.methods:
            m.open()

    def tasks(self, step: int, n: int, env):
        for m in self.methods:
            tasks = m.tasks(step, n, env)
            if tasks is not None:
                return tasks
        return None

    def begin_step(self, step: int) -> None:
        for m in self.methods:
            m.begin_step(step)

    def hints(self, step, seeds, hints, sampling, generator, system_prompt) -> tuple[list[str] | None, dict]:
        metrics: dict = {}
        for m in self.methods:
            hints, more = m.hints(step, seeds, hints, sampling, generator, system_prompt)
            metrics.update(more)
        return hints, metrics

    def after_sample(self, step: int, played) -> dict:
        return _merged(m.after_sample(step, played) for m in self.methods)

    def rows(self, s: StepInputs, played, room: int | None, times: dict | None = None) -> list[tuple[str, Extra]]:
        """Each method's extra rows, in order, as (name, Extra); `room` shrinks by the episodes
        each sampled. `times` (name -> seconds) receives how long each method took."""
        out = []
        for m in self.methods:
            t0 = time.perf_counter()
            extra = m.rows(s, played, room)
            if times is not None:
                times[m.name] = time.perf_counter() - t0
            if extra is not None:
                out.append((m.name, extra))
                if room is not None:
                    room -= extra.episodes
        return out

    def shape(self, s: StepInputs, batch, played) -> Shaping:
        shaped = [x for m in self.methods if (x := m.shape(s, batch, played)) is not None]
        if len(shaped) > 1:
            raise ValueError(f"{len(shaped)} methods shape the batch's advantages; a batch takes one")
        return shaped[0] if shaped else Shaping()

    def update_term(self):
        terms = [t for m in self.methods if (t := m.update_term()) is not None]
        if len(terms) > 1:
            raise ValueError(f"{len(terms)} methods add an update term; the update takes one")
        return terms[0] if terms else None

    def after_update(self, step: int, played, stats) -> dict:
        return _merged(m.after_update(step, played, stats) for m in self.methods)

    def end_step(self, end: StepEnd, record: Callable[[int, dict], None]) -> None:
        """Each method's end of the step, its metrics recorded at the step as it returns them."""
        for m in self.methods:
            metrics = m.end_step(end)
            for part in metrics if isinstance(metrics, list) else [metrics] if metrics else []:
                record(end.done, part)

    def state_dict(self) -> dict:
        out: dict = {}
        for m in self.methods:
            state = m.state_dict()
            if state:
                out.update(state)
        return out

    def extra_episodes(self, cfg) -> int:
        """Episodes the methods sample per step beyond B x G (iGRPO's drafts)."""
        return sum(type(m).extra_episodes(cfg) for m in self.methods)

    @property
    def gate(self):
        """The method that records held-out evaluations as test looks (the weights gate), or None."""
        return next((m for m in self.methods if m.watches_evals), None)

    def close(self) -> None:
        for m in self.methods:
            m.close()


def _merged(parts) -> dict:
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


from recursa.plugins import METHODS  # noqa: E402  (the table of methods by name)


def open_methods(names: list[str], ctx: RunContext, user: dict[str, dict] | None = None) -> Methods:
    """The run's methods: the built-in `names` that `cfg` enables, in that order, then the
    user's (`[methods.<name>]` tables, `user`), each given its options."""
    methods: list[Method] = []
    for name in names:
        cls = METHODS.get(name)
        if cls.enabled(ctx.cfg):
            methods.append(cls(ctx))
    for name, options in (user or {}).items():
        cls = METHODS.get(name)
        methods.append(cls(RunContext(**{**ctx.__dict__, "options": dict(options)})))
    return Methods(methods)


def check_methods(names: list[str], cfg, user: dict[str, dict] | None = None) -> None:
    """Every enabled method's `check(cfg)`, before the run directory is touched."""
    for name in [*names, *(user or {})]:
        cls = METHODS.get(name)
        if name in (user or {}) or cls.enabled(cfg):
            cls.check(cfg)
