"""RSIPO's stored wins for all-win groups (route.mode = 'pass_rate'): winning attempts from the
replay buffer as supervised rows weighted by the group's pass rate.

A plug-in of RSIPO's step (recursa/recipes/rsipo.py): its extra rows follow the policy's own."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recursa.algorithms.routing import ALL_WIN
from recursa.config import RSIPOConfig
from recursa.models import Policy
from recursa.rollout import render_prompt
from recursa.trajectory import Trajectory
from recursa.methods.attempts import Attempt, user_message
from recursa.methods.base import Extra, Method

# ----------------------------------------------------------------------------- attempts and contexts



@dataclass
class WinStep:
    """Stored winning episodes replayed as a supervised term for the step's all-win groups."""

    rows: list[Trajectory] = field(default_factory=list)  # the exact prompt ids the policy acted on + its action ids
    metrics: dict[str, float] = field(default_factory=dict)


def win_rows(policy: Policy, buffer: list[Attempt], routes: torch.Tensor, cfg: RSIPOConfig, system: str | None, gen: torch.Generator) -> WinStep:
    """route.mode = pass_rate: route.win_episodes winning attempts of the replay buffer (any
    game, drawn at random) per all-win group, one row per turn."""
    rc = cfg.route
    n_groups = int((routes == ALL_WIN).sum())
    if rc.mode != "pass_rate" or rc.win_coef == 0 or n_groups == 0:
        return WinStep()
    wins = [a for a in buffer if a.success]
    order = torch.randperm(len(wins), generator=gen, device="cpu").tolist()[: n_groups * rc.win_episodes]
    rows = []
    for i in order:
        a = wins[i]
        for ctx, actions in zip(a.contexts, a.actions):
            prompt = render_prompt(policy.tokenizer, user_message(ctx, cfg.agent, ctx.hint), system)
            rows.append(Trajectory(a.env, a.seed, -1, prompt + list(actions), [0] * len(prompt) + [1] * len(actions), [0.0] * (len(prompt) + len(actions)), 1.0, True))
    return WinStep(rows, {"route/win_episodes": float(len(order)), "route/win_rows": float(len(rows))})


# ----------------------------------------------------------------------------- teacher


class WinsMethod(Method):
    """route.mode = 'pass_rate' as a plug-in: stored wins for the all-win groups, rows after the hinted re-rolls'."""

    name = "wins"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return getattr(getattr(cfg, "route", None), "mode", "off") == "pass_rate"

    def rows(self, s, played, room):
        wins = win_rows(self.ctx.policy, played.parts["buffer"], played.routes, self.ctx.cfg, s.system, s.generator)
        played.parts["wins"] = wins
        return Extra(wins.rows, 0, wins.metrics)
