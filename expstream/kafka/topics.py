"""Topic names and topic creation, in one place: every topic's ``.dlq`` twin, ``create_topics``.

The dead-letter twin of topic ``T`` is ``T.dlq`` (:func:`dlq_topic`); the runner writes to it,
``expstream run`` watches it, ``expstream dlq`` reads and redrives it, and :func:`create_topics`
creates it beside ``T``. ``expstream topics create|list`` (:func:`topics_command`) is the
same creation for a deployment (docker-compose's init-topics); ``expstream topics tail TOPIC``
prints a topic's records (expstream/tools/tail.py).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from typing import Any

from expstream.config.topology import Topology
from expstream.errors import EXIT_OK, ConfigError, InfraError

__all__ = ["DLQ_SUFFIX", "dlq_topic", "stage_group", "DEFAULT_TOPIC_CONFIG", "POLICY_TOPIC", "loop_topics", "create_topics",
           "topics_command"]

log = logging.getLogger("expstream.topics")

#: The suffix that names a topic's dead-letter twin.
DLQ_SUFFIX = ".dlq"
#: A continuous run's announcements: one record per published policy version, key = run id
#: (expstream.train.weights.announce). No ``.dlq`` twin: no stage consumes it.
POLICY_TOPIC = "policy"
# Why 1 partition: versions are announced in order and read in order; one partition keeps it.
POLICY_PARTITIONS = 1
# max.message.bytes is checked by Apache Kafka on the compressed batch (1 MiB default); raise it so
# that a 64 MiB micro-batch (bus.KafkaConfig.max_request_size) is accepted. Tansu ignores it.
DEFAULT_TOPIC_CONFIG: dict[str, str] = {"max.message.bytes": str(64 * 1024 * 1024)}
# Why 50 ms: create_topics polls metadata until every partition has a leader; Tansu answers at
# once, a KRaft cluster within a few hundred ms.
METADATA_POLL_INTERVAL_S = 0.05


def dlq_topic(topic: str) -> str:
    """The dead-letter twin of ``topic``."""
    return topic + DLQ_SUFFIX


def stage_group(run_id: str, stage: str) -> str:
    """The consumer group every replica of ``stage`` joins in run ``run_id`` (stages/runner.py); what
    ``expstream status``, ``scale``, ``rewind`` and a KEDA ScaledObject (``expstream k8s render``) read."""
    return f"expstream.{run_id}.{stage}"


def loop_topics(topo: Topology) -> dict[str, int]:
    """The topics a continuous run adds to the pipeline's (no ``.dlq`` twins): ``policy`` when
    ``train.enabled``, else none."""
    return {POLICY_TOPIC: POLICY_PARTITIONS} if topo.train.enabled else {}


# CreateTopics error codes that mean "the broker would not take these topic configs": retried
# without them (brokers differ in which configs they accept; Tansu ignores them).
_CONFIG_ERROR_CODES = {40, 44}  # INVALID_CONFIG, POLICY_VIOLATION
_TOPIC_EXISTS = 36


def create_topics(
    bootstrap: str,
    topics: Mapping[str, int],
    *,
    with_dlq: bool = True,
    dlq_partitions: int = 1,
    replication_factor: int = 1,
    config: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    kafka_config=None,
) -> list[str]:
    """Create ``topics`` (name -> partitions) and, with ``with_dlq``, a ``<topic>.dlq`` twin of each.

    Idempotent: topics that exist are kept (TopicAlreadyExists is not an error), but an existing
    topic with a different partition count is a ConfigError (partitions cannot be changed here).
    ``config`` defaults to :data:`DEFAULT_TOPIC_CONFIG`; a broker that rejects the configs gets
    the topics without them (logged). Returns every topic name ensured, DLQ twins included, once
    metadata shows each with all its partitions led.
    """
    from expstream.kafka.clients import make_admin

    wanted = _wanted(topics, with_dlq=with_dlq, dlq_partitions=dlq_partitions)
    configs = dict(DEFAULT_TOPIC_CONFIG if config is None else config)
    deadline = time.monotonic() + timeout_s
    admin = make_admin(bootstrap, kafka_config)
    try:
        results = _request_creation(admin, bootstrap, wanted, configs, replication_factor, deadline)
        _wait_until_led(admin, wanted, results, deadline, timeout_s)
        return list(wanted)
    finally:
        admin.close()


def _wanted(topics: Mapping[str, int], *, with_dlq: bool, dlq_partitions: int) -> dict[str, int]:
    """Topic name -> partitions, each count checked, the ``.dlq`` twins added with ``with_dlq``."""
    wanted: dict[str, int] = {}
    for name, parts in topics.items():
        if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
            raise ConfigError(
                f"partition count must be a positive integer, got {parts!r}",
                field=f"topics.{name}",
                fix="give every topic 1 or more partitions",
            )
        wanted[name] = parts
    if with_dlq:
        for name in list(wanted):
            if not name.endswith(DLQ_SUFFIX):
                wanted.setdefault(dlq_topic(name), dlq_partitions)
    return wanted


def _request_creation(admin: Any, bootstrap: str, wanted: dict[str, int], configs: dict[str, str],
                      replication_factor: int, deadline: float) -> dict[str, tuple[int, str | None]]:
    """One CreateTopics request (again without the configs when the broker rejects them): name ->
    (error code, message); an error other than "exists" is an InfraError."""
    from kafka.errors import KafkaError

    def request(with_configs: bool) -> dict[str, tuple[int, str | None]]:
        spec = {
            name: {
                "num_partitions": n,
                "replication_factor": replication_factor,
                **({"configs": configs} if with_configs and configs else {}),
            }
            for name, n in wanted.items()
        }
        resp = admin.create_topics(
            spec, timeout_ms=int(max(deadline - time.monotonic(), 1) * 1000), raise_errors=False
        )
        return {t["name"]: (t["error_code"], t.get("error_message")) for t in resp.get("topics", [])}

    try:
        results = request(with_configs=True)
        if any(code in _CONFIG_ERROR_CODES for code, _ in results.values()):
            log.warning(
                "broker rejected topic configs %s (%s); creating topics without them",
                configs,
                {n: m for n, (c, m) in results.items() if c in _CONFIG_ERROR_CODES},
            )
            results = request(with_configs=False)
    except KafkaError as exc:
        raise InfraError(f"create_topics on {bootstrap} failed: {exc!r}") from exc
    bad = {n: (c, m) for n, (c, m) in results.items() if c not in (0, _TOPIC_EXISTS)}
    if bad:
        raise InfraError(f"broker refused to create topics: {bad}")
    return results


def _wait_until_led(admin: Any, wanted: dict[str, int], results: dict[str, tuple[int, str | None]],
                    deadline: float, timeout_s: float) -> None:
    """Wait until metadata shows every topic with all its partitions led (InfraError at the deadline)."""
    from kafka.errors import KafkaError

    while True:
        try:
            described = {t["name"]: t for t in admin.describe_topics(list(wanted))}
        except KafkaError as exc:
            described, last = {}, exc
        else:
            last = None
        missing = _not_ready(wanted, described, results)
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise InfraError(
                f"topics {missing} not ready in metadata within {timeout_s:.1f}s"
                + (f" (last error {last!r})" if last else "")
            )
        time.sleep(METADATA_POLL_INTERVAL_S)


def _not_ready(wanted: dict[str, int], described: dict[str, Any],
               results: dict[str, tuple[int, str | None]]) -> list[str]:
    """The wanted topics metadata does not yet show with all their partitions led; a topic that
    existed before with another partition count is a ConfigError."""
    missing = []
    for name, n in wanted.items():
        t = described.get(name)
        if t is None or t.get("error_code", 0) != 0:
            missing.append(name)
            continue
        parts = t.get("partitions") or []
        if len(parts) != n and len(parts) > 0 and all(p.get("error_code", 0) == 0 for p in parts):
            if results.get(name, (0,))[0] == _TOPIC_EXISTS:
                raise ConfigError(
                    f"topic {name!r} already exists with {len(parts)} partitions, {n} wanted",
                    field=f"topics.{name}",
                    fix="use the existing count, delete the topic, or start a fresh run with new topic names",
                )
        if len(parts) != n or any(
            p.get("error_code", 0) != 0 or p.get("leader_id", -1) < 0 for p in parts
        ):
            missing.append(name)
    return missing


def topics_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream topics create|list``: the topology's topics and their ``.dlq`` twins; ``tail``: one topic."""
    if not args.bootstrap_servers:
        raise ConfigError("--bootstrap-servers: needed to create topics, e.g. --bootstrap-servers kafka:9092")
    topics = topo.all_topics()
    if args.action == "create":
        create_topics(args.bootstrap_servers, topics, with_dlq=True, kafka_config=topo.kafka)
        if loop_topics(topo):
            create_topics(args.bootstrap_servers, loop_topics(topo), with_dlq=False, kafka_config=topo.kafka)
    for name, parts in topics.items():
        print(f"{name}\t{parts} partitions (+ {dlq_topic(name)})")
    for name, parts in loop_topics(topo).items():
        print(f"{name}\t{parts} partitions")
    return EXIT_OK
