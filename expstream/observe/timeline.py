"""The start-up timeline: where the seconds before the first experience go (summary.json ``startup``).

``expstream run`` marks its own steps (:class:`Timeline`, in the main process) and every stage
replica marks its own (:func:`mark_stage`, one small JSON file per replica under
``<output>/run/startup/``); the summary shows them as seconds since the run process started, with
the slowest replica's ``critical_path``. Every mark and what it means: docs/observability.md
"The start-up timeline".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: The directory under ``<output>/run`` where stage replicas write their marks.
STARTUP_DIR = "startup"
#: The environment variable naming that directory for a stage process (set by ``expstream run``).
STARTUP_DIR_ENV = "EXPSTREAM_STARTUP_DIR"


def process_started_at(pid: int | None = None) -> float:
    """Wall-clock time the process was created (Linux ``/proc``, to a clock tick; ``time.time()`` elsewhere).

    ``starttime`` in ``/proc/<pid>/stat`` counts clock ticks since boot. The boot time is taken as now
    minus ``CLOCK_BOOTTIME``, not ``/proc/stat``'s ``btime``: that is whole seconds, which put every
    process up to a second too early (0.8 s on the machine where it was found).
    """
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the comm field
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Timeline:
    """Named wall-clock marks of one process; the first mark of a name wins."""

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = process_started_at() if started_at is None else started_at
        self.marks: dict[str, float] = {"process_start": self.started_at}

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks.setdefault(name, time.time() if at is None else at)

    def relative(self, marks: dict[str, float] | None = None) -> dict[str, float]:
        """``marks`` (default: this timeline's) as seconds since this process started, in time order."""
        items = sorted((marks if marks is not None else self.marks).items(), key=lambda kv: kv[1])
        return {k: round(v - self.started_at, 3) for k, v in items}


def mark_stage(event: str, *, stage: str, replica: int | str, at: float | None = None) -> None:
    """A stage replica's mark, into ``$EXPSTREAM_STARTUP_DIR/<stage>-<replica>.json`` (best effort:
    without the variable, e.g. ``expstream stage`` run by hand, nothing is written)."""
    where = os.environ.get(STARTUP_DIR_ENV)
    if not where:
        return
    path = Path(where) / f"{stage}-{replica}.json"
    try:
        marks = json.loads(path.read_text()) if path.is_file() else {}
        if marks.get("pid") != os.getpid():  # a restarted replica starts its own timeline
            marks = {"pid": os.getpid(), "process_start": process_started_at()}
        marks.setdefault(event, time.time() if at is None else at)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(marks))
        os.replace(tmp, path)
    except (OSError, ValueError):  # observability never stops a stage
        pass


def startup_summary(timeline: Timeline, run_dir: Path) -> dict[str, Any]:
    """summary.json's ``startup``: the run's marks and every replica's, in seconds since the run started."""
    stages: dict[str, dict[str, float]] = {}
    for path in sorted((Path(run_dir) / STARTUP_DIR).glob("*.json")):
        try:
            marks = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        marks.pop("pid", None)
        stages[path.stem] = timeline.relative({k: float(v) for k, v in marks.items()})
    out: dict[str, Any] = {"timeline_s": timeline.relative(), "stages": stages}
    ready = {name: m for name, m in stages.items() if "assigned" in m}
    if ready:
        last = max(ready, key=lambda name: ready[name]["assigned"])
        out["critical_path"] = {"replica": last, **ready[last]}
    return out
