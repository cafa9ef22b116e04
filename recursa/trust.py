"""The trust boundary of a run directory (issue 49; docs/reliability.md, "A run directory is data").

A config the user writes or passes on the command line may name code: an env factory
(`env.name = "pkg.module:make_env"`), a reward function (`[[reward]] func = "pkg.module:fn"`),
a dataset scorer (`data.scorer = "pkg.module:score"`); recursa imports and calls it, as the
user asked. A run directory is different: its `config.toml` was written by whoever trained
the run, and a run is something people copy and share. So when a command reads a run's
stored config (`recursa eval --run RUN`, `eval --interpolate`, `train --resume RUN`), the
code that config names by import path is imported only when the user says so:

* ``--trust-run-code`` on the command line (as Hugging Face's ``trust_remote_code``), or
* the same spec given again on the command line (``--set env.name='pkg.module:make_env'``,
  or ``recursa eval --env ...``, which replaces the run's task altogether).

The same consent covers the files such a config names to read (`data.path`, the rows a task
is built from or SFT's demonstrations) when they lie outside the run directory: a run
someone shares must not make the reader's machine read one of its own files (a key, a
private dataset) into prompts, samples.jsonl and evaluations, which the reader may share
on. A data file inside the run directory (a run that carries its rows) is its own data and
is read as such.

What is never code here: a built-in name (an entry of a `recursa.plugins` registry such as
``arithmetic`` or ``rg:basic_arithmetic``), a name an installed package registers as an
entry point, or one registered in this process: those are code the user installed or
wrote, not code the run directory brings. `recursa report`, `lineage`, `export` and
`eval --skills RUN` read a run's config for its settings only and import nothing it names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from recursa.errors import UserError

TRUST_FLAG = "--trust-run-code"
PARTS = ("env", "reward", "scorer", "data", "demos")
FILE_SOURCES = ("jsonl", "parquet", "hf")


def named_code(cfg, parts: Iterable[str] = PARTS) -> list[tuple[str, str]]:
    """(config key, spec) of every piece of code `cfg` names by import path ('pkg.module:attr')
    among `parts`: 'env' (env.name, unless the tasks are [data] rows), 'reward' ([[reward]]
    func) and 'scorer' (data.scorer of [data] rows). Imports nothing."""
    from recursa.envs.base import is_factory_spec
    from recursa.envs.dataset import uses_dataset
    from recursa.registry import is_import_path

    parts = set(parts)
    data = uses_dataset(cfg)
    out: list[tuple[str, str]] = []
    if "env" in parts and not data and is_factory_spec(cfg.env.name):
        out.append(("env.name", cfg.env.name.strip()))
    if "reward" in parts:
        for entry in getattr(cfg, "reward", None) or []:
            func = getattr(entry, "func", None)
            if entry.kind == "func" and func and func != "env" and is_import_path(func):
                out.append(("reward.func", func.strip()))
    if "scorer" in parts and data and is_factory_spec(cfg.data.scorer):
        out.append(("data.scorer", cfg.data.scorer.strip()))
    return out


def named_files(cfg, run_dir: Path, parts: Iterable[str] = PARTS) -> list[tuple[str, str]]:
    """(config key, path) of every file outside `run_dir` that `cfg` names to read among
    `parts`: 'data' (data.path, when the tasks are [data] rows) and 'demos' (data.path of an
    SFT run's demonstrations, rows or chat transcripts). A relative path is resolved as the
    readers resolve it, from the working directory. Reads nothing."""
    from recursa.envs.dataset import uses_dataset

    parts, dc = set(parts), getattr(cfg, "data", None)
    if dc is None or dc.source not in FILE_SOURCES or not dc.path:
        return []
    read = ("data" in parts and uses_dataset(cfg)) or ("demos" in parts and cfg.recipe == "sft")
    if not read:
        return []
    base, real = Path(run_dir).resolve(), Path(dc.path).resolve()
    return [] if real == base or base in real.parents else [("data.path", dc.path)]


def command_line_strings(sets: Iterable[str] = (), extra: Iterable[str | None] = ()) -> set[str]:
    """Every string value the user typed: the values of --set overrides (inside lists and
    tables too) and `extra` (e.g. `recursa eval --env`), stripped."""
    from recursa.config import parse_override

    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.add(value.strip())
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    for item in sets:
        walk(parse_override(item)[1])
    for value in extra:
        walk(value)
    return found


def refuse_run_code(cfg, source: str, trusted: bool, given: set[str] = frozenset(), parts: Iterable[str] = PARTS) -> None:
    """Refuse (a one-line UserError) the first piece of code the stored config `cfg` of the
    run directory `source` names, then the first file outside it that it names to read
    (`named_files`), unless `trusted` (--trust-run-code) or the user typed the same spec or
    path again (`given`, from `command_line_strings`)."""
    if trusted:
        return
    for key, spec in named_code(cfg, parts):
        if spec not in given:
            raise UserError(
                f"{source}/config.toml names code to import, {key} = {spec!r}, and a run directory is data: "
                f"refusing to import it; if you trust whoever wrote this run, pass {TRUST_FLAG} (or give {key} again with --set)"
            )
    for key, path in named_files(cfg, Path(source), parts):
        if path.strip() not in given:
            raise UserError(
                f"{source}/config.toml names a file outside the run directory to read, {key} = {path!r}, and a run directory is data: "
                f"refusing to read it; if you trust whoever wrote this run, pass {TRUST_FLAG} (or give {key} again with --set)"
            )
