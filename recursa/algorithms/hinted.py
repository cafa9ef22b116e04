"""Hinted re-rolls of groups that all failed, trained under the un-hinted prompt (HATCH-like).

When no attempt of a group wins, every outcome advantage of the group is 0 (GRPO's group
normalisation has nothing to compare): the group teaches nothing, however much it cost.
RSIPO's `[hatch]` switch re-rolls k attempts of such a game with a hint h in the prompt (a
retrieved skill, a reflection the policy wrote on one of the failed attempts, or, as an
oracle ablation only, the walkthrough), and trains the policy on those sampled tokens *as
if the hint had not been there*: the row is the un-hinted prompt x followed by the same
action ids.

Shapes: N re-rolled rows (one per turn of a game, one per completion otherwise), L token
positions; ``mask  # (N, L)`` is 1 at the action tokens.

Token advantage of a re-rolled row (all constants, detached):

    A_t = c(step) * w_t * (R - b)                        on action tokens, 0 elsewhere
    w_t = min( pi_old(a_t | x, a_<t) / pi_old(a_t | x + h, a_<t),  cap )
    b   = mean reward of the group's un-hinted attempts

R is the re-rolled attempt's reward. The update's PPO-clip surrogate uses the ratio
pi_theta(a_t | x, .) / pi_old(a_t | x, .) on these rows (the proximal policy is the
un-hinted old policy, as in decoupled PPO), so at ratio 1 the gradient is
c w_t (R - b) grad log pi(a_t | x, a_<t): an off-policy REINFORCE estimate for the
un-hinted policy whose behaviour policy (the hinted one) is corrected token by token.

Departures, and why:
* The importance weight is per token (the ratio of that token's conditional
  probabilities), not the product over the prefix: the product of tens of ratios has a
  variance that makes the weight useless, the per-token ratio is the usual biased,
  low-variance choice (per-decision truncated IS; TIS in verl, IMPALA's rho-bar).
* The baseline is the un-hinted group's mean reward, not a mean over the re-rolls: the
  quantity estimated is how much better the hinted behaviour is than what the policy does
  unaided. With 0/1 rewards and an all-fail group, a re-roll that wins gets R - b = 1 and
  one that fails gets 0: only hinted successes carry signal.
* The coefficient is annealed to 0 (`anneal`): the hinted samples are off-policy and the
  hint may stop being needed; the outcome advantage takes over.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SCHEDULES", "anneal", "all_failed", "truncated_importance_weights", "hinted_token_advantages"]

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


def _shape(x: object) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _keep(mask: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(like, torch.Tensor) or like.dim() != 2:
        raise ValueError(f"{name} must be a tensor of shape (N, L), got {_shape(like)}")
    if not isinstance(mask, torch.Tensor) or mask.shape != like.shape:
        raise ValueError(f"mask shape {_shape(mask)} must equal {name} shape {tuple(like.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be binary (0/1 or bool), 1 at the action tokens")
    return mask != 0


def anneal(coef: float, step: int, steps: int, schedule: str = "linear") -> float:
    """The coefficient at `step` (0 = the first training step) of a schedule over `steps`.

    constant: coef;  linear: coef * max(0, 1 - step / steps);
    cosine: coef * (1 + cos(pi * min(step / steps, 1))) / 2.
    `steps` = 0 means no annealing (coef at every step, whatever the schedule).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid choices are {list(SCHEDULES)}")
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    if step < 0 or steps < 0:
        raise ValueError(f"step and steps must be >= 0, got {step} and {steps}")
    if schedule == "constant" or steps == 0:
        return float(coef)
    frac = min(step / steps, 1.0)
    if schedule == "linear":
        return float(coef * (1.0 - frac))
    return float(coef * 0.5 * (1.0 + math.cos(math.pi * frac)))


def all_failed(success: torch.Tensor) -> torch.Tensor:
    """True for each group none of whose attempts succeeded.  (B, G) -> (B,) bool"""
    if not isinstance(success, torch.Tensor) or success.dim() != 2:
        raise ValueError(f"success must be a tensor of shape (B, G), got {_shape(success)}")
    return ~success.bool().any(dim=1)


def truncated_importance_weights(
    logp_target: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """w_t = min(exp(logp_target - logp_behaviour), cap) on action tokens, 0 elsewhere.  (N, L)

    logp_target     # (N, L) log pi_old(a_t | un-hinted context), aligned on the action tokens
    logp_behaviour  # (N, L) log pi_old(a_t | hinted context), the policy that sampled a_t
    Computed as exp(min(diff, log cap)), so a huge ratio never overflows. Detached.
    """
    keep = _keep(mask, logp_target, "logp_target")
    if logp_behaviour.shape != logp_target.shape:
        raise ValueError(f"logp_behaviour shape {tuple(logp_behaviour.shape)} must equal logp_target shape {tuple(logp_target.shape)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (the truncation of the importance weight), got {cap}")
    diff = (logp_target.detach() - logp_behaviour.detach()).clamp(max=math.log(cap))  # (N, L)
    return torch.where(keep, diff.exp(), torch.zeros_like(diff))


def hinted_token_advantages(
    rewards: torch.Tensor, baselines: torch.Tensor, weights: torch.Tensor, coef: float, mask: torch.Tensor
) -> torch.Tensor:
    """A_t = coef * w_t * (R - b) on action tokens, 0 elsewhere.  -> (N, L)

    rewards    # (N,) reward R of the re-rolled attempt each row belongs to
    baselines  # (N,) b: mean reward of that group's un-hinted attempts
    weights    # (N, L) truncated importance weights (`truncated_importance_weights`)
    """
    keep = _keep(mask, weights, "weights")
    n = weights.shape[0]
    for name, x in (("rewards", rewards), ("baselines", baselines)):
        if not isinstance(x, torch.Tensor) or x.shape != (n,):
            raise ValueError(f"{name} must be a tensor of shape (N,) = ({n},), got {_shape(x)}")
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    adv = (rewards.detach() - baselines.detach()).to(weights.dtype)  # (N,)
    values = coef * weights.detach() * adv[:, None]  # (N, L)
    return torch.where(keep, values, torch.zeros_like(values))
