"""No source module over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES (issue 22).

Why: a module of one concept fits in a reader's head; a 1,000-line module or a 150-line function
is several concepts that have not been named yet. The source is read with ``ast`` (nothing is
imported), so the test is fast. The exceptions below are the modules and functions that other
items of issue 22 are splitting at the time of writing; an entry goes when its split lands, and a
new entry needs a note in docs/ARCHITECTURE.md saying why that one must be long.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("expstream", "stages", "schemas")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

#: Modules still over the limit, being split by other items of issue 22 (path relative to the repository).
LONG_MODULES: frozenset[str] = frozenset()
#: Functions still over the limit ("path:name"), likewise.
LONG_FUNCTIONS: frozenset[str] = frozenset()


def too_long(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(modules over MAX_MODULE_LINES, functions over MAX_FUNCTION_LINES) under PACKAGES, with their lengths."""
    modules, functions = [], []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            src = path.read_text(encoding="utf-8")
            if (n := len(src.splitlines())) > MAX_MODULE_LINES:
                modules.append(f"{rel} ({n} lines)")
            for node in ast.walk(ast.parse(src, filename=rel)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                        functions.append(f"{rel}:{node.name} ({n} lines)")
    return modules, functions


def test_too_long_finds_long_modules_and_functions(tmp_path):
    (tmp_path / "expstream").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "expstream" / "a.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    pass\n")
    (tmp_path / "expstream" / "b.py").write_text("y = 1\n" * (MAX_MODULE_LINES + 1))
    assert too_long(tmp_path) == ([f"expstream/b.py ({MAX_MODULE_LINES + 1} lines)"],
                                  [f"expstream/a.py:f ({MAX_FUNCTION_LINES + 1} lines)"])


def test_no_module_or_function_is_too_long():
    modules, functions = too_long()
    modules = [m for m in modules if m.split(" (")[0] not in LONG_MODULES]
    functions = [f for f in functions if f.split(" (")[0] not in LONG_FUNCTIONS]
    assert not modules and not functions, (
        f"split these along their concepts (at most {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a "
        "function):\n" + "\n".join(modules + functions))


def test_every_listed_exception_is_still_too_long():
    """An entry of LONG_MODULES / LONG_FUNCTIONS goes when its split lands: a stale one would let the
    place grow back unnoticed."""
    modules, functions = too_long()
    long_now = {m.split(" (")[0] for m in modules} | {f.split(" (")[0] for f in functions}
    stale = sorted((LONG_MODULES | LONG_FUNCTIONS) - long_now)
    assert not stale, "no longer too long, take them off the list: " + ", ".join(stale)
