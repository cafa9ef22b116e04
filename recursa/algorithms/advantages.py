"""Outcome advantage estimators for group-sampled RL (GRPO family).

Every estimator maps ``rewards  # (B, G)`` -- B groups (one prompt or game seed
each), G sampled completions per group, one scalar reward per completion -- to
advantages of the same shape ``(B, G)``.  The advantage of a completion is later
broadcast over all of its tokens by the loss.

Notation for one group: rewards r_1..r_G, mean m = (1/G) sum_j r_j,
unbiased std s = sqrt( sum_j (r_j - m)^2 / (G - 1) ).

* ``grpo``         A_i = (r_i - m) / (s + eps)                 (Shao et al. 2024, DeepSeekMath)
  The std is the *unbiased* one (Bessel correction, ``correction=1``), the
  torch default and what TRL's GRPOTrainer uses.  The biased std would make
  every advantage smaller by sqrt((G-1)/G).
* ``dr_grpo``      A_i = r_i - m                                (Liu et al. 2025, "Dr. GRPO")
  No division by the std, which removes the question-difficulty bias.
* ``rloo``         A_i = r_i - (1/(G-1)) sum_{j != i} r_j = G/(G-1) * (r_i - m)
  (Ahmadian et al. 2024, leave-one-out baseline).  Needs G >= 2.
* ``reinforce_pp`` c_i = r_i - m  (group baseline), then
                   A = c / (S + eps), S = unbiased std of all B*G values of c.
  (REINFORCE++-baseline, Hu et al. 2025.)  Departure: OpenRLHF's version
  *whitens* c over the batch, i.e. also subtracts the batch mean of c.  That
  mean is 0 in exact arithmetic (each group's c sums to 0) but not after
  rounding, and subtracting it would give constant groups a nonzero advantage.
  So we only divide.  S is computed as the std around the batch mean of c
  (``torch.std``), which equals the root mean square up to that same rounding.
* ``gopo``         rank-based, as GOPO's paper and release define it:
                   A_i = 2 - 4 (rho_i - 1) / (G - 1),  rho_i the 1-based descending rank of r_i
  in its group, so A spans [-2, 2] in equal steps and sums to 0 per group.  Ties are broken by
  sort order, as the release does (a stable descending sort: among equal rewards the earlier
  rollout ranks higher), so a constant group gets the full spread 2, ..., -2 by rollout index.
  Only comparisons of rewards are used, so A is invariant under any strictly increasing
  transform of the rewards.
* ``gopo_avg``     the same scale with tied rewards sharing their average rank,
                   rho_i - 1 = #{j: r_j > r_i} + (#{j: r_j = r_i} - 1) / 2,
  so a constant group gets exactly 0 (``[[5, 5, 1]]``: [1, 1, -2]; the release: [2, 0, -2]).
  Why a second rule: a constant group's sort-order advantages depend on the rollout index
  only, so their expected gradient is 0 and they add variance alone; on a softmax bandit
  where most groups start constant (docs/objectives.md, "Conventions") that noise slowed
  learning under Adam.
* ``gpg``          A_i = alpha (r_i - m),  alpha = B / B_valid     (Chu et al. 2025, GPG)
  B_valid is the number of groups whose rewards are not all equal.  Those groups
  carry the whole gradient, yet a token-mean loss divides by every row; alpha scales
  the valid groups back up (GPG's "accurate gradient estimation", with F_norm = 1,
  the paper's best setting).  alpha counts groups, the paper counts samples: the same
  for equal group sizes.  Departure from verl, which divides B by the number of
  nonzero rewards.  With no valid group every advantage is 0.

Conventions shared by all estimators:

* A group whose rewards are all equal (zero variance) has no learning signal;
  its advantages are exactly 0.0 (forced, not left to floating-point luck), except
  under ``gopo``, whose release ranks a constant group by rollout index.
* A group of size G = 1 is a zero-variance group for grpo, dr_grpo,
  reinforce_pp, gopo and gpg (advantage 0); rloo raises, since its baseline is
  undefined.
* Integer / bool rewards are cast to the default float dtype; rewards must be
  finite and 2-D, otherwise ValueError.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = [
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "gopo",
    "gopo_avg",
    "gpg",
    "ESTIMATORS",
    "compute_advantages",
]


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Validate ``rewards  # (B, G)`` and return it as a floating tensor."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(
            f"rewards must be a torch.Tensor of shape (B, G), got {type(rewards).__name__}; "
            "wrap it with torch.as_tensor(...)"
        )
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape (B, G) = (groups, samples per group), got shape "
            f"{tuple(rewards.shape)}; for a single group use rewards.unsqueeze(0)"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf; clean them before computing advantages")
    return rewards


def _check_eps(eps: float) -> None:
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def _constant_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``(B, 1)`` bool: True where every reward in the group is identical."""
    return (rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True))


def _group_centred(rewards: torch.Tensor) -> torch.Tensor:
    """r - group mean, with constant groups set to exactly 0.  (B, G)"""
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # (B, G)
    return torch.where(_constant_groups(rewards), torch.zeros_like(centred), centred)


def grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage (r - mean) / (unbiased std + eps), per group.  (B, G) -> (B, G)"""
    rewards = _check_rewards(rewards)  # (B, G)
    _check_eps(eps)
    if rewards.shape[-1] < 2:
        return torch.zeros_like(rewards)
    centred = _group_centred(rewards)  # (B, G)
    std = rewards.std(dim=-1, keepdim=True, correction=1)  # (B, 1)
    const = _constant_groups(rewards)  # (B, 1)
    # In constant groups std may be 0; divide by 1 there instead (centred is 0 anyway).
    denom = torch.where(const, torch.ones_like(std), std + eps)  # (B, 1)
    return centred / denom


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantage r - group mean.  (B, G) -> (B, G)"""
    rewards = _check_rewards(rewards)
    return _group_centred(rewards)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantage r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean).  (B, G) -> (B, G)"""
    rewards = _check_rewards(rewards)
    group_size = rewards.shape[-1]
    if group_size < 2:
        raise ValueError(
            f"rloo needs at least 2 samples per group (G >= 2) for a leave-one-out baseline, "
            f"got G = {group_size}; sample more completions per prompt or use another estimator"
        )
    return _group_centred(rewards) * (group_size / (group_size - 1))


def reinforce_pp(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline: (r - group mean) / (batch std of that + eps).  (B, G) -> (B, G)

    Not re-centred over the batch (see module docstring).  If every group has
    zero variance the result is all zeros.
    """
    rewards = _check_rewards(rewards)
    _check_eps(eps)
    centred = _group_centred(rewards)  # (B, G)
    if centred.numel() < 2 or not bool((centred != 0).any()):
        return torch.zeros_like(centred)
    global_std = centred.std(correction=1)  # ()
    return centred / (global_std + eps)


def gopo(rewards: torch.Tensor) -> torch.Tensor:
    """GOPO's rank advantage as the paper and its release define it: A = 2 - 4 (rho - 1) / (G - 1),
    rho the 1-based descending rank of the reward in its group, range [-2, 2]. Ties are broken by
    sort order, as the release does (a stable descending sort: among equal rewards the earlier
    rollout ranks higher), so ``[[5, 5, 1]]`` gives [2, 0, -2] and a constant group still gets
    the full spread. G = 1 gives 0.  (B, G) -> (B, G)"""
    rewards = _check_rewards(rewards)
    group_size = rewards.shape[-1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    order = torch.sort(rewards, dim=-1, descending=True, stable=True).indices  # (B, G)
    rank = torch.empty_like(order)
    positions = torch.arange(group_size, device=rewards.device).expand_as(order)
    rank.scatter_(-1, order, positions)  # (B, G), 0-based descending rank = rho - 1
    return 2.0 - 4.0 * rank.to(rewards.dtype) / (group_size - 1)


def gopo_avg(rewards: torch.Tensor) -> torch.Tensor:
    """GOPO's scale, A = 2 - 4 (rho - 1) / (G - 1), with tied rewards sharing their average rank
    (rho - 1 = #greater + (#equal - 1) / 2), so ``[[5, 5, 1]]`` gives [1, 1, -2] and a constant
    group exactly 0. G = 1 gives 0.  (B, G) -> (B, G)"""
    rewards = _check_rewards(rewards)
    group_size = rewards.shape[-1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    greater = (rewards.unsqueeze(-1) < rewards.unsqueeze(-2)).sum(-1)  # (B, G): #{j: r_j > r_i}
    equal = (rewards.unsqueeze(-1) == rewards.unsqueeze(-2)).sum(-1)  # (B, G), counting i itself
    rank = greater.to(rewards.dtype) + (equal - 1).to(rewards.dtype) / 2  # 0-based average descending rank
    out = 2.0 - 4.0 * rank / (group_size - 1)
    return torch.where(_constant_groups(rewards), torch.zeros_like(out), out)


def gpg(rewards: torch.Tensor) -> torch.Tensor:
    """GPG advantage alpha (r - group mean), alpha = groups / groups with unequal rewards.  (B, G) -> (B, G)"""
    rewards = _check_rewards(rewards)
    centred = _group_centred(rewards)  # (B, G), 0 in constant groups
    n_valid = int((~_constant_groups(rewards)).sum().item())
    if n_valid == 0:
        return torch.zeros_like(centred)
    return centred * (rewards.shape[0] / n_valid)


ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "gopo": gopo,
    "gopo_avg": gopo_avg,
    "gpg": gpg,
}


def compute_advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """Dispatch to the estimator called ``name`` (default arguments): a built-in of
    `ESTIMATORS`, or one registered in `recursa.plugins.ADVANTAGES` (a `recursa.advantages`
    entry point, or `ADVANTAGES.register`).  (B, G) -> (B, G)"""
    estimator = ESTIMATORS.get(name)
    if estimator is None:
        from recursa.plugins import ADVANTAGES

        if name not in ADVANTAGES:
            raise ValueError(f"unknown advantage estimator {name!r}; valid choices are {sorted(ADVANTAGES.names())}")
        estimator = ADVANTAGES.get(name)
    return estimator(rewards)
