"""A stage replica's polls: up to ``kafka.max_poll_records`` records each, retried with backoff, and what the assignment looks like.

The runner's loop (stages/runner.py) and its paused polling (stages/pausing.py) poll through
:class:`Poller` (main thread only: the consumer is not thread-safe). A poll that fails is logged
and retried after a backoff; a replica that has no partition for long is said so in the log every
``UNASSIGNED_LOG_INTERVAL_S``; each change of a group member's partitions is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kafka import errors as kafka_errors

from expstream.retry import Backoff
from stages.revocations import RevocationTracker
from stages.sending import RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_START_S

__all__ = ["POLL_TIMEOUT_MS", "UNASSIGNED_LOG_INTERVAL_S", "Poller"]

# Why 500 ms: short enough that SIGTERM is noticed quickly, long enough not to spin on an idle topic.
POLL_TIMEOUT_MS = 500
# Why 30 s: how often "no partitions assigned" is repeated in the log while the group is not joined.
UNASSIGNED_LOG_INTERVAL_S = 30.0


class Poller:
    """Polls the replica's consumer (main thread only)."""

    def __init__(self, consumer: Any, tracker: RevocationTracker, log: logging.Logger, *, stage: Any,
                 group_id: str, bootstrap: str, stop: threading.Event, on_assigned: Callable[[], None]) -> None:
        """
        Args:
            consumer: the subscribed consumer.
            tracker: its rebalance listener.
            log: the stage's logger.
            stage: the stage's configuration (name, input topic).
            group_id, bootstrap: named in the "no partition assigned" line.
            stop: set when the replica is asked to stop (a poll backoff ends early).
            on_assigned: called after every poll that finds partitions assigned.
        """
        self.consumer, self.tracker, self.log, self.stage = consumer, tracker, log, stage
        self.group_id, self.bootstrap, self.stop, self.on_assigned = group_id, bootstrap, stop, on_assigned
        self.backoff = Backoff(RETRY_BACKOFF_START_S, RETRY_BACKOFF_MAX_S)
        self.unassigned_since: float | None = None
        self.unassigned_logged = 0.0
        # the tracker's ``changes`` when the assignment was last logged (a hand assignment logs its own)
        self.seen_changes = tracker.changes
        self.seen_partitions: list[int] | None = sorted(tp.partition for tp in tracker.assigned) or None

    def poll(self, timeout_ms: int) -> dict:
        """One poll of at most ``kafka.max_poll_records`` records.

        Args:
            timeout_ms: how long the poll may wait.
        Returns:
            ``{TopicPartition: [records]}`` as kafka-python returns it; empty when nothing came or the
            poll failed (logged; the next poll comes after a backoff).
        """
        try:
            # Up to kafka.max_poll_records records: the fetch position is then past all of them. If the
            # assignment moves before they are all handled, the runner leaves a resume point for the
            # rest (stages/revocations.py): with 16 per poll and no resume point, a partition revoked and
            # given back mid-poll kept its advanced position and the rest were never handled (found by
            # test_scale's autoscaler test).
            polled = self.consumer.poll(timeout_ms=timeout_ms)
        except kafka_errors.KafkaError as exc:
            delay = self.backoff.next()
            self.log.warning("stage %s: poll of %s failed (%s: %s); retrying in %.1fs", self.stage.name,
                             self.stage.input, type(exc).__name__, exc, delay)
            if self.stop.is_set():  # still polling for a micro-batch in hand: do not spin
                time.sleep(min(delay, 1.0))
            else:
                self.stop.wait(delay)
            return {}
        self.backoff.reset()
        self.note_assignment()
        return polled

    def note_assignment(self) -> None:
        """Log a replica without partitions every UNASSIGNED_LOG_INTERVAL_S, and when it has some again."""
        now = time.monotonic()
        if self.tracker.changes != self.seen_changes:  # a rebalance moved it (group members only)
            self.seen_changes = self.tracker.changes
            parts = sorted(tp.partition for tp in self.tracker.assigned)
            if parts != self.seen_partitions:
                self.log.info("stage %s: %s partitions %s assigned by group %s (was %s)", self.stage.name,
                              self.stage.input, parts, self.group_id,
                              "none" if self.seen_partitions is None else self.seen_partitions)
                self.seen_partitions = parts
        if self.tracker.assigned:
            self.on_assigned()
            if self.unassigned_since is not None and now - self.unassigned_since > UNASSIGNED_LOG_INTERVAL_S:
                self.log.info("stage %s: partitions assigned again: %s", self.stage.name,
                              sorted(tp.partition for tp in self.tracker.assigned))
            self.unassigned_since = None
        elif self.unassigned_since is None:
            self.unassigned_since = self.unassigned_logged = now
        elif now - self.unassigned_logged > UNASSIGNED_LOG_INTERVAL_S:
            self.unassigned_logged = now
            self.log.warning("stage %s: no partition of %s assigned for %.0fs (group %s still joining, more "
                             "replicas than partitions, or the broker %s unreachable)", self.stage.name,
                             self.stage.input, now - self.unassigned_since, self.group_id, self.bootstrap)
