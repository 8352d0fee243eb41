"""The producer of ``kafka.client: confluent``: confluent-kafka (librdkafka) behind kafka-python's producer calls.

Why: a stage's outputs cost ~0.5 ms of CPU per record through kafka-python's Python protocol code (the
send, its network thread's ProduceRequest and answer); librdkafka does that work in C on threads of its
own (bench/README.md "kafka.client"). Only the producer is swapped: consumers and admin clients stay
kafka-python (group membership, pause/resume, rebalance listeners, seeks and commits are the runner's
contract with kafka-python, stages/runner.py).

:class:`RdkafkaProducer` answers the calls expstream makes on a kafka-python ``KafkaProducer``:
``send(topic, value=, key=, headers=, partition=, timestamp_ms=)`` returning a future with ``is_done``
and ``get(timeout)``, ``flush(timeout)``, ``close(timeout)``. The delivery guarantees are the same
(:func:`rdkafka_config` maps every ``KafkaConfig`` producer setting):

* acks, retries, retry backoff, linger, compression, the largest request (``message.max.bytes``), the
  request and delivery timeouts, reconnect backoff, TCP_NODELAY, no topic auto-creation, SASL;
* idempotence on exactly when kafka-python turns it on (acks ``all`` and retries > 0): retries neither
  duplicate nor reorder records;
* keys hash like kafka-python (``murmur2_random``: Java's partitioner), and ``spread`` producers spread
  round robin with the same :class:`~expstream.kafka.partitioning.RoundRobinPartitioner`;
* a record is acknowledged only when librdkafka's delivery report says so; a failed report raises
  ``ProduceError`` from the future's ``get``, not retriable when the broker refused the record (too
  large, not authorised: what kafka-python marks not retriable), retriable otherwise (timeouts, broker
  away). ``flush`` never raises; the futures say what is missing (expstream/kafka/clients.py).

Delivery reports are served by librdkafka's ``poll``/``flush`` on the calling thread: ``send`` serves
those ready (``poll(0)``), ``is_done`` too, ``get`` polls until its own report came or the timeout.
confluent-kafka is an optional extra (``pip install 'expstream[confluent]'``); the configuration refuses
``kafka.client: confluent`` when it is not importable (expstream/config/kafka.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kafka.producer.future import RecordMetadata

from expstream.config.kafka import KafkaConfig
from expstream.errors import BrokerUnavailableError, ProduceError
from expstream.kafka.partitioning import RoundRobinPartitioner

__all__ = ["RdkafkaProducer", "rdkafka_config", "warn_unapplied_extra"]

log = logging.getLogger("expstream.bus")

# Why 30 s: how long a spread producer trusts a topic's partition list before asking again (kafka-python's
# metadata refresh is 5 min; a topic's partitions are fixed for a run, so this only bounds a surprise).
PARTITIONS_TTL_S = 30.0
# Why 5 s: when the broker does not answer a refresh, the known list is used and asked for again this much later.
PARTITIONS_RETRY_S = 5.0
# Why 50 ms: how long a future's get() waits in one librdkafka poll before looking at its own report
# again (another thread's poll may have served it).
GET_POLL_SLICE_S = 0.05
_COMPRESSION = {None: "none", "gzip": "gzip", "snappy": "snappy", "lz4": "lz4", "zstd": "zstd"}


def warn_unapplied_extra(cfg: KafkaConfig, role: str) -> list[str]:
    """Warn that ``kafka.extra.all`` / ``kafka.extra.<role>`` (kafka-python arguments, which the tools'
    clients still take) do not reach this librdkafka ``role`` client; returns the blocks named.

    Not refused: the tools and the trainer stay kafka-python and use them (an SSL or SASL setting there
    must be given again as librdkafka properties under ``kafka.extra.librdkafka``)."""
    named = [where for where in ("all", role) if cfg.extra.get(where)]
    for where in named:
        log.warning("kafka.extra.%s (%s) holds kafka-python arguments: not applied to this stage's librdkafka %s "
                    "(kafka.client: confluent); give librdkafka properties under kafka.extra.librdkafka",
                    where, ", ".join(sorted(cfg.extra[where])), role)
    return named


def rdkafka_config(bootstrap: list[str], cfg: KafkaConfig) -> dict[str, Any]:
    """librdkafka producer properties equivalent to ``cfg.client_kwargs("producer")`` (see the module docstring)."""
    acks = {"all": "all", -1: "all", 0: "0", 1: "1"}[cfg.acks]
    conf: dict[str, Any] = {
        "bootstrap.servers": ",".join(bootstrap),
        "acks": acks,
        "enable.idempotence": acks == "all" and cfg.retries > 0,
        "retries": cfg.retries,
        "retry.backoff.ms": cfg.retry_backoff_ms,
        "reconnect.backoff.max.ms": cfg.reconnect_backoff_max_ms,
        "linger.ms": cfg.linger_ms,
        "compression.type": _COMPRESSION[cfg.compression_type],
        "message.max.bytes": cfg.max_request_size,
        "request.timeout.ms": cfg.request_timeout_ms,
        # kafka-python's delivery_timeout_ms (clients: at least 120 s)
        "message.timeout.ms": max(120000, cfg.linger_ms + cfg.request_timeout_ms),
        "socket.nagle.disable": True,  # kafka-python sets TCP_NODELAY
        "allow.auto.create.topics": False,
        "partitioner": "murmur2_random",  # kafka-python's (Java's) key hash
        "security.protocol": cfg.security_protocol.lower(),
        "logger": logging.getLogger("expstream.bus.rdkafka"),
    }
    sasl = cfg.sasl_kwargs()
    if sasl:
        conf.update({"sasl.mechanism": sasl["sasl_mechanism"], "sasl.username": sasl["sasl_plain_username"],
                     "sasl.password": sasl["sasl_plain_password"]})
    conf.update(cfg.extra.get("librdkafka", {}))
    warn_unapplied_extra(cfg, "producer")
    return conf


class DeliveryFuture:
    """One record's delivery report, with the ``is_done`` / ``get(timeout)`` of kafka-python's future."""

    __slots__ = ("_producer", "_topic", "_event", "_metadata", "_error")

    def __init__(self, producer: Any, topic: str) -> None:
        self._producer, self._topic = producer, topic
        self._event = threading.Event()
        self._metadata: RecordMetadata | None = None
        self._error: ProduceError | None = None

    def report(self, err: Any, msg: Any) -> None:
        """librdkafka's delivery callback (on the thread that polls)."""
        if err is not None:
            self._error = delivery_error(self._topic, err)
        else:
            value, key = msg.value(), msg.key()
            self._metadata = RecordMetadata(msg.topic(), msg.partition(), None, msg.offset(),
                                            msg.timestamp()[1], None, len(key) if key is not None else -1,
                                            len(value) if value is not None else -1, -1)
        self._event.set()

    @property
    def is_done(self) -> bool:
        if not self._event.is_set():
            self._producer.poll(0)
        return self._event.is_set()

    def get(self, timeout: float | None = None) -> RecordMetadata:
        """The record's metadata once acknowledged; ProduceError when it failed or ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.is_set():
            left = GET_POLL_SLICE_S if deadline is None else min(GET_POLL_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                raise ProduceError(f"record to {self._topic!r} not acknowledged within {timeout:.1f}s")
            self._producer.poll(left)
        if self._error is not None:
            raise self._error
        assert self._metadata is not None
        return self._metadata


def delivery_error(topic: str, err: Any) -> ProduceError:
    """A failed delivery report as ProduceError: not retriable when the broker refused the record (a broker
    error it does not retry, or too large), retriable for the client's own errors (timeouts, broker away)."""
    from confluent_kafka import KafkaError

    code = err.code()
    refused = (code >= 0 and not err.retriable()) or code == KafkaError._MSG_SIZE_TOO_LARGE
    return ProduceError(f"record to {topic!r} not acknowledged: {err.name()}: {err.str()}", refused=refused)


class RdkafkaProducer:
    """A confluent-kafka Producer answering kafka-python's producer calls (the module docstring)."""

    def __init__(self, bootstrap: list[str], cfg: KafkaConfig, *, spread: bool = False) -> None:
        from confluent_kafka import KafkaException, Producer

        self._bootstrap = bootstrap
        self._producer = Producer(rdkafka_config(bootstrap, cfg))
        self._spread = RoundRobinPartitioner() if spread else None
        self._partitions: dict[str, tuple[float, list[int], list[int]]] = {}
        self._lock = threading.Lock()
        self._max_block_s = cfg.produce_timeout_s
        try:  # as kafka-python's constructor: reach a bootstrap server now, or BrokerUnavailableError
            md = self._producer.list_topics(timeout=cfg.bootstrap_timeout_ms / 1000)
        except KafkaException as exc:
            raise BrokerUnavailableError(f"no Kafka broker reachable at {','.join(bootstrap)!r} for a producer "
                                         f"(confluent-kafka): {exc}") from exc
        # every topic's partitions known from the start, as kafka-python's bootstrap metadata: a first send
        # while the broker is away is queued (and its confirmation times out), not refused at once
        now = time.monotonic()
        for name, t in md.topics.items():
            if t.error is None and t.partitions:
                self._partitions[name] = (now, *_partition_lists(t))

    def send(self, topic: str, value: Any = None, key: bytes | None = None,
             headers: list[tuple[str, bytes]] | None = None, partition: int | None = None,
             timestamp_ms: int | None = None) -> DeliveryFuture:
        """Hand one record to librdkafka; ProduceError when it is refused at once (too large, unknown topic)."""
        from confluent_kafka import KafkaException

        if partition is None and self._spread is not None:
            partition = self._spread_partition(topic)
        fut = DeliveryFuture(self._producer, topic)
        kw: dict[str, Any] = {"value": value, "key": key, "on_delivery": fut.report}
        if headers:
            kw["headers"] = headers
        if partition is not None:
            kw["partition"] = partition
        if timestamp_ms is not None:
            kw["timestamp"] = timestamp_ms
        deadline = time.monotonic() + self._max_block_s
        while True:
            try:
                self._producer.produce(topic, **kw)
                break
            except BufferError as exc:  # the local queue is full: wait for deliveries (kafka-python's max_block_ms)
                if time.monotonic() > deadline:
                    raise ProduceError(f"send to {topic!r}: the producer's queue stayed full for "
                                       f"{self._max_block_s:.0f}s ({exc})") from exc
                self._producer.poll(0.1)
            except KafkaException as exc:
                raise delivery_error(topic, exc.args[0]) from exc
        self._producer.poll(0)
        return fut

    def _spread_partition(self, topic: str) -> int:
        """The round-robin partition of the next record of ``topic`` (partition list cached PARTITIONS_TTL_S)."""
        with self._lock:
            got = self._partitions.get(topic)
            if got is None or time.monotonic() - got[0] > PARTITIONS_TTL_S:
                try:
                    got = (time.monotonic(), *self._topic_partitions(topic))
                except ProduceError:
                    if got is None:
                        raise
                    # the broker is away: keep the list known (as kafka-python keeps stale metadata), ask again later
                    got = (time.monotonic() - PARTITIONS_TTL_S + PARTITIONS_RETRY_S, *got[1:])
                self._partitions[topic] = got
        return self._spread.partition(topic, None, None, None, None, _Cluster(topic, got[1], got[2]))

    def _topic_partitions(self, topic: str) -> tuple[list[int], list[int]]:
        from confluent_kafka import KafkaException

        try:
            md = self._producer.list_topics(topic, timeout=self._max_block_s).topics.get(topic)
        except KafkaException as exc:
            raise ProduceError(f"send to {topic!r}: no metadata from {','.join(self._bootstrap)!r}: {exc}") from exc
        if md is None or md.error is not None or not md.partitions:
            raise ProduceError(f"send to {topic!r}: topic not found ({md.error if md is not None else 'no metadata'})")
        return _partition_lists(md)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every delivery report (at most ``timeout`` s); never raises (the futures say what failed)."""
        self._producer.flush(-1 if timeout is None else max(timeout, 0.0))

    def close(self, timeout: float | None = None) -> None:
        """Flush (at most ``timeout`` s); librdkafka's threads end when the producer is dropped."""
        self.flush(10.0 if timeout is None else timeout)


def _partition_lists(md: Any) -> tuple[list[int], list[int]]:
    """A topic's partitions and those with a leader, from librdkafka's TopicMetadata."""
    every = sorted(md.partitions)
    return every, [p for p in every if md.partitions[p].leader >= 0]


class _Cluster:
    """The part of kafka-python's ClusterMetadata the round-robin partitioner reads, for one topic."""

    def __init__(self, topic: str, every: list[int], available: list[int]) -> None:
        self._topic, self._every, self._available = topic, every, available

    def topics(self) -> set[str]:
        return {self._topic}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(self._every)

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return set(self._available)
