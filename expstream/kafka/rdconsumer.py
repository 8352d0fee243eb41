"""The stage runner's consumer for ``kafka.client: confluent``: confluent-kafka (librdkafka) behind the
kafka-python calls the runner makes.

Why: one record at a time, a replica's fetch (poll plus kafka-python's IO thread) is ~1.2 ms of the
~2 ms of CPU a hop costs; librdkafka fetches, heartbeats and commits in C on threads of its own
(bench/README.md "kafka.client"). Only the stage runner's consumer is swapped (stages/runner.py through
:func:`expstream.kafka.clients.make_runner_consumer`); the tools, the trainer's stream and every other
consumer stay kafka-python.

:class:`RdkafkaConsumer` answers exactly the calls of stages/ (runner, polling, pausing, assigning,
revocations, rewinding, commitgroup), with kafka-python's semantics:

* ``poll(timeout_ms)``: ``{TopicPartition: [records]}`` (kafka-python's ``TopicPartition``; each record
  with ``topic partition offset timestamp key value headers``, headers ``[]`` when there are none), at
  most ``kafka.max_poll_records`` records (``consume(num_messages=...)``); rebalance callbacks run inside
  it, as kafka-python's do. A record-level error (e.g. a topic not there yet) is logged, not returned.
* ``subscribe(topics, listener=)``: the listener's ``on_partitions_revoked`` / ``_assigned`` / ``_lost``
  called from librdkafka's on_revoke / on_assign / on_lost. **Eager rebalancing keeps a partition's
  fetch position and paused flag when it is revoked and given back to the same member**, as
  kafka-python's ``assign_from_subscribed`` does: librdkafka would restart it from the committed offset,
  so the adapter notes each revoked partition's position (the offset after the last record ``poll``
  returned, or where ``seek`` put it) and assigns it back at that offset (stages/revocations.py's resume
  points rely on it). A partition that goes elsewhere, or is lost, starts from the committed offset.
* ``assign(tps)`` (static assignment, stages/assigning.py): no group join, the committed offset or
  ``auto_offset_reset``; commits then carry no generation, as kafka-python's.
* ``seek``, ``pause(*tps)``, ``resume(*tps)``, ``paused()``, ``assignment()`` (kept here, no round trip
  to librdkafka's main thread), ``position(tp)``, ``highwater(tp)`` (the last fetch's high watermark,
  ``get_watermark_offsets(cached=True)``; None before one), ``partitions_for_topic``, ``close()``.
* ``commit(offsets, timeout_ms=)``: synchronous, with the explicit offsets only; a refusal raises the
  kafka-python error of the same broker code (``IllegalGenerationError``, ``RebalanceInProgressError``,
  ... which the commit group treats as "rebalanced"), a local failure a retriable ``KafkaConnectionError``
  or ``KafkaTimeoutError``.

Settings (:func:`rdkafka_consumer_config`) come from the same ``KafkaConfig`` fields: session timeout,
heartbeat, max poll interval, fetch wait (``fetch.wait.max.ms``), fetch sizes, offset reset,
``isolation.level`` read_uncommitted (kafka-python's; librdkafka's own default is read_committed), no
auto commit, no auto offset store, no topic auto-creation; ``kafka.extra.librdkafka`` is added last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from kafka import TopicPartition
from kafka import errors as kafka_errors

from expstream.config.kafka import LIBRDKAFKA, KafkaConfig, MiB
from expstream.errors import BrokerUnavailableError
from expstream.kafka.rdkafka import warn_unapplied_extra

__all__ = ["RdRecord", "RdkafkaConsumer", "kafka_error", "rdkafka_consumer_config"]

log = logging.getLogger("expstream.bus")

# librdkafka's logical offset "none given: the committed one, else auto.offset.reset"
OFFSET_INVALID = -1001


class RdRecord(NamedTuple):
    """One consumed record: the fields of kafka-python's ConsumerRecord the stages read."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def rdkafka_consumer_config(bootstrap: list[str], group_id: str | None, cfg: KafkaConfig) -> dict[str, Any]:
    """librdkafka consumer properties equivalent to ``cfg.client_kwargs("consumer")`` (the module docstring)."""
    conf: dict[str, Any] = {
        "bootstrap.servers": ",".join(bootstrap),
        "session.timeout.ms": cfg.session_timeout_ms,
        "heartbeat.interval.ms": cfg.heartbeat_interval_ms,
        "max.poll.interval.ms": cfg.max_poll_interval_ms,
        "fetch.wait.max.ms": cfg.fetch_max_wait_ms,
        "fetch.max.bytes": cfg.fetch_max_bytes,
        "max.partition.fetch.bytes": cfg.max_partition_fetch_bytes,
        # responses carry whole micro-batches (kafka-python's receive_message_max_bytes, clients.py)
        "receive.message.max.bytes": max(100_000_000, cfg.fetch_max_bytes + MiB),
        "auto.offset.reset": cfg.auto_offset_reset,
        "isolation.level": "read_uncommitted",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "allow.auto.create.topics": False,
        "socket.timeout.ms": cfg.request_timeout_ms,
        "retry.backoff.ms": cfg.retry_backoff_ms,
        "reconnect.backoff.max.ms": cfg.reconnect_backoff_max_ms,
        "socket.nagle.disable": True,
        "security.protocol": cfg.security_protocol.lower(),
        "logger": logging.getLogger("expstream.bus.rdkafka"),
    }
    if group_id is not None:
        conf["group.id"] = group_id
    sasl = cfg.sasl_kwargs()
    if sasl:
        conf.update({"sasl.mechanism": sasl["sasl_mechanism"], "sasl.username": sasl["sasl_plain_username"],
                     "sasl.password": sasl["sasl_plain_password"]})
    conf.update(cfg.extra.get(LIBRDKAFKA, {}))
    warn_unapplied_extra(cfg, "consumer")
    return conf


def kafka_error(err: Any, what: str) -> kafka_errors.KafkaError:
    """kafka-python's error for a librdkafka ``KafkaError``: a broker code's own class (its ``retriable``
    as kafka-python has it), a local timeout ``KafkaTimeoutError``, a local state error
    ``IllegalStateError``, any other local failure a retriable ``KafkaConnectionError``."""
    from confluent_kafka import KafkaError

    code = err.code()
    text = f"{what}: {err.str()} (librdkafka {err.name()})"
    if code >= 0:
        return kafka_errors.for_code(code)(text)
    if code == KafkaError._TIMED_OUT:
        return kafka_errors.KafkaTimeoutError(text)
    if code in (KafkaError._STATE, KafkaError._UNKNOWN_PARTITION):
        return kafka_errors.IllegalStateError(text)
    return kafka_errors.KafkaConnectionError(text)


class RdkafkaConsumer:
    """A librdkafka consumer answering the runner's kafka-python calls (the module docstring)."""

    def __init__(self, bootstrap: list[str], group_id: str | None, cfg: KafkaConfig) -> None:
        from confluent_kafka import Consumer, KafkaException

        self._c = Consumer(rdkafka_consumer_config(bootstrap, group_id, cfg))
        self._max_records = cfg.max_poll_records
        self._timeout_s = cfg.request_timeout_ms / 1000
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}  # the offset after the last record returned, or sought
        # revoked, until the next assignment: [position, paused] (kafka-python keeps them in its assignment meanwhile)
        self._kept: dict[TopicPartition, list] = {}
        self._listener: Any = None
        self._tps: dict[tuple[str, int], TopicPartition] = {}
        try:  # as kafka-python's constructor: reach a bootstrap server now, or BrokerUnavailableError
            self._c.list_topics(timeout=cfg.bootstrap_timeout_ms / 1000)
        except KafkaException as exc:
            self._c.close()
            raise BrokerUnavailableError(f"no Kafka broker reachable at {','.join(bootstrap)!r} for a consumer "
                                         f"(confluent-kafka): {exc}") from exc
        from confluent_kafka import libversion

        log.info("consumer of group %s: librdkafka %s (kafka.client: confluent)", group_id, libversion()[0])

    # -- conversions -------------------------------------------------------------------------------
    def _tp(self, topic: str, partition: int) -> TopicPartition:
        tp = self._tps.get((topic, partition))
        if tp is None:
            tp = self._tps[(topic, partition)] = TopicPartition(topic, partition)
        return tp

    @staticmethod
    def _ctps(tps: Iterable[TopicPartition], offsets: Callable[[TopicPartition], int] | None = None) -> list:
        from confluent_kafka import TopicPartition as CTP

        if offsets is None:
            return [CTP(tp.topic, tp.partition) for tp in tps]
        return [CTP(tp.topic, tp.partition, offsets(tp)) for tp in tps]

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` with librdkafka's exceptions as kafka-python's (:func:`kafka_error`)."""
        from confluent_kafka import KafkaException

        try:
            return fn(*args, **kw)
        except KafkaException as exc:
            raise kafka_error(exc.args[0], what) from exc

    # -- membership ----------------------------------------------------------------------------------
    def subscribe(self, topics: Sequence[str], listener: Any = None) -> None:
        """Join the group for ``topics``; ``listener`` gets kafka-python's rebalance callbacks."""
        self._listener = listener
        self._call("subscribe", self._c.subscribe, list(topics), on_assign=self._on_assign,
                   on_revoke=self._on_revoke, on_lost=self._on_lost)

    def _on_revoke(self, _consumer: Any, partitions: list) -> None:
        tps = [self._tp(p.topic, p.partition) for p in partitions]
        if self._listener is not None:
            self._listener.on_partitions_revoked(tps)
        # kept for a give-back: kafka-python keeps the state of a partition in the old and the new assignment
        self._kept = {tp: [self._positions.get(tp), tp in self._paused] for tp in self._assigned}
        self._drop_assignment()

    def _on_lost(self, _consumer: Any, partitions: list) -> None:
        tps = [self._tp(p.topic, p.partition) for p in partitions]
        if self._listener is not None:
            self._listener.on_partitions_lost(tps)
        self._kept = {}
        self._drop_assignment()

    def _drop_assignment(self) -> None:
        # librdkafka keeps a partition's pause flag across an unassign: a partition paused when revoked would
        # come back paused whatever the runner resumed meanwhile (found by the given-back-mid-poll test)
        if self._paused:
            self._c.resume(self._ctps(self._paused))
        self._c.unassign()
        self._assigned, self._paused = set(), set()
        self._positions = {}

    def _on_assign(self, _consumer: Any, partitions: list) -> None:
        tps = [self._tp(p.topic, p.partition) for p in partitions]
        kept, self._kept = self._kept, {}
        positions = {tp: kept[tp][0] for tp in tps if tp in kept and kept[tp][0] is not None}
        self._c.assign(self._ctps(tps, lambda tp: positions.get(tp, OFFSET_INVALID)))
        self._assigned, self._positions = set(tps), positions
        repause = [tp for tp in tps if tp in kept and kept[tp][1]]
        if repause:
            self.pause(*repause)
        if self._listener is not None:
            self._listener.on_partitions_assigned(tps)

    def assign(self, partitions: Sequence[TopicPartition]) -> None:
        """Take ``partitions`` by hand (no group join): each from its committed offset."""
        tps = [self._tp(tp.topic, tp.partition) for tp in partitions]
        self._call("assign", self._c.assign, self._ctps(tps))
        self._assigned, self._paused, self._positions = set(tps), set(), {}

    def assignment(self) -> set[TopicPartition]:
        """The partitions assigned, and, between a revocation and the next assignment, the revoked ones
        (kafka-python's eager rebalance keeps them in its assignment until it is replaced)."""
        return self._assigned | set(self._kept)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        """The partition ids of ``topic`` from the broker's metadata; None when it is not known."""
        md = self._call(f"metadata of {topic}", self._c.list_topics, topic, timeout=self._timeout_s).topics.get(topic)
        if md is None or md.error is not None or not md.partitions:
            return None
        return set(md.partitions)

    # -- fetching --------------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[TopicPartition, list[RdRecord]]:
        """Up to ``max_records`` (``kafka.max_poll_records``) records, grouped by partition in fetch order."""
        n = max_records or self._max_records
        # consume() waits for all n messages (or the timeout); kafka-python returns as soon as any came. So:
        # what is there now, else wait for one (poll) and take what came with it.
        msgs = self._call("poll", self._c.consume, n, 0)
        if not msgs and timeout_ms > 0:
            first = self._call("poll", self._c.poll, timeout_ms / 1000)
            if first is not None:
                msgs = [first, *(self._call("poll", self._c.consume, n - 1, 0) if n > 1 else [])]
        out: dict[TopicPartition, list[RdRecord]] = {}
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal():
                    raise kafka_error(err, "poll")
                log.warning("consumer: %s[%s]: %s (librdkafka %s); librdkafka retries it", m.topic(), m.partition(),
                            err.str(), err.name())
                continue
            tp = self._tp(m.topic(), m.partition())
            offset = m.offset()
            out.setdefault(tp, []).append(RdRecord(tp.topic, tp.partition, offset, m.timestamp()[1], m.key(),
                                                   m.value(), m.headers() or []))
            self._positions[tp] = offset + 1
        return out

    def seek(self, partition: TopicPartition, offset: int) -> None:
        """The next ``poll`` of ``partition`` starts at ``offset``; IllegalStateError when it is not assigned."""
        tp = self._tp(partition.topic, partition.partition)
        if tp in self._kept:  # revoked, not yet reassigned: the position it comes back with
            self._kept[tp][0] = offset
            return
        if tp not in self._assigned:
            raise kafka_errors.IllegalStateError(f"seek: {tp.topic}[{tp.partition}] is not assigned to this consumer")
        self._call(f"seek {tp.topic}[{tp.partition}] to {offset}", self._c.seek, self._ctps([tp], lambda _: offset)[0])
        self._positions[tp] = offset

    def position(self, partition: TopicPartition) -> int | None:
        """The offset of the next record ``poll`` returns for ``partition`` (None when not known yet)."""
        tp = self._tp(partition.topic, partition.partition)
        known = self._kept[tp][0] if tp in self._kept else self._positions.get(tp)
        if tp in self._kept or known is not None:
            return known
        got = self._call("position", self._c.position, self._ctps([tp]))[0].offset
        return got if got >= 0 else None

    def highwater(self, partition: TopicPartition) -> int | None:
        """The high watermark of ``partition`` from the last fetch response; None before one."""
        try:
            _, high = self._c.get_watermark_offsets(self._ctps([partition])[0], cached=True)
        except Exception:  # noqa: BLE001 - not known (librdkafka raises for an unknown partition)
            return None
        return high if high is not None and high >= 0 else None

    def pause(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            if tp in self._kept:
                self._kept[tp][1] = True
        tps = [self._tp(tp.topic, tp.partition) for tp in partitions if tp in self._assigned]
        if tps:
            self._call("pause", self._c.pause, self._ctps(tps))
            self._paused.update(tps)

    def resume(self, *partitions: TopicPartition) -> None:
        for tp in partitions:
            if tp in self._kept:
                self._kept[tp][1] = False
        tps = [self._tp(tp.topic, tp.partition) for tp in partitions if tp in self._paused]
        if tps:
            self._call("resume", self._c.resume, self._ctps(tps))
            self._paused.difference_update(tps)

    def paused(self) -> set[TopicPartition]:
        return self._paused | {tp for tp, (_, paused) in self._kept.items() if paused}

    # -- commits ---------------------------------------------------------------------------------------
    def commit(self, offsets: dict[TopicPartition, Any], timeout_ms: int | None = None) -> None:
        """Commit exactly ``offsets`` (``{tp: OffsetAndMetadata}``), synchronously; kafka-python's errors.

        ``timeout_ms`` is not librdkafka's to take: a synchronous commit is bounded by the request timeout
        (``socket.timeout.ms`` = ``kafka.request_timeout_ms``)."""
        from confluent_kafka import TopicPartition as CTP

        todo = [CTP(tp.topic, tp.partition, om.offset) for tp, om in offsets.items()]
        done = self._call("commit", self._c.commit, offsets=todo, asynchronous=False) or []
        for p in done:
            if p.error is not None:
                raise kafka_error(p.error, f"commit of {p.topic}[{p.partition}]@{p.offset}")

    def close(self, autocommit: bool = False) -> None:
        """Leave the group (nothing is committed: auto commit is off) and end librdkafka's threads."""
        try:
            self._c.close()
        except RuntimeError:  # closed already
            pass
