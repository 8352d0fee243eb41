"""What the consumer's rebalance listener saw: the partitions this replica owns, whether they moved,
and where a partition given back to this replica must resume.

Rebalance listeners run inside ``poll()`` (kafka-python drives the group join from the polling
thread, though a join can span several polls), so the tracker only records revocations and
assignments under a lock; the runner's loop (stages/runner.py) acts on them between records: it
commits only partitions it still owns, and sets fetch positions again when the assignment moved
while records were in hand.

**Resume points.** A poll returns up to ``kafka.max_poll_records`` records; the fetch position of
their partition is already past the last of them. kafka-python (eager rebalancing, its default
assignors) keeps a partition's fetch position when a rebalance revokes it and gives it back to the
same member. So records of a poll that the runner did not handle because their partition was
revoked meanwhile (or because the assignment moved while an earlier one was in hand) would be
skipped for good once the partition comes back. The runner leaves a *resume point* for such a
partition (:meth:`RevocationTracker.leave_unhandled`: the first record not handled), and as soon
as the partition is its own again with the same fetch state, seeks it there
(:meth:`RevocationTracker.due_seeks`). A partition that left kafka-python's assignment in between
(given to another member, or lost with the membership) comes back with a fresh position, read from
the committed offset, and its resume point is dropped: nothing was skipped then. Which of the two
happened is told by the partition's *tenure*, a counter bumped every time the partition leaves the
assignment.
"""

from __future__ import annotations

import threading
from typing import Any

from kafka import ConsumerRebalanceListener, TopicPartition

__all__ = ["RevocationTracker"]


class RevocationTracker(ConsumerRebalanceListener):
    """Records revocations and assignments (the client's callbacks); the main loop acts on them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revoked: set[TopicPartition] = set()
        self.assigned: set[TopicPartition] = set()
        self.changes = 0  # bumped on every callback: "the assignment may have moved"
        # kafka-python's assignment as of the last on_partitions_assigned (eager: the whole set)
        self.held: set[TopicPartition] = set()
        self.tenures: dict[TopicPartition, int] = {}  # bumped when a partition leaves the assignment
        self.unhandled: dict[TopicPartition, tuple[int, int]] = {}  # tp -> (first offset not handled, tenure)

    def on_partitions_revoked(self, revoked: Any) -> None:
        # Eager rebalancing: a notification; kafka-python keeps the partitions (and their positions)
        # until the new assignment replaces them in on_partitions_assigned.
        with self.lock:
            self.revoked.update(revoked)
            self.assigned.difference_update(revoked)
            self.changes += 1

    def on_partitions_lost(self, lost: Any) -> None:
        # The membership was lost: kafka-python empties the assignment, positions go with it.
        with self.lock:
            self.revoked.update(lost)
            self.assigned.difference_update(lost)
            self.leave(set(lost))
            self.changes += 1

    def on_partitions_assigned(self, assigned: Any) -> None:
        with self.lock:
            new = set(assigned)
            self.leave(self.held - new)
            self.held = new
            self.assigned.update(new)
            self.revoked.difference_update(new)
            self.changes += 1

    def leave(self, gone: set[TopicPartition]) -> None:
        """Partitions that left kafka-python's assignment (lock held): new tenures, no resume points."""
        for tp in gone:
            self.tenures[tp] = self.tenures.get(tp, 0) + 1
            self.unhandled.pop(tp, None)
        self.held -= gone

    def owns(self, tp: TopicPartition) -> bool:
        """Whether ``tp`` is assigned to this consumer now.

        Args:
            tp: a partition of the stage's input topic.
        Returns:
            True when the last callback left it assigned here.
        """
        with self.lock:
            return tp in self.assigned

    def tenure(self, tp: TopicPartition) -> int:
        """How many times ``tp`` has left this consumer's assignment (a fetch position belongs to one tenure)."""
        with self.lock:
            return self.tenures.get(tp, 0)

    def leave_unhandled(self, tp: TopicPartition, offset: int, tenure: int) -> None:
        """Note that records of ``tp`` from ``offset`` on were polled in ``tenure`` and not handled.

        Args:
            tp: the partition; offset: its first record not handled (the lowest one noted wins).
            tenure: :meth:`tenure` of ``tp`` when the records were polled.
        """
        with self.lock:
            if self.tenures.get(tp, 0) != tenure:
                return  # the partition left the assignment since: it resumes from the committed offset
            known = self.unhandled.get(tp)
            if known is None or offset < known[0]:
                self.unhandled[tp] = (offset, tenure)

    @property
    def pending(self) -> bool:
        """Whether any resume point is waiting (cheap: read without the lock by the main loop)."""
        return bool(self.unhandled)

    def due_seeks(self) -> dict[TopicPartition, int]:
        """The resume points whose partition is this consumer's again, taken (the caller seeks them).

        Returns:
            ``{tp: offset}`` for every partition owned now in the tenure its resume point was left
            in; resume points of partitions still in a rebalance stay.
        """
        with self.lock:
            due = {tp: offset for tp, (offset, tenure) in self.unhandled.items()
                   if tp in self.assigned and self.tenures.get(tp, 0) == tenure}
            for tp in due:
                del self.unhandled[tp]
            return due
