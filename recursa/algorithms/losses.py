"""Token-level policy-gradient losses: PPO clipped surrogate, KL estimates, aggregation.

Shapes: B sequences (completions), T token positions.  ``mask  # (B, T)`` is 1
(or True) at the tokens the policy produced and should be trained on, 0 at the
prompt, padding, and tool / environment tokens.  The mask is treated as binary.

Clipped surrogate (Schulman et al. 2017), per token, with ratio rho = exp(logp - logp_old):

    l = -min( rho * A,  clip(rho, 1 - eps_low, 1 + eps_high) * A )

eps_low != eps_high gives the asymmetric "clip-higher" of DAPO (Yu et al. 2025).
The clip is active -- and the token's gradient is zero -- when A > 0 and
rho > 1 + eps_high, or A < 0 and rho < 1 - eps_low.  Exactly on the boundary
the clip is not active and the gradient is the unclipped one.

Dual clip (Ye et al. 2020, as in verl): for A < 0 the loss is additionally
capped at -c * A (c > 1), i.e. the objective becomes max(min(...), c * A).
Without it a token with A < 0 and a huge ratio contributes an unbounded loss.
The cap is active exactly when A < 0 and rho > c.

KL penalty to a reference policy (added per token before aggregation):
    l += kl_coef * k(logp, logp_ref)
with the estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020,
"Approximating KL divergence"), d = logp_ref - logp:
    k1 = -d = logp - logp_ref            (unbiased, can be negative)
    k3 = exp(d) - d - 1                  (unbiased, always >= 0, lower variance)
k3 is computed as expm1(d) - d for accuracy near d = 0.  Departure from verl's
"low_var_kl": we do not clamp d or the result to a range.

Aggregation of a per-token matrix ``values  # (B, T)`` into a scalar
(names follow verl's ``loss_agg_mode``):
    token-mean               sum_{b,t} m_bt v_bt / N_tok
    seq-mean-token-mean      (1 / N_seq) sum_b [ sum_t m_bt v_bt / sum_t m_bt ]
    seq-mean-token-sum-norm  (1 / N_seq) sum_b [ sum_t m_bt v_bt / L ]
N_tok defaults to the number of masked tokens in this call and N_seq to B, but
both may be passed as the counts over the *whole* batch; then the losses of
micro-batches add up to the full-batch loss (and so do their gradients), which
is what gradient accumulation needs.  L (``norm_len``) is a constant such as
the maximum completion length (Dr. GRPO); departure from verl: it is required,
we do not default it to the padded width T, which changes with batching.
A sequence with no masked tokens contributes 0 in every mode; a call with no
masked tokens at all returns a zero loss that is still attached to the graph.

Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training", as in verl and TRL). When a separate engine samples the
rollout, its log-probs logp_engine differ from the trainer's logp_old at the same weights
(other kernels, other precision), so the samples come from a slightly different policy. Each
token's clipped surrogate is then weighted by

    w = min( exp(logp_old - logp_engine), C )

(``truncated_is_weights``; ``ppo_clip_loss(token_weights=w)``), the KL term is not. C = None
is off (w = 1, exactly the loss without the option).

Entropy bonus (``entropy_bonus``; as verl's ``entropy_coeff``): the policy's entropy H_t at each
action position, aggregated like the policy loss, is subtracted from it,

    loss -= entropy_coef * agg(H)

so the gradient raises the entropy of the next-token distribution where the policy acts.
Aggregated with the same counts, micro-batches add up to the full batch's bonus.

``logp_old``, ``advantages``, ``logp_ref`` and ``token_weights`` are treated as constants (detached).

The log-ratio logp - logp_old is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20]
before the exponential (as in verl): exp(20) ~ 4.9e8 is far past any clip, so the loss of a
token inside the range is unchanged, and a token outside it gets a finite loss and a zero
gradient instead of inf / NaN.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "aggregate",
    "entropy_bonus",
    "masked_mean",
    "kl_estimate",
    "ppo_clip_loss",
    "truncated_is_weights",
    "entropy_from_logits",
    "part_scales",
]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")
LOG_RATIO_CLAMP = 20.0  # |logp - logp_old| is clamped to this before exp (see the module doc)

Count = Union[int, float, torch.Tensor]


def _check_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate ``values`` and ``mask`` (both (B, T)); return the mask as a bool tensor."""
    if values.dim() != 2:
        raise ValueError(f"expected values of shape (B, T), got shape {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal values shape {tuple(values.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            "mask must be binary (0/1 or bool); per-token weights are not supported, "
            "multiply them into the values instead"
        )
    return mask != 0


def _check_positive(name: str, value: Optional[Count]) -> None:
    if value is not None and not isinstance(value, torch.Tensor) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero; 0 if there are none.

    x, mask: same shape (any).  Returns a 0-dim tensor.  Values of ``x`` outside
    the mask are never read (so NaN/inf there do not propagate).
    """
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal x shape {tuple(x.shape)}")
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x)).sum()
    count = keep.sum().clamp_min(1).to(total.dtype)
    return total / count


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    norm_len: Optional[Count] = None,
) -> torch.Tensor:
    """Reduce per-token ``values  # (B, T)`` under ``mask  # (B, T)`` to a scalar (see module doc)."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid choices are {list(AGG_MODES)}")
    keep = _check_mask(values, mask)  # (B, T) bool
    _check_positive("num_tokens", num_tokens)
    _check_positive("num_seqs", num_seqs)
    _check_positive("norm_len", norm_len)
    masked = torch.where(keep, values, torch.zeros_like(values))  # (B, T)

    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = keep.sum().clamp_min(1).to(values.dtype)
        return masked.sum() / num_tokens

    if num_seqs is None:
        num_seqs = values.shape[0]
    seq_sum = masked.sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-mean":
        seq_len = keep.sum(dim=-1).clamp_min(1).to(values.dtype)  # (B,)
        return (seq_sum / seq_len).sum() / num_seqs

    # seq-mean-token-sum-norm
    if norm_len is None:
        raise ValueError(
            "mode 'seq-mean-token-sum-norm' needs norm_len, a constant such as the maximum "
            "completion length (Dr. GRPO); pass norm_len=..."
        )
    return (seq_sum / norm_len).sum() / num_seqs


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.  (B, T) -> (B, T)

    k1 = logp - logp_ref;  k3 = exp(d) - d - 1 with d = logp_ref - logp (always >= 0).
    """
    if logp.shape != logp_ref.shape:
        raise ValueError(
            f"logp shape {tuple(logp.shape)} must equal logp_ref shape {tuple(logp_ref.shape)}"
        )
    if estimator == "k1":
        return logp - logp_ref
    if estimator == "k3":
        d = logp_ref - logp  # (B, T)
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; valid choices are {list(KL_ESTIMATORS)}")


def truncated_is_weights(logp_old: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token truncated importance weights min(exp(logp_old - logp_engine), cap) at the masked
    tokens, 1 elsewhere.  (B, T), (B, T), (B, T) -> (B, T), detached.

    logp_old    # (B, T) the trainer's log-probs of the sampled tokens at the rollout's weights
    logp_engine # (B, T) the sampling engine's log-probs of the same tokens
    """
    if not cap > 0:
        raise ValueError(f"the truncation cap must be > 0, got {cap}; typical value 2.0")
    if logp_old.shape != logp_engine.shape:
        raise ValueError(f"logp_old shape {tuple(logp_old.shape)} must equal logp_engine shape {tuple(logp_engine.shape)}")
    keep = _check_mask(logp_old, mask)
    if bool((keep & (torch.isnan(logp_old) | torch.isnan(logp_engine))).any()):
        raise ValueError("logp_old and logp_engine must not be NaN at masked tokens (a NaN weight would reach the loss)")
    w = torch.exp(logp_old.detach() - logp_engine.detach()).clamp(max=cap)  # (B, T)
    return torch.where(keep, w, torch.ones_like(w))


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
    agg: str = "token-mean",
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    norm_len: Optional[Count] = None,
    logp_ref: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss with optional dual clip and KL penalty (see module doc).

    logp        # (B, T) log-probs of the sampled tokens under the current policy (grad flows)
    logp_old    # (B, T) log-probs under the behaviour policy (detached)
    advantages  # (B,) per sequence, broadcast over tokens, or (B, T) per token (detached)
    mask        # (B, T) 1 at trained tokens
    logp_ref    # (B, T) log-probs under the reference policy, optional (detached)
    token_weights  # (B, T) multiplies each token's clipped surrogate, not the KL term (e.g.
                   # `truncated_is_weights`), optional (detached)

    Returns (loss, stats); stats are python floats over the masked tokens of this call
    (0.0 when there are none): clip_frac, dual_clip_frac, ratio_mean, ratio_max,
    kl (mean KL estimate, 0.0 without logp_ref), approx_kl_old (mean 0.5 (logp - logp_old)^2).
    """
    if not 0.0 < clip_low < 1.0:
        raise ValueError(
            f"clip_low must be in (0, 1) so that the lower bound 1 - clip_low is a positive "
            f"ratio, got {clip_low}; typical value 0.2"
        )
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}; typical values 0.2-0.28")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(
            f"dual_clip must be None (off) or a constant > 1, got {dual_clip}; typical value 3.0"
        )
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0.0 and logp_ref is None:
        raise ValueError(
            f"kl_coef={kl_coef} > 0 needs the reference log-probs: pass logp_ref=..., "
            "or set kl_coef=0.0"
        )
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {kl_estimator!r}; valid choices are {list(KL_ESTIMATORS)}"
        )
    if logp_old.shape != logp.shape:
        raise ValueError(
            f"logp_old shape {tuple(logp_old.shape)} must equal logp shape {tuple(logp.shape)}"
        )
    keep = _check_mask(logp, mask)  # (B, T) bool

    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1 and adv.shape[0] == logp.shape[0]:
        adv = adv.unsqueeze(-1).expand_as(logp)  # (B, T)
    elif adv.shape != logp.shape:
        raise ValueError(
            f"advantages must have shape (B,) = ({logp.shape[0]},) or (B, T) = "
            f"{tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )

    # Clamped before the exponential (as verl does): a log-ratio past +-20 would give inf and
    # NaN gradients even on tokens the clip discards. Inside the range nothing changes.
    log_ratio = torch.clamp(logp - logp_old.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    surr_unclipped = ratio * adv  # (B, T)
    surr_clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv  # (B, T)
    per_token = -torch.minimum(surr_unclipped, surr_clipped)  # (B, T)

    neg_adv = adv < 0  # (B, T)
    if dual_clip is not None:
        cap = -dual_clip * adv  # (B, T), positive where adv < 0
        # Strictly past the cap only: at ratio == dual_clip the surrogate keeps its full gradient
        # (torch.minimum would split it in half between the two equal arguments; issue 50).
        per_token = torch.where(neg_adv & (per_token > cap), cap, per_token)
        dual_clipped = neg_adv & (ratio > dual_clip)  # (B, T)
    else:
        dual_clipped = torch.zeros_like(keep)
    if token_weights is not None:
        if token_weights.shape != logp.shape:
            raise ValueError(f"token_weights shape {tuple(token_weights.shape)} must equal logp shape {tuple(logp.shape)}")
        per_token = per_token * token_weights.detach().to(per_token.dtype)

    if logp_ref is not None:
        kl = kl_estimate(logp, logp_ref.detach(), kl_estimator)  # (B, T)
        if kl_coef > 0.0:
            per_token = per_token + kl_coef * kl
    else:
        kl = None

    loss = aggregate(
        per_token, keep, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len
    )

    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | (neg_adv & (ratio < 1.0 - clip_low))
        ratio_max = torch.where(keep, ratio, torch.full_like(ratio, -torch.inf)).amax()
        ratio_max = torch.where(keep.any(), ratio_max, torch.zeros_like(ratio_max))
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        stat_values = torch.stack(
            [
                masked_mean(clipped.to(ratio.dtype), keep),
                masked_mean(dual_clipped.to(ratio.dtype), keep),
                masked_mean(ratio, keep),
                ratio_max,
                masked_mean(kl, keep) if kl is not None else zero,
                masked_mean(0.5 * log_ratio.square(), keep),
            ]
        ).tolist()  # one device sync for all stats
    names = ("clip_frac", "dual_clip_frac", "ratio_mean", "ratio_max", "kl", "approx_kl_old")
    return loss, dict(zip(names, stat_values))


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    mode: str,
    *,
    num_tokens: Optional[Count] = None,
    num_seqs: Optional[Count] = None,
    norm_len: Optional[Count] = None,
) -> torch.Tensor:
    """The loss term -coef * agg(entropy) for per-token entropies ``entropy  # (B, T)`` (attached
    to the graph) under ``mask  # (B, T)``, aggregated as ``aggregate`` does with the same counts."""
    return -coef * aggregate(entropy, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim.  (..., V) -> (...)

    H = -sum_v p_v log p_v with log p = log_softmax(logits).  Terms with p_v = 0
    (e.g. logits of -inf) count as 0, so the value and its gradient stay finite.
    Computed in the dtype of ``logits``; cast to float32 first for bf16 logits.
    """
    logp = torch.log_softmax(logits, dim=-1)  # (..., V)
    p = logp.exp()  # (..., V)
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(dim=-1)


def part_scales(mask: torch.Tensor, sizes: list[int], mode: str) -> list[float]:
    """Factors that turn one aggregation over all rows into a sum of aggregations, one per
    block of rows.  ``mask  # (N, T)``; the blocks are consecutive, of ``sizes`` rows
    (summing to N).  Multiplying block j's advantages by factor j makes
    ``aggregate(all rows)`` equal the sum over blocks of ``aggregate(block j)``, because
    the per-token loss is linear in the advantage: token-mean divides by tokens, so
    factor j = all tokens / block j's tokens; the seq-mean modes divide by rows, so
    factor j = N / block j's rows.  With fewer than two non-empty blocks every factor is
    1.0; an empty block (or one without tokens, under token-mean) gets 0.0.  Exact for one
    mini-batch per epoch; with more, each mini-batch is split in the batch's proportions.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid choices are {list(AGG_MODES)}")
    if sum(sizes) != mask.shape[0] or any(s < 0 for s in sizes):
        raise ValueError(f"block sizes {sizes} must be >= 0 and sum to the {mask.shape[0]} rows")
    bounds, lo = [], 0
    for s in sizes:
        bounds.append((lo, lo + s))
        lo += s
    if sum(s > 0 for s in sizes) < 2:
        return [1.0] * len(sizes)
    if mode == "token-mean":
        counts = [float(mask[a:b].sum()) for a, b in bounds]
    else:
        counts = [float(b - a) for a, b in bounds]
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    return [total / c if c > 0 else 0.0 for c in counts]
