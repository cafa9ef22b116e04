"""The curriculum as a plug-in (`[curriculum]`, recursa/curriculum.py): it chooses each
step's tasks (arms drawn by learning progress or a schedule, and never-solved tasks offered
again with a hint) and learns from the step's outcomes."""

from __future__ import annotations

from recursa.curriculum import Curriculum, check_curriculum
from recursa.methods.base import Method


class CurriculumMethod(Method):
    name = "curriculum"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.curriculum.mode != "off" or cfg.curriculum.tail.enabled

    @classmethod
    def check(cls, cfg) -> None:
        check_curriculum(cfg)  # a bad arm option or tail hint fails before the run directory is touched

    def open(self) -> None:
        self.curriculum = Curriculum(self.ctx.cfg, self.ctx.multi_turn, self.ctx.run.state.get("curriculum"))
        self.current = None

    def tasks(self, step: int, n: int, env):
        self.current = self.curriculum.tasks(step, n, env)  # arms, tail re-offers with hints
        return self.current

    def after_update(self, step: int, played, stats) -> dict:
        self.curriculum.observe(self.current, played.wins)  # the arms' pass-rate averages and the tail table learn from this step
        return self.curriculum.metrics()

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()}
