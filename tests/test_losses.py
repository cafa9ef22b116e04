"""Hand-worked checks of the PPO clipped loss, KL estimators and aggregation modes."""

import math

import pytest
import torch

from recursa.algorithms.losses import (
    AGG_MODES,
    aggregate,
    entropy_from_logits,
    kl_estimate,
    masked_mean,
    ppo_clip_loss,
)

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, atol=1e-9):
    if not isinstance(actual, torch.Tensor):
        actual = torch.tensor(actual, dtype=F64)
    expected = torch.as_tensor(expected, dtype=F64).to(actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


def ppo_on_ratios(ratios, advantages, **kwargs):
    """Run ppo_clip_loss on one row with logp_old = 0, logp = log(ratio); return loss, grad, stats."""
    logp = torch.log(t([ratios])).requires_grad_(True)  # (1, T)
    logp_old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, stats = ppo_clip_loss(logp, logp_old, t([advantages]), mask, **kwargs)
    loss.backward()
    return loss, logp.grad[0], stats


# ---------------------------------------------------------------- aggregation

# values (nan where masked out: must never leak)      mask
#   [ 1,   2,   3, nan]                                [1, 1, 1, 0]   3 tokens, sum 6
#   [ 5, nan, nan, nan]                                [1, 0, 0, 0]   1 token,  sum 5
#   [nan, nan, nan, nan]                               [0, 0, 0, 0]   empty
NAN = math.nan
VALUES = t([[1.0, 2.0, 3.0, NAN], [5.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
MASK = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_aggregate_token_mean():
    close(aggregate(VALUES, MASK, "token-mean"), 11 / 4)  # (1+2+3+5) / 4 tokens
    close(aggregate(VALUES, MASK, "token-mean", num_tokens=8), 11 / 8)
    close(aggregate(VALUES, MASK.bool(), "token-mean"), 11 / 4)  # bool mask works the same


def test_aggregate_seq_mean_token_mean():
    # per-sequence means 6/3 = 2, 5/1 = 5, empty -> 0;  (2 + 5 + 0) / 3 sequences
    close(aggregate(VALUES, MASK, "seq-mean-token-mean"), 7 / 3)
    close(aggregate(VALUES, MASK, "seq-mean-token-mean", num_seqs=5), 7 / 5)


def test_aggregate_seq_mean_token_sum_norm():
    # per-sequence sums / 4: 6/4 = 1.5, 5/4 = 1.25, 0;  (1.5 + 1.25) / 3 = 0.9166666667
    close(aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_len=4), 0.9166666667)
    # norm_len 10, num_seqs 2: (0.6 + 0.5) / 2 = 0.55
    close(aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_len=10, num_seqs=2), 0.55)


def test_aggregate_empty_mask_is_zero_and_differentiable():
    v = torch.ones(2, 3, dtype=F64, requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate(v, torch.zeros(2, 3), mode, norm_len=3)
        assert out.item() == 0.0
        out.backward()
    assert torch.equal(v.grad, torch.zeros(2, 3, dtype=F64))


def test_aggregate_bad_arguments():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-mean.*seq-mean-token-sum-norm"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="binary"):
        aggregate(VALUES, MASK * 0.5, "token-mean")
    with pytest.raises(ValueError, match="shape"):
        aggregate(VALUES, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(VALUES, MASK, "token-mean", num_tokens=0)


def test_masked_mean():
    close(masked_mean(t([1.0, 2.0, NAN]), t([1, 1, 0])), 1.5)
    close(masked_mean(t([1.0, 2.0]), t([0, 0])), 0.0)


# ------------------------------------------------------------- clipping

def test_clip_boundaries_both_signs():
    # Exact boundaries: take the ratios exp(log 1.2) and exp(log 0.8) as float64
    # computes them and set the clip range to hit them exactly.
    hi = torch.exp(torch.log(t(1.2))).item()
    lo = torch.exp(torch.log(t(0.8))).item()
    d = 1e-3
    #            A   ratio     per-token loss            d loss / d logp (x 8 tokens)
    cases = [
        (+1, hi),        # -1.2     boundary, unclipped      -1.2
        (+1, hi + d),    # -1.2     clipped                    0
        (+1, hi - d),    # -1.199   inside                   -1.199
        (-1, lo),        # +0.8     boundary, unclipped      +0.8
        (-1, lo - d),    # +0.8     clipped                    0
        (-1, lo + d),    # +0.801   inside                   +0.801
        (+1, 0.5),       # -0.5     below range but A>0: unclipped  -0.5
        (-1, 1.5),       # +1.5     above range but A<0: unclipped  +1.5
    ]
    adv = [a for a, _ in cases]
    ratios = [r for _, r in cases]
    loss, grad, stats = ppo_on_ratios(ratios, adv, clip_low=1 - lo, clip_high=hi - 1)
    # sum = -1.2 - 1.2 - 1.199 + 0.8 + 0.8 + 0.801 - 0.5 + 1.5 = -0.198;  / 8 = -0.02475
    close(loss, -0.02475)
    close(grad, [-1.2 / 8, 0.0, -1.199 / 8, 0.8 / 8, 0.0, 0.801 / 8, -0.5 / 8, 1.5 / 8])
    assert grad[1] == 0.0 and grad[4] == 0.0  # clipped: exactly no gradient
    assert all(grad[i] != 0.0 for i in (0, 2, 3, 5, 6, 7))
    close(stats["clip_frac"], 2 / 8)
    # ratios sum: 1.2 + 1.201 + 1.199 + 0.8 + 0.799 + 0.801 + 0.5 + 1.5 = 8.0
    close(stats["ratio_mean"], 1.0)
    close(stats["ratio_max"], 1.5)
    assert stats["dual_clip_frac"] == 0.0 and stats["kl"] == 0.0


def test_asymmetric_clip_higher():
    # clip_low 0.2, clip_high 0.28: range [0.8, 1.28]
    #   A=+1 ratio 1.25: inside (would be clipped at 1.2)   loss -1.25, grad -1.25
    #   A=+1 ratio 1.30: clipped at 1.28                     loss -1.28, grad 0
    #   A=-1 ratio 0.79: clipped at 0.8                      loss +0.8,  grad 0
    #   A=-1 ratio 0.81: inside                              loss +0.81, grad +0.81
    loss, grad, stats = ppo_on_ratios(
        [1.25, 1.30, 0.79, 0.81], [1.0, 1.0, -1.0, -1.0], clip_low=0.2, clip_high=0.28
    )
    close(loss, (-1.25 - 1.28 + 0.8 + 0.81) / 4)  # = -0.23
    close(grad, [-1.25 / 4, 0.0, 0.0, 0.81 / 4])
    close(stats["clip_frac"], 0.5)
    # the symmetric default clips the first token too
    _, grad_sym, stats_sym = ppo_on_ratios([1.25, 1.30, 0.79, 0.81], [1.0, 1.0, -1.0, -1.0])
    assert grad_sym[0] == 0.0
    close(stats_sym["clip_frac"], 0.75)


def test_dual_clip_caps_negative_advantage_loss():
    # c = 3.  tokens (A, ratio): (-1, 5), (-1, 2), (+1, 5)
    #   without dual clip: [5, 2, -1.2] -> 5.8 / 3 = 1.9333333333
    #   with dual clip:    [min(5, 3) = 3, 2, -1.2] -> 3.8 / 3 = 1.2666666667
    #   grads (with):      [0 (capped), +2/3, 0 (clipped, A>0)]
    ratios, adv = [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0]
    loss_plain, grad_plain, _ = ppo_on_ratios(ratios, adv)
    close(loss_plain, 1.9333333333)
    close(grad_plain, [5 / 3, 2 / 3, 0.0])
    loss, grad, stats = ppo_on_ratios(ratios, adv, dual_clip=3.0)
    close(loss, 1.2666666667)
    close(grad, [0.0, 2 / 3, 0.0])
    close(stats["dual_clip_frac"], 1 / 3)
    close(stats["clip_frac"], 1 / 3)


def test_dual_clip_gradient_at_exactly_the_cap_is_full():
    # Issue 50. One token, A = -1, ratio exactly the cap c = 3 (the cap computed as the ratio
    # the loss will see, so the tie is exact in float64). Dual-clip PPO (Ye et al. 2020) caps
    # only strictly past c: at ratio == c the loss -A ratio = 3 keeps its gradient
    # d(-A e^logp)/dlogp = ratio = 3, not half of it (torch.minimum splits ties 1.5 / 1.5).
    cap = float(torch.exp(torch.log(t(3.0))))
    loss, grad, stats = ppo_on_ratios([cap], [-1.0], dual_clip=cap)
    close(loss, 3.0)
    close(grad, [3.0])
    assert stats["dual_clip_frac"] == 0.0
    # just past the cap: the gradient is 0
    _, grad_past, _ = ppo_on_ratios([cap * (1 + 1e-9)], [-1.0], dual_clip=cap)
    close(grad_past, [0.0])


def test_sequence_advantages_broadcast_and_approx_kl_old():
    # advantages (B,) = [2, -1] broadcast over T = 2 tokens; logp - logp_old = [[0.2, -0.4], [0, 0]]
    logp = t([[0.2, -0.4], [0.0, 0.0]]).requires_grad_(True)
    mask = t([[1, 1], [1, 0]])
    loss, stats = ppo_clip_loss(logp, torch.zeros_like(logp), t([2.0, -1.0]), mask)
    # ratios e^0.2 = 1.2214027582 (A=2 -> clipped at 1.2: -2.4), e^-0.4 = 0.6703200460
    # (A=2, below range, unclipped: -1.3406400921), row 1 token 0: ratio 1, A=-1 -> +1
    # loss = (-2.4 - 1.3406400921 + 1) / 3 = -0.9135466974
    close(loss, -0.9135466974)
    # approx_kl_old = 0.5 * (0.04 + 0.16 + 0) / 3 = 0.0333333333
    close(stats["approx_kl_old"], 0.0333333333)
    close(stats["clip_frac"], 1 / 3)


# ----------------------------------------------------------------- KL

def test_kl_estimators_hand_values():
    logp = t([[-1.0, -2.0, -0.5]])
    logp_ref = t([[-1.5, -1.0, -0.5]])
    # k1 = logp - logp_ref
    close(kl_estimate(logp, logp_ref, "k1"), [[0.5, -1.0, 0.0]])
    # d = logp_ref - logp = [-0.5, 1, 0];  k3 = e^d - d - 1
    #   e^-0.5 + 0.5 - 1 = 0.6065306597 - 0.5 = 0.1065306597;  e - 2 = 0.7182818285;  0
    close(kl_estimate(logp, logp_ref, "k3"), [[0.1065306597, 0.7182818285, 0.0]])


def test_k3_is_nonnegative():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 32, generator=gen) * 3
    logp_ref = logp + torch.randn(64, 32, generator=gen) * torch.logspace(-8, 1, 32)
    assert (kl_estimate(logp, logp_ref, "k3") >= 0).all()
    # k1 on the same samples does go negative
    assert (kl_estimate(logp, logp_ref, "k1") < 0).any()


def test_kl_term_added_to_loss():
    # ratio 1 and A = 0: the policy-gradient part is 0 with 0 gradient
    logp = t([[-1.0, -2.0, -0.5]]).requires_grad_(True)
    logp_ref = t([[-1.5, -1.0, -0.5]])
    mask = torch.ones_like(logp)
    loss, stats = ppo_clip_loss(
        logp, logp.detach(), t([0.0]), mask, logp_ref=logp_ref, kl_coef=0.1
    )
    # k3 sum = 0.1065306597 + 0.7182818285 = 0.8248124882; loss = 0.1 * 0.8248124882 / 3
    close(loss, 0.0274937496)
    close(stats["kl"], 0.2749374961)
    loss.backward()
    # d k3 / d logp = 1 - e^d:  0.1 / 3 * (1 - 0.6065306597) = 0.0131156447,
    #                           0.1 / 3 * (1 - 2.7182818285) = -0.0572760609, 0
    close(logp.grad, [[0.0131156447, -0.0572760609, 0.0]])
    # kl_coef = 0: loss unaffected, KL still reported; k1 reported when asked
    loss0, stats0 = ppo_clip_loss(
        logp, logp.detach(), t([0.0]), mask, logp_ref=logp_ref, kl_estimator="k1"
    )
    assert loss0.item() == 0.0
    close(stats0["kl"], -0.5 / 3)  # (0.5 - 1 + 0) / 3


# ------------------------------------------------ micro-batch additivity

@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_add_up_to_full_batch(mode):
    gen = torch.Generator().manual_seed(3)
    B, T = 4, 5
    logp_init = -torch.rand(B, T, generator=gen, dtype=F64) * 2
    logp_old = logp_init + torch.randn(B, T, generator=gen, dtype=F64) * 0.3
    logp_ref = logp_init + torch.randn(B, T, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(B, generator=gen, dtype=F64)
    # ragged: micro-batch 0 (rows 0-1) has 9 tokens, micro-batch 1 (rows 2-3) has 3
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    kw = dict(agg=mode, norm_len=T, dual_clip=1.3, kl_coef=0.05)

    logp = logp_init.clone().requires_grad_(True)
    full, stats = ppo_clip_loss(logp, logp_old, adv, mask, logp_ref=logp_ref, **kw)
    # the example exercises the clip, the dual clip and the KL term
    assert stats["clip_frac"] > 0 and stats["dual_clip_frac"] > 0 and stats["kl"] > 0
    full.backward()
    grad_full = logp.grad.clone()

    logp.grad = None
    total = torch.zeros((), dtype=F64)
    naive = torch.zeros((), dtype=F64)
    for rows in (slice(0, 2), slice(2, 4)):
        part, _ = ppo_clip_loss(
            logp[rows], logp_old[rows], adv[rows], mask[rows], logp_ref=logp_ref[rows],
            num_tokens=mask.sum(), num_seqs=B, **kw,
        )
        part.backward()
        total = total + part.detach()
        naive = naive + ppo_clip_loss(
            logp[rows].detach(), logp_old[rows], adv[rows], mask[rows], logp_ref=logp_ref[rows], **kw
        )[0]
    close(total, full.detach(), atol=1e-12)
    close(logp.grad, grad_full, atol=1e-12)
    # without the global counts the micro-batch losses do not add up
    assert abs(naive.item() - full.item()) > 1e-3


# ----------------------------------------------------------- entropy

def test_entropy_from_logits():
    # uniform over V = 7: log 7 = 1.9459101491, whatever the constant logit
    close(entropy_from_logits(torch.full((2, 3, 7), 4.2, dtype=F64)), [[1.9459101491] * 3] * 2)
    # p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446
    close(entropy_from_logits(t([0.0, math.log(3.0)])), 0.5623351446)


def test_entropy_with_masked_vocab_is_finite():
    logits = t([[0.0, 0.0, -math.inf]]).requires_grad_(True)
    h = entropy_from_logits(logits)
    close(h, [math.log(2.0)])  # 0.6931471806
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ------------------------------------------------------ bad arguments

@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clip_low=0.0), "clip_low"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=0.0), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(agg="mean"), "token-mean"),
        (dict(kl_coef=0.1), "logp_ref"),
        (dict(kl_estimator="k2"), "k1"),
        (dict(kl_coef=-0.1), "kl_coef"),
    ],
)
def test_ppo_bad_arguments(kwargs, match):
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(logp, logp, torch.zeros(2), torch.ones(2, 3), **kwargs)


def test_ppo_bad_shapes():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(logp, logp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="logp_old"):
        ppo_clip_loss(logp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, logp, "k2")
