"""A dataset of prompts (and answers) as a single-turn environment: RL on your own data.

    env = DatasetEnv("data/train.jsonl", prompt_key="question", answer_key="answer", scorer="last_number")
    prompt = env.reset(split_seed("train", 3))    # the 4th training row's prompt
    result = env.step(model_reply)                  # reward 1.0 when the reply's last number is the answer

Rows come from a JSONL file (`source = "jsonl"`), a Parquet file (`"parquet"`, needs
pyarrow) or a local Hugging Face datasets directory written by `save_to_disk`, or local
json / jsonl / parquet / csv files read by `datasets` (`"hf"`; nothing is ever downloaded).

Splits. Every row belongs to exactly one of train / gate / test, decided once from the row
itself, never from its position:

* with `split_key`, the row's own column says it ("train", "gate" or "test"; "validation"
  and "dev" count as gate); a Hugging Face DatasetDict's split names are read the same way;
* otherwise a hash of the prompt text: u = sha256(prompt) / 2^256 in [0, 1); u < test_frac
  is test, u < test_frac + gate_frac is gate, the rest train. Identical prompts always land
  in the same split, so a duplicated row cannot leak a held-out item into training, and
  adding or reordering rows never moves an existing row to another split.

Within a split, rows keep their file order: item i of a split is its i-th row, and seed
`split_seed(split, i)` names it, exactly as for generated tasks (train seeds in [0, 1e9),
gate in [1e9, 2e9), test in [2e9, 3e9)). A dataset is finite, so an index past the split's
end wraps around (item i is row i mod n): GRPO's training draws cover the train rows
uniformly, evaluations take at most the split's rows (`num_items`), and gate rounds reuse
gate rows once they run out. A held-out row can never be reached from a train seed.

Scorers: "exact" (the reply, or the content of its last <answer> tag, equals the answer after
collapsing whitespace; numbers compare by value), "last_number" (the reply's last number
equals the answer's), or "pkg.module:function", a reward function called as
`fn([prompt], [reply], **{column: [value]}) -> [score]` whose score is the reward and counts
as a success when it is at least `success_at`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from recursa.envs.base import (
    SPLITS,
    StepResult,
    extract_answer,
    import_object,
    is_factory_spec,
    last_number,
    normalise_number,
    split_of,
    split_seed,
)
from recursa.errors import UserError

SOURCES = ("jsonl", "parquet", "hf")
SCORERS = ("exact", "last_number")
_SPLIT_NAMES = {"train": "train", "gate": "gate", "validation": "gate", "valid": "gate", "dev": "gate", "test": "test"}


def hash_unit(text: str) -> float:
    """sha256(text) as a number in [0, 1): the split draw of a row without a split column."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def split_by_hash(prompt: str, gate_frac: float, test_frac: float) -> str:
    u = hash_unit(prompt)
    return "test" if u < test_frac else "gate" if u < test_frac + gate_frac else "train"


# ------------------------------------------------------------------------------- loading


def _read_jsonl(p: Path) -> list[tuple[dict, str | None]]:
    rows = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:  # decoded line by line, so a byte that is not UTF-8 is named with its line
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{p}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x}): save the data file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{p}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise UserError(f"{p}:{lineno}: expected a JSON object per line, got {type(record).__name__}")
            rows.append((record, None))
    return rows


def _read_parquet(p: Path) -> list[tuple[dict, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("data.source = 'parquet' needs pyarrow: pip install 'recursa[data]'") from None
    import pyarrow as pa

    try:  # a truncated or foreign file is the user's to fix, not pyarrow's traceback (issue 49)
        return [(r, None) for r in pq.read_table(p).to_pylist()]
    except (pa.ArrowException, UnicodeDecodeError, OSError) as exc:
        raise _unreadable(p, "Parquet file", exc) from None


def _unreadable(p: Path, kind: str, exc: BaseException) -> Exception:
    """The one line for a data file its reader could not parse (cut short by a copy, another
    format under the name, text that is not UTF-8): the innermost cause, since `datasets`
    wraps the reader's own error in a generic one. An OSError with an errno (permission denied)
    is returned as it is: recursa's CLI already says those in one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc  # the operating system's own failure (permission, a vanished file): said by the CLI as such
    if isinstance(exc, UnicodeDecodeError):
        return UserError(f"data.path = {str(p)!r}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}): save the {kind} as UTF-8")
    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    return UserError(f"data.path = {str(p)!r}: not a readable {kind} ({reason}): it may be truncated or corrupt; write it again")


@contextlib.contextmanager
def _quiet_datasets(datasets):
    """`datasets` logs a failed read before raising it and draws progress bars on stderr: while
    recursa reads a local file, its own line (or nothing) is what the user sees."""
    logging, bars = datasets.utils.logging, datasets.is_progress_bar_enabled()
    level = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _read_hf(p: Path) -> list[tuple[dict, str | None]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
    try:
        import datasets
    except ImportError:
        raise UserError("data.source = 'hf' needs the datasets package: pip install 'recursa[data]'") from None
    import pyarrow as pa
    from datasets.exceptions import DatasetGenerationError

    kind = "datasets directory" if p.is_dir() else {".jsonl": "JSON file", ".json": "JSON file", ".parquet": "Parquet file", ".csv": "CSV file"}.get(p.suffix)
    if kind is None:
        raise UserError(f"data.path = {str(p)!r}: data.source = 'hf' reads a save_to_disk directory or a .jsonl/.json/.parquet/.csv file")
    with _quiet_datasets(datasets):
        try:  # rows are decoded while iterating too: a bad byte may surface only there
            return _hf_rows(datasets, p)
        except (DatasetGenerationError, pa.ArrowException, UnicodeDecodeError, OSError) as exc:
            raise _unreadable(p, kind, exc) from None


def _hf_rows(datasets, p: Path) -> list[tuple[dict, str | None]]:
    import pyarrow as pa

    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as exc:
            if isinstance(exc, (UnicodeDecodeError, pa.ArrowException)):
                raise  # a directory of the right shape whose table file is cut short: said as such
            raise UserError(f"data.path = {str(p)!r}: not a datasets directory written by save_to_disk ({exc})") from None
    else:
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}[p.suffix]
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    if isinstance(ds, datasets.DatasetDict):
        out = []
        for name, part in ds.items():
            if name not in _SPLIT_NAMES:
                raise UserError(f"data.path = {str(p)!r}: split {name!r} is none of {sorted(_SPLIT_NAMES)}")
            out += [(dict(r), _SPLIT_NAMES[name]) for r in part]
        return out
    return [(dict(r), None) for r in ds]


@functools.lru_cache(maxsize=8)
def _load(path: str, source: str, mtime: float, prompt_key: str, answer_key: str | None, split_key: str | None,
          gate_frac: float, test_frac: float) -> dict[str, list[dict]]:
    """split -> rows (file order); cached per process while the file is unchanged."""
    p = Path(path)
    reader = {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}[source]
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for i, (row, given) in enumerate(reader(p)):
        where = f"{p}: row {i}"
        prompt = row.get(prompt_key)
        if not isinstance(prompt, str):
            what = "has no" if prompt_key not in row else f"has a {type(prompt).__name__} in"
            raise UserError(f"{where} {what} column {prompt_key!r} (data.prompt_key; columns: {sorted(row)}); the prompt must be a string")
        if answer_key is not None and row.get(answer_key) is None:
            raise UserError(f"{where} has no column {answer_key!r} (data.answer_key; columns: {sorted(row)})")
        if split_key is not None:
            given = row.get(split_key)
            if given not in _SPLIT_NAMES:
                raise UserError(f"{where}: column {split_key!r} (data.split_key) is {given!r}, not one of {sorted(_SPLIT_NAMES)}")
            given = _SPLIT_NAMES[given]
        splits[given or split_by_hash(prompt, gate_frac, test_frac)].append(row)
    if not splits["train"]:
        raise UserError(f"data.path = {path!r} gives no training rows ({sum(map(len, splits.values()))} rows in all): lower data.gate_frac / data.test_frac or check data.split_key")
    return splits


# ------------------------------------------------------------------------------- the env


class DatasetEnv:
    """Single-turn env over a dataset's rows (see the module docstring)."""

    def __init__(self, path: str, source: str = "jsonl", prompt_key: str = "prompt", answer_key: str | None = "answer",
                 scorer: str = "last_number", split_key: str | None = None, gate_frac: float = 0.1, test_frac: float = 0.1,
                 success_at: float = 1.0, system_prompt: str | None = None):
        if source not in SOURCES:
            raise UserError(f"data.source = {source!r}: choose one of {', '.join(SOURCES)}")
        p = Path(path)
        if not p.exists():
            raise UserError(f"data.path = {str(p)!r} not found: point it at your {source} data")
        if scorer not in SCORERS and not is_factory_spec(scorer):
            raise UserError(f"data.scorer = {scorer!r}: choose 'exact', 'last_number' or a reward function 'pkg.module:function'")
        self.scorer = scorer
        self.score_fn = import_object(scorer, "data.scorer") if scorer not in SCORERS else None
        if self.score_fn is not None:
            self.parse = None  # your scorer reads the reply in its own way: no answer extraction recursa knows of
        needs_answer = scorer in SCORERS
        self.splits = _load(str(p.resolve()), source, p.stat().st_mtime, prompt_key, answer_key if needs_answer else None,
                            split_key, gate_frac, test_frac)
        self.name = f"data:{p.name}"
        self.path, self.prompt_key, self.answer_key, self.success_at = str(p), prompt_key, answer_key, success_at
        self.system_prompt = system_prompt
        self._row: dict | None = None
        self._done = True

    def num_items(self, split: str) -> int:
        """Rows in `split` (evaluations take at most this many items)."""
        return len(self.splits[split])

    def row(self, seed: int) -> dict:
        """The row seed names: row (i mod n) of its split."""
        split = split_of(seed)
        rows = self.splits[split]
        if not rows:
            raise UserError(f"{self.path} has no {split} rows: raise data.{split}_frac, or give rows with {split!r} in data.split_key")
        return rows[(seed - split_seed(split, 0)) % len(rows)]

    def reset(self, seed: int) -> str:
        self._row, self._done = self.row(seed), False
        return self._row[self.prompt_key]

    def answer(self) -> str:
        value = (self._row or {}).get(self.answer_key) if self.answer_key else None
        return "" if value is None else str(value)

    def reference(self) -> str | None:
        """The row's answer as a reply (SFT's reference demonstrations)."""
        if self._row is None:
            raise RuntimeError("call reset(seed) before reference()")
        return self.answer() or None

    def fields(self) -> dict[str, Any]:
        """The row's columns other than the prompt: what reward functions receive as keywords."""
        return {k: v for k, v in (self._row or {}).items() if k != self.prompt_key}

    def parse(self, action_text: str) -> str | None:
        """The answer the scorer reads in a reply, None for none: its last number ('last_number'),
        or the content of its last <answer> tag, else the whole reply, whitespace collapsed
        ('exact'). A reward-function scorer has no answer extraction (`parse` is None)."""
        if self.scorer == "last_number":
            return last_number(action_text)
        tagged = extract_answer(action_text)
        text = " ".join((tagged if tagged is not None else action_text or "").split())
        return text or None

    def step(self, action_text: str) -> StepResult:
        if self._row is None or self._done:
            raise RuntimeError("call reset(seed) before step(); dataset episodes end after one step")
        self._done = True
        answer, note, fields = self.answer(), "", self.fields()
        if self.score_fn is not None:
            from recursa.answers import call_reward

            score = call_reward(self.score_fn, self.scorer, [self._row[self.prompt_key]], [action_text], {k: [v] for k, v in fields.items()})[0]
            reward = 0.0 if score is None else float(score)
            parsed, success = None, reward >= self.success_at
        elif self.scorer == "last_number":
            parsed = last_number(action_text)
            want = normalise_number(answer)
            success = parsed is not None and parsed == (want if want is not None else answer.strip())
            note = "" if parsed is not None else "no number in the reply"
            reward = float(success)
        else:  # exact
            tagged = extract_answer(action_text)
            parsed = " ".join((tagged if tagged is not None else action_text).split())
            want = " ".join(answer.split())
            a, b = normalise_number(parsed), normalise_number(want)
            success = parsed == want or (a is not None and a == b)
            note = "" if parsed else "empty reply"
            reward = float(success)
        return StepResult(obs="", reward=reward, done=True,
                          info={"success": bool(success), "answer": answer, "parsed": parsed, "note": note, "fields": fields})


def dataset_env_kwargs(dc) -> dict[str, Any]:
    """`DatasetEnv` keyword arguments from a config's [data] section."""
    return dict(path=dc.path, source=dc.source, prompt_key=dc.prompt_key or "prompt", answer_key=dc.answer_key, scorer=dc.scorer,
                split_key=dc.split_key, gate_frac=dc.gate_frac, test_frac=dc.test_frac, success_at=dc.success_at)


def uses_dataset(cfg) -> bool:
    """Whether the config's tasks come from [data] rows (not from env.name). SFT's
    data.source = 'jsonl' without data.prompt_key reads chat transcripts instead."""
    dc = getattr(cfg, "data", None)
    if dc is None or dc.source not in SOURCES:
        return False
    return not (cfg.recipe == "sft" and dc.source == "jsonl" and dc.prompt_key is None)


def task_factory(cfg):
    """A picklable zero-argument factory of the config's task env (for an `EnvPool` here, or a
    Ray worker elsewhere): the [data] rows as a `DatasetEnv`, else `env.name` with `env.kwargs`
    (a 'pkg.module:attr' or entry-point spec is re-imported by name in the other process); with
    curriculum arms, an `ArmsEnv` whose training seeds play the arms' settings and whose
    held-out seeds play `env.kwargs` (recursa/envs/arms.py)."""
    from recursa.envs.base import env_factory

    if uses_dataset(cfg):
        return functools.partial(DatasetEnv, **dataset_env_kwargs(cfg.data))
    curriculum = getattr(cfg, "curriculum", None)
    if curriculum is not None and curriculum.mode != "off":
        from recursa.envs.arms import arms_factory

        return arms_factory(cfg.env.name, cfg.env.kwargs, [a.kwargs for a in curriculum.arms])
    return env_factory(cfg.env.name, **cfg.env.kwargs)


def task_name(cfg) -> str:
    """The task's name in logs and evaluations: env.name, or data:<file> for a dataset."""
    return f"data:{Path(cfg.data.path).name}" if uses_dataset(cfg) else cfg.env.name
