"""Every example config's first steps on the tiny model reproduce the golden record made
before the last restructuring (tests/golden_runs.py says what a record holds and how to
re-record one after a change of behaviour on purpose)."""

from __future__ import annotations

import json

import pytest

import golden_runs as g

CASES = [pytest.param(p, id=g.example_id(p), marks=[pytest.mark.skipif(bool(g.needs(p)), reason=g.needs(p) or "")]) for p in g.EXAMPLES]


def test_every_example_has_a_golden_record():
    missing = [g.example_id(p) for p in g.EXAMPLES if not (g.GOLDEN / f"{g.example_id(p)}.json").exists()]
    assert not missing, f"no golden record for {missing}: .venv/bin/python tests/golden_runs.py --record {' '.join(missing)}"


@pytest.mark.parametrize("path", CASES)
def test_the_example_reproduces_its_golden_record(path, tmp_path):
    golden = json.loads((g.GOLDEN / f"{g.example_id(path)}.json").read_text())
    assert golden["overrides"] == g.overrides(path), "the shrinkage changed: re-record (tests/golden_runs.py --record)"
    got = g.record(g.run_example(path, tmp_path / "run"))
    assert got["metrics"] and got["weights"], "a record with nothing in it proves nothing"
    diff = g.same({k: golden[k] for k in ("metrics", "eval", "weights")}, got, **g.tolerance(golden))
    assert not diff, "\n".join(diff[:20])


def test_the_comparison_catches_a_change():
    rec = {"metrics": [{"step": 1, "loss/policy": 0.25, "reward/mean": "nan"}], "eval": {}, "weights": {"sum": 1.0}}
    assert g.same(rec, json.loads(json.dumps(rec))) == []
    moved = json.loads(json.dumps(rec))
    moved["metrics"][0]["loss/policy"] = 0.25 * (1 + 1e-5)
    assert g.same(rec, moved) == ["/metrics[0]/loss/policy: 0.25 against 0.2500025"]
    moved["metrics"][0]["extra"] = 1
    assert "/metrics[0]/extra: only in this run" in g.same(rec, moved)
    assert g.same(rec, {**rec, "metrics": []}) == ["/metrics: 1 entries against 0"]


def test_another_machine_forgives_float_kernels_but_not_a_change():
    rec = {"metrics": [{"step": 1, "rows_run": 3, "loss/policy": 0.25, "rollout/logprob_mismatch": 6e-4}], "weights": {"sum": 12.5}}
    noise = {"metrics": [{"step": 1, "rows_run": 3, "loss/policy": 0.25 * (1 + 4e-4), "rollout/logprob_mismatch": 5.7e-4}], "weights": {"sum": 12.5 * (1 - 5e-4)}}
    assert g.same(rec, noise) != []  # on the recording machine the last digits must agree
    assert g.same(rec, noise, **g.CROSS_MACHINE) == []
    changed = json.loads(json.dumps(noise))
    changed["metrics"][0]["loss/policy"] = 0.25 * 1.01
    assert g.same(rec, changed, **g.CROSS_MACHINE) == ["/metrics[0]/loss/policy: 0.25 against 0.2525"]
    changed = json.loads(json.dumps(noise))
    changed["metrics"][0]["rows_run"] = 4  # counts stay exact everywhere
    assert g.same(rec, changed, **g.CROSS_MACHINE) == ["/metrics[0]/rows_run: 3 against 4"]
    assert g.tolerance({"machine": g.machine()}) == {"rtol": g.RTOL, "atol": 1e-9}
    assert g.tolerance({}) == g.CROSS_MACHINE and g.tolerance({"machine": "another CPU | torch 0"}) == g.CROSS_MACHINE
