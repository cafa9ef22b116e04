"""The PPO log-ratio clamp and the NaN stop (docs/reliability.md, "Safe by default")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recursa.algorithms.losses import LOG_RATIO_CLAMP, ppo_clip_loss
from recursa.cli import main
from recursa.envs import StepResult, register_env

ROOT = Path(__file__).resolve().parents[1]


def test_clamp_changes_nothing_inside_the_range():
    """Hand computation for log-ratios well inside [-20, 20]: the loss and the gradient are the
    unclamped clipped surrogate's."""
    lr = torch.tensor([[0.1, -0.3, 19.0, -19.5]])
    logp_old = torch.tensor([[-1.0, -2.0, -30.0, -1.0]])
    logp = (logp_old + lr).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, _ = ppo_clip_loss(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    r = lr.exp()
    want = -torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    # gradients by hand: d(-r A)/dlogp = -r A where the unclipped term is the min, 0 where the clip is active
    unclipped = (r * adv) <= (r.clamp(0.8, 1.28) * adv)
    want_grad = torch.where(unclipped, -r * adv, torch.zeros_like(r)) / 4
    torch.testing.assert_close(logp.grad, want_grad)


def test_huge_log_ratio_gives_finite_loss_and_gradient():
    """exp(100) overflows float32: without the clamp the loss is inf and the gradient NaN even
    though the token is clipped. With it, the loss is finite and the gradient zero there; the
    other token's gradient is unchanged."""
    logp_old = torch.tensor([[-120.0, -1.0]])
    logp = torch.tensor([[-20.0, -0.9]], requires_grad=True)  # log-ratios 100 and 0.1
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = ppo_clip_loss(logp, logp_old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-math.exp(0.1) / 2, rel=1e-6)
    assert loss.item() == pytest.approx((math.exp(LOG_RATIO_CLAMP) - math.exp(0.1)) / 2, rel=1e-5)
    assert stats["ratio_max"] == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)
    # what the clamp prevents
    raw = torch.exp(torch.tensor(100.0))
    assert math.isinf(raw.item())


class NaNRewardEnv:
    """Rewards NaN for every reply: a broken reward function."""

    name = "toy-nan-reward"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return "Say anything."

    def step(self, action_text: str) -> StepResult:
        return StepResult("", float("nan"), True, {"success": False})


register_env("toy-nan-reward", NaNRewardEnv, "toy: NaN rewards (tests)")


def test_nan_advantages_stop_the_run_naming_the_step(tmp_path, capsys):
    run = tmp_path / "r"
    code = main(["train", str(ROOT / "examples" / "smoke.toml"), "--out", str(run), "--set", "env.name='toy-nan-reward'", "--set", "env.kwargs={}",
                 "--set", "eval.n=0", "--set", "train.steps=2", "--set", "run.checkpoint_every=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("error: step 1: rewards is NaN or infinite"), err
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())  # nothing NaN was saved
    assert not (run / "metrics.jsonl").exists() or not [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
