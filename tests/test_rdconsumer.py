"""``kafka.client: confluent``: the stage runner's librdkafka consumer (expstream/kafka/rdconsumer.py) answers
the runner's calls as kafka-python's consumer does.

The settings and the error mapping without a server; against the session broker, the same script of
polls, seeks, pauses, resumes, commits and watermarks run through both clients on the same topic must
observe the same things. The runner-level proofs are elsewhere: tests/test_rdkafka.py (a replica's
outputs, letters and commits equal a kafka-python replica's), tests/test_runner.py (a partition given
back mid-poll, parametrised by client) and tests/test_replay.py (a whole run's bytes).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kafka import TopicPartition
from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

from expstream.config.kafka import KafkaConfig
from expstream.errors import BrokerUnavailableError, ConfigError
from expstream.kafka.clients import (
    make_consumer,
    make_producer,
    make_runner_consumer,
    send_all_and_confirm,
    send_and_confirm,
)
from expstream.kafka.rdconsumer import RdkafkaConsumer, kafka_error, rdkafka_consumer_config
from stages.commitgroup import REBALANCED
from stages.revocations import RevocationTracker

CK = "confluent"


# ---------------------------------------------------------------------------------------------
# no server
# ---------------------------------------------------------------------------------------------
def test_the_consumer_settings_mirror_the_kafka_python_ones():
    cfg = KafkaConfig(client=CK, session_timeout_ms=9000, heartbeat_interval_ms=2000, max_poll_interval_ms=45000,
                      fetch_max_wait_ms=350, fetch_max_bytes=8 << 20, max_partition_fetch_bytes=4 << 20,
                      auto_offset_reset="latest", request_timeout_ms=20000,
                      extra={"librdkafka": {"fetch.wait.max.ms": 123, "client.id": "x"}})
    kp = KafkaConfig(**{**cfg.to_dict(), "client": "kafka-python", "extra": {}}).client_kwargs("consumer")
    conf = rdkafka_consumer_config(["h:1", "h:2"], "grp", cfg)
    assert conf["bootstrap.servers"] == "h:1,h:2" and conf["group.id"] == "grp"
    for ours, theirs in [("session.timeout.ms", "session_timeout_ms"), ("heartbeat.interval.ms", "heartbeat_interval_ms"),
                         ("max.poll.interval.ms", "max_poll_interval_ms"), ("fetch.max.bytes", "fetch_max_bytes"),
                         ("max.partition.fetch.bytes", "max_partition_fetch_bytes"),
                         ("auto.offset.reset", "auto_offset_reset"), ("socket.timeout.ms", "request_timeout_ms"),
                         ("receive.message.max.bytes", "receive_message_max_bytes")]:
        assert conf[ours] == kp[theirs], ours
    assert conf["fetch.wait.max.ms"] == 123, "kafka.extra.librdkafka comes last"
    assert conf["client.id"] == "x"
    # kafka-python's defaults, not librdkafka's (read_committed, auto commit and offset store on)
    assert (conf["isolation.level"], conf["enable.auto.commit"], conf["enable.auto.offset.store"]) == \
        ("read_uncommitted", False, False)
    assert kp["enable_auto_commit"] is False
    assert "group.id" not in rdkafka_consumer_config(["h:1"], None, KafkaConfig(client=CK))


def test_kafka_python_extra_arguments_are_named_as_not_applied_to_the_librdkafka_clients(caplog):
    """kafka.extra.all / .consumer are kafka-python arguments (the tools still take them): the stages'
    librdkafka clients say they do not get them, and where their settings go instead."""
    from expstream.kafka.rdkafka import rdkafka_config

    cfg = KafkaConfig(client=CK, extra={"all": {"ssl_cafile": "/ca.pem"}, "consumer": {"client_id": "c"},
                                        "librdkafka": {"ssl.ca.location": "/ca.pem"}})
    with caplog.at_level("WARNING", logger="expstream.bus"):
        conf = rdkafka_consumer_config(["h:1"], "grp", cfg)
    said = [r.getMessage() for r in caplog.records]
    assert conf["ssl.ca.location"] == "/ca.pem" and "ssl_cafile" not in conf and "client_id" not in conf
    assert any("kafka.extra.all (ssl_cafile)" in m and "librdkafka consumer" in m for m in said), said
    assert any("kafka.extra.consumer (client_id)" in m and "kafka.extra.librdkafka" in m for m in said), said
    caplog.clear()
    with caplog.at_level("WARNING", logger="expstream.bus"):
        rdkafka_config(["h:1"], cfg)
    assert [m for m in (r.getMessage() for r in caplog.records) if "kafka.extra." in m] == [
        "kafka.extra.all (ssl_cafile) holds kafka-python arguments: not applied to this stage's librdkafka producer "
        "(kafka.client: confluent); give librdkafka properties under kafka.extra.librdkafka"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="expstream.bus"):
        rdkafka_consumer_config(["h:1"], "grp", KafkaConfig(client=CK, extra={"librdkafka": {"client.id": "x"}}))
    assert not [r for r in caplog.records if "kafka.extra." in r.getMessage()]


def test_a_poll_interval_below_the_session_timeout_is_refused_naming_the_field():
    """librdkafka refuses to make such a consumer: said before any stage starts, not as a stage's crash."""
    with pytest.raises(ConfigError) as err:
        KafkaConfig(client=CK, max_poll_interval_ms=3000, session_timeout_ms=6000)
    assert err.value.field == "kafka.max_poll_interval_ms" and "6000" in str(err.value)
    KafkaConfig(client="kafka-python", max_poll_interval_ms=3000, session_timeout_ms=6000)  # kafka-python's is fine


def test_librdkafka_errors_become_the_kafka_python_errors_the_runner_catches():
    from confluent_kafka import KafkaError

    generation = kafka_error(KafkaError(KafkaError.ILLEGAL_GENERATION), "commit")
    assert isinstance(generation, kafka_errors.IllegalGenerationError) and isinstance(generation, REBALANCED)
    assert isinstance(kafka_error(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), "commit"), REBALANCED)
    assert isinstance(kafka_error(KafkaError(KafkaError.UNKNOWN_MEMBER_ID), "commit"), REBALANCED)
    away = kafka_error(KafkaError(KafkaError._TRANSPORT), "commit")
    assert isinstance(away, kafka_errors.KafkaConnectionError) and away.retriable and "commit" in str(away)
    assert isinstance(kafka_error(KafkaError(KafkaError._TIMED_OUT), "poll"), kafka_errors.KafkaTimeoutError)
    assert isinstance(kafka_error(KafkaError(KafkaError._STATE), "seek"), kafka_errors.IllegalStateError)


def test_the_runner_gets_kafka_pythons_consumer_unless_told_otherwise(broker):
    kp = make_runner_consumer(broker, f"g-{uuid.uuid4().hex[:6]}", KafkaConfig())
    try:
        assert type(kp).__module__.startswith("kafka."), "the default stays kafka-python's consumer"
    finally:
        kp.close()
    with pytest.raises(BrokerUnavailableError):
        RdkafkaConsumer(["127.0.0.1:9"], "g", KafkaConfig(client=CK, bootstrap_timeout_ms=500))


# ---------------------------------------------------------------------------------------------
# the same script through both clients, on the same topic
# ---------------------------------------------------------------------------------------------
def drain(consumer, want: int, deadline_s: float = 30.0) -> tuple[dict[int, list], int]:
    """Poll until ``want`` records came (or the deadline): ``{partition: [(offset, key, value, headers)]}`` and
    the largest poll seen."""
    got: dict[int, list] = {}
    largest, n, end = 0, 0, time.monotonic() + deadline_s
    while n < want and time.monotonic() < end:
        polled = consumer.poll(timeout_ms=200)
        largest = max(largest, sum(len(v) for v in polled.values()))
        for tp, recs in polled.items():
            for r in recs:
                assert (r.topic, r.partition) == (tp.topic, tp.partition)
                got.setdefault(tp.partition, []).append((r.offset, r.key, r.value, list(r.headers)))
                n += 1
    return got, largest


def script(broker: str, topic: str, client: str) -> dict:
    """Poll, seek, pause, resume, commit and read the watermarks of ``topic`` (2 partitions x 10 records)
    with the runner's consumer of ``client``; everything observed."""
    cfg = KafkaConfig(client=client, max_poll_records=3)
    group = f"g-{client}-{uuid.uuid4().hex[:6]}"
    p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    seen: dict = {}
    c = make_runner_consumer(broker, group, cfg)
    try:
        seen["partitions"] = c.partitions_for_topic(topic)
        c.assign([p0, p1])
        seen["assignment"] = c.assignment()
        seen["all"], seen["largest_poll"] = drain(c, 20)
        seen["highwater"] = (c.highwater(p0), c.highwater(p1))
        seen["position"] = (c.position(p0), c.position(p1))
        c.seek(p0, 4)
        c.pause(p1)
        seen["paused"] = c.paused()
        c.seek(p1, 2)  # paused: nothing comes from it until it is resumed
        seen["p0_from_4_p1_paused"], _ = drain(c, 6, deadline_s=3)
        c.resume(p1)
        seen["after_resume"], _ = drain(c, 8)
        seen["paused_after"] = c.paused()
        c.commit({p0: OffsetAndMetadata(6, "", -1), p1: OffsetAndMetadata(8, "", -1)}, timeout_ms=10000)
    finally:
        c.close(autocommit=False)
    probe = make_consumer(broker, group, KafkaConfig())
    try:
        seen["committed"] = (probe.committed(p0), probe.committed(p1))
    finally:
        probe.close()
    again = make_runner_consumer(broker, group, cfg)  # a new member starts from the committed offsets
    try:
        again.assign([p0, p1])
        got, _ = drain(again, 6)
        seen["restart"] = {p: [r[0] for r in recs] for p, recs in got.items()}
    finally:
        again.close(autocommit=False)
    return seen


@pytest.mark.integration
def test_poll_seek_pause_resume_commit_and_highwater_as_kafka_python(broker, fresh_topic):
    topic = fresh_topic(2)
    producer = make_producer(broker)
    try:
        futures = [producer.send(topic, value=f"v{p}.{i}".encode(), key=f"k{i}".encode(), headers=[("h", bytes([i]))],
                                 partition=p) for i in range(10) for p in (0, 1)]
        producer.flush(30)
        assert all(f.get(30) for f in futures)
    finally:
        producer.close()
    theirs, ours = script(broker, topic, "kafka-python"), script(broker, topic, CK)
    assert ours == theirs
    # and what both saw is what the script asks for (not merely the same)
    assert sorted(len(v) for v in ours["all"].values()) == [10, 10] and ours["largest_poll"] <= 3
    assert all([r[0] for r in recs] == list(range(10)) for recs in ours["all"].values()), "offset order per partition"
    assert ours["highwater"] == (10, 10) and ours["position"] == (10, 10)
    assert ours["paused"] == {TopicPartition(topic, 1)} and ours["paused_after"] == set()
    assert {p: [r[0] for r in recs] for p, recs in ours["p0_from_4_p1_paused"].items()} == {0: [4, 5, 6, 7, 8, 9]}
    assert {p: [r[0] for r in recs] for p, recs in ours["after_resume"].items()} == {1: [2, 3, 4, 5, 6, 7, 8, 9]}
    assert ours["committed"] == (6, 8)
    assert ours["restart"] == {0: [6, 7, 8, 9], 1: [8, 9]}
    assert ours["all"][1][3][1:] == (b"k3", b"v1.3", [("h", b"\x03")]), "key, value and headers as produced"


@pytest.mark.integration
def test_a_subscribed_consumer_tells_the_listener_inside_poll(broker, fresh_topic):
    """subscribe(listener=): the assignment comes through on_partitions_assigned from inside a poll, records
    follow; close() leaves the group with the revocation reported."""
    topic = fresh_topic(2)
    producer = make_producer(broker, spread=True)
    try:
        send_all_and_confirm(producer, [(topic, f"v{i}".encode()) for i in range(6)])
    finally:
        producer.close()
    tracker = RevocationTracker()
    c = make_runner_consumer(broker, f"g-{uuid.uuid4().hex[:6]}", KafkaConfig(client=CK))
    try:
        c.subscribe([topic], listener=tracker)
        assert tracker.changes == 0, "nothing before a poll"
        got, _ = drain(c, 6)
        assert tracker.assigned == {TopicPartition(topic, 0), TopicPartition(topic, 1)} == c.assignment()
        assert sorted(v for recs in got.values() for _, _, v, _ in recs) == [f"v{i}".encode() for i in range(6)]
        assert {p: c.highwater(TopicPartition(topic, p)) for p in got} == {p: len(recs) for p, recs in got.items()}
    finally:
        c.close()
    assert tracker.revoked == {TopicPartition(topic, 0), TopicPartition(topic, 1)} and not tracker.assigned


@pytest.mark.integration
def test_a_poll_returns_as_soon_as_a_record_is_there_not_when_max_poll_records_are(broker, fresh_topic):
    """kafka-python's poll returns what is there once anything is; librdkafka's consume(n, timeout) waits for
    all n (that cost ~300 ms per hop in the demo). A second record is produced only if the poll has not
    returned 15 s after the first: it must not be in the poll's answer."""
    topic = fresh_topic(1)
    tp = TopicPartition(topic, 0)
    c = make_runner_consumer(broker, f"g-{uuid.uuid4().hex[:6]}", KafkaConfig(client=CK, max_poll_records=16))
    producer = make_producer(broker)
    returned = threading.Event()
    try:
        c.assign([tp])
        c.poll(timeout_ms=200)
        send_and_confirm(producer, topic, b"first")

        def second() -> None:
            if not returned.wait(15):
                send_and_confirm(producer, topic, b"second")

        late = threading.Thread(target=second, daemon=True)
        late.start()
        got = c.poll(timeout_ms=30000)
        returned.set()
        late.join(20)
    finally:
        returned.set()
        producer.close()
        c.close()
    assert [r.value for r in got.get(tp, [])] == [b"first"]
