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


#: The layers of the code base, lowest first (docs/ARCHITECTURE.md, "Packages and layers"). A module
#: may import modules of its own layer or of a lower one, never of a higher one. Each entry is a
#: package (every module under it) or a single top-level module.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("schemas", "expstream.errors", "expstream.retry", "expstream.procs", "expstream.cpuslice", "expstream.faults"),
    ("expstream.config",),
    ("expstream.kafka",),
    ("expstream.rl", "expstream.state", "expstream.models", "expstream.observe"),
    ("expstream.rewards", "expstream.train"),
    ("stages",),
    ("expstream.launch", "expstream.tools"),
    ("expstream.cli", "expstream.__main__", "expstream"),
)


def layer_of(module: str) -> int:
    """The layer index of ``module``: the longest entry of LAYERS that is it or a package above it."""
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = i, len(entry)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it (or its package) to LAYERS and to ARCHITECTURE.md")
    return best


def test_layer_of_picks_the_most_specific_entry():
    assert layer_of("expstream") == len(LAYERS) - 1
    assert layer_of("expstream.errors") == 0
    assert layer_of("expstream.config.topology") == 1
    assert layer_of("stages.runner") == layer_of("stages")


def test_no_module_imports_a_higher_layer():
    upward = sorted(
        f"{src} (layer {layer_of(src)}) -> {dst} (layer {layer_of(dst)})"
        for src, targets in import_graph().items()
        for dst in targets
        if layer_of(dst) > layer_of(src)
    )
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def private_reach_ins(root: Path = ROOT, dirs: tuple[str, ...] = (*PACKAGES, "tests", "bench")) -> list[str]:
    """Every ``from ours import _name`` and ``ours_module._name`` in the Python files under ``dirs``.

    A leading underscore says "not part of this module's interface"; a name another module needs
    is made public where it belongs instead (issue 22).
    """
    found: list[str] = []
    modules = module_files(root)
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            aliases: set[str] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PACKAGES:
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            found.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {alias.name}")
                        if f"{node.module}.{alias.name}" in modules:  # a module, not a function or class
                            aliases.add(alias.asname or alias.name)
                elif isinstance(node, ast.Import):
                    aliases.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                        and isinstance(node.value, ast.Name) and node.value.id in aliases):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_private_reach_ins_are_found(tmp_path):
    (tmp_path / "expstream").mkdir()
    for name in ("__init__", "b", "c"):
        (tmp_path / "expstream" / f"{name}.py").write_text("")
    (tmp_path / "expstream" / "a.py").write_text(
        "from expstream.b import _hidden, shown\nfrom expstream import c as C\nC._x()\nshown._y\n")
    found = private_reach_ins(tmp_path, ("expstream",))
    assert found == ["expstream/a.py:1: from expstream.b import _hidden", "expstream/a.py:3: C._x"]


def test_no_module_imports_another_modules_private_names():
    found = private_reach_ins()
    assert not found, "private names used from another module (make them public where they belong):\n" + "\n".join(found)
