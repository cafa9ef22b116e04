"""A*-PO's stage 1 (algo.apo_values = 'reference', recursa/apo_reference.py): V*(x) from a stored
sample of the reference policy, worked by hand; two steps on the tiny model writing the sample
file; a killed run resumed without resampling; the config rules, each one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from recursa.apo_reference import FILE, ReferenceSample, read_sample
from recursa.config import load_config
from recursa.errors import UserError
from recursa.generation import SamplingParams

LN = math.log


def _v(rewards, beta):
    """V* = beta log((1/k) sum_j exp(r_j / beta)), written out for the tests' few rewards."""
    return beta * LN(sum(math.exp(r / beta) for r in rewards) / len(rewards))


def test_values_from_the_stored_file_by_hand(tmp_path):
    """beta = 0.5: [1, 0, 0, 0] -> 0.5 ln((e^2 + 3) / 4) = 0.477229...; [0.5, 0.5, 0.5, 0.5] -> 0.5;
    beta = 1: [1, 0, 0, 0] -> ln((e + 3) / 4) = 0.357374...; a task met twice in a step gets its
    value twice. Nothing is sampled: every seed is in the file (no policy is needed)."""
    path = tmp_path / FILE
    path.write_text('{"seed": 11, "k": 4, "rewards": [1.0, 0.0, 0.0, 0.0]}\n{"seed": 12, "k": 4, "rewards": [0.5, 0.5, 0.5, 0.5]}\n')
    sample = ReferenceSample(path, None, None, 4, SamplingParams(4), None)
    v = sample.values([11, 12, 11], beta=0.5)
    torch.testing.assert_close(v, torch.tensor([0.4772293, 0.5, 0.4772293], dtype=torch.float64), rtol=0, atol=1e-6)
    assert 0.5 * LN((math.e**2 + 3) / 4) == pytest.approx(0.4772293, abs=1e-7)
    assert float(sample.values([11], beta=1.0)[0]) == pytest.approx(LN((math.e + 3) / 4)) == pytest.approx(0.3573740, abs=1e-7)
    assert sample.sampled == 0


def test_a_cut_off_last_line_is_dropped_and_another_k_is_refused(tmp_path):
    path = tmp_path / FILE
    path.write_text('{"seed": 1, "k": 2, "rewards": [1.0, 0.0]}\n{"seed": 2, "k": 2, "rew')
    assert read_sample(path) == {1: [1.0, 0.0]}
    assert path.read_text() == '{"seed": 1, "k": 2, "rewards": [1.0, 0.0]}\n'  # the next append starts a clean line
    with pytest.raises(UserError, match="apo_reference_k = 3") as err:
        read_sample(path, k=3)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- the tiny model, end to end

def _sets(*more):
    return ["model.name=tiny-random", "run.threads=1", "env.name=toy-digits", "sampling.max_new_tokens=6", "train.steps=2",
            "train.prompts_per_step=2", "train.group_size=3", "train.micro_batch_size=6", "train.lr=1e-2", "eval.n=0",
            "run.checkpoint_every=1", "algo.objective=apo", "algo.apo_values=reference", "algo.apo_reference_k=3", *more]


@pytest.fixture
def toy(monkeypatch):
    """Every update's V* (and each stage-1 sampling's seeds) recorded; the task is conftest's
    toy-digits (reward: the share of digit characters in the reply)."""
    import recursa.apo_reference as apo_reference
    import recursa.recipes.grpo as grpo
    seen = {"values": [], "rewards": [], "sampled": [], "runs": [], "kill_at": None}
    update, sample, open_ = grpo.update, apo_reference.ReferenceSample.sample, grpo.GRPO.open

    def recording_update(*a, outcomes=None, **k):
        seen["values"].append(outcomes.values.tolist())
        seen["rewards"].append(outcomes.rewards.tolist())
        if seen["kill_at"] is not None and len(seen["values"]) == seen["kill_at"]:
            raise KeyboardInterrupt  # killed in this step's update, after its reference sample was written
        return update(*a, outcomes=outcomes, **k)

    def recording_sample(self, seeds):
        seen["sampled"].append(list(seeds))
        return sample(self, seeds)

    def recording_open(*a, **k):
        run = open_(*a, **k)
        seen["runs"].append(run)
        return run

    monkeypatch.setattr(grpo, "update", recording_update)
    monkeypatch.setattr(apo_reference.ReferenceSample, "sample", recording_sample)
    monkeypatch.setattr(grpo.GRPO, "open", recording_open)
    return seen


def _lines(run):
    return [json.loads(line) for line in (run / FILE).read_text().splitlines()]


def test_two_steps_write_the_sample_and_train_on_its_values(tmp_path, toy):
    import recursa.recipes.grpo as grpo
    from recursa.recipes.loop import train_seeds

    cfg = load_config(None, _sets())
    run = grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss/policy" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss/policy"]) for r in steps)
    seeds = [train_seeds(cfg, 0), train_seeds(cfg, 1)]
    lines = _lines(run)
    # one line per new task, in the order the steps met them, k = 3 rewards each, each a digit share (j / n for n <= 6 chars)
    assert [ln["seed"] for ln in lines] == list(dict.fromkeys(seeds[0] + seeds[1]))
    assert all(ln["k"] == 3 and len(ln["rewards"]) == 3 and all(0 <= r <= 1 for r in ln["rewards"]) for ln in lines)
    expected, known = [], set()  # each step samples the tasks no earlier step met
    for step_seeds in seeds:
        new = [x for x in dict.fromkeys(step_seeds) if x not in known]
        known |= set(new)
        expected += [new] if new else []
    assert toy["sampled"] == expected
    # each update's V* is beta_1 log mean exp(r / beta_1) of the stored rewards of its step's tasks (beta_1 = 0.5)
    stored = {ln["seed"]: ln["rewards"] for ln in lines}
    for values, step_seeds in zip(toy["values"], seeds):
        assert values == pytest.approx([_v(stored[s], 0.5) for s in step_seeds], abs=1e-12)
    # ... and not the group's own: V* of the on-policy rewards differs somewhere
    assert any(v != pytest.approx(_v(g, 0.5), abs=1e-9) for vs, rs in zip(toy["values"], toy["rewards"]) for v, g in zip(vs, rs))
    # --overwrite deletes the sample with the run's other files (a new run must not read an old pi_ref's)
    from recursa.runio import remove_run_files

    remove_run_files(run)
    assert not (run / FILE).exists()


def test_the_sample_is_the_reference_policys_whatever_the_training_did(tmp_path, toy):
    """Two runs whose weights move differently (lr 1e-2 and 3e-1) store the same sample for step 2's
    tasks: it comes from the frozen initial weights, not from the policy being trained."""
    import recursa.recipes.grpo as grpo

    a = grpo.train(load_config(None, _sets()), tmp_path / "a", log=lambda *_: None)
    b = grpo.train(load_config(None, _sets("train.lr=3e-1")), tmp_path / "b", log=lambda *_: None)
    assert (a / FILE).read_bytes() == (b / FILE).read_bytes()
    assert toy["rewards"][1] != toy["rewards"][3], "the two runs' step-2 rollouts are the same: the check says nothing"


def test_a_killed_run_resumes_without_resampling(tmp_path, toy):
    """Killed in step 2's update (after step 2's reference sample was stored): the resumed run reads
    the file back, samples nothing, leaves the file as it was and trains step 2 on the same V*;
    the file equals the uninterrupted run's."""
    import recursa.recipes.grpo as grpo

    cfg = load_config(None, _sets())
    ref = grpo.train(cfg, tmp_path / "ref", log=lambda *_: None)
    ref_values, ref_file = toy["values"][:], (ref / FILE).read_bytes()
    toy["values"].clear(), toy["sampled"].clear()
    toy["kill_at"] = 2
    with pytest.raises(KeyboardInterrupt):
        grpo.train(cfg, tmp_path / "killed", log=lambda *_: None)
    killed = toy["runs"][-1]
    killed.store.close(), killed.pool.close()  # what the killed process's exit would release
    before = (tmp_path / "killed" / FILE).read_bytes()
    assert before == ref_file and len(toy["sampled"]) == 2
    toy["kill_at"], toy["sampled"] = None, []
    logs = []
    grpo.train(cfg, tmp_path / "killed", resume=True, log=logs.append)
    assert toy["sampled"] == []  # nothing resampled
    assert (tmp_path / "killed" / FILE).read_bytes() == before  # the file unchanged
    assert toy["values"][2] == ref_values[1]  # step 2 again, on the same V*
    assert any("reference samples read back" in line for line in logs)


@pytest.mark.parametrize("fault", ["apo_reference.torn@2", "apo_reference.appended@2"])
def test_a_sigkill_while_storing_the_sample_then_resume_equals_the_uninterrupted_run(tmp_path, fault):
    """SIGKILL with half of step 2's stage-1 lines written (torn), or just after they were synced
    (appended): `train --resume` ends with the uninterrupted run's sample file and metrics."""
    from tests.test_faults import TIME_KEYS, _runner

    config = tmp_path / "apo.toml"
    config.write_text("")  # every setting comes from the --set list
    sets = [str(config), *(x for kv in _sets() for x in ("--set", kv))]
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = _runner([{"argv": ["train", "--out", str(ref), *sets]}, {"argv": ["train", "--out", str(run), *sets], "fault": fault},
                   {"argv": ["train", "--resume", str(run)]}])
    assert out[0] == {"exit": 0, "killed": False} and out[1]["killed"] and out[2] == {"exit": 0, "killed": False}, out
    assert (run / FILE).read_bytes() == (ref / FILE).read_bytes()

    def metrics(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]

    assert metrics(run) == metrics(ref)


def test_a_multi_turn_game_is_refused_in_one_line(tmp_path, monkeypatch):
    import recursa.recipes.grpo as grpo
    from recursa.envs import base
    from tests.test_objectives import DigitGameEnv

    monkeypatch.setattr(base.ENVS, "_registered", dict(base.ENVS._registered))
    base.register_env("toy-digit-game", DigitGameEnv, "test")
    cfg = load_config(None, ["model.name=tiny-random", "run.threads=1", "env.name=toy-digit-game", "agent.history_turns=1",
                             "sampling.max_new_tokens=4", "train.steps=1", "train.prompts_per_step=1", "train.group_size=2", "eval.n=0",
                             "algo.objective=apo", "algo.apo_values=reference"])
    with pytest.raises(UserError, match="multi-turn game") as err:
        grpo.train(cfg, tmp_path / "run", log=lambda *_: None)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / FILE).exists()


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("sets, words", [
    (["algo.objective=apo", "algo.apo_values=reference", "algo.apo_reference_k=0"], "apo_reference_k"),
    (["algo.objective=rebel", "algo.apo_values=reference"], "reads no V"),
    (["algo.apo_values=reference"], "reads no V"),
    (["algo.objective=apo", "algo.apo_values=offline"], "apo_values"),
    (["algo.objective=apo", "algo.apo_values=reference", "algo.igrpo=true"], "igrpo"),
])
def test_config_rules_are_one_line(sets, words):
    with pytest.raises(UserError, match=words) as err:
        load_config(None, ["model.name=tiny-random", *sets])
    assert "\n" not in str(err.value)


def test_the_default_is_the_group():
    cfg = load_config(None, ["algo.objective=apo"])
    assert cfg.algo.apo_values == "group" and cfg.algo.apo_reference_k == 8
