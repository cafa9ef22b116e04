"""The FSDP2 learner (recursa/distributed/fsdp.py, issue 47): two CPU processes over gloo give the
one-process update, and a torchrun run trains like one process.

Unlike `ddp` the reduction is FSDP2's reduce-scatter and AdamW runs on the shards, so nothing is
expected bit for bit: gradients within rtol 1e-5 / atol 1e-7 of the one-process run, and the
weights after the step within lr * 1e-7 / eps with AdamW's eps at 1e-3 (tests/test_ddp.py's module
doc says why a tight weight check needs a large eps)."""

from __future__ import annotations

import os

import pytest
import torch

from test_ddp import ATOL, INEXACT_EPS, RTOL, SCENARIOS, _batch, _optimizer, _run_update, _setup

NAMES = [n for n in SCENARIOS if "lora" not in n]  # the FSDP2 learner trains full weights


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    os.environ["RECURSA_DEVICE"] = "cpu"
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from recursa.distributed import worker
    from recursa.distributed.fsdp import FullyShardedDataParallel

    learner = FullyShardedDataParallel(rank, world, torch.device("cpu"))
    if rank != 0:
        worker.serve(learner, log=lambda *_: None)
        learner.close()
        return
    results = {}
    for name in NAMES:
        cfg, policy, kind, extra, _ = _setup(name)
        batch = _batch(policy, kind)
        initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
        learner.hello(cfg, policy)
        optimizer = _optimizer(policy, cfg, exact=False)
        stats = _run_update(policy, optimizer, batch, cfg, extra, learner)
        sharded = {n: p for n, p in learner._train.named_parameters()}
        results[name] = {
            "initial": initial, "batch": batch, "stats": stats,
            "weights": {k: v.clone() for k, v in policy.model.state_dict().items()},
            "moments": {n: optimizer.state[p]["exp_avg"].clone() for n, p in policy.model.named_parameters() if p in optimizer.state},
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in sharded.items()},
            "full_shapes": {n: tuple(p.shape) for n, p in sharded.items()},
        }
    learner.stop()
    learner.close()
    torch.save(results, out)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "results.pt"
    mp.spawn(_rank, args=(2, str(tmp / "init"), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", NAMES)
def test_two_fsdp2_processes_give_the_one_process_update(two_processes, name):
    got = two_processes[name]
    cfg, policy, _, extra, _ = _setup(name)
    policy.model.load_state_dict(got["initial"])
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.run.threads)
    try:
        optimizer = _optimizer(policy, cfg, exact=False)
        stats = _run_update(policy, optimizer, got["batch"], cfg, extra)
    finally:
        torch.set_num_threads(before)
    for key, value in stats.items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), (name, key)
    # the parameters were sharded: rank 0 held about half of each along dim 0
    for n, shape in got["full_shapes"].items():
        assert got["local_shapes"][n][0] == (shape[0] + 1) // 2 and got["local_shapes"][n][1:] == shape[1:]
    weight_tol = dict(rtol=RTOL, atol=cfg.train.lr * ATOL / INEXACT_EPS)
    moved = 0
    for k, v in policy.model.state_dict().items():
        torch.testing.assert_close(got["weights"][k], v, **weight_tol, msg=lambda m: f"{name}: weight {k}: {m}")
        moved += not torch.equal(v, got["initial"][k])
    assert moved > 0 or SCENARIOS[name][1] == "zero"
    # rank 0's plain AdamW holds the gathered moments (what a checkpoint saves); exp_avg = (1 - beta1) * summed gradient
    mine = {n: optimizer.state[p]["exp_avg"] for n, p in policy.model.named_parameters() if p in optimizer.state}
    assert mine.keys() == got["moments"].keys() and mine
    for n in mine:
        torch.testing.assert_close(got["moments"][n], mine[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: exp_avg of {n}: {m}")


def test_torchrun_fsdp_trains_like_one_process_and_resumes_like_the_uninterrupted_run(tmp_path):
    """`torchrun --nproc_per_node 2` with learner.backend = 'fsdp' end to end: the run equals the
    one-process run (same rewards; weights within the tolerance), and a 2-process run stopped at
    step 2 and resumed to step 3 ends where the uninterrupted 2-process run does."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file
    from test_ddp import ROOT

    sets = ["model.name=tiny-random", "env.name=toy-digits", "env.kwargs={}", "sampling.max_new_tokens=8", "train.prompts_per_step=2", "train.group_size=4",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.mini_batches=2", "eval.n=4", "run.checkpoint_every=1", "run.threads=1"]
    launcher = str(ROOT / "tests" / "_launch_with_toy_envs.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RECURSA_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

    def train(prefix, steps, out, *extra):
        argv = [launcher, "train", str(ROOT / "examples" / "smoke.toml"), *[x for s in [*sets, f"train.steps={steps}"] for x in ("--set", s)], *extra]
        proc = subprocess.run([*prefix, *argv, "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    one, two, part = tmp_path / "one", tmp_path / "two", tmp_path / "part"
    train([sys.executable], 3, one)
    proc = train(torchrun, 3, two, "--set", "learner.backend=fsdp")
    assert "rank 1/2: learner worker" in proc.stdout
    train(torchrun, 2, part, "--set", "learner.backend=fsdp")
    train(torchrun, 3, part, "--set", "learner.backend=fsdp", "--resume", str(part))

    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = rows(one), rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] and sum("reward/mean" in r for r in b) == 3
    for ra, rb in zip(a, b):
        for k in ra:
            if k.startswith(("time/", "throughput/")):
                continue
            if k.startswith(("reward/", "eval/", "completion/", "episode/", "batch/", "budget/")):
                assert ra[k] == rb[k], (ra["step"], k)
            else:
                assert ra[k] == pytest.approx(rb[k], rel=1e-3, abs=1e-6), (ra["step"], k)
    wa, wb, wc = (load_file(r / "checkpoints" / "step_000003" / "model.safetensors") for r in (one, two, part))
    for k in wa:
        # AdamW here runs non-fused on the shards, fused in one process, at eps 1e-8: an entry whose gradient is
        # within rounding of zero can move by a good part of lr either way (tests/test_ddp.py's module doc); one of
        # 2048 entries was off by 1.9e-6 after six steps at lr 1e-2 (2026-12-07), so 1e-3 x lr bounds it
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-3 * 1e-2)
        torch.testing.assert_close(wc[k], wb[k], rtol=1e-6, atol=1e-8)
    assert [r.get("reward/mean") for r in rows(part) if "reward/mean" in r] == [r["reward/mean"] for r in b if "reward/mean" in r]
