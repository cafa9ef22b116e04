"""Hand-worked checks of the self-teacher math (teacher shift, psi, token advantages, ...)."""

import math

import pytest
import torch

from recursa.algorithms.distill import (
    correlation,
    delta_scale,
    group_normalise,
    group_offsets,
    distribution_loss,
    imitation_loss,
    pass_rate_weights,
    psi,
    seed_imitation_weights,
    penalised,
    skill_effect,
    skill_replay_reward,
    skill_rewards,
    teacher_shift,
    token_advantages,
    topk_divergence,
    trajectory_shift,
    with_tail,
)

F64 = torch.float64
NAN = math.nan


def t(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, atol=1e-9):
    if not isinstance(actual, torch.Tensor):
        actual = torch.tensor(actual, dtype=F64)
    expected = torch.as_tensor(expected, dtype=F64).to(actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


# ------------------------------------------------------------ teacher shift

def test_teacher_shift_and_trajectory_shift():
    # NaN off the mask must not leak
    logp_teacher = t([[-1.0, -0.5, NAN], [-2.0, -0.1, -3.0], [NAN, NAN, NAN]]).requires_grad_(True)
    logp_student = t([[-1.5, -0.5, -1.0], [-1.0, NAN, -2.5], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    delta = teacher_shift(logp_teacher, logp_student, mask)
    # row 0: -1 + 1.5 = 0.5, -0.5 + 0.5 = 0;  row 1: -2 + 1 = -1, -3 + 2.5 = -0.5
    close(delta, [[0.5, 0.0, 0.0], [-1.0, 0.0, -0.5], [0.0, 0.0, 0.0]])
    assert not delta.requires_grad
    # means over action tokens: (0.5 + 0) / 2 = 0.25, (-1 - 0.5) / 2 = -0.75, empty row 0
    close(trajectory_shift(delta, mask), [0.25, -0.75, 0.0])


def test_teacher_shift_bad_shapes():
    with pytest.raises(ValueError, match=r"\(N, L\)"):
        teacher_shift(t([1.0, 2.0]), t([1.0, 2.0]), t([1, 1]))
    with pytest.raises(ValueError, match="logp_student"):
        teacher_shift(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask shape"):
        trajectory_shift(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="binary"):
        trajectory_shift(torch.zeros(2, 3), torch.full((2, 3), 0.5))


# ------------------------------------------------------------ psi

# masked values 1, 3, -1 (NaN off the mask): mean 1, deviations 0, 2, -2,
# unbiased variance 8 / 2 = 4, std 2
DELTA = t([[1.0, 3.0, NAN], [-1.0, NAN, NAN]])
MASK = t([[1, 1, 0], [1, 0, 0]])


def test_psi_std_scale_by_hand():
    close(delta_scale(DELTA, MASK, "std"), 2.0)
    # Delta / 2 = [0.5, 1.5], [-0.5]; nothing reaches clip 3
    close(psi(DELTA, MASK, clip=3.0), [[0.5, 1.5, 0.0], [-0.5, 0.0, 0.0]])
    # clip 1.2 cuts 1.5
    close(psi(DELTA, MASK, clip=1.2), [[0.5, 1.2, 0.0], [-0.5, 0.0, 0.0]])
    # softened negative side: -0.5 * 0.5 = -0.25, positives untouched
    close(
        psi(DELTA, MASK, clip=1.2, negative_scale=0.5), [[0.5, 1.2, 0.0], [-0.25, 0.0, 0.0]]
    )
    # negative_scale 0 drops the teacher's rejections altogether
    close(psi(DELTA, MASK, negative_scale=0.0), [[0.5, 1.5, 0.0], [0.0, 0.0, 0.0]])


def test_psi_clips_before_softening():
    # scale "none": [2, -6] -> clip 4 -> [2, -4] -> negatives * 0.25 -> [2, -1]
    # (softening first would give -6 * 0.25 = -1.5)
    close(psi(t([[2.0, -6.0]]), t([[1, 1]]), clip=4.0, scale="none", negative_scale=0.25),
          [[2.0, -1.0]])


def test_psi_mad_scale_by_hand():
    # [1, 2, 4, 10]: median (2 + 4) / 2 = 3 (torch.median would say 2),
    # |dev| = [2, 1, 1, 7] -> sorted [1, 1, 2, 7] -> median 1.5; scale 1.4826 * 1.5 = 2.2239
    delta = t([[1.0, 2.0], [4.0, 10.0]])
    mask = torch.ones(2, 2)
    close(delta_scale(delta, mask, "mad"), 2.2239)
    # 1 / 2.2239 = 0.4496605063, 2 / .. = 0.8993210126, 4 / .. = 1.7986420253, 10 / .. = 4.4966 -> 3
    close(psi(delta, mask, clip=3.0, scale="mad"), [[0.4496605063, 0.8993210126], [1.7986420253, 3.0]])
    # odd count [-2, 1, 5]: median 1, |dev| [3, 0, 4] -> median 3; scale 4.4478
    close(delta_scale(t([[-2.0, 1.0, 5.0]]), torch.ones(1, 3), "mad"), 4.4478)


def test_psi_degenerate_scales_hit_the_floor():
    # a single action token or a constant Delta has std 0 -> floored at eps -> saturates at clip
    close(psi(t([[0.3, NAN]]), t([[1, 0]]), clip=2.0), [[2.0, 0.0]])
    close(psi(t([[-0.2, -0.2]]), t([[1, 1]]), clip=2.0), [[-2.0, -2.0]])
    close(delta_scale(t([[0.2, 0.2]]), t([[1, 1]]), "std", eps=1e-3), 1e-3)
    # no action tokens at all: zeros
    close(psi(t([[5.0, 1.0]]), t([[0, 0]])), [[0.0, 0.0]])


def test_psi_bad_arguments():
    with pytest.raises(ValueError, match="std.*mad.*none"):
        psi(DELTA, MASK, scale="iqr")
    with pytest.raises(ValueError, match="clip"):
        psi(DELTA, MASK, clip=0.0)
    with pytest.raises(ValueError, match="negative_scale"):
        psi(DELTA, MASK, negative_scale=-0.5)
    with pytest.raises(ValueError, match="eps"):
        psi(DELTA, MASK, eps=0.0)


# ------------------------------------------------------------ token advantages

OUTCOME = t([1.0, -0.5, 0.0])
PSI = t([[0.5, -1.0, NAN], [2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
TRUST = t([0.5, 1.0, 0.2])
ADV_MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])


def test_token_advantages_by_hand():
    # lam * T = 0.4 * [0.5, 1, 0.2] = [0.2, 0.4, 0.08]
    # row 0: 1 + 0.2 * [0.5, -1] = [1.1, 0.8]
    # row 1: -0.5 + 0.4 * [2, 0, 1] = [0.3, -0.5, -0.1]
    # row 2: 0 + 0.08 * 1 = 0.08
    adv, shares = token_advantages(OUTCOME, PSI, TRUST, 0.4, ADV_MASK)
    close(adv, [[1.1, 0.8, 0.0], [0.3, -0.5, -0.1], [0.08, 0.0, 0.0]])
    # 6 action tokens; |outcome| sum = 1 + 1 + 3 * 0.5 + 0 = 3.5 -> 0.5833333333
    # |teacher| sum = 0.1 + 0.2 + 0.8 + 0 + 0.4 + 0.08 = 1.58 -> 0.2633333333
    # share = 1.58 / (3.5 + 1.58) = 0.3110236220
    close(shares["outcome_abs"], 3.5 / 6)
    close(shares["teacher_abs"], 1.58 / 6)
    close(shares["teacher_share"], 0.3110236220)


def test_token_advantages_route_failed_only():
    # success = [True, False, False]: row 0 keeps its outcome advantage alone
    success = torch.tensor([True, False, False])
    adv, shares = token_advantages(OUTCOME, PSI, TRUST, 0.4, ADV_MASK, route="failed", success=success)
    close(adv, [[1.0, 1.0, 0.0], [0.3, -0.5, -0.1], [0.08, 0.0, 0.0]])
    # |teacher| sum = 0.8 + 0.4 + 0.08 = 1.28 -> share 1.28 / (3.5 + 1.28) = 0.2677824268
    close(shares["teacher_abs"], 1.28 / 6)
    close(shares["teacher_share"], 0.2677824268)
    # without routing success is irrelevant
    plain, _ = token_advantages(OUTCOME, PSI, TRUST, 0.4, ADV_MASK, success=success)
    close(plain[0], [1.1, 0.8, 0.0])


def test_token_advantages_zero_trust_or_lam_is_outcome_only():
    expected = [[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]]
    adv, shares = token_advantages(OUTCOME, PSI, torch.zeros(3), 0.4, ADV_MASK)
    close(adv, expected)
    assert shares["teacher_abs"] == 0.0 and shares["teacher_share"] == 0.0
    close(token_advantages(OUTCOME, PSI, TRUST, 0.0, ADV_MASK)[0], expected)
    # nothing at all: shares are 0, not NaN
    _, empty = token_advantages(OUTCOME, PSI, TRUST, 0.4, torch.zeros(3, 3))
    assert empty == {"outcome_abs": 0.0, "teacher_abs": 0.0, "teacher_share": 0.0}


def test_token_advantages_bad_arguments():
    with pytest.raises(ValueError, match="success"):
        token_advantages(OUTCOME, PSI, TRUST, 0.4, ADV_MASK, route="failed")
    with pytest.raises(ValueError, match="route"):
        token_advantages(OUTCOME, PSI, TRUST, 0.4, ADV_MASK, route="success")
    with pytest.raises(ValueError, match=r"trust must lie in \[0, 1\]"):
        token_advantages(OUTCOME, PSI, t([0.5, 1.5, 0.0]), 0.4, ADV_MASK)
    with pytest.raises(ValueError, match="lam"):
        token_advantages(OUTCOME, PSI, TRUST, -0.1, ADV_MASK)
    with pytest.raises(ValueError, match="outcome_adv"):
        token_advantages(t([1.0, 2.0]), PSI, TRUST, 0.4, ADV_MASK)
    with pytest.raises(ValueError, match="success"):
        token_advantages(OUTCOME, PSI, TRUST, 0.4, ADV_MASK, route="failed", success=t([1, 0]))


# ------------------------------------------------------------ imitation

LN3 = math.log(3.0)


def test_seed_imitation_weights():
    delta = t([[0.0, LN3, NAN], [-LN3, 2.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4, sigmoid(2) = 0.8807970780
    close(seed_imitation_weights(delta, mask), [[0.5, 0.75, 0.0], [0.25, 0.8807970780, 0.0]])
    # temperature 2: sigmoid(ln 3 / 2) = sqrt 3 / (1 + sqrt 3) = 0.6339745962, sigmoid(1) = 0.7310585786
    close(seed_imitation_weights(delta, mask, temperature=2.0)[:, 1], [0.6339745962, 0.7310585786])
    with pytest.raises(ValueError, match="temperature"):
        seed_imitation_weights(delta, mask, temperature=0.0)


def test_imitation_loss_value_and_gradient():
    weights = t([[0.5, 0.75, 0.0], [0.25, 0.8807970780, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    logp = t([[-1.0, -2.0, NAN], [-0.5, -4.0, NAN]]).requires_grad_(True)
    loss = imitation_loss(logp, weights, mask)
    # (0.5 * 1 + 0.75 * 2 + 0.25 * 0.5 + 0.8807970780 * 4) / 4 = 5.648188312 / 4
    close(loss, 1.412047078)
    loss.backward()
    # d loss / d logp = -w / 4 on action tokens, 0 elsewhere
    close(logp.grad, [[-0.125, -0.1875, 0.0], [-0.0625, -0.2201992695, 0.0]])
    # micro-batch count: divide by the whole batch's 8 tokens instead
    close(imitation_loss(logp.detach(), weights, mask, num_tokens=8), 5.648188312 / 8)
    with pytest.raises(ValueError, match="weights shape"):
        imitation_loss(logp, weights[:, :2], mask)


# ------------------------------------------------------------ full-distribution self-distillation

def test_with_tail_collapses_onto_k_tokens_and_the_rest():
    out = with_tail(t([[math.log(0.5), math.log(0.2)]]))
    close(out.exp(), [[0.5, 0.2, 0.3]])
    # k tokens holding all the mass leave the floored tail, finite
    full = with_tail(t([[math.log(0.5), math.log(0.5)]]))
    assert torch.isfinite(full).all() and full[0, 2] < -15


def test_topk_divergence_against_hand_computation():
    # k = 1: student p(i) = 0.5 -> cells (0.5, 0.5); teacher p(i) = 0.8 -> cells (0.8, 0.2)
    s, te = t([[[math.log(0.5)]]]), t([[[math.log(0.8)]]])
    forward = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)  # 0.192745
    reverse = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)  # 0.223144
    m = (0.65, 0.35)
    jsd = 0.5 * (0.8 * math.log(0.8 / m[0]) + 0.2 * math.log(0.2 / m[1]) + 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))  # 0.050672
    close(topk_divergence(s, te, "forward"), [[forward]])
    close(topk_divergence(s, te, "reverse"), [[reverse]])
    close(topk_divergence(s, te, "jsd"), [[jsd]])
    close(forward, 0.192745, atol=1e-6)
    close(reverse, 0.223144, atol=1e-6)
    close(jsd, 0.050672, atol=1e-6)
    # equal distributions: 0 for every kind
    for kind in ("forward", "reverse", "jsd"):
        close(topk_divergence(te, te, kind), [[0.0]])
    with pytest.raises(ValueError, match="kind"):
        topk_divergence(s, te, "tv")
    with pytest.raises(ValueError, match="one shape"):
        topk_divergence(s, t([[[0.0, 0.0]]]), "jsd")


def test_topk_set_from_the_student_or_the_teacher_by_hand():
    """Issue 50: SDPO keeps the student's top-k, recursa by default the teacher's. A 4-token
    vocabulary, p_S = (.5, .3, .1, .1), p_T = (.1, .2, .3, .4), k = 2, forward KL(T || S) over
    the k tokens and the tail cell.
    teacher's set {3, 2}: T cells (.4, .3, .3), S cells (.1, .1, .8);
    student's set {0, 1}: S cells (.5, .3, .2), T cells (.1, .2, .7)."""
    p_s, p_t = torch.tensor([0.5, 0.3, 0.1, 0.1]), torch.tensor([0.1, 0.2, 0.3, 0.4])

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b))

    for ids, t_cells, s_cells in (([3, 2], (0.4, 0.3, 0.3), (0.1, 0.1, 0.8)), ([0, 1], (0.1, 0.2, 0.7), (0.5, 0.3, 0.2))):
        student = p_s[ids].log().view(1, 1, 2)
        teacher = p_t[ids].log().view(1, 1, 2)
        got = topk_divergence(student, teacher, "forward")
        assert got.item() == pytest.approx(kl(t_cells, s_cells), rel=1e-5)
    # the two sets disagree on this pair: 0.4 log 4 + 0.3 log 3 + 0.3 log(3/8) vs 0.1 log(1/5) + 0.2 log(2/3) + 0.7 log(7/2)
    assert kl((0.4, 0.3, 0.3), (0.1, 0.1, 0.8)) == pytest.approx(0.4 * math.log(4) + 0.3 * math.log(3) + 0.3 * math.log(3 / 8))
    assert kl((0.1, 0.2, 0.7), (0.5, 0.3, 0.2)) == pytest.approx(0.1 * math.log(0.2) + 0.2 * math.log(2 / 3) + 0.7 * math.log(3.5))


def test_forward_divergence_gradient_is_softmax_minus_teacher():
    # a 3-token vocabulary, the teacher's top 2 ids: the tail is exactly the third token, so
    # KL(T || S) is the full forward KL and its gradient in the student's logits z is p_S - p_T
    z = t([0.3, -0.2, 1.1]).requires_grad_(True)
    p_t = t([0.6, 0.1, 0.3])
    ids = [0, 2]  # the teacher's top 2
    logp_s = torch.log_softmax(z, -1)
    loss = topk_divergence(logp_s[ids].reshape(1, 1, 2), p_t[ids].log().reshape(1, 1, 2), "forward")
    close(loss, [[float((p_t * (p_t.log() - logp_s.detach())).sum())]])
    loss.sum().backward()
    close(z.grad, torch.softmax(z.detach(), -1) - p_t)


def test_distribution_loss_is_the_weighted_token_mean():
    s = t([[[math.log(0.5)], [math.log(0.9)], [0.0]]]).requires_grad_(True)  # (1, 3, 1); position 2 is padding (p = 1)
    te = t([[[math.log(0.8)], [math.log(0.9)], [0.0]]])
    mask, w = t([[1, 1, 0]]), t([[0.5, 1.0, 7.0]])
    fwd = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    loss = distribution_loss(s, te, w, mask, "forward")
    close(loss, (0.5 * fwd + 1.0 * 0.0) / 2)
    loss.backward()
    assert torch.isfinite(s.grad).all() and s.grad[0, 2, 0] == 0  # the padded position: no NaN, no gradient
    # d/d log p_S(i) of KL(T || S) with cells (p, 1 - p): -T(i) + T(tail) p / (1 - p) = -0.8 + 0.2 = -0.6; x w / tokens
    close(s.grad[0, 0, 0], 0.5 * -0.6 / 2)
    close(distribution_loss(s.detach(), te, w, mask, "forward", num_tokens=4), (0.5 * fwd) / 4)
    with pytest.raises(ValueError, match="student shape"):
        distribution_loss(s, te, w[:, :2], mask[:, :2])


# ------------------------------------------------------------ pass-rate weights

def test_pass_rate_weights():
    success = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    # p = 0.5 -> sqrt(0.25) = 0.5; p = 1 or 0 -> 0; p = 0.25 -> sqrt(0.1875) = 0.4330127019
    expected = [[0.5] * 4, [0.0] * 4, [0.0] * 4, [0.4330127019] * 4]
    out = pass_rate_weights(success)
    close(out, expected)
    assert torch.equal(out[1:3], torch.zeros(2, 4))  # exactly zero
    close(pass_rate_weights(success.bool()), expected)
    with pytest.raises(ValueError, match=r"\(B, G\)"):
        pass_rate_weights(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="0/1"):
        pass_rate_weights(torch.tensor([[1.0, 0.5]]))


# ------------------------------------------------------------ skill rewards

def test_skill_effect_and_penalties_by_hand():
    # games played with the skill won 1, 0, 1 against mean rewards 0.5, 0.25, 1.0 without it
    close(skill_effect(t([1.0, 0.0, 1.0]), t([0.5, 0.25, 1.0])), (0.5 - 0.25 + 0.0) / 3)
    with pytest.raises(ValueError, match="M >= 1"):
        skill_effect(t([]), t([]))
    with pytest.raises(ValueError, match="baselines"):
        skill_effect(t([1.0]), t([0.5, 0.5]))
    with pytest.raises(ValueError, match="finite"):
        skill_effect(t([NAN]), t([0.5]))
    # 12 words over max 10 costs 2 x 0.1; an invalid candidate gets invalid_reward whatever its raw value
    close(penalised([0.5, 0.3, 9.0], [12, 4, 0], [False, False, True], 10, 0.1, -1.0), [0.3, 0.3, -1.0])
    with pytest.raises(ValueError, match="one entry per candidate"):
        penalised([0.5], [1, 2], [False], 10, 0.1)


def test_skill_replay_reward_with_clipping():
    # c = 1: clip(D) = [0.5, -1, 1, -0.1], y * clip = [0.5, 1, 1, -0.1], mean 2.4 / 4 = 0.6
    r = skill_replay_reward(t([0.5, -2.0, 3.0, -0.1]), t([1, -1, 1, 1]), clip=1.0)
    close(r, 0.6)
    # without effective clipping: [0.5, 2, 3, -0.1] -> 5.4 / 4 = 1.35
    close(skill_replay_reward(t([0.5, -2.0, 3.0, -0.1]), t([1, -1, 1, 1]), clip=10.0), 1.35)
    with pytest.raises(ValueError, match="no replayed trajectories"):
        skill_replay_reward(t([]), t([]), clip=1.0)
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        skill_replay_reward(t([0.5]), t([0]), clip=1.0)
    with pytest.raises(ValueError, match="clip"):
        skill_replay_reward(t([0.5]), t([1]), clip=0.0)


def test_skill_rewards_penalties():
    # candidate 0: replay reward 0.6 (above), 120 long, max 100: 0.6 - 0.01 * 20 = 0.4
    # candidate 1: invalid -> -1 (its replays are not looked at)
    # candidate 2: D = 0.2 on a failure -> -0.2, 80 long: no penalty
    rewards = skill_rewards(
        delta_means=[t([0.5, -2.0, 3.0, -0.1]), t([]), t([0.2])],
        outcomes=[t([1, -1, 1, 1]), t([]), t([-1])],
        lengths=[120, 500, 80],
        invalid=[False, True, False],
        clip=1.0,
        max_len=100,
        length_penalty=0.01,
    )
    close(rewards.to(F64), [0.4, -1.0, -0.2], atol=1e-6)
    custom = skill_rewards([t([])], [t([])], [10], [True], clip=1.0, max_len=100,
                           length_penalty=0.01, invalid_reward=-2.0)
    close(custom.to(F64), [-2.0])
    with pytest.raises(ValueError, match="one entry per candidate"):
        skill_rewards([t([0.1])], [t([1])], [10, 20], [False], clip=1.0, max_len=100,
                      length_penalty=0.0)
    with pytest.raises(ValueError, match="length_penalty"):
        skill_rewards([t([0.1])], [t([1])], [10], [False], clip=1.0, max_len=100,
                      length_penalty=-1.0)


def test_group_normalise():
    # [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.5773502692 -> +-0.8660254038
    close(group_normalise(t([1.0, 0.0, 0.0, 1.0]), eps=0.0),
          [0.8660254038, -0.8660254038, -0.8660254038, 0.8660254038])
    # zero-variance group (0.1 does not average back to 0.1 in float32) and K = 1: exactly 0
    assert torch.equal(group_normalise(torch.full((7,), 0.1)), torch.zeros(7))
    assert torch.equal(group_normalise(t([0.7])), torch.zeros(1, dtype=F64))
    with pytest.raises(ValueError, match=r"\(K,\)"):
        group_normalise(torch.zeros(2, 2))


# ------------------------------------------------------------ correlation

def test_correlation():
    # NaN pair dropped: (1, 2), (2, 4), (3, 7); dx = [-1, 0, 1], dy = [-7/3, -1/3, 8/3]
    # sum dx dy = 5, sum dx^2 = 2, sum dy^2 = 114 / 9; r = 5 / sqrt(2 * 114 / 9) = 0.9933992678
    close(correlation(t([1.0, 2.0, 3.0, NAN]), t([2.0, 4.0, 7.0, 100.0])), 0.9933992678)
    close(correlation(t([1.0, 2.0, 3.0]), t([-1.0, -3.0, -5.0])), -1.0)
    assert math.isnan(correlation(t([1.0, 2.0, 3.0]), t([0.1, 0.1, 0.1])))  # zero variance
    assert math.isnan(correlation(t([1.0, NAN]), t([2.0, 3.0])))  # one pair
    assert math.isnan(correlation(t([]), t([])))
    with pytest.raises(ValueError, match="same number"):
        correlation(t([1.0, 2.0]), t([1.0]))


def test_group_offsets_by_hand_and_what_centering_does_to_the_trust_trials():
    from recursa.algorithms.trust import agreement_trials

    # two groups of 3 attempts; the middle attempt of group 0 had no hint
    mean_delta = t([-0.3, 9.0, -0.1, 0.2, 0.4, 0.6])
    hinted = torch.tensor([True, False, True, True, True, True])
    close(group_offsets(mean_delta, hinted, 3), [-0.2, -0.2, -0.2, 0.4, 0.4, 0.4])  # (-0.3 - 0.1) / 2; (0.2 + 0.4 + 0.6) / 3
    close(group_offsets(mean_delta, torch.zeros(6, dtype=torch.bool), 3), [0.0] * 6)  # no hint: no offset
    with pytest.raises(ValueError, match="groups of 4"):
        group_offsets(mean_delta, hinted, 4)
    with pytest.raises(ValueError, match=r"shape \(A,\)"):
        group_offsets(mean_delta, hinted[:5], 3)

    # a teacher that ranks every group's attempts exactly as the outcome does, but whose hint
    # lowers every log-prob by 0.5: the raw sign agrees on half the trials, the centred on all
    outcome = [1.0, -1.0, 1.0, -1.0]  # two groups of two, one success and one failure each
    raw = t([-0.4, -0.6, -0.3, -0.7])
    centred = raw - group_offsets(raw, torch.ones(4, dtype=torch.bool), 2)
    close(centred, [0.1, -0.1, 0.2, -0.2])
    groups, source = ["s", "s", "s", "s"], [False] * 4
    assert agreement_trials(groups, raw.tolist(), outcome, source, 0.0) == {"s": (2, 4)}
    assert agreement_trials(groups, centred.tolist(), outcome, source, 0.0) == {"s": (4, 4)}
