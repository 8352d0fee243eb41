"""The recorder: what crosses the topics, copied into a run directory's recording while it flows.

``expstream run`` starts it as the supervised process ``recorder`` (when ``record`` is on, see
``expstream.config.topology.RecordConfig.is_on``) and stops it after the stages; ``expstream record``
runs the same :class:`Recorder` against a live deployment. Both write
``<output>/topics/<topic>/partition-<p>.rec`` in the format of expstream/tools/recording.py
(schemas/README.md section 10). :meth:`Recorder.run`: refuse to mix two sources (``--continue``
is checked against ``topics/source.json`` and the broker's last recorded record), find the
partitions, start after what is recorded, poll without a group, append frames and flush after
every poll, drain to the end offsets on a stop. Times are applied to the records' own timestamps,
never the broker's ``offsets_for_times`` (wrong on the embedded Tansu). Details: docs/replay.md
"Recording".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaError

from expstream.config.cli_args import Command, add_topology_args
from expstream.config.kafka import KafkaConfig
from expstream.errors import EXIT_OK, BrokerUnavailableError, ConfigError
from expstream.kafka.clients import end_offsets, make_consumer
from expstream.tools.recording import (
    MAGIC,
    TOPICS_DIR,
    PartitionReader,
    RecordFrame,
    RecordingError,
    RecordingWriter,
    partition_path,
    recorded_partitions,
    recorded_topics,
)

__all__ = ["Position", "parse_position", "Recorder", "RecordStats", "record_topics", "SOURCE_FILE",
           "recorder_argv", "recording_summary", "add_record_arguments", "record_command", "RECORDER"]

log = logging.getLogger("expstream.recorder")

#: The supervised recorder's name in `expstream run` (its log: run/logs/recorder-0.log).
RECORDER = "recorder"
# Why 200 ms: a poll returns as soon as records arrive; the timeout only bounds how late a stop
# request or a drained partition is noticed. Flushing once per poll keeps the syscalls per batch.
POLL_MS = 200
# Why 500: a fetch of up to 500 records is one write per file; records are micro-batches (KBs).
MAX_POLL_RECORDS = 500
# Why 15 s: after SIGTERM the stages are already stopped (the recorder stops last), so what is left
# is at most a poll's worth of fetches; 15 s covers a slow broker and stays under the supervisor's
# 20 s SIGKILL grace (STOP_GRACE_S), so the files are closed by us, not cut by a kill.
DRAIN_DEADLINE_S = 15.0
# Why 2 s: a topic missing in follow mode is looked for again this often (a deployment creating it).
MISSING_TOPIC_RETRY_S = 2.0
# How long export mode waits for the broker's metadata and end offsets.
METADATA_TIMEOUT_S = 30.0
#: ``<output>/topics/source.json``: where a recording was started from (step 0 of the module doc).
SOURCE_FILE = "source.json"

_PER_PARTITION = re.compile(r"^\d+:\d+(,\d+:\d+)*$")


# ------------------------------------------------------------------------------------------------
# positions on the command line
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """A place in a topic, as ``--from`` / ``--to`` give it (see :func:`parse_position`)."""

    kind: str  # "offset" | "time" | "batch"
    text: str  # what was typed, for messages
    offset: int | None = None  # kind offset: the same offset in every partition
    offsets: dict[int, int] | None = None  # kind offset: per partition (partitions not named: unbounded)
    time_ms: int | None = None  # kind time: ms since the epoch
    batch_id: str | None = None  # kind batch: a batch id (expstream rewind)

    def offset_for(self, partition: int) -> int | None:
        """The offset this position names in ``partition`` (None: not an offset, or not named)."""
        if self.kind != "offset":
            return None
        if self.offsets is not None:
            return self.offsets.get(int(partition))
        return self.offset


POSITION_FIX = ("an offset (123), offsets per partition (0:12,1:40), an ISO 8601 time with a zone "
                "(2026-11-24T10:00:00Z), epoch milliseconds (@1700000000000) or a batch id (batch:p000003)")


def parse_position(text: str, flag: str = "--from") -> Position:
    """``123`` | ``0:12,1:40`` | ``2026-11-24T10:00:00Z`` | ``@1700000000000`` | ``batch:p000003``.

    A time needs a zone (``Z`` or ``+01:00``): a zoneless time would depend on the machine's. Bad
    text is a ConfigError naming ``flag``.
    """
    raw = text
    text = (text or "").strip()
    if not text:
        raise ConfigError("empty position", field=flag, fix=f"give {POSITION_FIX}")
    if text.startswith("batch:"):
        batch = text[len("batch:"):]
        if not batch:
            raise ConfigError(f"{raw!r} names no batch id", field=flag, fix="e.g. batch:p000003")
        return Position("batch", raw, batch_id=batch)
    if text.isdigit():
        return Position("offset", raw, offset=int(text))
    if _PER_PARTITION.match(text):
        offsets: dict[int, int] = {}
        for item in text.split(","):
            p, _, o = item.partition(":")
            if int(p) in offsets:
                raise ConfigError(f"{raw!r} names partition {p} twice", field=flag, fix="name each partition once")
            offsets[int(p)] = int(o)
        return Position("offset", raw, offsets=offsets)
    if text.startswith("@"):
        if not text[1:].isdigit():
            raise ConfigError(f"{raw!r}: after @ come epoch milliseconds", field=flag, fix="e.g. @1700000000000")
        return Position("time", raw, time_ms=int(text[1:]))
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise ConfigError(f"cannot read {raw!r} as a position", field=flag, fix=f"give {POSITION_FIX}") from None
    if when.tzinfo is None:
        raise ConfigError(f"{raw!r} has no time zone", field=flag,
                          fix=f"add one: {text}Z for UTC, or {text}+01:00")
    return Position("time", raw, time_ms=int(round(when.timestamp() * 1000)))


# ------------------------------------------------------------------------------------------------
# the recorder
# ------------------------------------------------------------------------------------------------


def cut_torn_tail(path: Path, topic: str, partition: int) -> int:
    """Cut an incomplete last frame (a recorder killed mid-write) off ``path`` before appending to
    it again, so that new frames never follow a torn one (which readers would call corruption).
    Returns the bytes cut; a corrupt file raises RecordingError (naming the file and byte position)."""
    reader = PartitionReader(path, topic, partition)
    for _ in reader:  # validates: raises on corruption, says where a torn tail starts
        pass
    if reader.damage is None:
        return 0
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(reader.damage.position)
    log.warning("recorder: %s[%d]: cut a torn last frame (%d bytes at byte %d) off %s before appending", topic,
                partition, size - reader.damage.position, reader.damage.position, path)
    return size - reader.damage.position


@dataclass
class RecordStats:
    """What one :meth:`Recorder.run` recorded."""

    records: dict[str, int] = field(default_factory=dict)  # topic -> frames written
    skipped: int = 0  # records already in the recording (a restart), not written again
    filtered: int = 0  # records outside the --from/--to times
    drained: bool = True  # False: the drain deadline passed before the end offsets were reached


class Recorder:
    """Copies ``topics`` into the recording under ``root`` (a run directory); see the module doc.

    ``start`` / ``end``: a :class:`Position` applied to every topic, or a mapping
    ``(topic, partition) -> offset``; None: the beginning / no bound. ``follow``: keep recording until
    :meth:`request_stop` (SIGTERM in the CLI), else stop at the end offsets taken at start.
    ``continue_recording``: append to a recording ``root`` already holds, once it is checked to be of
    this source (step 0); ``run_id``: the run this recorder belongs to (kept in ``topics/source.json``).
    """

    def __init__(self, bootstrap: str, kafka_config: KafkaConfig | None, topics: Iterable[str], root: str | Path,
                 start: Position | Mapping[tuple[str, int], int] | None = None,
                 end: Position | Mapping[tuple[str, int], int] | None = None, *, follow: bool = False,
                 continue_recording: bool = False, run_id: str | None = None, max_bytes: int | None = None,
                 max_age_s: float | None = None) -> None:
        self.bootstrap, self.cfg = bootstrap, kafka_config or KafkaConfig()
        self.topics = list(dict.fromkeys(topics))
        if not self.topics:
            raise ConfigError("no topics to record", field="--topics", fix="e.g. --topics rollouts,scored")
        for pos, flag in ((start, "--from"), (end, "--to")):
            if isinstance(pos, Position) and pos.kind == "batch":
                raise ConfigError(f"{pos.text!r}: a batch id is a rewind target, not a recording bound", field=flag,
                                  fix="give an offset or a time")
        self.root = Path(root)
        self.start, self.end, self.follow = start, end, follow
        self.continue_recording, self.run_id = continue_recording, run_id
        self.max_bytes, self.max_age_s = max_bytes, max_age_s  # record.max_bytes / max_age_s (retention.py)
        self._stop = threading.Event()
        self.stats = RecordStats()

    def request_stop(self) -> None:
        """Drain up to the end offsets of this moment, then return from :meth:`run` (thread/signal safe)."""
        self._stop.set()

    # -- steps 1-3 ------------------------------------------------------------------------------
    def _partitions(self, consumer: Any) -> list[TopicPartition]:
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        missing = list(self.topics)
        tps: list[TopicPartition] = []
        warned: set[str] = set()
        while True:
            existing = consumer.topics()
            for topic in list(missing):
                parts = consumer.partitions_for_topic(topic) if topic in existing else None
                if parts:
                    tps += [TopicPartition(topic, p) for p in sorted(parts)]
                    missing.remove(topic)
            if not missing:
                return tps
            if not self.follow:
                if time.monotonic() > deadline or not all(t in existing for t in missing):
                    raise ConfigError(f"topic(s) {', '.join(missing)} not on the broker {self.bootstrap}",
                                      field="--topics", fix="name existing topics (`expstream topics list` shows "
                                                            "them), or add --follow to wait for them")
                time.sleep(0.05)
                continue
            for topic in set(missing) - warned:
                log.warning("recorder: topic %s not on the broker yet; looking again every %.0fs", topic,
                            MISSING_TOPIC_RETRY_S)
                warned.add(topic)
            if self._stop.wait(MISSING_TOPIC_RETRY_S):
                return tps

    @staticmethod
    def _bound(pos: Position | Mapping[tuple[str, int], int] | None, tp: TopicPartition) -> int | None:
        if pos is None:
            return None
        if isinstance(pos, Position):
            return pos.offset_for(tp.partition)
        return pos.get((tp.topic, tp.partition))

    def _time(self, pos: Any) -> int | None:
        return pos.time_ms if isinstance(pos, Position) and pos.kind == "time" else None

    # -- step 0 ---------------------------------------------------------------------------------
    def _source(self) -> dict[str, Any]:
        try:
            got = json.loads((self.root / TOPICS_DIR / SOURCE_FILE).read_text())
            return got if isinstance(got, dict) else {}
        except (OSError, ValueError):
            return {}

    def _held(self) -> dict[str, int]:
        """Topic -> partition files of the recording ``root`` already holds (empty: nothing recorded)."""
        return {t: len(recorded_partitions(self.root, t)) for t in recorded_topics(self.root)
                if recorded_partitions(self.root, t)}

    def _refuse_other_recording(self) -> None:
        """Step 0 before the broker is asked: a recording here, and no --continue (or another run id)."""
        held = self._held()
        if not held:
            return
        src = self._source()
        whose = (f"run {src.get('run_id') or '?'} from {src.get('bootstrap') or '?'}, started {src.get('started') or '?'}"
                 if src else f"no {SOURCE_FILE}: made before recordings named their source")
        what = ", ".join(f"{t} ({n} partition file(s))" for t, n in sorted(held.items()))
        if not self.continue_recording:
            raise ConfigError(f"{self.root} already holds a recording ({what}; {whose}); appending another run's "
                              "records to it would mix two runs", field="--output",
                              fix="give a new or empty --output, or pass --continue to append to it (only the same "
                                  "source is accepted: checked record by record)")
        if src.get("run_id") and self.run_id and src["run_id"] != self.run_id:
            raise ConfigError(f"--continue: {self.root} holds the recording of run {src['run_id']}, not of run "
                              f"{self.run_id} ({what})", field="--output",
                              fix="give a new or empty --output for this run, or the --run-id of that recording")

    def _check_same_source(self, tps: list[TopicPartition]) -> None:
        """Step 0 against the broker: the last recorded record of each partition is still there, the same."""
        last: dict[TopicPartition, RecordFrame] = {}
        for tp in tps:
            path = partition_path(self.root, tp.topic, tp.partition)
            if path.exists():
                for frame in PartitionReader(path, tp.topic, tp.partition):
                    last[tp] = frame
        if not last:
            return
        ends = end_offsets(self.bootstrap, self.cfg, sorted(last), timeout_s=METADATA_TIMEOUT_S)
        fix = "give a new or empty --output: the broker's topic is not the one this directory recorded"
        for tp, frame in last.items():
            if ends[tp] <= frame.offset:
                raise ConfigError(f"--continue: {self.root} recorded {frame.where}, but the broker's {tp.topic}"
                                  f"[{tp.partition}] ends before it (end offset {ends[tp]}): another run's topic (a "
                                  "restarted broker, a recreated topic)", field="--output", fix=fix)
        probe = make_consumer(self.bootstrap, None, self.cfg, max_poll_records=1)
        try:
            begin = probe.beginning_offsets(sorted(last))
            todo = {tp: f for tp, f in last.items() if begin[tp] <= f.offset}
            for tp in set(last) - set(todo):
                log.warning("recorder: --continue: %s is no longer on the broker (it starts at offset %d); the "
                            "source cannot be checked there", last[tp].where, begin[tp])
            if not todo:
                return
            probe.assign(sorted(todo))
            for tp, f in todo.items():
                probe.seek(tp, f.offset)
            deadline = time.monotonic() + METADATA_TIMEOUT_S
            while todo:
                if time.monotonic() > deadline:
                    raise BrokerUnavailableError(f"recorder: --continue: the broker did not return "
                                                 f"{', '.join(f.where for f in todo.values())} within "
                                                 f"{METADATA_TIMEOUT_S:.0f}s")
                for tp, recs in probe.poll(timeout_ms=POLL_MS).items():
                    if tp not in todo or not recs:
                        continue
                    f, rec = todo.pop(tp), recs[0]
                    probe.pause(tp)
                    same = (rec.offset == f.offset and rec.timestamp == f.timestamp
                            and (None if rec.key is None else bytes(rec.key)) == f.key
                            and (None if rec.value is None else bytes(rec.value)) == f.value)
                    if not same:
                        raise ConfigError(f"--continue: {self.root} recorded {f.where} (timestamp {f.timestamp}, "
                                          f"{len(f.value or b'')} bytes), but the broker holds another record at "
                                          f"{tp.topic}[{tp.partition}]@{rec.offset} (timestamp {rec.timestamp}, "
                                          f"{len(rec.value or b'')} bytes): another run's topic", field="--output",
                                          fix=fix)
        finally:
            probe.close(autocommit=False)

    def _write_source(self) -> None:
        path = self.root / TOPICS_DIR / SOURCE_FILE
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": 1, "run_id": self.run_id, "bootstrap": self.bootstrap,
                                    "topics": self.topics, "started": datetime.now().astimezone().isoformat(
                                        timespec="seconds")}, indent=1) + "\n")

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> RecordStats:
        """Steps 0-5 of the module doc; returns what was recorded."""
        self._refuse_other_recording()
        consumer = make_consumer(self.bootstrap, None, self.cfg, max_poll_records=MAX_POLL_RECORDS)
        writer = RecordingWriter(self.root, max_bytes=self.max_bytes, max_age_s=self.max_age_s)
        try:
            tps = self._partitions(consumer)
            if not tps:
                return self.stats
            self._prepare_files(tps)
            stop_at = self._seek(consumer, writer, tps)
            t_from, t_to = self._time(self.start), self._time(self.end)
            active = {tp for tp in tps if stop_at[tp] is None or consumer.position(tp) < stop_at[tp]}
            drain_deadline: float | None = None
            while active:
                if self._stop.is_set() and drain_deadline is None:
                    drain_deadline = time.monotonic() + DRAIN_DEADLINE_S
                    if not self._drain_to_end_offsets(active, stop_at):
                        break
                if drain_deadline is not None and time.monotonic() > drain_deadline:
                    left = {f"{tp.topic}[{tp.partition}]": stop_at[tp] - consumer.position(tp) for tp in active}
                    log.error("recorder: drain deadline (%.0fs) passed; records left unrecorded: %s",
                              DRAIN_DEADLINE_S, left)
                    self.stats.drained = False
                    break
                self._poll_once(consumer, writer, active, stop_at, t_from, t_to)
            self.stats.skipped = writer.skipped
            return self.stats
        finally:
            writer.close()
            consumer.close(autocommit=False)
            if writer.trimmed:
                log.info("recorder: %d oldest records dropped by record.max_bytes=%s / record.max_age_s=%s",
                         writer.trimmed, self.max_bytes, self.max_age_s)
            log.info("recorder: recorded %s into %s", ", ".join(f"{t}: {n}" for t, n in sorted(
                self.stats.records.items())) or "nothing", self.root)

    def _prepare_files(self, tps: list[TopicPartition]) -> None:
        """The files before polling: the same source (``--continue``), torn tails cut, source.json, a file
        per partition (an empty one recorded as empty)."""
        try:
            if self.continue_recording:
                self._check_same_source(tps)
            for tp in tps:
                path = partition_path(self.root, tp.topic, tp.partition)
                if path.exists():
                    cut_torn_tail(path, tp.topic, tp.partition)
        except RecordingError as exc:  # never append to a damaged file: new frames would follow the damage
            raise ConfigError(f"--continue: {exc}", field="--output",
                              fix="give a new or empty --output (the damaged recording stays as it is)") from exc
        self._write_source()
        for tp in tps:
            path = partition_path(self.root, tp.topic, tp.partition)
            if not path.exists():  # an empty partition is recorded as empty (magic only), not left out
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(MAGIC)

    def _seek(self, consumer: Any, writer: RecordingWriter,
              tps: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """Steps 2-3: each partition assigned and sought past what is recorded; returns where each stops
        (exclusive; None: follow until stopped)."""
        begin = consumer.beginning_offsets(tps)
        ends: dict[TopicPartition, int] | None = None
        if not self.follow:
            ends = end_offsets(self.bootstrap, self.cfg, tps, timeout_s=METADATA_TIMEOUT_S)
        stop_at: dict[TopicPartition, int | None] = {}
        consumer.assign(tps)
        for tp in tps:
            start = max(self._bound(self.start, tp) or 0, begin[tp])
            last = writer.last_offset(tp.topic, tp.partition)
            if last is not None and last + 1 > start:
                start = last + 1
            consumer.seek(tp, start)
            upper = self._bound(self.end, tp)
            if ends is not None:
                upper = ends[tp] if upper is None else min(upper, ends[tp])
            stop_at[tp] = upper
            log.info("recorder: %s[%d] from offset %d to %s", tp.topic, tp.partition, start,
                     "the end" if upper is None else f"offset {upper} (exclusive)")
        return stop_at

    def _drain_to_end_offsets(self, active: set[TopicPartition], stop_at: dict[TopicPartition, int | None]) -> bool:
        """Stop requested: record up to the end offsets of now (False when they cannot be read)."""
        try:
            now_ends = end_offsets(self.bootstrap, self.cfg, sorted(active), timeout_s=DRAIN_DEADLINE_S)
        except (KafkaError, BrokerUnavailableError) as exc:  # the broker went first: keep what was recorded
            log.error("recorder: stop requested but the end offsets could not be read (%s: %s); "
                      "records after the last poll are not recorded", type(exc).__name__, exc)
            self.stats.drained = False
            return False
        for tp in active:
            stop_at[tp] = now_ends[tp] if stop_at[tp] is None else min(stop_at[tp], now_ends[tp])
        log.info("recorder: stop requested; draining up to %s",
                 ", ".join(f"{tp.topic}[{tp.partition}]@{stop_at[tp]}" for tp in sorted(active)))
        return True

    def _poll_once(self, consumer: Any, writer: RecordingWriter, active: set[TopicPartition],
                   stop_at: dict[TopicPartition, int | None], t_from: int | None, t_to: int | None) -> None:
        """Step 4: one poll's records appended (time-filtered), flushed; partitions at their end leave ``active``."""
        for tp, recs in consumer.poll(timeout_ms=POLL_MS).items():
            for rec in recs:
                if tp not in active:
                    break
                limit = stop_at.get(tp)
                if limit is not None and rec.offset >= limit:
                    active.discard(tp)
                    break
                if t_to is not None and rec.timestamp >= t_to and self.follow:
                    active.discard(tp)  # follow mode: the first record at or past --to ends it
                    break
                if (t_from is not None and rec.timestamp < t_from) or (t_to is not None and rec.timestamp >= t_to):
                    self.stats.filtered += 1
                    continue
                if writer.append(RecordFrame.from_consumer_record(rec)):
                    self.stats.records[tp.topic] = self.stats.records.get(tp.topic, 0) + 1
        writer.flush()  # step 4: whole frames on disk after every poll
        for tp in list(active):
            limit = stop_at.get(tp)
            if limit is not None and consumer.position(tp) >= limit:
                active.discard(tp)


# ------------------------------------------------------------------------------------------------
# expstream run's recorder
# ------------------------------------------------------------------------------------------------


def record_topics(topo: Any) -> list[str]:
    """``record.topics``, or every topology topic, its ``.dlq`` twin and (continuous) ``policy``."""
    from expstream.kafka.topics import dlq_topic, loop_topics

    if topo.record.topics is not None:
        return list(topo.record.topics)
    out: list[str] = []
    for t in topo.all_topics():
        out += [t, dlq_topic(t)]
    return out + list(loop_topics(topo))


def recorder_argv(topo_path: Path, bootstrap: str, topics: list[str], out_dir: Path, run_id: str) -> list[str]:
    """The supervised recorder's command line (like a stage's: ``python -m expstream record ...``)."""
    # --continue: a restarted recorder carries on with its own recording (checked to be this run's)
    return [sys.executable, "-m", "expstream", "record", "--topology", str(topo_path), "--bootstrap-servers", bootstrap,
            "--topics", ",".join(topics), "--output", str(Path(out_dir).resolve()), "--follow", "--run-id", run_id,
            "--continue"]


def recording_summary(root: str | Path) -> dict[str, Any]:
    """``{topics: {name: records}, bytes, torn_tails, corrupt}`` of the recording under ``root``
    (summary.json); ``corrupt`` names each damaged file and byte position (never raises for it)."""
    topics: dict[str, int] = {}
    size = torn = 0
    corrupt: list[str] = []
    for topic in recorded_topics(root):
        n = 0
        for p in recorded_partitions(root, topic):
            path = partition_path(root, topic, p)
            reader = PartitionReader(path, topic, p, strict=False)
            n += sum(1 for _ in reader)
            torn += reader.torn_tail
            if reader.damage is not None and reader.corrupt:
                corrupt.append(f"{topic}[{p}] at byte {reader.damage.position}: {reader.damage.detail}")
            size += path.stat().st_size
        topics[topic] = n
    return {"topics": topics, "bytes": size, "torn_tails": torn, "corrupt": corrupt}


# ------------------------------------------------------------------------------------------------
# expstream record
# ------------------------------------------------------------------------------------------------


def _stop_when_orphaned(recorder: Recorder) -> None:
    from expstream.procs import watch_parent

    def on_orphan(parent: int) -> None:
        log.error("recorder: parent process %d is gone (now %d); stopping", parent, os.getppid())
        recorder.request_stop()

    watch_parent(on_orphan)


def record_command(topo: Any, args: argparse.Namespace,
                   install_signals: Callable[[Recorder], None] | None = None) -> int:
    """``expstream record`` (wired in expstream/cli.py)."""
    if args.run_id:  # `ps` and `top` name the run, like its stages (expstream/procs.py)
        from setproctitle import setproctitle

        setproctitle(f"expstream {RECORDER} run={args.run_id}")
    if not args.bootstrap_servers:
        raise ConfigError("needed to read the topics", field="--bootstrap-servers", fix="e.g. --bootstrap-servers kafka:9092")
    from expstream.launch.preflight import KAFKA_FIX_EXISTING, check_kafka

    # an unreachable broker: one line in seconds, before the output directory is created
    check_kafka(args.bootstrap_servers, topo.kafka, fix=KAFKA_FIX_EXISTING)
    topics = [t.strip() for t in (args.topics or "").split(",") if t.strip()]
    if not topics:
        raise ConfigError("no topics given", field="--topics", fix="e.g. --topics rollouts,scored")
    start = parse_position(args.from_, "--from") if args.from_ else None
    end = parse_position(args.to, "--to") if args.to else None
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {str(out)!r} ({exc.strerror or exc})", field="--output",
                          fix="give a writable directory") from exc
    recorder = Recorder(args.bootstrap_servers, topo.kafka, topics, out, start, end, follow=args.follow,
                        continue_recording=args.continue_recording, run_id=args.run_id,
                        max_bytes=topo.record.max_bytes, max_age_s=topo.record.max_age_s)
    if install_signals is None:
        def _on_signal(signum: int, _frame: Any) -> None:
            log.info("recorder: got signal %d; draining", signum)
            recorder.request_stop()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    else:
        install_signals(recorder)
    from expstream.procs import EXIT_WITH_PARENT_ENV

    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":
        _stop_when_orphaned(recorder)
    stats = recorder.run()
    total = sum(stats.records.values())
    print(f"recorded {total} record(s) into {out}/topics: "
          + (", ".join(f"{t} {n}" for t, n in sorted(stats.records.items())) or "nothing")
          + (f"; {stats.skipped} already recorded" if stats.skipped else "")
          + (f"; {stats.filtered} outside the --from/--to times" if stats.filtered else ""))
    return EXIT_OK


def add_record_arguments(rec: argparse.ArgumentParser) -> None:
    """The ``record`` subcommand's arguments."""
    add_topology_args(rec)
    rec.add_argument("--topics", required=True, help="comma-separated topic names, e.g. rollouts,scored,scored.dlq")
    rec.add_argument("--from", dest="from_", default=None, metavar="POS",
                     help="first record: an offset (123, or 0:12,1:40 per partition; inclusive), an ISO 8601 time "
                          "with a zone or @epoch-ms (records with timestamp >= it); default: the beginning")
    rec.add_argument("--to", default=None, metavar="POS",
                     help="end: an offset (exclusive, like a Kafka end offset) or a time (records with timestamp "
                          "< it); default: the end offsets at start (with --follow: until SIGTERM)")
    rec.add_argument("--output", required=True, help="run directory to write (topics/<topic>/partition-<p>.rec)")
    rec.add_argument("--run-id", default=None, help="the run this recorder belongs to (shown in its process title)")
    rec.add_argument("--follow", action="store_true",
                     help="keep recording new records until SIGTERM/Ctrl-C (then drain and exit 0)")
    rec.add_argument("--continue", dest="continue_recording", action="store_true",
                     help="--output already holds a recording: append to it, after checking it is of the same "
                          "source (the broker still holds its last records, byte for byte); without it, refused")


RECORD = Command("record", "export topics from a live broker into a recording (runs/<name>/topics/)",
                 add_record_arguments, record_command, reads_topology=True)
