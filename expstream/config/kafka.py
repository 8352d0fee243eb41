"""The topology's ``kafka`` block: kafka-python client settings with documented defaults.

:class:`KafkaConfig` rejects unknown keys and passwords (those come from the environment), and
builds the keyword arguments of each kafka-python client role (producer, consumer, admin). The
factories that use it are in expstream/kafka/clients.py; the settings are described in
docs/topology.md and docs/kafka-notes.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from expstream.config.fieldtypes import check_fields
from expstream.errors import ConfigError, unknown_key_error

__all__ = ["CLIENTS", "CONFLUENT", "MiB", "KafkaConfig", "USERNAME_ENV"]

MiB = 1024 * 1024

_ROLES = ("producer", "consumer", "admin")
#: kafka.client: whose producers and stage-runner consumers the pipeline uses (tools and admin: kafka-python).
CONFLUENT = "confluent"
CLIENTS = ("kafka-python", CONFLUENT)
#: kafka.extra's key for librdkafka properties (the confluent producer's), beside the kafka-python roles.
LIBRDKAFKA = "librdkafka"
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

    # --- client library ------------------------------------------------------------------------
    # Which library the stages' producers and the stage runner's consumer use: "kafka-python" (the default)
    # or "confluent" (confluent-kafka, i.e. librdkafka in C, the optional extra `pip install
    # 'expstream[confluent]'`: the same acks, idempotence, retries, linger, sizes, partitioning and delivery
    # confirmation, expstream/kafka/rdkafka.py; the same group, fetch, pause, seek and commit semantics,
    # expstream/kafka/rdconsumer.py). The tools' consumers and admin clients are kafka-python either way.
    # Why optional: bench/README.md "kafka.client".
    client: str = "kafka-python"

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
    # Why 16: one record is one micro-batch; a stage replica catching up on a backlog takes 16 per poll
    # (a poll costs ~0.5 ms of kafka-python whatever it returns) and confirms and commits them in
    # commit groups of the same size (stages/commitgroup.py). Records of a poll not handled because
    # the assignment moved are sought back to when their partition returns (stages/revocations.py).
    max_poll_records: int = 16
    # Why "earliest": a new group (a fresh run, a replay) must see the whole topic, not only
    # records produced after it joined.
    auto_offset_reset: str = "earliest"

    # --- requests and sizes --------------------------------------------------------------------
    # Why 30 s: kafka-python's default; long enough for a 64 MiB request on a slow link.
    request_timeout_ms: int = 30000
    # Why 64 MiB: max_request_size is checked by the producer on the *uncompressed* record, and one
    # record carries a whole micro-batch (token ids, log-probs, values, multimodal tensors).
    # Topics are created with max.message.bytes raised to match (expstream.kafka.topics.create_topics).
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
    # Tansu looks for new records at half the wait left (docs/kafka-notes.md): a longer wait means fuller,
    # fewer fetches (less CPU per record: the tiny pipeline's steady rate 1.13x -> 1.28x the in-process
    # chain at 500, 1.49x at 1000) and more latency per hop (median 33 -> 63 / 168 ms; the demo's first
    # experience 4.3 -> 5.2 s at 1000). Raise it for throughput-bound runs on the embedded broker; on
    # Apache Kafka a waiting fetch is answered when a record arrives, so a long wait costs no latency.
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
        """Every field checked, in this order: numbers, named choices, extra and SASL, the client library
        (ConfigError naming the field and the fix)."""
        self._check_numbers()
        self._check_choices()
        self._check_extra_and_sasl()
        self._check_client()

    def _check_numbers(self) -> None:
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

    def _check_client(self) -> None:
        if self.client not in CLIENTS:
            raise ConfigError(f"unknown client {self.client!r}", field="kafka.client",
                              fix=f"use {' or '.join(repr(c) for c in CLIENTS)}")
        if self.client != CONFLUENT:
            return
        import importlib.util

        if importlib.util.find_spec("confluent_kafka") is None:
            raise ConfigError("kafka.client is 'confluent' but the confluent-kafka package is not installed",
                              field="kafka.client",
                              fix="pip install 'expstream[confluent]' (confluent-kafka==2.16.1), or set "
                                  "kafka.client: kafka-python")
        if self.max_poll_interval_ms < self.session_timeout_ms:
            # librdkafka refuses to make such a consumer (kafka-python does not mind)
            raise ConfigError(f"max_poll_interval_ms ({self.max_poll_interval_ms}) is below session_timeout_ms "
                              f"({self.session_timeout_ms}): librdkafka (kafka.client: confluent) refuses that",
                              field="kafka.max_poll_interval_ms",
                              fix=f"set it to at least {self.session_timeout_ms}, or kafka.client: kafka-python")
        if self.extra.get("producer"):
            raise ConfigError("kafka-python producer arguments do not apply to the confluent producer",
                              field="kafka.extra.producer",
                              fix=f"give librdkafka properties under kafka.extra.{LIBRDKAFKA} (e.g. "
                                  "'ssl.ca.location'), or set kafka.client: kafka-python")

    def _check_choices(self) -> None:
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

    def _check_extra_and_sasl(self) -> None:
        if not isinstance(self.extra, Mapping) or any(k not in (*_ROLES, "all", LIBRDKAFKA) for k in self.extra):
            raise ConfigError(
                f"bad extra block {self.extra!r}",
                field="kafka.extra",
                fix="map 'producer', 'consumer', 'admin' or 'all' to kafka-python arguments (and "
                    f"'{LIBRDKAFKA}' to librdkafka properties, with kafka.client: confluent)",
            )
        self._validate_sasl()

    def _validate_sasl(self) -> None:
        """The SASL settings agree with security_protocol; no password in kafka.extra."""
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
            # the stages export their own (expstream/observe/metrics.py). kafka.extra can switch them back on.
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
