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

`source = "successes"` is self-imitation instead: the rows are the turns of the run's own
won episodes of earlier steps (no demonstration at all), at most `n` distinct wins kept per
stratum, the oldest dropped first. A stratum is the curriculum arm of the episode's task (one
stratum without a curriculum), and each step draws its rows evenly across the strata, so a
task type the curriculum stops offering is still imitated from its past wins while the
rewards go elsewhere. A win repeated move for move on the same task is kept once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
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
    keys: list[str] | None = None  # each row's stratum (successes); None: one pool of rows
    capacity: int = 0  # successes: distinct won episodes kept per stratum; 0: fixed demonstrations
    wins: dict[str, deque] = field(default_factory=dict)  # successes: stratum -> deque of (identity, rows)

    def pick(self, opt_step: int) -> list[int]:
        """The rows of optimizer step `opt_step`: `per_step` of them (all, if there are fewer),
        without replacement, from a generator seeded by (seed, opt_step). With strata, the
        quota is split evenly over the strata that have rows (the remainder to strata in a
        seeded order), and a stratum with fewer rows than its quota gives all it has."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + opt_step)
        if self.keys is None:
            return torch.randperm(len(self.rows), generator=gen)[: self.per_step].tolist()
        strata = sorted(set(self.keys))
        if not strata:
            return []
        order = torch.randperm(len(strata), generator=gen).tolist()
        base, extra = divmod(self.per_step, len(strata))
        chosen = []
        for rank, j in enumerate(order):
            members = [i for i, k in enumerate(self.keys) if k == strata[j]]
            quota = base + (rank < extra)
            chosen += [members[m] for m in torch.randperm(len(members), generator=gen)[:quota].tolist()]
        return chosen

    def observe(self, episodes: list[tuple[str, tuple, list[Trajectory]]]) -> int:
        """Successes: add won episodes, each (stratum, identity, its rows); an identity already
        kept in its stratum is skipped. Returns how many were added."""
        added = 0
        for key, ident, rows in episodes:
            kept = self.wins.setdefault(key, deque(maxlen=self.capacity))
            if any(ident == other for other, _ in kept):
                continue
            kept.append((ident, rows))
            added += 1
        self.rows = [r for key in sorted(self.wins) for _, rows in self.wins[key] for r in rows]
        self.keys = [key for key in sorted(self.wins) for _, rows in self.wins[key] for _ in rows]
        return added

    def state_dict(self) -> dict:
        """Successes: the kept wins, token ids and masks as compact strings (the checkpoint's state.json)."""
        def enc(xs):
            return " ".join(map(str, xs))
        return {key: [[list(ident), [[r.seed, r.group, enc(r.token_ids), enc(r.action_mask)] for r in rows]] for ident, rows in kept]
                for key, kept in self.wins.items()}

    def load_state_dict(self, state: dict) -> None:
        def dec(text):
            return [int(x) for x in text.split()] if text else []
        episodes = []
        for key, kept in sorted(state.items()):
            for ident, rows in kept:
                trajs = []
                for seed, group, ids, mask in rows:
                    ids, mask = dec(ids), dec(mask)
                    trajs.append(Trajectory("anchor", seed, group, ids, mask, [0.0] * len(ids), 1.0, True))
                episodes.append((key, _tupled(ident), trajs))
        self.wins = {}
        self.observe(episodes)

    def empty(self) -> bool:
        return not self.rows

    def backward(self, model, opt_step: int, micro_batch_size: int, logit_chunk: int, device) -> float:
        """Accumulate the gradient of coef x the token-mean NLL of this step's rows into
        `model`'s .grad (micro-batched; the mean is over all of the step's target tokens).
        Returns that mean NLL (without the coefficient)."""
        chosen = [self.rows[i] for i in self.pick(opt_step)]
        if not chosen:  # successes, before the first win: no term
            return 0.0
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


def check_anchor(cfg) -> None:
    """Refuse the anchor where it is not wired yet (a data-parallel learner), in one line."""
    from recursa.distributed import ddp

    if cfg.anchor.coef > 0 and ddp.active():
        raise UserError("anchor.coef > 0 is not available with a data-parallel learner yet: run it in one process, or set anchor.coef = 0")


def make_anchor(cfg, pool, tokenizer) -> tuple[Anchor | None, str]:
    """The anchor `cfg.anchor` asks for (None when coef is 0), and a line for the log."""
    ac = cfg.anchor
    if ac.coef == 0:
        return None, ""
    if ac.source == "successes":
        return (Anchor([], ac.coef, ac.rows, cfg.train.seed, tokenizer.pad_token_id, keys=[], capacity=ac.n),
                f"anchor: self-imitation of the run's own wins, at most {ac.n} per stratum, {ac.rows} rows a step at coef {ac.coef:g}")
    from recursa.config import DataConfig
    from recursa.demos import build_demos

    data = DataConfig(source=ac.source, n=ac.n, start=ac.start)  # every other data option at its default
    view = SimpleNamespace(data=data, model=cfg.model, env=cfg.env, agent=cfg.agent, recipe="anchor")
    try:
        demos = build_demos(view, pool, tokenizer)
    except UserError as exc:
        raise UserError(f"anchor.source = {ac.source!r} gives no demonstrations to imitate here ({exc}); games have walkthroughs "
                        "(anchor.source = 'walkthrough'), single-turn tasks reference answers ('reference')") from None
    if not demos.rows:
        raise UserError(f"anchor.coef = {ac.coef} but the anchor found no demonstrations to imitate: {demos.summary()}")
    return Anchor(demos.rows, ac.coef, ac.rows, cfg.train.seed, tokenizer.pad_token_id), f"anchor: {demos.summary()}, {ac.rows} rows a step at coef {ac.coef:g}"


def _tupled(x):
    """JSON lists back into the tuples an identity was made of."""
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


def won_episodes(trajs: list[Trajectory], row_episode: list[int], won: list[bool], stratum) -> list[tuple[str, tuple, list[Trajectory]]]:
    """The won episodes among a step's rows, as `Anchor.observe` takes them: (stratum of the
    task seed, identity = (seed, the episode's completions), its rows). `row_episode[i]` is
    the episode of row i (the first len(row_episode) rows are the step's own episodes)."""
    by_episode: dict[int, list[Trajectory]] = {}
    for t, e in zip(trajs, row_episode):
        if won[e]:
            by_episode.setdefault(e, []).append(t)
    return [(stratum(rows[0].seed), (rows[0].seed, tuple(r.completion_text for r in rows)), rows) for _, rows in sorted(by_episode.items())]
