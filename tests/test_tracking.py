"""Live trackers (`log.report_to`): one GRPO run on the tiny model reports to every tracker
installed here, offline; each tracker's own files are read back and must hold exactly the
numeric keys and values of metrics.jsonl at the same steps. A tracker whose package is
missing is skipped with the reason (pip install 'recursa[track]')."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import sqlite3
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from recursa.tracking import numeric

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
INSTALLED = [name for name, module in PACKAGES.items() if importlib.util.find_spec(module) is not None]


def _need(name: str) -> None:
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed (pip install 'recursa[track]')")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-step GRPO run reporting to every installed tracker, in a fresh process."""
    if not INSTALLED:
        pytest.skip("no tracker installed (pip install 'recursa[track]')")
    root = tmp_path_factory.mktemp("tracked")
    run = root / "run"
    env = {**os.environ, "TRACKIO_DIR": str(root / "trackio"), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MLFLOW_TRACKING_URI", None)
    argv = [sys.executable, "-m", "recursa.cli", "train", SMOKE, "--out", str(run), "--set", "train.steps=2", "--set", "eval.n=4",
            "--set", f"log.report_to={json.dumps(INSTALLED)}", "--set", "log.log_completions=true", "--set", "log.project='byo-test'",
            "--set", "log.run_name='tiny'"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected: dict[int, dict[str, float]] = defaultdict(dict)  # step -> every numeric value logged at that step
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        expected[row["step"]].update(numeric(row))
    assert set(expected) == {0, 1, 2} and "reward/mean" in expected[1] and "eval/success_rate" in expected[2]
    return run, root, dict(expected)


def _same(got: dict[int, dict[str, float]], expected: dict[int, dict[str, float]], rel: float = 0.0) -> None:
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert set(got[step]) == set(expected[step]), step
        for k, v in expected[step].items():
            if math.isnan(v):
                assert math.isnan(got[step][k]), k
            else:
                assert got[step][k] == pytest.approx(v, rel=rel, abs=1e-12 if rel == 0 else 1e-7), k


def test_tensorboard_event_files_hold_the_metrics(tracked):
    _need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, expected = tracked
    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got[event.step][tag] = event.value
    _same(got, expected, rel=1e-6)  # event files store float32
    assert "samples/text_summary" in acc.Tags()["tensors"]


def _wandb_records(path: str):
    """The protobuf records of a .wandb transaction log (LevelDB-style 32 KiB blocks, each
    record with a 7-byte header: crc32, length, type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4)."""
    raw, pos, buf, block = Path(path).read_bytes(), 7, b"", 32768  # 7 bytes: ':W&B', magic, version
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        buf += raw[pos : pos + length]
        pos += length
        if kind in (1, 4):
            yield buf
            buf = b""


def test_wandb_offline_run_holds_the_metrics(tracked):
    _need("wandb")
    from wandb.proto import wandb_internal_pb2

    run, _, expected = tracked
    [path] = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    got: dict[int, dict[str, float]] = defaultdict(dict)
    samples = 0
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        step = items.pop("_step")
        table = {k for k in items if k == "samples" or k.startswith("samples/")}  # a table is logged as several nested keys
        samples += bool(table)
        got[step].update({k: float(v) for k, v in items.items() if not k.startswith("_") and k not in table})
    _same(got, expected)
    assert samples == 2  # log_completions: one table per training step


def test_trackio_local_store_holds_the_metrics(tracked):
    _need("trackio")
    run, root, expected = tracked
    db = sqlite3.connect(root / "trackio" / "byo-test.db")
    got: dict[int, dict[str, float]] = defaultdict(dict)
    samples = 0
    for step, blob, name in db.execute("SELECT step, metrics, run_name FROM metrics ORDER BY id"):
        assert name == "tiny"
        values = json.loads(blob)
        samples += "samples" in values
        got[step].update({k: float(v) for k, v in values.items() if k != "samples"})
    _same(got, expected)
    assert samples == 2


def test_mlflow_local_store_holds_the_metrics(tracked):
    _need("mlflow")
    from mlflow.tracking import MlflowClient

    run, _, expected = tracked
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    [mlrun] = client.search_runs([client.get_experiment_by_name("byo-test").experiment_id])
    assert mlrun.info.run_name == "tiny" and mlrun.data.params["train.steps"] == "2"
    got: dict[int, dict[str, float]] = defaultdict(dict)
    for key in mlrun.data.metrics:
        for m in client.get_metric_history(mlrun.info.run_id, key):
            got[m.step][key] = m.value
    _same(got, expected)
    assert sorted(a.path for a in client.list_artifacts(mlrun.info.run_id, "samples")) == ["samples/step_000001.jsonl", "samples/step_000002.jsonl"]


def test_a_missing_tracker_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from recursa.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when it is not installed
    assert main(["train", SMOKE, "--out", str(tmp_path / "r"), "--set", "log.report_to=['wandb']"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs the wandb package: pip install 'recursa[track]'" in err and "\n" not in err
