"""The demonstration anchor as a plug-in (`[anchor]`, recursa/anchor.py): the warm start's own
SFT loss on a few demonstrations (or, with `anchor.source = "successes"`, on the run's own won
episodes of earlier steps) added to every optimizer step of the update."""

from __future__ import annotations

from recursa.anchor import check_anchor, make_anchor, won_episodes
from recursa.envs.arms import arm_of
from recursa.methods.base import Method


def success_strata(cfg):
    """seed -> the stratum of self-imitation's wins (`anchor.source = "successes"`): the name of
    the curriculum arm the seed's task comes from, or '' without arms."""
    if cfg.curriculum.mode == "off" or not cfg.curriculum.arms:
        return lambda seed: ""
    names = cfg.curriculum.arm_names()

    def stratum(seed: int) -> str:
        arm = arm_of(seed, len(names))
        return names[arm] if arm is not None else ""
    return stratum


class AnchorMethod(Method):
    name = "anchor"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.anchor.coef > 0

    @classmethod
    def check(cls, cfg) -> None:
        check_anchor(cfg)  # a data-parallel learner refuses the anchor before the run directory is touched

    def open(self) -> None:
        ctx = self.ctx
        self.anchor, note = make_anchor(ctx.cfg, ctx.pool, ctx.policy.tokenizer)  # demonstrations imitated at every optimizer step
        ctx.log(note)
        if ctx.run.state.get("anchor"):
            self.anchor.load_state_dict(ctx.run.state["anchor"])  # source = successes: the wins kept at the checkpoint
        self.stratum = success_strata(ctx.cfg)

    def update_term(self):
        return self.anchor

    def after_update(self, step: int, played, stats) -> dict:
        metrics = {"anchor/nll": stats.anchor_nll}  # the demonstrations' NLL per target token, before each optimizer step's update
        if self.ctx.cfg.anchor.source == "successes":  # the step's wins join the self-imitation rows of later steps
            roots = played.root_rows
            metrics["anchor/wins_added"] = self.anchor.observe(won_episodes(played.trajs[:roots], played.row_seq[:roots], played.success, self.stratum))
            metrics["anchor/rows"] = len(self.anchor.rows)  # rows kept (all strata)
        return metrics

    def state_dict(self) -> dict | None:
        return {"anchor": self.anchor.state_dict()} if self.anchor.wins else None
