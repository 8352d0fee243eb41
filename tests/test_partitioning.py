"""Room to scale (issue 23 item 2): records spread evenly over partitions, default topics have room for
8 replicas of a stage."""

from __future__ import annotations

import random
from collections import Counter

from expstream.config.topology import load_topology
from expstream.kafka.clients import make_producer
from expstream.kafka.partitioning import RoundRobinPartitioner
from expstream.launch.scale import check_counts


def test_records_of_one_group_key_spread_evenly_over_the_partitions(broker, fresh_topic):
    """32 records with the keys a short run has (a few group ids) land 8/8/8/8 on 4 partitions; under
    the key hash they fell 8/9/10/5 (docs/reward.md)."""
    topic = fresh_topic(partitions=4)
    producer = make_producer(broker, spread=True)
    try:
        futures = [producer.send(topic, value=b"v", key=f"g{i % 3}".encode()) for i in range(32)]
        producer.flush(timeout=30)
        parts = Counter(f.get(timeout=30).partition for f in futures)
    finally:
        producer.close()
    assert sorted(parts.values()) == [8, 8, 8, 8], parts


def test_round_robin_starts_anywhere_and_skips_a_partition_without_a_leader():
    class Cluster:  # the two metadata questions a partitioner asks
        def __init__(self, available):
            self.available = available

        def topics(self):
            return {"t"}

        def partitions_for_topic(self, topic):
            return {0, 1, 2, 3}

        def available_partitions_for_topic(self, topic):
            return self.available

    rr = RoundRobinPartitioner(random.Random(7))
    seq = [rr.partition("t", None, b"k", None, b"v", Cluster({0, 1, 2, 3})) for _ in range(8)]
    assert sorted(seq[:4]) == [0, 1, 2, 3] and seq[4:] == seq[:4]
    starts = {RoundRobinPartitioner(random.Random(s)).partition("t", None, None, None, b"", Cluster(set()))
              for s in range(40)}
    assert len(starts) > 1  # several producers do not all begin on partition 0
    seq = [rr.partition("t", None, b"k", None, b"v", Cluster({0, 2})) for _ in range(6)]
    assert set(seq) == {0, 2} and Counter(seq)[0] == Counter(seq)[2] == 3


def test_the_default_topology_lets_every_stage_scale_to_8_replicas():
    topo = load_topology(None, [])
    partitions = topo.all_topics()
    assert all(n >= 8 for n in partitions.values()), partitions
    check_counts(topo, {"reward": 8, "generate": 8})  # raises when refused
