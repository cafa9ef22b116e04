"""The FSDP2 learner's sharded checkpoints (recursa/distributed/checkpoint.py, issue 47): every rank
writes its shard through `torch.distributed.checkpoint`, a resume reads each rank's own shard back,
and `recursa export` consolidates the shards into one Hugging Face directory.

The runs are two gloo processes under torchrun on the tiny random model, two steps. The resumed run
is checked against the uninterrupted one at the tolerance tests/test_fsdp.py holds a resume to; to
show the resume reads the shards and not rank 0's gathered files, those files (model.safetensors and
the moments in optimizer.pt) are overwritten with wrong values before resuming."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from test_ddp import ROOT

SETS = ["model.name=tiny-random", "env.name=toy-digits", "env.kwargs={}", "sampling.max_new_tokens=8", "train.prompts_per_step=2", "train.group_size=4",
        "train.micro_batch_size=2", "train.lr=1e-2", "train.mini_batches=2", "eval.n=4", "eval.before=false", "run.checkpoint_every=1", "run.threads=1",
        "learner.backend=fsdp"]


def _train(steps: int, out, *extra: str) -> subprocess.CompletedProcess:
    launcher = str(ROOT / "tests" / "_launch_with_toy_envs.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RECURSA_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", launcher, "train", str(ROOT / "examples" / "smoke.toml"),
            *[x for s in [*SETS, f"train.steps={steps}"] for x in ("--set", s)], *extra, "--out", str(out)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 2-step run, and a run stopped after step 1 whose gathered files were then
    spoiled, resumed to step 2."""
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("fsdp_dcp")
    whole, part = tmp / "whole", tmp / "part"
    _train(2, whole)
    _train(1, part)
    ckpt = part / "checkpoints" / "step_000001"
    weights = load_file(ckpt / "model.safetensors")
    save_file({k: v + 1.0 for k, v in weights.items()}, ckpt / "model.safetensors", metadata={"format": "pt"})
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    for state in optim["state"].values():
        state["exp_avg"].fill_(3.0)
    torch.save(optim, ckpt / "optimizer.pt")
    resumed = _train(2, part, "--resume", str(part))
    return whole, part, resumed


def _moments(ckpt) -> list[torch.Tensor]:
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    return [state[i][k] for i in sorted(state) for k in ("exp_avg", "exp_avg_sq")]


def test_every_rank_writes_its_shard_and_the_resume_reads_them_back(runs):
    from safetensors.torch import load_file

    whole, part, resumed = runs
    for run in (whole, part):
        for step in (1, 2):
            dcp = run / "checkpoints" / f"step_{step:06d}" / "dcp"
            assert sorted(p.name for p in dcp.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"], (run.name, step)
    assert not list((part / "checkpoints").glob("*.tmp"))
    assert "read its own shard" in resumed.stdout
    a, b = (r / "checkpoints" / "step_000002" for r in (whole, part))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:  # rank 0's spoiled files were not what the resume trained from
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-8)
    ma, mb = _moments(a), _moments(b)
    assert len(ma) == len(mb) > 0
    for x, y in zip(ma, mb):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-10)
    rows = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["reward/mean"] for r in rows(part) if "reward/mean" in r] == [r["reward/mean"] for r in rows(whole) if "reward/mean" in r]


def test_export_consolidates_the_shards_into_one_hf_directory(runs, tmp_path, capsys):
    """The export of the resumed run's last checkpoint equals its weights file bit for bit (both are
    the training copy's state); with that weights file spoiled, the export still gives the shards'."""
    from safetensors.torch import load_file, save_file

    from recursa.cli import main

    whole, part, _ = runs
    assert main(["export", str(part), "--out", str(tmp_path / "hf")]) == 0
    want = load_file(part / "checkpoints" / "step_000002" / "model.safetensors")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) <= set(want) and got
    for k in got:
        assert torch.equal(got[k], want[k]), k
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    ckpt = copy / "checkpoints" / "step_000002"
    save_file({k: torch.zeros_like(v) for k, v in load_file(ckpt / "model.safetensors").items()}, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert main(["export", str(copy), "--out", str(tmp_path / "hf2")]) == 0
    truth = load_file(whole / "checkpoints" / "step_000002" / "model.safetensors")
    for k, v in load_file(tmp_path / "hf2" / "model.safetensors").items():
        assert torch.equal(v, truth[k]), k


def test_a_damaged_shard_is_one_line_and_exit_2(runs, tmp_path, capsys):
    from recursa.cli import main
    from recursa.store import checkpoint_problem

    whole, _, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    ckpt = copy / "checkpoints" / "step_000002"
    shard = ckpt / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["export", str(copy), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "__1_0.distcp is truncated" in err and "Traceback" not in err
    assert "truncated" in checkpoint_problem(ckpt)  # a resume sets it aside and resumes from step 1 (RunStore.resume_checkpoint)
    shard.unlink()
    assert main(["export", str(copy), "--out", str(tmp_path / "hf")]) == 2
    assert "__1_0.distcp is missing" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


class _Planted:
    """A metadata pickle that would run a command when unpickled without an allow-list."""

    def __reduce__(self):
        return (os.system, ("echo planted",))


def test_planted_metadata_is_refused_unread(runs, tmp_path, capfd):
    from recursa.cli import main
    from recursa.distributed.checkpoint import shards_problem

    whole, _, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    dcp = copy / "checkpoints" / "step_000002" / "dcp"
    assert shards_problem(dcp) is None
    (dcp / ".metadata").write_bytes(pickle.dumps(_Planted()))
    assert "is not DCP metadata recursa wrote" in shards_problem(dcp)
    assert main(["export", str(copy), "--out", str(tmp_path / "hf")]) == 2
    captured = capfd.readouterr()  # the file descriptors: os.system would write there
    assert "planted" not in captured.out and "not DCP metadata" in captured.err
