"""Rewards without a verifier: the built-in `[[reward]]` kinds (docs/rewards.md).

    [[reward]]
    kind = "self_consistency"     # or "self_judge", "self_reward"
    weight = 1.0

Each kind scores the step's single-turn trajectories from the policy's own behaviour; the
math is in `recursa.algorithms.self_reward` (tested against hand computations), this module
runs the models and logs what shows how far the reward can be trusted:

* `self_consistency`: 1 for a reply whose extracted answer (the task's own `parse(reply)`)
  is the majority answer of its group (TTRL); groups with a majority share under
  `min_agreement` get 0 and, with `penalty`, a negative advantage (RESTRAIN): -penalty
  added to the estimator's advantage (`restrain = "add"`), or, as the paper defines it,
  -weight * penalty in its place (`restrain = "paper"`). With
  `verified_frac` > 0 the pseudo-label is checked on that share of the tasks and the
  reward scaled by the empirical-Bayes trust in it, per agreement bin. Logs
  reward/<name>/agreement, /low_agreement, /label_accuracy (verified tasks),
  /label_accuracy_all (every task with a reference answer; never read by the reward
  unless the task is verified) and /trust.
* `self_judge`: P(Yes) / (P(Yes) + P(No)) of the policy asked, with `rubric`, whether its
  own reply is right: deterministic, one forward pass over two verdict rows per reply.
  Logs reward/<name>/verified_mean (the env's reward on the items with a reference
  answer), /gap (judge minus env on those) and /corr (their Pearson correlation).
* `self_reward`: sum over the reply of log pi_SFT - log pi_base (pi_SFT = the
  init.from_run warm start, pi_base = `base`), standardised per group and clipped. Logs
  reward/<name>/log_ratio_mean (before standardising) and /corr (with the env's reward
  on the items with a reference answer).

The judge reads the policy's current weights (those that sampled the step); the
self-reward's two models are frozen copies loaded once. Nothing is trained on the judge's
prompts or the verdicts. The env's reward keeps its weight 1 unless an entry
`func = "env"` says otherwise: set its weight to 0 for a run that never reads a verifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from recursa.algorithms.self_reward import (
    agreement_bin,
    group_standardise,
    pearson,
    self_consistency,
    vote_key,
    yes_probability,
)
from recursa.algorithms.trust import TrustEstimator
from recursa.config import check_kinds_task
from recursa.envs.base import answer_extractor
from recursa.errors import UserError

__all__ = ["BuiltinReward", "SelfConsistency", "SelfJudge", "SelfReward", "SelfRewardContext", "TermScore", "answer_extractor",
           "build_builtin", "is_verified"]


@dataclass
class TermScore:
    """What a built-in kind returns for one step's N items."""

    values: list[float | None]  # (N,) its reward r_k of each item
    metrics: dict[str, float] = field(default_factory=dict)  # its own reward/<name>/... keys
    advantage_offsets: list[float] | None = None  # (N,) added to each item's advantage after the estimator, or None
    advantage_targets: list[float | None] | None = None  # (N,) the advantage an item gets in place of the estimator's (x the entry's weight; None: keep it), or None


class BuiltinReward(Protocol):
    def score(self, trajs: list, env_rewards: list[float]) -> TermScore: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class SelfRewardContext:
    """What the built-in kinds are built from: the run's config, its policy, one env of its
    task (for answer extraction) and the warm start's checkpoint (init.from_run, or None)."""

    cfg: Any
    policy: Any
    env: Any
    init_dir: Path | None


# ----------------------------------------------------------------------------- checks


def build_builtin(entry, name: str, context: SelfRewardContext) -> BuiltinReward:
    """The scorer of a built-in `[[reward]]` entry."""
    from recursa.envs.dataset import task_name

    cfg = context.cfg
    check_kinds_task([entry.kind], context.env, task_name(cfg))
    micro, chunk = cfg.train.micro_batch_size, cfg.train.logit_chunk
    if entry.kind == "self_consistency":
        o = entry.option
        return SelfConsistency(name, answer_extractor(context.env), o("min_agreement"), o("penalty"), o("verified_frac"), o("trust_bins"), o("trust_decay"),
                               o("restrain"))
    if entry.kind == "self_judge":
        from recursa.envs.base import system_prompt_of

        system = system_prompt_of(context.env) or cfg.model.system_prompt or None
        return SelfJudge(name, context.policy, entry.option("rubric"), system, micro, chunk, cfg.train.shared_prefix)
    if entry.kind == "self_reward":
        sft, base = _implicit_reward_models(cfg, entry, context.init_dir)
        return SelfReward(name, sft, base, context.policy.tokenizer.pad_token_id, entry.option("clip"), micro, chunk, cfg.train.shared_prefix)
    raise ValueError(f"unknown reward kind {entry.kind!r}")


# ----------------------------------------------------------------------------- helpers


def _scorer(shared_prefix: bool):
    from recursa.generation import sequence_logprobs, shared_prefix_logprobs

    return shared_prefix_logprobs if shared_prefix else sequence_logprobs


@torch.no_grad()
def _summed_logprobs(logprobs, model: torch.nn.Module, batch, micro: int, chunk: int) -> torch.Tensor:
    """(N,) sum of log pi(a_t | a_<t) over each row's action tokens under `model` at
    temperature 1, `micro` rows at a time, on the host; the model's train/eval mode is
    restored afterwards."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(batch), dtype=torch.float64, device="cpu")
    try:
        for lo in range(0, len(batch), micro):
            idx = torch.arange(lo, min(lo + micro, len(batch)), device=batch.device)
            mb = batch.select(idx)
            logp, _ = logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask, 1.0, chunk)
            out[lo : lo + len(idx)] = (logp * mb.action_mask).sum(dim=1).double().cpu()
    finally:
        model.train(was_training)
    return out


def _verified_pairs(values: list[float], env_rewards: list[float], trajs: list) -> tuple[list[float], list[float]]:
    """(values, env rewards) on the items whose env gave a reference answer (the verified ones)."""
    keep = [i for i, t in enumerate(trajs) if str(t.info.get("answer", "") or "") != ""]
    return [values[i] for i in keep], [env_rewards[i] for i in keep]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def is_verified(seed: int, verified_frac: float) -> bool:
    """Whether the task `seed` is among the `verified_frac` share whose reference answer the
    self-consistency reward may read: a sha256 hash of the seed, fixed for the run."""
    if verified_frac <= 0:
        return False
    from recursa.envs.dataset import hash_unit

    return hash_unit(f"recursa.verified:{seed}") < verified_frac


# ----------------------------------------------------------------------------- the kinds


class SelfConsistency:
    """Majority-vote pseudo-rewards with RESTRAIN's low-agreement penalty and an empirical-Bayes
    check of the pseudo-label on verified tasks (see the module doc)."""

    def __init__(self, name: str, parse: Callable[[str], str | None], min_agreement: float, penalty: float, verified_frac: float,
                 bins: int, decay: float, restrain: str = "add"):
        if restrain not in ("add", "paper"):
            raise ValueError(f"restrain must be 'add' or 'paper', got {restrain!r}")
        self.name, self.parse, self.restrain = name, parse, restrain
        self.min_agreement, self.penalty, self.verified_frac, self.bins = min_agreement, penalty, verified_frac, bins
        self.trust = TrustEstimator(decay=decay) if verified_frac > 0 else None  # cold start: accuracy 1/2, trust 0 until checked

    def score(self, trajs: list, env_rewards: list[float]) -> TermScore:
        answers = [vote_key(self.parse(t.completion_text)) for t in trajs]
        c = self_consistency([t.group for t in trajs], answers, self.min_agreement)
        # the pseudo-label is right when a sample that gave it solved the task (the task's own verifier)
        checks: list[tuple[bool, bool, bool]] = []  # per group: (has a reference answer, verified, label right)
        for members, label in zip(c.members, c.labels):
            first = trajs[members[0]]
            has_ref = str(first.info.get("answer", "") or "") != ""
            right = label is not None and any(trajs[i].success for i in members if answers[i] == label)
            checks.append((has_ref and label is not None, has_ref and label is not None and is_verified(first.seed, self.verified_frac), right))
        bins = [agreement_bin(s, self.bins) for s in c.shares]
        trust = [1.0] * len(c.members)
        if self.trust is not None:
            trials: dict[int, tuple[float, float]] = {}
            for b, (_, verified, right) in zip(bins, checks):
                if verified:
                    a, n = trials.get(b, (0.0, 0.0))
                    trials[b] = (a + float(right), n + 1.0)
            self.trust.update(trials)
            trust = [self.trust.trust(b) for b in bins]
        values = list(c.rewards)
        for members, t in zip(c.members, trust):
            for i in members:
                values[i] *= t
        offsets = targets = None
        if self.restrain == "paper":  # RESTRAIN: a low-agreement group's advantage is -delta, whatever else scored it
            targets = [-self.penalty if low else None for low in c.low] if any(c.low) else None
        elif self.penalty > 0:
            offsets = [-self.penalty if low else 0.0 for low in c.low]
        p = f"reward/{self.name}"
        metrics = {
            f"{p}/agreement": _mean(c.shares),
            f"{p}/low_agreement": _mean([float(s < self.min_agreement) for s in c.shares]),
            f"{p}/label_accuracy": _mean([float(right) for _, verified, right in checks if verified]),
            f"{p}/label_accuracy_all": _mean([float(right) for labelled, _, right in checks if labelled]),
        }
        if self.trust is not None:
            metrics[f"{p}/trust"] = _mean(trust)
        return TermScore(values, metrics, offsets, targets)

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.trust is None else self.trust.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.trust is not None:
            self.trust.load_state_dict(state)


class SelfJudge:
    """The policy's own verdict on its reply: P(Yes) / (P(Yes) + P(No)) after the rubric prompt."""

    def __init__(self, name: str, policy, rubric: str, system_prompt: str | None, micro: int, chunk: int, shared_prefix: bool):
        tok = policy.tokenizer
        self.name, self.policy, self.rubric, self.system = name, policy, rubric, system_prompt
        self.yes = tok.encode("Yes", add_special_tokens=False)
        self.no = tok.encode("No", add_special_tokens=False)
        if not self.yes or not self.no or self.yes == self.no:
            raise UserError(f"reward kind = 'self_judge': the tokenizer of {policy.name!r} cannot tell 'Yes' from 'No'")
        self.micro, self.chunk, self.logprobs = max(2, micro - micro % 2), chunk, _scorer(shared_prefix)

    def judge_prompts(self, trajs: list) -> list[list[int]]:
        """The token ids of each item's rubric prompt (the chat template with the assistant's turn opened)."""
        from recursa.rollout import render_prompt

        return [render_prompt(self.policy.tokenizer, self.rubric.format(prompt=t.prompt_text, completion=t.completion_text), self.system)
                for t in trajs]

    def verdict_logprobs(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log P(Yes | prompt), log P(No | prompt)), each (N,), summed over the verdict's tokens."""
        from recursa.trajectory import Trajectory, collate

        rows = []
        for ids in prompts:
            for verdict in (self.yes, self.no):  # rows 2i (Yes) and 2i + 1 (No) share prompt i
                rows.append(Trajectory("judge", 0, 0, ids + verdict, [0] * len(ids) + [1] * len(verdict), [0.0] * (len(ids) + len(verdict)), 0.0, False))
        model = self.policy.causal_lm
        batch = collate(rows, torch.zeros(len(rows)), self.policy.tokenizer.pad_token_id, self.policy.device)
        summed = _summed_logprobs(self.logprobs, model, batch, self.micro, self.chunk)
        return summed[0::2], summed[1::2]

    def score(self, trajs: list, env_rewards: list[float]) -> TermScore:
        logp_yes, logp_no = self.verdict_logprobs(self.judge_prompts(trajs))
        values = [float(v) for v in yes_probability(logp_yes, logp_no)]
        judged, verified = _verified_pairs(values, env_rewards, trajs)
        p = f"reward/{self.name}"
        return TermScore(values, {
            f"{p}/verified_mean": _mean(verified),
            f"{p}/gap": _mean(judged) - _mean(verified) if verified else float("nan"),
            f"{p}/corr": pearson(judged, verified),
        })

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _frozen(policy) -> torch.nn.Module:
    model = policy.causal_lm
    model.requires_grad_(False)
    model.eval()
    return model


def _implicit_reward_models(cfg, entry, init_dir: Path | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(pi_SFT, pi_base), frozen, on the policy's device: the warm start and `entry.base`."""
    from recursa.models import load_policy
    from recursa.store import run_checkpoint

    if init_dir is None:
        raise UserError("reward kind = 'self_reward' needs two models, pi_SFT and pi_base: set init.from_run to the warm start (pi_SFT, e.g. an SFT run)")
    plain = cfg.model.model_copy(update={"lora": None})  # the models themselves, never adapters over them
    base = entry.option("base")
    base_dir = None if base == "model" else run_checkpoint(base, "last", cfg.model.name, "reward.base", "reward.base")
    if base_dir is not None and Path(base_dir).resolve() == Path(init_dir).resolve():
        raise UserError(f"reward.base = {base!r} is the warm start's own checkpoint: log pi_SFT / pi_base would be 0; name another run or 'model'")
    return _frozen(load_policy(plain, base_dir=init_dir)), _frozen(load_policy(plain, base_dir=base_dir))


class SelfReward:
    """The implicit reward log pi_SFT(y|x) - log pi_base(y|x), standardised per group and clipped."""

    def __init__(self, name: str, sft: torch.nn.Module, base: torch.nn.Module, pad_id: int, clip: float, micro: int, chunk: int, shared_prefix: bool):
        self.name, self.sft, self.base, self.pad_id, self.clip = name, sft, base, pad_id, clip
        self.micro, self.chunk, self.logprobs = micro, chunk, _scorer(shared_prefix)

    def log_ratios(self, trajs: list) -> torch.Tensor:
        """(N,) d_i = sum over the reply of log pi_SFT - log pi_base, float64 on the host."""
        from recursa.trajectory import collate

        device = next(self.sft.parameters()).device
        batch = collate(trajs, torch.zeros(len(trajs)), self.pad_id, device)
        return _summed_logprobs(self.logprobs, self.sft, batch, self.micro, self.chunk) - _summed_logprobs(self.logprobs, self.base, batch, self.micro, self.chunk)

    def score(self, trajs: list, env_rewards: list[float]) -> TermScore:
        d = self.log_ratios(trajs).tolist()
        values = group_standardise(d, [t.group for t in trajs], self.clip)
        ratios, verified = _verified_pairs(d, env_rewards, trajs)
        p = f"reward/{self.name}"
        return TermScore(values, {f"{p}/log_ratio_mean": _mean(d), f"{p}/corr": pearson(ratios, verified)})

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
