"""Tests for recursa.report on synthetic run directories."""

import json
import warnings

import pytest
from scipy import stats as sps

from recursa.report import load_eval, load_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

METRICS = [
    {"step": 0, "reward/mean": 0.1, "reward/std": 0.05, "loss/policy": 0.7, "policy/kl": 0.0,
     "policy/entropy": 1.9, "completion/len_mean": 120.0,
     "time/rollout_s": 2.0, "time/update_s": 1.0, "time/step_s": 3.1},
    # reward/std, entropy and timings missing on this line
    {"step": 1, "reward/mean": 0.3, "policy/kl": 0.01, "completion/len_mean": 110.0},
    # a held-out evaluation line
    {"step": 1, "eval/success_rate": 0.4, "eval/ci95_lo": 0.2, "eval/ci95_hi": 0.6, "eval/mean_reward": 0.41},
    {"step": 2, "reward/mean": 0.9, "reward/std": 0.1, "policy/kl": 0.02, "policy/entropy": 1.7,
     "time/rollout_s": 2.2, "time/update_s": 0.9, "throughput/tokens_per_s": 1500.5},
    {"step": 2, "eval/success_rate": 0.7, "eval/ci95_lo": 0.5, "eval/ci95_hi": 0.85},
]

ALL_PLOTS = ["reward.png", "eval_success.png", "kl.png", "entropy.png", "completion_len.png", "step_time.png"]


def _write_metrics(run_dir, records):
    with open(run_dir / "metrics.jsonl", "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


def _eval_json(successes, label=None, ci=None):
    items = [{"seed": s, "reward": float(ok), "success": ok} for s, ok in enumerate(successes)]
    k, n = sum(successes), len(successes)
    data = {"env": "arith", "split": "test", "n": n, "mean_reward": k / n, "success_rate": k / n,
            "items": items, "model": "tiny"}
    if ci is not None:
        data["ci95"] = ci
    if label is not None:
        data["label"] = label
    return data


def _assert_pngs(run_dir, names):
    for name in names:
        path = run_dir / "plots" / name
        assert path.is_file(), name
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), name


@pytest.fixture
def full_run(tmp_path):
    run_dir = tmp_path / "run-42"
    (run_dir / "eval").mkdir(parents=True)
    _write_metrics(run_dir, METRICS)
    (run_dir / "config.toml").write_text('[train]\nlr = 1e-6\nname = "grpo-`x`"\n', encoding="utf-8")
    # 12 items; before solves seeds 0-3 and 10; after solves seeds 0-9.
    # b (only after) = seeds 4-9 = 6; c (only before) = seed 10 = 1.
    before = [s in {0, 1, 2, 3, 10} for s in range(12)]
    after = [s < 10 for s in range(12)]
    (run_dir / "eval" / "before.json").write_text(json.dumps(_eval_json(before, "base", [0.19, 0.68])))
    (run_dir / "eval" / "after.json").write_text(json.dumps(_eval_json(after)))
    return run_dir


def test_full_report(full_run):
    report = write_report(full_run)
    assert report == full_run / "report.md"
    text = report.read_text(encoding="utf-8")

    assert text.startswith("# Run report: run-42\n")
    # config verbatim in a collapsible block
    assert "<details><summary>config.toml</summary>" in text
    assert 'lr = 1e-6\nname = "grpo-`x`"' in text

    # evaluation table: label, file, n, rates with intervals
    assert "| base | eval/before.json |" in text
    assert "| after | eval/after.json |" in text
    assert "0.417 [0.190, 0.680]" in text  # before: 5/12 with the file's ci95
    assert "0.833 [0.552, 0.953]" in text  # after: 10/12, no ci95 in file -> Wilson interval

    # paired comparison: b=6, c=1, n=7 discordant.
    # P(X >= 6 | 7, 1/2) = (C(7,6) + C(7,7)) / 128 = 8/128 = 0.0625; two-sided 0.125.
    assert "McNemar" in text
    assert "b = 6" in text and "c = 1" in text
    p_greater = sps.binomtest(6, 7, 0.5, alternative="greater").pvalue
    p_two = sps.binomtest(6, 7, 0.5).pvalue
    assert p_greater == pytest.approx(0.0625) and p_two == pytest.approx(0.125)
    assert "p = 0.0625 (one-sided" in text
    assert "p = 0.125 (two-sided" in text
    assert "0.417 → 0.833" in text and "difference +0.417" in text

    # final metrics: each key's last logged value and its step
    assert "| reward/mean | 0.9 | 2 |" in text
    assert "| completion/len_mean | 110 | 1 |" in text
    assert "| eval/mean_reward | 0.41 | 1 |" in text
    assert "| throughput/tokens_per_s | 1500.5 | 2 |" in text

    # plots exist, are real PNGs, and are embedded by relative path
    _assert_pngs(full_run, ALL_PLOTS)
    for name in ALL_PLOTS:
        assert f"](plots/{name})" in text
    assert str(full_run) not in text


def test_metrics_only_run(tmp_path):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    _write_metrics(run_dir, [
        {"step": 0, "reward/mean": 0.0, "policy/kl": 0.0},
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.75, "policy/kl": 0.03},
    ])
    text = write_report(run_dir).read_text(encoding="utf-8")
    assert "# Run report: bare" in text
    assert "No evaluation files" in text
    assert "McNemar" not in text
    assert "config.toml" not in text
    _assert_pngs(run_dir, ["reward.png", "kl.png"])
    for absent in ["eval_success.png", "entropy.png", "completion_len.png", "step_time.png"]:
        assert not (run_dir / "plots" / absent).exists()
        assert absent not in text
    assert "| reward/mean | 0.75 | 2 |" in text


def test_paired_comparison_skipped_without_shared_seeds(tmp_path):
    run_dir = tmp_path / "noshare"
    (run_dir / "eval").mkdir(parents=True)
    before = _eval_json([True, False])
    after = _eval_json([True, True])
    for it in after["items"]:
        it["seed"] += 100
    (run_dir / "eval" / "before.json").write_text(json.dumps(before))
    (run_dir / "eval" / "after.json").write_text(json.dumps(after))
    text = write_report(run_dir).read_text(encoding="utf-8")
    assert "share no item seeds" in text
    assert "McNemar" not in text
    assert "No `metrics.jsonl` records." in text


def test_load_metrics_tolerates_truncated_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward/mean": 1.0}\n\n{"step": 1, "rew', encoding="utf-8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = load_metrics(path)
    assert records == [{"step": 0, "reward/mean": 1.0}]
    assert any("truncated" in str(w.message) for w in caught)

    path.write_text('{"step": 0\n{"step": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=":1:"):
        load_metrics(path)

    assert load_metrics(tmp_path / "missing.jsonl") == []


def test_load_eval_roundtrip(tmp_path):
    data = _eval_json([True, False, True], label="x")
    path = tmp_path / "e.json"
    path.write_text(json.dumps(data))
    assert load_eval(path) == data


def test_episode_plot_only_for_multiturn_runs(tmp_path):
    run = tmp_path / "game"
    run.mkdir()
    rows = [{"step": k, "reward/mean": 0.1 * k, "episode/success_rate": 0.1 * k, "episode/invalid_rate": 1 - 0.2 * k} for k in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(run).read_text()
    assert (run / "plots" / "episodes.png").stat().st_size > 0 and "plots/episodes.png" in report
    single = tmp_path / "single"
    single.mkdir()
    (single / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    write_report(single)
    assert not (single / "plots" / "episodes.png").exists()
