"""Helpers shared by the benchmarks: generated prompts, medians, plain-text tables, result files.

The benchmarks are scripts (``.venv/bin/python bench/pipeline.py``), so this module is imported
as ``common`` from the script's own directory.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
#: Where the default tiny models live (same place as `expstream run` builds them from the repo root).
TINY_CACHE = ROOT / ".cache" / "expstream" / "models"
#: The bigger "small" models of ``--model-size small`` get their own cache directory.
SMALL_CACHE = ROOT / ".cache" / "expstream" / "bench-models"

_T0 = time.perf_counter()

_TEMPLATES = (
    ("What is {a} + {b}?", lambda a, b: str(a + b)),
    ("What is {a} times {b}? Answer with a number only.", lambda a, b: str(a * b)),
    ("Compute {a} minus {b} and explain the steps briefly.", lambda a, b: str(a - b)),
    ("Is {a} larger than {b}? Say yes or no.", lambda a, b: "yes" if a > b else "no"),
    ("Write a short sentence that contains the numbers {a} and {b}.", lambda a, b: ""),
)


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` deterministic prompts of mixed length as JSON lines (ids ``b00000``...)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(count):
            text, label = _TEMPLATES[i % len(_TEMPLATES)]
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            fh.write(json.dumps({"id": f"b{i:05d}", "prompt": text.format(a=a, b=b), "label": label(a, b)}) + "\n")
    return path


def median(xs: Sequence[float]) -> float:
    vals = [float(x) for x in xs if x == x]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return "n/a" if x != x else format(x, spec)
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table; the first column is left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def machine() -> dict[str, Any]:
    """What the numbers were measured on (and how busy it was)."""
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        load = []
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
    }


def checked_sets(sets: Sequence[str], flag: str) -> list[str]:
    """Topology overrides given to a bench (``flag`` names the option), refused before anything starts: a wrong
    key or value exits with the topology's own message (the field and the fix), not minutes into a run."""
    from expstream.config.topology import load_topology
    from expstream.errors import ConfigError

    try:
        load_topology(None, list(sets))
    except ConfigError as exc:
        print(f"{flag}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return list(sets)


def progress(msg: str) -> None:
    """A progress line on stderr (stdout carries only the results)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def save(name: str, summary: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` and print the one-line JSON summary."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    line = json.dumps(summary, separators=(",", ":"), sort_keys=False, default=_jsonable)
    path.write_text(line + "\n")
    print(line)
    print(f"(written to {path.relative_to(ROOT)})", file=sys.stderr)
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def rounded(x: float, nd: int = 3) -> float | None:
    return None if x is None or x != x else round(float(x), nd)
