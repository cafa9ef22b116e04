"""Branching rollouts (`rollout.branch`): the branch-turn rules and the advantage math against
hand computations, replay correctness on the deterministic games, the refusals, and the GRPO
recipe end to end on the tiny model with each mode (episode counts, metrics, resume)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from recursa.agent import AgentConfig
from recursa.algorithms.advantages import dr_grpo, grpo
from recursa.algorithms.branching import branch_advantages, branch_turn, doubt_turn, mean_logprob, turn_advantages
from recursa.branching import BranchPoint, branch_points, check_replay
from recursa.config import load_config
from recursa.distributed.rollouts import RolloutRequest
from recursa.engines import NativeEngine
from recursa.envs import StepResult, make_env, register_env
from recursa.errors import UserError
from recursa.generation import SamplingParams, group_generators
from recursa.recipes.grpo import train
from recursa.rollout import rollout_episodes

from conftest import CorridorEnv

HOUSEHOLD_KW = dict(rooms=1, objects_per_room=2, distractors=0, tasks="pick_and_place", max_steps=6)
HOUSEHOLD = 'env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, tasks = "pick_and_place", max_steps = 4}'
FAST = ["model.name=tiny-random", "run.threads=1", "sampling.max_new_tokens=5", "eval.n=2", "train.lr=1e-3"]
TALLY = [*FAST, "env.name=toy-tally", "env.kwargs={max_steps = 4}", "train.prompts_per_step=2", "train.group_size=2"]
TIME_KEYS = ("time/", "throughput/")


class TallyEnv:
    """Toy deterministic game where every reply counts (no admissible list): reward 0.25 for a
    reply of even length, so the tiny model's episodes (and branches) get different returns."""

    name = "toy-tally"
    system_prompt = None
    invalid_penalty = 0.0

    def __init__(self, max_steps: int = 4):
        self.max_steps, self.steps, self.total, self.task = max_steps, 0, 0.0, ""

    def reset(self, seed: int) -> str:
        self.steps, self.total = 0, 0.0
        self.task = f"Your task is to: write {random.Random(seed).randint(2, 9)} even replies."
        return "Nothing written yet."

    def admissible_actions(self):
        return None

    def walkthrough(self):
        return None

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        reward = 0.25 if len(action_text) % 2 == 0 else 0.0
        self.total += reward
        done = self.steps >= self.max_steps
        info = {"won": False, "success": False, "invalid": False, "admissible": None, "steps": self.steps, "score": self.total}
        return StepResult(f"Step {self.steps}: {len(action_text)} characters, tally {self.total}.", reward, done, info)


register_env("toy-tally", TallyEnv, "toy: a deterministic game scoring replies of even length (tests)")


# ----------------------------------------------------------------------------- the math


def test_doubt_turn_by_hand():
    # mean log-probs: -1, -2, (no tokens: skipped), -0.5 -> turn 1
    assert mean_logprob([-3.0, -1.0]) == -2.0 and mean_logprob([]) == 0.0
    assert doubt_turn([[-1.0, -1.0], [-3.0, -1.0], [], [-0.5]]) == 1
    assert doubt_turn([[-2.0], [-1.0, -3.0]]) == 0  # a tie goes to the earliest turn
    assert doubt_turn([[], []]) == 0  # no turn has tokens


def test_branch_turn_rules():
    lp = [[-1.0]] * 5
    g = torch.Generator().manual_seed(0)
    assert branch_turn(lp, "last", 2, g) == 3 and branch_turn(lp, "last", 1, g) == 4 and branch_turn(lp, "last", 9, g) == 0
    assert branch_turn([[-1.0], [-4.0], [-2.0]], "doubt", 1, g) == 1
    state = g.get_state()
    assert branch_turn([[-1.0]], "random", 1, g) == 0 and torch.equal(g.get_state(), state)  # one turn: t = 0, no draw
    draws = [branch_turn(lp, "random", 1, g) for _ in range(200)]
    assert set(draws) == {1, 2, 3, 4}  # uniform over the turns past the first
    again = torch.Generator().manual_seed(0)
    branch_turn([[-1.0]], "random", 1, again)
    assert [branch_turn(lp, "random", 1, again) for _ in range(200)] == draws  # reproducible from the generator
    with pytest.raises(ValueError):
        branch_turn(lp, "sideways", 1, g)
    with pytest.raises(ValueError):
        branch_turn([], "last", 1, g)


def test_branch_advantages_by_hand_grpo():
    # One group, G = 2 roots with returns [1, 0]; source 0 branched, K = 2 continuations, both 0.
    # Extended group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.5625 + 3 x 0.0625) / 3) = 0.5
    #   -> A_E = [1.5, -0.5, -0.5, -0.5].
    # Branch group [1, 0, 0] (source first): mean 1/3, unbiased std sqrt((4/9 + 2/9) / 2) = 1/sqrt(3)
    #   -> A_B = [(2/3) sqrt(3), -(1/3) sqrt(3), -(1/3) sqrt(3)] = [1.1547, -0.57735, -0.57735].
    adv = branch_advantages(grpo, torch.tensor([[1.0, 0.0]]), torch.tensor([[[0.0, 0.0]]]))
    torch.testing.assert_close(adv.episode, torch.tensor([[1.5, -0.5, -0.5, -0.5]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv.branch, torch.tensor([[[1.1547005, -0.5773503, -0.5773503]]]), atol=1e-5, rtol=0)
    # root 0 has 3 turns, branched at t = 1; root 1 has 2 turns; the continuations sampled 2 and 1 turns.
    # w = 0.5: root 0's turns 1, 2 get 0.5 x 1.1547 = 0.57735; the continuations' turns 0.5 x -0.57735.
    outer, terms = turn_advantages(adv, root_turns=[3, 2], source_turns=[[1]], continuation_turns=[2, 1], weight=0.5)
    assert outer == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert terms[0] == pytest.approx([0.0, 0.57735, 0.57735], abs=1e-5)
    assert terms[1] == [0.0, 0.0]
    assert terms[2] == pytest.approx([-0.288675, -0.288675], abs=1e-5) and terms[3] == pytest.approx([-0.288675], abs=1e-5)


def test_branch_advantages_by_hand_two_groups_two_sources():
    # dr_grpo (r - mean), B = 2, G = 2, S = 2 (both roots branched), K = 1.
    # group 0: roots [1, 0], continuations of source 0: [1], of source 1: [1]
    #   extended [1, 0, 1, 1], mean 0.75 -> A_E [0.25, -0.75, 0.25, 0.25]
    #   branches [1, 1] -> [0, 0];  [0, 1] -> [-0.5, 0.5]
    # group 1: roots [0, 0], continuations [0], [1]
    #   extended [0, 0, 0, 1], mean 0.25 -> [-0.25, -0.25, -0.25, 0.75]
    #   branches [0, 0] -> [0, 0];  [0, 1] -> [-0.5, 0.5]
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    cont = torch.tensor([[[1.0], [1.0]], [[0.0], [1.0]]])
    adv = branch_advantages(dr_grpo, rewards, cont)
    torch.testing.assert_close(adv.episode, torch.tensor([[0.25, -0.75, 0.25, 0.25], [-0.25, -0.25, -0.25, 0.75]]))
    torch.testing.assert_close(adv.branch, torch.tensor([[[0.0, 0.0], [-0.5, 0.5]], [[0.0, 0.0], [-0.5, 0.5]]]))
    # episodes: roots b G + g (2 turns each), then continuations (b S + s) K + j (1 sampled turn each); all branched at t = 1
    outer, terms = turn_advantages(adv, [2, 2, 2, 2], [[1, 1], [1, 1]], [1, 1, 1, 1], weight=1.0)
    assert outer == pytest.approx([0.25, -0.75, -0.25, -0.25, 0.25, 0.25, -0.25, 0.75])
    assert terms == [[0.0, 0.0], [0.0, -0.5], [0.0, 0.0], [0.0, -0.5], [0.0], [0.5], [0.0], [0.5]]
    with pytest.raises(ValueError):
        branch_advantages(grpo, rewards, torch.zeros(2, 3, 1))  # 3 sources in groups of 2
    with pytest.raises(ValueError):
        turn_advantages(adv, [2, 2, 2], [[1, 1], [1, 1]], [1, 1, 1, 1], 1.0)


# ----------------------------------------------------------------------------- replay


def _household():
    return make_env("household", **HOUSEHOLD_KW)


def test_a_replayed_prefix_reaches_the_walkthrough_states(tiny_policy):
    """prefixes: every episode of the seed replays the actions (token-less turns with the game's
    own observations and rewards), then samples from the state they reach."""
    seed = 11
    env = _household()
    first = env.reset(seed)
    plan = env.walkthrough()
    assert len(plan) >= 3
    expected, obs = [], first
    for action in plan[:2]:
        result = env.step(action)
        expected.append((obs, action, result.reward))
        obs = result.obs
    ro = rollout_episodes(tiny_policy, _household, [seed], 2, SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0), None,
                          AgentConfig(), prefixes=[plan[:2]])
    for ep in ro.episodes:
        assert ep.branch_turn == 2 and len(ep.turns) > 2
        assert [(t.observation, t.action, t.reward) for t in ep.turns[:2]] == expected
        assert all(t.prompt_ids == [] and t.action_ids == [] for t in ep.turns[:2])
        assert ep.turns[2].observation == obs and ep.turns[2].action_ids  # sampling starts where the replay left the game
        assert len(ep.rows()) == len(ep.turns) - 2 and ep.rows()[0].info["turn"] == 2
    # a prefix that wins the game ends the episode before anything is sampled
    won = rollout_episodes(tiny_policy, _household, [seed], 1, SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0), None,
                           AgentConfig(), prefixes=[plan]).episodes[0]
    assert won.won and won.finish_reason == "won" and len(won.turns) == len(plan) and won.rows() == []


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("game", ["household", "toy-corridor"])
def test_a_branch_replays_its_source_episode(tiny_policy, game, continuous):
    """Branch points of sampled episodes, replayed: the continuations see the source's
    observations, rewards and anchors on the replayed turns, and their first sampled turn has
    exactly the source's prompt at the branch turn (same history, same state)."""
    factory = _household if game == "household" else (lambda: make_env("toy-corridor", max_steps=4))
    params = SamplingParams(max_new_tokens=5)
    engine = NativeEngine(tiny_policy, continuous=True, max_rows=4) if continuous else None
    gen = group_generators(torch.Generator().manual_seed(3), 2)
    roots = rollout_episodes(tiny_policy, factory, [5, 6], 2, params, gen, None, AgentConfig(), engine=engine).episodes
    points = branch_points(roots, 2, 2, "last", 2, torch.Generator().manual_seed(0))
    assert [(p.group, p.source) for p in points] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert all(p.turn == len(roots[p.source].turns) - 2 and len(p.prefix) == p.turn for p in points)
    conts = rollout_episodes(tiny_policy, factory, [p.seed for p in points], 2, params, group_generators(torch.Generator().manual_seed(4), 4), None,
                             AgentConfig(), engine=engine, prefixes=[list(p.prefix) for p in points]).episodes
    for i, cont in enumerate(conts):
        p = points[i // 2]
        source = roots[p.source]
        assert cont.branch_turn == p.turn
        for u in range(p.turn):
            a, b = cont.turns[u], source.turns[u]
            assert (a.observation, a.action, a.reward, a.invalid, a.anchor, a.admissible) == (b.observation, b.action, b.reward, b.invalid, b.anchor, b.admissible)
        assert cont.turns[p.turn].prompt_ids == source.turns[p.turn].prompt_ids
    check_replay(roots, points, conts, 2)  # passes on a deterministic game


def test_empty_prefixes_change_no_sample(tiny_policy):
    params = SamplingParams(max_new_tokens=5)
    plain = rollout_episodes(tiny_policy, _household, [1, 2], 2, params, torch.Generator().manual_seed(0), None, AgentConfig())
    empty = rollout_episodes(tiny_policy, _household, [1, 2], 2, params, torch.Generator().manual_seed(0), None, AgentConfig(), prefixes=[[], []])
    for a, b in zip(plain.episodes, empty.episodes):
        assert a.branch_turn is None and b.branch_turn == 0
        assert [(t.prompt_ids, t.action_ids, t.action_logprobs) for t in a.turns] == [(t.prompt_ids, t.action_ids, t.action_logprobs) for t in b.turns]
    with pytest.raises(ValueError):
        rollout_episodes(tiny_policy, _household, [1, 2], 2, params, None, None, AgentConfig(), prefixes=[[]])


def test_a_request_shards_its_prefixes():
    req = RolloutRequest([1, 2, 3], 2, SamplingParams(), None, AgentConfig(), None, [["a"], [], ["b", "c"]])
    assert req.shard(1, 3).seeds == [2, 3] and req.shard(1, 3).prefixes == [[], ["b", "c"]]
    assert RolloutRequest([1, 2], 2, SamplingParams(), None).shard(0, 1).prefixes is None


class DriftingCorridor(CorridorEnv):
    """Not deterministic: the start room alternates with every reset, whatever the seed."""

    name = "toy-drifting"
    resets = 0

    def reset(self, seed: int) -> str:
        super().reset(seed)
        DriftingCorridor.resets += 1
        self.pos = DriftingCorridor.resets % 2
        return self._obs()


register_env("toy-drifting", DriftingCorridor, "toy: a corridor whose start ignores the seed (tests)")


def test_check_replay_names_a_game_that_is_not_deterministic():
    source_turns = [type("T", (), {"observation": f"room {u}", "reward": 0.0})() for u in range(3)]
    other = [type("T", (), {"observation": "elsewhere", "reward": 0.0})() for _ in range(3)]
    from recursa.trajectory import Episode

    roots = [Episode("g", 7, 0, "task", source_turns, False, "max_steps")]
    point = BranchPoint(0, 0, 7, 1, ("go east",))
    check_replay(roots, [point], [Episode("g", 7, 0, "task", source_turns, False, "max_steps", branch_turn=1)], 1)
    with pytest.raises(UserError, match="turn 0's observation differs.*deterministic"):
        check_replay(roots, [point], [Episode("g", 7, 0, "task", other, False, "max_steps", branch_turn=1)], 1)
    check_replay(roots, [point], [Episode("g", 7, 0, "task", other[:1], False, "crashed", branch_turn=1)], 1)  # a crashed game is exempt
    with pytest.raises(UserError, match="ended after 1 of the 2"):
        check_replay(roots, [BranchPoint(0, 0, 7, 2, ("a", "b"))], [Episode("g", 7, 0, "task", source_turns[:1], False, "lost", branch_turn=2)], 1)


def test_branching_refuses_a_game_that_is_not_deterministic(tmp_path):
    cfg = load_config(None, [*FAST, "env.name=toy-drifting", "env.kwargs={max_steps = 3}", "train.steps=1", "train.prompts_per_step=1",
                             "train.group_size=2", "rollout.branch=last", "rollout.branch_k=2"])
    with pytest.raises(UserError) as err:
        train(cfg, tmp_path / "run", log=lambda *_: None)
    assert "deterministic" in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- refusals


def test_branching_refuses_a_single_turn_task(tmp_path):
    cfg = load_config(None, [*FAST, "env.name=toy-digits", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "rollout.branch=random"])
    with pytest.raises(UserError) as err:
        train(cfg, tmp_path / "run", log=lambda *_: None)
    assert "single-turn" in str(err.value) and "rollout.branch = 'off'" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run" / "config.toml").exists()  # refused before the run directory was written


@pytest.mark.parametrize("recipe", ["rsipo", "rft", "sft"])
def test_branching_is_a_grpo_option(recipe):
    with pytest.raises(UserError, match="rollout.branch = 'random' is an option of the grpo recipe"):
        load_config(None, ["rollout.branch=random"], recipe=recipe)


def test_more_sources_than_a_group_has_is_refused():
    with pytest.raises(UserError, match="rollout.branch_sources"):
        load_config(None, ["rollout.branch=doubt", "train.group_size=2", "rollout.branch_sources=3"])
    load_config(None, ["train.group_size=2", "rollout.branch_sources=3"])  # ignored while branching is off


# ----------------------------------------------------------------------------- the recipe


def test_the_example_config_spends_the_benchmark_budget():
    """examples/branch_household.toml: the 135M model from the household SFT run, 32 episodes a
    step (the benchmark's GRPO B x G = 4 x 8) and extended groups of 8."""
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "branch_household.toml")
    B, G, rc = cfg.train.prompts_per_step, cfg.train.group_size, cfg.rollout
    assert cfg.init.from_run == "runs/household_sft" and cfg.model.name == "smollm2-135m-instruct" and rc.branch != "off"
    assert B * G + B * rc.branch_sources * rc.branch_k == 4 * 8 and G + rc.branch_sources * rc.branch_k == 8


def _train_rows(run) -> list[dict]:
    return [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


@pytest.mark.parametrize("mode, extra", [("random", []), ("last", []), ("doubt", []), ("doubt", ["rollout.continuous=true", "rollout.max_rows=4"])])
def test_grpo_with_branches_on_a_game(tmp_path, mode, extra):
    """B = 2 groups of G = 2 episodes of 4 turns, one source per group, K = 3: 4 + 2 x 3 = 10
    episodes per step, every metric finite, one row per root turn plus one per sampled
    continuation turn (also with continuous batching)."""
    cfg = load_config(None, [*TALLY, "train.steps=2", f"rollout.branch={mode}", "rollout.branch_k=3", "rollout.branch_last=2",
                             "algo.step_advantage=gigpo", *extra])
    rows = _train_rows(train(cfg, tmp_path / mode, log=lambda *_: None))
    assert len(rows) == 2
    for k, r in enumerate(rows):
        assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for v in r.values()), r
        assert r["episodes/sampled"] == 2 * 2 + 2 * 3 and r["budget/episodes"] == (k + 1) * 10
        assert r["branch/branches"] == 2 and r["branch/episodes"] == 6
        assert 0.0 <= r["branch/nonzero_frac"] <= 1.0 and 0.0 <= r["branch/success_rate"] <= 1.0
        assert r["episode/turns_mean"] == 4.0  # every game lasts max_steps
        t = r["branch/turn_mean"]
        assert {"random": 1 <= t <= 3, "last": t == 2.0, "doubt": 0 <= t <= 3}[mode]
        assert r["batch/rows"] == 2 * 2 * 4 + 3 * 2 * (4 - t)  # roots' turns + the continuations' sampled turns
    assert any(r["branch/nonzero_frac"] > 0 for r in rows)  # replies of odd and even length: branches differ


def test_branching_leaves_the_step_episodes_alone(tmp_path):
    """The first step's own episodes are sampled before any branch: with branching on they are
    the episodes of the run without it (reward/* and episode/* equal)."""
    off = _train_rows(train(load_config(None, [*TALLY, "train.steps=1"]), tmp_path / "off", log=lambda *_: None))[0]
    on = _train_rows(train(load_config(None, [*TALLY, "train.steps=1", "rollout.branch=doubt"]), tmp_path / "on", log=lambda *_: None))[0]
    keys = [k for k in off if k.startswith(("reward/", "episode/")) and k != "episode/step_adv_abs_mean"]
    assert "reward/mean" in keys and {k: off[k] for k in keys} == {k: on[k] for k in keys}
    assert on["episodes/sampled"] == off["episodes/sampled"] + 2 * 4 and "branch/branches" not in off


def test_branch_advantage_reaches_the_continuation_rows_only(tmp_path):
    """The logged row advantages: the continuations' rows are their own (prefix turns make no
    rows), and turning branch_weight from 0 to 1 changes only rows from the branch turn on."""
    sets = [*TALLY, "train.steps=1", "rollout.branch=last", "rollout.branch_k=2", "rollout.branch_last=1", "run.log_samples=64",
            "train.prompts_per_step=1"]
    runs = {w: train(load_config(None, [*sets, f"rollout.branch_weight={w}"]), tmp_path / f"w{w}", log=lambda *_: None) for w in (0, 1)}
    samples = {w: [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()] for w, run in runs.items()}
    a, b = samples[0], samples[1]
    assert len(a) == len(b) == 2 * 4 + 2 * 1  # G = 2 roots of 4 turns, K = 2 continuations re-deciding the last turn
    changed = [i for i, (x, y) in enumerate(zip(a, b)) if x["advantage"] != pytest.approx(y["advantage"], abs=1e-6)]
    # root 0 is the source (its turn 3), root 1's rows never change, the continuations are rows 8, 9
    assert changed and set(changed) <= {3, 8, 9}
    assert [x["completion"] for x in a] == [y["completion"] for y in b]  # the same samples either way


def transcript_actions(prompts, completions, **fields):
    """A [[reward]] function: the number of actions in the episode's transcript."""
    return [float(len(c.split("\n"))) for c in completions]


def test_a_reward_function_scores_a_continuation_as_the_whole_game(tmp_path):
    """With the env's reward weighted 0 and R = the transcript's action count, every game (4
    turns) scores 4, continuations included: their transcripts hold the replayed actions, so no
    branch group and no extended group sees a difference."""
    cfg = load_config(None, [*TALLY, "train.steps=1", "rollout.branch=random", "rollout.branch_k=2",
                             "reward=[{func = 'env', weight = 0.0}, {func = 'test_branching:transcript_actions'}]"])
    (r,) = _train_rows(train(cfg, tmp_path / "run", log=lambda *_: None))
    assert r["reward/transcript_actions/mean"] == 4.0 and r["reward/mean"] == 4.0
    assert r["branch/nonzero_frac"] == 0.0 and r["advantage/abs_mean"] == 0.0 and r["branch/turn_mean"] >= 1


def test_resume_with_branches_equals_the_uninterrupted_run(tmp_path):
    sets = [*TALLY, "rollout.branch=random", "rollout.branch_k=2", "run.checkpoint_every=1", "eval.after=false"]
    full = train(load_config(None, [*sets, "train.steps=3"]), tmp_path / "full", log=lambda *_: None)
    part = train(load_config(None, [*sets, "train.steps=1"]), tmp_path / "part", log=lambda *_: None)
    train(load_config(None, [*sets, "train.steps=3"]), part, resume=True, log=lambda *_: None)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]

    assert strip(_train_rows(part)) == strip(_train_rows(full))
    assert [r["budget/episodes"] for r in _train_rows(full)] == [8, 16, 24]
