"""The static import graph of recursa/ (every `import` and `from ... import`, inside functions
too): no cycle, and layers that only point down (docs/design.md, "Layers").

An import path held as a string in a registry table ('recursa.envs.twx:TWXEnv') is not an
import: a table names what it may load without depending on it (recursa/registry.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "recursa"

# the pure layer: math, data types and text functions; they import only each other
PURE = {"recursa.errors", "recursa.registry", "recursa.plugins", "recursa.answers", "recursa.stats", "recursa.trajectory", "recursa.agent", "recursa.skills.sanitize", "recursa.bm25", "recursa.hardware"}
PURE_PACKAGES = ("recursa.algorithms",)
# the environments know nothing of configs, models, rollouts or recipes
ENVS_MAY_IMPORT = ("recursa.envs", "recursa.runio")
# config validation asks the registries (envs, methods) and the pure layer; it loads no model and runs no recipe
CONFIG_MAY_IMPORT = ("recursa.envs", "recursa.agent", "recursa.methods.base")
# only the top of the stack runs recipes
RECIPE_USERS = ("recursa.recipes", "recursa.methods", "recursa.cli", "recursa.export", "recursa.distributed.worker")


def test_the_methods_protocol_imports_only_the_pure_layer():
    bad = _breaks(GRAPH, lambda m: m == "recursa.methods.base", _pure)
    assert not bad, bad


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the recursa modules it imports anywhere in its source (a `from a import b`
    counts as an import of a.b when a.b is a module, else of a)."""
    modules = {module_name(p): p for p in pkg.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {m for a in node.names if (m := known(a.name)) and a.name.startswith("recursa")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not source.startswith("recursa"):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    m = sub if sub in modules else known(source)
                    if m:
                        found.add(m)
        found.discard(name)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _pure(name: str) -> bool:
    return name in PURE or _under(name, PURE_PACKAGES)


def _breaks(graph, who, allowed) -> list[str]:
    return [f"{a} -> {b}" for a in sorted(graph) if who(a) for b in sorted(graph[a]) if not allowed(b)]


GRAPH = import_graph()


def test_the_graph_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "recursa"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from recursa.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nimport recursa.sub.c\n")
    (pkg / "sub" / "c.py").write_text("import os\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = import_graph(pkg)
    finally:
        ROOT = saved
    assert graph["recursa.a"] == {"recursa.sub.b"} and graph["recursa.sub.b"] == {"recursa.a", "recursa.sub.c"}
    assert cycles(graph) == [["recursa.a", "recursa.sub.b"]]


def test_recursa_has_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_pure_layer_imports_only_itself():
    assert "recursa.algorithms.advantages" in GRAPH and _pure("recursa.algorithms.advantages")
    bad = _breaks(GRAPH, _pure, _pure)
    assert not bad, bad


def test_the_environments_know_nothing_of_configs_models_or_recipes():
    bad = _breaks(GRAPH, lambda m: _under(m, ("recursa.envs",)), lambda m: _pure(m) or _under(m, ENVS_MAY_IMPORT))
    assert not bad, bad


def test_config_validation_imports_no_model_and_no_recipe():
    bad = _breaks(GRAPH, lambda m: m == "recursa.config", lambda m: _pure(m) or _under(m, CONFIG_MAY_IMPORT))
    assert not bad, bad


def test_only_the_top_of_the_stack_imports_a_recipe():
    bad = [f"{a} -> {b}" for a in sorted(GRAPH) for b in sorted(GRAPH[a]) if _under(b, ("recursa.recipes",)) and not _under(a, RECIPE_USERS)]
    assert not bad, bad
