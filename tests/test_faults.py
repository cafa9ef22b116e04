"""Fault injection: kills at every write point, two writers, stale locks, corrupt
checkpoints, read-only and full disks, --overwrite of what is not a run
(docs/reliability.md, "Nothing lost").

Kills are deterministic: RECURSA_FAULT_AT=POINT@K makes the process SIGKILL itself the K-th
time it reaches write point POINT (recursa.runio.fault_point); tests/_fault_runner.py forks
one child per kill so the interpreter starts once."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from recursa.cli import main
from recursa.runio import FAULT_POINTS, RunLock

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
SETS = ["--set", "train.steps=2", "--set", "eval.n=4", "--set", "eval.batch_size=4", "--set", "train.group_size=2", "--set", "run.checkpoint_every=1"]
TIME_KEYS = ("time/", "throughput/")


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def _runner(jobs: list[dict], timeout: int = 900) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RECURSA_FAULT_AT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_fault_runner.py"), json.dumps(jobs)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ledger(run: Path, sql: str) -> list[tuple]:
    db = sqlite3.connect(run / "ledger.sqlite")
    try:
        return list(db.execute(sql))
    finally:
        db.close()


def _assert_consistent(run: Path) -> None:
    """The ledger, the checkpoints and the evaluations agree; nothing temporary is left."""
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_000001", "step_000002"], ckpts
    assert [r[0] for r in _ledger(run, "SELECT step FROM checkpoints ORDER BY step")] == [1, 2]
    evals = _ledger(run, "SELECT label, path FROM evaluations ORDER BY id")
    assert sorted(label for label, _ in evals) == ["after", "before"], evals
    for _, rel in evals:
        json.loads((run / rel).read_text())
    assert not [p for p in run.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


# each kill: (RECURSA_FAULT_AT spec, what it interrupts)
KILLS = [
    ("config.written", "the new run's config is written, nothing else"),
    ("metrics.torn@1", "half of the before-evaluation's metrics line"),
    ("metrics.torn@2", "half of step 1's metrics line"),
    ("metrics.appended@3", "step 2's metrics line written, its checkpoint not started"),
    ("eval.tmp@1", "before.json's temporary file written"),
    ("eval.recorded@2", "after.json's ledger row committed, the file not yet renamed"),
    ("eval.renamed@2", "after.json in place, its metrics line not written"),
    ("checkpoint.tmp@2", "the final checkpoint's temporary directory written"),
    ("checkpoint.renamed@1", "step 1's checkpoint in place, its ledger row not written"),
    ("checkpoint.recorded@2", "the final checkpoint recorded, the after-evaluation not started"),
]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """An uninterrupted reference run, and one run killed at each write point (plus one
    resume killed while it rewrites the logs), all from one runner process."""
    base = tmp_path_factory.mktemp("kills")
    ref = base / "ref"
    assert main(["train", SMOKE, "--out", str(ref), *SETS]) == 0
    jobs = [{"argv": ["train", SMOKE, "--out", str(base / f"k{i}"), *SETS], "fault": spec} for i, (spec, _) in enumerate(KILLS)]
    chain = base / "chain"  # killed at the final checkpoint, then its resume killed while truncating the logs
    jobs += [{"argv": ["train", SMOKE, "--out", str(chain), *SETS], "fault": "checkpoint.tmp@2"},
             {"argv": ["train", "--resume", str(chain)], "fault": "truncate.jsonl@1"}]
    outcomes = _runner(jobs)
    return base, ref, outcomes


def _assert_resumes_to(run: Path, ref: Path, flags: list[str] = ()) -> None:
    """`train --resume run` (with `flags`, e.g. --trust-run-code) ends with the uninterrupted run's metrics and held-out items."""
    assert main(["train", "--resume", str(run), *flags]) == 0
    assert _metrics(run) == _metrics(ref)
    for label in ("before", "after"):
        a = json.loads((ref / "eval" / f"{label}.json").read_text())
        b = json.loads((run / "eval" / f"{label}.json").read_text())
        assert a["items"] == b["items"], label


@pytest.mark.parametrize("i", range(len(KILLS)), ids=[k for k, _ in KILLS])
def test_kill_at_write_point_then_resume_equals_uninterrupted(killed_runs, i):
    base, ref, outcomes = killed_runs
    assert outcomes[i]["killed"], (KILLS[i], outcomes[i])
    run = base / f"k{i}"
    _assert_resumes_to(run, ref)
    _assert_consistent(run)


def test_kill_during_resume_truncation(killed_runs):
    base, ref, outcomes = killed_runs
    assert outcomes[-2]["killed"] and outcomes[-1]["killed"], outcomes[-2:]
    run = base / "chain"
    assert main(["train", "--resume", str(run)]) == 0
    assert _metrics(run) == _metrics(ref)
    _assert_consistent(run)


@pytest.mark.parametrize("recipe", ["grpo", "rsipo"])
def test_kill_during_a_mid_run_evaluation_keeps_the_training_before_it(tmp_path, recipe):
    """The evaluation every eval.every steps comes after that step's checkpoint: a kill while it
    runs loses no training, and the resumed run evaluates there first, then goes on as the
    uninterrupted run did (same metrics, same evaluated items)."""
    config = SMOKE if recipe == "grpo" else str(ROOT / "examples" / "rsipo_smoke.toml")
    sets = [*SETS, "--set", "eval.every=1"] + ([] if recipe == "grpo" else ["--set", "skills.candidates=2"])
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert main(["train", config, "--out", str(ref), *sets]) == 0
    (outcome,) = _runner([{"argv": ["train", config, "--out", str(run), *sets], "fault": "eval.tmp@2"}])  # before = 1st, step 1's = 2nd
    assert outcome["killed"], outcome
    assert (run / "checkpoints" / "step_000001").is_dir() and not (run / "eval" / "step_0001.json").exists()
    assert main(["train", "--resume", str(run)]) == 0
    assert _metrics(run) == _metrics(ref)
    for label in ("before", "step_0001", "after"):
        a = json.loads((ref / "eval" / f"{label}.json").read_text())
        b = json.loads((run / "eval" / f"{label}.json").read_text())
        assert a["items"] == b["items"], label
    evals = sorted(label for label, _ in _ledger(run, "SELECT label, path FROM evaluations"))
    assert evals == ["after", "before", "step_0001"], evals


def test_every_fault_point_is_exercised():
    """Each write point of recursa.runio.FAULT_POINTS is killed at in this module."""
    used = {k.split("@")[0] for k, _ in KILLS} | {"truncate.jsonl"}
    assert set(FAULT_POINTS) <= used, set(FAULT_POINTS) - used


# ----------------------------------------------------------------------------- two writers and stale locks


def test_second_writer_is_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from recursa.runio import RunLock; "
        "RunLock.of(sys.argv[2]).acquire(); print('locked', flush=True); time.sleep(120)"), str(ROOT), str(run)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", SMOKE, "--out", str(run), *SETS]) == 2
        err = capsys.readouterr().err.strip()
        assert f"pid {holder.pid}" in err and "another recursa process" in err and "\n" not in err
        assert not (run / "metrics.jsonl").exists() and not (run / "config.toml").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died by SIGKILL without releasing: its lock is taken over
    assert main(["train", SMOKE, "--out", str(run), *SETS, "--set", "train.steps=1", "--set", "eval.n=0"]) == 0
    out = capsys.readouterr().out
    assert f"from pid {holder.pid}, which is no longer running" in out


def test_second_writer_on_a_live_run_is_refused(tmp_path, capsys):
    """A resume of a run another process is training is refused, and the run is untouched."""
    run = tmp_path / "r"
    assert main(["train", SMOKE, "--out", str(run), *SETS, "--set", "train.steps=1", "--set", "eval.n=0"]) == 0
    before = (run / "metrics.jsonl").read_text()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from recursa.runio import RunLock; "
        "RunLock.of(sys.argv[2]).acquire(); print('locked', flush=True); time.sleep(120)"), str(ROOT), str(run)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for argv in (["train", "--resume", str(run)], ["train", SMOKE, "--out", str(run), "--overwrite"]):
            assert main(argv) == 2
            assert f"pid {holder.pid}" in capsys.readouterr().err
        assert (run / "metrics.jsonl").read_text() == before
        assert (run / "checkpoints" / "step_000001" / "state.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_reentrant_and_released(tmp_path):
    lock = RunLock.of(tmp_path / "x")
    with lock:
        with RunLock.of(tmp_path / "x"):
            assert lock.held
        assert lock.held
    assert not lock.held


# ----------------------------------------------------------------------------- corrupt checkpoints


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, capsys):
    run = tmp_path / "r"
    ref = tmp_path / "ref"
    assert main(["train", SMOKE, "--out", str(ref), *SETS]) == 0
    assert main(["train", SMOKE, "--out", str(run), *SETS, "--set", "eval.after=false"]) == 0
    capsys.readouterr()
    latest = run / "checkpoints" / "step_000002"
    opt = latest / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])  # truncated by a failing disk
    # the run did not finish its last step as far as the logs go: drop step 2's lines, as a kill would have
    assert main(["train", "--resume", str(run), "--set", "eval.after=true"]) == 0
    out = capsys.readouterr().out
    assert "step_000002 is corrupt" in out and "resuming from the previous good checkpoint" in out
    assert "resumed" in out and "step_000001" in out
    aside = [p.name for p in (run / "checkpoints").iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1  # set aside, never deleted
    assert (run / "checkpoints" / "step_000001" / "state.json").exists()
    assert _metrics(run) == _metrics(ref)  # step 2 was redone exactly


def test_resume_reconciles_a_checkpoint_without_ledger_row_and_a_row_without_checkpoint(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", SMOKE, "--out", str(run), *SETS, "--set", "eval.n=0"]) == 0
    db = sqlite3.connect(run / "ledger.sqlite")
    db.execute("DELETE FROM checkpoints WHERE step = 1")
    db.execute("INSERT INTO checkpoints (step, path, created) VALUES (7, 'checkpoints/step_000007', 0)")
    db.commit()
    db.close()
    (run / "eval" / "after.json").write_text("")  # a torn evaluation file (written by an older recursa)
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step_000001 had no ledger row" in out
    assert [r[0] for r in _ledger(run, "SELECT step FROM checkpoints ORDER BY step")] == [1, 2]


def test_empty_eval_file_is_set_aside_and_the_evaluation_rerun(tmp_path, capsys):
    run = tmp_path / "r"
    ref = tmp_path / "ref"
    assert main(["train", SMOKE, "--out", str(ref), *SETS]) == 0
    assert main(["train", SMOKE, "--out", str(run), *SETS]) == 0
    (run / "eval" / "after.json").write_text("")  # what a kill mid-write used to leave
    assert main(["train", "--resume", str(run)]) == 0
    assert "could not be read" in capsys.readouterr().out
    a = json.loads((ref / "eval" / "after.json").read_text())
    b = json.loads((run / "eval" / "after.json").read_text())
    assert a["items"] == b["items"]
    assert any(".corrupt-" in p.name for p in (run / "eval").iterdir())  # kept for inspection


# ----------------------------------------------------------------------------- --overwrite


def test_overwrite_deletes_only_the_runs_files(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", SMOKE, "--out", str(run), *SETS, "--set", "train.steps=1", "--set", "eval.n=0"]) == 0
    (run / "my_notes.md").write_text("keep me")
    (run / "data").mkdir()
    (run / "data" / "x.csv").write_text("1,2")
    (run / "list.jsonl").write_text('{"no": "step"}\n')  # not a run log: no step
    assert main(["train", SMOKE, "--out", str(run), *SETS, "--set", "train.steps=1", "--set", "eval.n=0", "--overwrite"]) == 0
    assert (run / "my_notes.md").read_text() == "keep me"
    assert (run / "data" / "x.csv").read_text() == "1,2"
    assert (run / "list.jsonl").exists()
    assert "kept 3 file(s)" in capsys.readouterr().err


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export X=1")
    (home / "thesis.tex").write_text("...")
    assert main(["train", SMOKE, "--out", str(home), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "not a recursa run" in err and "\n" not in err.strip()
    assert sorted(p.name for p in home.iterdir()) == [".bashrc", "thesis.tex"]


# ----------------------------------------------------------------------------- full and read-only disks


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_stops_cleanly_with_last_good_checkpoint(tmp_path, capsys):
    """A real full file system: a tmpfs sized so that the first checkpoints fit and a later
    one does not. The run stops with exit 2 and one line saying the disk is full; every
    finished checkpoint stays whole, no temporary directory is left, and after space is
    freed the run resumes to the end."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "16m"):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root and mount); the injected ENOSPC test covers the code path")
    try:
        probe = tmp_path / "probe"  # how large one checkpoint of this run is
        assert main(["train", SMOKE, "--out", str(probe), *SETS, "--set", "train.steps=1", "--set", "eval.n=0"]) == 0
        size = sum(f.stat().st_size for f in (probe / "checkpoints" / "step_000001").rglob("*") if f.is_file())
        capsys.readouterr()
        run = mnt / "r"
        ballast = mnt / "ballast"
        free = shutil.disk_usage(mnt).free
        ballast.write_bytes(b"\0" * (free - int(2.5 * size) - 64 * 1024))  # room for two checkpoints and the logs, not three
        code = main(["train", SMOKE, "--out", str(run), *SETS, "--set", "train.steps=6", "--set", "eval.n=0"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: disk full") and "\n" not in err, err
        done = sorted(p for p in (run / "checkpoints").iterdir())
        assert done and all(".tmp" not in p.name for p in done)
        from recursa.store import checkpoint_problem

        assert all(checkpoint_problem(p) is None for p in done)
        ballast.unlink()
        assert main(["train", "--resume", str(run)]) == 0
        assert (run / "checkpoints" / "step_000006" / "state.json").exists()
    finally:
        _umount(mnt)


@pytest.mark.parametrize("point", ["checkpoint.tmp", "eval.tmp", "metrics.appended"])
def test_injected_disk_full_is_one_line_and_resumable(killed_runs, tmp_path, point, capsys):
    """ENOSPC injected at a write point (deterministic, any machine): exit 2, one line that says
    the disk is full, and a resume that finishes equal to an uninterrupted run."""
    _, ref, _ = killed_runs
    run = tmp_path / "r"
    os.environ["RECURSA_FAULT_ENOSPC"] = point
    try:
        import recursa.runio

        recursa.runio._hits.clear()
        assert main(["train", SMOKE, "--out", str(run), *SETS]) == 2
    finally:
        del os.environ["RECURSA_FAULT_ENOSPC"]
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: disk full") and "\n" not in err, err
    assert main(["train", "--resume", str(run)]) == 0
    assert _metrics(run) == _metrics(ref)
    _assert_consistent(run)


def test_read_only_run_directory_is_one_line(tmp_path, capsys):
    mnt = tmp_path / "ro"
    if not _mount_tmpfs(mnt, "4m"):
        pytest.skip("cannot mount a tmpfs here to remount read-only (needs root and mount)")
    try:
        (mnt / "old").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)
        for argv in (["train", SMOKE, "--out", str(mnt / "new")], ["train", SMOKE, "--out", str(mnt / "old")],
                     ["eval", "--model", "tiny-random", "--n", "1", "--json", str(mnt / "e.json")]):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("error: ") and "\n" not in err and ("read-only" in err or "not writable" in err), err
    finally:
        _umount(mnt)


def test_permission_denied_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions; the read-only file system test covers refusals to write")
    cfg = tmp_path / "c.toml"
    cfg.write_text(Path(SMOKE).read_text())
    cfg.chmod(0)
    assert main(["train", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert "permission denied" in capsys.readouterr().err


def test_os_errors_map_to_one_line():
    from recursa.cli import expected_failure

    assert expected_failure(OSError(errno.ENOSPC, "No space left on device", "/x")).startswith("disk full (/x)")
    assert expected_failure(OSError(errno.EROFS, "Read-only file system", "/x")).startswith("read-only file system")
    assert expected_failure(PermissionError(errno.EACCES, "Permission denied", "/x")).startswith("permission denied")
    assert expected_failure(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 123 vs 456")).startswith("disk full")
    assert expected_failure(sqlite3.DatabaseError("file is not a database")).startswith("a run's ledger.sqlite")
    assert expected_failure(KeyError("x")) is None  # a bug keeps its traceback under --debug, and says so without it
