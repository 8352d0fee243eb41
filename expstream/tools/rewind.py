"""``expstream rewind``: move a live stage's consumer group back (or forward), its replicas stopped first.

``--to`` (an offset, a time, or ``batch:<id>``) is resolved into per-partition offsets of the
stage's input topic (:func:`resolve_targets`) from the records' own timestamps, never the broker's
time index. The tool and the replicas then run a seven-step handshake through the run state: the
replicas pause in their consumer group (no rebalance), acknowledge, seek and commit the targets,
and resume. This module is the tool's side; the replica's side is in stages/rewinding.py.
Positions, the numbered handshake, and why the replicas stay in the group (measured on Tansu):
docs/replay.md "Rewind".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kafka import TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import OffsetSpec
from kafka.structs import OffsetAndMetadata

from expstream.config.chains import unit_of
from expstream.config.cli_args import Command, add_topology_args
from expstream.config.kafka import KafkaConfig
from expstream.config.topology import Topology, load_topology
from expstream.errors import EXIT_FAILED, EXIT_OK, ConfigError, ExpstreamError
from expstream.kafka.clients import end_offsets, make_admin, make_consumer
from expstream.kafka.topics import TURNS_GROUP_SUFFIX, stage_group, turns_group
from expstream.tools.recorder import Position, parse_position
from expstream.tools.recording import PartitionReader, partition_path, recorded_partitions, recorded_topics
from schemas.codec import peek_header

log = logging.getLogger("expstream.rewind")

# Why 10 s: a replica heartbeats every 2 s (stages/runner.py HEARTBEAT_INTERVAL_S); five missed beats
# mean it is gone (killed, or its host away), so the rewind does not wait for its acknowledgement.
LIVE_HEARTBEAT_S = 10.0
# Why 120 s: a replica acknowledges after the micro-batch in hand, and a generation can take a minute
# or more; --timeout changes it.
DEFAULT_TIMEOUT_S = 120.0
# Why 15 s: the request's time to live, refreshed every round (ROUND_S), so that replicas go back
# to work within 15 s of a rewind tool that died half way.
REQUEST_TTL_S = 15.0
# Why 0.25 s: how often the tool looks at acknowledgements and retries the commit; half the replicas'
# check interval, so the tool adds little to the handshake.
ROUND_S = 0.25
# Why 30 s: scanning a topic for timestamps and batch ids (no recording) gives up after this long.
SCAN_TIMEOUT_S = 30.0

_OFFSETS_RE = re.compile(r"^\d+:\d+(,\d+:\d+)*$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One record of the input topic, as the plan needs it."""

    offset: int
    timestamp: int  # ms since the epoch (the record's own timestamp)
    batch_id: str | None  # peeked from the msgpack header (None: unreadable)


@dataclasses.dataclass
class PartitionPlan:
    """What a rewind does to one partition of the input topic."""

    partition: int
    target: int  # the offset committed for the group
    current: int  # where the group would fetch now (committed, else auto_offset_reset's choice)
    committed: bool  # False: no commit yet, ``current`` is the reset position
    end: int  # the high watermark when resolved
    entries: list[Entry]  # records between target and current (either direction)

    @property
    def records(self) -> int:
        """Records reprocessed (> 0, a rewind) or skipped (< 0, a move forward)."""
        return self.current - self.target

    def line(self, topic: str) -> str:
        where = f"{topic}[{self.partition}]"
        src = f"{self.current}{'' if self.committed else ' (no commit yet)'}"
        if self.records == 0:
            return f"  {where}: {src} -> {self.target}: unchanged"
        ids = [e.batch_id or "?" for e in self.entries]
        span = f"batches {ids[0]} .. {ids[-1]}" if ids else "batch ids not read"
        verb = "reprocessed" if self.records > 0 else "SKIPPED (moving forward)"
        return f"  {where}: {src} -> {self.target} (end {self.end}): {abs(self.records)} record(s) {verb}, {span}"


# --- positions ---------------------------------------------------------------------------------
def parse_rewind_position(text: str) -> Position:
    """``--to``: ``123`` | ``0:12,1:40`` | ISO 8601 time with a zone | ``@epoch_ms`` | ``batch:<id>``
    (expstream/tools/recorder.py's grammar)."""
    return parse_position(text, "--to")


def _first_at_or_after(entries: list[Entry], time_ms: int, end: int) -> int:
    for e in entries:
        if e.timestamp >= time_ms:
            return e.offset
    return end


def resolve_targets(pos: Position, index: dict[int, list[Entry]], starts: dict[int, int],
                    ends: dict[int, int], topic: str = "input") -> dict[int, int]:
    """Per-partition target offsets for ``pos``: only the partitions that move (pure; no Kafka).

    ``index``: each partition's records in offset order (timestamps, batch ids); ``starts``/``ends``:
    the first offset still held and the high watermark of every partition of ``topic``.
    """
    parts = sorted(ends)
    if pos.kind == "offset":
        wanted = {p: pos.offset for p in parts} if pos.offset is not None else dict(pos.offsets or {})
        for p, off in wanted.items():
            if p not in ends:
                raise ConfigError(f"--to {pos.text}: {topic} has no partition {p} (partitions: "
                                  f"{', '.join(map(str, parts))})", field="--to", fix="name an existing partition")
            if not starts[p] <= off <= ends[p]:
                raise ConfigError(f"--to {pos.text}: offset {off} is outside {topic}[{p}], which holds "
                                  f"{starts[p]}..{ends[p]} (end {ends[p]} = after the last record)", field="--to",
                                  fix=f"choose an offset between {starts[p]} and {ends[p]}")
        return wanted
    if pos.kind == "time":
        return {p: _first_at_or_after(index.get(p, []), pos.time_ms, ends[p]) for p in parts}
    hits = [(e.offset, p, e) for p in parts for e in index.get(p, []) if e.batch_id == pos.batch_id]
    if not hits:
        raise ConfigError(f"--to {pos.text}: no record of {topic} carries batch id {pos.batch_id!r}", field="--to",
                          fix=f"give a batch id of the stage's input topic ({topic}): `expstream topics tail {topic}` "
                              "lists them; sub-batches look like p000003/m0")
    first = min(hits, key=lambda h: (h[2].timestamp, h[1], h[0]))
    targets = {p: _first_at_or_after(index.get(p, []), first[2].timestamp, ends[p]) for p in parts}
    targets[first[1]] = first[0]
    return targets


# --- reading the input topic -------------------------------------------------------------------
def index_from_recording(run_dir: str | Path, topic: str) -> dict[int, list[Entry]]:
    """Every recorded record of ``topic`` (offset order per partition); {} when it was not recorded."""
    if topic not in recorded_topics(run_dir):
        return {}
    out: dict[int, list[Entry]] = {}
    for p in recorded_partitions(run_dir, topic):
        reader = PartitionReader(partition_path(run_dir, topic, p), topic, p, strict=False)
        out[p] = [Entry(f.offset, f.timestamp, peek_header(f.value)[2] if f.value else None) for f in reader]
        if reader.damage is not None:  # a torn or corrupt end: the positions before it still hold
            log.warning("rewind: %s; using the %d record(s) before it", reader.damage.message(), len(out[p]))
    return out


def scan_topic(bootstrap: str, cfg: KafkaConfig, topic: str, ranges: dict[int, tuple[int, int]],
               timeout_s: float = SCAN_TIMEOUT_S) -> dict[int, list[Entry]]:
    """Records of ``topic`` in ``ranges`` (partition -> [start, end)), read without a group."""
    todo = {p: r for p, r in ranges.items() if r[0] < r[1]}
    out: dict[int, list[Entry]] = {p: [] for p in ranges}
    if not todo:
        return out
    consumer = make_consumer(bootstrap, None, cfg, max_poll_records=500)
    try:
        tps = {p: TopicPartition(topic, p) for p in todo}
        consumer.assign(list(tps.values()))
        for p, (start, _) in todo.items():
            consumer.seek(tps[p], start)
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tps[p]) < todo[p][1] for p in todo):
            if time.monotonic() > deadline:
                raise ExpstreamError(f"scanning {topic} for timestamps and batch ids took over {timeout_s:.0f}s; "
                                     "give --run-dir (its recording) or an offset")
            for tp, recs in consumer.poll(timeout_ms=200).items():
                end = todo[tp.partition][1]
                out[tp.partition].extend(Entry(r.offset, r.timestamp, peek_header(r.value)[2] if r.value else None)
                                         for r in recs if r.offset < end)
    finally:
        consumer.close(autocommit=False)
    return out


@dataclasses.dataclass
class TopicView:
    """The input topic as the rewind sees it: bounds, records (from the recording, then the broker)."""

    topic: str
    starts: dict[int, int]
    ends: dict[int, int]
    index: dict[int, list[Entry]]
    recorded: dict[int, int]  # partition -> records taken from the recording


def view_topic(bootstrap: str, cfg: KafkaConfig, topic: str, run_dir: str | Path | None) -> TopicView:
    admin = make_admin(bootstrap, cfg)
    try:
        desc = admin.describe_topics([topic])
        if not desc or desc[0].get("error_code", 0) != 0:
            raise ConfigError(f"topic {topic!r} (the stage's input) does not exist on {bootstrap}",
                              field="--bootstrap-servers", fix="point at the run's broker")
        tps = [TopicPartition(topic, p["partition_index"]) for p in desc[0]["partitions"]]
        starts = {tp.partition: o.offset for tp, o in
                  admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps}).items()}
    finally:
        admin.close()
    ends = {tp.partition: off for tp, off in end_offsets(bootstrap, cfg, tps).items()}
    index = index_from_recording(run_dir, topic) if run_dir is not None else {}
    recorded = {p: len(v) for p, v in index.items()}
    ranges = {}
    for p in ends:
        have = [e for e in index.get(p, []) if starts[p] <= e.offset < ends[p]]
        index[p] = have
        ranges[p] = (max(starts[p], have[-1].offset + 1) if have else starts[p], ends[p])
    for p, entries in scan_topic(bootstrap, cfg, topic, ranges).items():
        index[p].extend(entries)
    return TopicView(topic, starts, ends, index, recorded)


# --- the group ---------------------------------------------------------------------------------
def group_id_of(run_id: str, stage: str) -> str:
    """The consumer group of a stage (expstream/kafka/topics.py stage_group)."""
    return stage_group(run_id, stage)


def committed_offsets(admin: Any, group: str, topic: str, partitions: list[int]) -> dict[int, int | None]:
    tps = [TopicPartition(topic, p) for p in partitions]
    try:
        got = admin.list_group_offsets({group: tps}).get(group, {})
    except kafka_errors.BrokerResponseError:  # e.g. GroupIdNotFound: nothing committed yet
        got = {}
    out: dict[int, int | None] = {}
    for tp in tps:
        c = got.get(tp)
        out[tp.partition] = c.offset if c is not None and c.offset is not None and c.offset >= 0 else None
    return out


def make_plan(view: TopicView, targets: dict[int, int], committed: dict[int, int | None],
              cfg: KafkaConfig) -> list[PartitionPlan]:
    plans = []
    for p in sorted(view.ends):
        c = committed.get(p)
        current = c if c is not None else (view.starts[p] if cfg.auto_offset_reset == "earliest" else view.ends[p])
        target = targets.get(p, current)
        lo, hi = sorted((target, current))
        plans.append(PartitionPlan(p, target, current, c is not None, view.ends[p],
                                   [e for e in view.index.get(p, []) if lo <= e.offset < hi]))
    return plans


@dataclasses.dataclass(frozen=True)
class Move:
    """One consumer group a rewind moves: its topic and the partitions' target offsets."""

    group: str
    topic: str
    targets: dict[int, int]


def position_time(pos: Position, view: TopicView) -> int | None:
    """The moment ``pos`` names on the input topic: a time as given, a batch id's earliest record's
    timestamp; None for offsets (they name positions of that topic alone)."""
    if pos.kind == "time":
        return pos.time_ms
    if pos.kind == "batch":
        stamps = [e.timestamp for entries in view.index.values() for e in entries if e.batch_id == pos.batch_id]
        return min(stamps) if stamps else None
    return None


def turns_targets(time_ms: int | None, view: TopicView, committed: dict[int, int | None],
                  cfg: KafkaConfig) -> tuple[dict[int, int], list[int]]:
    """generate's turns group in a multi-turn run (docs/multi_turn.md "Rewinding generate"): back to the first
    turn record at or after ``time_ms`` (pure; no Kafka). Never forward: a skipped turn record is an episode
    that never finishes (its group neither arrives nor is counted lost). Returns (targets, partitions held
    back from moving forward)."""
    if time_ms is None:
        return {}, []
    targets, held = {}, []
    for p in sorted(view.ends):
        c = committed.get(p)
        current = c if c is not None else (view.starts[p] if cfg.auto_offset_reset == "earliest" else view.ends[p])
        target = _first_at_or_after(view.index.get(p, []), time_ms, view.ends[p])
        if target < current:
            targets[p] = target
        elif target > current:
            held.append(p)
    return targets, held


def commit_when_empty(admin: Any, group: str, topic: str, targets: dict[int, int], deadline: float,
                      refresh: Any) -> None:
    """Step 5 without live replicas: commit ``targets`` for ``group`` from outside; the broker refuses it
    (UNKNOWN_MEMBER_ID) while a member is left, so refusals are retried until ``deadline``."""
    offsets = {TopicPartition(topic, p): OffsetAndMetadata(o, "", -1) for p, o in targets.items()}
    while True:
        errors = {tp: err for tp, err in admin.alter_group_offsets(group, offsets).items()
                  if err is not kafka_errors.NoError}
        if not errors:
            return
        if time.monotonic() > deadline:
            raise RewindAborted(f"the broker still refuses the commit for group {group}: "
                                f"{ {tp.partition: e.__name__ for tp, e in errors.items()} } (a member that is not a "
                                "stage replica of this run, e.g. a stray consumer, is still in the group?)")
        refresh()
        time.sleep(ROUND_S)


class RewindAborted(ExpstreamError):
    """The handshake did not complete in time (``moved``: some partitions were moved already)."""

    retriable = False

    def __init__(self, message: str, *, moved: bool = False) -> None:
        super().__init__(message)
        self.moved = moved


# --- the command -------------------------------------------------------------------------------
def _services(run_dir: Path | None) -> dict:
    if run_dir is None:
        return {}
    try:
        return json.loads((run_dir / "run" / "services.json").read_text())
    except (OSError, ValueError):
        return {}


def _topology(topo: Topology, args: argparse.Namespace, run_dir: Path | None) -> Topology:
    if run_dir is None or args.topology:
        return topo
    for path in (run_dir / "topology.yaml", run_dir / "run" / "topology.yaml"):
        if path.is_file():
            return load_topology(path, args.overrides)
    return topo


def rewind_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream rewind``: steps 1-7 of the module docstring."""
    from expstream.state import RedisState

    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is not None and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is not a directory", field="--run-dir", fix="give runs/<name>")
    services = _services(run_dir)
    topo = _topology(topo, args, run_dir)
    run_id = args.run_id or services.get("run_id")
    if not run_id:
        raise ConfigError("no run id", field="--run-id", fix="give --run-id (the run's `--run-id`, see "
                          "<run>/run/services.json)")
    if services.get("run_id") and services["run_id"] != run_id:
        raise ConfigError(f"--run-id {run_id} but {run_dir} recorded run {services['run_id']}", field="--run-id",
                          fix="give the matching --run-dir, or the run id of that directory")
    bootstrap = args.bootstrap_servers or services.get("bootstrap_servers")
    if not bootstrap:
        raise ConfigError("no broker to talk to", field="--bootstrap-servers", fix="give --bootstrap-servers HOST:PORT")
    redis_url = args.redis_url or (services.get("redis_url") if "***" not in services.get("redis_url", "***") else None)
    if not redis_url:
        raise ConfigError("no Redis URL for the run state", field="--redis-url",
                          fix="give --redis-url or set $EXPSTREAM_REDIS_URL")
    stage = topo.stages.get(args.stage)
    unit = unit_of(topo, args.stage)
    if unit is not None and unit.chained and args.stage != unit.head:  # docs/replay.md "Chained stages"
        if args.stage != unit.name:
            raise ConfigError(f"stage {args.stage} runs inside the chain {unit.name}: it reads no topic, and the "
                              "chain moves as one unit", field="--stage",
                              fix=f"rewind the chain's input: --stage {unit.head} (or --stage {unit.name})")
        stage = topo.stages[unit.head]
    if stage is None or not stage.enabled:
        raise ConfigError(f"unknown or disabled stage {args.stage!r}", field="--stage",
                          fix=f"one of {', '.join(n for n, s in topo.stages.items() if s.enabled)}")
    pos = parse_rewind_position(args.to)
    cfg, topic, group = topo.kafka, stage.input, group_id_of(run_id, stage.name)
    # generate of a multi-turn run reads the turns topic too, as a second group (docs/multi_turn.md)
    multi_turn = stage.name == "generate" and topo.environment is not None and not (unit and unit.chained)

    view = view_topic(bootstrap, cfg, topic, run_dir)
    targets = resolve_targets(pos, view.index, view.starts, view.ends, topic)
    admin = make_admin(bootstrap, cfg)
    try:
        plan = make_plan(view, targets, committed_offsets(admin, group, topic, sorted(view.ends)), cfg)
        print(f"rewind stage {stage.name} (group {group}, input topic {topic}) to {pos.text}:")
        if view.recorded:
            print(f"  (timestamps and batch ids: {sum(view.recorded.values())} records from {run_dir}'s recording, "
                  "the rest read from the topic)")
        for pp in plan:
            print(pp.line(topic))
        moves = [(Move(group, topic, targets), view)] + (plan_turns(admin, bootstrap, topo, run_id, pos, view, run_dir)
                                                         if multi_turn else [])
        note = rewind_note(topo, stage.name)
        if note:
            print(note)
        if args.dry_run:
            print("dry run: nothing changed")
            return EXIT_OK
        if not confirmed(args):
            print("not rewound")
            return EXIT_OK
        state = RedisState(redis_url, run_id)
        try:
            before = handshake(state, admin, stage.name, [m for m, _ in moves], args.timeout,
                               ("", TURNS_GROUP_SUFFIX) if multi_turn else ("",))
        except RewindAborted as exc:
            print(f"expstream rewind: aborted, {'PARTLY MOVED' if exc.moved else 'nothing changed'}: {exc}",
                  file=sys.stderr)
            return EXIT_FAILED
        finally:
            state.close()
        print(f"rewound {stage.name}: offsets committed; the replicas resume and reprocess from there:")
        for m, v in moves:
            for pp in make_plan(v, m.targets, before[m.topic], cfg):
                print(pp.line(m.topic))
        return EXIT_OK
    finally:
        admin.close()


def confirmed(args: argparse.Namespace) -> bool:
    """``--yes``, or the operator's answer on a terminal (none: a ConfigError naming --yes)."""
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise ConfigError("rewind moves a live consumer group and asks first", field="--yes",
                          fix="pass --yes to proceed without a prompt (or --dry-run to only look)")
    return input("stop the stage's replicas and move the offsets? [y/N] ").strip().lower() in ("y", "yes")


def plan_turns(admin: Any, bootstrap: str, topo: Topology, run_id: str, pos: Position, view: TopicView,
               run_dir: Path | None) -> list[tuple[Move, TopicView]]:
    """generate's turns group in a multi-turn run: its plan printed, its move (none when it stays)."""
    assert topo.environment is not None, "a multi-turn run's generate"
    cfg, group, topic = topo.kafka, turns_group(run_id), topo.environment.turns_topic
    tview = view_topic(bootstrap, cfg, topic, run_dir)
    committed = committed_offsets(admin, group, topic, sorted(tview.ends))
    targets, held = turns_targets(position_time(pos, view), tview, committed, cfg)
    print(f"  and generate's turns group {group} (topic {topic}):")
    if pos.kind == "offset":
        print(f"  {topic}: unchanged (offsets name {view.topic}'s records; give a time or batch:<id> to move the turns "
              "group to the same moment; the episodes of the rewound prompts start again from their first turn "
              "either way)")
        return []
    for pp in make_plan(tview, targets, committed, cfg):
        print(pp.line(topic))
    for p in held:
        print(f"  {topic}[{p}]: not moved forward (skipping turn records would drop episodes in flight)")
    return [(Move(group, topic, targets), tview)] if targets else []


def rewind_note(topo: Topology, stage: str) -> str | None:
    """What a rewind of ``stage`` means beyond reprocessing, for the plan (None: nothing to add)."""
    from expstream.rl.admission import backpressure_on

    if stage == "generate" and backpressure_on(topo):
        from expstream.state.base import ADMISSION_WINDOWS

        horizon = (ADMISSION_WINDOWS - 1) * topo.redis.dedupe_window_s
        return ("  note: the continuous loop's generate: records already committed are regenerated with the current "
                "weights but not admitted again (their samples were counted when first admitted); their sample ids are "
                "trained already, so advantage and the trainer drop the copies (docs/replay.md \"Rewind\"). Records "
                f"committed more than {horizon} s ago (the admission ledger's horizon, {ADMISSION_WINDOWS - 1} x "
                "redis.dedupe_window_s) may be forgotten: they are admitted and counted as new work, and trained as new "
                "work once the trainer no longer keeps their ids (docs/async.md \"The trainer's dedupe horizon\")")
    return None


def live_replicas(state: Any, stage: str, now: float | None = None) -> set[str]:
    """Replicas of ``stage`` with a heartbeat younger than LIVE_HEARTBEAT_S."""
    now = time.time() if now is None else now
    return {r for (s, r), t in state.heartbeats().items() if s == stage and now - t < LIVE_HEARTBEAT_S}


def move_request(request: str, moves: list[Move]) -> str:
    """The ``move`` step's request text: ``<id>/move/<topic>/<p:offset,...>[/<topic>/<p:offset,...>]``
    (stages/rewinding.py parses it; a topic name holds no ``/``). The topic tells a replica's runners
    apart: generate of a multi-turn run has one per topic, and each moves only its own."""
    return f"{request}/move/" + "/".join(
        f"{m.topic}/" + ",".join(f"{p}:{o}" for p, o in sorted(m.targets.items())) for m in moves)


def handshake(state: Any, admin: Any, stage: str, moves: list[Move], timeout_s: float,
              ack_suffixes: tuple[str, ...] = ("",)) -> dict[str, dict[int, int | None]]:
    """Steps 2-7; returns per topic the offsets its group had committed when paused (before the move).
    ``ack_suffixes``: every live replica acknowledges under its heartbeat name plus each of them (generate
    of a multi-turn run: ``""`` and ``.turns``, its two runners)."""
    request = uuid.uuid4().hex[:12]
    deadline = time.monotonic() + timeout_s
    current = [request]

    def refresh() -> None:
        state.set_rewind_request(stage, current[0], REQUEST_TTL_S)

    def wait_acks(step: str) -> set[str]:
        while True:
            live = {r + suffix for r in live_replicas(state, stage) for suffix in ack_suffixes}
            acked = state.rewind_acks(stage, current[0])
            if not live - acked:
                return acked & live
            if time.monotonic() > deadline:
                raise RewindAborted(f"replica(s) {', '.join(sorted(live - acked))} of stage {stage} did not "
                                    f"acknowledge the {step} step within {timeout_s:.0f}s (acknowledged: "
                                    f"{', '.join(sorted(acked & live)) or 'none'}); a micro-batch still in hand "
                                    "(raise --timeout) or a replica from before this version")
            refresh()
            time.sleep(ROUND_S)

    refresh()
    log.info("rewind %s: request %s set; waiting for the replicas to pause", stage, request)
    try:
        paused = wait_acks("pause")
        log.info("rewind %s: paused by %s", stage, ", ".join(sorted(paused)) or "no live replica")
        before = {m.topic: committed_offsets(admin, m.group, m.topic, sorted(m.targets)) for m in moves}
        current[0] = move_request(request, moves)
        refresh()
        moved = wait_acks("move")
        for m in moves:
            if not moved:  # no live replica: nobody in the group, so commit from outside
                commit_when_empty(admin, m.group, m.topic, m.targets, deadline, refresh)
            while (now := committed_offsets(admin, m.group, m.topic, sorted(m.targets))) != m.targets:
                # a partition no live replica owned (a member that is not ours, or one still joining)
                if time.monotonic() > deadline:
                    raise RewindAborted(f"the replicas moved {m.topic} partially: committed now "
                                        f"{ {p: o for p, o in now.items()} }, wanted {m.targets}; partitions not "
                                        "yet at their target were not owned by a live replica", moved=True)
                refresh()
                time.sleep(ROUND_S)
            log.info("rewind %s: committed %s for group %s", stage,
                     ", ".join(f"{m.topic}[{p}]@{o}" for p, o in sorted(m.targets.items())), m.group)
        return before
    finally:
        state.clear_rewind_request(stage)


def add_rewind_arguments(p: argparse.ArgumentParser) -> None:
    """The ``rewind`` subcommand's arguments."""
    add_topology_args(p)
    p.add_argument("--stage", required=True, help="the stage to rewind, e.g. reward")
    p.add_argument("--to", required=True, metavar="POS",
                   help="123 | 0:12,1:40 | 2026-11-24T10:00:00Z | @epoch_ms | batch:<batch id> (of the stage's input)")
    p.add_argument("--run-id", help="the run (consumer groups, Redis keys); default: --run-dir's services.json")
    p.add_argument("--run-dir", help="the run directory: its recording gives timestamps and batch ids, its "
                                     "topology.yaml the topics, its services.json the broker and run id")
    p.add_argument("--dry-run", action="store_true", help="print what would be reprocessed; change nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for the replicas to leave the group (default {DEFAULT_TIMEOUT_S:.0f})")


REWIND = Command("rewind", "move a live stage's consumer group to an offset, time or batch id "
                           "(its replicas paused safely first)", add_rewind_arguments, rewind_command,
                 reads_topology=True)
