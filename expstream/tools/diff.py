"""``expstream diff RUN_A RUN_B``: what differs between two runs' records of one topic.

Each side is read with :func:`expstream.tools.samples.read_samples` (the recording of ``--topic``, or
``experiences.msgpack``); SampleBatch samples, PromptBatch prompts or dead letters are matched by
id and compared field by field (integers and text exactly, floats within ``atol + rtol * |b|``,
B the reference). Exit 0 equal, 1 different, 2 bad arguments, a corrupt recording or a topic of
nothing comparable. What is compared, the rules in order, the output and the exit codes:
docs/replay.md "diff".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from expstream.config.cli_args import Command
from expstream.errors import EXIT_FAILED, EXIT_OK, ConfigError
from expstream.tools.recording import Damage, RecordingError
from expstream.tools.samples import EXPERIENCES_TOPIC, Sample, SampleSet, is_dlq, read_samples, refuse_damaged

__all__ = ["Difference", "DiffResult", "add_diff_arguments", "compare_samples", "diff_command", "diff_runs"]

#: Detail lines printed before "... N more" in the text view (--json always has them all).
DEFAULT_MAX_LINES = 50
#: Sample ids listed per "only in" line of the text view.
LISTED_IDS = 20


@dataclass
class Difference:
    """One field of one sample that differs."""

    sample: str  # sample id group#index
    field: str  # SampleBatch field, or "info.<key>" / "reward_metrics.<key>"
    kind: str  # values | length | dtype | string | bytes | missing_field
    a: Any = None  # the differing value of A (scalar fields), the length (length), the dtype (dtype)
    b: Any = None
    max_abs: float | None = None  # max |a - b| over the compared positions
    max_rel: float | None = None  # max |a - b| / |b| (inf where b == 0 != a)
    first_position: int | None = None  # per-token rows: first differing position
    positions: int | None = None  # per-token rows: how many positions differ (over the common prefix)

    def text(self) -> str:
        head = f"{self.sample} {self.field}:"
        if self.kind == "missing_field":
            return f"{head} only in {'A' if self.b is None else 'B'}"
        if self.kind == "string":
            return f"{head} {_short(self.a)} vs {_short(self.b)}"
        if self.kind == "dtype":
            return f"{head} dtype {self.a} vs {self.b}"
        if self.kind == "bytes":
            return f"{head} {self.a} vs {self.b} bytes, first differing byte {self.first_position}"
        errs = "" if self.max_abs is None else f", max abs {self.max_abs:.6g}, max rel {self.max_rel:.6g}"
        if self.kind == "length":
            return f"{head} length {self.a} vs {self.b}, first differing position {self.first_position}{errs}"
        if self.first_position is None:
            return f"{head} {self.a!r} vs {self.b!r}{errs}"
        return (f"{head} {self.positions} position(s) differ, first at {self.first_position} "
                f"(a={self.a!r} b={self.b!r}){errs}")


def _short(s: Any, n: int = 80) -> str:
    r = repr(s)
    return r if len(r) <= n else r[: n - 3] + "..."


def _scalar(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else x


def _errors(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max abs, max rel) of float arrays of one shape (0, 0 when empty)."""
    if a.size == 0:
        return 0.0, 0.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    d = np.abs(a64 - b64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(d == 0, 0.0, d / np.abs(b64))
    return float(d.max()), float(rel.max())


def _differs(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return np.abs(a64 - b64) > atol + rtol * np.abs(b64)
    return a != b


def _compare_field(sid: str, name: str, a: Any, b: Any, atol: float, rtol: float) -> Difference | None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype:
            return Difference(sid, name, "dtype", str(a.dtype), str(b.dtype))
        n = min(len(a), len(b))
        bad = _differs(a[:n], b[:n], atol, rtol)
        abs_err, rel_err = _errors(a[:n], b[:n]) if a.dtype.kind in "fiu" else (None, None)
        if a.dtype.kind == "b":
            abs_err, rel_err = _errors(a[:n].astype(np.int8), b[:n].astype(np.int8))
        if len(a) != len(b):
            first = int(np.flatnonzero(bad)[0]) if bad.any() else n
            return Difference(sid, name, "length", len(a), len(b), abs_err, rel_err, first, int(bad.sum()))
        if not bad.any():
            return None
        first = int(np.flatnonzero(bad)[0])
        return Difference(sid, name, "values", _scalar(a[first]), _scalar(b[first]), abs_err, rel_err, first,
                          int(bad.sum()))
    if isinstance(a, str) or isinstance(b, str):
        return None if a == b else Difference(sid, name, "string", a, b)
    if isinstance(a, bytes) or isinstance(b, bytes):
        if a == b:
            return None
        a, b = bytes(a or b""), bytes(b or b"")
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return Difference(sid, name, "bytes", len(a), len(b), first_position=first)
    if not isinstance(a, (int, float, np.number)) or not isinstance(b, (int, float, np.number)):  # lists, None
        return None if a == b else Difference(sid, name, "values", a, b)
    if isinstance(a, float) or isinstance(b, float):
        fa, fb = np.array([a], np.float64), np.array([b], np.float64)
        if not _differs(fa, fb, atol, rtol)[0]:
            return None
        abs_err, rel_err = _errors(fa, fb)
        return Difference(sid, name, "values", a, b, abs_err, rel_err)
    if a == b:
        return None
    return Difference(sid, name, "values", a, b, float(abs(a - b)), _errors(np.array([a]), np.array([b]))[1])


def compare_samples(a: Sample, b: Sample, *, atol: float, rtol: float,
                    ignore: tuple[str, ...] = ()) -> list[Difference]:
    """Every field of ``a`` and ``b`` (same sample id) that differs (module docstring, steps 1-5)."""
    out = []
    names = list(a.fields) + [k for k in b.fields if k not in a.fields]
    for name in names:
        if any(name == ig or name.startswith(ig + ".") for ig in ignore):
            continue
        if name not in b.fields or name not in a.fields:
            out.append(Difference(a.sample_id, name, "missing_field",
                                  "present" if name in a.fields else None, "present" if name in b.fields else None))
            continue
        d = _compare_field(a.sample_id, name, a.fields[name], b.fields[name], atol, rtol)
        if d is not None:
            out.append(d)
    return out


@dataclass
class FieldSummary:
    samples_differing: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    first_sample: str = ""


@dataclass
class DiffResult:
    topic: str
    atol: float
    rtol: float
    a: SampleSet
    b: SampleSet
    only_in_a: list[str] = field(default_factory=list)  # missing from B
    only_in_b: list[str] = field(default_factory=list)  # extra in B
    compared: int = 0
    differences: list[Difference] = field(default_factory=list)

    @property
    def unit(self) -> str:
        """What was compared: "samples", "prompts", "dead letters" (or several, comma separated)."""
        names = {"sample": "samples", "prompt": "prompts", "letter": "dead letters"}
        kinds = sorted({*self.a.kinds, *self.b.kinds}) or (["letter"] if is_dlq(self.topic) else ["sample"])
        return ", ".join(names.get(k, k) for k in kinds)

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences or self.a.undecodable
                    or self.b.undecodable)

    def summary(self) -> dict[str, FieldSummary]:
        out: dict[str, FieldSummary] = {}
        for d in self.differences:
            s = out.setdefault(d.field, FieldSummary(first_sample=d.sample))
            s.samples_differing += 1
            for attr in ("max_abs", "max_rel"):
                v = getattr(d, attr)
                if v is not None:
                    setattr(s, attr, v if getattr(s, attr) is None else max(getattr(s, attr), v))
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        def side(s: SampleSet) -> dict[str, Any]:
            return {"source": s.source, "records": s.records, "samples": len(s.samples), "kinds": s.kinds,
                    "duplicates": s.duplicates, "undecodable": s.undecodable, "torn": s.torn}

        return _jsonable({
            "topic": self.topic, "unit": self.unit, "atol": self.atol, "rtol": self.rtol, "equal": self.equal,
            "a": side(self.a), "b": side(self.b), "only_in_a": self.only_in_a, "only_in_b": self.only_in_b,
            "compared": self.compared, "differences": [asdict(d) for d in self.differences],
            "fields": {k: asdict(v) for k, v in self.summary().items()},
        })


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    x = _scalar(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf": JSON has no infinity
    return x


def _order_key(sid: str) -> tuple[Any, ...]:
    """Group ids numerically when they are numbers (1, 2, 10), then the index."""
    g, _, i = sid.rpartition("#")
    return (0, int(g), "", int(i)) if g.isdigit() else (1, 0, g, int(i) if i.isdigit() else 0)


def diff_runs(run_a: str | Path, run_b: str | Path, *, topic: str = EXPERIENCES_TOPIC, atol: float = 1e-6,
              rtol: float = 0.0, ignore: tuple[str, ...] = (),
              on_damage: Callable[[Damage], None] | None = None) -> DiffResult:
    """Compare ``topic``'s entries of two run directories (module docstring)."""
    a = read_samples(run_a, topic, flag="RUN_A", on_damage=on_damage)
    b = read_samples(run_b, topic, flag="RUN_B", on_damage=on_damage)
    if not a.samples and not b.samples and (a.undecodable or b.undecodable):
        first = (a.undecodable or b.undecodable)[0]
        raise ConfigError(f"topic {topic!r} holds no record diff can compare: {len(a.undecodable)} record(s) in "
                          f"RUN_A and {len(b.undecodable)} in RUN_B are not PromptBatch or SampleBatch messages "
                          f"(e.g. {first[:300]})", field="--topic",
                          fix="diff compares samples, prompts and dead letters (.dlq topics); name such a topic "
                              "(`expstream show RUN --topic T --offset 0:0` shows what a record of T is)")
    res = DiffResult(topic, atol, rtol, a, b)
    res.only_in_a = sorted((s for s in a.samples if s not in b.samples), key=_order_key)
    res.only_in_b = sorted((s for s in b.samples if s not in a.samples), key=_order_key)
    for sid in sorted((s for s in a.samples if s in b.samples), key=_order_key):
        res.compared += 1
        res.differences += compare_samples(a.samples[sid], b.samples[sid], atol=atol, rtol=rtol, ignore=ignore)
    return res


def format_result(res: DiffResult, max_lines: int = DEFAULT_MAX_LINES) -> str:
    lines = []
    for name, s in (("A", res.a), ("B", res.b)):
        lines.append(f"{name}: {s.source}  {len(s.samples)} {res.unit} from {s.records} records, "
                     f"{s.duplicates} duplicate(s) skipped (first occurrence kept)")
        for t in s.torn:
            lines.append(f"  {name} torn: {t}")
        for u in s.undecodable:
            lines.append(f"  {name} undecodable record {u}")
    for label, ids in (("only in A (missing from B)", res.only_in_a), ("only in B (extra)", res.only_in_b)):
        more = f" ... {len(ids) - LISTED_IDS} more" if len(ids) > LISTED_IDS else ""
        lines.append(f"{label}: {len(ids)}" + (f"  {', '.join(ids[:LISTED_IDS])}{more}" if ids else ""))
    lines.append(f"compared {res.compared} {res.unit} of topic {res.topic}; a float differs where "
                 f"|a-b| > atol + rtol*|b| (atol={res.atol:g}, rtol={res.rtol:g})")
    if res.differences:
        lines.append(f"differences ({len(res.differences)}):")
        lines += ["  " + d.text() for d in res.differences[:max_lines]]
        if len(res.differences) > max_lines:
            lines.append(f"  ... {len(res.differences) - max_lines} more (--max-lines N, or --json for all)")
        summary = res.summary()
        rows = [("field", "samples", "max_abs", "max_rel", "first sample")]
        rows += [(k, str(v.samples_differing), "-" if v.max_abs is None else f"{v.max_abs:.6g}",
                  "-" if v.max_rel is None else f"{v.max_rel:.6g}", v.first_sample) for k, v in summary.items()]
        widths = [max(len(r[j]) for r in rows) for j in range(5)]
        lines.append("summary:")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("EQUAL within tolerance" if res.equal else "DIFFERENT")
    return "\n".join(lines)


def diff_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    for flag, v in (("--atol", args.atol), ("--rtol", args.rtol)):
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"{flag} must be a finite number >= 0, got {v}", field=flag,
                              fix=f"e.g. {flag} 1e-6, or {flag} 0 for exact equality")
    if args.max_lines < 0:
        raise ConfigError(f"--max-lines must be >= 0, got {args.max_lines}", field="--max-lines",
                          fix="e.g. --max-lines 50")
    def warn(d: Damage) -> None:
        print(f"expstream diff: warning: {d.message()}", file=sys.stderr)

    try:
        res = diff_runs(args.run_a, args.run_b, topic=args.topic, atol=args.atol, rtol=args.rtol,
                        ignore=tuple(args.ignore), on_damage=warn)
    except RecordingError as exc:
        raise refuse_damaged(exc, "RUN_A/RUN_B") from exc
    if args.json:
        print(json.dumps(res.to_json(), sort_keys=True), file=out)
    else:
        print(format_result(res, args.max_lines), file=out)
    return EXIT_OK if res.equal else EXIT_FAILED


def add_diff_arguments(p: argparse.ArgumentParser) -> None:
    """``expstream diff`` (no topology flags: each run directory holds its configuration)."""
    p.add_argument("run_a", metavar="RUN_A", help="a run directory (the one under test)")
    p.add_argument("run_b", metavar="RUN_B", help="a run directory (the reference: rel errors divide by B)")
    p.add_argument("--topic", default=EXPERIENCES_TOPIC, help="the recorded topic to compare (default: experiences)")
    p.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance for floats (default 1e-6)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for floats, times |b| (default 0)")
    p.add_argument("--ignore", action="append", default=[], metavar="FIELD",
                   help="a field not to compare (repeatable), e.g. batch_id, info for every info.<key>, or "
                        "headers.error_message on a .dlq topic")
    p.add_argument("--max-lines", type=int, default=DEFAULT_MAX_LINES,
                   help=f"difference lines printed (default {DEFAULT_MAX_LINES}; --json has them all)")
    p.add_argument("--json", action="store_true", help="one JSON object (docs/replay.md, 'diff')")


DIFF = Command("diff", "compare two runs' samples, prompts or dead letters of a topic, field by field "
                        "(exit 1 when they differ)", add_diff_arguments, diff_command, reads_topology=False)
