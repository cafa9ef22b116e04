"""Live tracking: the run's metrics sent to TensorBoard, Weights & Biases, Trackio or MLflow.

`RunStore.log_metrics` writes every metrics line to RUN_DIR/metrics.jsonl first (the
source of truth: reports, resume and tests read it), then hands the same line to a
`Trackers` object, which sends its numeric values (ints, floats and bools, NaN included)
to every tracker in `log.report_to` under the same keys and step. With no tracker it is
an empty list and the loop never branches on it.

    tensorboard  RUN_DIR/tb, event files (torch.utils.tensorboard; pip install tensorboard)
    wandb        a W&B run in RUN_DIR/wandb, offline unless WANDB_MODE says otherwise
                 (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later)
    trackio      a Trackio run in its local store ($TRACKIO_DIR, default ~/.cache/huggingface/trackio);
                 `trackio show` opens the dashboard
    mlflow       an MLflow run in a local store, the SQLite file RUN_DIR/mlflow.db with artifacts in
                 RUN_DIR/mlartifacts (MLflow 3 keeps its plain-file store in maintenance mode), or
                 $MLFLOW_TRACKING_URI when set (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`)

Each (re)start of `recursa train` is one tracker run, named `log.run_name` (default: the
run directory's name); a resumed run's tracker run starts at the checkpoint's step.
With `log.log_completions`, each step's sample completions (what samples.jsonl holds) go
to the trackers too: a table (W&B, Trackio), a text summary (TensorBoard), a JSON artifact (MLflow).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from recursa.errors import UserError

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
_SAMPLE_COLUMNS = ("seed", "prompt", "completion", "reward", "advantage")


def numeric(metrics: dict) -> dict[str, float]:
    """The values every tracker receives: ints, floats and bools as floats (NaN kept), under
    their metrics.jsonl keys; strings and other values stay in metrics.jsonl only."""
    out = {}
    for k, v in metrics.items():
        if k == "step":
            continue
        if hasattr(v, "item") and callable(v.item):
            v = v.item()
        if isinstance(v, (bool, int, float)):
            out[k] = float(v)
    return out


def _need(module: str, tracker: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"log.report_to includes {tracker!r}, which needs the {module.split('.')[0]} package: pip install 'recursa[track]'") from None


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict):
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, samples: list[dict]) -> None:
        lines = [" | ".join(_SAMPLE_COLUMNS), " | ".join("---" for _ in _SAMPLE_COLUMNS)]
        lines += [" | ".join(_cell(s.get(c)) for c in _SAMPLE_COLUMNS) for s in samples]
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict):
        wandb = _need("wandb", "wandb")
        self.wandb = wandb
        (run_dir / "wandb").parent.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config, mode=os.environ.get("WANDB_MODE", "offline"),
                              reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        table = self.wandb.Table(columns=list(_SAMPLE_COLUMNS), data=[[_plain(s.get(c)) for c in _SAMPLE_COLUMNS] for s in samples])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    name = "trackio"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict):
        self.trackio = _need("trackio", "trackio")
        self.run = self.trackio.init(project=project, name=run_name, config=config, embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        import pandas as pd

        frame = pd.DataFrame([[_plain(s.get(c)) for c in _SAMPLE_COLUMNS] for s in samples], columns=list(_SAMPLE_COLUMNS))
        self.run.log({"samples": self.trackio.Table(dataframe=frame)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict):
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(project, artifact_location=(run_dir / "mlartifacts").resolve().as_uri()))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        from mlflow.entities import Param

        flat = _flatten(config)
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for lo in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[lo : lo + 1000])

    def log_samples(self, step: int, samples: list[dict]) -> None:
        self.client.log_text(self.run_id, "".join(json.dumps({"step": step, **s}) + "\n" for s in samples), f"samples/step_{step:06d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker, "mlflow": MLflowTracker}


class Trackers:
    """The trackers of one run; `log` sends one metrics line to all of them."""

    def __init__(self, trackers: list, log_completions: bool = False):
        self.trackers, self.log_completions = trackers, log_completions

    @classmethod
    def open(cls, run_dir: Path, names: list[str], project: str = "recursa", run_name: str | None = None, config: dict | None = None,
             log_completions: bool = False) -> "Trackers":
        opened = []
        try:
            for name in dict.fromkeys(names):
                if name not in _CLASSES:
                    raise UserError(f"log.report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
                try:
                    opened.append(_CLASSES[name](Path(run_dir), project, run_name or Path(run_dir).resolve().name, config or {}))
                except UserError:
                    raise
                except Exception as exc:
                    raise UserError(f"log.report_to: {name} did not start ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        except BaseException:
            for t in opened:
                t.close()
            raise
        return cls(opened, log_completions)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, step: int, metrics: dict) -> None:
        values = numeric(metrics)
        if values:
            for t in self.trackers:
                t.log(step, values)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        if self.log_completions and samples:
            for t in self.trackers:
                t.log_samples(step, samples)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def open_trackers(cfg, run_dir: Path) -> Trackers:
    """The trackers a config asks for (`log.report_to`, plus 'tensorboard' for the older `run.tensorboard = true`)."""
    names = list(cfg.log.report_to) + (["tensorboard"] if cfg.run.tensorboard else [])
    if not names:
        return Trackers([])
    return Trackers.open(run_dir, names, cfg.log.project, cfg.log.run_name, cfg.model_dump(mode="json"), cfg.log.log_completions)


def _plain(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return " ".join(str(v).split()).replace("|", "\\|")[:300]


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
