"""The Ray rollout backend on a local Ray (one cluster for the module, 2 CPUs, the tiny
model): Ray workers return the trajectories the single process does at the same seeds,
play the learner's current weights, survive a worker killed mid-step, and GRPO and RSIPO
runs on 2 workers log the metrics of the single-process run. Skipped when Ray is not installed
(pip install 'recursa[ray]')."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from conftest import DigitsEnv  # noqa: E402
from test_distributed import assert_same_trajectories  # noqa: E402

from recursa.config import ModelConfig, load_config  # noqa: E402
from recursa.distributed.ray_rollout import RayRollouts, load_payload, weights_payload  # noqa: E402
from recursa.distributed.rollouts import LocalRollouts  # noqa: E402
from recursa.envs import EnvPool, make_env, register_env  # noqa: E402
from recursa.errors import UserError  # noqa: E402
from recursa.generation import SamplingParams  # noqa: E402
from recursa.models import load_policy  # noqa: E402
from recursa.recipes import grpo, rsipo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


class SlowDigitsEnv(DigitsEnv):
    """toy-digits whose every step leaves a marker file named by the seed and then waits, so a
    test can kill the worker playing a given seed while it plays it."""

    def __init__(self, marker_dir: str = "", delay: float = 0.0):
        self.marker_dir, self.delay, self.seed = marker_dir, delay, None

    def reset(self, seed: int) -> str:
        self.seed = seed
        return super().reset(seed)

    def step(self, action_text: str):
        if self.marker_dir:
            Path(self.marker_dir, str(self.seed)).touch()
        time.sleep(self.delay)
        return super().step(action_text)


register_env("toy-digits-slow", SlowDigitsEnv, "toy-digits with a marker file and a delay per step (tests)")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the module; the workers import the tests' envs from tests/."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "byo_pkg"), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path, "RECURSA_DEVICE": "cpu"}})
    yield
    ray.shutdown()


def _cfg(env: str, *sets: str):
    return load_config(SMOKE, ["distributed.backend=ray", "distributed.workers=2", f"env.name={env}", "env.kwargs={}", *sets])


def test_weights_payload_round_trip(fresh_tiny_policy):
    """What the driver puts in the object store loads into a worker's model exactly (float32
    and bfloat16); tied weights travel once; a name the worker lacks is a one-line error."""
    src, dst = fresh_tiny_policy.model, load_policy(ModelConfig(name="tiny-random")).model
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)
    payload = weights_payload(src, trainable=True)
    assert len(payload) == len(list(src.parameters()))  # named_parameters: a tied tensor once
    assert weights_payload(src, trainable=False) == {}  # full fine-tuning: nothing frozen
    load_payload(dst, payload)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    src, dst = src.to(torch.bfloat16), dst.to(torch.bfloat16)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.5)
    load_payload(dst, weights_payload(src, trainable=True))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    with pytest.raises(UserError, match="no parameter"):
        load_payload(dst, {"nope.weight": next(iter(payload.values()))})


def test_ray_workers_play_what_the_single_process_plays(fresh_tiny_policy):
    """Two workers, single-turn: equal to LocalRollouts with group streams, call after call;
    after the learner's weights change, the workers play the new weights."""
    policy = fresh_tiny_policy
    remote = RayRollouts(_cfg("toy-digits"), policy, log=lambda s: None)
    local = LocalRollouts(policy, EnvPool(lambda: make_env("toy-digits")), "group")
    try:
        for step in range(2):
            a = remote.rollout([3, 8, 1, 5, 2], 2, PARAMS, torch.Generator().manual_seed(step), None, hints=["h", None, None, "k", None])
            b = local.rollout([3, 8, 1, 5, 2], 2, PARAMS, torch.Generator().manual_seed(step), None, hints=["h", None, None, "k", None])
            assert_same_trajectories(a.trajectories, b.trajectories)
            assert a.stats == b.stats
            assert remote.metrics()["distributed/restarts"] == 0
        before = [t.token_ids for t in a.trajectories]
        with torch.no_grad():  # "an update": the next call must ship these weights
            for p in policy.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        a = remote.rollout([3, 8, 1, 5, 2], 2, PARAMS, torch.Generator().manual_seed(1), None)
        b = local.rollout([3, 8, 1, 5, 2], 2, PARAMS, torch.Generator().manual_seed(1), None)
        assert_same_trajectories(a.trajectories, b.trajectories)
        assert [t.token_ids for t in a.trajectories] != before
        pids = ray.get([w.pid.remote() for w in remote.workers])
        assert len(set(pids)) == 2 and os.getpid() not in pids  # two separate worker processes
    finally:
        remote.close()
    assert remote.workers == [] and ray.is_initialized()  # the module's Ray is not ours to stop


def test_a_worker_killed_mid_step_is_replaced_and_the_step_is_the_same(tiny_policy, tmp_path):
    seeds = [3, 8, 1, 5]  # worker 0 plays seeds 3 and 8
    cfg = _cfg("toy-digits-slow", f'env.kwargs={{marker_dir = "{tmp_path}", delay = 0.8}}')
    logs: list[str] = []
    remote = RayRollouts(cfg, tiny_policy, log=logs.append)
    killed = []

    def kill_worker_0_while_it_plays():
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "3").exists() and not (tmp_path / "8").exists():
            time.sleep(0.01)
        killed.append(remote.workers[0])
        ray.kill(remote.workers[0])

    def start_killer():
        for marker in tmp_path.iterdir():
            marker.unlink()
        killer = threading.Thread(target=kill_worker_0_while_it_plays)
        killer.start()
        return killer

    try:
        killer = start_killer()
        a = remote.rollout(seeds, 2, PARAMS, torch.Generator().manual_seed(9), None)
        killer.join()
        assert killed and remote.workers[0] is not killed[0]  # replaced
        assert remote.metrics()["distributed/restarts"] == 1
        assert any("worker 0 died" in line for line in logs)
        b = LocalRollouts(tiny_policy, EnvPool(lambda: make_env("toy-digits")), "group").rollout(seeds, 2, PARAMS, torch.Generator().manual_seed(9), None)
        assert_same_trajectories(a.trajectories, b.trajectories)
        c = remote.rollout(seeds, 2, PARAMS, torch.Generator().manual_seed(9), None)  # the replacement keeps working
        assert_same_trajectories(c.trajectories, b.trajectories)
        assert remote.metrics()["distributed/restarts"] == 0
        # past distributed.max_restarts deaths in one step the run stops with one line
        remote.dc = remote.dc.model_copy(update={"max_restarts": 0})
        killer = start_killer()
        with pytest.raises(UserError, match="died 1 times in one step") as info:
            remote.rollout(seeds, 2, PARAMS, torch.Generator().manual_seed(9), None)
        killer.join()
        assert "\n" not in str(info.value)
    finally:
        remote.close()


def test_a_worker_error_is_one_line(tiny_policy):
    remote = RayRollouts(_cfg("arithmetic", "env.kwargs={difficulty = 99}", "distributed.workers=1"), tiny_policy, log=lambda s: None)
    try:
        with pytest.raises(UserError) as info:
            remote.rollout([1, 2], 2, PARAMS, torch.Generator().manual_seed(0), None)
        assert "difficulty" in str(info.value) and "\n" not in str(info.value)
    finally:
        remote.close()


RECIPE_RUNS = {  # recipe module, config, overrides, tolerance of float metrics and weights
    "grpo": (grpo, SMOKE, ["env.name=toy-digits", "env.kwargs={}", "train.steps=2", "eval.n=4", "run.checkpoint_every=0"], 0.0),
    # a game, skills shown in the policy's prompts (hints sharded with their seeds), and the
    # step generator used after the rollout (skill writing, replay): all must line up. Two
    # single-process RSIPO runs of this config already differ at ~1e-8 in the replay reward
    # (and so in the loss), hence a tolerance for its floats; counts and rewards are exact.
    "rsipo_game": (rsipo, str(ROOT / "examples" / "rsipo_smoke.toml"),
                   ["train.steps=2", "eval.n=2", "skills.in_context=true", "run.checkpoint_every=0"], 1e-5),
    # branching rollouts: the continuations' requests carry action prefixes, sharded with their seeds
    "grpo_branch": (grpo, SMOKE, ["env.name=household", "env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, max_steps = 4}",
                                  "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "rollout.branch=random", "rollout.branch_k=2",
                                  "eval.n=2", "run.checkpoint_every=0"], 1e-5),
    # curriculum arms (each worker's envs route a training seed to its arm) and tail hints, sharded with their seeds
    "grpo_curriculum": (grpo, SMOKE, ["env.name=household", "env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, max_steps = 4}",
                                      "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "curriculum.mode=progress",
                                      "curriculum.arms=[{kwargs = {rooms = 1}}, {kwargs = {rooms = 2}}]", "curriculum.tail.enabled=true",
                                      "curriculum.tail.min_attempts=2", "curriculum.tail.frac=0.5", "eval.n=2", "run.checkpoint_every=0"], 1e-5),
}


def _same_metrics(a: dict, b: dict, tol: float) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, float) and isinstance(y, float):
            if not (math.isnan(x) and math.isnan(y) or abs(x - y) <= tol * max(1.0, abs(x), abs(y))):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("name", sorted(RECIPE_RUNS))
def test_a_recipe_on_two_ray_workers_logs_the_single_process_metrics(tmp_path, name):
    """The recipe end to end: 2 Ray workers vs one process with group streams, same seeds:
    the same metrics (all but timings) and the same final weights."""
    module, path, sets, tol = RECIPE_RUNS[name]
    ray_run, local_run = tmp_path / "ray", tmp_path / "local"
    module.train(load_config(path, [*sets, "distributed.backend=ray", "distributed.workers=2"]), ray_run, log=lambda s: None)
    module.train(load_config(path, [*sets, "sampling.streams=group"]), local_run, log=lambda s: None)

    def rows(run):  # rollout/logprob_mismatch compares the sampler's log-probs (a worker's, at its own thread count)
        # with the trainer's: equal to float rounding, not bit for bit, so it is left out like timings
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/", "distributed/", "rollout/"))}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(ray_run), rows(local_run)
    assert len(a) == len(b) and len([r for r in a if "reward/mean" in r]) == 2
    for x, y in zip(a, b):
        assert _same_metrics(x, y, tol), (x, y)
        assert {k: v for k, v in x.items() if k.startswith(("reward/", "episode/", "completion/"))} == {k: v for k, v in y.items() if k.startswith(("reward/", "episode/", "completion/"))}
    assert all("distributed/restarts" in json.loads(line) for line in (ray_run / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line)
    from safetensors.torch import load_file

    wa = load_file(str(ray_run / "checkpoints" / "step_000002" / "model.safetensors"))
    wb = load_file(str(local_run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=tol, rtol=0)


def test_cli_train_with_ray_starts_and_stops_its_own_local_ray(tmp_path):
    """`recursa train ... --set distributed.backend=ray` in a fresh process: a local Ray is
    started (address ''), used and shut down; the run completes."""
    run = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "recursa.cli", "train", SMOKE, "--out", str(run), "--set", "distributed.backend=ray", "--set", "distributed.workers=2",
         "--set", "eval.n=0", "--set", "train.steps=2"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 Ray workers" in proc.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert (run / "checkpoints" / "step_000002" / "model.safetensors").exists()


BYO = ROOT / "tests" / "byo_pkg"
BYO_TASKS = {  # the task sources of tests/byo_pkg that a worker must rebuild by name
    "factory": '[env]\nname = "byo_tasks.envs:make_qa_env"\nkwargs = {{ path = "{data}" }}\n',
    "data": '[data]\nsource = "jsonl"\npath = "{data}"\nprompt_key = "question"\n',
}


@pytest.mark.parametrize("task", sorted(BYO_TASKS))
def test_user_env_or_dataset_with_a_reward_function_on_ray_workers(tmp_path, monkeypatch, task):
    """An env named by import path, or a dataset, plus a [[reward]] function: the Ray workers
    rebuild the task from the config by name, and the run logs the single-process metrics."""
    monkeypatch.syspath_prepend(str(BYO))
    data = BYO / "byo_tasks" / "data" / "qa.jsonl"
    path = tmp_path / "c.toml"
    path.write_text(
        '[model]\nname = "tiny-random"\n[sampling]\nmax_new_tokens = 6\n[train]\nsteps = 2\nprompts_per_step = 2\ngroup_size = 4\n'
        'micro_batch_size = 8\nlr = 1e-3\n[eval]\nn = 2\n[run]\ncheckpoint_every = 0\n'
        '[[reward]]\nfunc = "byo_tasks.rewards:brevity"\nweight = 0.5\n' + BYO_TASKS[task].format(data=data)
    )
    ray_run, local_run = tmp_path / "ray", tmp_path / "local"
    grpo.train(load_config(path, ["distributed.backend=ray", "distributed.workers=2"]), ray_run, log=lambda s: None)
    grpo.train(load_config(path, ["sampling.streams=group"]), local_run, log=lambda s: None)

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/", "distributed/", "rollout/"))}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(ray_run), rows(local_run)
    assert [r for r in a if "reward/brevity/mean" in r] and len(a) == len(b)
    for x, y in zip(a, b):
        assert _same_metrics(x, y, 0.0), (x, y)
