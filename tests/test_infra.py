"""Local broker/redis processes, topic creation and the Kafka bus, against a real Tansu broker."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from expstream import errors
from expstream.kafka.clients import (
    KafkaConfig,
    OutRecord,
    end_offsets,
    make_admin,
    make_consumer,
    make_producer,
    read_topic,
    send_all_and_confirm,
    send_and_confirm,
    topic_lag,
)
from expstream.kafka.topics import create_topics
from expstream.launch.localservers import LocalBroker, LocalRedis, free_port, port_is_open

pytestmark = pytest.mark.integration


# --- errors ------------------------------------------------------------------------------------


def test_error_hierarchy_says_what_is_retriable():
    assert errors.ExpstreamError.retriable is False
    assert errors.ConfigError.retriable is False
    assert errors.PoisonRecordError.retriable is False
    assert errors.ShutdownRequested.retriable is False
    for cls in (
        errors.InfraError,
        errors.BrokerUnavailableError,
        errors.StateUnavailableError,
        errors.ProduceError,
    ):
        assert issubclass(cls, errors.InfraError) and cls.retriable is True
    e = errors.ConfigError("must be positive", field="kafka.linger_ms", fix="set it to 2")
    assert "kafka.linger_ms" in str(e) and "set it to 2" in str(e)


# --- config ------------------------------------------------------------------------------------


def test_kafka_config_rejects_unknown_key_naming_the_closest():
    with pytest.raises(errors.ConfigError) as ei:
        KafkaConfig.from_dict({"sesion_timeout_ms": 6000})
    assert "session_timeout_ms" in str(ei.value) and "sesion_timeout_ms" in str(ei.value)
    with pytest.raises(errors.ConfigError, match="valid keys"):
        KafkaConfig.from_dict({"zzz": 1})
    with pytest.raises(errors.ConfigError, match="heartbeat_interval_ms"):
        KafkaConfig.from_dict({"heartbeat_interval_ms": 7000})
    with pytest.raises(errors.ConfigError, match="acks"):
        KafkaConfig(acks="most")
    cfg = KafkaConfig.from_dict({"linger_ms": 5, "compression_type": "gzip"})
    assert cfg.linger_ms == 5 and cfg.session_timeout_ms == 6000
    assert cfg.replace(linger_ms=0).linger_ms == 0
    with pytest.raises(errors.ConfigError, match="max_poll_records"):
        cfg.replace(max_poll_record=2)


def test_client_kwargs_map_to_kafka_python():
    cfg = KafkaConfig(extra={"consumer": {"client_id": "x"}})
    c = cfg.client_kwargs("consumer")
    assert c["enable_auto_commit"] is False and c["allow_auto_create_topics"] is False
    assert c["max_poll_records"] == cfg.max_poll_records and c["session_timeout_ms"] == 6000 and c["client_id"] == "x"
    assert "value_deserializer" not in c
    p = cfg.client_kwargs("producer")
    assert p["acks"] == "all" and p["max_request_size"] == 64 * 1024 * 1024 and "session_timeout_ms" not in p
    assert "acks" not in cfg.client_kwargs("admin")


# --- local broker ------------------------------------------------------------------------------


def test_local_broker_start_pause_stop_frees_port(tmp_path):
    b = LocalBroker(tmp_path / "b")
    bootstrap = b.start()
    host, port = bootstrap.rsplit(":", 1)
    # start() returns a broker that serves, not one still coming up (its own deadline is the bound):
    # the port accepts and the process is alive the moment it returns, before anything else waits
    assert port_is_open("127.0.0.1", int(port)) and b.running, b.log_tail()
    assert host == "127.0.0.1" and int(port) == b.port
    assert int((tmp_path / "b" / "broker.pid").read_text()) == b.pid
    assert (tmp_path / "b" / "broker.log").exists()

    b.pause()
    with open(f"/proc/{b.pid}/stat") as fh:
        assert fh.read().rsplit(") ", 1)[1][0] == "T"  # stopped (pause() waits for it)
    b.resume()
    admin = make_admin(bootstrap)
    admin.list_topics()
    admin.close()

    pid = b.pid
    b.stop()
    assert b.pid is None and not (tmp_path / "b" / "broker.pid").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not port_is_open("127.0.0.1", int(port))
    with socket.socket() as s:  # a new server can bind it again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(port)))
    b.stop()  # idempotent


def test_unreachable_broker_is_a_retriable_error():
    cfg = KafkaConfig(bootstrap_timeout_ms=300)
    with pytest.raises(errors.BrokerUnavailableError) as ei:
        make_admin(f"127.0.0.1:{free_port()}", cfg)
    assert ei.value.retriable


def test_local_redis_without_binary_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(errors.InfraError, match="apt-get install -y redis-server"):
        LocalRedis(tmp_path / "r").start()


# --- topics ------------------------------------------------------------------------------------


def test_create_topics_idempotent_with_dlq_twins(broker):
    a, b = f"ta-{uuid.uuid4().hex[:8]}", f"tb-{uuid.uuid4().hex[:8]}"
    names = create_topics(broker, {a: 3, b: 1})
    assert names == [a, b, f"{a}.dlq", f"{b}.dlq"]
    assert create_topics(broker, {a: 3, b: 1}) == names  # again: no error
    admin = make_admin(broker)
    try:
        parts = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(names)}
    finally:
        admin.close()
    assert parts == {a: 3, b: 1, f"{a}.dlq": 1, f"{b}.dlq": 1}
    with pytest.raises(errors.ConfigError, match="already exists with 3 partitions"):
        create_topics(broker, {a: 4}, with_dlq=False, timeout_s=5)
    c = f"tc-{uuid.uuid4().hex[:8]}"
    assert create_topics(broker, {c: 2}, with_dlq=False) == [c]


# --- produce / consume -------------------------------------------------------------------------


def _poll_n(consumer, n, timeout_s=20.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        for recs in consumer.poll(timeout_ms=200).values():
            out.extend(recs)
    return out


def test_round_trip_commit_resume_and_lag(broker, fresh_topic, kafka_cfg):
    topic = fresh_topic(1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    producer = make_producer(broker, kafka_cfg)
    items = [
        OutRecord(topic, f"v{i}".encode(), f"k{i}".encode(), [("stage", b"test"), ("i", str(i).encode())])
        for i in range(5)
    ]
    mds = send_all_and_confirm(producer, items, timeout_s=10)
    assert [m.offset for m in mds] == [0, 1, 2, 3, 4]
    assert send_all_and_confirm(producer, []) == []

    assert topic_lag(broker, kafka_cfg, group, topic) == {0: 5}  # never committed: everything

    c1 = make_consumer(broker, group, kafka_cfg, topics=[topic])
    got = _poll_n(c1, 3, timeout_s=120)  # the first join of a group: a deadline on the wait, not a speed bound
    assert len(got) >= 3, f"the first group join delivered {len(got)} of 3 records within 120 s"
    assert [r.value for r in got[:3]] == [b"v0", b"v1", b"v2"]
    assert got[0].key == b"k0" and dict(got[0].headers)["stage"] == b"test"
    tp = TopicPartition(topic, 0)
    c1.commit({tp: OffsetAndMetadata(got[2].offset + 1, None, -1)})  # last processed + 1
    c1.close()

    assert topic_lag(broker, kafka_cfg, group, topic) == {0: 2}

    c2 = make_consumer(broker, group, kafka_cfg, topics=[topic])
    rest = _poll_n(c2, 2)
    assert [r.value for r in rest] == [b"v3", b"v4"]
    c2.commit({tp: OffsetAndMetadata(rest[-1].offset + 1, None, -1)})
    c2.close()
    assert topic_lag(broker, kafka_cfg, group, topic) == {0: 0}
    producer.close()


def test_read_topic_returns_exactly_what_was_produced(broker, fresh_topic, kafka_cfg):
    topic = fresh_topic(3)
    producer = make_producer(broker, kafka_cfg)
    sent = [(f"k{i % 7}".encode(), f"v{i}".encode()) for i in range(30)]
    send_all_and_confirm(producer, [(topic, v, k) for k, v in sent])
    send_and_confirm(producer, topic, b"last", key=b"k0", headers=[("h", b"1")], timeout_s=10)
    sent.append((b"k0", b"last"))

    got = list(read_topic(broker, kafka_cfg, topic, timeout_s=10))
    assert sorted((r.key, r.value) for r in got) == sorted(sent)
    for p in {r.partition for r in got}:  # offset order within each partition, no gaps
        offs = [r.offset for r in got if r.partition == p]
        assert offs == list(range(len(offs)))
    same_key = [r.value for r in got if r.key == b"k0"]  # one key -> one partition -> send order
    assert same_key == [v for k, v in sent if k == b"k0"]

    # records produced after the snapshot are not returned
    it = read_topic(broker, kafka_cfg, topic, timeout_s=10)
    first = next(it)
    send_and_confirm(producer, topic, b"later", key=b"k1", timeout_s=10)
    rest = list(it)
    assert len(rest) + 1 == len(sent) and b"later" not in [r.value for r in rest] + [first.value]
    assert len(list(read_topic(broker, kafka_cfg, topic, timeout_s=10, max_records=4))) == 4
    producer.close()


def test_end_offsets_count_records_not_batches(broker, fresh_topic, kafka_cfg):
    # Tansu 0.6 answers ListOffsets(LATEST) with "last batch's base offset + 1"; end_offsets must not.
    topic = fresh_topic(2)
    producer = make_producer(broker, kafka_cfg)
    send_all_and_confirm(producer, [(topic, b"x", b"same-key") for _ in range(5)])
    send_all_and_confirm(producer, [(topic, b"y", b"same-key") for _ in range(3)])
    producer.close()
    ends = end_offsets(broker, kafka_cfg, [TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout_s=10)
    assert sorted(ends.values()) == [0, 8]


def test_too_large_record_is_a_non_retriable_produce_error(broker, fresh_topic):
    topic = fresh_topic(1)
    producer = make_producer(broker, KafkaConfig(max_request_size=2000))
    with pytest.raises(errors.ProduceError) as ei:
        send_and_confirm(producer, topic, b"x" * 5000, timeout_s=5)
    assert ei.value.retriable is False
    producer.close()
