"""The import graph of expstream/, stages/ and schemas/ has no circle.

Why: a circle (cli -> run -> supervisor -> forkserver -> cli, as it once was) means no module of
it can be read, tested or replaced on its own, and one top-level import away from an
ImportError at start-up. Function-level imports count too: they hide a circle, they do not
remove it. The graph is built from the source with ``ast`` (nothing is imported), so the test
is fast and sees every import, whichever branch it sits in.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("expstream", "stages", "schemas")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (``pkg/__init__.py`` is ``pkg``)."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``module`` imports anywhere in its source (top level or inside functions).

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
    A package's own ``__init__`` is not counted as imported by ``import pkg.mod`` (Python runs
    it, but it is a package marker here; ``expstream/__init__.py`` imports lazily).
    """
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt, black) == grey:
                return stack[stack.index(nxt):] + [nxt]
            if colour.get(nxt) == white and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        colour[node] = black
        return None

    for start in sorted(graph):
        if colour[start] == white and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "expstream"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from expstream import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    graph = import_graph(tmp_path)
    assert graph["expstream.a"] == {"expstream.b"} and graph["expstream.b"] == {"expstream.a"}
    assert find_cycle(graph) == ["expstream.a", "expstream.b", "expstream.a"]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "expstream.cli" in graph and graph["expstream.cli"], "the graph found no module or no import"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
