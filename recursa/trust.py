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

What is never code here: a built-in name (an entry of a `recursa.plugins` registry such as
``arithmetic`` or ``rg:basic_arithmetic``), a name an installed package registers as an
entry point, or one registered in this process: those are code the user installed or
wrote, not code the run directory brings. `recursa report`, `lineage`, `export` and
`eval --skills RUN` read a run's config for its settings only and import nothing it names.
"""

from __future__ import annotations

from typing import Any, Iterable

from recursa.errors import UserError

TRUST_FLAG = "--trust-run-code"
PARTS = ("env", "reward", "scorer")


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
    run directory `source` names, unless `trusted` (--trust-run-code) or the user typed the
    same spec again (`given`, from `command_line_strings`)."""
    if trusted:
        return
    for key, spec in named_code(cfg, parts):
        if spec not in given:
            raise UserError(
                f"{source}/config.toml names code to import, {key} = {spec!r}, and a run directory is data: "
                f"refusing to import it; if you trust whoever wrote this run, pass {TRUST_FLAG} (or give {key} again with --set)"
            )
