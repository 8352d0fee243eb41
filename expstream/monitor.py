"""The run monitor: reads the experiences topic and the dead-letter twins while ``expstream run`` runs.

It counts complete groups (deduped by sample id) and the groups dead letters made impossible, which
is how the run knows when every prompt group is accounted for. Prompt files and feeding them are
in ``expstream.prompts``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kafka import TopicPartition

from expstream.bus import KafkaConfig, make_consumer
from schemas import PromptBatch, SampleBatch, decode
from schemas.errors import SchemaError

# Why 1 s: a steady-state rate needs arrivals spread over some time; a short run's few records
# arrive within milliseconds of each other and would give a meaningless rate.
STEADY_MIN_SPAN_S = 1.0


@dataclass
class ExperienceCollector:
    """Reads the experiences topic from outside any group; dedupes by sample id.

    ``records`` keeps the raw bytes of every record that brought at least one new sample, in
    arrival order, so ``experiences.msgpack`` is the wire format concatenated.
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

    def __post_init__(self) -> None:
        self.consumer = make_consumer(self.bootstrap, None, self.cfg)
        parts = []
        for t in [self.topic, *self.dlq_topics]:
            for p in sorted(self.consumer.partitions_for_topic(t) or []):
                parts.append(TopicPartition(t, p))
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)

    @property
    def complete_groups(self) -> int:
        return sum(1 for c in self.group_counts.values() if c >= self.n_per_group)

    def poll(self, timeout_ms: int = 500) -> int:
        """Take what has arrived; returns the number of new samples."""
        new = 0
        for tp, recs in self.consumer.poll(timeout_ms=timeout_ms).items():
            for rec in recs:
                if tp.topic == self.topic:
                    new += self._experience(rec.value)
                else:
                    self._dead_letter(rec)
        return new

    def _experience(self, value: bytes) -> int:
        batch = decode(value)
        assert isinstance(batch, SampleBatch)
        fresh = 0
        for sid, gid in zip(batch.sample_ids(), batch.group_id, strict=True):
            if sid in self.samples:
                self.duplicates += 1
                continue
            self.samples.add(sid)
            self.group_counts[gid] = self.group_counts.get(gid, 0) + 1
            fresh += 1
        if fresh:
            self.records.append(bytes(value))
            now = time.monotonic()
            if self.first_at is None:
                self.first_at, self.first_samples = now, fresh
            self.last_at = now
        return fresh

    def steady_rate(self) -> float | None:
        """Samples/s between the first and the last new experience (start-up excluded)."""
        # under a second of arrivals says more about batching than about a rate
        if self.first_at is None or self.last_at is None or self.last_at - self.first_at < STEADY_MIN_SPAN_S:
            return None
        return (len(self.samples) - self.first_samples) / (self.last_at - self.first_at)

    def _dead_letter(self, rec) -> None:  # noqa: ANN001 - ConsumerRecord
        headers = {k: v.decode(errors="replace") for k, v in (rec.headers or [])}
        entry = {"topic": rec.topic, "offset": rec.offset, "stage": headers.get("stage"),
                 "error_class": headers.get("error_class"),
                 "error": (headers.get("error_message") or "").splitlines()[:1]}
        try:
            msg = decode(rec.value)
        except SchemaError:
            entry["groups"] = []
        else:
            if isinstance(msg, PromptBatch):  # the whole prompt group is lost, every sample of it
                ids = [f"{g}#{i}" for g in msg.prompt_id for i in range(self.n_per_group)]
            else:
                ids = msg.sample_ids()
            self.dead_samples.update(ids)
            groups = {sid.rpartition("#")[0] for sid in ids}
            self.dead_groups.update(groups)
            entry["groups"] = sorted(groups)
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

    def close(self) -> None:
        self.consumer.close()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
