"""The replica's side of the rewind handshake (the tool's side and the whole protocol: expstream/tools/rewind.py).

Between two records, at most every ``REWIND_CHECK_INTERVAL_S``, the runner's loop asks
:meth:`ReplicaRewind.maybe_rewind` to read the stage's rewind request from the run state. When one
is set: 1. the micro-batch in hand is already done and committed (the check is between records);
records polled but not handled yet are fetched again (their positions are set back); 2. every
assigned partition is paused and the replica keeps polling (it stays in the group: no rebalance);
3. it acknowledges each step under its heartbeat name ``<replica>:<pid>``; at the ``move`` step it
seeks every partition it owns to the target and commits it (as a member: the commit is accepted);
4. once the request is gone (cleared, or expired: the tool died) it resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition
from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

from expstream.errors import ExpstreamError
from stages.context import StageContext
from stages.pausing import PausedPolling

__all__ = ["REWIND_ACK_TTL_S", "REWIND_CHECK_INTERVAL_S", "ReplicaRewind", "parse_move"]

# Why 0.5 s: how often a replica reads its stage's rewind request between records; one Redis GET per
# replica per half second is nothing, and a rewind waits at most this long for an idle replica.
REWIND_CHECK_INTERVAL_S = 0.5
# Why 30 s: a waiting replica's acknowledgement lives this long unless renewed (every check), so a
# replica that dies while waiting stops counting as acknowledged.
REWIND_ACK_TTL_S = 30.0


class ReplicaRewind:
    """One replica's rewind handshake, driven by the runner's loop (main thread: it uses the consumer)."""

    def __init__(self, ctx: StageContext, consumer: Any, pausing: PausedPolling, replica_key: str,
                 log: logging.Logger, stopping: Callable[[], bool]) -> None:
        """
        Args:
            ctx: the stage's context (its run state holds the request).
            consumer: the replica's consumer (seek and commit at the ``move`` step).
            pausing: pauses, polls paused, resumes and repositions the consumer's partitions.
            replica_key: ``<replica>:<pid>``, the name acknowledgements are made under.
            log: the stage's logger.
            stopping: true once the replica is asked to stop (the wait ends).
        """
        self.ctx, self.consumer, self.pausing, self.replica_key = ctx, consumer, pausing, replica_key
        self.log, self.stopping, self.stage = log, stopping, ctx.stage.name
        self.rewinds = 0  # rewind requests this replica left its group for
        self.next_check = 0.0

    def due(self) -> bool:
        """Whether the next :meth:`maybe_rewind` reads the request (the loop finishes its group first)."""
        return time.monotonic() >= self.next_check

    def maybe_rewind(self, pending: dict[TopicPartition, int] | None = None) -> bool:
        """Between records: when the stage has a rewind request, pause, acknowledge, move the owned
        partitions when told, and resume once the request is gone.

        Args:
            pending: the first record not handled yet of each partition polled (they are fetched again).
        Returns:
            True when a rewind happened (the caller polls afresh).
        """
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + REWIND_CHECK_INTERVAL_S
        try:
            request = self.ctx.state.rewind_request(self.stage)
        except ExpstreamError as exc:  # the state is away: the work path notices and retries; go on
            self.log.warning("stage %s: could not read the rewind request: %s", self.stage, exc)
            return False
        if request is None:
            return False
        self.rewinds += 1
        for tp, offset in (pending or {}).items():
            self.pausing.reposition(tp, offset)
        self.log.warning("stage %s replica %s: rewind request %s: pausing %s (last record committed)",
                         self.stage, self.replica_key, request.split("/")[0], self.ctx.stage.input)
        started, moved, acked = time.monotonic(), set(), None
        while not self.stopping():
            try:
                request = self.ctx.state.rewind_request(self.stage)
                if request is None:
                    break
                if self.move(request, moved):
                    self.ctx.state.ack_rewind(self.stage, request, self.replica_key, REWIND_ACK_TTL_S)
                    if request != acked:
                        self.log.info("stage %s replica %s: acknowledged rewind step %s", self.stage,
                                      self.replica_key, request)
                        acked = request
            except ExpstreamError as exc:
                self.log.warning("stage %s: rewind handshake: run state unreachable (%s); still paused",
                                 self.stage, exc)
            self.pausing.poll_paused()  # keeps the membership; ~BUSY_POLL_MS
        self.pausing.resume_all()
        self.log.warning("stage %s replica %s: rewind done after %.1fs; resuming (moved here: %s)", self.stage,
                         self.replica_key, time.monotonic() - started,
                         ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(moved)) or "none")
        return True

    def move(self, request: str, moved: set[TopicPartition]) -> bool:
        """``<id>/move/<p:offset,...>``: seek and commit every owned partition named.

        Only the partitions of the topics the request names move (generate of a multi-turn run has a runner
        per topic in one replica, each with its own ReplicaRewind; a request of an earlier version names no
        topic: every owned partition named).

        Args:
            request: the request text (any other step than ``move`` asks nothing more than the pause).
            moved: the partitions already moved for this request; updated.
        Returns:
            True when every owned partition named is moved.
        """
        _, _, rest = request.partition("/")
        if not rest.startswith("move/"):
            return True  # the pause step: paused is all it asks
        by_topic = parse_move(rest[5:])
        ok = True
        for tp in sorted(self.consumer.assignment()):
            targets = by_topic.get(tp.topic, by_topic.get(None, {}))
            if tp in moved or tp.partition not in targets:
                continue
            offset = targets[tp.partition]
            try:
                self.consumer.seek(tp, offset)
                self.consumer.commit({tp: OffsetAndMetadata(offset, "", -1)},
                                     timeout_ms=self.ctx.topology.kafka.request_timeout_ms)
            except (kafka_errors.KafkaError, AssertionError) as exc:  # rebalanced meanwhile: tried again
                self.log.warning("stage %s: rewind of %s[%d] to %d not committed yet (%s); retrying",
                                 self.stage, tp.topic, tp.partition, offset, exc)
                ok = False
                continue
            moved.add(tp)
            self.log.warning("stage %s replica %s: rewound %s[%d] to %d (committed)", self.stage,
                             self.replica_key, tp.topic, tp.partition, offset)
        return ok


def parse_move(body: str) -> dict[str | None, dict[int, int]]:
    """``<topic>/<p:offset,...>[/<topic>/...]`` (expstream/tools/rewind.py move_request) -> targets per topic;
    ``<p:offset,...>`` alone (an earlier tool) -> ``{None: targets}``, for every topic."""
    def offsets(text: str) -> dict[int, int]:
        out = {}
        for item in filter(None, text.split(",")):
            partition, offset = item.split(":")
            out[int(partition)] = int(offset)
        return out

    parts = body.split("/")
    if len(parts) == 1:
        return {None: offsets(parts[0])}
    return {parts[i]: offsets(parts[i + 1]) for i in range(0, len(parts) - 1, 2)}
