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
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from pathlib import Path

import torch

from recursa.errors import UserError
from recursa.tracking import Trackers

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
    def __init__(self, path: Path, trackers: Trackers | None = None, keep_last: int | None = None):
        """`trackers`: live trackers that receive every metrics line after metrics.jsonl
        (recursa.tracking; none by default). `keep_last`: keep only the K newest checkpoints
        (`prune_checkpoints`)."""
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "eval").mkdir(exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        self.samples_path = self.path / "samples.jsonl"
        self.db = sqlite3.connect(self.path / "ledger.sqlite")
        self.db.executescript(_SCHEMA)
        self.trackers = trackers if trackers is not None else Trackers([])
        self.keep_last = keep_last

    # ---- logs -------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.trackers.log(step, row)  # the same keys and values as the line just written

    def log_samples(self, step: int, samples: list[dict]) -> None:
        with self.samples_path.open("a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")
        self.trackers.log_samples(step, samples)

    def append_jsonl(self, name: str, step: int, records: list[dict]) -> None:
        """Append records, each tagged with `step`, to RUN_DIR/<name>.jsonl (a recipe's own
        log, e.g. expert iteration's kept solutions); truncated on resume like the metrics."""
        with (self.path / f"{name}.jsonl").open("a") as f:
            for r in records:
                f.write(json.dumps({"step": step, **r}) + "\n")

    def read_jsonl(self, name: str) -> list[dict]:
        path = self.path / f"{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop every log line (of every RUN_DIR/*.jsonl) and ledger row with a step greater than `step`."""
        for path in sorted(self.path.glob("*.jsonl")):
            if path.exists():
                kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in kept))
        self.db.execute("DELETE FROM evaluations WHERE step > ?", (step,))
        self.db.execute("DELETE FROM checkpoints WHERE step > ?", (step,))
        self.db.commit()

    def record_eval(self, step: int, label: str, result, path: Path) -> None:
        self.db.execute(
            "INSERT INTO evaluations (step, label, env, split, n, success_rate, ci_lo, ci_hi, mean_reward, path, created)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (step, label, result.env, result.split, result.n, result.success_rate, result.ci95[0], result.ci95[1], result.mean_reward, str(path.relative_to(self.path)), time.time()),
        )
        self.db.commit()

    # ---- checkpoints ------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step_{step:06d}"

    def save_checkpoint(self, step: int, policy, optimizer: torch.optim.Optimizer, state: dict) -> Path:
        final = self.checkpoint_dir(step)
        write_weights(final, policy, optimizer, {"step": step, **state})
        self.db.execute("INSERT OR REPLACE INTO checkpoints (step, path, created) VALUES (?,?,?)", (step, str(final.relative_to(self.path)), time.time()))
        self.db.commit()
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

    @staticmethod
    def load_state(ckpt: Path, optimizer: torch.optim.Optimizer | None) -> dict:
        state = json.loads((ckpt / "state.json").read_text())
        if optimizer is not None:
            load_optimizer(optimizer, ckpt / "optimizer.pt")
        rng = _load_tensors(ckpt / "rng.pt")
        torch.set_rng_state(rng["torch_rng"])
        if "cuda_rng" in rng and torch.cuda.is_available() and len(rng["cuda_rng"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda_rng"])
        return state

    def close(self) -> None:
        self.trackers.close()
        self.db.close()


def write_weights(final: Path, policy, optimizer: torch.optim.Optimizer, state: dict | None = None) -> Path:
    """The policy as a Hugging Face model directory (`models.save_weights`), its optimizer
    state (and, with `state`, the RNG state and state.json) written to `final` through a
    temporary directory: the directory is either complete or absent."""
    from recursa.models import save_weights

    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_weights(policy, tmp)
    torch.save(_to_cpu(optimizer.state_dict()), tmp / "optimizer.pt")
    if state is not None:
        rng = {"torch_rng": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda_rng"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


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
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / "state.json").exists())


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    return v
