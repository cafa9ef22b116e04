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

    patch_rsipo(monkeypatch, "update", crash)
    with pytest.raises(KeyboardInterrupt):
        rsipo.train(config, out, log=lambda *_: None)
    patch_rsipo(monkeypatch, "update", real_update)


RSIPO_MODULES = ("recursa.recipes.rsipo", "recursa.methods.attempts", "recursa.methods.skills", "recursa.methods.hatch",
                 "recursa.methods.wins", "recursa.methods.teacher")


def patch_rsipo(monkeypatch, name: str, value) -> None:
    """Replace `name` in the RSIPO recipe and in every module of its phases that binds it
    (recursa/methods/: attempts, skills, hatch, wins, teacher), as a patch of one module
    did when the recipe was one file."""
    import importlib

    hit = False
    for module in map(importlib.import_module, RSIPO_MODULES):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)
            hit = True
    assert hit, f"no RSIPO module binds {name!r}"
