"""Where a record goes: every producer of a run spreads its records round-robin over a topic's partitions.

Records used to be keyed by group id and placed by kafka-python's default partitioner (murmur2 of
the key), which evens out only over thousands of records: 32 records fell 8/9/10/5 on 4
partitions, and the replica owning the busiest one set the pace (reward 1 -> 4 replicas: 3.43x,
docs/reward.md). :class:`RoundRobinPartitioner` (Kafka's own ``RoundRobinPartitioner`` idea) sends
a producer's k-th record of a topic to partition ``(start + k) mod n``, so one producer's records
differ by at most one per partition, however few. ``start`` is random per producer and topic, so
that several replicas producing a few records each do not all begin on partition 0.

Nothing depends on which partition a group's records take: a group's samples are gathered in Redis
(expstream/state, the group buffers), deduplication is by sample and batch ids, and replay writes
each output to its input's recorded partition. The record key (the first group id) stays on the
record for the tools (``expstream topics tail``, dead letters). A send with an explicit partition
(replay's publishing) is not asked. A partition without a leader is skipped while another has one.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from kafka.partitioner.abc import Partitioner

__all__ = ["RoundRobinPartitioner"]


class RoundRobinPartitioner(Partitioner):
    """The k-th record a producer sends to a topic goes to its partition ``(start + k) mod n``."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()  # kafka-python calls it from any thread that sends

    def partition(self, topic: str, key: Any, serialized_key: bytes | None, value: Any,
                  serialized_value: bytes | None, cluster: Any) -> int:
        if topic not in cluster.topics():
            raise ValueError(f"Topic {topic} not found in ClusterMetadata")
        every = sorted(cluster.partitions_for_topic(topic))
        available = set(cluster.available_partitions_for_topic(topic) or ())
        with self._lock:
            k = self._next.get(topic)
            if k is None:
                k = self._rng.randrange(len(every))
            for step in range(len(every)):
                choice = every[(k + step) % len(every)]
                if not available or choice in available:
                    self._next[topic] = k + step + 1
                    return choice
            self._next[topic] = k + 1
            return every[k % len(every)]
