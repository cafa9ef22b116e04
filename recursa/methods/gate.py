"""The gates of a GRPO run as a plug-in (`[gate]`, recursa/methods/gating.py): every
`gate.prompt_every` steps the policy proposes a revised prompt from its recent failures,
adopted only when it wins on fresh gate items; every `gate.every` steps (and at the end) the
weights are tested against the last accepted ones and rolled back when they do not win.
Every held-out evaluation after training started is recorded as a test look."""

from __future__ import annotations

from collections import deque

from recursa.methods.base import Method, StepEnd
from recursa.methods.gating import PromptGate, WeightsGate


class GateMethod(Method):
    name = "gate"
    watches_evals = True

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.gate.mode != "off"

    def open(self) -> None:
        ctx = self.ctx
        cfg = ctx.cfg
        # ctx.eval_hints: RSIPO's skills.in_context, every gate item scored with the hint the policy is shown for it
        self.weights = WeightsGate(cfg, ctx.store, ctx.pool, ctx.start_step, ctx.log, hints=ctx.eval_hints, engine=ctx.engine)
        self.weights.start(ctx.policy, ctx.optimizer, f"{cfg.model.name}{ctx.run.origin}")
        self.prompts = (PromptGate(cfg, ctx.store, ctx.pool, self.weights.lineage, ctx.multi_turn, ctx.log, engine=ctx.engine, hints=ctx.eval_hints)
                        if cfg.gate.prompt_every else None)
        self.failures: deque[tuple[str, str]] = deque(maxlen=4)  # recent failures, what prompt proposals read
        replay = ctx.find("replay")  # RSIPO's replay buffer: a resumed run's prompt rounds read the failures before the checkpoint
        if replay is not None:
            self.failures.extend(replay.failures_before())

    def look(self, step: int, label: str, before, now) -> None:
        self.weights.look(step, label, before, now)

    def after_sample(self, step: int, played) -> dict:
        self.failures.extend(played.failures)
        return {}

    def end_step(self, end: StepEnd) -> list[dict]:
        ctx, gc = self.ctx, self.ctx.cfg.gate
        out = []
        if self.prompts is not None and end.done % gc.prompt_every == 0 and self.failures:
            out.append(self.prompts.check(ctx.policy, end.done, list(self.failures), end.generator))
        if end.done % gc.every == 0 or end.final:
            out.append(self.weights.check(ctx.policy, ctx.optimizer, end.done, ctx.progress))
        return out
