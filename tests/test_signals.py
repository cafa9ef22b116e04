"""Hand-worked checks of RSIPO's learning signals: hinted re-rolls (recursa/algorithms/hinted.py),
routing by pass rate and the critical step (recursa/algorithms/routing.py), the split of one
aggregation into parts (losses.part_scales) and the skill curator (recursa/skills/curator.py)."""

import math

import pytest
import torch

from recursa.algorithms.hinted import all_failed, anneal, hinted_token_advantages, truncated_importance_weights
from recursa.algorithms.losses import aggregate, part_scales
from recursa.algorithms.routing import critical_weights, divergence_turn, group_routes, route_counts, route_gate
from recursa.skills import Skill, contrastive_writing_prompt, parse_skill
from recursa.skills.curator import junk_reason, near_duplicate, retire_reason, rule_form, similarity, single_action, utility

# ----------------------------------------------------------------------------- hinted re-rolls


def test_anneal_by_hand():
    assert anneal(2.0, 0, 4, "linear") == 2.0
    assert anneal(2.0, 1, 4, "linear") == 1.5  # 2 (1 - 1/4)
    assert anneal(2.0, 4, 4, "linear") == 0.0 and anneal(2.0, 9, 4, "linear") == 0.0  # never negative
    assert anneal(2.0, 2, 4, "cosine") == pytest.approx(1.0)  # 2 (1 + cos(pi/2)) / 2
    assert anneal(2.0, 1, 4, "cosine") == pytest.approx(1.0 + math.cos(math.pi / 4))
    assert anneal(2.0, 3, 4, "constant") == 2.0 and anneal(2.0, 3, 0, "linear") == 2.0  # 0 steps: no annealing
    with pytest.raises(ValueError, match="schedule"):
        anneal(1.0, 0, 4, "step")


def test_all_failed():
    success = torch.tensor([[0, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert all_failed(success).tolist() == [True, False, False]


def test_truncated_importance_weights_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    logp_u = torch.tensor([[-1.0, -0.5, float("nan")], [-3.0, 0.0, 0.0]])  # un-hinted (target)
    logp_h = torch.tensor([[-2.0, -0.4, 0.0], [-0.1, 0.0, 0.0]])  # hinted (behaviour)
    w = truncated_importance_weights(logp_u, logp_h, mask, cap=2.0)
    # exp(1) = 2.718 -> capped at 2; exp(-0.1); exp(-2.9); NaN off the mask never leaks
    want = torch.tensor([[2.0, math.exp(-0.1), 0.0], [math.exp(-2.9), 0.0, 0.0]])
    assert torch.allclose(w, want, atol=1e-6)
    huge = truncated_importance_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), torch.ones(1, 1), cap=3.0)
    assert huge.item() == pytest.approx(3.0)  # no overflow
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(logp_u, logp_h, mask, cap=0.0)


def test_hinted_token_advantages_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    w = torch.tensor([[2.0, 0.5, 9.0], [1.0, 1.0, 0.25]])
    adv = hinted_token_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.25]), w, 0.5, mask)
    # row 0: 0.5 * w * (1 - 0.25); row 1: 0.5 * w * (0 - 0.25)
    want = torch.tensor([[0.75, 0.1875, 0.0], [-0.125, -0.125, -0.03125]])
    assert torch.allclose(adv, want)
    with pytest.raises(ValueError, match="rewards"):
        hinted_token_advantages(torch.tensor([1.0]), torch.tensor([0.0, 0.0]), w, 1.0, mask)


# ----------------------------------------------------------------------------- routing


def test_group_routes_and_counts():
    success = torch.tensor([[0, 0], [1, 0], [1, 1], [0, 0]], dtype=torch.bool)
    routes = group_routes(success)
    assert routes.tolist() == [0, 1, 2, 0]
    assert route_counts(routes) == {"route/all_fail": 2.0, "route/mixed": 1.0, "route/all_win": 1.0}
    assert route_gate(routes, True, True, False).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert route_gate(routes, False, True, True).tolist() == [0.0, 1.0, 1.0, 0.0]
    assert group_routes(torch.tensor([[1]], dtype=torch.bool)).tolist() == [2]  # G = 1: won is all-win


def test_divergence_turn_by_hand():
    won = [("room 0", "go east"), ("room 1", "take key"), ("room 1 key", "go east"), ("room 2", "open door")]
    assert divergence_turn([("room 0", "go east"), ("room 1", "go west"), ("room 0", "wait")], won) == 1
    assert divergence_turn([("room 0", "wait"), ("room 0", "go east")], won) == 0
    # the same actions but another observation: the game was not deterministic here, no verdict
    assert divergence_turn([("room 0", "go east"), ("room 9", "take key")], won) is None
    # the failed attempt stopped while still on the winning path (e.g. out of steps): no verdict
    assert divergence_turn(won[:2], won) is None


def test_critical_weights_by_hand():
    assert critical_weights(5, 2, "from", 0.0) == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert critical_weights(5, 2, "at", 0.25) == [0.25, 0.25, 1.0, 0.25, 0.25]
    assert critical_weights(3, None, "from", 0.0, unmatched=0.5) == [0.5, 0.5, 0.5]
    assert critical_weights(1, 0, "from") == [1.0]  # a single-turn attempt: unchanged
    with pytest.raises(ValueError, match="turn"):
        critical_weights(3, 3, "from")


# ----------------------------------------------------------------------------- aggregation parts


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_part_scales_make_one_aggregation_the_sum_of_the_parts(mode):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[0.3, -1.0, 5.0], [2.0, 0.0, 0.0], [0.5, 0.5, -0.5], [0.0, 1.5, 1.0], [-2.0, 0.0, 0.0]])
    sizes = [2, 0, 2, 1]
    scales = part_scales(mask, sizes, mode)
    if mode == "token-mean":
        assert scales == [9 / 3, 0.0, 9 / 5, 9 / 1]
    else:
        assert scales == [5 / 2, 0.0, 5 / 2, 5 / 1]
    row_scale = torch.tensor([scales[0]] * 2 + [scales[2]] * 2 + [scales[3]])[:, None]
    whole = aggregate(values * row_scale, mask, mode, norm_len=3)
    parts = aggregate(values[:2], mask[:2], mode, norm_len=3) + aggregate(values[2:4], mask[2:4], mode, norm_len=3) + aggregate(values[4:], mask[4:], mode, norm_len=3)
    assert whole.item() == pytest.approx(parts.item())
    assert part_scales(mask, [5, 0, 0], mode) == [1.0, 1.0, 1.0]  # one part: unchanged
    with pytest.raises(ValueError, match="sum"):
        part_scales(mask, [2, 2], mode)


# ----------------------------------------------------------------------------- curator


def _skill(text, sid=1, trials=0.0, agree=0.0, reward=None, created=1):
    return Skill(sid, text, "g", 1, None, 0, 1, "failure", created, trust_successes=agree, trust_trials=trials, replay_reward=reward)


def test_single_action_rules():
    actions = ["take makeup kit", "open wastepaper basket", "put eyeliner in dressing table", "go east"]
    assert single_action("Take the makeup kit.", actions)
    assert single_action("Always open wastepaper basket", actions)
    assert single_action("put eyeliner in dressing table", actions)
    assert not single_action("Take the makeup kit, then put it in the dresser.", actions)
    assert not single_action("Open the basket before you take anything.", actions)
    assert not single_action("go", actions)  # a part of an action is not that action
    assert not single_action("take makeup kit", [])


def test_junk_rules():
    assert junk_reason("and nothing else") == "fragment"
    assert junk_reason("Nothing else matters here.") == "fragment"
    assert junk_reason("Do it now then.") == "no_content"  # one content word ("do")
    assert junk_reason("Open the drawer before taking the key.") is None
    assert junk_reason("...") == "no_content"


def test_near_duplicates_by_jaccard():
    a = "Open the drawer before taking the key."
    assert similarity(a, "open drawer before taking key") == 1.0  # stopwords do not count
    assert similarity("go east", "do not go east") == pytest.approx(2 / 4)  # "not" counts
    lib = [_skill("Always go east to the exit.", 1), _skill("Open the drawer before taking the key.", 2)]
    assert near_duplicate("open the drawer, then take the key", lib, 0.5).id == 2  # {open, drawer, key} / {open, drawer, take, key, taking, before}
    assert near_duplicate("read the manual", lib, 0.5) is None
    with pytest.raises(ValueError, match="threshold"):
        near_duplicate(a, lib, 0.0)


def test_utility_and_retirement_rules():
    # enough decayed trials: utility is 2 a/n - 1
    assert utility(_skill("x", trials=4.0, agree=3.0), 5, 4.0, 3) == pytest.approx(0.5)
    assert retire_reason(_skill("x", trials=4.0, agree=2.0), 5, 4.0, 3) == "agreement"  # 2 a/n - 1 = 0: retired
    assert retire_reason(_skill("x", trials=5.0, agree=3.0), 5, 4.0, 3) is None
    # too few trials: judged by the replay reward once grace_steps old, kept before
    young = _skill("x", trials=1.0, agree=0.0, reward=-0.01, created=4)
    assert utility(young, 5, 4.0, 3) is None and retire_reason(young, 5, 4.0, 3) is None
    assert retire_reason(young, 7, 4.0, 3) == "replay"
    assert retire_reason(_skill("x", reward=0.02, created=1), 9, 4.0, 3) is None
    assert retire_reason(_skill("x", reward=None, created=1), 9, 4.0, 3) is None  # never measured


def test_rule_form():
    assert rule_form("When the door is locked, take the key first, not the lamp.")
    assert rule_form("If you see a basket, open it instead of walking away")
    assert not rule_form("Take the key, not the lamp.")
    assert not rule_form("When the door is locked, take the key.")


def test_contrastive_prompt_shows_both_attempts_and_asks_for_a_rule():
    text = contrastive_writing_prompt("Task: t\n1. go east\nOutcome: SUCCESS", "Task: t\n1. wait\nOutcome: FAILURE", 20)
    assert text.index("SUCCESSFUL ATTEMPT") < text.index("go east") < text.index("FAILED ATTEMPT") < text.index("wait")
    assert "When <situation>, do" in text and "at most 20 words" in text and text.rstrip().endswith("nothing else.")
    assert parse_skill("SKILL: When the exit is east, go east, not wait.", 20, 300).valid
