"""Kafka plumbing: client settings, producer/consumer/admin factories, confirmed sends, lag, replay.

Everything here is plain kafka-python (>= 3.0.12) and works the same against Apache Kafka and the
embedded Tansu broker. Payloads are ``bytes`` in and out: no serializers or deserializers are
installed, because a ``value_deserializer`` runs inside the fetcher and one undecodable record would
then block its partition. Stages decode under ``try/except`` and route failures to the DLQ.

Delivery rule used by every stage: an input offset is committed only after every output record is
acknowledged (:func:`send_all_and_confirm`), since ``producer.flush()`` does not raise per-record
errors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import OffsetSpec
from kafka.consumer.fetcher import ConsumerRecord
from kafka.producer.future import RecordMetadata

from expstream.errors import BrokerUnavailableError, ConfigError, ProduceError, unknown_key_error
from expstream.fieldtypes import check_fields

__all__ = [
    "MiB",
    "KafkaConfig",
    "OutRecord",
    "make_producer",
    "make_consumer",
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

MiB = 1024 * 1024

# How often read_topic() polls while waiting for the end-offset snapshot to be reached. Short,
# because read_topic is used by tests and replays where latency matters more than request count.
READ_POLL_MS = 200
# How long the end-offset probe's fetches may wait on the broker for data. Short, because an empty
# partition is answered only after this wait, and the probe needs only the response's high watermark.
PROBE_FETCH_WAIT_MS = 10

_ROLES = ("producer", "consumer", "admin")
_ACKS = (0, 1, -1, "all")
_COMPRESSION = (None, "gzip", "snappy", "lz4", "zstd")
_OFFSET_RESET = ("earliest", "latest")
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
#: Where the SASL user name is read from when the topology names none.
USERNAME_ENV = "EXPSTREAM_KAFKA_USERNAME"


def _refuse_passwords(d: Mapping[str, Any], where: str) -> None:
    """A password in a topology is a ConfigError: it would be copied into run dirs, logs and images."""
    for key in d:
        if "password" in str(key) and str(key) != "sasl_password_env":
            raise ConfigError(
                "passwords are not read from the topology (it is copied into run directories and images)",
                field=f"{where}.{key}",
                fix="put the password in the environment ($EXPSTREAM_KAFKA_PASSWORD, or the variable "
                "named by kafka.sasl_password_env); docker-compose reads it from .env",
            )


@dataclass
class KafkaConfig:
    """Client settings shared by every producer, consumer and admin client of a pipeline.

    The defaults suit a pipeline of micro-batches of up to tens of MiB on a local broker or a small
    Apache Kafka cluster. ``from_dict`` (used for the ``kafka:`` block of ``topology.yaml``) rejects
    unknown keys and names the closest valid one. Timings are milliseconds unless the name says
    ``_s``.
    """

    # --- consumer group membership -------------------------------------------------------------
    # Why 6 s: the join time of a new member grows with the session timeout. With kafka-python's
    # default (45 s) a first group join took ~23 s on Tansu; with 6 s it takes ~3 s. 6 s is also
    # Apache Kafka's default group.min.session.timeout.ms, so a broker accepts nothing shorter.
    session_timeout_ms: int = 6000
    # Why 1 s: must be well under session_timeout_ms (Kafka suggests <= 1/3) so that one lost
    # heartbeat does not evict a healthy member. Heartbeats run on kafka-python's IO thread.
    heartbeat_interval_ms: int = 1000
    # Why 60 s: the longest time between two poll() calls before the member is evicted; it is also
    # the rebalance timeout, so it is not raised to hours. Long model work pauses the assigned
    # partitions and keeps calling poll() instead (see stages/runner.py).
    max_poll_interval_ms: int = 60000
    # Why 1: one record is one micro-batch; a consumer that takes one at a time never holds a fetch
    # position far past the record in hand (stage replicas always poll one at a time, whatever this
    # says: stages/runner.py; they confirm and commit records in groups across polls instead).
    max_poll_records: int = 1
    # Why "earliest": a new group (a fresh run, a replay) must see the whole topic, not only
    # records produced after it joined.
    auto_offset_reset: str = "earliest"

    # --- requests and sizes --------------------------------------------------------------------
    # Why 30 s: kafka-python's default; long enough for a 64 MiB request on a slow link.
    request_timeout_ms: int = 30000
    # Why 64 MiB: max_request_size is checked by the producer on the *uncompressed* record, and one
    # record carries a whole micro-batch (token ids, log-probs, values, multimodal tensors).
    # Topics are created with max.message.bytes raised to match (expstream.topics.create_topics).
    max_request_size: int = 64 * MiB
    # Why 64 MiB: a fetch must be able to return at least one whole micro-batch.
    fetch_max_bytes: int = 64 * MiB
    # Why 64 MiB: same, per partition.
    max_partition_fetch_bytes: int = 64 * MiB
    # Why 200 ms: the longest a fetch waits on the broker when the partition has nothing new. Apache
    # Kafka answers a waiting fetch as soon as a record arrives; Tansu (the embedded broker) answers
    # late. Measured here, a record produced 130 ms into a consumer's wait, against the CPU an idle
    # consumer (a stage replica between micro-batches) spends on empty fetches:
    #   500 ms (kafka-python's default): seen after 123 ms (median), idle CPU  8 ms per second
    #   200 ms:                          seen after  24 ms,           idle CPU 12 ms per second
    #   100 ms:                          seen after  26 ms,           idle CPU 24 ms per second
    #    50 ms:                          seen after   6 ms,           idle CPU 35 ms per second
    # A run has ~10 consumers on 2 cores, mostly idle: 200 ms keeps both costs small.
    fetch_max_wait_ms: int = 200

    # --- producer ------------------------------------------------------------------------------
    # Why 2 ms: micro-batches are already batches; a short linger only coalesces the few records a
    # stage emits for one input without adding visible latency.
    linger_ms: int = 2
    # Why "all": an input offset is committed once its outputs are acknowledged; with acks=all an
    # acknowledged record survives the loss of the partition leader (on a replicated cluster).
    acks: Any = "all"
    # Why None: float tensors barely compress and gzip (the only codec built in) is slow at level 9;
    # lz4/zstd need extra packages. Token-id-heavy topics may turn it on.
    compression_type: str | None = None
    # Why 5: enough to ride through a leader election; kafka-python's idempotent producer keeps
    # retries from duplicating or reordering records.
    retries: int = 5
    # Why 100 ms: kafka-python's default; the first retry after a leader change should be quick.
    retry_backoff_ms: int = 100
    # Why 2 s: caps the reconnect backoff so that a restarted broker is found again within ~2 s.
    reconnect_backoff_max_ms: int = 2000
    # Why 30 s: how long send_and_confirm()/send_all_and_confirm() wait for acknowledgements (and
    # how long send() may block on metadata) before raising a retriable ProduceError.
    produce_timeout_s: float = 30.0
    # Why 30 s: how long a client constructor tries to reach a bootstrap server before
    # BrokerUnavailableError. kafka-python 3.0 raises KafkaTimeoutError after this (it has no
    # NoBrokersAvailable any more).
    bootstrap_timeout_ms: int = 30000

    # --- security ------------------------------------------------------------------------------
    # PLAINTEXT suits the embedded broker and a compose network; SASL_PLAINTEXT / SASL_SSL with
    # sasl_mechanism authenticate (docs/deploy.md: docker-compose's host listener wants SCRAM-SHA-512).
    security_protocol: str = "PLAINTEXT"
    # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (others, e.g. OAUTHBEARER, through `extra`); needed by SASL_*.
    sasl_mechanism: str | None = None
    # The SASL user name; None: read $EXPSTREAM_KAFKA_USERNAME when a SASL protocol is used.
    sasl_plain_username: str | None = None
    # The *name* of the environment variable holding the SASL password. The password itself is never
    # a topology value: topologies are copied into run directories, logs and images.
    sasl_password_env: str = "EXPSTREAM_KAFKA_PASSWORD"
    # Extra kafka-python arguments per role (ssl_cafile, sasl_*, client_id, ...), passed verbatim:
    # {"producer": {...}, "consumer": {...}, "admin": {...}, "all": {...}}.
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, *, where: str = "kafka") -> KafkaConfig:
        """Build from a mapping (the ``kafka:`` block of a topology); unknown keys are errors.

        >>> KafkaConfig.from_dict({"sesion_timeout_ms": 6000})
        Traceback (most recent call last):
        ...
        expstream.errors.ConfigError: kafka.sesion_timeout_ms: unknown key. Did you mean kafka.session_timeout_ms? ...
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"expected a mapping, got {type(d).__name__}",
                field=where,
                fix="write the kafka block as key: value pairs",
            )
        _refuse_passwords(d, where)
        valid = cls.field_names()
        for key in d:
            if key not in valid:
                raise unknown_key_error(where, key, valid)
        return cls(**check_fields(cls, d, where))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> KafkaConfig:
        """A copy with some settings changed (unknown names rejected like :meth:`from_dict`)."""
        merged = self.to_dict()
        unknown = {k: v for k, v in changes.items() if k not in merged}
        if unknown:
            KafkaConfig.from_dict(unknown)  # raises with the suggestion
        merged.update(changes)
        return KafkaConfig(**merged)

    def validate(self) -> None:
        def positive(name: str, *, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
            if not ok:
                raise ConfigError(
                    f"must be a {'non-negative' if allow_zero else 'positive'} number, got {v!r}",
                    field=f"kafka.{name}",
                    fix=f"set it to a number like {getattr(KafkaConfig, name)!r}",
                )

        for name in (
            "session_timeout_ms",
            "heartbeat_interval_ms",
            "max_poll_interval_ms",
            "max_poll_records",
            "request_timeout_ms",
            "max_request_size",
            "fetch_max_bytes",
            "max_partition_fetch_bytes",
            "fetch_max_wait_ms",
            "produce_timeout_s",
            "bootstrap_timeout_ms",
            "reconnect_backoff_max_ms",
        ):
            positive(name)
        for name in ("linger_ms", "retries", "retry_backoff_ms"):
            positive(name, allow_zero=True)
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ConfigError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below session_timeout_ms "
                f"({self.session_timeout_ms})",
                field="kafka.heartbeat_interval_ms",
                fix="use about a third of session_timeout_ms",
            )
        if self.acks not in _ACKS:
            raise ConfigError(f"unknown acks {self.acks!r}", field="kafka.acks", fix="use 0, 1 or 'all'")
        if self.compression_type not in _COMPRESSION:
            raise ConfigError(
                f"unknown compression_type {self.compression_type!r}",
                field="kafka.compression_type",
                fix="use null, gzip, snappy, lz4 or zstd",
            )
        if self.auto_offset_reset not in _OFFSET_RESET:
            raise ConfigError(
                f"unknown auto_offset_reset {self.auto_offset_reset!r}",
                field="kafka.auto_offset_reset",
                fix="use 'earliest' or 'latest'",
            )
        if self.security_protocol not in _PROTOCOLS:
            raise ConfigError(
                f"unknown security_protocol {self.security_protocol!r}",
                field="kafka.security_protocol",
                fix=f"use one of {', '.join(_PROTOCOLS)}",
            )
        if not isinstance(self.extra, Mapping) or any(k not in (*_ROLES, "all") for k in self.extra):
            raise ConfigError(
                f"bad extra block {self.extra!r}",
                field="kafka.extra",
                fix="map 'producer', 'consumer', 'admin' or 'all' to kafka-python arguments",
            )
        for role, kw in self.extra.items():
            _refuse_passwords(kw, f"kafka.extra.{role}")
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and self.sasl_mechanism is None and not any("sasl_mechanism" in kw for kw in self.extra.values()):
            raise ConfigError(
                f"security_protocol {self.security_protocol} needs a SASL mechanism",
                field="kafka.sasl_mechanism",
                fix=f"set it to one of {', '.join(_MECHANISMS)} (docker-compose's host listener: SCRAM-SHA-512)",
            )
        if self.sasl_mechanism is not None and self.sasl_mechanism not in _MECHANISMS:
            raise ConfigError(
                f"unknown sasl_mechanism {self.sasl_mechanism!r}",
                field="kafka.sasl_mechanism",
                fix=f"use one of {', '.join(_MECHANISMS)}, or pass others through kafka.extra.all",
            )
        if self.sasl_mechanism is not None and not sasl:
            raise ConfigError(
                f"sasl_mechanism {self.sasl_mechanism} is set but security_protocol is {self.security_protocol}",
                field="kafka.security_protocol",
                fix="use SASL_PLAINTEXT (or SASL_SSL), or remove sasl_mechanism",
            )

    def sasl_kwargs(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """kafka-python's SASL arguments: user from the topology or $EXPSTREAM_KAFKA_USERNAME, password
        from ``$<sasl_password_env>`` (read when a client is made, never stored in the topology)."""
        if self.sasl_mechanism is None:
            return {}
        env = os.environ if environ is None else environ
        user = self.sasl_plain_username or env.get(USERNAME_ENV)
        password = env.get(self.sasl_password_env)
        if not user:
            raise ConfigError(
                f"SASL {self.sasl_mechanism} needs a user name",
                field="kafka.sasl_plain_username",
                fix=f"set kafka.sasl_plain_username or export {USERNAME_ENV}",
            )
        if not password:
            raise ConfigError(
                f"SASL {self.sasl_mechanism} needs a password and ${self.sasl_password_env} is empty",
                field=self.sasl_password_env,
                fix=f"export {self.sasl_password_env}=... (docker-compose: from .env), never in the topology",
            )
        return {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": user,
                "sasl_plain_password": password}

    # --- mapping to kafka-python ---------------------------------------------------------------
    def client_kwargs(self, role: str) -> dict[str, Any]:
        """kafka-python constructor arguments for ``role`` ("producer", "consumer" or "admin")."""
        if role not in _ROLES:
            raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
        common: dict[str, Any] = {
            "request_timeout_ms": self.request_timeout_ms,
            "retry_backoff_ms": self.retry_backoff_ms,
            "reconnect_backoff_max_ms": self.reconnect_backoff_max_ms,
            "bootstrap_timeout_ms": self.bootstrap_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if role in ("producer", "consumer"):
            # Why off: kafka-python's own metrics (sensors updated on every request, response and
            # record) were ~8 % of a stage's CPU per record in a profile, and nothing reads them:
            # the stages export their own (expstream/metrics.py). kafka.extra can switch them back on.
            common["metrics_enabled"] = False
        if role == "producer":
            kw = {
                **common,
                "acks": self.acks,
                "compression_type": self.compression_type,
                "retries": self.retries,
                "linger_ms": self.linger_ms,
                "max_request_size": self.max_request_size,
                # send() blocks on metadata for at most this long (topics are never auto-created).
                "max_block_ms": int(self.produce_timeout_s * 1000),
                "allow_auto_create_topics": False,
            }
            # kafka-python requires delivery_timeout_ms >= linger_ms + request_timeout_ms.
            kw["delivery_timeout_ms"] = max(120000, self.linger_ms + self.request_timeout_ms)
        elif role == "consumer":
            kw = {
                **common,
                "session_timeout_ms": self.session_timeout_ms,
                "heartbeat_interval_ms": self.heartbeat_interval_ms,
                "max_poll_interval_ms": self.max_poll_interval_ms,
                "max_poll_records": self.max_poll_records,
                "fetch_max_bytes": self.fetch_max_bytes,
                "max_partition_fetch_bytes": self.max_partition_fetch_bytes,
                "fetch_max_wait_ms": self.fetch_max_wait_ms,
                "auto_offset_reset": self.auto_offset_reset,
                "enable_auto_commit": False,
                "allow_auto_create_topics": False,
            }
        else:
            kw = dict(common)
        # Responses carry whole micro-batches: allow them through the client's frame size check.
        kw["receive_message_max_bytes"] = max(100_000_000, self.fetch_max_bytes + MiB)
        kw.update(self.sasl_kwargs())
        kw.update(self.extra.get("all", {}))
        kw.update(self.extra.get(role, {}))
        return kw


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
    bootstrap: str | Sequence[str], cfg: KafkaConfig | None = None, **overrides: Any
) -> KafkaProducer:
    """A KafkaProducer taking ``bytes`` values/keys (no serializers). ``overrides`` win over ``cfg``."""
    cfg = cfg or KafkaConfig()
    kw = {**cfg.client_kwargs("producer"), **overrides}
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
            f"{len(failures)} of {len(sent)} records not acknowledged; first: {first}", cause=first.cause
        )
        raise err from first
    return out


def _partitions(admin: KafkaAdminClient, topic: str) -> list[TopicPartition]:
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
        tps = _partitions(admin, topic)
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
