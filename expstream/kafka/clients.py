"""Kafka plumbing: client settings, producer/consumer/admin factories, confirmed sends, lag, replay.

Everything here is plain kafka-python (>= 3.0.12), but the producer and the stage runner's consumer of
``kafka.client: confluent`` (confluent-kafka: expstream/kafka/rdkafka.py, rdconsumer.py), and works the same against Apache Kafka and the
embedded Tansu broker. Payloads are ``bytes`` in and out: no serializers or deserializers are
installed, because a ``value_deserializer`` runs inside the fetcher and one undecodable record would
then block its partition. Stages decode under ``try/except`` and route failures to the DLQ.

Delivery rule used by every stage: an input offset is committed only after every output record is
acknowledged (:func:`send_all_and_confirm`), since ``producer.flush()`` does not raise per-record
errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import OffsetSpec
from kafka.consumer.fetcher import ConsumerRecord
from kafka.producer.future import RecordMetadata

from expstream.config.kafka import CONFLUENT, KafkaConfig, MiB
from expstream.errors import BrokerUnavailableError, ProduceError
from expstream.kafka.partitioning import RoundRobinPartitioner

__all__ = [
    "MiB",
    "KafkaConfig",
    "OutRecord",
    "make_producer",
    "make_consumer",
    "make_runner_consumer",
    "make_admin",
    "send_and_confirm",
    "send_all_and_confirm",
    "topic_lag",
    "end_offsets",
    "read_topic",
    "ConsumerRecord",
    "RecordMetadata",
]

log = logging.getLogger("expstream.bus")


# How often read_topic() polls while waiting for the end-offset snapshot to be reached. Short,
# because read_topic is used by tests and replays where latency matters more than request count.
READ_POLL_MS = 200
# How long the end-offset probe's fetches may wait on the broker for data. Short, because an empty
# partition is answered only after this wait, and the probe needs only the response's high watermark.
PROBE_FETCH_WAIT_MS = 10

def _bootstrap_list(bootstrap: str | Sequence[str]) -> list[str]:
    if isinstance(bootstrap, str):
        return [s.strip() for s in bootstrap.split(",") if s.strip()]
    return list(bootstrap)


def _unavailable(bootstrap: str | Sequence[str], role: str, exc: BaseException) -> BrokerUnavailableError:
    return BrokerUnavailableError(f"no Kafka broker reachable at {bootstrap!r} for a {role}: {exc}")


# Errors a client constructor raises when it cannot reach a bootstrap server. kafka-python 3.0
# raises KafkaTimeoutError("Unable to bootstrap ..."); older versions NoBrokersAvailable.
_BOOTSTRAP_ERRORS: tuple[type[BaseException], ...] = tuple(
    t
    for t in (
        getattr(kafka_errors, n, None)
        for n in ("NoBrokersAvailable", "KafkaTimeoutError", "KafkaConnectionError")
    )
    if isinstance(t, type)
)


def make_producer(
    bootstrap: str | Sequence[str], cfg: KafkaConfig | None = None, *, spread: bool = False, **overrides: Any
) -> KafkaProducer:
    """A KafkaProducer taking ``bytes`` values/keys (no serializers). ``overrides`` win over ``cfg``.

    With ``kafka.client: confluent`` a confluent-kafka (librdkafka) producer answering the same calls
    (expstream/kafka/rdkafka.py); ``overrides`` (kafka-python arguments) are refused then.

    ``spread``: records go round-robin over a topic's partitions instead of by key hash (the pipeline's
    data records: the feeder's and every stage's outputs; expstream/kafka/partitioning.py), so that
    the replicas of the next stage get even shares on short runs too. Without it a key keeps its
    partition (the tools, the policy log, dead-letter redrives)."""
    cfg = cfg or KafkaConfig()
    if cfg.client == CONFLUENT:
        if overrides:
            raise TypeError(f"make_producer: overrides {sorted(overrides)} are kafka-python arguments; with "
                            "kafka.client=confluent put librdkafka properties in kafka.extra.librdkafka")
        from expstream.kafka.rdkafka import RdkafkaProducer

        return RdkafkaProducer(_bootstrap_list(bootstrap), cfg, spread=spread)
    kw = {**cfg.client_kwargs("producer"), **overrides}
    if spread:
        kw.setdefault("partitioner", RoundRobinPartitioner())
    try:
        return KafkaProducer(bootstrap_servers=_bootstrap_list(bootstrap), **kw)
    except _BOOTSTRAP_ERRORS as exc:
        raise _unavailable(bootstrap, "producer", exc) from exc


def make_consumer(
    bootstrap: str | Sequence[str],
    group_id: str | None,
    cfg: KafkaConfig | None = None,
    topics: Sequence[str] | None = None,
    **overrides: Any,
) -> KafkaConsumer:
    """A KafkaConsumer with manual commits, no topic auto-creation and no value deserializer.

    ``topics`` given: subscribe to them (group membership, needs ``group_id``). Otherwise the caller
    subscribes or assigns partitions itself. ``group_id=None`` gives a group-less consumer (replay).
    """
    cfg = cfg or KafkaConfig()
    kw = {**cfg.client_kwargs("consumer"), **overrides}
    try:
        consumer = KafkaConsumer(bootstrap_servers=_bootstrap_list(bootstrap), group_id=group_id, **kw)
    except _BOOTSTRAP_ERRORS as exc:
        raise _unavailable(bootstrap, "consumer", exc) from exc
    if topics:
        consumer.subscribe(list(topics))
    return consumer


def make_runner_consumer(bootstrap: str | Sequence[str], group_id: str, cfg: KafkaConfig) -> Any:
    """The stage runner's consumer (stages/runner.py): :func:`make_consumer`'s, or with ``kafka.client:
    confluent`` a confluent-kafka (librdkafka) consumer answering the runner's calls with kafka-python's
    semantics (expstream/kafka/rdconsumer.py). Every other consumer (tools, the trainer) is kafka-python's."""
    if cfg.client == CONFLUENT:
        from expstream.kafka.rdconsumer import RdkafkaConsumer

        return RdkafkaConsumer(_bootstrap_list(bootstrap), group_id, cfg)
    return make_consumer(bootstrap, group_id, cfg)


def make_admin(
    bootstrap: str | Sequence[str], cfg: KafkaConfig | None = None, **overrides: Any
) -> KafkaAdminClient:
    cfg = cfg or KafkaConfig()
    kw = {**cfg.client_kwargs("admin"), **overrides}
    try:
        return KafkaAdminClient(bootstrap_servers=_bootstrap_list(bootstrap), **kw)
    except _BOOTSTRAP_ERRORS as exc:
        raise _unavailable(bootstrap, "admin client", exc) from exc


class OutRecord(NamedTuple):
    """One record to send: ``send_all_and_confirm`` also accepts plain 2-4 tuples in this order."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: list[tuple[str, bytes]] | None = None


def _send(producer: KafkaProducer, rec: OutRecord):
    if not isinstance(rec.value, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"record values are bytes (encode with schemas.codec first), got {type(rec.value).__name__}"
        )
    try:
        return producer.send(rec.topic, value=rec.value, key=rec.key, headers=rec.headers or None)
    except kafka_errors.KafkaError as exc:
        raise ProduceError(f"send to {rec.topic!r} failed: {exc!r}", cause=exc) from exc


def _confirm(future, topic: str, timeout_s: float) -> RecordMetadata:
    try:
        md = future.get(timeout=max(timeout_s, 0.0))
    except kafka_errors.KafkaError as exc:
        raise ProduceError(f"record to {topic!r} not acknowledged: {exc!r}", cause=exc) from exc
    if md is None:  # kafka-python < 3.0.12 could return None on timeout
        raise ProduceError(f"record to {topic!r} not acknowledged within {timeout_s:.1f}s")
    return md


def send_and_confirm(
    producer: KafkaProducer,
    topic: str,
    value: bytes,
    key: bytes | None = None,
    headers: list[tuple[str, bytes]] | None = None,
    timeout_s: float = 30.0,
) -> RecordMetadata:
    """Send one record and wait for its acknowledgement; ProduceError when it is not acknowledged."""
    fut = _send(producer, OutRecord(topic, value, key, headers))
    return _confirm(fut, topic, timeout_s)


def send_all_and_confirm(
    producer: KafkaProducer,
    items: Iterable[OutRecord | tuple],
    timeout_s: float = 30.0,
) -> list[RecordMetadata]:
    """Send every record, flush, then check every future (flush does not raise per-record errors).

    Returns the metadata in input order. Raises ProduceError naming the first failed record (and how
    many failed) once all futures have been looked at; some records may then have been written, which
    at-least-once delivery plus idempotent ids downstream tolerates.
    """
    deadline = time.monotonic() + timeout_s
    sent = send_all(producer, items)
    if not sent:
        return []
    flush(producer, deadline - time.monotonic())
    return confirm_all(sent, deadline - time.monotonic())


def send_all(producer: KafkaProducer, items: Iterable[OutRecord | tuple]) -> list[tuple[OutRecord, Any]]:
    """Hand every record to the producer without waiting: ``(record, future)`` pairs for
    :func:`confirm_all` after a :func:`flush` (several callers' records can share one flush)."""
    recs = [r if isinstance(r, OutRecord) else OutRecord(*r) for r in items]
    return [(r, _send(producer, r)) for r in recs]


def flush(producer: KafkaProducer, timeout_s: float) -> None:
    """Flush the producer; a timeout is not raised (the futures' :func:`confirm_all` says what is missing)."""
    try:
        producer.flush(timeout=max(timeout_s, 0.0))
    except kafka_errors.KafkaTimeoutError:
        pass


def confirm_all(sent: Sequence[tuple[OutRecord, Any]], timeout_s: float) -> list[RecordMetadata]:
    """Check every future of :func:`send_all` (after a flush); ProduceError as in :func:`send_all_and_confirm`."""
    deadline = time.monotonic() + timeout_s
    out: list[RecordMetadata] = []
    failures: list[ProduceError] = []
    for rec, fut in sent:
        try:
            out.append(_confirm(fut, rec.topic, deadline - time.monotonic()))
        except ProduceError as exc:
            failures.append(exc)
    if failures:
        first = failures[0]
        err = ProduceError(
            f"{len(failures)} of {len(sent)} records not acknowledged; first: {first}", cause=first.cause,
            refused=not first.retriable)
        raise err from first
    return out


def partitions_of(admin: KafkaAdminClient, topic: str) -> list[TopicPartition]:
    desc = admin.describe_topics([topic])
    if not desc or desc[0].get("error_code", 0) != 0:
        raise kafka_errors.UnknownTopicOrPartitionError(f"topic {topic!r} not found")
    return [
        TopicPartition(topic, p["partition_index"])
        for p in sorted(desc[0]["partitions"], key=lambda p: p["partition_index"])
    ]


def end_offsets(
    bootstrap: str | Sequence[str],
    cfg: KafkaConfig | None,
    partitions: Sequence[TopicPartition],
    *,
    timeout_s: float = 30.0,
) -> dict[TopicPartition, int]:
    """The high watermark (offset of the next record) of each partition, from a group-less probe.

    Why not just ``ListOffsets(LATEST)`` (``consumer.end_offsets``, ``admin.list_partition_offsets``):
    Tansu 0.6 answers it with *base offset of the last record batch + 1*, so after one batch of 5
    records it says 1, not 5. The high watermark in a Fetch response is right on every broker. So:
    take ListOffsets' answer L, fetch once from max(L - 1, start) (one record batch at most: the
    last one) and take max(L, the fetch's high watermark). On Apache Kafka both agree.
    """
    cfg = cfg or KafkaConfig()
    tps = list(partitions)
    if not tps:
        return {}
    deadline = time.monotonic() + timeout_s
    probe = make_consumer(
        bootstrap,
        None,
        cfg,
        fetch_max_wait_ms=PROBE_FETCH_WAIT_MS,
        max_poll_records=1,
        max_partition_fetch_bytes=1,
    )  # brokers still return the first whole batch
    try:
        listed = probe.end_offsets(tps)
        starts = probe.beginning_offsets(tps)
        todo = [tp for tp in tps if listed[tp] > starts[tp]]  # an empty partition needs no probe
        if todo:
            probe.assign(todo)
            for tp in todo:
                probe.seek(tp, max(listed[tp] - 1, starts[tp]))
            while any(probe.highwater(tp) is None for tp in todo):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailableError(f"no fetch response for {todo} within {timeout_s:.1f}s")
                probe.poll(timeout_ms=int(min(left * 1000, READ_POLL_MS)))
        return {tp: max(listed[tp], probe.highwater(tp) or 0) if tp in todo else listed[tp] for tp in tps}
    finally:
        probe.close()


def topic_lag(
    bootstrap: str | Sequence[str],
    cfg: KafkaConfig | None,
    group_id: str,
    topic: str,
    *,
    admin: KafkaAdminClient | None = None,
    timeout_s: float = 30.0,
) -> dict[int, int]:
    """Records of ``topic`` not yet committed by ``group_id``, per partition, seen from outside the group.

    lag = end offset (:func:`end_offsets`) - committed offset; a partition without a commit counts
    from its earliest offset (auto_offset_reset="earliest"). Does not join the group.
    """
    own = admin is None
    admin = admin or make_admin(bootstrap, cfg)
    try:
        tps = partitions_of(admin, topic)
        starts = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps})
        try:
            committed = admin.list_group_offsets({group_id: tps}).get(group_id, {})
        except kafka_errors.BrokerResponseError as exc:  # e.g. GroupIdNotFound on some brokers
            log.debug("no committed offsets for group %s: %r", group_id, exc)
            committed = {}
        ends = end_offsets(bootstrap, cfg, tps, timeout_s=timeout_s)
        lag: dict[int, int] = {}
        for tp in tps:
            c = committed.get(tp)
            pos = c.offset if c is not None and c.offset is not None and c.offset >= 0 else starts[tp].offset
            lag[tp.partition] = max(0, ends[tp] - pos)
        return lag
    finally:
        if own:
            admin.close()


def read_topic(
    bootstrap: str | Sequence[str],
    cfg: KafkaConfig | None,
    topic: str,
    *,
    timeout_s: float = 30.0,
    max_records: int | None = None,
) -> Iterator[ConsumerRecord]:
    """Yield every record of ``topic`` present when the call starts, then stop.

    No consumer group: all partitions are assigned, sought to the beginning, and read up to the end
    offsets snapshotted at the start (records produced later are not returned). Records come in
    offset order within a partition. Raises BrokerUnavailableError when the snapshot is not reached
    within ``timeout_s``.
    """
    cfg = cfg or KafkaConfig()
    deadline = time.monotonic() + timeout_s
    # max_poll_records=1 suits stages; a reader takes what a fetch returns.
    consumer = make_consumer(bootstrap, None, cfg, max_poll_records=500)
    try:
        parts = None
        while parts is None:
            parts = consumer.partitions_for_topic(topic)
            if parts is None:
                if time.monotonic() > deadline:
                    raise BrokerUnavailableError(f"topic {topic!r} not found within {timeout_s:.1f}s")
                time.sleep(0.05)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        ends = end_offsets(bootstrap, cfg, tps, timeout_s=max(deadline - time.monotonic(), 1.0))
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        remaining = {tp for tp in tps if consumer.position(tp) < ends[tp]}
        count = 0
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                todo = {tp.partition: ends[tp] - consumer.position(tp) for tp in remaining}
                raise BrokerUnavailableError(
                    f"read_topic({topic!r}) timed out after {timeout_s:.1f}s; "
                    f"records left per partition: {todo}"
                )
            batch = consumer.poll(timeout_ms=int(min(left * 1000, READ_POLL_MS)))
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset >= ends[tp]:
                        continue
                    yield rec
                    count += 1
                    if max_records is not None and count >= max_records:
                        return
            for tp in list(remaining):
                if consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        consumer.close()
