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
