"""Checkpoint hygiene: run.keep_last prunes old checkpoints (never gate incumbents, never what
the ledger accepted) and run.resume = "auto" continues a run in place, exactly as an
uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from recursa.cli import main
from recursa.lineage import Lineage
from recursa.store import RunStore, finished_checkpoints

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
TIME_KEYS = ("time/", "throughput/")


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIME_KEYS)} for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_keep_last_spares_what_the_ledger_accepted(tmp_path, tiny_policy):
    store = RunStore(tmp_path / "run", keep_last=1)
    Lineage(store.db).root("weights", "accepted weights", {"dir": "checkpoints/step_000002"}, step=2)
    opt = torch.optim.AdamW(tiny_policy.model.parameters(), lr=1e-3)
    for step in range(1, 5):
        store.save_checkpoint(step, tiny_policy, opt, {"opt_steps": step})
    assert [p.name for p in finished_checkpoints(store.path)] == ["step_000002", "step_000004"]
    assert [r[0] for r in store.db.execute("SELECT step FROM checkpoints ORDER BY step")] == [2, 4]
    assert store.prune_checkpoints(1) == []  # nothing more to delete
    store.close()


def test_keep_last_in_a_gated_run_keeps_every_incumbent_and_changes_no_number(tmp_path):
    sets = ["--set", "train.steps=4", "--set", "run.checkpoint_every=1", "--set", "eval.n=4", "--set", "gate.mode='gate'",
            "--set", "gate.every=1", "--set", "gate.n=4", "--set", "gate.alpha=0.45"]
    full, pruned = tmp_path / "full", tmp_path / "pruned"
    assert main(["train", SMOKE, "--out", str(full), *sets]) == 0
    assert main(["train", SMOKE, "--out", str(pruned), *sets, "--set", "run.keep_last=2"]) == 0
    assert [p.name for p in finished_checkpoints(full)] == [f"step_00000{i}" for i in (1, 2, 3, 4)]
    assert [p.name for p in finished_checkpoints(pruned)] == ["step_000003", "step_000004"]
    assert sorted(p.name for p in (pruned / "incumbents").iterdir()) == sorted(p.name for p in (full / "incumbents").iterdir())
    assert (pruned / "incumbents" / "step_000000" / "optimizer.pt").exists()
    assert _rows(pruned) == _rows(full)


def test_resume_auto_continues_in_place_like_an_uninterrupted_run(tmp_path, capsys):
    sets = ["--set", "run.checkpoint_every=1", "--set", "eval.n=8", "--set", "run.keep_last=1"]
    full = tmp_path / "full"
    assert main(["train", SMOKE, "--out", str(full), *sets, "--set", "train.steps=4"]) == 0

    part = tmp_path / "part"
    assert main(["train", SMOKE, "--out", str(part), *sets, "--set", "train.steps=2", "--set", "eval.after=false"]) == 0
    with (part / "metrics.jsonl").open("a") as f:  # a crash after step 2's checkpoint left a later line
        f.write(json.dumps({"step": 3, "reward/mean": 123.0}) + "\n")
    # without run.resume = "auto" the run directory is protected
    assert main(["train", SMOKE, "--out", str(part), *sets, "--set", "train.steps=4"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", SMOKE, "--out", str(part), *sets, "--set", "train.steps=4", "--set", "run.resume='auto'"]) == 0
    assert "continuing the run" in capsys.readouterr().out
    assert _rows(part) == _rows(full)
    a = json.loads((full / "eval" / "after.json").read_text())
    b = json.loads((part / "eval" / "after.json").read_text())
    assert a["items"] == b["items"]
    assert [p.name for p in finished_checkpoints(part)] == ["step_000004"]
    # auto on an empty directory simply starts a run
    fresh = tmp_path / "fresh"
    assert main(["train", SMOKE, "--out", str(fresh), *sets, "--set", "train.steps=1", "--set", "run.resume='auto'"]) == 0
    assert [r["step"] for r in _rows(fresh) if "reward/mean" in r] == [1]


def test_relabel_eval_moves_file_and_ledger_row_and_refuses_clashes(tmp_path):
    """RunStore.relabel_eval: the file and its ledger row move together, a reconcile after it
    changes nothing, and a missing label or a taken one is a one-line error."""
    import pytest

    from recursa.errors import UserError
    from recursa.evaluate import EvalResult

    store = RunStore(tmp_path / "run")
    try:
        r = EvalResult(env="toy", split="test", n=2, mean_reward=0.5, success_rate=0.5, ci95=(0.1, 0.9), mean_reward_ci95=(0.0, 1.0))
        for label, step in (("after", 4), ("step_0002", 2)):
            store.save_eval(step, label, r, store.path / "eval" / f"{label}.json", {"eval/success_rate": 0.5})
        store.relabel_eval("after", "step_0004")
        rows = sorted(store.db.execute("SELECT step, label, path FROM evaluations"))
        assert rows == [(2, "step_0002", "eval/step_0002.json"), (4, "step_0004", "eval/step_0004.json")]
        assert sorted(p.name for p in (store.path / "eval").glob("*.json")) == ["step_0002.json", "step_0004.json"]
        store.reconcile(log=lambda _: None)
        assert sorted(store.db.execute("SELECT step, label, path FROM evaluations")) == rows
        with pytest.raises(UserError, match="no evaluation 'after'"):
            store.relabel_eval("after", "x")
        with pytest.raises(UserError, match="already has an evaluation 'step_0004'"):
            store.relabel_eval("step_0002", "step_0004")
    finally:
        store.close()
