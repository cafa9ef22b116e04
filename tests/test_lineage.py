"""The lineage ledger: round trips, incumbents, counts, tree text, test-look cap, resume, plots."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest
from matplotlib.image import imread

from recursa.errors import UserError
from recursa.gate import GateConfig, binary_gate, continuous_gate
from recursa.lineage import (
    Lineage,
    TestLook,
    format_tree,
    plot_lineage,
    report_section,
    show_lineage,
    summary_lines,
)

CFG = GateConfig(alpha=0.05)


def better():
    """Candidate solves 8 of 10 items the incumbent fails: b=8, c=0, p=2**-8 -> accepted."""
    return binary_gate([False] * 10, [True] * 8 + [False] * 2, CFG)


def tie():
    """b=1, c=1: p=0.75 -> rejected."""
    return binary_gate([True, False] + [True] * 8, [False, True] + [True] * 8, CFG)


@pytest.fixture
def lin(tmp_path):
    lineage = Lineage(tmp_path / "ledger.sqlite")
    yield lineage
    lineage.close()


def test_binary_record_round_trips_every_field(tmp_path):
    d = better()
    assert d.accepted and (d.b, d.c, d.n) == (8, 0, 10)
    lin = Lineage(tmp_path / "ledger.sqlite")
    root = lin.root("weights", "initial policy", {"checkpoint": "checkpoints/step_000000"})
    cid = lin.record("weights", root, 5, "grpo step 5", {"checkpoint": "checkpoints/step_000005", "ids": [1, 2]}, d)
    lin.close()

    c = Lineage(tmp_path / "ledger.sqlite").get(cid)  # a fresh connection reads it back
    assert (c.kind, c.parent_id, c.step, c.summary) == ("weights", root, 5, "grpo step 5")
    assert c.payload == {"checkpoint": "checkpoints/step_000005", "ids": [1, 2]}
    assert c.stats == {**dataclasses.asdict(d), "gain_ci95": list(d.gain_ci95)}
    assert c.stats["p_value"] == 2.0**-8 and c.stats["gain"] == 0.8
    assert (c.incumbent_score, c.candidate_score, c.n) == (0.0, 0.8, 10)
    assert c.accepted and c.reason == d.reason and c.reason.startswith("accepted: ")
    assert isinstance(c.created, float) and not c.is_root


def test_binary_scores_count_regressions():
    # incumbent solves 6, candidate gains b=1 and loses c=2: rates 0.6 -> 0.5
    inc = [True] * 6 + [False] * 4
    cand = [True] * 4 + [False] * 2 + [True] + [False] * 3
    d = binary_gate(inc, cand, CFG)
    lin = Lineage(":memory:")
    cid = lin.record("skills", lin.root("skills", "empty library", []), 1, "s", ["sk1"], d)
    c = lin.get(cid)
    assert (c.incumbent_score, c.candidate_score) == (0.6, 0.5)
    assert not c.accepted and c.reason == d.reason


def test_continuous_record_needs_incumbent_score():
    d = continuous_gate([0.2, 0.4, 0.5, 0.1], [0.6, 0.7, 0.9, 0.5], CFG, n_boot=2000)
    lin = Lineage(":memory:")
    root = lin.root("prompt", "system prompt v0", "You are a helpful agent.")
    with pytest.raises(ValueError, match="incumbent_score"):
        lin.record("prompt", root, 1, "v1", "Think step by step.", d)
    with pytest.raises(ValueError, match="derived"):
        lin.record("prompt", root, 1, "v1", "x", better(), incumbent_score=0.3)
    c = lin.get(lin.record("prompt", root, 1, "v1", "Think step by step.", d, incumbent_score=0.3))
    assert c.stats == dataclasses.asdict(d)
    assert c.incumbent_score == 0.3 and c.candidate_score == pytest.approx(0.3 + d.mean_diff)
    assert c.accepted == d.accepted and c.payload == "Think step by step."


def test_incumbent_switches_only_on_accepted(lin):
    root = lin.root("weights", "w0", "ckpt0")
    skills = lin.root("skills", "lib0", [])
    assert lin.incumbent("weights").id == root
    lin.record("weights", root, 1, "w1", "ckpt1", tie())
    assert lin.incumbent("weights").id == root
    w2 = lin.record("weights", root, 2, "w2", "ckpt2", better())
    assert lin.incumbent("weights").id == w2
    lin.record("weights", w2, 3, "w3", "ckpt3", tie())
    assert lin.incumbent("weights").id == w2
    assert lin.incumbent("skills").id == skills  # kinds are independent
    assert lin.incumbent("weights").payload == "ckpt2"


def test_record_validates_kind_parent_step_and_payload(lin, tmp_path):
    root = lin.root("weights", "w0", "ckpt0")
    rejected = lin.record("weights", root, 1, "w1", "ckpt1", tie())
    lin.root("skills", "lib0", [])
    with pytest.raises(ValueError, match="one of weights, skills, prompt"):
        lin.record("optimizer", root, 1, "x", None, better())
    with pytest.raises(ValueError, match="was rejected"):
        lin.record("weights", rejected, 2, "x", None, better())
    with pytest.raises(ValueError, match="needs a skills parent"):
        lin.record("skills", root, 2, "x", None, better())
    with pytest.raises(ValueError, match="no lineage candidate with id 99"):
        lin.record("weights", 99, 2, "x", None, better())
    with pytest.raises(ValueError, match="before its parent"):
        lin.record("weights", lin.record("weights", root, 4, "w", "c", better()), 3, "x", None, better())
    with pytest.raises(ValueError, match="JSON-serialisable"):
        lin.record("weights", root, 2, "x", tmp_path, better())
    with pytest.raises(ValueError, match="already has a root"):
        lin.root("weights", "again", None)
    with pytest.raises(ValueError, match="no root yet"):
        lin.incumbent("prompt")


def test_counts_exclude_roots(lin):
    assert lin.counts() == {}
    lin.root("prompt", "p0", "text")
    w = lin.root("weights", "w0", "ckpt0")
    lin.record("weights", w, 1, "a", None, tie())
    w2 = lin.record("weights", w, 2, "b", None, better())
    lin.record("weights", w2, 3, "c", None, tie())
    assert lin.counts() == {"weights": {"accepted": 1, "rejected": 2}, "prompt": {"accepted": 0, "rejected": 0}}
    assert list(lin.counts()) == ["weights", "prompt"]  # KINDS order
    assert [c.summary for c in lin.candidates("weights")] == ["w0", "a", "b", "c"]
    assert len(lin.candidates()) == 5


def test_tree_orders_by_parent_then_step(lin):
    root = lin.root("weights", "initial policy", "ckpt0")
    late = lin.record("weights", root, 4, "late accepted", None, better())  # recorded first, later step
    lin.record("weights", root, 2, "early rejected", None, tie())
    lin.record("weights", late, 6, "grandchild " + "x" * 80, None, tie())
    lin.root("skills", "empty library", [])
    lines = format_tree(lin).splitlines()
    assert lines[0] == "weights: 1 accepted, 2 rejected"
    assert lines[1] == f"  #{root} step 0  initial policy  root"
    assert lines[2].startswith("    #3 step 2  early rejected  +0.000 [")
    assert "p=0.75  rejected (p=0.75 > alpha_t=0.05" in lines[2]
    assert lines[3].startswith(f"    #{late} step 4  late accepted  +0.800 [")
    assert "p=0.00391  ACCEPTED (p=0.003906 <= alpha_t=0.05" in lines[3]
    assert lines[4].startswith("      #4 step 6  grandchild xxx") and "…" in lines[4]
    assert lines[5:] == ["", "skills: 0 accepted, 0 rejected", "  #5 step 0  empty library  root"]
    assert [c.id for c in lin.children(root)] == [3, late]


def test_tree_of_continuous_decision_shows_one_sided_bound(lin):
    d = continuous_gate([0.0] * 6, [0.5] * 6, CFG, n_boot=2000)
    root = lin.root("prompt", "p0", "a")
    lin.record("prompt", root, 1, "p1", "b", d, incumbent_score=0.0)
    assert "+0.500 [+0.500, +inf) at 0.95  ACCEPTED" in format_tree(lin)
    assert format_tree(Lineage(":memory:")) == "no lineage candidates recorded"


def test_test_look_cap_raises_user_error(lin):
    assert lin.record_test_look(3, "w#2 vs root", 50, 0.4, 0.5, (-0.05, 0.25), 0.04, max_looks=2) == 1
    lin.record_test_look(7, "w#5 vs root", 50, 0.4, 0.56, (0.0, 0.3), 0.01, max_looks=2)
    with pytest.raises(UserError, match="already looked at 2 times, the cap of 2 looks"):
        lin.record_test_look(9, "again", 50, 0.4, 0.6, (0.0, 0.3), 0.01, max_looks=2)
    with pytest.raises(ValueError, match="max_looks"):
        lin.record_test_look(9, "again", 50, 0.4, 0.6, (0.0, 0.3), 0.01, max_looks=0)
    looks = lin.test_looks()
    assert [t.look_index for t in looks] == [1, 2]
    assert looks[0] == TestLook(1, 3, "w#2 vs root", 50, 0.4, 0.5, pytest.approx(0.1), -0.05, 0.25, 0.04, 1)
    lines = summary_lines(lin)
    assert "| 1 | 3 | w#2 vs root | 50 | 0.400 | 0.500 | +0.100 [-0.050, +0.250] | 0.04 |" in lines
    assert "No candidates recorded." in lines


def test_truncate_after_drops_later_steps(lin):
    root = lin.root("weights", "w0", "c0")
    w2 = lin.record("weights", root, 2, "w2", "c2", better())
    w4 = lin.record("weights", w2, 4, "w4", "c4", better())
    lin.record("weights", w4, 5, "w5", "c5", tie())
    lin.record_test_look(2, "a", 10, 0.1, 0.9, (0.4, 0.9), 0.001, max_looks=3)
    lin.record_test_look(4, "b", 10, 0.1, 0.9, (0.4, 0.9), 0.001, max_looks=3)
    lin.truncate_after(3)
    assert [c.id for c in lin.candidates()] == [root, w2]
    assert lin.incumbent("weights").id == w2
    assert [t.step for t in lin.test_looks()] == [2]
    assert lin.record_test_look(4, "b again", 10, 0.1, 0.9, (0.4, 0.9), 0.001, max_looks=3) == 2
    assert lin.get(lin.record("weights", w2, 4, "w4 again", "c4", better())).parent_id == w2


def _png_shape(path):
    assert path.is_file() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(path).shape


def test_plot_empty_single_and_many(lin, tmp_path):
    assert _png_shape(plot_lineage(lin, tmp_path / "empty.png"))[:2] == (380, 700)
    root = lin.root("weights", "w0", "c0")
    assert _png_shape(plot_lineage(lin, tmp_path / "root_only.png"))[:2] == (380, 700)
    lin.record("weights", root, 1, "w1", "c1", better())
    assert _png_shape(plot_lineage(lin, tmp_path / "plots" / "single.png"))[:2] == (380, 700)
    parent = lin.incumbent("weights").id
    for step in range(2, 30):
        d = better() if step % 7 == 0 else tie()
        lin.record("weights", parent, step, f"w{step}", None, d)
        parent = lin.incumbent("weights").id
    sk = lin.root("skills", "lib0", [])
    lin.record("skills", sk, 3, "lib1", ["a"], tie())
    p = lin.root("prompt", "p0", "a")
    lin.record("prompt", p, 4, "p1", "b", continuous_gate([0.1] * 5, [0.6] * 5, CFG, n_boot=2000), incumbent_score=0.1)
    assert _png_shape(plot_lineage(lin, tmp_path / "many.png"))[:2] == (940, 700)  # one panel per kind


def test_shares_the_ledger_with_other_tables(tmp_path):
    from recursa.store import RunStore

    store = RunStore(tmp_path / "run")
    store.db.execute("INSERT INTO checkpoints (step, path, created) VALUES (1, 'checkpoints/step_000001', 0)")
    store.db.commit()
    lin = Lineage(store.db)
    lin.record("weights", lin.root("weights", "w0", "c0"), 1, "w1", None, better())
    lin.close()  # a shared connection stays open
    store.truncate_after(5)
    assert store.db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] == 1
    store.close()

    again = Lineage(tmp_path / "run" / "ledger.sqlite")
    assert len(again.candidates()) == 2
    tables = {r[0] for r in again.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"evaluations", "checkpoints", "candidates", "test_looks"} <= tables
    again.close()


def test_cli_and_report_entry_points(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert report_section(run) == []
    with pytest.raises(UserError, match="has no lineage"):
        show_lineage(run)
    sqlite3.connect(run / "ledger.sqlite").execute("CREATE TABLE evaluations (id INTEGER)").connection.close()
    assert report_section(run) == []  # a ledger without a lineage is read, never changed
    tables = {r[0] for r in sqlite3.connect(run / "ledger.sqlite").execute("SELECT name FROM sqlite_master")}
    assert tables == {"evaluations"}

    lin = Lineage(run / "ledger.sqlite")
    root = lin.root("weights", "w0", "c0")
    lin.record("weights", root, 1, "w1", None, tie())
    lin.record("weights", root, 2, "w2", None, better())
    lin.record_test_look(2, "w2 vs w0", 100, 0.3, 0.4, (0.02, 0.18), 0.01, max_looks=1)
    lin.close()
    text, png = show_lineage(run)
    assert text.splitlines()[0] == "weights: 1 accepted, 1 rejected" and "ACCEPTED" in text
    assert png == run / "plots" / "lineage.png" and png.stat().st_size > 0
    png.unlink()
    lines = report_section(run)
    assert lines[0] == "## Lineage (gated changes)"
    assert "| weights | 1 | 1 | #3 w2 |" in lines
    assert "| 1 | 2 | w2 vs w0 | 100 | 0.300 | 0.400 | +0.100 [+0.020, +0.180] | 0.01 |" in lines
    assert "![Lineage](plots/lineage.png)" in lines and png.is_file()

