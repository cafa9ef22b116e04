"""Self-teacher math of the RSIPO recipe: teacher log-prob shift, its normalisation,
token advantages, imitation gates and weights, and the replay reward of written skills.

Shapes: N trajectories (rows), L token positions.  ``mask  # (N, L)`` is 1 (or True)
at the action tokens -- the tokens the policy sampled and is trained on -- and 0 at
prompt, padding and environment tokens; it is treated as binary, and values off the
mask are never read (NaN there does not propagate).

Self-teacher shift (RSIPO spec; the re-scoring of OPID, Yang et al. 2026,
arXiv:2606.26790).  The sampled action tokens a_t are scored twice by the behaviour
policy, once with a retrieved skill s inserted into the context:

    Delta_t = log pi_old(a_t | context + s) - log pi_old(a_t | context)

The caller aligns both log-prob rows on the same action positions (the skill moves the
tokens in the teacher's context, not the tokens that are scored).  Delta > 0 means the
skill makes the sampled token more likely: the self-teacher endorses it.

Normalisation psi(Delta): divide by a robust batch scale over the masked tokens,
    "std"   unbiased std of the masked Delta (Bessel correction, as in ``grpo``),
    "mad"   1.4826 * median(|Delta - median(Delta)|)  (the std of a normal sample),
    "none"  1,
floored at eps; clip to [-clip, clip]; multiply the negative values by
``negative_scale`` (< 1 softens the teacher's rejections, as SDAR does with its
sigmoid gate, Lu et al. 2026, arXiv:2605.15155).  Delta is *not* centred: its sign is
the teacher's verdict and must survive.  With fewer than 2 masked tokens the std is
taken as 0, so the floor applies (and a nonzero Delta saturates at +-clip).

Token advantage (RSIPO spec):

    A_t = A_outcome + lam * T_g * psi_t          on action tokens, 0 elsewhere

with T_g in [0, 1] the empirical-Bayes trust in the skill group's teacher
(``recursa.algorithms.trust``).  Routing "failed" (SRPO, Li et al. 2026,
arXiv:2604.02288) applies the teacher term only to trajectories that failed;
successful ones keep the outcome advantage alone.  Departure from SRPO: SRPO routes
failed samples to a logit-level distillation *loss* with entropy-aware weights; here
the teacher enters as an advantage term (OPID) and the trust T_g plays the role of
the reliability weight.

Imitation gate (SEED-like, as the RSIPO spec names it; the same form as SDAR's gate):
    w_t = sigmoid(Delta_t / temperature),  loss = masked mean of -w_t * log pi(a_t)
so tokens the teacher endorses are imitated with weight > 1/2, rejected ones < 1/2.

Pass-rate weights (SC-SDPO, Liu et al. 2026, arXiv:2605.27765): each trajectory of a
group with pass rate p gets the weight sqrt(p (1 - p)) (0 for all-pass or all-fail
groups), the factor GRPO's normalisation leaves on the per-question gradient.

Skill replay reward (RSIPO spec): a written skill s is replayed on M stored
trajectories with outcomes y_i in {+1, -1}; with D_i the mean Delta of trajectory i
under s,
    r(s) = (1/M) sum_i y_i * clip(D_i, -c, c)
i.e. a skill is rewarded for raising the likelihood of successful behaviour and
lowering that of failed behaviour.  Candidates are then penalised (over-length, invalid)
and normalised within their group of K candidates like GRPO rewards.

Skill effect (``skills.effect_games``; the issue's "skills rewarded by what they do"): a
candidate is instead played, shown in the prompt, on M related games of the same step (the
games are deterministic, so the same game without it is its group's episodes), and its
reward is e(s) = mean_m (R_m - b_m), the change in reward it caused (``skill_effect``), with
the same penalties (``penalised``).

Full-distribution self-distillation (SDPO, Hubotter et al. 2026, arXiv:2601.20802; OPSD):
instead of the shift of the sampled token alone, the student's next-token distribution at
each action position is pulled toward the teacher's (the same policy with the hint in its
context, at the rollout's weights: a constant target).  Only the teacher's k most likely
tokens are stored; both distributions are collapsed onto those k tokens plus one tail cell
holding the rest of the mass,

    P = (p(i_1), ..., p(i_k), 1 - sum_j p(i_j))

which is an exact distribution over k + 1 outcomes, so every divergence below is a true
divergence of the collapsed distributions (a lower bound of the full-vocabulary one).  The
per-token divergences D_t:

    "forward"  KL(P_T || P_S) = sum_c P_T(c) (log P_T(c) - log P_S(c))  (mass-covering)
    "reverse"  KL(P_S || P_T)                                            (mode-seeking)
    "jsd"      (KL(P_T || M) + KL(P_S || M)) / 2, M = (P_T + P_S) / 2

and the loss is the masked token mean of w_t D_t (``distribution_loss``), w_t the trust
(and route) weight of the token's row.  Whose k tokens (`teacher.topk_from`): SDPO takes
the student's top-k at update time, which needs the teacher's full logits there; recursa's
default ("teacher") takes the teacher's top-k once, when the teacher scores the rollout, and
the update needs only the student's log-probs at those k ids.  "student" takes the student's
top-k (the bare context) at that same scoring pass, at the step's weights, and reads the
teacher's log-probs at those ids: SDPO's set at the step's first optimizer update, fixed for
the step's later ones (one more scoring pass).  The math here is the same either way; only
the ids differ.

All inputs except the log-probs of ``imitation_loss`` and the student's log-probs of
``topk_divergence`` / ``distribution_loss`` are treated as constants (detached).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from recursa.algorithms.advantages import grpo
from recursa.algorithms.losses import aggregate

__all__ = [
    "SCALES",
    "teacher_shift",
    "trajectory_shift",
    "group_offsets",
    "delta_scale",
    "psi",
    "token_advantages",
    "seed_imitation_weights",
    "imitation_loss",
    "DIVERGENCES",
    "with_tail",
    "topk_divergence",
    "distribution_loss",
    "pass_rate_weights",
    "skill_replay_reward",
    "skill_effect",
    "penalised",
    "skill_rewards",
    "group_normalise",
    "correlation",
]

SCALES: tuple[str, ...] = ("std", "mad", "none")
DIVERGENCES: tuple[str, ...] = ("forward", "reverse", "jsd")
MAD_TO_STD = 1.4826  # 1 / Phi^-1(3/4): MAD * this estimates the std of a normal sample

Count = Union[int, float, torch.Tensor]


def _shape(x: object) -> object:
    """The shape of a tensor, or the type name of anything else (for error messages)."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_tokens(name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate ``x  # (N, L)`` against ``mask  # (N, L)``; return the mask as bool."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a tensor of shape (N, L), got {_shape(x)}")
    if not isinstance(mask, torch.Tensor) or mask.shape != x.shape:
        raise ValueError(f"mask shape {_shape(mask)} must equal {name} shape {tuple(x.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be binary (0/1 or bool), 1 at the action tokens")
    return mask != 0


def _check_rows(name: str, x: torch.Tensor, n: int) -> torch.Tensor:
    """Validate a per-row tensor ``x  # (N,)``; return it as a float tensor."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{name} must be a tensor of shape (N,) = ({n},), got {_shape(x)}")
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _check_binary(name: str, x: torch.Tensor) -> torch.Tensor:
    """Validate a 0/1 or bool tensor; return it as bool."""
    if x.dtype == torch.bool:
        return x
    if not bool(((x == 0) | (x == 1)).all()):
        raise ValueError(f"{name} must be bool or 0/1, got values {x.unique().tolist()}")
    return x != 0


def _masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x where keep, exactly 0 elsewhere (NaN off the mask does not leak)."""
    return torch.where(keep, x, torch.zeros_like(x))


def _median(x: torch.Tensor) -> torch.Tensor:
    """Median of a 1-D tensor, the mean of the two middle values for even sizes.

    (``torch.median`` returns the lower of the two.)
    """
    ordered = x.sort().values
    n = ordered.shape[0]
    return 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])


def teacher_shift(
    logp_teacher: torch.Tensor, logp_student: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Delta = logp_teacher - logp_student on action tokens, 0 elsewhere.  (N, L)

    logp_teacher  # (N, L) log pi_old(a_t | context + skill), aligned on the action tokens
    logp_student  # (N, L) log pi_old(a_t | context)
    mask          # (N, L) 1 at action tokens
    Returned detached: Delta is a constant (an advantage), not a path for gradients.
    """
    keep = _check_tokens("logp_teacher", logp_teacher, mask)
    if logp_student.shape != logp_teacher.shape:
        raise ValueError(
            f"logp_student shape {tuple(logp_student.shape)} must equal logp_teacher shape "
            f"{tuple(logp_teacher.shape)}; align both on the same action tokens"
        )
    delta = logp_teacher.detach() - logp_student.detach()  # (N, L)
    return _masked(delta, keep)


def trajectory_shift(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean Delta over each row's action tokens, 0 for rows without any.  (N, L) -> (N,)"""
    keep = _check_tokens("delta", delta, mask)
    total = _masked(delta, keep).sum(dim=-1)  # (N,)
    count = keep.sum(dim=-1).clamp_min(1).to(total.dtype)  # (N,)
    return total / count


def group_offsets(mean_delta: torch.Tensor, hinted: torch.Tensor, group_size: int) -> torch.Tensor:
    """The teacher's offset in each group, per attempt.  (A,) -> (A,)

    mean_delta  # (A,) mean Delta of each attempt, attempts in groups of `group_size` (B x G order)
    hinted      # (A,) True where the attempt had a teacher hint
    Returns, for every attempt, the mean of `mean_delta` over the hinted attempts of its
    group (0 for a group without any). Inserting text into a context shifts the
    log-probability of every action by a roughly common amount (usually down); the outcome
    advantage is relative to the group, so the teacher's verdict is made relative to its
    group too by subtracting this offset (`teacher.center = "group"`).
    """
    if mean_delta.dim() != 1 or hinted.shape != mean_delta.shape:
        raise ValueError(f"mean_delta and hinted must both have shape (A,), got {_shape(mean_delta)} and {_shape(hinted)}")
    if group_size < 1 or mean_delta.numel() % group_size:
        raise ValueError(f"{mean_delta.numel()} attempts do not split into groups of {group_size}")
    values = mean_delta.reshape(-1, group_size)  # (B, G)
    weight = hinted.reshape(-1, group_size).to(values.dtype)  # (B, G)
    offset = (values * weight).sum(dim=1) / weight.sum(dim=1).clamp_min(1)  # (B,)
    return offset.repeat_interleave(group_size)  # (A,)


def delta_scale(
    delta: torch.Tensor, mask: torch.Tensor, scale: str = "std", eps: float = 1e-6
) -> torch.Tensor:
    """Batch scale of Delta over the masked tokens, floored at eps (see module doc).  -> ()

    "std": unbiased std; "mad": 1.4826 * median absolute deviation; "none": 1.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid choices are {list(SCALES)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it floors the scale we divide by), got {eps}")
    keep = _check_tokens("delta", delta, mask)
    dtype = delta.dtype if delta.is_floating_point() else torch.get_default_dtype()
    if scale == "none":
        return torch.ones((), dtype=dtype, device=delta.device)
    values = delta[keep].to(dtype)  # (M,) the masked tokens
    if values.numel() < 2:
        spread = torch.zeros((), dtype=dtype, device=delta.device)
    elif scale == "std":
        spread = values.std(correction=1)
    else:
        spread = MAD_TO_STD * _median((values - _median(values)).abs())
    return spread.clamp_min(eps)


def psi(
    delta: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 3.0,
    scale: str = "std",
    negative_scale: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Scale-normalised, clipped Delta with optionally softened negatives.  (N, L) -> (N, L)

    psi_t = clip(Delta_t / scale, -clip, clip), then negative values * negative_scale;
    0 off the mask.  The scale comes from ``delta_scale`` over this call's masked tokens.
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}; typical values 2-5 (in scale units)")
    if not negative_scale >= 0:
        raise ValueError(
            f"negative_scale must be >= 0 (1 keeps the teacher's rejections, 0 drops them), "
            f"got {negative_scale}"
        )
    keep = _check_tokens("delta", delta, mask)
    normalised = delta / delta_scale(delta, keep, scale, eps)  # (N, L)
    clipped = normalised.clamp(-clip, clip)  # (N, L)
    softened = torch.where(clipped < 0, clipped * negative_scale, clipped)  # (N, L)
    return _masked(softened, keep)


def token_advantages(
    outcome_adv: torch.Tensor,
    psi_values: torch.Tensor,
    trust: torch.Tensor,
    lam: float,
    mask: torch.Tensor,
    route: Optional[str] = None,
    success: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A_t = A_outcome + lam * T * psi_t on action tokens, 0 elsewhere.  -> (N, L), shares

    outcome_adv  # (N,) outcome advantage of each trajectory (grpo, rloo, ...)
    psi_values   # (N, L) psi(Delta), see ``psi``
    trust        # (N,) trust T_g in [0, 1] of each row's skill group
    mask         # (N, L) 1 at action tokens
    route        None: teacher term on every row; "failed": only on rows whose
                 ``success  # (N,)`` is False (SRPO routing)
    Shares (python floats, over the action tokens, 0.0 when there are none):
    outcome_abs = mean |A_outcome|, teacher_abs = mean |lam T psi| (0 on routed-out rows),
    teacher_share = teacher_abs / (outcome_abs + teacher_abs), 0.0 when both are 0.
    """
    keep = _check_tokens("psi_values", psi_values, mask)
    n = psi_values.shape[0]
    outcome_adv = _check_rows("outcome_adv", outcome_adv, n).detach()
    trust = _check_rows("trust", trust, n).detach()
    if not bool(((trust >= 0) & (trust <= 1)).all()):
        raise ValueError(f"trust must lie in [0, 1], got {trust.tolist()}")
    if not lam >= 0:
        raise ValueError(f"lam must be >= 0 (the weight of the teacher term), got {lam}")
    if route not in (None, "failed"):
        raise ValueError(f"unknown route {route!r}; valid choices are None and 'failed'")
    teacher_weight = lam * trust  # (N,)
    if route == "failed":
        if success is None:
            raise ValueError("route='failed' needs success=..., a (N,) bool tensor per row")
        if not isinstance(success, torch.Tensor) or success.shape != (n,):
            raise ValueError(
                f"success must be a bool tensor of shape (N,) = ({n},), got {_shape(success)}"
            )
        success = _check_binary("success", success)
        teacher_weight = torch.where(success, torch.zeros_like(teacher_weight), teacher_weight)

    outcome_part = _masked(outcome_adv.unsqueeze(-1).expand_as(psi_values), keep)  # (N, L)
    teacher_part = _masked(teacher_weight.unsqueeze(-1) * psi_values.detach(), keep)  # (N, L)
    advantages = outcome_part + teacher_part  # (N, L)

    count = keep.sum().clamp_min(1).to(advantages.dtype)
    outcome_abs, teacher_abs = (
        torch.stack([outcome_part.abs().sum(), teacher_part.abs().sum()]) / count
    ).tolist()
    total = outcome_abs + teacher_abs
    shares = {
        "outcome_abs": outcome_abs,
        "teacher_abs": teacher_abs,
        "teacher_share": teacher_abs / total if total > 0 else 0.0,
    }
    return advantages, shares


def seed_imitation_weights(
    delta: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Gate w_t = sigmoid(Delta_t / temperature) on action tokens, 0 elsewhere.  (N, L)

    The weight of the imitation term -w_t * log pi(a_t) (see ``imitation_loss``):
    Delta = 0 gives 1/2, endorsed tokens more, rejected tokens less.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    keep = _check_tokens("delta", delta, mask)
    return _masked(torch.sigmoid(delta.detach() / temperature), keep)


def imitation_loss(
    logp: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: Optional[Count] = None,
) -> torch.Tensor:
    """Masked token mean of -w_t * log pi(a_t).  -> ()

    logp     # (N, L) log-probs of the sampled tokens under the current policy (grad flows)
    weights  # (N, L) e.g. ``seed_imitation_weights`` (detached)
    mask     # (N, L) 1 at action tokens
    num_tokens: the masked-token count of the whole batch, for micro-batches that must add
    up to the full-batch loss (as in ``losses.aggregate``); default: this call's count.
    """
    keep = _check_tokens("logp", logp, mask)
    if weights.shape != logp.shape:
        raise ValueError(
            f"weights shape {tuple(weights.shape)} must equal logp shape {tuple(logp.shape)}"
        )
    return aggregate(-weights.detach() * logp, keep, "token-mean", num_tokens=num_tokens)


def with_tail(logp_k: torch.Tensor) -> torch.Tensor:
    """Log-probs of k tokens -> the log-probs of k + 1 cells: the k tokens and the tail, the
    rest of the distribution's mass, log(1 - sum_j p_j).  (..., k) -> (..., k + 1)

    The tail is floored at log(1 - exp(-1e-7)) (about -16.1): k tokens that hold all the mass
    up to rounding still leave a finite tail (and a finite gradient)."""
    covered = torch.logsumexp(logp_k, dim=-1, keepdim=True).clamp(max=-1e-7)  # log sum_j p_j < 0
    return torch.cat([logp_k, torch.log(-torch.expm1(covered))], dim=-1)


def _kl_cells(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis of cell log-probs."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def topk_divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str = "jsd") -> torch.Tensor:
    """Per-position divergence between student and teacher collapsed onto k tokens (the teacher's
    top-k, or the student's: `teacher.topk_from`) plus a tail cell (see the module docstring).
    (N, L, k), (N, L, k) -> (N, L)

    student  # (N, L, k) log pi_student(i_j) at the k ids (grad flows)
    teacher  # (N, L, k) log pi_teacher(i_j) at the same ids (detached)
    kind: "forward" KL(T || S), "reverse" KL(S || T), "jsd" the Jensen-Shannon divergence.
    Positions off the action tokens may hold anything finite (the loss masks them)."""
    if kind not in DIVERGENCES:
        raise ValueError(f"kind must be one of {DIVERGENCES}, got {kind!r}")
    if not isinstance(student, torch.Tensor) or student.dim() != 3 or not isinstance(teacher, torch.Tensor) or teacher.shape != student.shape:
        raise ValueError(f"student and teacher must be tensors of one shape (N, L, k), got {_shape(student)} and {_shape(teacher)}")
    s, t = with_tail(student), with_tail(teacher.detach())
    if kind == "forward":
        return _kl_cells(t, s)
    if kind == "reverse":
        return _kl_cells(s, t)
    m = torch.logaddexp(s, t) - math.log(2.0)  # log of the mixture (P_S + P_T) / 2
    return 0.5 * (_kl_cells(t, m) + _kl_cells(s, m))


def distribution_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "jsd",
    num_tokens: Optional[Count] = None,
) -> torch.Tensor:
    """Masked token mean of w_t * D_t, D_t = ``topk_divergence``.  -> ()

    student, teacher  # (N, L, k) as in ``topk_divergence``
    weights           # (N, L) the weight of each token's term (detached), e.g. the row's trust
    mask              # (N, L) 1 at action tokens
    num_tokens: the masked-token count of the whole batch (micro-batches add up to the
    full-batch loss, as in ``imitation_loss``); default: this call's count."""
    keep = _check_tokens("weights", weights, mask)
    if student.dim() != 3 or student.shape[:2] != weights.shape:
        raise ValueError(f"student shape {_shape(student)} must be (N, L, k) with (N, L) = {tuple(weights.shape)}")
    # off the action tokens the cells may be anything (0-filled padding): make them a uniform,
    # finite distribution there, so no NaN reaches the gradient through the masked positions
    uniform = -math.log(student.shape[-1] + 1)
    div = topk_divergence(torch.where(keep[..., None], student, uniform), torch.where(keep[..., None], teacher, uniform), kind)
    return aggregate(weights.detach() * div, keep, "token-mean", num_tokens=num_tokens)


def pass_rate_weights(success: torch.Tensor) -> torch.Tensor:
    """SC-SDPO weight sqrt(p (1 - p)), p = the group's pass rate.  (B, G) -> (B, G)

    success  # (B, G) bool or 0/1, B groups of G trajectories.  All-pass and all-fail
    groups get exactly 0; p = 1/2 gives the maximum 1/2.
    """
    if not isinstance(success, torch.Tensor) or success.dim() != 2:
        raise ValueError(f"success must be a tensor of shape (B, G), got {_shape(success)}")
    passed = _check_binary("success", success).to(torch.get_default_dtype())  # (B, G)
    p = passed.mean(dim=-1, keepdim=True)  # (B, 1)
    return torch.sqrt(p * (1.0 - p)).expand_as(passed)


def skill_replay_reward(
    delta_means: torch.Tensor, outcomes: torch.Tensor, clip: float
) -> torch.Tensor:
    """r(s) = mean_i y_i * clip(D_i, -clip, clip) over M replayed trajectories.  -> ()

    delta_means  # (M,) mean Delta of each replayed trajectory under the skill
    outcomes     # (M,) y_i = +1 (success) or -1 (failure)
    """
    if not isinstance(delta_means, torch.Tensor) or delta_means.dim() != 1:
        raise ValueError("delta_means must be a tensor of shape (M,), one per replayed trajectory")
    m = delta_means.shape[0]
    if m == 0:
        raise ValueError(
            "a skill with no replayed trajectories has no replay reward; "
            "replay it on at least one trajectory or mark it invalid"
        )
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    delta_means = _check_rows("delta_means", delta_means, m)
    if not bool(torch.isfinite(delta_means).all()):
        raise ValueError("delta_means contain NaN or inf")
    outcomes = _check_rows("outcomes", outcomes, m)
    if not bool(((outcomes == 1) | (outcomes == -1)).all()):
        raise ValueError(f"outcomes must be +1 or -1, got {outcomes.unique().tolist()}")
    return (outcomes * delta_means.clamp(-clip, clip)).mean()


def skill_effect(rewards: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """e(s) = (1/M) sum_m (R_m - b_m): a skill's effect, the mean change in reward it caused
    when shown in the prompt of M games, R_m the reward of the episode played with it and b_m
    the game's mean reward without it (its group's, the same step).  (M,), (M,) -> ()"""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.shape[0] == 0:
        raise ValueError(f"rewards must be a tensor of shape (M,) with M >= 1 (one per game played with the skill), got {_shape(rewards)}")
    baselines = _check_rows("baselines", baselines, rewards.shape[0])
    if not bool(torch.isfinite(rewards).all() and torch.isfinite(baselines).all()):
        raise ValueError("rewards and baselines must be finite")
    return (rewards - baselines).mean()


def penalised(raw: Sequence[float], lengths: Sequence[int], invalid: Sequence[bool], max_len: int, length_penalty: float,
              invalid_reward: float = -1.0) -> torch.Tensor:
    """Candidate rewards with the penalties: raw_k - length_penalty * max(0, lengths[k] -
    max_len) if valid, invalid_reward if invalid (raw_k is then ignored).  -> (K,)"""
    k = len(raw)
    if not (len(lengths) == len(invalid) == k):
        raise ValueError(f"raw, lengths and invalid need one entry per candidate; got {k}, {len(lengths)}, {len(invalid)}")
    if not length_penalty >= 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    if not max_len > 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    out = [float(invalid_reward) if bad else float(r) - length_penalty * max(0, n - max_len) for r, n, bad in zip(raw, lengths, invalid)]
    return torch.tensor(out, dtype=torch.get_default_dtype(), device="cpu")  # Python floats: a host statistic


def skill_rewards(
    delta_means: Sequence[torch.Tensor],
    outcomes: Sequence[torch.Tensor],
    lengths: Sequence[int],
    invalid: Sequence[bool],
    clip: float,
    max_len: int,
    length_penalty: float,
    invalid_reward: float = -1.0,
) -> torch.Tensor:
    """Reward of each of K candidate skills, penalties included.  -> (K,)

    delta_means[k]  # (M_k,), outcomes[k]  # (M_k,): candidate k's replays (see
                    ``skill_replay_reward``); ignored (may be empty) for invalid ones
    lengths[k]      candidate k's length, in the unit of max_len (tokens or characters)
    invalid[k]      True if the candidate could not be parsed / used
    reward_k = r(s_k) - length_penalty * max(0, lengths[k] - max_len)   if valid
             = invalid_reward (a fixed value, e.g. -1)                  if invalid
    """
    k = len(lengths)
    if not (len(delta_means) == len(outcomes) == len(invalid) == k):
        raise ValueError(
            f"delta_means, outcomes, lengths and invalid need one entry per candidate; got "
            f"{len(delta_means)}, {len(outcomes)}, {k}, {len(invalid)}"
        )
    raw = [0.0 if invalid[j] else skill_replay_reward(delta_means[j], outcomes[j], clip).item() for j in range(k)]
    return penalised(raw, lengths, invalid, max_len, length_penalty, invalid_reward)


def group_normalise(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (unbiased std + eps) within one group of K candidates.  (K,) -> (K,)

    The ``grpo`` advantage of one group: exactly 0 for a zero-variance group or K = 1.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a tensor of shape (K,), got {_shape(rewards)}")
    return grpo(rewards.unsqueeze(0), eps=eps)[0]


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of x and y (same shape), ignoring pairs where either is NaN.

    nan when undefined: fewer than 2 pairs, or either side has zero variance.
    Computed in float64; e.g. corr(trajectory_shift, outcome advantage) for logging.
    """
    x = torch.as_tensor(x, device="cpu").detach().to(torch.float64).flatten()  # a statistic: on the host,
    y = torch.as_tensor(y, device="cpu").detach().to(torch.float64).flatten()  # whatever device x and y are on
    if x.shape != y.shape:
        raise ValueError(
            f"x and y must have the same number of values, got {x.numel()} and {y.numel()}"
        )
    both = ~(torch.isnan(x) | torch.isnan(y))
    x, y = x[both], y[both]
    if x.numel() < 2:
        return math.nan
    if x.max() == x.min() or y.max() == y.min():
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    denom = torch.sqrt((dx * dx).sum() * (dy * dy).sum())
    return (dx * dy).sum().div(denom).clamp(-1.0, 1.0).item()
