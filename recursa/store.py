"""The run directory: config, metrics, samples, checkpoints and the SQLite ledger.

```
RUN_DIR/
  config.toml          resolved config (every default written out)
  metrics.jsonl        one JSON object per line, {"step": k, "reward/mean": ..., ...}
  samples.jsonl        a few completions per step
  *.jsonl              a recipe's own step-tagged logs (expert iteration: kept.jsonl, tasks.jsonl)
  eval/*.json          held-out evaluations (before.json, after.json, step_0010.json, ...)
  checkpoints/step_000010/   a Hugging Face model directory, plus the training state:
      config.json, generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja
      model.safetensors  weights with the HF parameter names (`from_pretrained` loads the directory);
                         under LoRA adapter_config.json + adapter_model.safetensors instead
      optimizer.pt     AdamW state (CPU tensors: loads on any device)
      rng.pt           torch RNG state (and the GPUs' when CUDA is in use), tensors only
      state.json       step, optimizer steps, a recipe's own state
  incumbents/step_000008/    gated runs: accepted weights (the same HF layout) + optimizer.pt
  ledger.sqlite        evaluations and checkpoints (the source of truth for what was kept)
  tb/, wandb/, mlflow.db live trackers' files (log.report_to; recursa/tracking.py)
  report.md, plots/    written by `recursa report`
```

Step numbers count completed training steps: metrics of the first step carry step 1,
an evaluation before training carries step 0, and a checkpoint at step k holds the state
after k steps. With `run.keep_last = K` only the K newest checkpoints stay (incumbents and
what the ledger accepted are never deleted). Resuming from step k drops every log line with a larger step, so a resumed
run's logs equal an uninterrupted run's.

Checkpoints written before they were Hugging Face directories (a bare model.safetensors
with the same parameter names, no config or tokenizer files) still load, resume and export:
the model's architecture and tokenizer always come from the run's `model.name`.
Everything a checkpoint holds is read without unpickling code (safetensors, JSON, and
`torch.load(weights_only=True)` for the optimizer and RNG state), so opening someone
else's run directory cannot run their code.

Crash safety (docs/reliability.md): a process writing a run holds its lock
(`recursa.runio.RunLock`); every file is written atomically or appended with one synced
write; a checkpoint directory appears whole (temporary directory, fsync, rename) and its
ledger row follows; an evaluation's ledger row is written before its JSON file is renamed
into place, so the file's presence means the evaluation is committed. A resume first calls
`RunStore.reconcile`, which makes the ledger, the checkpoints and the evaluations agree
again whatever moment the last process died at, and `RunStore.resume_checkpoint` skips
(and sets aside as `step_K.corrupt-N`) a latest checkpoint that cannot be read.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from pathlib import Path

import torch

from recursa.errors import UserError
from recursa.tracking import Trackers
from recursa.runio import RunLock, append_line, atomic_write_bytes, atomic_write_json, atomic_write_text, fault_point, fsync_dir, inside, inside_tree, read_jsonl

_SCHEMA = """
CREATE TABLE IF NOT EXISTS evaluations (
  id INTEGER PRIMARY KEY, step INTEGER, label TEXT, env TEXT, split TEXT, n INTEGER,
  success_rate REAL, ci_lo REAL, ci_hi REAL, mean_reward REAL, path TEXT, created REAL
);
CREATE TABLE IF NOT EXISTS checkpoints (
  step INTEGER PRIMARY KEY, path TEXT, created REAL
);
"""


class RunStore:
    """A run directory opened for writing: holds its lock (RunLock) until `close`."""

    def __init__(self, path: Path, trackers: Trackers | None = None, keep_last: int | None = None):
        """`trackers`: live trackers that receive every metrics line after metrics.jsonl
        (recursa.tracking; none by default). `keep_last`: keep only the K newest checkpoints
        (`prune_checkpoints`)."""
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock.of(self.path).acquire()  # a second writer is refused here, before anything is written
        try:
            for name in ("eval", "checkpoints", "incumbents", "plots", "report.md", "config.toml"):
                inside(self.path, self.path / name)  # nothing the run writes may lead out of it (issue 49)
            (self.path / "eval").mkdir(exist_ok=True)
            self.metrics_path = inside(self.path, self.path / "metrics.jsonl")
            self.samples_path = inside(self.path, self.path / "samples.jsonl")
            self.db = _open_ledger(inside(self.path, self.path / "ledger.sqlite"))
        except BaseException:
            self.lock.release()
            raise
        self.trackers = trackers if trackers is not None else Trackers([])
        self.keep_last = keep_last

    # ---- logs -------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        append_line(self.metrics_path, json.dumps(row) + "\n", point="metrics")
        self.trackers.log(step, row)  # the same keys and values as the line just written

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if samples:
            append_line(self.samples_path, "".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
        self.trackers.log_samples(step, samples)

    def append_jsonl(self, name: str, step: int, records: list[dict]) -> None:
        """Append records, each tagged with `step`, to RUN_DIR/<name>.jsonl (a recipe's own
        log, e.g. expert iteration's kept solutions); truncated on resume like the metrics."""
        if records:
            append_line(inside(self.path, self.path / f"{name}.jsonl"), "".join(json.dumps({"step": step, **r}) + "\n" for r in records))

    def read_jsonl(self, name: str) -> list[dict]:
        return read_jsonl(inside(self.path, self.path / f"{name}.jsonl"))

    def truncate_after(self, step: int) -> None:
        """Drop every log line (of every RUN_DIR/*.jsonl) and ledger row with a step greater than
        `step`; a line torn by a kill is dropped too. Each log is rewritten atomically."""
        for path in sorted(self.path.glob("*.jsonl")):
            if inside(self.path, path).exists():
                kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
                fault_point("truncate.jsonl")
        self.db.execute("DELETE FROM evaluations WHERE step > ?", (step,))
        self.db.execute("DELETE FROM checkpoints WHERE step > ?", (step,))
        self.db.commit()

    def record_eval(self, step: int, label: str, result, path: Path) -> None:
        """The ledger row of an evaluation (see `save_eval`, which also writes its file)."""
        self.db.execute(
            "INSERT INTO evaluations (step, label, env, split, n, success_rate, ci_lo, ci_hi, mean_reward, path, created)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (step, label, result.env, result.split, result.n, result.success_rate, result.ci95[0], result.ci95[1], result.mean_reward, str(path.relative_to(self.path)), time.time()),
        )
        self.db.commit()

    def save_eval(self, step: int, label: str, result, path: Path, metrics: dict, before_commit=None) -> None:
        """Commit an evaluation: its JSON to a temporary file, its ledger row, then (after
        `before_commit()`, e.g. a gate's test look) the rename that puts eval/<label>.json in
        place, then its metrics line. The file's presence is the commit: `reconcile` drops a
        ledger row (and test look) whose file never arrived, and re-logs the metrics line of
        a committed evaluation a kill cut off. The metrics row is kept in the file for that."""
        data = {**result.to_json(), "step": step, "metrics_row": {k: _jsonable(v) for k, v in metrics.items()}}
        inside(self.path, path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        atomic_write_json(tmp, data)
        fault_point("eval.tmp")
        self.record_eval(step, label, result, path)
        if before_commit is not None:
            before_commit()
        fault_point("eval.recorded")
        tmp.replace(path)
        fsync_dir(path.parent)
        fault_point("eval.renamed")
        self.log_metrics(step, metrics)

    def relabel_eval(self, label: str, new_label: str) -> None:
        """Give the committed evaluation eval/<label>.json the label `new_label` (its file
        renamed, its ledger row changed), e.g. a finished run's `after` made the mid-run
        evaluation of its step when the run is trained further. The ledger changes first: a
        kill between the two leaves a row whose file is missing, which `reconcile` drops."""
        old, new = self.path / "eval" / f"{label}.json", self.path / "eval" / f"{new_label}.json"
        if not old.exists():
            raise UserError(f"{self.path} has no evaluation {label!r} to relabel")
        if new.exists():
            raise UserError(f"{self.path} already has an evaluation {new_label!r}")
        self.db.execute("UPDATE evaluations SET label = ?, path = ? WHERE path = ?", (new_label, str(new.relative_to(self.path)), str(old.relative_to(self.path))))
        self.db.commit()
        old.rename(new)
        fsync_dir(new.parent)

    # ---- checkpoints ------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return inside(self.path, self.path / "checkpoints" / f"step_{step:06d}")

    def save_checkpoint(self, step: int, policy, optimizer: torch.optim.Optimizer, state: dict) -> Path:
        """Write checkpoints/step_K whole (or not at all), then its ledger row. On a full
        disk the partial temporary directory is removed, the earlier checkpoints stay, and
        the error says so."""
        final = self.checkpoint_dir(step)
        try:
            write_weights(final, policy, optimizer, {"step": step, **state}, point="checkpoint")
        except Exception as exc:  # noqa: BLE001 -- a full disk surfaces as OSError, RuntimeError (torch) or SafetensorError
            from recursa.runio import user_error_of

            err = user_error_of(exc)
            if err is None:
                raise
            last = self.latest_checkpoint()
            raise UserError(f"{err}; checkpoint step {step} was not written (last good: {last.name if last else 'none'})") from exc
        fault_point("checkpoint.renamed")
        self.db.execute("INSERT OR REPLACE INTO checkpoints (step, path, created) VALUES (?,?,?)", (step, str(final.relative_to(self.path)), time.time()))
        self.db.commit()
        fault_point("checkpoint.recorded")
        if self.keep_last:
            self.prune_checkpoints(self.keep_last)
        return final

    def protected_dirs(self) -> set[Path]:
        """Directories the ledger marks as accepted (lineage candidates with a weights `dir`):
        never pruned. Gate incumbents live under RUN_DIR/incumbents, which pruning never touches."""
        has_lineage = self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'candidates'").fetchone()
        if not has_lineage:
            return set()
        out = set()
        for (payload,) in self.db.execute("SELECT payload_json FROM candidates WHERE accepted = 1"):
            d = json.loads(payload).get("dir") if payload else None
            if d:
                out.add((self.path / d).resolve())
        return out

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the `keep` newest finished checkpoints (run.keep_last), sparing every
        directory the ledger marks as accepted; returns the deleted ones. Unfinished
        (*.tmp) directories are left to `write_weights`, which replaces them."""
        done = finished_checkpoints(self.path)
        protected = self.protected_dirs()
        deleted = []
        for ckpt in done[: max(len(done) - keep, 0)]:
            if ckpt.resolve() in protected:
                continue
            shutil.rmtree(ckpt)
            self.db.execute("DELETE FROM checkpoints WHERE path = ?", (str(ckpt.relative_to(self.path)),))
            deleted.append(ckpt)
        self.db.commit()
        return deleted

    def latest_checkpoint(self) -> Path | None:
        done = finished_checkpoints(self.path)
        return done[-1] if done else None

    # ---- crash recovery -------------------------------------------------------------
    def reconcile(self, log=print) -> None:
        """Make the run directory agree with itself after a crash (called before a resume):
        finish or undo a half-replaced checkpoint, remove temporary files, give every
        finished checkpoint its ledger row (and drop rows of checkpoints that are gone),
        drop the ledger row and test look of an evaluation whose file never arrived, set
        aside an evaluation file that cannot be read, and re-log the metrics line of a
        committed evaluation that a kill cut off."""
        for path in sorted(self.path.glob("*.jsonl")):  # a line torn by a kill mid-append: cut it, so appends start on a fresh line
            data = inside(self.path, path).read_bytes()
            if data and not data.endswith(b"\n"):
                atomic_write_bytes(path, data[: data.rfind(b"\n") + 1])
                log(f"reconciled: dropped the torn last line of {path.name} (a kill mid-write)")
        root = self.path / "checkpoints"
        for parent in (root, self.path / "incumbents"):
            if not parent.is_dir():
                continue
            for p in sorted(parent.iterdir()):
                if ".old-" in p.name:
                    final = p.with_name(p.name.split(".old-")[0])
                    if not final.exists():
                        p.rename(final)  # killed between the two renames of a replacement: the old one is still good
                    else:
                        shutil.rmtree(p, ignore_errors=True)
                elif p.name.endswith(".tmp"):
                    shutil.rmtree(p, ignore_errors=True)
        for p in list(self.path.glob(".*.tmp-*")) + list((self.path / "eval").glob(".*.tmp-*")):
            if p.is_file():  # we hold the lock: no other process is writing them
                p.unlink(missing_ok=True)
        rows = {r[0]: r[1] for r in self.db.execute("SELECT step, path FROM checkpoints")}
        for ckpt in finished_checkpoints(self.path):
            step = int(ckpt.name.split("_")[1])
            if step not in rows:
                self.db.execute("INSERT INTO checkpoints (step, path, created) VALUES (?,?,?)", (step, str(ckpt.relative_to(self.path)), time.time()))
                log(f"reconciled: {ckpt.name} had no ledger row (a kill between its rename and the ledger); added it")
        for step, rel in rows.items():
            if not (self.path / rel / "state.json").exists():
                self.db.execute("DELETE FROM checkpoints WHERE step = ?", (step,))
        looks = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'test_looks'")}
        for eid, step, label, rel in list(self.db.execute("SELECT id, step, label, path FROM evaluations")):
            if not (self.path / rel).exists():
                self.db.execute("DELETE FROM evaluations WHERE id = ?", (eid,))
                if looks:
                    self.db.execute("DELETE FROM test_looks WHERE step = ? AND label = ?", (step, label))
        self.db.commit()
        recorded = {r[0] for r in self.db.execute("SELECT path FROM evaluations")}
        metrics = read_jsonl(self.metrics_path)
        for path in sorted((self.path / "eval").glob("*.json")):
            inside(self.path, path)
            rel = str(path.relative_to(self.path))
            try:
                data = json.loads(path.read_text())
                if not isinstance(data, dict) or "items" not in data:
                    raise ValueError("not an evaluation")
            except (ValueError, UnicodeDecodeError) as exc:
                aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
                path.rename(aside)
                self.db.execute("DELETE FROM evaluations WHERE path = ?", (rel,))
                self.db.commit()
                log(f"reconciled: {rel} could not be read ({type(exc).__name__}); moved it to {aside.name} and the evaluation will be run again")
                continue
            row = data.get("metrics_row")
            if rel in recorded and isinstance(row, dict) and row and isinstance(data.get("step"), int):
                if not any(m.get("step") == data["step"] and all(k in m for k in row) for m in metrics):
                    self.log_metrics(data["step"], row)
                    log(f"reconciled: re-logged the metrics of {rel} (a kill cut them off)")

    def resume_checkpoint(self, log=print) -> Path | None:
        """The newest checkpoint that reads back whole. A newer one that does not (a corrupt
        or truncated file) is moved aside to step_K.corrupt-<time> and its ledger row
        dropped, and the log says so; earlier good checkpoints are never touched."""
        for ckpt in reversed(finished_checkpoints(self.path)):
            problem = checkpoint_problem(ckpt)
            if problem is None:
                return ckpt
            aside = ckpt.with_name(f"{ckpt.name}.corrupt-{int(time.time())}")
            ckpt.rename(aside)
            self.db.execute("DELETE FROM checkpoints WHERE step = ?", (int(ckpt.name.split("_")[1]),))
            self.db.commit()
            log(f"checkpoint {ckpt.name} is corrupt ({problem}): moved it to {aside.name}; resuming from the previous good checkpoint")
        return None

    @staticmethod
    def load_state(ckpt: Path, optimizer: torch.optim.Optimizer | None) -> dict:
        try:
            state = json.loads((ckpt / "state.json").read_text())
        except ValueError:
            raise UserError(f"{ckpt / 'state.json'} is not valid JSON: the checkpoint is corrupt; remove it to resume from the previous one") from None
        if optimizer is not None:
            load_optimizer(optimizer, ckpt / "optimizer.pt")
        rng = _load_tensors(ckpt / "rng.pt")
        torch.set_rng_state(rng["torch_rng"])
        if "cuda_rng" in rng and torch.cuda.is_available() and len(rng["cuda_rng"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda_rng"])
        return state

    def close(self) -> None:
        try:
            self.trackers.close()
            self.db.close()
        finally:
            self.lock.release()


def _open_ledger(path: Path) -> sqlite3.Connection:
    """The ledger database, its tables created if absent; a file that is not a SQLite
    database is a UserError naming the fix."""
    try:
        db = sqlite3.connect(path)
        db.executescript(_SCHEMA)
        db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()
        return db
    except sqlite3.DatabaseError as exc:
        raise UserError(f"{path} is not a readable ledger ({exc}): the run directory is corrupt; restore the file or start a new run with another --out") from None


def _fsync_tree(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def write_weights(final: Path, policy, optimizer: torch.optim.Optimizer, state: dict | None = None, point: str | None = None) -> Path:
    """The policy as a Hugging Face model directory (`models.save_weights`), its optimizer
    state (and, with `state`, the RNG state and state.json) written to `final` through a
    temporary directory that is synced and renamed: the directory is either complete or
    absent. Replacing an existing `final` renames it to `final.old-PID` first and removes
    it last; `RunStore.reconcile` restores it if a kill falls between the two renames.
    A failure (a full disk) removes the temporary directory and leaves `final` as it was."""
    from recursa.models import save_weights

    tmp = final.with_name(final.name + ".tmp")
    for path in (tmp, final):  # a planted step_K.tmp (or step_K) linked elsewhere is refused, never written through
        inside(final.parent, path, "the checkpoints directory")
    if tmp.is_symlink():
        tmp.unlink()
    elif tmp.exists():
        shutil.rmtree(tmp)
    try:
        save_weights(policy, tmp)
        torch.save(_to_cpu(optimizer.state_dict()), tmp / "optimizer.pt")
        if state is not None:
            rng = {"torch_rng": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                rng["cuda_rng"] = torch.cuda.get_rng_state_all()
            torch.save(rng, tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
        _fsync_tree(tmp)
        if point:
            fault_point(f"{point}.tmp")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from (a missing or truncated file,
    unreadable JSON), or None when every file reads back: state.json parses, the
    safetensors headers cover their files, and the torch files' zip records check out."""
    import zipfile

    try:
        state = json.loads((ckpt / "state.json").read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return "state.json holds no step"
    except (OSError, ValueError) as exc:
        return f"state.json: {type(exc).__name__}"
    weights = sorted(ckpt.glob("*.safetensors"))
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{index.name}: unreadable ({type(exc).__name__})"
        for shard in sorted(set(map(str, shards))):
            inside(ckpt, ckpt / shard, "the checkpoint")  # a shard named ../../x is refused, not skipped
    if not weights:
        return "no weights file"
    for w in weights:
        problem = _safetensors_problem(w)
        if problem:
            return f"{w.name}: {problem}"
    for name in ("optimizer.pt", "rng.pt"):
        f = ckpt / name
        if not f.exists():
            return f"{name} is missing"
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip()
            if bad is not None:
                return f"{name}: bad record {bad}"
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            return f"{name}: {type(exc).__name__}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file's header parses and its tensors end exactly at the end of the file."""
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "truncated"
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                return "truncated header"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        return f"unreadable header ({type(exc).__name__})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    if 8 + n + max(ends, default=0) != size:
        return "truncated"
    return None


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Optimizer state saved by `write_weights`, read onto the CPU; `load_state_dict` moves
    each state tensor to its parameter's device."""
    optimizer.load_state_dict(_load_tensors(path))


def _load_tensors(path: Path):
    """A torch file of tensors and plain containers (optimizer.pt, rng.pt), read onto the CPU
    with `weights_only=True`: a file that would need arbitrary code to unpickle is refused."""
    import pickle
    import re

    if not path.exists():
        raise UserError(f"{path} is missing: the checkpoint is incomplete; resume from an earlier one or start again")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it needs {found.group(1)}" if found else "it is not a tensors-only file"
        raise UserError(f"{path} holds more than tensors and plain values ({what}); refusing to unpickle it, since that could run code: use a checkpoint written by recursa") from None


def _to_cpu(obj):
    """A state dict with every tensor on the CPU (CPU tensors as they are, not copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def finished_checkpoints(run_dir: Path) -> list[Path]:
    """A run's complete checkpoints (state.json written), oldest first."""
    run_dir = Path(run_dir)
    root = inside(run_dir, run_dir / "checkpoints")
    if not root.exists():
        return []
    done = sorted(p for p in root.glob("step_*") if p.name.count(".") == 0 and (p / "state.json").exists())
    for p in done:  # a checkpoint, or a file or folder at any depth of one, linked out of the run is refused, not read
        inside_tree(run_dir, p)
    return done


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def run_checkpoint(run_dir: str, checkpoint: str, model_name: str, key: str, checkpoint_key: str) -> Path:
    """The finished checkpoint `checkpoint` ('last' or a step number) of the run in `run_dir`,
    which must have trained `model_name`; else a one-line UserError naming the config key."""
    from recursa.config import load_config

    run = Path(run_dir)
    if not (run / "config.toml").exists():
        raise UserError(f"{key} = {str(run)!r}: no run there (no config.toml); train it first, e.g. recursa train examples/twx_twc_sft.toml")
    source = load_config(run / "config.toml", check=False)
    if source.model.name != model_name:
        raise UserError(f"{key} = {str(run)!r} trained model {source.model.name!r}, but this config uses {model_name!r}: set model.name to match")
    done = finished_checkpoints(run)
    if not done:
        raise UserError(f"{key} = {str(run)!r} has no finished checkpoint yet: let that run finish (or resume it) first")
    if checkpoint == "last":
        return done[-1]
    want = run / "checkpoints" / f"step_{int(checkpoint):06d}"
    if want not in done:
        raise UserError(f"{checkpoint_key} = {checkpoint}: {run} has {[p.name for p in done]}")
    return want
