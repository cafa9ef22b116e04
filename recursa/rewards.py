"""Your own rewards: `[[reward]]` entries, each a function, a weight and a name.

    def brevity(prompts, completions, **fields):          # fields: lists aligned with completions
        return [1.0 - len(c) / 200 for c in completions]    # None for an item the reward does not apply to

    [[reward]]
    func = "my_rewards:brevity"
    weight = 0.1

A reward function has the signature `fn(prompts, completions, **item_fields) -> list[float | None]`:
one call per training step over every sampled completion (B x G), `prompts[i]` and
`completions[i]` as text, and each item field as a list aligned with them. Item fields:

    seed        the task's seed (its split and index)
    answer      the env's reference answer ("" when it has none)
    success     whether the env counted the attempt as solved
    env_reward  the env's own reward
    <column>    every column of a [data] row other than the prompt (datasets only)

The training reward of an attempt is the weighted sum over the entries,

    R = sum_k w_k r_k      (an entry whose r_k is None does not apply and adds nothing)

and the env's own reward is the entry named `env`: it is there with weight 1 unless an
entry `func = "env"` gives it another weight (0 drops it). Every entry is logged as
`reward/<name>/mean` (over the items it applied to) beside `reward/mean`, the mean of R.

Multi-turn games: a reward function is called once per episode, at its end, with
`prompts[i]` the episode's task line and `completions[i]` its action transcript (the
actions sent to the game, one per line); R replaces the episode's total env reward in the
outcome advantage (GiGPO's step term still reads the env's per-turn rewards).

Rewards without a verifier: an entry with `kind = "self_consistency"`, `"self_judge"` or
`"self_reward"` is built in (`recursa/self_rewards.py`, docs/rewards.md). It scores the
step's trajectories from the policy's own behaviour (majority votes, its own Yes/No verdict,
the warm start's log-ratio to the base model) rather than from a function of the text, and
may log more keys under `reward/<name>/` and add an offset to each item's advantage
(`Scored.advantage_offsets`, RESTRAIN's penalty). An entry may instead name the advantage
an item gets in place of the estimator's (RESTRAIN as its paper defines it, x the entry's
weight): the set computes the estimator's advantage of the step's totals, the same pure
function the recipe calls next, and folds target - A into the offsets, so the recipe's
A + offset is the target. The grpo recipe builds them with a `SelfRewardContext` (the
policy, an env, the warm start).

Evaluations and the gate always measure the env's success rate: rewards shape training,
they do not redefine what solving a task means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from recursa.answers import call_reward, reward_function  # noqa: F401  (call_reward: a reward function called and its output checked; re-exported)
from recursa.errors import UserError

ENV = "env"


@dataclass
class RewardTerm:
    name: str
    func: str  # "pkg.module:function", "env", or a built-in kind ("self_consistency", ...)
    weight: float
    fn: Callable | None  # None for the env's own reward and for built-in kinds
    builtin: Any = None  # a built-in kind's scorer (recursa.self_rewards.BuiltinReward), else None


@dataclass
class Scored:
    totals: list[float]  # R per item
    metrics: dict[str, float]  # reward/<name>/mean (+ reward/<name>/applied when an entry skipped items, + a built-in kind's own keys)
    advantage_offsets: list[float] | None = None  # per item, added to its advantage after the estimator (None: no entry asked for one)


class RewardSet:
    """The weighted sum of a config's [[reward]] entries (see the module docstring)."""

    def __init__(self, terms: list[RewardTerm], estimator: Callable | None = None, group_size: int = 0):
        self.terms = terms
        self.estimator, self.group_size = estimator, group_size  # (B, G) totals -> (B, G) advantages, for an entry's advantage targets

    @classmethod
    def from_config(cls, entries, context=None) -> "RewardSet | None":
        """The set of `cfg.reward` entries, or None when there are none (the env's reward alone,
        exactly as without this module). Built-in kinds need `context`, a
        `recursa.self_rewards.SelfRewardContext`."""
        if not entries:
            return None
        terms = []
        for e in entries:
            kind = getattr(e, "kind", "func")
            if kind != "func":
                if context is None:
                    raise UserError(f"reward kind = {kind!r} needs the policy and the task: build the RewardSet with a SelfRewardContext (the grpo recipe does)")
                from recursa.self_rewards import build_builtin

                terms.append(RewardTerm(e.name or kind, kind, e.weight, None, build_builtin(e, e.name or kind, context)))
                continue
            terms.append(RewardTerm(e.name or _default_name(e.func), e.func, e.weight, None if e.func == ENV else reward_function(e.func)))
        if not any(t.func == ENV for t in terms):
            terms.insert(0, RewardTerm(ENV, ENV, 1.0, None))
        names = [t.name for t in terms]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise UserError(f"two [[reward]] entries are named {dup!r}: give each a distinct name")
        for t in terms:
            if t.fn is not None and not callable(t.fn):
                raise UserError(f"reward.func = {t.func!r} is a {type(t.fn).__name__}, not a function")
        estimator, G = None, 0
        if context is not None:
            import functools

            from recursa.algorithms.advantages import compute_advantages

            estimator, G = functools.partial(compute_advantages, context.cfg.algo.advantage), context.cfg.train.group_size
        return cls(terms, estimator, G)

    def score(self, prompts: list[str], completions: list[str], env_rewards: list[float], fields: dict[str, list], trajs=None) -> Scored:
        """R for every item and the per-entry metrics. Built-in kinds read `trajs`, the
        single-turn `Trajectory` of each item (None for game episodes: refused)."""
        n = len(completions)
        totals = [0.0] * n
        metrics: dict[str, float] = {}
        offsets: list[float] | None = None
        targets: list[float | None] = [None] * n
        for t in self.terms:
            extra: dict[str, float] = {}
            if t.builtin is not None:
                if trajs is None:
                    raise UserError(f"reward kind = {t.func!r} scores single-turn replies, not game episodes: use a single-turn task or drop the entry")
                out = t.builtin.score(trajs, list(env_rewards))
                values, extra = _checked(out.values, t.name, n), out.metrics
                if out.advantage_offsets is not None:
                    offsets = [a + b for a, b in zip(offsets or [0.0] * n, out.advantage_offsets)]
                for i, v in enumerate(out.advantage_targets or []):
                    if v is not None:
                        targets[i] = (targets[i] or 0.0) + t.weight * v
            else:
                values = list(env_rewards) if t.fn is None else call_reward(t.fn, t.name, prompts, completions, fields)
            applied = [v for v in values if v is not None]
            for i, v in enumerate(values):
                if v is not None:
                    totals[i] += t.weight * v
            metrics[f"reward/{t.name}/mean"] = sum(applied) / len(applied) if applied else float("nan")
            if len(applied) < n:
                metrics[f"reward/{t.name}/applied"] = len(applied) / max(n, 1)
            metrics.update(extra)
        if any(v is not None for v in targets):
            offsets = self._replacing(totals, targets, offsets)
        return Scored(totals, metrics, offsets)

    def _replacing(self, totals: list[float], targets: list[float | None], offsets: list[float] | None) -> list[float]:
        """The offsets that make A_i + offset_i = target_i where an entry named a target: A the
        estimator's advantages of the totals (float32, (B, G) in group order, as the recipe
        computes them), the other entries' offsets kept on the rest."""
        import torch

        n, G = len(totals), self.group_size
        if self.estimator is None or G < 1 or n % G:
            raise RuntimeError(f"an advantage target needs the estimator and the group size of the step ({n} items, group size {G})")
        adv = self.estimator(torch.tensor(totals, dtype=torch.float32, device="cpu").view(-1, G)).reshape(-1).tolist()
        base = offsets or [0.0] * n
        return [base[i] if v is None else v - adv[i] for i, v in enumerate(targets)]

    def state_dict(self) -> dict[str, Any]:
        """What the built-in kinds carry from step to step (self_consistency's label-accuracy
        counts), by entry name; {} when none carries anything."""
        out = {}
        for t in self.terms:
            state = t.builtin.state_dict() if t.builtin is not None else None
            if state is not None:
                out[t.name] = state
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (a resumed run)."""
        for t in self.terms:
            if t.builtin is not None and t.name in state:
                t.builtin.load_state_dict(state[t.name])


def _checked(values: list[float | None], name: str, n: int) -> list[float | None]:
    """A built-in kind's values, one per item (a bug otherwise, not a user error; a NaN is
    caught by the recipe's finiteness check, which names the step)."""
    if len(values) != n:
        raise RuntimeError(f"reward {name!r} returned {len(values)} values for {n} items")
    return values


def _default_name(func: str) -> str:
    return func.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def item_fields(items: list[dict[str, Any]]) -> dict[str, list]:
    """Per-item field dicts -> one list per field, aligned (a field missing from an item is None)."""
    keys: list[str] = []
    for it in items:
        keys += [k for k in it if k not in keys]
    return {k: [it.get(k) for it in items] for k in keys}


def score_trajectories(rewards: RewardSet, trajs) -> Scored:
    """Single-turn attempts: R of each `Trajectory`; each trajectory's `reward` becomes R (its
    env reward is kept in `info["env_reward"]`)."""
    env_rewards = [float(t.reward) for t in trajs]
    fields = item_fields([
        {"seed": t.seed, "answer": str(t.info.get("answer", "")), "success": bool(t.success), "env_reward": r, **(t.info.get("fields") or {})}
        for t, r in zip(trajs, env_rewards)
    ])
    scored = rewards.score([t.prompt_text for t in trajs], [t.completion_text for t in trajs], env_rewards, fields, trajs=trajs)
    for t, r, total in zip(trajs, env_rewards, scored.totals):
        t.info = {**t.info, "env_reward": r}
        t.reward = total
    return scored


def score_episodes(rewards: RewardSet, episodes) -> Scored:
    """Multi-turn episodes: R of each `Episode` at its end, from its task line and action transcript."""
    env_rewards = [e.total_reward for e in episodes]
    fields = item_fields([{"seed": e.seed, "answer": "", "success": bool(e.won), "env_reward": r, "turns": len(e.turns)}
                          for e, r in zip(episodes, env_rewards)])
    return rewards.score([e.task for e in episodes], ["\n".join(t.action for t in e.turns) for e in episodes], env_rewards, fields)
