"""Run-directory input and output that survives kills, full disks and a second writer.

* :func:`atomic_write_bytes` / :func:`atomic_write_text` write a file through a temporary
  file in the same directory (write, flush, fsync, rename, fsync the directory): a reader
  sees the old file or the new one, never a torn one, whatever moment the process dies.
  :func:`append_line` appends one JSON line with a single write and fsync; a line torn by
  a kill is the file's last, and every reader drops it (:func:`read_jsonl`).
* :class:`RunLock` locks a run directory while a process writes it (an advisory ``flock``
  on ``RUN_DIR/.recursa.lock``, which names the holder's pid and host). The kernel drops
  the lock when its holder dies, so a lock left by a killed process is taken over; a
  second live writer is refused with one line naming the holder.
* :func:`is_run_dir` / :func:`remove_run_files` let ``--overwrite`` refuse a directory
  that is not a recursa run and delete only a run's own files; :func:`refuse_deleting`
  refuses ``.``, a parent of the working directory and the home directory outright.
* :func:`inside` is the containment check of every reader and writer of a run directory:
  a path that resolves (symlinks followed) outside the directory is refused in one line.
* :func:`user_error_of` turns the operating system's failures (disk full, permission
  denied, read-only file system) into one-line :class:`~recursa.errors.UserError` messages.
* :func:`fault_point` is the fault-injection hook of the test suite: with
  ``RECURSA_FAULT_AT=NAME`` (or ``NAME@K``, the K-th time that point is reached) the process
  kills itself with SIGKILL there; with ``RECURSA_FAULT_ENOSPC=NAME`` it raises the
  "no space left on device" error there. Both are deterministic, never timing-based; the
  names are listed in :data:`FAULT_POINTS`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from recursa.errors import UserError

__all__ = [
    "FAULT_POINTS",
    "LOCK_NAME",
    "RunLock",
    "append_line",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fault_point",
    "fsync_dir",
    "inside",
    "is_run_dir",
    "read_jsonl",
    "refuse_deleting",
    "remove_run_files",
    "user_error_of",
]

LOCK_NAME = ".recursa.lock"

# Every write point the fault-injection suite kills at (tests/test_faults.py).
FAULT_POINTS: tuple[str, ...] = (
    "config.written",  # config.toml of a new run written
    "metrics.torn",  # half of a metrics line written (then killed: a torn last line)
    "metrics.appended",  # a metrics line written and synced
    "eval.tmp",  # eval/<label>.json's temporary file written, not yet renamed
    "eval.renamed",  # eval/<label>.json in place, its ledger row not yet written
    "eval.recorded",  # the evaluation's ledger row committed
    "checkpoint.tmp",  # a checkpoint's temporary directory fully written, not yet renamed
    "checkpoint.renamed",  # checkpoints/step_K in place, its ledger row not yet written
    "checkpoint.recorded",  # the checkpoint's ledger row committed
    "truncate.jsonl",  # a resume rewrote one *.jsonl log
)

_hits: dict[str, int] = {}


def cache_dir() -> Path:
    """recursa's cache directory on this machine ($RECURSA_CACHE, else ~/.cache/recursa): the
    embedded model converted to safetensors, generated TextWorld games."""
    return Path(os.environ.get("RECURSA_CACHE", Path.home() / ".cache" / "recursa"))


def _matches(spec: str | None, name: str) -> bool:
    if not spec:
        return False
    for item in spec.split(","):
        want, _, nth = item.strip().partition("@")
        if want == name and (not nth or _hits.get(name, 0) == int(nth)):
            return True
    return False


def fault_point(name: str) -> None:
    """A named write point: kill the process (RECURSA_FAULT_AT) or fail with ENOSPC
    (RECURSA_FAULT_ENOSPC) here when the environment asks for it; otherwise nothing."""
    at, enospc = os.environ.get("RECURSA_FAULT_AT"), os.environ.get("RECURSA_FAULT_ENOSPC")
    if not at and not enospc:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _matches(at, name):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if _matches(enospc, name):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)


# ----------------------------------------------------------------------------- containment


def inside(root: Path, path: Path | str, what: str = "the run directory") -> Path:
    """`path` (a path under `root`, e.g. root / "metrics.jsonl") when it resolves inside `root` with
    every symlink followed; else a one-line UserError: a file of a run directory (a lock, a
    log, plots/, a checkpoint's shard) never points outside it, so no command reads or
    writes elsewhere through one (issue 49). Returns the unresolved path."""
    root, path = Path(root), Path(path)
    base = root.resolve()
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise UserError(f"{path} is a symlink loop inside {what} {root}: remove it") from None
    if real != base and base not in real.parents:
        raise UserError(f"{path} points outside {what} {root} (to {real}): a run directory's files must stay inside it; remove that link or file")
    return path


def inside_tree(root: Path, top: Path | str, what: str = "the run directory") -> Path:
    """`top` when it and everything beneath it resolve inside `root` (`inside` for each):
    every file and directory at any depth, and what a directory link leads to, walked as
    well (each real directory once, so a link loop ends). A checkpoint is read by libraries
    that open whatever its directory holds (a shard in a nested folder, the tokenizer files,
    LoRA adapters), so containment covers the whole tree, not its top-level names (issue 49).
    Returns `top`."""
    seen: set[Path] = set()
    stack = [Path(top)]
    while stack:
        path = stack.pop()
        inside(root, path, what)
        if path.is_dir():
            real = path.resolve()
            if real not in seen:
                seen.add(real)
                stack.extend(sorted(path.iterdir()))
    return Path(top)


def refuse_deleting(path: Path, flag: str = "--overwrite") -> None:
    """A one-line UserError when `path` is a directory no --overwrite may delete, whatever
    it holds: the file-system root, the home directory or one of its parents, the working
    directory or one of its parents."""
    real = Path(path).resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    why = ("the file-system root" if real == Path(real.anchor) else "your home directory" if real == home
           else "a parent of your home directory" if real in home.parents else "the working directory" if real == cwd
           else "a parent of the working directory" if real in cwd.parents else None)
    if why:
        raise UserError(f"{flag} {path}: it is {why}; refusing to delete anything there: choose a new or empty directory")


# ----------------------------------------------------------------------------- atomic writes


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, point: str | None = None) -> Path:
    """Write `data` to `path` through a temporary file + fsync + rename. `point` names the
    fault point reached once the temporary file is written (``<point>.tmp``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if point:
            fault_point(f"{point}.tmp")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: Path, text: str, point: str | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), point)


def atomic_write_json(path: Path, obj, point: str | None = None, indent: int | None = 1) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent) + "\n", point)


def append_line(path: Path, text: str, point: str | None = None) -> None:
    """Append `text` (one or more whole lines) with one write, then fsync."""
    data = text.encode("utf-8")
    with open(path, "ab") as f:
        if point and os.environ.get("RECURSA_FAULT_AT"):  # the test hook: die with half the line written
            torn = f"{point}.torn"
            _hits[torn] = _hits.get(torn, 0) + 1
            if _matches(os.environ["RECURSA_FAULT_AT"], torn):
                f.write(data[: max(1, len(data) // 2)])
                f.flush()
                os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if point:
        fault_point(f"{point}.appended")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; a torn last line (a kill mid-append) is dropped.
    A malformed line elsewhere is a UserError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [(i + 1, line) for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()) if line.strip()]
    out = []
    for pos, (lineno, line) in enumerate(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if pos == len(lines) - 1:
                break  # torn by a kill while appending
            raise UserError(f"{path}:{lineno} is not valid JSON: the run's log is corrupt; remove that line (or the run) and resume") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("step", 0), int):
            raise UserError(f"{path}:{lineno} is not a step-tagged JSON object: the run's log is corrupt; remove that line (or the run) and resume")
        out.append(obj)
    return out


# ----------------------------------------------------------------------------- the run lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


_held: dict[str, "RunLock"] = {}


class RunLock:
    """An exclusive lock on a run directory, re-entrant within one process.

    ``acquire()`` takes an advisory ``flock`` on RUN_DIR/.recursa.lock and writes the holder
    (pid, host, start time, command) into it; a second process is refused with a UserError
    naming that holder. The kernel releases the lock when the holder dies, however it dies,
    so a stale lock file (its pid gone) is taken over, and ``stale`` then names the dead
    holder. ``release()`` unlocks (the file stays, it is harmless)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._depth = 0
        self.stale: dict = {}

    @classmethod
    def of(cls, run_dir: Path) -> "RunLock":
        key = str(Path(run_dir).resolve())
        if key not in _held:
            _held[key] = cls(run_dir)
        return _held[key]

    def acquire(self) -> "RunLock":
        import fcntl

        if self._depth:
            self._depth += 1
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        inside(self.run_dir, self.path)  # a lock file linked elsewhere is refused, not written through
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            h = _read_holder(self.path)
            who = f"pid {h.get('pid', '?')} on host {h.get('host', '?')}"
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"])) if "since" in h else "an unknown time"
            raise UserError(
                f"{self.run_dir} is being written by another recursa process ({who}, since {since}): wait for it to finish, "
                "stop it, or choose another --out"
            ) from None
        previous = _read_holder(self.path)
        if previous.get("pid") and previous.get("host") == socket.gethostname() and previous["pid"] != os.getpid() and not _pid_alive(previous["pid"]):
            self.stale = previous
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "argv": sys.argv[:8]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        self._depth = 1
        return self

    def release(self) -> None:
        import fcntl

        if not self._depth:
            return
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def release_all(self) -> None:
        """Release however many times this process acquired it (a run that stopped on an error)."""
        while self._depth:
            self.release()

    @property
    def held(self) -> bool:
        return self._depth > 0

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------- --overwrite

_RUN_FILES = ("config.toml", "metrics.jsonl", "samples.jsonl", "ledger.sqlite", "ledger.sqlite-journal", "ledger.sqlite-wal",
              "ledger.sqlite-shm", "report.md", "demos.json", "apo_reference.jsonl")  # apo_reference: A*-PO's stage-1 sample (no step tags)
_RUN_DIRS = ("eval", "checkpoints", "incumbents", "plots", "tb")


def _is_ledger(path: Path) -> bool:
    """A run's ledger: a regular file (not a link) that is a SQLite database."""
    try:
        if path.is_symlink() or not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds a recursa run, i.e. recursa wrote it: its ledger.sqlite (which the
    run store creates before anything else) beside a config.toml naming a recipe, or beside a
    metrics log, an eval/ or checkpoints/ directory. A project directory holding its own
    config.toml, even one naming a recipe, is not a run."""
    import tomllib

    path = Path(path)
    if not _is_ledger(path / "ledger.sqlite"):
        return False
    cfg = path / "config.toml"
    if cfg.is_file():
        try:
            if "recipe" in tomllib.loads(cfg.read_text(errors="replace")):
                return True
        except (tomllib.TOMLDecodeError, OSError):
            pass
    return (path / "metrics.jsonl").is_file() or any((path / d).is_dir() for d in ("eval", "checkpoints"))


def _step_tagged(path: Path) -> bool:
    """A *.jsonl written by a run: its first line is a JSON object with a "step"."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return False
    if not first.strip():
        return path.stat().st_size == 0
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and "step" in obj


def remove_run_files(path: Path) -> list[str]:
    """Delete a run's own files in `path` (config, logs, ledger, evaluations, checkpoints,
    report, plots); anything else stays. Returns the names of what was left in place.
    Refuses (UserError) a directory that is not a recursa run and is not empty."""
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_dir():
        raise UserError(f"--overwrite {path}: it is a file, not a run directory; choose another --out")
    entries = [p for p in path.iterdir() if p.name != LOCK_NAME]
    if entries:
        refuse_deleting(path)
    if entries and not is_run_dir(path):
        raise UserError(
            f"--overwrite {path}: this directory is not a recursa run (no ledger.sqlite that recursa wrote) and is not empty; "
            "refusing to delete anything: choose an empty or new --out"
        )
    kept = []
    for p in entries:
        own = (p.name in _RUN_FILES and p.is_file()) or (p.name in _RUN_DIRS and p.is_dir()) or (
            p.suffix == ".jsonl" and p.is_file() and _step_tagged(p)) or p.name.startswith(".") and ".tmp-" in p.name
        if not own:
            kept.append(p.name)
        elif p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return kept


# ----------------------------------------------------------------------------- OS errors


def user_error_of(exc: BaseException) -> UserError | None:
    """A one-line UserError for an operating-system failure a user can fix, else None."""
    if isinstance(exc, OSError):
        where = exc.filename or ""
        where = f" ({where})" if where else ""
        if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
            return UserError(f"disk full{where}: free some space (or use another --out), then continue with `recursa train --resume RUN_DIR`; "
                             "the last finished checkpoint is intact")
        if exc.errno == errno.EROFS:
            return UserError(f"read-only file system{where}: choose a writable --out")
        if exc.errno in (errno.EACCES, errno.EPERM):
            return UserError(f"permission denied{where}: make it readable/writable for this user, or choose another path")
        if exc.errno == errno.ENOENT:
            return UserError(f"no such file or directory{where}: check the path")
        if exc.errno in (errno.ENOTDIR, errno.EISDIR):
            return UserError(f"{os.strerror(exc.errno).lower()}{where}: pass the right kind of path")
        if exc.errno == errno.ENAMETOOLONG:
            return UserError(f"file name too long{where}: choose a shorter path")
        if exc.errno == errno.EIO:
            return UserError(f"input/output error{where}: the disk or file system failed; check it and resume")
    # Writers that do not raise OSError on a full disk: torch.save's zip writer ("unexpected pos",
    # "file write failed"), safetensors (an IoError with os error 28 / StorageFull), SQLite
    # ("database or disk is full").
    text = str(exc)
    markers = ("unexpected pos", "file write failed", "No space left", "StorageFull", "os error 28", "database or disk is full")
    if isinstance(exc, Exception) and any(m in text for m in markers):
        return UserError(f"disk full while writing ({type(exc).__name__}): free some space, then continue with `recursa train --resume RUN_DIR`; "
                         "the last finished checkpoint is intact")
    return None
