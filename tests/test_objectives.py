"""The objectives of `algo.objective` (SPO, GPG, REBEL, NFT, A*-PO) and iGRPO (`algo.igrpo`):
each loss against a hand computation of its value and gradient on small tensors, the update's
gradient against the loss written out on the whole batch, the config rules, and two-step runs
of every switch on the tiny model (a single-turn and a multi-turn toy task)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from recursa.algorithms.advantages import compute_advantages, gpg
from recursa.algorithms.losses import ppo_clip_loss
from recursa.algorithms.objectives import (
    apo_loss, apo_values, nft_loss, pg_loss, ratio_stats, rebel_loss, sequence_sums, sequence_surrogate, sequence_weights, spo_loss,
)
from recursa.config import ModelConfig, load_config
from recursa.errors import UserError
from recursa.generation import sequence_logprobs
from recursa.models import load_policy
from recursa.methods.igrpo import draft_hint, draft_hints
from recursa.recipes.grpo import Outcomes, update

LN = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def _grad(fn, logp):
    """(value, d value / d logp) of fn(logp)."""
    x = logp.clone().requires_grad_(True)
    value = fn(x)
    (g,) = torch.autograd.grad(value, x)
    return float(value.detach()), g


# ---------------------------------------------------------------------------- SPO


def test_spo_loss_and_gradient_by_hand():
    # row 0: A = 1, ratios 1.5 and 0.9; row 1: A = -2, ratio 0.7 (and one padded token); eps = 0.2
    logp = t([[LN(1.5), LN(0.9)], [LN(0.7), 0.0]])
    old = torch.zeros_like(logp)
    adv = t([1.0, -2.0])
    mask = t([[1, 1], [1, 0]])
    # l = -(rho A - |A| / (2 eps) (rho - 1)^2):
    #   1.5:  -(1.5 - 2.5 * 0.25) = -0.875;  0.9: -(0.9 - 2.5 * 0.01) = -0.875
    #   0.7, A = -2: -(-1.4 - 5 * 0.09) = 1.85;       token mean over 3 tokens
    value, g = _grad(lambda x: spo_loss(x, old, adv, mask, eps=0.2)[0], logp)
    assert value == pytest.approx((-0.875 - 0.875 + 1.85) / 3)
    # dl/dlogp = -(A - |A| (rho - 1) / eps) rho:
    #   1.5: -(1 - 2.5) 1.5 = 2.25;  0.9: -(1 + 0.5) 0.9 = -1.35;  0.7: -(-2 - 2 (-0.3) / 0.2) 0.7 = -(-2 + 3) 0.7 = -0.7
    torch.testing.assert_close(g, t([[2.25, -1.35], [-0.7, 0.0]]) / 3)
    _, st = spo_loss(logp, old, adv, mask, eps=0.2)
    # past the peak 1 + eps sign(A): 1.5 (A > 0, 0.5 > 0.2) and 0.7 (A < 0, 0.3 > 0.2); not 0.9
    assert st["clip_frac"] == pytest.approx(2 / 3)
    assert st["ratio_max"] == pytest.approx(1.5) and st["kl"] == 0.0


def test_spo_peaks_where_the_clip_would_start_and_adds_the_kl_term():
    old = torch.zeros(1, 1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.float64)
    for a, peak in ((1.0, 1.3), (-1.0, 0.7)):  # eps = 0.3: the objective's maximum in rho is 1 + eps sign(A)
        _, g = _grad(lambda x: spo_loss(x, old, t([a]), mask, eps=0.3)[0], t([[LN(peak)]]))
        assert abs(float(g)) < 1e-12
    ref = t([[0.5]])
    plain, _ = spo_loss(t([[0.2]]), old, t([1.0]), mask, eps=0.2)
    with_kl, st = spo_loss(t([[0.2]]), old, t([1.0]), mask, eps=0.2, logp_ref=ref, kl_coef=0.1, kl_estimator="k1")
    assert float(with_kl - plain) == pytest.approx(0.1 * (0.2 - 0.5)) and st["kl"] == pytest.approx(-0.3)
    with pytest.raises(ValueError, match="eps"):
        spo_loss(t([[0.2]]), old, t([1.0]), mask, eps=0.0)


# ---------------------------------------------------------------------------- GPG


def test_gpg_advantage_by_hand():
    rewards = t([[1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
    # 2 of 3 groups have unequal rewards: alpha = 3 / 2; A = alpha (r - group mean)
    expected = 1.5 * t([[0.75, -0.25, -0.25, -0.25], [0, 0, 0, 0], [-0.5, 0.5, 0.5, -0.5]])
    torch.testing.assert_close(gpg(rewards), expected)
    torch.testing.assert_close(compute_advantages("gpg", rewards), expected)
    assert torch.equal(gpg(t([[1, 1], [0, 0]])), torch.zeros(2, 2, dtype=torch.float64))  # no valid group: no signal
    assert torch.equal(gpg(t([[0.3], [0.9]])), torch.zeros(2, 1, dtype=torch.float64))  # G = 1


def test_pg_loss_by_hand_and_equal_to_ppo_on_policy():
    logp = t([[-1.0, -2.0], [-0.5, -3.0]])
    adv = t([2.0, -1.0])
    mask = t([[1, 1], [1, 0]])
    value, g = _grad(lambda x: pg_loss(x, x.detach(), adv, mask)[0], logp)
    assert value == pytest.approx(-(2 * -1.0 + 2 * -2.0 + -1 * -0.5) / 3)  # -A logp, token mean
    torch.testing.assert_close(g, t([[-2.0, -2.0], [1.0, 0.0]]) / 3)
    # one on-policy step: rho = 1, so PPO-clip's gradient is the same (and SPO's)
    _, g_ppo = _grad(lambda x: ppo_clip_loss(x, x.detach(), adv, mask)[0], logp)
    _, g_spo = _grad(lambda x: spo_loss(x, x.detach(), adv, mask)[0], logp)
    torch.testing.assert_close(g, g_ppo)
    torch.testing.assert_close(g, g_spo)
    _, st = pg_loss(logp, logp - 0.1, adv, mask)
    assert st["clip_frac"] == 0.0 and st["ratio_max"] == pytest.approx(math.exp(0.1))


# ---------------------------------------------------------------------------- NFT


def test_nft_loss_by_hand():
    # pass rate 0.5; row 0 a success with R = 2; row 1 a failure with R = 0.5; logp_old = 0
    logp = t([[LN(2.0)], [LN(0.5)]])
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    pos, rate = t([1.0, 0.0]), t([0.5, 0.5])
    # weight (1 - r) = 0.5. success: -log R = -ln 2. failure: neg ratio (1 - 0.5 * 0.5) / 0.5 = 1.5 >= clamp 1: -ln 1.5
    value, g = _grad(lambda x: nft_loss(x, old, pos, rate, mask)[0], logp)
    assert value == pytest.approx(0.5 * (-LN(2.0) - LN(1.5)) / 2)
    # d/dlogp: success -0.5; failure -0.5 * (-r R / (1 - r)) / 1.5 = -0.5 * (-0.5) / 1.5 = 1/6; token mean over 2
    torch.testing.assert_close(g, t([[-0.5], [1 / 6]]) / 2)


def test_nft_success_keeps_its_gradient_below_log_ratio_minus_20():
    # Issue 50. NFT's positive loss is -log R (the release clamps the log-ratio only from above,
    # at +10). One success, pass rate 0.5 (weight 1 - r = 0.5), log R = -25: loss 0.5 * 25 = 12.5,
    # d/dlogp = -0.5. The old +-20 clamp gave loss 10 and gradient 0.
    logp, old, mask = t([[-25.0]]), t([[0.0]]), t([[1.0]])
    value, g = _grad(lambda x: nft_loss(x, old, t([1.0]), t([0.5]), mask)[0], logp)
    assert value == pytest.approx(12.5)
    torch.testing.assert_close(g, t([[-0.5]]))
    # above +10 the release's clamp holds: value 0.5 * -10, gradient 0
    value, g = _grad(lambda x: nft_loss(x, old, t([1.0]), t([0.5]), mask)[0], t([[12.0]]))
    assert value == pytest.approx(-5.0)
    torch.testing.assert_close(g, t([[0.0]]))


@pytest.mark.parametrize("rate", [1.5, -0.1, float("nan")])
def test_nft_rejects_a_pass_rate_outside_0_1(rate):
    logp = t([[0.0], [0.0]])
    with pytest.raises(ValueError, match="pass_rate"):
        nft_loss(logp, torch.zeros_like(logp), t([1.0, 0.0]), t([rate, 0.5]), torch.ones_like(logp))


def test_apo_values_rejects_nan_rewards():
    with pytest.raises(ValueError, match="finite"):
        apo_values(t([[0.0, float("nan")]]), beta=0.5)
    with pytest.raises(ValueError, match="finite"):
        apo_values(t([[0.0, float("inf")]]), beta=0.5)


def test_truncated_is_weights_rejects_nan_at_masked_tokens():
    from recursa.algorithms.losses import truncated_is_weights

    nan = float("nan")
    mask = t([[1.0, 0.0]])
    with pytest.raises(ValueError, match="NaN"):
        truncated_is_weights(t([[nan, 0.0]]), t([[0.0, 0.0]]), mask, cap=2.0)
    with pytest.raises(ValueError, match="NaN"):
        truncated_is_weights(t([[0.0, 0.0]]), t([[nan, 0.0]]), mask, cap=2.0)
    # off the mask a NaN is ignored and the weight is 1
    torch.testing.assert_close(truncated_is_weights(t([[0.0, nan]]), t([[0.0, 0.0]]), mask, cap=2.0), t([[1.0, 1.0]]))


def test_nft_clamps_the_implicit_negative_ratio_and_keeps_a_finite_gradient():
    # a failure whose ratio grew to R = 3 at r = 0.5: (1 - 1.5) / 0.5 = -1 < 0, pi_neg would be negative
    logp, old, mask = t([[LN(3.0)]]), t([[0.0]]), t([[1.0]])
    value, g = _grad(lambda x: nft_loss(x, old, t([0.0]), t([0.5]), mask, neg_clamp=1.0)[0], logp)
    assert value == pytest.approx(0.0)  # -0.5 log max(-1, 1) = 0
    assert float(g) == pytest.approx(-0.5 * (-0.5 * 3.0 / 0.5) / 1.0)  # straight through, divided by the clamped value: 1.5
    _, st = nft_loss(logp, old, t([0.0]), t([0.5]), mask)
    assert st["clip_frac"] == 1.0
    # with a lower clamp the value is -log of it, the gradient divided by it
    value, g = _grad(lambda x: nft_loss(x, old, t([0.0]), t([0.5]), mask, neg_clamp=0.25)[0], logp)
    assert value == pytest.approx(-0.5 * LN(0.25)) and float(g) == pytest.approx(1.5 / 0.25)


def test_nft_leaves_out_groups_of_one_verdict_and_clips_the_pass_rate():
    logp, old, mask = t([[-0.3], [-0.7]]), t([[-0.5], [-0.5]]), torch.ones(2, 1, dtype=torch.float64)
    value, g = _grad(lambda x: nft_loss(x, old, t([1.0, 0.0]), t([1.0, 0.0]), mask)[0], logp)
    assert value == 0.0 and torch.equal(g, torch.zeros_like(g))
    # r = 0.995 is clipped to 0.98: the success's weight is 1 - 0.98
    value, _ = _grad(lambda x: nft_loss(x, old, t([1.0, 1.0]), t([0.995, 0.995]), mask)[0], logp)
    assert value == pytest.approx(0.02 * (-0.2 + 0.2) / 2)
    with pytest.raises(ValueError, match="0 or 1"):
        nft_loss(logp, old, t([0.5, 1.0]), t([0.5, 0.5]), mask)


def test_nft_on_policy_gradient_is_dr_grpo_with_the_binary_reward():
    torch.manual_seed(0)
    logp = -torch.rand(6, 4, dtype=torch.float64)
    mask = t([[1, 1, 1, 0]] * 6)
    success = t([1, 0, 0, 1, 1, 0])  # two groups of 3: pass rates 1/3 and 2/3
    rate = t([1 / 3] * 3 + [2 / 3] * 3)
    _, g_nft = _grad(lambda x: nft_loss(x, x.detach(), success, rate, mask)[0], logp)
    _, g_pg = _grad(lambda x: pg_loss(x, x.detach(), success - rate, mask)[0], logp)
    torch.testing.assert_close(g_nft, g_pg)


# ---------------------------------------------------------------------------- REBEL, A*-PO


def test_rebel_loss_and_gradient_by_hand():
    s = t([0.2, -0.1, 0.0, 5.0])
    r = t([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1])  # three in group 0; group 1 has no pair
    # pairs (0,1), (0,2), (1,2) with eta = 0.5: residuals 0.3/0.5 - 1 = -0.4, 0.2/0.5 - 1 = -0.6, -0.1/0.5 - 0 = -0.2
    value, g = _grad(lambda x: rebel_loss(x, r, groups, eta=0.5), s)
    assert value == pytest.approx((0.16 + 0.36 + 0.04) / 3)
    # dL/dS_i = 2 / (eta P) sum_j e_ij (e_ji = -e_ij), P = 3 pairs: S_0: (-0.4 - 0.6), S_1: (0.4 - 0.2), S_2: (0.6 + 0.2)
    torch.testing.assert_close(g, (2 / 1.5) * t([-1.0, 0.2, 0.8, 0.0]))
    # at S = 0 the weights are -2 G / (eta P) (r - group mean): a policy gradient with Dr. GRPO's advantage
    _, g0 = _grad(lambda x: rebel_loss(x, r, groups, eta=0.5), torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(g0, -(2 * 3 / 1.5) * t([2 / 3, -1 / 3, -1 / 3, 0.0]))
    assert float(rebel_loss(t([1.0, 2.0]), t([0.0, 1.0]), torch.tensor([0, 1]), eta=1.0)) == 0.0  # no pairs


def test_apo_value_and_loss_by_hand():
    v = apo_values(t([[0.0, 1.0], [1.0, 1.0]]), beta=0.5)
    torch.testing.assert_close(v, t([0.5 * LN((1 + math.exp(2.0)) / 2), 1.0]))
    r = t([[0.0, 1.0, 0.0, 0.0]])
    assert float(apo_values(r, beta=1e3)) == pytest.approx(0.25, abs=1e-3)  # -> the mean as beta grows
    assert float(apo_values(r, beta=1e-3)) == pytest.approx(1.0, abs=1e-2)  # -> the max as beta shrinks
    assert torch.isfinite(apo_values(t([[0.0, 50.0]]), beta=1e-3)).all()
    # (beta S - target)^2, mean over 2: (0.5 - 0.5)^2 = 0 and (-1 + 0.5)^2 = 0.25
    value, g = _grad(lambda x: apo_loss(x, t([0.5, -0.5]), beta=0.5), t([1.0, -2.0]))
    assert value == pytest.approx(0.125)
    torch.testing.assert_close(g, t([0.0, 2 * (-0.5) * 0.5 / 2]))


def test_apo_values_from_a_stored_reference_sample_by_hand():
    """A*-PO's stage 1: V*(x) = beta_1 log mean_j exp(r_j / beta_1) over N samples of pi_ref per
    task, read back by seed. beta_1 = 0.5: [1, 0, 0, 0] -> 0.5 log((e^2 + 3) / 4); [1, 1] -> 1;
    [0, 0, 0] -> 0. The regression then fits r - V* of the reference sample, not of the group."""
    from types import SimpleNamespace

    from recursa.algorithms.objectives import SEQUENCE_LOSSES, reference_values

    stored = {7: [1.0, 0.0, 0.0, 0.0], 3: [1.0, 1.0], 5: [0.0, 0.0, 0.0]}
    v = reference_values(stored, [7, 3, 5], beta=0.5)
    torch.testing.assert_close(v, t([0.5 * LN((math.exp(2.0) + 3) / 4), 1.0, 0.0]))
    with pytest.raises(ValueError, match="task 9 has no stored sample"):
        reference_values(stored, [7, 9], beta=0.5)
    with pytest.raises(ValueError, match="empty"):
        reference_values({1: []}, [1], beta=0.5)
    # the loss with V* from the stored sample: group rewards [1, 0] of task 7, S = [0, 0], beta_2 = 1:
    # targets 1 - V, -V with V = 0.5 log((e^2 + 3) / 4) ~ 0.47723 -> mean of (1 - V)^2 and V^2
    rewards = t([[1.0, 0.0]])
    ac = SimpleNamespace(apo_value_beta=0.5, apo_beta=1.0)
    V = 0.5 * LN((math.exp(2.0) + 3) / 4)
    offline = Outcomes(rewards, rewards, torch.tensor([0, 1]), values=reference_values(stored, [7], 0.5))
    assert float(SEQUENCE_LOSSES["apo"](t([0.0, 0.0]), offline, ac)) == pytest.approx(((1 - V) ** 2 + V**2) / 2)
    # the default: V* from the group [1, 0] itself, 0.5 log((e^2 + 1) / 2) ~ 0.71689
    Vg = 0.5 * LN((math.exp(2.0) + 1) / 2)
    group = Outcomes(rewards, rewards, torch.tensor([0, 1]))
    assert float(SEQUENCE_LOSSES["apo"](t([0.0, 0.0]), group, ac)) == pytest.approx(((1 - Vg) ** 2 + Vg**2) / 2)
    assert group.to("cpu").values is None and torch.equal(offline.to("cpu").values, offline.values)
    with pytest.raises(ValueError, match="one value per group"):
        SEQUENCE_LOSSES["apo"](t([0.0, 0.0]), Outcomes(rewards, rewards, torch.tensor([0, 1]), values=t([0.1, 0.2])), ac)


def test_sequence_helpers_by_hand():
    values = t([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0], [0.5, 0.5, 0.5]])
    mask = t([[1, 1, 0], [0, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(sequence_sums(values, mask, torch.tensor([1, 1, 0]), 2), t([0.5, 3.0 + 9.0]))
    value, w = sequence_weights(lambda s: (s.square() * t([1.0, 3.0])).sum(), t([2.0, -1.0]))
    assert value == pytest.approx(4.0 + 3.0) and torch.equal(w, t([4.0, -6.0]))
    logp = t([[-1.0, -2.0], [-3.0, -4.0]]).requires_grad_(True)
    loss = sequence_surrogate(logp, t([[1, 1], [1, 0]]), t([0.5, -2.0]), share=0.7)
    assert float(loss.detach()) == pytest.approx(0.7)  # the value is the share of L; the gradient is w x mask
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[0.5, 0.5], [-2.0, 0.0]]))
    st = ratio_stats(t([[0.1, 0.0]]), t([[0.0, 0.0]]), t([[1, 0]]), logp_ref=t([[0.3, 0.0]]), kl_estimator="k1")
    assert st["clip_frac"] == 0.0 and st["ratio_max"] == pytest.approx(math.exp(0.1)) and st["kl"] == pytest.approx(-0.2)


# ---------------------------------------------------------------------------- the update on the tiny model


def _cfg(*sets):
    return load_config(None, ["model.name=tiny-random", "train.max_grad_norm=1e9", *sets])


def _batch(policy):
    """2 prompts x 4 samples of the tiny model (8 rows), advantages and outcomes alongside."""
    from recursa.generation import SamplingParams, generate
    from recursa.rollout import render_prompt
    from recursa.trajectory import Trajectory, collate

    tok = policy.tokenizer
    prompts = [render_prompt(tok, f"question {i} " * (i + 1), None) for i in range(2)]
    samples = generate(policy.causal_lm, tok, prompts, SamplingParams(max_new_tokens=6), n=4, generator=torch.Generator().manual_seed(0))
    trajs = [Trajectory("t", 0, s.prompt_index, prompts[s.prompt_index] + s.token_ids, [0] * len(prompts[s.prompt_index]) + [1] * len(s.token_ids),
                        [0.0] * len(prompts[s.prompt_index]) + s.logprobs, 0.0, False) for s in samples]
    batch = collate(trajs, torch.zeros(len(trajs)), tok.pad_token_id)
    rewards = t([[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0]]).float()
    success = (rewards >= 1.0).float()
    batch.advantages = compute_advantages("grpo", rewards).view(-1)
    return batch, Outcomes(rewards, success, torch.arange(8))


def _grads(policy, batch, cfg, outcomes):
    model = policy.causal_lm
    saved = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = {}
    opt.register_step_pre_hook(lambda *a, **k: captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    st = update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0, outcomes=outcomes)
    model.load_state_dict(saved)
    return captured, st


def _close(a, b, rtol=1e-4):
    assert a.keys() == b.keys() and a
    for k in a:
        assert (a[k] - b[k]).norm() <= rtol * b[k].norm() + 1e-7, k


@pytest.mark.parametrize("objective", ["spo", "gpg"])
def test_one_on_policy_step_of_spo_and_gpg_is_ppos_gradient(objective):
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch, outcomes = _batch(policy)
    ppo, _ = _grads(policy, batch, _cfg(), outcomes)
    other, st = _grads(policy, batch, _cfg(f"algo.objective={objective}"), outcomes)
    _close(other, ppo, rtol=1e-5)
    assert st.clip_frac == 0.0


def test_one_on_policy_step_of_nft_is_dr_grpo_on_the_verdicts():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch, outcomes = _batch(policy)
    nft, _ = _grads(policy, batch, _cfg("algo.objective=nft", "train.micro_batch_size=3"), outcomes)
    rate = outcomes.success.mean(dim=1, keepdim=True)
    dr = copy.deepcopy(batch)
    dr.advantages = (outcomes.success - rate).view(-1)
    ppo, _ = _grads(policy, dr, _cfg(), outcomes)
    _close(nft, ppo)


def _direct_sequence_grads(policy, batch, outcomes, objective, base):
    """The sequence objective written out on the whole batch: S through the model, L(S), backward."""
    from recursa.recipes.grpo import SEQUENCE_LOSSES

    cfg = _cfg(f"algo.objective={objective}")
    model = policy.causal_lm
    model.zero_grad(set_to_none=True)
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    s = sequence_sums(logp - base, batch.action_mask, outcomes.row_seq, outcomes.rewards.numel())
    loss = SEQUENCE_LOSSES[objective](s, outcomes, cfg.algo)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


@pytest.mark.parametrize("objective", ["rebel", "apo"])
def test_sequence_objectives_give_the_exact_gradient_however_the_rows_are_split(objective):
    policy = load_policy(ModelConfig(name="tiny-random"))
    policy.enable_reference()
    with torch.no_grad():  # move the policy off the reference, so A*-PO's S is not 0
        for p in policy.causal_lm.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch, _ = _batch(policy)
    # games: rows 2k and 2k + 1 are two turns of one episode; 4 episodes in 2 groups of 2
    outcomes = Outcomes(t([[1.0, 0.0], [0.25, 1.0]]).float(), t([[1.0, 0.0], [0.0, 1.0]]).float(), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    with torch.no_grad():
        old, _ = sequence_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
        ref, _ = sequence_logprobs(policy.reference, batch.input_ids, batch.attention_mask, batch.action_mask)
    direct, value = _direct_sequence_grads(policy, batch, outcomes, objective, ref if objective == "apo" else old)
    assert value > 0
    for micro in (8, 3, 1):
        got, st = _grads(policy, batch, _cfg(f"algo.objective={objective}", f"train.micro_batch_size={micro}"), outcomes)
        _close(got, direct)
        assert st.loss == pytest.approx(value, rel=1e-4)
    if objective == "apo":
        assert st.kl > 0  # the KL to the reference is reported


@pytest.mark.parametrize("objective", ["rebel", "apo"])
def test_sequence_objectives_fit_their_regression_across_epochs(objective):
    """Five epochs (five optimizer steps, the weights dL/dS recomputed before each) bring the
    regression's loss at the final weights well under its value at the start."""
    from recursa.recipes.grpo import SEQUENCE_LOSSES

    policy = load_policy(ModelConfig(name="tiny-random"))
    policy.enable_reference()
    batch, outcomes = _batch(policy)
    # apo at beta 0.5: targets (r - V*) / beta of a few nats, which five steps can reach (at the
    # default 1e-3 they are hundreds of nats away)
    cfg = _cfg(f"algo.objective={objective}", "train.epochs=5", "train.lr=1e-3", *(["algo.apo_beta=0.5"] if objective == "apo" else []))
    with torch.no_grad():
        start, _ = sequence_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)  # = old = reference
    st = update(policy, torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-3), batch, cfg, torch.Generator().manual_seed(0), 0, outcomes=outcomes)
    assert st.opt_steps == 5 and st.approx_kl_old > 0 and math.isfinite(st.loss)
    with torch.no_grad():
        after, _ = sequence_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
    s = sequence_sums(after - start, batch.action_mask, outcomes.row_seq, 8)
    before_value = float(SEQUENCE_LOSSES[objective](torch.zeros(8), outcomes, cfg.algo))
    assert float(SEQUENCE_LOSSES[objective](s, outcomes, cfg.algo)) < 0.5 * before_value
    r = outcomes.rewards
    assert float(((s.view(2, 4) - s.view(2, 4).mean(1, keepdim=True)) * (r - r.mean(1, keepdim=True))).sum()) > 0  # better sequences gained


def test_an_objective_that_reads_outcomes_needs_them():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch, _ = _batch(policy)
    with pytest.raises(ValueError, match="outcomes"):
        update(policy, torch.optim.SGD(policy.causal_lm.parameters(), lr=0.0), batch, _cfg("algo.objective=nft"), torch.Generator(), 0)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("sets, words", [
    (["algo.objective=gpg", "algo.kl_coef=0.1"], "no KL"),
    (["algo.objective=apo", "algo.kl_coef=0.1"], "no KL"),
    (["algo.objective=rebel", "train.mini_batches=2"], "mini_batches = 1"),
    (["algo.objective=apo", "rollout.tis_cap=2.0"], "tis_cap"),
    (["algo.objective=nft", "algo.step_advantage=gigpo"], "step_advantage"),
    (["algo.objective=ppo-clip"], "algo.objective"),
    (["algo.igrpo_drafts=0"], "igrpo_drafts"),
    (["algo.spo_eps=0"], "spo_eps"),
])
def test_objective_config_rules(sets, words):
    with pytest.raises(UserError, match=words) as err:
        load_config(None, ["model.name=tiny-random", *sets])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["algo.objective=spo", "algo.igrpo=true"])
def test_rsipo_refuses_the_grpo_only_options(key):
    with pytest.raises(UserError, match="grpo recipe"):
        load_config(None, ["model.name=tiny-random", key], recipe="rsipo")


def test_defaults_are_ppo_and_the_reference_is_kept_only_when_read():
    cfg = load_config(None, [])
    assert cfg.algo.objective == "ppo" and not cfg.algo.igrpo and not cfg.algo.needs_reference
    assert load_config(None, ["algo.objective=apo"]).algo.needs_reference
    assert load_config(None, ["algo.kl_coef=0.1"]).algo.needs_reference


# ---------------------------------------------------------------------------- iGRPO


def test_draft_hint_frames_and_clips():
    assert draft_hint("  12\n+ 3 ", 0.5, 100) == "Your best earlier attempt (reward 0.50): 12 + 3\nImprove on it."
    assert draft_hint("", 0.0, 100).endswith("(empty)\nImprove on it.")
    clipped = draft_hint("x" * 50, 1.0, 10)
    assert "xxxxxxx..." in clipped and "x" * 8 not in clipped


class _FakeRollouts:
    """Drafts with chosen rewards; records the calls."""

    def __init__(self, rewards):
        self.rewards, self.calls = rewards, []

    def rollout(self, seeds, group_size, sampling, generator, system_prompt, hints=None):
        from recursa.rollout import RolloutResult
        from recursa.trajectory import Trajectory

        self.calls.append((list(seeds), group_size, hints))
        trajs = [Trajectory("e", s, b, [1, 2], [0, 1], [0.0, -1.0], self.rewards[b][k], self.rewards[b][k] >= 1, completion_text=f"draft {b}.{k}")
                 for b, s in enumerate(seeds) for k in range(group_size)]
        return RolloutResult(trajs, None)


def test_draft_hints_pick_the_best_draft_of_each_task():
    cfg = load_config(None, ["model.name=tiny-random", "algo.igrpo=true", "algo.igrpo_drafts=3", "train.prompts_per_step=2"])
    fake = _FakeRollouts([[0.0, 0.7, 0.7], [1.0, 0.2, 0.0]])
    hints, metrics = draft_hints(fake, [11, 12], cfg, None, torch.Generator(), None, False, None, 0)
    assert fake.calls == [([11, 12], 3, None)]
    assert hints == [draft_hint("draft 0.1", 0.7, 400), draft_hint("draft 1.0", 1.0, 400)]  # the first of ties
    assert metrics["igrpo/draft_reward_mean"] == pytest.approx(2.6 / 6)
    assert metrics["igrpo/best_draft_reward_mean"] == pytest.approx(0.85)
    assert metrics["igrpo/draft_success_rate"] == pytest.approx(1 / 6)


def test_draft_hints_do_not_tie_rewards_that_differ_below_float32_resolution():
    # Issue 50: 1.0 and 1.0 + 1e-9 are one float32 value; the second draft is the better one.
    cfg = load_config(None, ["model.name=tiny-random", "algo.igrpo=true", "algo.igrpo_drafts=2", "train.prompts_per_step=1"])
    assert torch.tensor(1.0 + 1e-9, dtype=torch.float32) == torch.tensor(1.0, dtype=torch.float32)
    fake = _FakeRollouts([[1.0, 1.0 + 1e-9]])
    hints, _ = draft_hints(fake, [11], cfg, None, torch.Generator(), None, False, None, 0)
    assert hints == [draft_hint("draft 0.1", 1.0 + 1e-9, 400)]


# ---------------------------------------------------------------------------- two steps of every switch on the tiny model

class AnyDigitEnv:
    """Single-turn toy task: reward = the share of digit characters in the reply, success = any
    digit. The tiny random model succeeds now and then, so every objective gets a signal."""

    name = "toy-anydigit"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return f"Write a number. Item {seed % 10}."

    def step(self, action_text: str):
        from recursa.envs import StepResult

        text = action_text or ""
        frac = sum(c.isdigit() for c in text) / max(len(text), 1)
        return StepResult("", frac, True, {"success": frac > 0})


class DigitGameEnv:
    """Multi-turn toy game: any reply is an action; one holding a digit wins (reward 1), else the
    game goes on until max_steps (reward 0)."""

    name = "toy-digit-game"
    system_prompt = None

    def __init__(self, max_steps: int = 2):
        self.max_steps, self.steps, self.task = max_steps, 0, "Your task is to: say a number."

    def reset(self, seed: int) -> str:
        self.steps = 0
        return f"Round {seed % 7}."

    def admissible_actions(self) -> list[str]:
        return []  # free text: the reply's first line is the action

    def walkthrough(self) -> list[str]:
        return ["7"]

    def step(self, action_text: str):
        from recursa.envs import StepResult

        self.steps += 1
        won = any(c.isdigit() for c in action_text)
        done = won or self.steps >= self.max_steps
        return StepResult("Say a number." if not won else "Done.", float(won), done, {"won": won, "success": won, "invalid": False})


SINGLE = ["env.name=toy-anydigit", "sampling.max_new_tokens=6"]
GAME = ["env.name=toy-digit-game", "agent.history_turns=1", "sampling.max_new_tokens=4"]
SWITCHES = {
    "spo": ["algo.objective=spo"],
    "gpg": ["algo.objective=gpg", "algo.advantage=gpg"],
    "rebel": ["algo.objective=rebel"],
    "nft": ["algo.objective=nft"],
    "apo": ["algo.objective=apo"],
    "igrpo": ["algo.igrpo=true", "algo.igrpo_drafts=2"],
}


@pytest.mark.parametrize("task", ["single-turn", "game"])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_every_switch_trains_two_steps_with_finite_metrics(tmp_path, monkeypatch, switch, task):
    import recursa.recipes.grpo as grpo
    import recursa.recipes.loop as loop
    from recursa.envs import base

    monkeypatch.setattr(base.ENVS, "_registered", dict(base.ENVS._registered))  # the registrations below end with the test
    base.register_env("toy-anydigit", AnyDigitEnv, "test")
    base.register_env("toy-digit-game", DigitGameEnv, "test")
    seen_hints = []
    make = loop.make_rollouts  # the shared step loop (recipes/loop.py) opens the rollout backend

    def recording(*a, **k):  # record the hints each rollout of the step is given
        backend = make(*a, **k)
        rollout, episodes = backend.rollout, backend.episodes
        backend.rollout = lambda *x, hints=None, **y: (seen_hints.append(hints), rollout(*x, hints=hints, **y))[1]
        backend.episodes = lambda *x, hints=None, **y: (seen_hints.append(hints), episodes(*x, hints=hints, **y))[1]
        return backend

    monkeypatch.setattr(loop, "make_rollouts", recording)
    sets = ["model.name=tiny-random", "run.threads=1", "train.steps=2", "train.prompts_per_step=2", "train.group_size=4", "train.epochs=2",
            "train.micro_batch_size=4", "train.lr=1e-2", "eval.n=2", *(SINGLE if task == "single-turn" else GAME), *SWITCHES[switch]]
    cfg = load_config(None, sets)
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert len(steps) == 2
    for r in steps:
        for key, value in r.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (switch, task, key, value)
    assert any(r["policy/grad_norm"] > 0 for r in steps), f"{switch} on {task} never moved the weights"
    assert (run / "eval" / "after.json").exists()
    if switch == "igrpo":
        assert all(r["episodes/sampled"] == 2 * (2 + 4) for r in steps) and steps[-1]["budget/episodes"] == 24
        assert all("igrpo/best_draft_reward_mean" in r for r in steps)
        # per step: the drafts without a hint, then the trained rollout with one hint per task
        drafts, refined = seen_hints[0::2], seen_hints[1::2]
        assert drafts == [None, None] and all(len(h) == 2 and all(x.startswith("Your best earlier attempt") for x in h) for h in refined)
    else:
        assert seen_hints == [None, None]


# ---------------------------------------------------------------------------- the example configs

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "objectives").glob("*.toml"))


def test_there_is_an_example_per_switch():
    assert [p.stem for p in EXAMPLES] == sorted(SWITCHES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_matches_the_household_grpo_benchmark_but_for_its_switch(path):
    """Everything but `[algo]` (and the output directory; iGRPO's group, which halves to keep the
    episodes per step) equals the GRPO run of benchmarks/rsipo_vs_grpo.py --games household."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("rsipo_vs_grpo", ROOT / "benchmarks" / "rsipo_vs_grpo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = SimpleNamespace(steps=None, eval_n=None, eval_every=None, split="test", device=None, tiny=False)
    grpo = load_config(None, bench.run_spec("grpo", 0, args, bench.HOUSEHOLD)["sets"], recipe="grpo").model_dump()
    mine = load_config(path).model_dump()
    assert mine["model"]["name"] == "smollm2-135m-instruct" and mine["init"]["from_run"] == "runs/household_sft"
    for dump in (grpo, mine):
        dump.pop("algo")
        dump["run"].pop("out")
    if path.stem == "igrpo":
        assert mine["train"].pop("group_size") + load_config(path).algo.igrpo_drafts == grpo["train"].pop("group_size")
    assert mine == grpo


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_a_step_on_the_tiny_model(tmp_path, path):
    import recursa.recipes.grpo as grpo

    cfg = load_config(path, ["model.name=tiny-random", "init.from_run=", "run.threads=1", "train.steps=1", "train.prompts_per_step=1",
                             "sampling.max_new_tokens=4", "eval.n=2", "eval.every=0",
                             'env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, tasks = "pick_and_place", max_steps = 2}'])
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert (run / "eval" / "after.json").exists()


def test_branching_refuses_objectives_and_igrpo_it_cannot_feed():
    """rollout.branch trains continuations on branch advantages; the sequence objectives read
    rewards instead, and iGRPO's draft hints are not replayed: both are refused in one line."""
    from recursa.config import load_config
    from recursa.errors import UserError

    game = ['env.name="household"', 'rollout.branch="last"']
    with pytest.raises(UserError, match="does not read"):
        load_config(None, [*game, 'algo.objective="nft"', 'algo.step_advantage="none"'], recipe="grpo")
    with pytest.raises(UserError, match="use one of the two"):
        load_config(None, [*game, "algo.igrpo=true"], recipe="grpo")
    load_config(None, [*game, 'algo.objective="spo"'], recipe="grpo")  # a per-token objective reads the branch advantages


def test_igrpo_refuses_the_curriculum_tail():
    """iGRPO's best draft and the curriculum tail's guidance would both be a task's hint: refused in one line."""
    from recursa.config import load_config
    from recursa.errors import UserError

    with pytest.raises(UserError, match="use one of the two"):
        load_config(None, ["algo.igrpo=true", "curriculum.mode=progress", "curriculum.arms=[{kwargs = {difficulty = 0}}]",
                           "curriculum.tail.enabled=true"], recipe="grpo")
