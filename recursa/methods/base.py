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
    update_term()                  an extra loss term the update adds at every optimizer step
    after_update(step, played, s)  after the update and before publishing; -> metrics
    end_step(end)                  after the step's metrics are logged: gates, phase ends; a
                                   method that changes the weights publishes them to the
                                   engine and advances end.opt_step; -> metrics logged at the step
    state_dict()                   what goes into the checkpoint's state (a dict, or None)
    close()                        at the end of the run

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

    def __iter__(self):
        return iter(self.methods)

    def open(self) -> None:
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
