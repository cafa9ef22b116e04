"""Every command end to end on the tiny model, resume, and bad-input handling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recursa.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
TIME_KEYS = ("time/", "throughput/")


def _non_time(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_eval_report_envs(tmp_path, capsys):
    run = tmp_path / "smoke"
    assert main(["train", SMOKE, "--out", str(run)]) == 0
    for name in ("config.toml", "metrics.jsonl", "samples.jsonl", "ledger.sqlite", "report.md", "eval/before.json", "eval/after.json"):
        assert (run / name).exists(), name
    assert (run / "checkpoints" / "step_000003" / "model.safetensors").exists()
    rows = _metrics(run)
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for key in ("loss/policy", "policy/kl", "policy/clip_frac", "policy/entropy", "completion/len_mean", "time/rollout_s", "time/update_s", "throughput/tokens_per_s"):
        assert key in train_rows[0], key
    before = json.loads((run / "eval" / "before.json").read_text())
    assert set(before) >= {"env", "split", "n", "mean_reward", "success_rate", "ci95", "items"}
    assert before["n"] == 16 and before["split"] == "test" and len(before["items"]) == 16
    assert set(before["items"][0]) >= {"seed", "reward", "success"}
    assert all(i["seed"] >= 2_000_000_000 for i in before["items"])  # the test range

    out_json = tmp_path / "e.json"
    assert main(["eval", "--run", str(run), "--n", "16", "--json", str(out_json), "--compare", str(run / "eval" / "before.json")]) == 0
    data = json.loads(out_json.read_text())
    assert data["n"] == 16 and "compare" in data and "p_two_sided" in data["compare"]
    after = json.loads((run / "eval" / "after.json").read_text())
    assert [i["success"] for i in data["items"]] == [i["success"] for i in after["items"]]  # same weights, greedy

    assert main(["eval", "--config", SMOKE, "--n", "4", "--env", "arithmetic", "--env-arg", "difficulty=1"]) == 0
    assert main(["report", str(run)]) == 0
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "arithmetic" in out and "rg:" in out
    assert main(["train", "--help-config"]) == 0


def test_resume_equals_uninterrupted(tmp_path):
    sets = ["--set", "train.steps=4", "--set", "run.checkpoint_every=1", "--set", "eval.n=8"]
    full = tmp_path / "full"
    assert main(["train", SMOKE, "--out", str(full), *sets]) == 0

    part = tmp_path / "part"
    assert main(["train", SMOKE, "--out", str(part), *sets, "--set", "train.steps=2", "--set", "eval.after=false"]) == 0
    # simulate a crash after step 2's checkpoint: a stray later log line must be dropped
    with (part / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": 123.0}) + "\n")
    assert main(["train", "--resume", str(part), "--set", "train.steps=4", "--set", "eval.after=true"]) == 0
    assert _non_time(_metrics(part)) == _non_time(_metrics(full))
    a = json.loads((full / "eval" / "after.json").read_text())
    b = json.loads((part / "eval" / "after.json").read_text())
    assert a["items"] == b["items"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", SMOKE, "--set", "train.stepz=3"], "unknown key 'train.stepz'"),
        (["train", SMOKE, "--set", "train.lr=abc"], "train.lr"),
        (["train", SMOKE, "--set", "env.name=nosuchtask"], "unknown env 'nosuchtask'"),
        (["train", SMOKE, "--set", "model.name=/no/such/model"], "does not exist"),
        (["train", "missing.toml"], "not found"),
        (["eval", "--env", "rg:no_such_dataset", "--model", "tiny-random"], "no_such_dataset"),
        (["report", "/no/such/run"], "not a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    if argv[0] == "train" and "--out" not in argv and argv[1] != "missing.toml":
        argv = argv + ["--out", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main(["train", SMOKE, "--out", str(run)]) == 2
    assert "--resume" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "recursa.cli", "train", SMOKE, "--set", "nope=1", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "unknown key 'nope'" in err and "\n" not in err
