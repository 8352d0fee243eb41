"""Runs every stage replica as its own OS process and restarts the ones that die.

A crashed replica is restarted with a doubling backoff; exit code 2 (a configuration error) fails
the run at once, quoting the child's last log line; a one-shot child (the continuous run's trainer)
that exits 0 is finished. ``stop()`` sends SIGTERM, waits ``STOP_GRACE_S``, then SIGKILLs, and
every child also dies with this process (``PDEATHSIG``, parent watch). :meth:`Supervisor.scale_to`
changes a stage's replica count live (call it from the run's main thread). ``pids.json`` lists the
live replicas; fault injection reaches only a replica's first process.
Restarts, scaling, lifetimes and why: docs/ARCHITECTURE.md "Processes" and "The supervisor".
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from expstream.errors import EXIT_CONFIG
from expstream.faults import FAULT_ENV
from expstream.procs import EXIT_WITH_PARENT_ENV, die_with

log = logging.getLogger("expstream.supervisor")

# Why 0.5 s doubling to 10 s: a stage that dies at start (e.g. the broker is still electing)
# is retried quickly, while a crash-looping one does not eat the CPU the other stages need.
RESTART_BACKOFF_START_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
# A replica that ran this long before dying is considered healthy again: its backoff resets.
HEALTHY_AFTER_S = 30.0
# Why 20 s between SIGTERM and SIGKILL: a stopping stage finishes at most one forward pass (a
# generation stops between tokens), then flushes its producer (at most 10 s, stages/runner.py)
# and leaves the group; on a busy 2-core machine that takes a few seconds. After 20 s the stage
# is stuck: SIGKILL loses nothing, its uncommitted micro-batch is redelivered.
STOP_GRACE_S = 20.0


#: How much of the end of a child's log :func:`last_error_line` reads (its last lines are the error).
LOG_TAIL_BYTES = 4096


def last_error_line(path: Path) -> str | None:
    """The last non-empty line of a child's log (where ``expstream: ...`` errors end up), shortened."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:500] if lines else None


@dataclass
class Child:
    name: str
    replica: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures_in_a_row: int = 0
    next_start_at: float = 0.0
    exit_codes: list[int] = field(default_factory=list)
    one_shot: bool = False  # exit 0 = finished: not restarted
    finished: bool = False  # a one-shot child that exited 0
    kind: str = "stage"  # how log lines and errors name it ("stage", "process")
    stop_last: bool = False  # stopped after every other child has exited (the recorder drains what they wrote)
    retired: bool = False  # scaled down: SIGTERM sent (or gone); never restarted, its exit is no failure
    retire_deadline: float = 0.0  # SIGKILL after this (monotonic), while a retiring process lives on
    added_live: bool = False  # started by a scale-up: no fault injection (it names the stage's first processes)
    restarting: bool = False  # retired by a reassignment to start again with its new share (not "left")

    @property
    def label(self) -> str:
        return f"{self.name}[{self.replica}]"


class SupervisorError(RuntimeError):
    pass


class Supervisor:
    """Starts, watches and stops the children added with :meth:`add`.

    ``spawn="exec"`` runs each child's argv as a fresh interpreter; ``spawn="fork"`` forks it from
    the fork server instead, where the process calls ``fork_entry`` (``"module:function"``, e.g.
    ``"expstream.cli:main"``) with the arguments after ``python -m MODULE``. The caller names the
    entry point, so neither this module nor the fork server imports the command line.
    """

    def __init__(self, log_dir: Path, max_restarts: int = 5, env: dict[str, str] | None = None,
                 spawn: str = "exec", fork_entry: str | None = None,
                 on_gone: Callable[[str, int], None] | None = None) -> None:
        if spawn not in ("exec", "fork"):
            raise ValueError(f"spawn: {spawn!r}; use exec (a fresh interpreter per stage) or fork (fork server)")
        if spawn == "fork" and not fork_entry:
            raise ValueError("spawn: fork needs fork_entry, the 'module:function' a forked child runs")
        self.spawn = spawn
        self.fork_entry = fork_entry
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.max_restarts = max_restarts
        self.env = {**os.environ, **(env or {}), EXIT_WITH_PARENT_ENV: "1"}
        self.children: list[Child] = []
        self.stopping = False
        self.on_gone = on_gone
        # unit -> (count, argv_for) of a reassignment waiting for the old replicas to exit (:meth:`reassign`)
        self.reassigning: dict[str, tuple[int, Callable[[int], list[str]]]] = {}

    def add(self, name: str, replica: int, argv: list[str], *, one_shot: bool = False,
            stop_last: bool = False) -> Child:
        """Supervise ``argv`` as ``name[replica]``; ``one_shot``: an exit 0 means finished, not restarted;
        ``stop_last``: :meth:`stop` signals it only once every other child has exited."""
        child = Child(name, replica, argv, self.log_dir / f"{name}-{replica}.log", one_shot=one_shot,
                      kind="process" if one_shot or stop_last else "stage", stop_last=stop_last)
        self.children.append(child)
        return child

    def finished(self, name: str) -> bool:
        """True when every replica of the one-shot child ``name`` exited 0 (False for unknown names)."""
        mine = [c for c in self.children if c.name == name]
        return bool(mine) and all(c.finished for c in mine)

    def _child_env(self, child: Child) -> dict[str, str]:
        """The environment of ``child``'s next process: fault injection only in its first one."""
        spec = self.env.get(FAULT_ENV)
        if not spec or (child.restarts == 0 and not child.added_live):
            return self.env
        kept = [item for item in spec.split(",") if item.strip() and item.partition(":")[0].strip() != child.name]
        env = dict(self.env)
        if kept:
            env[FAULT_ENV] = ",".join(kept)
        else:
            env.pop(FAULT_ENV, None)
        return env

    def _spawn(self, child: Child) -> None:
        if self.spawn == "fork":
            from expstream.launch.forkserver import ForkedProcess, ForkServerError

            try:
                child.proc = ForkedProcess(self.fork_entry, child.argv, child.log_path, self._child_env(child))
            except ForkServerError as exc:
                raise SupervisorError(f"{child.kind} {child.label} could not be started: {exc}") from exc
            self._started(child)
            return
        out = open(child.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            child.proc = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT,
                                          env=self._child_env(child),
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=functools.partial(die_with, os.getpid()))
        finally:
            out.close()
        self._started(child)

    def _started(self, child: Child) -> None:
        child.started_at = time.monotonic()
        self._write_pids()
        log.info("started %s pid %d (log %s)", child.label, child.proc.pid, child.log_path)

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def poll(self) -> None:
        """Restart children that died; raise SupervisorError when one cannot be kept alive."""
        if self.stopping:
            return
        now = time.monotonic()
        for name in list(self.reassigning):
            self._start_reassigned(name)
        for child in self.children:
            if child.retired:
                self._reap_retired(child, now)
                continue
            if child.proc is None:
                if not child.finished and now >= child.next_start_at:
                    self._spawn(child)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            child.exit_codes.append(code)
            child.proc = None
            self._write_pids()
            if code == 0 and child.one_shot:
                child.finished = True
                log.info("%s %s finished (exit 0); not restarted", child.kind, child.label)
                continue
            if code == EXIT_CONFIG:
                said = last_error_line(child.log_path)
                raise SupervisorError(f"{child.kind} {child.label} exited with a configuration error (code {code})"
                                      + (f": {said}" if said else "") + f"; see {child.log_path}")
            if now - child.started_at > HEALTHY_AFTER_S:
                child.failures_in_a_row = 0
            child.failures_in_a_row += 1
            child.restarts += 1
            if child.restarts > self.max_restarts:
                raise SupervisorError(f"{child.kind} {child.label} died {child.restarts} times (last exit code {code}); "
                                      f"giving up, see {child.log_path}")
            delay = min(RESTART_BACKOFF_START_S * 2 ** (child.failures_in_a_row - 1), RESTART_BACKOFF_MAX_S)
            child.next_start_at = now + delay
            log.warning("%s %s exited with code %s; restart %d in %.1fs (log %s)", child.kind, child.label, code,
                        child.restarts, delay, child.log_path)

    # ---- live scaling --------------------------------------------------------------------------
    def replicas(self, name: str) -> int:
        """Replicas of ``name`` that are supervised now (running or waiting for a restart, or a reassignment's
        still to start), retiring ones not counted."""
        waiting = self.reassigning[name][0] if name in self.reassigning else 0  # a reassignment's, still to start
        return sum(1 for c in self.children if c.name == name and not c.retired) + waiting

    def scale_to(self, name: str, count: int, argv_for: Callable[[int], list[str]]) -> int:
        """Run ``count`` replicas of stage ``name``; returns the count before. ``argv_for(replica)`` is a
        new replica's command line. Scale-up starts processes now; scale-down SIGTERMs the highest
        replica ids and returns at once (:meth:`poll` reaps them, SIGKILL after ``STOP_GRACE_S``)."""
        if count < 1:
            raise ValueError(f"{name}: {count} replicas; a stage needs at least 1")
        active = sorted((c for c in self.children if c.name == name and not c.retired), key=lambda c: c.replica)
        before = len(active)
        if not active:
            raise ValueError(f"{name}: no such supervised stage")
        if count < before:
            for child in active[count:]:
                self._retire(child)
        for _ in range(count - before):
            self._add_replica(name, argv_for, kind=active[0].kind)
        self._write_pids()
        return before

    def reassign(self, name: str, count: int, argv_for: Callable[[int], list[str]]) -> int:
        """Run ``count`` replicas of ``name`` that take their partitions by hand: every replica is
        retired (SIGTERM; each finishes and commits its micro-batch; SIGKILL after ``STOP_GRACE_S``),
        and once all have exited (:meth:`poll`) replicas ``0..count-1`` start with
        ``argv_for(replica)``, which names the new share (``--assign replica/count``). Returns the count
        before, at once: the run loop goes on collecting while the old replicas finish.

        Why all first: hand-assigned replicas commit without a group generation (stages/assigning.py);
        no two may hold one partition, and the share of every replica changes with the count."""
        if count < 1:
            raise ValueError(f"{name}: {count} replicas; a stage needs at least 1")
        before = self.replicas(name)
        mine = [c for c in self.children if c.name == name and not c.retired]
        if not mine and name not in self.reassigning:
            raise ValueError(f"{name}: no such supervised stage")
        for child in mine:
            child.restarting = child.replica < count
            self._retire(child)
        self.reassigning[name] = (count, argv_for)
        self._write_pids()
        self._start_reassigned(name)  # at once when none was running
        return before

    def _start_reassigned(self, name: str) -> None:
        """The new replicas of a reassignment, once no old replica of ``name`` runs."""
        if any(c.name == name and c.retired and c.proc is not None for c in self.children):
            return
        count, argv_for = self.reassigning.pop(name)
        kind = next(c.kind for c in self.children if c.name == name)
        for _ in range(count):
            self._add_replica(name, argv_for, kind=kind)
        self._write_pids()
        log.info("%s: %d replicas started, each with its share of the partitions", name, count)

    def _add_replica(self, name: str, argv_for: Callable[[int], list[str]], kind: str) -> None:
        mine = [c for c in self.children if c.name == name]
        busy = {c.replica for c in mine if not c.retired or c.proc is not None}
        replica = next(i for i in range(len(mine) + 1) if i not in busy)
        child = next((c for c in mine if c.replica == replica), None)
        if child is None:
            child = self.add(name, replica, argv_for(replica))
            child.kind = kind
        child.argv = argv_for(replica)
        child.retired, child.failures_in_a_row, child.added_live, child.restarting = False, 0, True, False
        self._spawn(child)

    def _retire(self, child: Child) -> None:
        child.retired = True
        child.retire_deadline = time.monotonic() + STOP_GRACE_S
        if child.proc is None or child.proc.poll() is not None:
            child.proc = None
            log.info("%s %s retired (was not running)", child.kind, child.label)
            return
        log.info("%s %s %s: SIGTERM to pid %d (finishes its micro-batch, commits, %s)", child.kind, child.label,
                 "stopping" if child.restarting else "retiring", child.proc.pid,
                 "starts again with its new share" if child.restarting else "leaves")
        try:
            child.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _reap_retired(self, child: Child, now: float) -> None:
        if child.proc is None:
            return
        code = child.proc.poll()
        if code is None:
            if now > child.retire_deadline:
                log.warning("%s %s did not stop within %.0fs of SIGTERM; killing it", child.kind, child.label,
                            STOP_GRACE_S)
                child.proc.kill()
            return
        self._log_left(child, code)
        child.proc = None
        self._write_pids()
        self._gone(child)

    @staticmethod
    def _log_left(child: Child, code: int | None) -> None:
        """A retired child has exited: left after a scale-down, or stopped to start again with a new share."""
        how = "stopped, to start again with its new share" if child.restarting else "left after scale-down"
        log.info("%s %s %s (exit code %s)", child.kind, child.label, how, code)

    def _gone(self, child: Child) -> None:
        if self.on_gone is not None:
            try:
                self.on_gone(child.name, child.replica)
            except Exception as exc:  # noqa: BLE001 - housekeeping never stops the supervisor
                log.warning("%s %s: clean-up after its exit failed: %s", child.kind, child.label, exc)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Two waves: every child not ``stop_last``, then the ``stop_last`` ones (each wave: SIGTERM,
        wait up to ``grace_s``, SIGKILL), so a recorder sees every record the stages wrote."""
        if self.stopping and not any(c.proc is not None and c.proc.poll() is None for c in self.children):
            return  # stopped already (expstream run may call this twice): nothing to stop, nothing new to report
        self.stopping = True
        for last in (False, True):
            self._stop_wave([c for c in self.children if c.stop_last == last], grace_s)
        for child in self.children:
            if child.retired and child.proc is not None:  # still finishing its last micro-batch when the run ended
                self._log_left(child, child.proc.returncode)
            if child.proc is not None and child.proc.returncode not in (None, 0, -signal.SIGTERM):
                log.warning("%s %s exited with code %s on stop", child.kind, child.label, child.proc.returncode)
            self._gone(child)
        self._write_pids()

    def _stop_wave(self, children: list[Child], grace_s: float) -> None:
        live = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in live:
            try:
                child.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for child in live:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s %s did not stop within %.0fs of SIGTERM; killing it", child.kind, child.label,
                            grace_s)
                child.proc.kill()
                child.proc.wait()

    def _write_pids(self) -> None:
        """``pids.json`` beside the logs: what is running now, for operators and kill tests."""
        path = self.log_dir.parent / "pids.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.pids(), sort_keys=True))
        tmp.replace(path)

    def pids(self) -> dict[str, int]:
        return {c.label: c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None}

    @property
    def total_restarts(self) -> int:
        return sum(c.restarts for c in self.children)
