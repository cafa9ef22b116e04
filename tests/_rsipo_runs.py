"""What the RSIPO test modules share: the fast tiny-model settings, reading a run's JSONL
files, and a run killed in its n-th update (for the exact-resume tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recursa.recipes.rsipo as rsipo
from recursa.config import load_config

FAST = ["model.name=tiny-random", "run.threads=1", "train.lr=1e-3", "eval.n=0", "sampling.max_new_tokens=5"]
VOLATILE = ("time/", "throughput/")  # wall-clock metrics differ between any two runs


def cfg(*sets, path=None):
    return load_config(path, [*FAST, *sets], recipe="rsipo")


def rows(run: Path, name: str = "metrics") -> list[dict]:
    path = run / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_rows(run: Path) -> list[dict]:
    return [r for r in rows(run) if "reward/mean" in r]


def kill_in_update(monkeypatch, config, out: Path, at: int = 3) -> None:
    """Train `config` into `out` until its `at`-th update raises KeyboardInterrupt (a kill
    mid-step), then restore the real update, so that the caller can resume the run."""
    real_update, calls = rsipo.update, []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real_update(*args, **kwargs)

    monkeypatch.setattr(rsipo, "update", crash)
    with pytest.raises(KeyboardInterrupt):
        rsipo.train(config, out, log=lambda *_: None)
    monkeypatch.setattr(rsipo, "update", real_update)
