"""A user's own objective and training method, each one function or class in this one file,
registered through the package's entry points (pyproject.toml: recursa.objectives,
recursa.methods). tests/test_plugins.py trains with both on the tiny model."""

from __future__ import annotations

import torch

from recursa.algorithms.losses import aggregate
from recursa.methods import Method

CALLS = {"objective": 0}  # how often recursa called the objective, read by the test


def reinforce(mb, ac) -> tuple[torch.Tensor, dict]:
    """Plain REINFORCE on the action tokens: -A log pi, aggregated as the config says."""
    CALLS["objective"] += 1
    adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages.unsqueeze(1)
    per_token = -adv * mb.logp
    loss = aggregate(per_token, mb.mask, ac.agg, num_tokens=mb.num_tokens, num_seqs=mb.num_seqs, norm_len=mb.norm_len)
    return loss, {"clip_frac": 0.0, "kl": 0.0, "approx_kl_old": 0.0, "ratio_max": 1.0}


class SuccessStreak(Method):
    """Counts the steps in a row whose success rate reached `threshold` (an option of its
    [methods.success_streak] table), logs it, and keeps it across a resume."""

    name = "success_streak"

    def open(self) -> None:
        self.threshold = float(self.ctx.options.get("threshold", 0.5))
        self.streak = int(self.ctx.run.state.get("success_streak", 0))

    def after_update(self, step, played, stats) -> dict:
        rate = sum(played.success) / len(played.success)
        self.streak = self.streak + 1 if rate >= self.threshold else 0
        return {"streak/steps": self.streak, "streak/threshold": self.threshold}

    def state_dict(self) -> dict:
        return {"success_streak": self.streak}
