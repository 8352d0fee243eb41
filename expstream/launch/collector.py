"""The run monitor: reads the experiences topic and the dead-letter twins while ``expstream run`` runs.

It counts complete groups (deduped by sample id) and the groups dead letters made impossible, which
is how the run knows when every prompt group is accounted for. Prompt files and feeding them are
in ``expstream.launch.prompts``.

The collector validates like a stage does and never raises on a record:

1. a record it cannot decode, of the wrong schema (a ``PromptBatch``), or a ``SampleBatch`` that is
   not an experience (no advantages, ...) is *rejected*: counted, named ``topic[partition]@offset``
   with a reason, and its raw bytes appended to ``rejected.msgpack`` in the run's output directory;
2. samples of groups this run did not feed (:meth:`ExperienceCollector.expect_groups`), and every
   sample of a record that was on the topic before the collector started (a reused broker's
   previous run, with the same prompt ids) are *foreign*: counted, never towards completion, never
   written to ``experiences.msgpack`` (a record holding only foreign samples is rejected as well,
   so its bytes are kept aside); dead letters from before the run are counted, not losses;
3. everything else is deduped by sample id and kept.

``rejected.msgpack`` is a stream of msgpack maps, one per rejected record:
``{topic, partition, offset, key, value, headers, reason}`` (``value`` the original bytes, nil for a
tombstone; ``headers`` a list of ``[name, bytes]``); read it with ``msgpack.Unpacker``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from kafka import TopicPartition

from expstream.config.kafka import KafkaConfig
from expstream.kafka.clients import make_consumer
from expstream.kafka.letters import sample_errors
from schemas import PromptBatch, SampleBatch, decode, encode
from schemas.errors import SchemaError

log = logging.getLogger("expstream.monitor")

# Why 1 s: a steady-state rate needs arrivals spread over some time; a short run's few records
# arrive within milliseconds of each other and would give a meaningless rate.
STEADY_MIN_SPAN_S = 1.0
#: Rejected records listed in summary.json; the count and rejected.msgpack hold all of them.
#: Why 20: enough to see the pattern of a flood, short enough that the summary stays readable.
REJECTED_LIST_CAP = 20
#: Why 300 characters: a reason is one line in a summary, not a traceback.
REASON_MAX_CHARS = 300
#: What read_experiences (Experience.from_sample_batch) needs besides the per-sample lists.
EXPERIENCE_FIELDS = ("prompt_ids", "action_ids", "action_log_probs", "advantages", "returns")
NEVER_COMPLETED = "never completed"
#: Rejected records' bytes, in the run's output directory next to experiences.msgpack.
REJECTED_FILE = "rejected.msgpack"


def record_where(rec: Any) -> str:  # noqa: ANN401 - a kafka ConsumerRecord
    return f"{rec.topic}[{rec.partition}]@{rec.offset}"


@dataclass
class ExperienceCollector:
    """Reads the experiences topic from outside any group; dedupes by sample id.

    ``records`` keeps the raw bytes of every record that brought at least one new sample, in
    arrival order, so ``experiences.msgpack`` is the wire format concatenated (a record that also
    held foreign samples is re-encoded without them). ``rejected_path``: where rejected records'
    bytes are appended as they arrive (None: counted and listed only).
    """

    bootstrap: str
    cfg: KafkaConfig
    topic: str
    n_per_group: int
    dlq_topics: list[str] = field(default_factory=list)
    records: list[bytes] = field(default_factory=list)
    samples: set[str] = field(default_factory=set)
    group_counts: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    dead_letters: list[dict] = field(default_factory=list)
    dead_groups: set[str] = field(default_factory=set)
    dead_samples: set[str] = field(default_factory=set)
    group_mode: bool = False  # group estimators emit whole groups only
    first_at: float | None = None  # monotonic time of the first new experience
    first_samples: int = 0
    last_at: float | None = None
    rejected_path: Path | None = None
    fed_groups: set[str] = field(default_factory=set)
    foreign_samples: int = 0
    rejected_count: int = 0
    rejected: list[dict] = field(default_factory=list)  # the first REJECTED_LIST_CAP: {where, reason}
    dead_reasons: dict[str, str] = field(default_factory=dict)  # group id -> first dead letter's reason
    dead_letters_before_run: int = 0  # on the dead-letter topics before this run started: not its losses

    def __post_init__(self) -> None:
        self.consumer = make_consumer(self.bootstrap, None, self.cfg)
        parts = []
        for t in [self.topic, *self.dlq_topics]:
            for p in sorted(self.consumer.partitions_for_topic(t) or []):
                parts.append(TopicPartition(t, p))
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)
        # What is on the topics now was written before this run fed anything (another run on a
        # reused broker, or an injection): read, validated and counted, never this run's samples.
        self.start_offsets: dict[TopicPartition, int] = dict(self.consumer.end_offsets(parts)) if parts else {}

    def expect_groups(self, group_ids: Iterable[str]) -> None:
        """Groups fed in this run (call before feeding them): only these count towards completion."""
        self.fed_groups.update(group_ids)

    @property
    def complete_groups(self) -> int:
        return sum(1 for c in self.group_counts.values() if c >= self.n_per_group)

    def poll(self, timeout_ms: int = 500) -> int:
        """Take what has arrived; returns the number of new samples. Never raises on a record."""
        new = 0
        for tp, recs in self.consumer.poll(timeout_ms=timeout_ms).items():
            for rec in recs:
                before_run = rec.offset < self.start_offsets.get(tp, 0)
                try:
                    if tp.topic == self.topic:
                        new += self._experience(rec, before_run)
                    elif before_run:
                        self.dead_letters_before_run += 1
                    else:
                        self._dead_letter(rec)
                except Exception as exc:  # noqa: BLE001 - a record is data: kept aside, never fatal
                    self._reject(rec, f"unreadable ({type(exc).__name__}: {exc})")
        return new

    def _experience(self, rec: Any, before_run: bool = False) -> int:  # noqa: ANN401 - a ConsumerRecord
        try:
            batch = decode(rec.value)
        except SchemaError as exc:
            return self._reject(rec, f"undecodable: {exc}")
        if not isinstance(batch, SampleBatch):
            return self._reject(rec, f"wrong schema: a {batch.SCHEMA} on the experiences topic, which holds "
                                     f"{SampleBatch.SCHEMA} records written by the last stage")
        missing = [name for name in EXPERIENCE_FIELDS if getattr(batch, name) is None]
        if missing:
            return self._reject(rec, f"not an experience: SampleBatch {batch.batch_id!r} has no "
                                     f"{', '.join(missing)} (only the last stage's output is an experience)")
        fresh: list[int] = []
        foreign = 0
        for row, (sid, gid) in enumerate(zip(batch.sample_ids(), batch.group_id, strict=True)):
            if before_run or gid not in self.fed_groups:
                foreign += 1
                continue
            if sid in self.samples:
                self.duplicates += 1
                continue
            self.samples.add(sid)
            self.group_counts[gid] = self.group_counts.get(gid, 0) + 1
            fresh.append(row)
        if foreign:
            self.foreign_samples += foreign
            if foreign == len(batch):
                why = "written before this run started" if before_run else "of groups this run did not feed"
                self._reject(rec, f"foreign: {foreign} samples {why} (batch {batch.batch_id!r}, e.g. group "
                                  f"{batch.group_id[0]!r})")
            else:
                log.warning("collector: %s batch=%s: %d samples of groups this run did not feed; kept out",
                            record_where(rec), batch.batch_id, foreign)
        if fresh:
            value = bytes(rec.value) if not foreign else encode(batch.select(fresh))
            self.records.append(value)
            now = time.monotonic()
            if self.first_at is None:
                self.first_at, self.first_samples = now, len(fresh)
            self.last_at = now
        return len(fresh)

    def _reject(self, rec: Any, reason: str) -> int:  # noqa: ANN401 - a kafka ConsumerRecord
        """Count a record the collector will not use and keep its bytes aside; returns 0 (no samples)."""
        where = record_where(rec)
        reason = " ".join(str(reason).split())[:REASON_MAX_CHARS]
        self.rejected_count += 1
        if len(self.rejected) < REJECTED_LIST_CAP:
            self.rejected.append({"where": where, "reason": reason})
        log.warning("collector: rejected %s: %s", where, reason)
        if self.rejected_path is not None:
            value = rec.value
            entry = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                     "key": bytes(rec.key) if isinstance(rec.key, (bytes, bytearray)) else rec.key,
                     "value": bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None,
                     "headers": [[str(k), bytes(v or b"")] for k, v in (rec.headers or [])], "reason": reason}
            try:
                with open(self.rejected_path, "ab") as fh:
                    fh.write(msgpack.packb(entry, use_bin_type=True))
            except (OSError, TypeError, ValueError) as exc:  # counted above; the file is a convenience
                log.error("collector: cannot keep %s aside in %s: %s", where, self.rejected_path, exc)
        return 0

    def steady_rate(self) -> float | None:
        """Samples/s between the first and the last new experience (start-up excluded)."""
        # under a second of arrivals says more about batching than about a rate
        if self.first_at is None or self.last_at is None or self.last_at - self.first_at < STEADY_MIN_SPAN_S:
            return None
        return (len(self.samples) - self.first_samples) / (self.last_at - self.first_at)

    def _dead_letter(self, rec: Any) -> None:  # noqa: ANN401 - a kafka ConsumerRecord
        headers = {str(k): (v or b"").decode(errors="replace") for k, v in (rec.headers or [])}
        first_line = ((headers.get("error_message") or "").splitlines() or [""])[0]
        entry = {"topic": rec.topic, "offset": rec.offset, "stage": headers.get("stage"),
                 "error_class": headers.get("error_class"), "error": [first_line] if first_line else []}
        try:
            msg = decode(rec.value)
        except SchemaError:
            entry["groups"] = []
        else:
            if isinstance(msg, PromptBatch):  # the whole prompt group is lost, every sample of it
                ids = [f"{g}#{i}" for g in msg.prompt_id for i in range(self.n_per_group)]
            else:
                ids = msg.sample_ids()
            ids = [sid for sid in ids if sid.rpartition("#")[0] in self.fed_groups]  # another run's are not ours
            self.dead_samples.update(ids)
            groups = {sid.rpartition("#")[0] for sid in ids}
            self.dead_groups.update(groups)
            entry["groups"] = sorted(groups)
            source = f"dead letter from {headers.get('stage') or '?'}"
            reason = f"{source}: {headers.get('error_class') or '?'}: {first_line}".rstrip(": ")
            # a record dead-lettered whole names each sample's own failure (prompt ids for a PromptBatch)
            own = sample_errors(headers)
            for sid in ids:
                g = sid.rpartition("#")[0]
                why = own.get(sid) or own.get(g)
                self.dead_reasons.setdefault(g, (f"{source}: {why}" if why else reason)[:REASON_MAX_CHARS])
        self.dead_letters.append(entry)

    def lost_groups(self) -> set[str]:
        """Groups that cannot come out complete because samples of them were dead-lettered.

        With a group estimator one dead sample loses the group (its buffer never fills); with a
        per-sample estimator the group is accounted for once every sample came out or died.
        """
        dead: dict[str, int] = {}
        for sid in self.dead_samples - self.samples:
            g = sid.rpartition("#")[0]
            dead[g] = dead.get(g, 0) + 1
        return {g for g, k in dead.items()
                if self.group_counts.get(g, 0) < self.n_per_group
                and (self.group_mode or self.group_counts.get(g, 0) + k >= self.n_per_group)}

    def lost_group_reasons(self, *, finished: bool, dropped: int = 0) -> dict[str, str]:
        """Group id -> why it did not come out: its first dead letter's stage, class and message.

        ``finished``: the run stopped waiting because every fed group was accounted for (or the
        target was met); otherwise the fed groups neither complete nor dead-lettered are listed
        as ``never completed`` (``dropped``: groups dynamic sampling dropped, which the collector
        cannot name: they are among those, and said so).
        """
        lost = {g: self.dead_reasons.get(g, "dead-lettered") for g in sorted(self.lost_groups())}
        if not finished:
            complete = {g for g, c in self.group_counts.items() if c >= self.n_per_group}
            why = NEVER_COMPLETED + (f" (or among the {dropped} groups dynamic sampling dropped)" if dropped else "")
            for g in sorted(self.fed_groups - complete - set(lost)):
                lost[g] = self.dead_reasons.get(g, why)
        return lost

    def close(self) -> None:
        self.consumer.close()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
