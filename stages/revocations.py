"""What the consumer's rebalance listener saw: the partitions this replica owns, and whether they moved.

Rebalance listeners run on kafka-python's IO thread, so the tracker only records revocations and
assignments under a lock; the runner's loop (stages/runner.py) acts on them between records: it
commits only partitions it still owns, and sets fetch positions again when the assignment moved
while a record was in hand.
"""

from __future__ import annotations

import threading
from typing import Any

from kafka import ConsumerRebalanceListener, TopicPartition

__all__ = ["RevocationTracker"]


class RevocationTracker(ConsumerRebalanceListener):
    """Runs on the client's IO thread: only records what happened; the main loop acts on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revoked: set[TopicPartition] = set()
        self.assigned: set[TopicPartition] = set()
        self.changes = 0  # bumped on every callback: "the assignment may have moved"

    def on_partitions_revoked(self, revoked: Any) -> None:
        with self.lock:
            self.revoked.update(revoked)
            self.assigned.difference_update(revoked)
            self.changes += 1

    def on_partitions_assigned(self, assigned: Any) -> None:
        with self.lock:
            self.assigned.update(assigned)
            self.revoked.difference_update(assigned)
            self.changes += 1

    def owns(self, tp: TopicPartition) -> bool:
        """Whether ``tp`` is assigned to this consumer now.

        Args:
            tp: a partition of the stage's input topic.
        Returns:
            True when the last callback left it assigned here.
        """
        with self.lock:
            return tp in self.assigned
