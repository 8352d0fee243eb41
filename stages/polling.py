"""A stage replica's polls: up to ``kafka.max_poll_records`` records each, retried with backoff, and what the assignment looks like.

The runner's loop (stages/runner.py) and its paused polling (stages/pausing.py) poll through
:class:`Poller` (main thread only: the consumer is not thread-safe). A poll that fails is logged
and retried after a backoff; a replica that has no partition for long is said so in the log every
``UNASSIGNED_LOG_INTERVAL_S``.

A group member left with no partition while its input has records that nobody commits is in a
stuck group (:class:`StuckGroupWatch`): seen with the embedded Tansu broker when members left in
the middle of a rebalance (a live scale-down) and the one member left was given nothing, for good.
It leaves and joins the group again, which makes the broker hand out the partitions once more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition
from kafka import errors as kafka_errors

from expstream.retry import Backoff
from stages.revocations import RevocationTracker
from stages.sending import RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_START_S

__all__ = ["POLL_TIMEOUT_MS", "UNASSIGNED_LOG_INTERVAL_S", "Poller", "StuckGroupWatch", "stuck_check_s"]

# Why 500 ms: short enough that SIGTERM is noticed quickly, long enough not to spin on an idle topic.
POLL_TIMEOUT_MS = 500
# Why 30 s: how often "no partitions assigned" is repeated in the log while the group is not joined.
UNASSIGNED_LOG_INTERVAL_S = 30.0
# Why 15 s, and at least two session timeouts: a member that has left is out of the group after one session
# timeout, and its rebalance gives the partitions out; a group still without an owner for the waiting
# records after two is stuck. The interval doubles after each rejoin that did not help (up to 5 min), so
# idle replicas beside a peer busy on one long record rejoin rarely.
STUCK_CHECK_MIN_S = 15.0
STUCK_CHECK_MAX_S = 300.0


def stuck_check_s(session_timeout_ms: int) -> float:
    """The first interval of :class:`StuckGroupWatch` for a group with this session timeout."""
    return max(STUCK_CHECK_MIN_S, 2 * session_timeout_ms / 1000)


class StuckGroupWatch:
    """Notices a group member with no partition while records of its input wait and nobody commits them.

    When the replica is left without partitions, and every ``interval_s`` after, it reads the group's
    committed offsets and the partitions' ends; when a partition had records waiting at two readings and its committed offset did not move
    in between, no member is reading it: :meth:`check` says so, and the caller rejoins the group.
    """

    def __init__(self, consumer: Any, topic: str, interval_s: float,
                 ends: Callable[[list[TopicPartition]], dict[TopicPartition, int]]) -> None:
        """
        Args:
            consumer: the group member's consumer (its group's committed offsets).
            topic: the stage's input topic.
            interval_s: between two readings (:func:`stuck_check_s`).
            ends: the partitions' end offsets (expstream.kafka.clients.end_offsets: right on Tansu too).
        """
        self.consumer, self.topic, self.interval_s, self.ends = consumer, topic, interval_s, ends
        self.base_s = interval_s
        self.last: dict[Any, tuple[int | None, int]] | None = None
        self.due = time.monotonic()

    def reset(self) -> None:
        """The replica is left without partitions: start over at the first interval, with a reading now."""
        self.last, self.interval_s = None, self.base_s
        self.due = time.monotonic()

    def check(self, now: float) -> list[int] | None:
        """The input partitions nobody reads (records waiting, no commit for an interval), or None.

        Args:
            now: ``time.monotonic()``.
        Returns:
            None until an interval has passed; then the stuck partitions (the caller rejoins and
            calls :meth:`rejoined`), or None when every waiting partition's commit moved.
        """
        if now < self.due:
            return None
        self.due = now + self.interval_s
        try:
            tps = [TopicPartition(self.topic, p) for p in sorted(self.consumer.partitions_for_topic(self.topic) or ())]
            ends = self.ends(tps)
            seen = {tp: (self.consumer.committed(tp), int(ends.get(tp, 0))) for tp in tps}
        except Exception:  # noqa: BLE001 - the broker is away: the poll's own retries report that
            return None
        last, self.last = self.last, seen
        if last is None:
            return None
        stuck = [tp.partition for tp, (committed, end) in seen.items()
                 if end > (committed or 0) and tp in last and last[tp][0] == committed and last[tp][1] > (committed or 0)]
        return stuck or None

    def rejoined(self) -> None:
        """After a rejoin: read afresh, and wait twice as long before the next one."""
        self.last = None
        self.interval_s = min(STUCK_CHECK_MAX_S, 2 * self.interval_s)
        self.due = time.monotonic() + self.interval_s


class Poller:
    """Polls the replica's consumer (main thread only)."""

    def __init__(self, consumer: Any, tracker: RevocationTracker, log: logging.Logger, *, stage: Any,
                 group_id: str, bootstrap: str, stop: threading.Event, on_assigned: Callable[[], None],
                 stuck: StuckGroupWatch | None = None) -> None:
        """
        Args:
            consumer: the subscribed consumer.
            tracker: its rebalance listener.
            log: the stage's logger.
            stage: the stage's configuration (name, input topic).
            group_id, bootstrap: named in the "no partition assigned" line.
            stop: set when the replica is asked to stop (a poll backoff ends early).
            on_assigned: called after every poll that finds partitions assigned.
            stuck: a group member's watch for a stuck group (None: hand-assigned partitions).
        """
        self.consumer, self.tracker, self.log, self.stage = consumer, tracker, log, stage
        self.group_id, self.bootstrap, self.stop, self.on_assigned = group_id, bootstrap, stop, on_assigned
        self.backoff = Backoff(RETRY_BACKOFF_START_S, RETRY_BACKOFF_MAX_S)
        self.unassigned_since: float | None = None
        self.unassigned_logged = 0.0
        self.stuck = stuck
        self.rejoins = 0
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
            if self.stuck is not None:
                self.stuck.reset()
            self.unassigned_since = self.unassigned_logged = now
        elif self.stuck is not None and (parts := self.stuck.check(now)):
            self.rejoin(parts, now - self.unassigned_since)
        elif now - self.unassigned_logged > UNASSIGNED_LOG_INTERVAL_S:
            self.unassigned_logged = now
            self.log.warning("stage %s: no partition of %s assigned for %.0fs (group %s still joining, more "
                             "replicas than partitions, or the broker %s unreachable)", self.stage.name,
                             self.stage.input, now - self.unassigned_since, self.group_id, self.bootstrap)

    def rejoin(self, partitions: list[int], for_s: float) -> None:
        """Leave the group and join it again (the next poll joins): the broker gives the partitions out anew."""
        self.rejoins += 1
        self.log.warning("stage %s: no partition of %s assigned for %.0fs while %s[%s] have records waiting that "
                         "no member of group %s commits: the group is stuck (a rebalance that gave them to no "
                         "member); leaving and joining it again", self.stage.name, self.stage.input, for_s,
                         self.stage.input, ",".join(map(str, partitions)), self.group_id)
        self.consumer.unsubscribe()
        self.consumer.subscribe([self.stage.input], listener=self.tracker)
        assert self.stuck is not None
        self.stuck.rejoined()
