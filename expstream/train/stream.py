"""ExperienceStream: a trainer's consumer of the ``experiences`` topic, positions under its control.

A trainer owns its offsets: it stores them in its checkpoint and commits them to Kafka only after
that checkpoint is durable (expstream/train/checkpoint.py). So the stream assigns every partition
(no group rebalancing: one trainer reads everything), seeks where it is told, and never
auto-commits. The consumer group id is used only to store committed offsets (``commit``) and to
start from them when no position is given.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from expstream.config.kafka import KafkaConfig
from expstream.errors import BrokerUnavailableError
from expstream.kafka.clients import make_consumer
from schemas import decode
from schemas.errors import SchemaError

__all__ = ["ExperienceStream", "StreamRecord"]

log = logging.getLogger("expstream.train.stream")

#: One decoded record: (SampleBatch, topic, partition, offset).
StreamRecord = tuple[Any, str, int, int]

# Why 30 s: a fresh topic's metadata reaches the client within a second or two; a broker that
# does not know the topic after this long is misconfigured (the trainer started before the run).
TOPIC_WAIT_S = 30.0
# Why 0.1 s: the interval between metadata probes while waiting for the topic.
TOPIC_PROBE_S = 0.1
# Why 500: one fetch may return many small micro-batches; the trainer wants all it can get.
MAX_POLL_RECORDS = 500


class ExperienceStream:
    """Read decoded experience batches from ``topic``, every partition, from chosen positions.

    1. ``__init__`` assigns all partitions of ``topic`` and seeks: to ``positions[p]`` when given,
       else to the group's committed offset, else to the beginning.
    2. ``poll`` returns decoded records in offset order per partition; a record that does not
       decode is logged with ``topic[p]@offset`` and skipped (``undecodable`` counts them).
    3. ``positions`` is the next offset to read per partition (what a checkpoint stores).
    4. ``commit(positions)`` stores them as the group's committed offsets (after the checkpoint).
    """

    def __init__(self, bootstrap: str, kafka_config: KafkaConfig | None, topic: str, group_id: str,
                 positions: dict[int, int] | None = None) -> None:
        self.topic = topic
        self.group_id = group_id
        self.undecodable = 0
        self._consumer = make_consumer(bootstrap, group_id, kafka_config, max_poll_records=MAX_POLL_RECORDS,
                                       enable_auto_commit=False)
        deadline = time.monotonic() + TOPIC_WAIT_S
        parts = self._consumer.partitions_for_topic(topic)
        while not parts:
            if time.monotonic() > deadline:
                self._consumer.close()
                raise BrokerUnavailableError(f"topic {topic!r} not found within {TOPIC_WAIT_S:.0f}s; "
                                             "create it first (`expstream topics create`)")
            time.sleep(TOPIC_PROBE_S)
            parts = self._consumer.partitions_for_topic(topic)
        self._tps = {p: TopicPartition(topic, p) for p in sorted(parts)}
        self._consumer.assign(list(self._tps.values()))
        self.seek(positions or {})

    def seek(self, positions: dict[int, int]) -> None:
        """Seek every partition: to ``positions[p]``, else the committed offset, else the beginning."""
        for p, tp in self._tps.items():
            if p in positions:
                self._consumer.seek(tp, int(positions[p]))
                continue
            committed = self._consumer.committed(tp)
            if committed is not None:
                self._consumer.seek(tp, int(committed))
            else:
                self._consumer.seek_to_beginning(tp)

    def poll(self, timeout_ms: int = 500) -> list[StreamRecord]:
        out: list[StreamRecord] = []
        for tp, records in self._consumer.poll(timeout_ms=timeout_ms).items():
            for rec in records:
                try:
                    if rec.value is None:
                        raise SchemaError("a tombstone (null value) is not an experience")
                    batch = decode(bytes(rec.value))
                    if getattr(batch, "group_id", None) is None:
                        raise SchemaError(f"expected an expstream.SampleBatch, got {type(batch).__name__}")
                except (SchemaError, ValueError, TypeError) as exc:
                    self.undecodable += 1
                    log.error("%s[%d]@%d: undecodable experience record skipped (%s: %s); "
                              "%d skipped so far", tp.topic, tp.partition, rec.offset, type(exc).__name__, exc,
                              self.undecodable)
                    continue
                out.append((batch, tp.topic, tp.partition, rec.offset))
        out.sort(key=lambda r: (r[2], r[3]))
        return out

    def positions(self) -> dict[int, int]:
        return {p: int(self._consumer.position(tp)) for p, tp in self._tps.items()}

    def commit(self, positions: dict[int, int]) -> None:
        """Store ``positions`` as the group's committed offsets (synchronously)."""
        self._consumer.commit({self._tps[p]: OffsetAndMetadata(int(o), "", -1) for p, o in positions.items()})

    def close(self) -> None:
        self._consumer.close()
