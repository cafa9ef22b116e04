"""Policy-optimization objectives besides PPO-clip, switched by `algo.objective`.

Shapes as in `recursa.algorithms.losses`: B rows (completions, or one turn of a game each),
T token positions, ``mask  # (B, T)`` 1 at the policy's own tokens. ``logp`` carries the
gradient; ``logp_old`` (the policy that sampled the rows), ``logp_ref``, advantages and
rewards are constants. rho = exp(logp - logp_old) per token, the log-ratio clamped to
[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20] before the exponential as PPO-clip does (NFT clamps only
the top, at +NFT_LOG_RATIO_MAX = +10, as its release does).

Token-level objectives (a per-token loss, reduced with `losses.aggregate` under ``agg``):

* ``spo_loss``  SPO, "simple policy optimization" (Xie et al. 2025): the clip is replaced by a
  quadratic penalty on the ratio's departure from 1,

      l = -( rho A - |A| / (2 eps) (rho - 1)^2 ).

  In rho the objective peaks at rho = 1 + eps sign(A), where PPO's clip would start; past it
  the penalty pushes the ratio back instead of only stopping the gradient. Its stat
  ``clip_frac`` is the share of tokens past that point.
* ``pg_loss``  the plain policy gradient of GPG, "group policy gradient" (Chu et al. 2025):
  l = -A logp. No ratio, no clip, no KL term; with one optimizer step per batch its
  gradient equals PPO-clip's (rho = 1 there). GPG's advantage is `advantages.gpg`.
* ``nft_loss``  NFT, "negative-aware fine-tuning" (Chen et al. 2025): positives are trained
  by likelihood and failures through an implicit negative policy (see the function).

Sequence-level objectives (a loss of S, the sequence log-ratios, then the gradient):

* ``rebel_loss``  REBEL (Gao et al. 2024): for every pair (i, j) of sequences of one task
  group, the squared error of (S_i - S_j) / eta against r_i - r_j, with S = log pi(y|x) -
  log pi_old(y|x); the mean over pairs.
* ``apo_loss`` with ``apo_values``  A*-PO (Brantley et al. 2025): V*(x) = beta_1 log mean_j
  exp(r_j / beta_1) over samples of the task, then (beta_2 S - (r - V*(x)))^2 per sequence,
  with S = log pi(y|x) - log pi_ref(y|x); the mean over sequences.

A sequence objective couples the rows of a sequence (a game's turns) and of a task group
(REBEL's pairs), which micro-batches split. Its gradient is sum_e dL/dS_e grad S_e and
grad S_e = sum over the sequence's action tokens of grad logp, so with the weights
w_e = dL/dS_e computed from all the sequences at the current weights (``sequence_weights``)
each micro-batch's rows add ``sequence_surrogate`` = sum_rows w sum_t logp, and the summed
gradient is exactly the objective's. The recipe (recursa/recipes/grpo.py) recomputes the
weights before every optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from recursa.algorithms.losses import LOG_RATIO_CLAMP, Count, _check_mask, aggregate, kl_estimate, masked_mean, ppo_clip_loss

__all__ = [
    "NFT_RATE_CLIP",
    "spo_loss",
    "pg_loss",
    "nft_loss",
    "ratio_stats",
    "rebel_loss",
    "apo_values",
    "reference_values",
    "apo_loss",
    "sequence_sums",
    "sequence_weights",
    "sequence_surrogate",
]

NFT_LOG_RATIO_MAX = 10.0  # NFT clamps the log-ratio only from above, at +10, as the authors' release does
NFT_RATE_CLIP = 0.02  # NFT's pass rate is clamped to [0.02, 0.98] inside the loss, as in the authors' release


def _ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped log-ratio, ratio), both (B, T); logp_old detached."""
    if logp_old.shape != logp.shape:
        raise ValueError(f"logp_old shape {tuple(logp_old.shape)} must equal logp shape {tuple(logp.shape)}")
    log_ratio = torch.clamp(logp - logp_old.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages as a detached (B, T) tensor of `like`'s dtype."""
    adv = advantages.detach().to(like.dtype)
    if adv.dim() == 1 and adv.shape[0] == like.shape[0]:
        return adv.unsqueeze(-1).expand_as(like)
    if adv.shape != like.shape:
        raise ValueError(f"advantages must have shape (B,) = ({like.shape[0]},) or (B, T) = {tuple(like.shape)}, got {tuple(advantages.shape)}")
    return adv


def _row_values(values: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """A (B,) per-row tensor as a detached (B, 1) column of `like`'s dtype."""
    if values.shape != (like.shape[0],):
        raise ValueError(f"{name} must have shape (B,) = ({like.shape[0]},), got {tuple(values.shape)}")
    return values.detach().to(like.dtype).unsqueeze(-1)


def _ratio_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, keep: torch.Tensor, beyond: torch.Tensor, kl: Optional[torch.Tensor]) -> dict[str, float]:
    """The stats every objective reports, as `losses.ppo_clip_loss` names them; ``beyond`` (B, T)
    bool marks the tokens the objective counts in ``clip_frac``."""
    with torch.no_grad():
        ratio_max = torch.where(keep, ratio, torch.full_like(ratio, -torch.inf)).amax()
        ratio_max = torch.where(keep.any(), ratio_max, torch.zeros_like(ratio_max))
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        values = torch.stack([
            masked_mean(beyond.to(ratio.dtype), keep),
            masked_mean(ratio, keep),
            ratio_max,
            masked_mean(kl, keep) if kl is not None else zero,
            masked_mean(0.5 * log_ratio.square(), keep),
        ]).tolist()
    return dict(zip(("clip_frac", "ratio_mean", "ratio_max", "kl", "approx_kl_old"), values))


def _weighted(per_token: torch.Tensor, token_weights: Optional[torch.Tensor]) -> torch.Tensor:
    if token_weights is None:
        return per_token
    if token_weights.shape != per_token.shape:
        raise ValueError(f"token_weights shape {tuple(token_weights.shape)} must equal logp shape {tuple(per_token.shape)}")
    return per_token * token_weights.detach().to(per_token.dtype)


def spo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 0.2,
    agg: str = "token-mean",
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    norm_len: Optional[Count] = None,
    logp_ref: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SPO: per token -(rho A - |A| / (2 eps) (rho - 1)^2), plus kl_coef x KL when asked;
    aggregated by ``agg`` (arguments as `losses.ppo_clip_loss`, with ``eps`` for the clip).

    d l / d logp = -(A - |A| (rho - 1) / eps) rho: -A at rho = 1 (the policy gradient), zero
    at rho = 1 + eps sign(A), and of the other sign past it. ``clip_frac`` is the share of
    tokens with A != 0 past that point, (rho - 1) sign(A) > eps.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}; typical value 0.2")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs the reference log-probs: pass logp_ref=..., or set kl_coef=0.0")
    keep = _check_mask(logp, mask)
    adv = _token_advantages(advantages, logp)
    log_ratio, ratio = _ratio(logp, logp_old)
    per_token = -(ratio * adv - adv.abs() / (2.0 * eps) * (ratio - 1.0).square())  # (B, T)
    per_token = _weighted(per_token, token_weights)
    kl = kl_estimate(logp, logp_ref.detach(), kl_estimator) if logp_ref is not None else None
    if kl is not None and kl_coef > 0:
        per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, keep, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    beyond = (adv != 0) & ((ratio.detach() - 1.0) * torch.sign(adv) > eps)
    return loss, _ratio_stats(ratio, log_ratio, keep, beyond, kl)


def pg_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    norm_len: Optional[Count] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG's plain policy gradient: per token -A logp, aggregated by ``agg``. ``logp_old`` is
    read only for the ratio stats (``clip_frac`` is 0: nothing is clipped)."""
    keep = _check_mask(logp, mask)
    adv = _token_advantages(advantages, logp)
    per_token = _weighted(-adv * logp, token_weights)  # (B, T)
    loss = aggregate(per_token, keep, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    log_ratio, ratio = _ratio(logp.detach(), logp_old)
    return loss, _ratio_stats(ratio, log_ratio, keep, torch.zeros_like(keep), None)


def nft_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    positive: torch.Tensor,
    pass_rate: torch.Tensor,
    mask: torch.Tensor,
    *,
    neg_clamp: float = 1.0,
    agg: str = "token-mean",
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    norm_len: Optional[Count] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """NFT's per-token loss (Chen et al. 2025, "Bridging supervised learning and reinforcement
    learning in math reasoning"), aggregated by ``agg``.

    positive   # (B,) 1 where the row's sequence succeeded (the binary verdict), else 0
    pass_rate  # (B,) r_q, the share of successes in the row's task group

    The sampling policy splits into the successes' and the failures' distributions:
    pi_old = r_q pi_pos + (1 - r_q) pi_neg. NFT trains pi_theta as pi_pos on the successes and,
    on the failures, the implicit negative policy it defines,

        pi_neg = (pi_old - r_q pi_theta) / (1 - r_q),

    by likelihood, per token with R = pi_theta / pi_old = rho:

        positive  l = -log R
        negative  l = -log max( (1 - r R) / (1 - r), neg_clamp )

    with r = r_q clamped to [NFT_RATE_CLIP, 1 - NFT_RATE_CLIP] and each row weighted by
    (1 - r) (the release's default prompt weight). The max is taken on the value only: its
    gradient is that of (1 - r R) / (1 - r) divided by the clamped value (a straight-through
    clamp, as the release does), so a failure whose ratio has grown past 1 / r (where
    pi_neg would be negative) still gets a finite push down. Rows of groups with r_q = 0 or 1
    weigh 0: the release filters such groups out, and r_q = 1 would divide by zero.

    In strict on-policy training (R = 1, neg_clamp <= 1) the gradient is Dr. GRPO's with the
    binary reward: -(c - r_q) grad logp, c the verdict. ``clip_frac`` is the share of failed
    rows' tokens at the clamp.
    """
    if not 0 < neg_clamp <= 1:
        raise ValueError(f"neg_clamp must be in (0, 1], got {neg_clamp}; the release uses 1.0")
    keep = _check_mask(logp, mask)
    pos = _row_values(positive, logp, "positive")  # (B, 1)
    rate = _row_values(pass_rate, logp, "pass_rate")  # (B, 1)
    if bool(((pos != 0) & (pos != 1)).any()):
        raise ValueError("positive must be 0 or 1 per row (NFT needs a binary verdict)")
    if bool((~torch.isfinite(rate) | (rate < 0) | (rate > 1)).any()):
        raise ValueError(f"pass_rate must be a share in [0, 1] per row, got {rate.flatten().tolist()}")
    if logp_old.shape != logp.shape:
        raise ValueError(f"logp_old shape {tuple(logp_old.shape)} must equal logp shape {tuple(logp.shape)}")
    # Only the top is clamped, at +NFT_LOG_RATIO_MAX as the release does: a success far below
    # the sampling policy (log-ratio < -20) keeps its -log R gradient (issue 50).
    log_ratio = torch.clamp(logp - logp_old.detach(), max=NFT_LOG_RATIO_MAX)  # (B, T)
    ratio = torch.exp(log_ratio)
    r = rate.clamp(NFT_RATE_CLIP, 1.0 - NFT_RATE_CLIP)
    weight = torch.where((rate > 0) & (rate < 1), 1.0 - r, torch.zeros_like(r))  # (B, 1)
    neg_ratio = (1.0 - r * ratio) / (1.0 - r)  # (B, T): pi_neg / pi_old
    clamped = neg_ratio + (neg_ratio.clamp(min=neg_clamp) - neg_ratio).detach()  # value max(., clamp), gradient of neg_ratio
    per_token = weight * (pos * -log_ratio + (1.0 - pos) * -torch.log(clamped))  # (B, T)
    per_token = _weighted(per_token, token_weights)
    loss = aggregate(per_token, keep, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    at_clamp = (pos == 0) & (weight > 0) & (neg_ratio.detach() < neg_clamp)
    return loss, _ratio_stats(ratio, log_ratio, keep, at_clamp.expand_as(keep), None)


def ratio_stats(
    logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, logp_ref: Optional[torch.Tensor] = None, kl_estimator: str = "k3",
) -> dict[str, float]:
    """The stats of an objective with no token-level surrogate (REBEL, A*-PO): the ratio to the
    sampling policy over the masked tokens, ``kl`` to the reference when ``logp_ref`` is given,
    ``clip_frac`` 0."""
    keep = _check_mask(logp, mask)
    log_ratio, ratio = _ratio(logp.detach(), logp_old)
    kl = kl_estimate(logp.detach(), logp_ref.detach(), kl_estimator) if logp_ref is not None else None
    return _ratio_stats(ratio, log_ratio, keep, torch.zeros_like(keep), kl)


def rebel_loss(seq_logratio: torch.Tensor, rewards: torch.Tensor, groups: torch.Tensor, eta: float) -> torch.Tensor:
    """REBEL: the mean over pairs i < j of one group of ((S_i - S_j) / eta - (r_i - r_j))^2.

    seq_logratio  # (E,) S, the log-ratio of each sequence to the policy that sampled it
    rewards       # (E,)
    groups        # (E,) long, the task group of each sequence

    0 (still attached to ``seq_logratio``) when no group has two sequences.
    """
    if not eta > 0:
        raise ValueError(f"eta must be > 0, got {eta}")
    if not (seq_logratio.shape == rewards.shape == groups.shape) or seq_logratio.dim() != 1:
        raise ValueError(f"seq_logratio, rewards and groups must be equal 1-D shapes, got {tuple(seq_logratio.shape)}, {tuple(rewards.shape)}, {tuple(groups.shape)}")
    r = rewards.detach().to(seq_logratio.dtype)
    pairs = (groups.unsqueeze(1) == groups.unsqueeze(0)).triu(diagonal=1)  # (E, E), i < j in one group
    residual = (seq_logratio.unsqueeze(1) - seq_logratio.unsqueeze(0)) / eta - (r.unsqueeze(1) - r.unsqueeze(0))  # (E, E)
    n_pairs = pairs.sum()
    total = torch.where(pairs, residual.square(), torch.zeros_like(residual)).sum()
    return total / n_pairs.clamp_min(1).to(total.dtype)


def apo_values(rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """A*-PO's estimate of the optimal value of each task: V* = beta log( (1/G) sum_j exp(r_j / beta) )
    over the group's rewards.  ``rewards  # (B, G)`` -> (B,). Between the group's mean (beta -> inf)
    and its max (beta -> 0); computed with logsumexp, so any beta > 0 is finite."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must have shape (B, G) with G >= 1, got {tuple(rewards.shape)}")
    if rewards.is_floating_point() and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (a NaN or inf reward would give V* = NaN / inf)")
    r = rewards.to(torch.get_default_dtype()) if not rewards.is_floating_point() else rewards
    g = torch.tensor(float(rewards.shape[1]), dtype=r.dtype, device=r.device)
    return beta * (torch.logsumexp(r / beta, dim=1) - torch.log(g))


def reference_values(samples: Mapping[int, Sequence[float]], seeds: Sequence[int], beta: float) -> torch.Tensor:
    """A*-PO's stage 1 read back: V*(x) of each task from a stored sample of the reference policy,
    ``apo_values`` over the rewards of pi_ref's samples of that task (each task may have its own
    number of samples).  ``samples``: task seed -> rewards; ``seeds  # (B,)`` -> (B,) float64."""
    out = []
    for seed in seeds:
        rewards = samples.get(seed)
        if rewards is None:
            raise ValueError(f"task {seed} has no stored sample of the reference policy: sample it in stage 1, or use V* from the group")
        if len(rewards) == 0:
            raise ValueError(f"task {seed}'s stored sample of the reference policy is empty")
        out.append(apo_values(torch.tensor([list(rewards)], dtype=torch.float64), beta)[0])
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def apo_loss(seq_logratio: torch.Tensor, targets: torch.Tensor, beta: float) -> torch.Tensor:
    """A*-PO's regression: the mean over sequences of (beta S - target)^2, with S = log pi(y|x) -
    log pi_ref(y|x) and target = r - V*(x) (``apo_values``).  (E,), (E,) -> ()"""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if seq_logratio.shape != targets.shape or seq_logratio.dim() != 1:
        raise ValueError(f"seq_logratio and targets must be equal 1-D shapes, got {tuple(seq_logratio.shape)} and {tuple(targets.shape)}")
    if seq_logratio.numel() == 0:
        return seq_logratio.sum()
    return (beta * seq_logratio - targets.detach().to(seq_logratio.dtype)).square().mean()


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, row_seq: torch.Tensor, n_seq: int) -> torch.Tensor:
    """Per sequence, the sum of ``values`` over its rows' masked tokens: (N, T), (N, T), (N,) long
    -> (n_seq,). A game's turns are rows of one sequence; a single-turn row is its own."""
    keep = _check_mask(values, mask)
    if row_seq.shape != (values.shape[0],):
        raise ValueError(f"row_seq must have shape (N,) = ({values.shape[0]},), got {tuple(row_seq.shape)}")
    per_row = torch.where(keep, values, torch.zeros_like(values)).sum(dim=1)  # (N,)
    return torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add_(0, row_seq, per_row)


def sequence_weights(loss_fn: Callable[[torch.Tensor], torch.Tensor], seq_logratio: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(L(S), dL/dS) of a sequence objective at the log-ratios ``seq_logratio  # (E,)``; the
    weights are detached, (E,)."""
    s = seq_logratio.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        value = loss_fn(s)
        (grad,) = torch.autograd.grad(value, s, allow_unused=True)
    return float(value.detach()), (torch.zeros_like(s) if grad is None else grad).detach()


def sequence_surrogate(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, share: float) -> torch.Tensor:
    """sum_b w_b sum_t mask_bt logp_bt, whose gradient is a sequence objective's restricted to these
    rows (``weights  # (B,)`` = dL/dS of each row's sequence, ``sequence_weights``); its value is
    replaced by ``share`` (the rows' share of L(S)), so the values of the micro-batches add up to L."""
    keep = _check_mask(logp, mask)
    w = _row_values(weights, logp, "weights")
    linear = torch.where(keep, w * logp, torch.zeros_like(logp)).sum()
    return linear - linear.detach() + share


# ----------------------------------------------------------------------------- the objectives as the update calls them
#
# The update (recursa/recipes/grpo.py) hands each micro-batch to the objective algo.objective
# names (recursa.plugins.OBJECTIVES) as a `MicroBatch`; an objective returns its loss and the
# stats clip_frac, kl, approx_kl_old and ratio_max. NFT and the sequence objectives (REBEL,
# A*-PO) read the sequences' outcomes (`Outcomes`) instead of the advantage.


@dataclass
class Outcomes:
    """The sampled sequences' outcomes, which the objectives 'rebel', 'nft' and 'apo' read instead
    of the advantage: each sequence's reward and verdict, and the sequence of each training row
    (a game's turns are rows of their episode; a single-turn row is its own sequence)."""

    rewards: torch.Tensor  # (B, G) the training reward of each sequence (the env's, or the [[reward]] sum)
    success: torch.Tensor  # (B, G) 1.0 where it succeeded (answer correct, game won), else 0.0
    row_seq: torch.Tensor  # (N,) long: the sequence b * G + g each row of the batch belongs to
    values: torch.Tensor | None = None  # (B,) A*-PO's V*(x) from a stored sample of pi_ref (``reference_values``); None: from the group's rewards

    def to(self, device: torch.device | str) -> "Outcomes":
        values = None if self.values is None else self.values.to(device)
        return Outcomes(self.rewards.to(device), self.success.to(device), self.row_seq.to(device), values)

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """(B, G) per-sequence values -> (N,) per row."""
        return values.reshape(-1)[self.row_seq]


@dataclass
class MicroBatch:
    """One micro-batch as an objective (`recursa.plugins.OBJECTIVES`) reads it; the per-row inputs of NFT and
    of the sequence objectives are set only for them."""

    logp: torch.Tensor  # (b, T) current policy, grad flows
    logp_old: torch.Tensor  # (b, T) the policy the rows were sampled from
    mask: torch.Tensor  # (b, T) 1 at action tokens
    advantages: torch.Tensor  # (b,) or (b, T)
    logp_ref: torch.Tensor | None  # (b, T) reference policy, when the update keeps one
    token_weights: torch.Tensor | None  # (b, T) truncated importance weights (rollout.tis_cap)
    num_tokens: int  # action tokens of the whole mini-batch (aggregation denominators)
    num_seqs: int  # rows of the whole mini-batch
    norm_len: int  # sampling.max_new_tokens, seq-mean-token-sum-norm's constant
    positive: torch.Tensor | None = None  # (b,) NFT: 1.0 where the row's sequence succeeded
    pass_rate: torch.Tensor | None = None  # (b,) NFT: the success rate of its task group
    seq_weight: torch.Tensor | None = None  # (b,) REBEL, A*-PO: dL/dS of the row's sequence at the current weights
    seq_share: float = 0.0  # REBEL, A*-PO: these rows' share of the loss value L(S)


def ppo_objective(mb: MicroBatch, ac) -> tuple[torch.Tensor, dict]:
    return ppo_clip_loss(
        mb.logp, mb.logp_old, mb.advantages, mb.mask, clip_low=ac.clip_low, clip_high=ac.clip_high, dual_clip=ac.dual_clip, agg=ac.agg,
        num_tokens=mb.num_tokens, num_seqs=mb.num_seqs, norm_len=mb.norm_len, logp_ref=mb.logp_ref, kl_coef=ac.kl_coef,
        kl_estimator=ac.kl_estimator, token_weights=mb.token_weights,
    )


def spo_objective(mb: MicroBatch, ac) -> tuple[torch.Tensor, dict]:
    return spo_loss(
        mb.logp, mb.logp_old, mb.advantages, mb.mask, eps=ac.spo_eps, agg=ac.agg, num_tokens=mb.num_tokens, num_seqs=mb.num_seqs,
        norm_len=mb.norm_len, logp_ref=mb.logp_ref, kl_coef=ac.kl_coef, kl_estimator=ac.kl_estimator, token_weights=mb.token_weights,
    )


def gpg_objective(mb: MicroBatch, ac) -> tuple[torch.Tensor, dict]:
    return pg_loss(mb.logp, mb.logp_old, mb.advantages, mb.mask, agg=ac.agg, num_tokens=mb.num_tokens, num_seqs=mb.num_seqs,
                   norm_len=mb.norm_len, token_weights=mb.token_weights)


def nft_objective(mb: MicroBatch, ac) -> tuple[torch.Tensor, dict]:
    return nft_loss(mb.logp, mb.logp_old, mb.positive, mb.pass_rate, mb.mask, neg_clamp=ac.nft_neg_clamp, agg=ac.agg,
                    num_tokens=mb.num_tokens, num_seqs=mb.num_seqs, norm_len=mb.norm_len, token_weights=mb.token_weights)


def sequence_objective(mb: MicroBatch, ac) -> tuple[torch.Tensor, dict]:
    loss = sequence_surrogate(mb.logp, mb.mask, mb.seq_weight, mb.seq_share)
    return loss, ratio_stats(mb.logp, mb.logp_old, mb.mask, mb.logp_ref, ac.kl_estimator)




def _rebel(seq_logratio: torch.Tensor, outcomes: Outcomes, ac) -> torch.Tensor:
    B, G = outcomes.rewards.shape
    groups = torch.arange(B, device=seq_logratio.device).repeat_interleave(G)  # sequence b * G + g is in group b
    return rebel_loss(seq_logratio, outcomes.rewards.reshape(-1), groups, ac.rebel_eta)


def _apo(seq_logratio: torch.Tensor, outcomes: Outcomes, ac) -> torch.Tensor:
    # V*(x) from a stored sample of pi_ref when the caller read one (A*-PO's stage 1), else from the
    # group's own rewards, the stand-in for it (docs/objectives.md)
    values = apo_values(outcomes.rewards, ac.apo_value_beta) if outcomes.values is None else outcomes.values
    if values.shape != outcomes.rewards.shape[:1]:
        raise ValueError(f"V* must have one value per group, shape ({outcomes.rewards.shape[0]},), got {tuple(values.shape)}")
    targets = outcomes.rewards - values.to(outcomes.rewards.dtype).unsqueeze(1)  # (B, G): r - V*(x)
    return apo_loss(seq_logratio, targets.reshape(-1), ac.apo_beta)


# algo.objective -> L(S), a loss of the sequences' log-ratios S (to the sampling policy for REBEL, to the reference for A*-PO)
SEQUENCE_LOSSES: dict[str, Callable[[torch.Tensor, Outcomes, object], torch.Tensor]] = {"rebel": _rebel, "apo": _apo}
