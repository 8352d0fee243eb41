"""Keeping a consumer in its group while a micro-batch is in hand: pause, poll, rewind, resume.

kafka-python drops a member that has not called ``poll()`` for ``max_poll_interval_ms``; model work
on one record can take longer. So while the runner's worker thread holds a record, the main thread
pauses every assigned partition and keeps polling: a paused partition returns nothing, but each
poll keeps the membership. A partition assigned during the pause (another replica joined or left)
is paused too once it shows up; whatever a poll returned for it before that is rewound with
``seek`` to the first returned offset, so nothing is skipped. When the work is done (or a backoff
spent this way is over) everything paused is resumed, and fetch data that kafka-python parked for
a paused partition is dropped (:func:`drop_parked_records`: a workaround for a fetcher bug).

The runner (stages/runner.py) owns the consumer and the commit protocol; this module only moves
fetch positions and the paused set. Main thread only: the consumer is not thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition
from kafka import errors as kafka_errors

# Why 1 s: most micro-batches finish well within it and then pay nothing for pausing; a batch that
# takes longer is still far from max_poll_interval_ms (60 s by default, >= 6 s in any sane setup).
BUSY_GRACE_S = 1.0
# Why 200 ms: the poll() made while the partitions are paused; each returns after about this long,
# so the end of the work is noticed within 200 ms and heartbeats/rebalances are served promptly.
BUSY_POLL_MS = 200


class PausedPolling:
    """Pause/poll/rewind/resume for one consumer.

    ``poll(timeout_ms)`` is the runner's poll (it retries broker errors and tracks the assignment);
    ``owns(tp)`` says whether the partition is still assigned to this consumer.
    """

    def __init__(self, consumer: Any, poll: Callable[[int], dict], owns: Callable[[TopicPartition], bool],
                 log: logging.Logger, name: str, max_poll_interval_ms: int) -> None:
        self.consumer = consumer
        self.poll = poll
        self.owns = owns
        self.log = log
        self.name = name
        # a quarter of the poll interval at most, so a short max_poll_interval_ms is still honoured
        self.grace_s = min(BUSY_GRACE_S, max_poll_interval_ms / 4000)
        self.rewound = 0  # records returned for a newly assigned partition and rewound (final log line)

    def wait(self, fut: concurrent.futures.Future, where: str) -> float | None:
        """Wait for the worker, polling with paused partitions once it takes longer than the grace.

        Returns how long the work took when it had to pause, else None.
        """
        started = time.monotonic()
        if concurrent.futures.wait([fut], timeout=self.grace_s).done:
            return None
        self.log.info("stage %s %s: micro-batch still in hand after %.1fs; pausing %d partitions and polling "
                      "to keep the group membership", self.name, where, self.grace_s,
                      len(self.consumer.assignment()))
        try:
            while not fut.done():
                self.poll_paused()
        finally:
            self.resume_all()
        busy = time.monotonic() - started
        self.log.info("stage %s %s: micro-batch done after %.1fs; partitions resumed", self.name, where, busy)
        return busy

    def sleep(self, seconds: float, stopped: Callable[[], bool]) -> None:
        """Back off for ``seconds`` without leaving the group (paused polls); cut short by ``stopped()``."""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and not stopped():
                self.poll_paused()
        finally:
            self.resume_all()

    def poll_paused(self) -> None:
        """One poll with every assigned partition paused; rewinds anything a new partition returned."""
        self.pause_all()
        polled = self.poll(BUSY_POLL_MS)
        for tp, recs in polled.items():
            if not recs:
                continue
            first = min(r.offset for r in recs)
            try:
                self.consumer.seek(tp, first)
            except (kafka_errors.KafkaError, AssertionError) as exc:
                self.log.warning("stage %s: could not rewind %s[%d] to %d: %r", self.name, tp.topic,
                                 tp.partition, first, exc)
                continue
            self.rewound += len(recs)
            self.log.info("stage %s: %s[%d] assigned while a micro-batch is in hand; rewound to %d (%d records "
                          "returned before it was paused)", self.name, tp.topic, tp.partition, first, len(recs))
        self.pause_all()

    def pause_all(self) -> None:
        todo = [tp for tp in self.consumer.assignment() if tp not in self.consumer.paused()]
        if todo:
            self.consumer.pause(*todo)

    def resume_all(self) -> None:
        """Resume every paused partition and drop every partition's parked fetch data: also that of a
        partition revoked while paused, whose entry would otherwise outlive it and keep it from ever
        being fetched again when a later rebalance gives it back (found by test_scale's live scale-up
        and down: two of three partitions never read again after the scale-down)."""
        paused = self.consumer.paused()
        if paused:
            self.consumer.resume(*paused)
        dropped = drop_parked_records(self.consumer)
        if dropped:
            self.log.debug("stage %s: dropped parked fetch data of %s (fetched again from the position)",
                           self.name, dropped)

    def reposition(self, tp: TopicPartition, offset: int) -> None:
        """Set the fetch position of ``tp`` to ``offset`` if it is still ours (else nothing to do)."""
        if not self.owns(tp):
            return
        try:
            self.consumer.seek(tp, offset)
        except (kafka_errors.KafkaError, AssertionError) as exc:  # not assigned after all
            self.log.debug("stage %s: seek %s to %d skipped: %r", self.name, tp, offset, exc)


def drop_parked_records(consumer: Any) -> list[TopicPartition]:
    """Work around a kafka-python 3.0.x fetcher bug: drop the parked fetch data of every partition that
    is not paused now; returns the partitions whose data was dropped.

    Since dpkp/kafka-python#2981 (KAFKA-7548), records fetched for a partition that is paused while
    they are being drained are parked in ``Fetcher._paused_partition_records``. They are put back
    only when the fetcher's in-line slot is empty (``_next_partition_records is None``), which it
    almost never is once any partition has returned records, and a partition with parked data is
    never fetched again. Measured here: pause one of two partitions, poll, resume -> the partition
    returns nothing, forever; with the parked entry dropped it resumes at its position. Dropping
    loses nothing: the data is fetched again from the partition's position (which the parked copy
    never moved). A partition revoked while paused keeps its parked entry (kafka-python clears them only
    at close); when a rebalance gives it back it has a fresh, unpaused state, and the entry alone keeps
    it out of every fetch: dropped too, its position comes from the committed offset. A no-op when the
    attribute is missing (other versions).
    """
    parked = getattr(getattr(consumer, "_fetcher", None), "_paused_partition_records", None)
    if not isinstance(parked, dict):
        return []
    paused = consumer.paused()
    return [tp for tp in list(parked) if tp not in paused and parked.pop(tp, None) is not None]
