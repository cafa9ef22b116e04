"""The demonstration anchor: reinforcement learning that keeps imitating its demonstrations.

GRPO from an SFT warm start on `household` trades task types: a run that learns one type
loses another the warm start played (docs/curriculum.md). The anchor keeps the warm start's
own teaching in the loss while the policy learns from rewards. At every optimizer step of
the update, `rows` demonstration rows (oracle walkthrough turns, or reference answers) are
drawn and

    loss = policy loss + c x ( -sum_{i,t} m_it log pi(x_it | x_i<t) / sum_{i,t} m_it )

is minimised, where m marks the demonstrations' target tokens (the actions, never the
prompt) and the NLL is at temperature 1, the SFT loss itself. Unlike a KL term to the warm
start, it pulls only toward what the demonstrations do, on the states they visit, and it does
so also on task types that the step's own episodes did not play. The rows come from a
generator seeded by (train.seed, optimizer step), so a resumed run draws what an
uninterrupted one draws. With a data-parallel learner the term is computed on rank 0 only:
the gradients are summed onto rank 0 before the step, so it counts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from recursa.errors import UserError
from recursa.generation import sequence_logprobs
from recursa.trajectory import Trajectory, collate


@dataclass
class Anchor:
    """Demonstration rows and how much of them each optimizer step imitates."""

    rows: list[Trajectory]
    coef: float
    per_step: int
    seed: int
    pad_id: int

    def pick(self, opt_step: int) -> list[int]:
        """The rows of optimizer step `opt_step`: `per_step` of them (all, if there are fewer),
        without replacement, from a generator seeded by (seed, opt_step)."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + opt_step)
        return torch.randperm(len(self.rows), generator=gen)[: self.per_step].tolist()

    def backward(self, model, opt_step: int, micro_batch_size: int, logit_chunk: int, device) -> float:
        """Accumulate the gradient of coef x the token-mean NLL of this step's rows into
        `model`'s .grad (micro-batched; the mean is over all of the step's target tokens).
        Returns that mean NLL (without the coefficient)."""
        chosen = [self.rows[i] for i in self.pick(opt_step)]
        batch = collate(chosen, torch.zeros(len(chosen)), self.pad_id, device)
        num_tokens = int(batch.action_mask.sum().item())
        total = 0.0
        for lo in range(0, len(chosen), micro_batch_size):
            mb = batch.select(torch.arange(lo, min(lo + micro_batch_size, len(chosen)), device=batch.input_ids.device))
            logp, _ = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask, 1.0, logit_chunk)  # (b, L)
            nll = -(logp * mb.action_mask).sum()
            (self.coef * nll / num_tokens).backward()
            total += float(nll.item())
        return total / max(num_tokens, 1)


def make_anchor(cfg, pool, tokenizer) -> tuple[Anchor | None, str]:
    """The anchor `cfg.anchor` asks for (None when coef is 0), and a line for the log."""
    ac = cfg.anchor
    if ac.coef == 0:
        return None, ""
    from recursa.demos import build_demos

    data = SimpleNamespace(source=ac.source, n=ac.n, start=ac.start, path=None, prompt_key=None)
    view = SimpleNamespace(data=data, model=cfg.model, env=cfg.env, agent=cfg.agent, recipe="anchor")
    try:
        demos = build_demos(view, pool, tokenizer)
    except UserError as exc:
        raise UserError(f"anchor.source = {ac.source!r} gives no demonstrations to imitate here ({exc}); games have walkthroughs "
                        "(anchor.source = 'walkthrough'), single-turn tasks reference answers ('reference')") from None
    if not demos.rows:
        raise UserError(f"anchor.coef = {ac.coef} but the anchor found no demonstrations to imitate: {demos.summary()}")
    return Anchor(demos.rows, ac.coef, ac.rows, cfg.train.seed, tokenizer.pad_token_id), f"anchor: {demos.summary()}, {ac.rows} rows a step at coef {ac.coef:g}"
