"""stages/pausing.py against the session broker: a partition that was paused with fetched records in hand,
taken away and given back, is read again once the work is over (kafka-python's parked fetch data)."""

from __future__ import annotations

import logging
import time

from kafka import TopicPartition

from expstream.kafka.clients import make_consumer, make_producer
from stages.pausing import PausedPolling


def _poll_until(consumer, want, deadline_s: float = 30.0) -> dict[int, list[int]]:
    """Poll until ``want(seen)`` holds; returns {partition: [offsets]} of everything polled."""
    seen: dict[int, list[int]] = {}
    deadline = time.monotonic() + deadline_s
    while not want(seen) and time.monotonic() < deadline:
        for tp, recs in consumer.poll(timeout_ms=200).items():
            seen.setdefault(tp.partition, []).extend(r.offset for r in recs)
    return seen


def test_a_partition_given_back_after_a_pause_with_parked_records_is_read_again(broker, fresh_topic):
    """The scale-up-then-down path of a live run: replica A pauses its partitions while a micro-batch is
    in hand, with the rest of a fetch in kafka-python's in-line slot, which a poll then parks; a
    rebalance takes the partition away as the work ends, a later one gives it back with a fresh state.
    Hand assignment moves the partitions here, as those rebalances do, without their timing. Before the
    fix the parked entry outlived the partition's tenure and kept it out of every fetch for good: the
    last poll saw partition 1 only (the symptom of test_scale's stalled live-scale run in CI)."""
    topic = fresh_topic(2)
    producer = make_producer(broker)
    for p in (0, 1):
        for i in range(6):
            producer.send(topic, value=f"{p}-{i}".encode(), partition=p)
    producer.flush()
    producer.close()
    p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = make_consumer(broker, None, max_poll_records=1, auto_offset_reset="earliest")
    try:
        consumer.assign([p0])
        first = _poll_until(consumer, lambda seen: bool(seen))
        assert first == {0: [0]}  # one record handed out; the rest of the fetch waits in-line
        moves: list[list[TopicPartition]] = []

        def poll(ms: int) -> dict:  # a rebalance happens inside a poll, which may then fetch the new partitions
            if moves:
                consumer.assign(moves.pop(0))
            return consumer.poll(timeout_ms=ms)

        pausing = PausedPolling(consumer, poll, lambda tp: True, logging.getLogger("test"), "test", 60000)
        # the worker holds record 0, so the partition is paused; a rebalance inside the next poll gives this
        # replica partition 1 too, fetched before it is paused: partition 0's fetch data is parked
        moves.append([p0, p1])
        deadline = time.monotonic() + 30
        while pausing.rewound == 0 and time.monotonic() < deadline:
            pausing.poll_paused()  # until that poll returned partition 1's records (rewound, then paused)
        fetcher = getattr(consumer, "_fetcher")  # noqa: B009 - the condition under test lives there
        assert pausing.rewound and p0 in fetcher._paused_partition_records, "precondition: fetch data parked"
        consumer.assign([p1])  # the next rebalance gives partition 0 to another replica, as the work ends
        pausing.resume_all()  # the work is over
        assert p0 not in fetcher._paused_partition_records  # no parked entry outlives its partition's tenure
        consumer.assign([p0, p1])  # a later rebalance gives partition 0 back (fresh state, not paused)
        consumer.seek(p0, 1)  # where the committed offset would put it
        seen = _poll_until(consumer, lambda s: len(s.get(0, [])) >= 5 and len(s.get(1, [])) >= 6)
        assert sorted(seen.get(0, [])) == [1, 2, 3, 4, 5], seen  # partition 0 is read again, from its position
        assert sorted(seen.get(1, [])) == list(range(6)), seen
    finally:
        consumer.close()
