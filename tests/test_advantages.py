"""Hand-worked checks of the outcome advantage estimators."""

import math

import pytest
import torch

from recursa.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo,
    gopo,
    gopo_avg,
    grpo,
    reinforce_pp,
    rloo,
)

# Shared example: 3 groups of G = 4.
#   group 0: [1, 0, 0, 1]  mean 0.5,  deviations [+.5, -.5, -.5, +.5]
#            unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773502692
#   group 1: [0, 0, 0, 0]  zero variance
#   group 2: [1, 1, 1, 0]  mean 0.75, deviations [+.25, +.25, +.25, -.75]
#            unbiased var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std = 0.5
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])

# A constant group whose float32 mean is NOT exactly 0.1 (0.1 * 7 / 7 rounds),
# so a naive r - mean would leave ~1e-8 and grpo would blow it up to ~1e-2.
ROUNDING_CONSTANT = torch.full((1, 7), 0.1)


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


def test_grpo_hand_example():
    # group 0: +-0.5 / 0.5773502692 = +-0.8660254038 (= sqrt(3)/2)
    # group 2: [.25, .25, .25, -.75] / 0.5 = [.5, .5, .5, -1.5]
    expected = [
        [0.8660254038, -0.8660254038, -0.8660254038, 0.8660254038],
        [0.0, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.5, -1.5],
    ]
    close(grpo(REWARDS, eps=0.0), expected)
    # default eps = 1e-6 shrinks group 0 to 0.5 / 0.5773512692 = 0.8660239038
    close(grpo(REWARDS)[0, 0], 0.8660239038, atol=1e-6)


def test_grpo_uses_unbiased_std():
    # [0, 2]: mean 1, unbiased std = sqrt(2 / 1) = 1.4142135624 -> A = +-0.7071067812
    # (the biased std would be 1 -> A = +-1)
    close(grpo(torch.tensor([[0.0, 2.0]]), eps=0.0), [[-0.7071067812, 0.7071067812]])


def test_dr_grpo_hand_example():
    expected = [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.25, 0.25, 0.25, -0.75]]
    close(dr_grpo(REWARDS), expected)


def test_rloo_hand_example():
    # group 0: r=1, others {0,0,1} mean 1/3 -> 2/3;  r=0, others {1,0,1} mean 2/3 -> -2/3
    # group 2: r=1, others {1,1,0} mean 2/3 -> 1/3;  r=0, others {1,1,1} mean 1  -> -1
    expected = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4, [1 / 3, 1 / 3, 1 / 3, -1.0]]
    close(rloo(REWARDS), expected)


def test_rloo_identity_with_explicit_leave_one_out():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    explicit = torch.empty_like(rewards)
    for b in range(5):
        for i in range(6):
            others = torch.cat([rewards[b, :i], rewards[b, i + 1 :]])
            explicit[b, i] = rewards[b, i] - others.mean()
    close(rloo(rewards), explicit, atol=1e-12)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="G >= 2"):
        rloo(torch.tensor([[1.0], [0.0]]))


def test_reinforce_pp_hand_example():
    # group-centred c = dr_grpo above; its batch mean is 0, sum of squares
    # = 4 * 0.25 + 3 * 0.0625 + 0.5625 = 1.75 over 12 values,
    # unbiased std = sqrt(1.75 / 11) = 0.3988620176.
    #   0.5 / 0.3988620176 = 1.2535663410, 0.25 / ... = 0.6267831705, -0.75 / ... = -1.8803495115
    expected = [
        [1.2535663410, -1.2535663410, -1.2535663410, 1.2535663410],
        [0.0] * 4,
        [0.6267831705, 0.6267831705, 0.6267831705, -1.8803495115],
    ]
    close(reinforce_pp(REWARDS), expected, atol=1e-5)


def test_reinforce_pp_normalises_globally_not_per_group():
    # Scaling group 1's rewards by 10 must change group 0's advantages (shared std),
    # which per-group normalisation (grpo) would not.
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    # c = [[.5, -.5], [.5, -.5]], std over 4 values = sqrt(1 / 3) = 0.5773502692 -> +-0.8660254038
    close(reinforce_pp(rewards, eps=0.0), [[0.8660254038, -0.8660254038]] * 2)
    scaled = torch.tensor([[1.0, 0.0], [10.0, 0.0]])
    # c = [[.5, -.5], [5, -5]], sum sq = 50.5, std = sqrt(50.5 / 3) = 4.1028445417
    #   0.5 / 4.1028445417 = 0.1218666696, 5 / 4.1028445417 = 1.2186666956
    close(reinforce_pp(scaled, eps=0.0), [[0.1218666696, -0.1218666696], [1.2186666956, -1.2186666956]])
    close(grpo(scaled, eps=0.0)[0], [0.7071067812, -0.7071067812])


def test_reinforce_pp_is_not_recentred_over_the_batch():
    # In float32 the group-centred values of [0.1, 0.2, 0.4] sum to -4.47e-8, not 0,
    # so re-centring over the batch would leak a nonzero advantage into the constant group.
    rewards = torch.tensor([[0.1, 0.2, 0.4], [1.0, 1.0, 1.0]])
    centred = rewards[0] - rewards[0].mean()
    assert centred.sum() != 0, "precondition: rounding leaves a residue"
    out = reinforce_pp(rewards)
    assert torch.equal(out[1], torch.zeros(3))
    # group 0: mean 0.7 / 3, c = [-0.1333333, -0.0333333, 0.1666667]
    # std over 6 values (mean 0): sqrt((0.0177778 + 0.0011111 + 0.0277778) / 5) = 0.0966092
    close(reinforce_pp(rewards, eps=0.0)[0], [-1.3801311, -0.3450328, 1.7251639], atol=1e-5)


def test_reinforce_pp_all_zero_variance_batch_gives_zeros():
    out = reinforce_pp(torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.3, 0.3]]))
    assert torch.equal(out, torch.zeros(3, 2))


def test_gopo_hand_example():
    # Paper / release: A = 2 - 4 (rho - 1) / (G - 1), rho the descending rank, ties by sort
    # order (stable: the earlier rollout ranks higher). G = 4: rho 1..4 -> [2, 2/3, -2/3, -2].
    # group 0 [1, 0, 0, 1]: rho = [1, 3, 4, 2]; group 1 constant: rho = [1, 2, 3, 4];
    # group 2 [1, 1, 1, 0]: rho = [1, 2, 3, 4]  (issue 50: was half the scale, ties averaged)
    expected = [[2.0, -2 / 3, -2.0, 2 / 3], [2.0, 2 / 3, -2 / 3, -2.0], [2.0, 2 / 3, -2 / 3, -2.0]]
    close(gopo(REWARDS), expected)


def test_gopo_paper_scale_and_ties():
    close(gopo(torch.tensor([[0.0, 1.0, 2.0]])), [[-2.0, 0.0, 2.0]])  # the example
    close(gopo(torch.tensor([[5.0, 5.0, 1.0]])), [[2.0, 0.0, -2.0]])  # tie broken by order
    # [3, -1, 10, 0.5]: rho = [2, 4, 1, 3]
    close(gopo(torch.tensor([[3.0, -1.0, 10.0, 0.5]])), [[2 / 3, -2.0, 2.0, -2 / 3]])
    # [2, 5, 2, 7, 5], G = 5, A = 2 - (rho - 1): 7 rho 1, 5s rho 2, 3, 2s rho 4, 5
    close(gopo(torch.tensor([[2.0, 5.0, 2.0, 7.0, 5.0]])), [[-1.0, 1.0, -2.0, 2.0, 0.0]])
    assert torch.equal(gopo(torch.tensor([[4.0]])), torch.zeros(1, 1))


def test_gopo_avg_ties_share_their_average_rank_by_hand():
    """rho - 1 = #greater + (#equal - 1) / 2, A = 2 - 4 (rho - 1) / (G - 1)."""
    close(gopo_avg(torch.tensor([[5.0, 5.0, 1.0]])), [[1.0, 1.0, -2.0]])  # the release: [2, 0, -2]
    # [2, 5, 2, 7, 5], G = 5: 7 -> 0 -> 2; the 5s 1 + 1/2 -> 1/2; the 2s 3 + 1/2 -> -3/2
    close(gopo_avg(torch.tensor([[2.0, 5.0, 2.0, 7.0, 5.0]])), [[-1.5, 0.5, -1.5, 2.0, 0.5]])
    # REWARDS: [1, 0, 0, 1] -> ranks 1/2, 5/2 -> +-4/3; constant -> 0; [1, 1, 1, 0] -> rank 1 -> 2/3, rank 3 -> -2
    close(gopo_avg(REWARDS), [[4 / 3, -4 / 3, -4 / 3, 4 / 3], [0.0] * 4, [2 / 3, 2 / 3, 2 / 3, -2.0]])
    # without ties it is GOPO itself
    distinct = torch.tensor([[3.0, -1.0, 10.0, 0.5]])
    assert torch.equal(gopo_avg(distinct), gopo(distinct))
    assert torch.equal(gopo_avg(torch.tensor([[4.0]])), torch.zeros(1, 1))
    assert torch.equal(compute_advantages("gopo_avg", REWARDS), gopo_avg(REWARDS))


def test_grpo_run_with_gopo_avg(tmp_path):
    import json
    from pathlib import Path

    from recursa.config import load_config
    from recursa.recipes import grpo as recipe

    smoke = str(Path(__file__).resolve().parents[1] / "examples" / "smoke.toml")
    cfg = load_config(smoke, ["model.name=tiny-random", "run.threads=1", "eval.n=2", "train.steps=2", "algo.advantage=gopo_avg"])
    run = recipe.train(cfg, tmp_path / "gopo_avg", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]
    assert len(rows) == 2
    for r in rows:  # a constant group contributes 0, a mixed one at most 2 in absolute value
        assert 0.0 <= r["advantage/abs_mean"] <= 2.0
        if r["reward/zero_std_groups"] == 1.0:
            assert r["advantage/abs_mean"] == 0.0


def test_gopo_monotone_invariance():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(-3, 4, (6, 8), generator=gen).double()  # many ties
    transformed = rewards.pow(3) + torch.exp(rewards)  # strictly increasing map
    assert torch.equal(gopo(rewards), gopo(transformed))
    # grpo is not invariant under the same transform (sanity check that the test bites)
    assert not torch.allclose(grpo(rewards), grpo(transformed))


@pytest.mark.parametrize("name", sorted(set(ESTIMATORS) - {"gopo"}))  # GOPO ranks a constant group by order, as its release does
def test_zero_variance_groups_are_exactly_zero(name):
    out = compute_advantages(name, REWARDS)
    assert torch.equal(out[1], torch.zeros(4))
    # constant group whose float mean is off by rounding, next to a normal group
    rewards = torch.cat([ROUNDING_CONSTANT, torch.arange(7.0).unsqueeze(0)])
    naive = rewards[0] - rewards[0].mean()
    assert (naive != 0).any(), "precondition: rounding leaves a residue"
    out = compute_advantages(name, rewards)
    assert torch.equal(out[0], torch.zeros(7))
    assert (out[1] != 0).any()


def test_compute_advantages_dispatch_and_unknown_name():
    close(compute_advantages("dr_grpo", REWARDS)[2], [0.25, 0.25, 0.25, -0.75])
    with pytest.raises(ValueError, match="dr_grpo.*gopo.*grpo.*reinforce_pp.*rloo"):
        compute_advantages("ppo", REWARDS)


def test_bad_rewards_raise():
    with pytest.raises(ValueError, match=r"\(B, G\)"):
        grpo(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="NaN"):
        dr_grpo(torch.tensor([[1.0, math.nan]]))
    with pytest.raises(ValueError, match="eps"):
        grpo(REWARDS, eps=-1.0)


def test_integer_rewards_are_accepted():
    close(dr_grpo(torch.tensor([[1, 0]])), [[0.5, -0.5]])
