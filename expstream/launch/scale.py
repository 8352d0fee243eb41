"""Live replica counts: ``expstream scale``, its request protocol, and the per-stage autoscaler.

``expstream scale --run-dir RUN reward=4 [generate=1 ...]`` talks to the ``expstream run`` that
holds ``RUN`` through files in ``RUN/run/scale/`` (no broker or Redis needed, and the run's
directory is already the one thing an operator names):

1. The command reads ``RUN/run/topology.yaml`` (the resolved topology the stages run with) and
   refuses, exit 2 naming the flag, a stage named twice, a stage that is not enabled there, a count below 1 or above
   the partitions of the stage's input topic (a replica past them would own nothing). It checks
   that a run holds ``RUN/.lock`` (expstream.launch.rundir), else exit 1: nobody would answer.
2. It writes ``req-<id>.json`` ``{"id", "counts": {stage: n}}`` atomically (a temporary file
   renamed into place: the run never reads half a request).
3. The run loop (:meth:`Scaler.tick`, every loop turn: ~0.3 s) takes requests in name order,
   checks them again against its own topology, applies them (expstream.launch.supervisor
   ``Supervisor.scale_to``), logs and records one scale event per changed stage, writes
   ``resp-<id>.json`` ``{"id", "ok", "error", "counts": {every stage: n}, "events"}`` atomically
   and deletes the request.
4. The command waits for the answer (up to :data:`ANSWER_TIMEOUT_S`), prints the new counts,
   deletes the answer and exits 0 (1 when the run refused it, ended first (its lock released) or
   did not answer; the request is then deleted so that it is not applied later by surprise).

The autoscaler (``stages.<name>.autoscale``, off by default) runs in the same tick: every
:data:`AUTOSCALE_INTERVAL_S` it reads the consumer lag of the stage's input topic for the group
``expstream.<run_id>.<stage>`` (expstream.kafka.clients.topic_lag) and asks :func:`desired_replicas`, a pure
function of (current count, lag, config, time, memory), for the count to run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expstream.config.chains import unit_of
from expstream.config.cli_args import Command
from expstream.config.topology import AutoscaleConfig, Topology
from expstream.errors import EXIT_FAILED, EXIT_OK, ConfigError

log = logging.getLogger("expstream.scale")

#: Where requests and answers live, under the run directory's ``run/``.
SCALE_DIR = "scale"
# Why 30 s: the run answers within one loop turn (~0.3 s) unless it is busy starting replicas
# (a fork takes well under a second each); 30 s is generous for a loaded machine, and a run
# that is not answering at all is reported rather than waited on forever.
ANSWER_TIMEOUT_S = 30.0
# Why 0.1 s: the command's poll for the answer; cheap (one stat), and the answer is seen at once.
ANSWER_POLL_S = 0.1
# Why 2 s: how often the autoscaler reads the lag. A lag read costs a few broker round trips; a
# stage's micro-batch takes 0.1-10 s, so the lag does not move much faster than this.
AUTOSCALE_INTERVAL_S = 2.0
MANUAL, AUTOSCALE = "manual", "autoscale"


# ---- the policy ------------------------------------------------------------------------------
@dataclass
class AutoscaleMemory:
    """What :func:`desired_replicas` remembers between calls for one stage."""

    last_change_at: float | None = None  # when the count last changed (either way, either reason)
    low_since: float | None = None  # since when the lag has asked for fewer replicas, continuously


def desired_replicas(current: int, lag: int, cfg: AutoscaleConfig, now: float, mem: AutoscaleMemory) -> int:
    """The replica count to run now (``current`` when nothing should change); updates ``mem``.

    * wanted = clamp(ceil(lag / target_lag_per_replica), min, max) (lag 0 wants ``min``);
    * up: at once to ``wanted``, unless the last change was less than ``cooldown_s`` ago;
    * down: only once the lag has wanted fewer replicas for ``cooldown_s`` without a break (the
      hysteresis: one quiet read between bursts does not stop replicas that will be needed again),
      and not within ``cooldown_s`` of the last change; then straight to ``wanted``.
    A count outside [min, max] (changed by hand) is brought back inside at once.
    """
    wanted = min(max(math.ceil(lag / cfg.target_lag_per_replica), cfg.min), cfg.max)
    if current < cfg.min or current > cfg.max:
        mem.last_change_at, mem.low_since = now, None
        return min(max(current, cfg.min), cfg.max)
    cooled = mem.last_change_at is None or now - mem.last_change_at >= cfg.cooldown_s
    if wanted >= current:
        mem.low_since = None
        if wanted > current and cooled:
            mem.last_change_at = now
            return wanted
        return current
    if mem.low_since is None:
        mem.low_since = now
    if cooled and now - mem.low_since >= cfg.cooldown_s:
        mem.last_change_at, mem.low_since = now, None
        return wanted
    return current


# ---- requests --------------------------------------------------------------------------------
def parse_counts(items: list[str]) -> dict[str, int]:
    """``["reward=4", "generate=1"]`` -> ``{"reward": 4, "generate": 1}``; ConfigError naming the item."""
    if not items:
        raise ConfigError("no stage given", field="STAGE=N", fix="name at least one, e.g. expstream scale "
                          "--run-dir RUN reward=4")
    counts: dict[str, int] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            n = int(text)
        except ValueError:
            n = None
        if not sep or not name or n is None:
            raise ConfigError(f"{item!r} is not STAGE=N", field=item, fix="write e.g. reward=4")
        name = name.strip()
        if name in counts:  # `reward=2 reward=1`: which one was meant? never pick one silently
            raise ConfigError(f"{name} is given twice ({name}={counts[name]} and {item})", field=item,
                              fix=f"name each stage once, e.g. {name}={n}")
        counts[name] = n
    return counts


def check_counts(topo: Topology, counts: dict[str, int]) -> None:
    """ConfigError naming the ``STAGE=N`` item that cannot be run (step 1 of the module docstring)."""
    stages = {u.name: topo.stages[u.head] for u in topo.units()}  # a chain scales as one unit
    partitions = topo.all_topics()
    for name, n in counts.items():
        if name not in stages:
            unit = unit_of(topo, name)
            fix = f"scale its chain: {unit.name}={n}" if unit is not None else f"name one of {', '.join(stages)}"
            raise ConfigError(f"{name}={n}: no enabled stage {name!r} in this run" if unit is None else
                              f"{name}={n}: {name} runs in the chain {unit.name}, which scales as one unit",
                              field=f"{name}={n}", fix=fix)
        limit = partitions[stages[name].input]
        if not 1 <= n <= limit:
            raise ConfigError(f"{name}={n}: a count from 1 to {limit} (the partitions of {stages[name].input!r}; "
                              "a replica past them would own nothing)", field=f"{name}={n}",
                              fix=f"give 1..{limit}; for more, start the run with a larger topics.partitions or "
                                  f"stages.{name}.autoscale.max")


def _write_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))  # key order kept: requests are applied in the order given
    os.replace(tmp, path)


def scale_dir(run_dir: Path) -> Path:
    """``<output>/run/scale``: where ``expstream scale`` leaves requests for the run in ``<output>``."""
    return Path(run_dir) / "run" / SCALE_DIR


# ---- the run side ----------------------------------------------------------------------------
class Scaler:
    """The run loop's side: answers ``expstream scale`` requests and runs the autoscalers.

    ``argv_for(stage, replica)`` is a new replica's command line; ``lag_of(stage)`` returns the
    total consumer lag of the stage's input (records), or raises (logged, the tick is skipped);
    ``reassign(stage, count)`` changes the count of a stage whose partitions are assigned by hand
    (every replica restarted with its new share; returns the count before), or returns None for a
    stage of consumer-group members, which is scaled by starting or retiring replicas
    (expstream/launch/services.py).
    """

    def __init__(self, topo: Topology, sup: Any, out_dir: Path, argv_for: Callable[[str, int], list[str]],
                 lag_of: Callable[[str], int] | None = None, started: float | None = None,
                 reassign: Callable[[str, int], int | None] | None = None) -> None:
        self.topo, self.sup, self.argv_for, self.lag_of, self.reassign = topo, sup, argv_for, lag_of, reassign
        self.dir = scale_dir(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic() if started is None else started
        self.events: list[dict[str, Any]] = []
        self.auto = {u.name: topo.stages[u.head].autoscale for u in topo.units()
                     if topo.stages[u.head].autoscale is not None}
        self.memory = {name: AutoscaleMemory() for name in self.auto}
        self.next_auto_at = time.monotonic() + AUTOSCALE_INTERVAL_S

    def counts(self) -> dict[str, int]:
        return {u.name: self.sup.replicas(u.name) for u in self.topo.units()}

    def tick(self) -> None:
        """Answer pending requests; every AUTOSCALE_INTERVAL_S, the autoscalers (never raises for a lag read)."""
        for req in sorted(self.dir.glob("req-*.json")):
            self._answer(req)
        now = time.monotonic()
        if self.auto and self.lag_of is not None and now >= self.next_auto_at:
            self.next_auto_at = now + AUTOSCALE_INTERVAL_S
            for name, cfg in self.auto.items():
                try:
                    lag = int(self.lag_of(name))
                except Exception as exc:  # noqa: BLE001 - a broker hiccup skips one read, the run goes on
                    log.warning("autoscale %s: lag not read (%s: %s); next try in %.0fs", name, type(exc).__name__,
                                exc, AUTOSCALE_INTERVAL_S)
                    continue
                current = self.sup.replicas(name)
                want = desired_replicas(current, lag, cfg, time.monotonic(), self.memory[name])
                if want != current:
                    self.apply(name, want, AUTOSCALE, lag)

    def apply(self, name: str, count: int, reason: str, lag: int | None) -> dict[str, Any] | None:
        """Scale ``name`` to ``count``; the event (logged and kept for summary.json), None when unchanged."""
        before = None
        if self.reassign is not None and count != self.sup.replicas(name):
            before = self.reassign(name, count)
        if before is None:
            before = self.sup.scale_to(name, count, lambda replica: self.argv_for(name, replica))
        if before == count:
            return None
        if reason == MANUAL and name in self.memory:  # the autoscaler's cooldown counts a hand change too
            self.memory[name].last_change_at, self.memory[name].low_since = time.monotonic(), None
        event = {"time": round(time.time(), 3), "t_s": round(time.monotonic() - self.started, 3), "stage": name,
                 "from": before, "to": count, "reason": reason, "lag": lag}
        self.events.append(event)
        log.info("scale %s: %d -> %d replicas (%s%s)", name, before, count, reason,
                 "" if lag is None else f", input lag {lag} records")
        return event

    def _answer(self, req: Path) -> None:
        try:
            body = json.loads(req.read_text())
            rid, counts = str(body["id"]), body["counts"]
            if not isinstance(counts, dict) or not all(isinstance(v, int) for v in counts.values()):
                raise ValueError("counts must map stage names to integers")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("scale request %s unreadable (%s); deleted", req, exc)
            req.unlink(missing_ok=True)
            return
        answer: dict[str, Any] = {"id": rid, "ok": True, "error": None, "events": []}
        try:
            check_counts(self.topo, counts)
            for name, n in counts.items():
                lag = None
                if self.lag_of is not None and name in self.auto:
                    try:
                        lag = int(self.lag_of(name))
                    except Exception:  # noqa: BLE001, S110 - the lag is informative here
                        pass
                event = self.apply(name, n, MANUAL, lag)
                if event:
                    answer["events"].append(event)
        except ConfigError as exc:
            answer.update(ok=False, error=str(exc))
            log.error("scale request %s refused: %s", rid, exc)
        answer["counts"] = self.counts()
        _write_atomic(self.dir / f"resp-{rid}.json", answer)
        req.unlink(missing_ok=True)


def lag_reader(topo: Topology, bootstrap: str, run_id: str) -> Callable[[str], int]:
    """``lag_of(stage)``: uncommitted records of the stage's input for its group (expstream.kafka.clients.topic_lag).

    generate of a multi-turn run (not chained: a chain has no turns runner) reads the turns topic too, as
    the group ``<generate's>.turns`` (expstream/launch/replica.py): its backlog is the sum of both, since
    a replica works through the unfinished episodes as well as the prompts (docs/multi_turn.md)."""
    from expstream.kafka.clients import topic_lag
    from expstream.kafka.topics import stage_group, turns_group

    heads = {u.name: topo.stages[u.head] for u in topo.units()}  # a chain reads as its first stage

    def lag_of(name: str) -> int:
        st = heads[name]
        total = sum(topic_lag(bootstrap, topo.kafka, stage_group(run_id, st.name), st.input, timeout_s=10.0).values())
        if name == "generate" and topo.environment is not None:
            total += sum(topic_lag(bootstrap, topo.kafka, turns_group(run_id), topo.environment.turns_topic,
                                   timeout_s=10.0).values())
        return int(total)

    return lag_of


# ---- the command -----------------------------------------------------------------------------
def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the running run's --output directory")
    p.add_argument("counts", nargs="+", metavar="STAGE=N", help="e.g. reward=4 generate=1")
    p.add_argument("--timeout", type=float, default=ANSWER_TIMEOUT_S, help="seconds to wait for the run's answer")


def scale_command(args: argparse.Namespace) -> int:
    """Steps 1, 2 and 4 of the module docstring."""
    from expstream.config.topology import load_topology
    from expstream.launch.rundir import LOCK_NAME, is_locked

    counts = parse_counts(args.counts)
    out_dir = Path(args.run_dir)
    topo_path = out_dir / "run" / "topology.yaml"
    if not topo_path.is_file():
        raise ConfigError(f"{out_dir} has no run/topology.yaml: not the --output of an expstream run",
                          field="--run-dir", fix="give the directory the run was started with --output")
    check_counts(load_topology(topo_path), counts)
    if not is_locked(out_dir / LOCK_NAME):
        print(f"expstream scale: no run holds {out_dir} (it finished or was never started); nothing to scale",
              file=sys.stderr)
        return EXIT_FAILED
    folder = scale_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rid = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
    req, resp = folder / f"req-{rid}.json", folder / f"resp-{rid}.json"
    _write_atomic(req, {"id": rid, "counts": counts})
    deadline = time.monotonic() + args.timeout
    while not resp.exists():
        ended = not is_locked(out_dir / LOCK_NAME)
        if (ended or time.monotonic() > deadline) and not resp.exists():
            req.unlink(missing_ok=True)
            why = "ended before answering" if ended else f"did not answer within {args.timeout:.0f}s"
            print(f"expstream scale: the run in {out_dir} {why}; request withdrawn", file=sys.stderr)
            return EXIT_FAILED
        time.sleep(ANSWER_POLL_S)
    answer = json.loads(resp.read_text())
    resp.unlink(missing_ok=True)
    if not answer.get("ok"):
        print(f"expstream scale: refused by the run: {answer.get('error')}", file=sys.stderr)
        return EXIT_FAILED
    changed = {e["stage"]: f"{e['from']} -> {e['to']}" for e in answer.get("events", [])}
    for name, n in answer["counts"].items():
        print(f"{name:<17} {n} replicas" + (f"  ({changed[name]})" if name in changed else ""))
    return EXIT_OK


SCALE = Command("scale", "change the replica count of stages of a running `expstream run`", add_scale_arguments,
                scale_command, reads_topology=False)
