"""The data-parallel learner: two CPU processes on gloo give the one-process update.

Each rank runs whole micro-batches of the one-process run, so with one micro-batch per rank
the summed gradient is the one-process sum bit for bit (a + b == b + a): those scenarios
check `torch.equal` for the gradients and the weights after the step (AdamW as the recipes
make it). With several micro-batches per rank only the order of the float additions
differs: gradients within rtol 1e-5 / atol 1e-7. The weights after the step are checked with
AdamW's eps raised to 1e-3: at the default 1e-8, an entry whose gradient is within float
rounding of zero moves by lr * g / (|g| + eps), which amplifies a 1e-12 rounding difference
to ~1e-4 * lr (one process changing its micro-batch size does the same), so a tight weight
check would test AdamW's conditioning, not the learner. At eps 1e-3 a gradient entry that is
off by the gradient tolerance moves its weight by up to about lr * 1e-7 / eps = 1e-6 more per
step (lr 1e-2), so that is the weights' absolute tolerance (an entry of the embedding was off
by 2.2e-7 after six steps in the 2026-12-06 suite, over the 1e-7 it was held to before).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recursa.cli import main
from recursa.config import load_config
from recursa.distributed.ddp import shard_bounds

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.name=tiny-random", "train.prompts_per_step=3", "train.group_size=3", "train.lr=1e-2", "train.micro_batch_size=2", "sampling.max_new_tokens=6"]


def _optimizer(policy, cfg, exact: bool):
    """AdamW as the recipes make it; with eps 1e-3 where only a tolerance is expected (see the module doc)."""
    from recursa.recipes.common import make_optimizer

    params = [p for p in policy.model.parameters() if p.requires_grad]
    return make_optimizer(params, cfg) if exact else torch.optim.AdamW(params, lr=cfg.train.lr, betas=cfg.train.betas, eps=INEXACT_EPS)


INEXACT_EPS = 1e-3  # AdamW eps where only a tolerance is expected
RTOL, ATOL = 1e-5, 1e-7

# name -> (config overrides, how the batch's advantages look, extra, bit-identical expected).
# The batch has 9 rows, 3 of them (a zero-variance group) skipped when there is no KL term.
SCENARIOS = {
    "token-mean": (["train.micro_batch_size=3"], "some-zero", None, True),
    "seq-mean, 2 epochs x 3 mini-batches": (["algo.agg=seq-mean-token-mean", "train.epochs=2", "train.mini_batches=3"], "some-zero", None, True),
    "seq-sum-norm, sampler log-probs": (["algo.agg=seq-mean-token-sum-norm", "train.old_logprobs=sampling", "train.mini_batches=3"], "some-zero", None, True),
    "kl to the reference, 2 epochs": (["algo.kl_coef=0.1", "train.epochs=2", "train.micro_batch_size=5"], "some-zero", None, True),
    "lora, kl, 2 epochs": (["model.lora.r=4", "model.lora.alpha=8.0", "algo.kl_coef=0.1", "train.epochs=2", "train.micro_batch_size=5"], "some-zero", None, True),
    "token advantages + imitation (rsipo)": (["train.micro_batch_size=5"], "per-token", "imitation", True),
    "token advantages + distribution term (rsipo)": (["train.micro_batch_size=5"], "per-token", "distillation", True),
    "all advantages zero": ([], "zero", None, True),
    "supervised step": (["train.micro_batch_size=5"], "some-zero", "supervised", True),
    "token-mean, 3 micro-batches per rank": (["train.micro_batch_size=1"], "some-zero", None, False),
    "seq-mean, 2 epochs x 3 mini-batches, several per rank": (["algo.agg=seq-mean-token-mean", "train.epochs=2", "train.micro_batch_size=1",
                                                               "train.mini_batches=3"], "some-zero", None, False),
    "kl, 2 epochs, several per rank": (["algo.kl_coef=0.1", "train.epochs=2", "train.micro_batch_size=2"], "some-zero", None, False),
    "supervised step, several per rank": (["train.micro_batch_size=2"], "some-zero", "supervised", False),
    "rebel, 2 epochs (outcomes)": (["algo.objective=rebel", "train.epochs=2", "train.micro_batch_size=5"], "some-zero", "outcomes", True),
    "a*-po, reference, several per rank (outcomes)": (["algo.objective=apo", "train.epochs=2", "train.micro_batch_size=2"], "some-zero", "outcomes", False),
    "nft, 2 epochs (outcomes)": (["algo.objective=nft", "train.epochs=2", "train.micro_batch_size=5"], "some-zero", "outcomes", True),
}


def test_shard_bounds_by_hand():
    assert [shard_bounds(10, r, 3) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [shard_bounds(1, r, 2) for r in range(2)] == [(0, 0), (0, 1)]  # a rank may get no row
    assert [shard_bounds(0, r, 2) for r in range(2)] == [(0, 0), (0, 0)]
    for n in range(12):
        for w in (1, 2, 3, 5):
            cuts = [shard_bounds(n, r, w) for r in range(w)]
            assert cuts[0][0] == 0 and cuts[-1][1] == n and all(cuts[r][1] == cuts[r + 1][0] for r in range(w - 1))
            assert max(hi - lo for lo, hi in cuts) - min(hi - lo for lo, hi in cuts) <= 1


def _batch(policy, kind: str):
    """3 prompts x 3 samples of the tiny model; advantages with a zero-variance group."""
    from recursa.generation import SamplingParams, generate
    from recursa.rollout import render_prompt
    from recursa.trajectory import Trajectory, collate

    tok = policy.tokenizer
    prompts = [render_prompt(tok, f"question {i} " * (i + 1), None) for i in range(3)]
    samples = generate(policy.causal_lm, tok, prompts, SamplingParams(max_new_tokens=6), n=3, generator=torch.Generator().manual_seed(1))
    trajs = [Trajectory("t", 0, s.prompt_index, prompts[s.prompt_index] + s.token_ids, [0] * len(prompts[s.prompt_index]) + [1] * len(s.token_ids),
                        [0.0] * len(prompts[s.prompt_index]) + s.logprobs, 0.0, False) for s in samples]
    adv = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0, -1.2, 0.4, 0.8])
    if kind == "zero":
        adv.zero_()
    batch = collate(trajs, adv, tok.pad_token_id)
    if kind == "per-token":
        batch.advantages = batch.action_mask * torch.linspace(-1, 1, batch.action_mask.shape[1])[None, :] * adv[:, None]
    return batch


def _run_update(policy, optimizer, batch, cfg, extra, learner=None):
    """The update (or supervised step) under test; returns its stats as a dict."""
    from dataclasses import asdict

    from recursa.distributed.ddp import SINGLE
    from recursa.recipes.common import supervised_step
    from recursa.recipes.grpo import Imitation, update

    learner = learner or SINGLE
    if extra == "supervised":
        return asdict(supervised_step(policy, optimizer, batch, cfg, 0, learner=learner))
    imitation, outcomes, distillation = None, None, None
    if extra == "imitation":
        imitation = Imitation(batch.action_mask * torch.linspace(0.1, 1.0, len(batch))[:, None], 0.5)
    if extra == "distillation":  # a made-up teacher: the top 3 of a fixed random distribution at every position
        from recursa.recipes.grpo import Distillation

        logp, ids = torch.log_softmax(torch.randn((*batch.input_ids.shape, 32), generator=torch.Generator().manual_seed(7)), -1).topk(3, dim=-1)
        distillation = Distillation(ids, logp, batch.action_mask * torch.linspace(0.1, 1.0, len(batch))[:, None], 0.5, "jsd")
    if extra == "outcomes":  # REBEL, NFT, A*-PO: rewards and verdicts of the 3 groups of 3 (the middle group all equal)
        from recursa.recipes.grpo import Outcomes

        rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.5, 1.0]])
        outcomes = Outcomes(rewards, (rewards >= 1).float(), torch.arange(9))
    return asdict(update(policy, optimizer, batch, cfg, torch.Generator().manual_seed(3), 0, imitation, learner=learner, outcomes=outcomes,
                         distillation=distillation))


def _setup(name):
    from recursa.models import load_policy

    sets, kind, extra, exact = SCENARIOS[name]
    cfg = load_config(None, [*TINY, *sets])
    torch.manual_seed(0)
    policy = load_policy(cfg.model)
    if cfg.algo.needs_reference:
        policy.enable_reference()
    return cfg, policy, kind, extra, exact


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    """One process of the two: rank 0 runs every scenario against rank 1's `serve`."""
    os.environ["RECURSA_DEVICE"] = "cpu"
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from recursa.distributed import ddp, worker

    learner = ddp.DataParallel(rank, world, torch.device("cpu"))
    if rank != 0:
        worker.serve(learner, log=lambda *_: None)
        learner.close()
        return
    results = {}
    for name in SCENARIOS:
        cfg, policy, kind, extra, exact = _setup(name)
        batch = _batch(policy, kind)
        initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
        learner.hello(cfg, policy)
        optimizer = _optimizer(policy, cfg, exact)
        stats = _run_update(policy, optimizer, batch, cfg, extra, learner)
        results[name] = {
            "initial": initial, "batch": batch,
            "grads": {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None},
            "weights": {k: v.clone() for k, v in policy.model.state_dict().items()}, "stats": stats,
        }
    learner.stop()
    learner.close()
    torch.save(results, out)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every scenario's rank-0 result from one pair of gloo processes."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "results.pt"
    mp.spawn(_rank, args=(2, str(tmp / "init"), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_gloo_processes_give_the_one_process_gradient_and_weights(two_processes, name):
    got = two_processes[name]
    cfg, policy, _, extra, exact = _setup(name)
    policy.model.load_state_dict(got["initial"])
    # The one-process update at the thread count the ranks' learner runs at (cfg.run.threads):
    # a float reduction's order depends on it, and an earlier test may have left another.
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.run.threads)
    try:
        stats = _run_update(policy, _optimizer(policy, cfg, exact), got["batch"], cfg, extra)
    finally:
        torch.set_num_threads(before)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=RTOL, atol=ATOL)
    # a gradient off by ATOL moves a weight by up to about lr * ATOL / eps more per step (module doc)
    weight_tol = dict(rtol=0, atol=0) if exact else dict(rtol=RTOL, atol=cfg.train.lr * ATOL / INEXACT_EPS)
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    assert grads.keys() == got["grads"].keys() and grads
    for n in grads:
        torch.testing.assert_close(got["grads"][n], grads[n], **tol, msg=lambda m: f"{name}: gradient of {n}: {m}")
    moved = 0
    for k, v in policy.model.state_dict().items():
        torch.testing.assert_close(got["weights"][k], v, **weight_tol, msg=lambda m: f"{name}: weight {k}: {m}")
        moved += not torch.equal(v, got["initial"][k])
    assert moved > 0 or SCENARIOS[name][1] == "zero"  # the step did something (AdamW's first step on a zero gradient does not)
    for key, value in stats.items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), (name, key)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_two_processes_train_like_one(tmp_path):
    """`torchrun --nproc_per_node 2` end to end: rank 0 alone writes the run, and the run
    equals the one-process run (same rewards; weights within the tolerance)."""
    sets = ["model.name=tiny-random", "env.name=toy-digits", "env.kwargs={}", "sampling.max_new_tokens=8", "train.prompts_per_step=2", "train.group_size=4",
            "train.micro_batch_size=2", "train.lr=1e-2", "train.steps=3", "train.mini_batches=2", "eval.n=4", "run.checkpoint_every=1",
            "run.threads=1"]
    launcher = str(ROOT / "tests" / "_launch_with_toy_envs.py")
    argv = [launcher, "train", str(ROOT / "examples" / "smoke.toml"), *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RECURSA_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    proc = subprocess.run([sys.executable, *argv, "--out", str(one)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*torchrun, *argv, "--out", str(two)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank 1/2: learner worker" in proc.stdout and "data-parallel learner on 2 processes" in proc.stdout
    a, b = _metrics(one), _metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]  # rank 0 alone wrote: no line twice
    assert sum("reward/mean" in r for r in b) == 3
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            if k.startswith(("time/", "throughput/")):
                continue
            if k.startswith(("reward/", "eval/", "completion/", "episode/", "batch/", "budget/")):
                assert ra[k] == rb[k], (ra["step"], k)  # same samples: the weights agree to float rounding
            else:
                assert ra[k] == pytest.approx(rb[k], rel=1e-3, abs=1e-6), (ra["step"], k)
    from safetensors.torch import load_file

    wa = load_file(one / "checkpoints" / "step_000003" / "model.safetensors")
    wb = load_file(two / "checkpoints" / "step_000003" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(wa[k], load_file(one / "checkpoints" / "step_000001" / "model.safetensors")[k]) for k in wa)


def test_backend_choice_errors_are_one_line(tmp_path, capsys, monkeypatch):
    smoke = str(ROOT / "examples" / "smoke.toml")
    assert main(["train", smoke, "--out", str(tmp_path / "r"), "--set", "learner.backend=ddp"]) == 2
    assert "torchrun --nproc_per_node" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", smoke, "--out", str(tmp_path / "r"), "--set", "learner.backend=single"]) == 2
    err = capsys.readouterr().err.strip()
    assert "WORLD_SIZE = 2" in err and "\n" not in err
    monkeypatch.setenv("RANK", "0")
    assert main(["train", smoke, "--out", str(tmp_path / "r"), "--set", "model.device=cuda:0"]) == 2
    assert "cuda:LOCAL_RANK" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # nothing written before the learner was set up
