"""Registries: names -> objects, known by their import path until one is used.

One mechanism serves every table of recursa's extension points (objectives, advantage
estimators, reward kinds, environments, training methods): a `Registry` holds, for each
name, the 'package.module:attribute' path of the object and a one-line description. A
config is validated against the names alone; a module is imported only when its object
is asked for (`Registry.get`). So this module, and every table built on it, sits at the
bottom of the import graph: it imports nothing of recursa but its error type, and a table
never imports the modules it names.

Names come from three places, the first found wins:

* the table's built-in entries (`builtins`: name -> (path, description));
* `register(name, obj_or_path)` in this process: a decorator or a call, for a user's own
  code in a script or a notebook;
* the Python entry points of the table's group (`group`, e.g. ``recursa.methods``) that
  installed packages declare, so a package adds a name by being installed:

      [project.entry-points."recursa.objectives"]
      my_loss = "my_pkg.losses:MY_LOSS"
"""

from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from recursa.errors import UserError

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def one_line(text: Any) -> str:
    """Collapse all whitespace to single spaces (task lines, observations, error texts)."""
    return " ".join(str(text).split())


def is_import_path(spec: Any) -> bool:
    """Whether `spec` reads 'package.module:attribute'."""
    return isinstance(spec, str) and bool(_PATH.match(spec.strip()))


def import_object(target: str, what: str):
    """The object 'pkg.module:attr' names; a one-line `UserError` naming `what` when the
    module cannot be imported or lacks the attribute."""
    module_name, _, attr = target.strip().partition(":")
    if not module_name or not attr:
        raise UserError(f"{what} = {target!r}: expected 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{what} = {target!r}: cannot import module {module_name!r} ({one_line(exc)}); install the package or put it on PYTHONPATH") from None
    except Exception as exc:  # the module's own code failed while importing
        raise UserError(f"{what} = {target!r}: importing {module_name!r} failed: {type(exc).__name__}: {one_line(exc)}") from None
    except SystemExit as exc:  # the module called sys.exit while importing: one line, not a silent exit (issue 49)
        raise UserError(f"{what} = {target!r}: importing {module_name!r} called sys.exit({exc.code!r}); a module a config names must not exit the process") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{what} = {target!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def entry_point_table(group: str) -> dict[str, str]:
    """name -> 'pkg.module:attr' of every entry point installed packages declare in `group`
    (the first of a repeated name)."""
    from importlib.metadata import entry_points

    out: dict[str, str] = {}
    for ep in entry_points(group=group):
        out.setdefault(ep.name, ep.value)
    return out


@dataclass
class Entry:
    name: str
    path: str | None  # 'pkg.module:attr', or None for an object registered in this process
    description: str
    source: str  # "built-in", "registered" or "entry point"
    obj: Any = None  # the object registered in this process


class Registry:
    """One table of named extension points (see the module docstring). `key` is the config
    key that names an entry, for error messages (e.g. 'algo.objective')."""

    def __init__(self, kind: str, key: str, group: str | None, builtins: dict[str, tuple[str, str]] | None = None):
        self.kind, self.key, self.group = kind, key, group
        self._builtin = {name: Entry(name, path, desc, "built-in") for name, (path, desc) in (builtins or {}).items()}
        self._registered: dict[str, Entry] = {}
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------------ names

    def entries(self) -> dict[str, Entry]:
        """Every name the table knows, built-in first, then this process's, then entry points."""
        out = dict(self._builtin)
        for name, e in self._registered.items():
            out.setdefault(name, e)
        if self.group:
            for name, path in entry_point_table(self.group).items():
                out.setdefault(name, Entry(name, path, f"entry point ({self.group})", "entry point"))
        return out

    def builtins(self) -> dict[str, Entry]:
        """The table's built-in names."""
        return dict(self._builtin)

    def registered(self) -> dict[str, Entry]:
        """The names registered in this process (`register`), in order."""
        return dict(self._registered)

    def names(self) -> list[str]:
        return list(self.entries())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._builtin or name in self._registered
                                         or (self.group is not None and name in entry_point_table(self.group)))

    def path(self, name: str) -> str | None:
        """The import path behind `name` (None for an object registered in this process);
        a one-line UserError for an unknown name. Imports nothing."""
        return self._entry(name).path

    def check(self, name: str) -> str:
        """`name` when the table knows it, else the one-line UserError `get` would raise."""
        self._entry(name)
        return name

    def _entry(self, name: str) -> Entry:
        entry = self._builtin.get(name) or self._registered.get(name)
        if entry is None and self.group:
            path = entry_point_table(self.group).get(name)
            entry = Entry(name, path, f"entry point ({self.group})", "entry point") if path else None
        if entry is None:
            names = self.names()
            close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"{self.key} = {name!r}: no {self.kind} of that name{hint}; known: {', '.join(names)}")
        return entry

    # ------------------------------------------------------------------ objects

    def get(self, name: str) -> Any:
        """The object behind `name`, importing its module the first time."""
        if name in self._cache:
            return self._cache[name]
        entry = self._entry(name)
        obj = entry.obj if entry.path is None else import_object(entry.path, f"{self.key} = {name!r}")
        self._cache[name] = obj
        return obj

    def register(self, name: str, obj: Any = None, *, description: str = "", replace: bool = False) -> Callable:
        """Add `name` in this process: `obj` is the object or its 'pkg.module:attr' path.
        Without `obj`, a decorator: ``@METHODS.register("my_method")``. A built-in name is
        refused (pick another), and so is a second registration unless `replace`."""
        def add(value: Any) -> Any:
            if name in self._builtin:
                raise ValueError(f"{name!r} is a built-in {self.kind}: register yours under another name")
            if name in self._registered and not replace:
                raise ValueError(f"{name!r} is already a registered {self.kind}: pass replace=True to replace it")
            path = value.strip() if is_import_path(value) else None
            self._registered[name] = Entry(name, path, description or f"registered {self.kind}", "registered", None if path else value)
            self._cache.pop(name, None)
            return value

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> None:
        """Drop a name registered in this process (tests, notebooks)."""
        self._registered.pop(name, None)
        self._cache.pop(name, None)
