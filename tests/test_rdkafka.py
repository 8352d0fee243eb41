"""``kafka.client: confluent``: the librdkafka producer (expstream/kafka/rdkafka.py) keeps kafka-python's guarantees.

The configuration refuses what would be silently wrong; against the session broker the producer spreads,
hashes keys, carries headers and refuses oversized records like kafka-python's; and a stage replica
with it puts out exactly what a kafka-python replica puts out (outputs and dead letters, every offset
committed), and commits nothing while its outputs cannot be acknowledged. confluent-kafka is in the
``dev`` extra (``make setup``), so these run wherever the suite does.
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections import Counter

import pytest

from expstream.config.kafka import KafkaConfig
from expstream.config.topology import load_topology
from expstream.errors import BrokerUnavailableError, ConfigError, ProduceError
from expstream.kafka.clients import (
    make_producer,
    read_topic,
    send_all_and_confirm,
    send_and_confirm,
    topic_lag,
)
from expstream.kafka.letters import H_ERROR_CLASS
from expstream.kafka.topics import create_topics
from schemas import PromptBatch, encode
from schemas.codec import peek_header
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running

CK = "confluent"


# ---------------------------------------------------------------------------------------------
# configuration (no server)
# ---------------------------------------------------------------------------------------------
def test_an_unknown_client_is_refused_naming_the_field_and_the_choices():
    with pytest.raises(ConfigError) as err:
        KafkaConfig.from_dict({"client": "librdkafka"})
    assert err.value.field == "kafka.client"
    assert "'kafka-python' or 'confluent'" in str(err.value)
    with pytest.raises(ConfigError, match="kafka.client"):
        load_topology(overrides=["kafka.client=rdkafka"])


def test_confluent_without_the_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "confluent_kafka" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        KafkaConfig(client=CK)
    assert err.value.field == "kafka.client" and "expstream[confluent]" in str(err.value)
    assert KafkaConfig().client == "kafka-python", "the default needs nothing extra"


def test_kafka_python_producer_arguments_are_refused_with_the_confluent_producer():
    with pytest.raises(ConfigError) as err:
        KafkaConfig.from_dict({"client": CK, "extra": {"producer": {"client_id": "x"}}})
    assert err.value.field == "kafka.extra.producer" and "kafka.extra.librdkafka" in str(err.value)
    cfg = KafkaConfig.from_dict({"client": CK, "extra": {"librdkafka": {"client.id": "x"}, "consumer": {"client_id": "y"}}})
    assert "librdkafka" not in cfg.client_kwargs("consumer") and cfg.client_kwargs("consumer")["client_id"] == "y"
    with pytest.raises(ConfigError, match="password"):
        KafkaConfig.from_dict({"client": CK, "extra": {"librdkafka": {"sasl.password": "s3cret"}}})


def test_the_librdkafka_settings_mirror_the_kafka_python_ones():
    from expstream.kafka.rdkafka import rdkafka_config

    conf = rdkafka_config(["h:1"], KafkaConfig(client=CK))
    assert conf["acks"] == "all" and conf["enable.idempotence"] is True, "idempotent like kafka-python's default"
    assert conf["retries"] == 5 and conf["linger.ms"] == 2 and conf["message.max.bytes"] == 64 * 1024 * 1024
    assert conf["partitioner"] == "murmur2_random" and conf["allow.auto.create.topics"] is False
    assert conf["compression.type"] == "none" and conf["message.timeout.ms"] == 120000
    # kafka-python drops idempotence when acks is not all or there are no retries: so does this
    assert rdkafka_config(["h:1"], KafkaConfig(client=CK, acks=1))["enable.idempotence"] is False
    assert rdkafka_config(["h:1"], KafkaConfig(client=CK, retries=0))["enable.idempotence"] is False


# ---------------------------------------------------------------------------------------------
# the producer against the session broker
# ---------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_records_spread_round_robin_with_keys_and_headers_intact(broker, fresh_topic):
    topic = fresh_topic(4)
    producer = make_producer(broker, KafkaConfig(client=CK), spread=True)
    try:
        sent = [(topic, f"v{i}".encode(), f"k{i}".encode(), [("h", str(i).encode())]) for i in range(12)]
        mds = send_all_and_confirm(producer, sent)
    finally:
        producer.close()
    assert Counter(md.partition for md in mds) == {0: 3, 1: 3, 2: 3, 3: 3}
    got = {(r.key, r.value, tuple(r.headers)) for r in read_topic(broker, None, topic)}
    assert got == {(f"k{i}".encode(), f"v{i}".encode(), (("h", str(i).encode()),)) for i in range(12)}


@pytest.mark.integration
def test_a_key_goes_to_the_partition_kafka_python_gives_it(broker, fresh_topic):
    topic = fresh_topic(8)
    kp, ck = make_producer(broker, KafkaConfig()), make_producer(broker, KafkaConfig(client=CK))
    try:
        keys = [f"batch-{i}".encode() for i in range(24)]
        theirs = [send_and_confirm(kp, topic, b"a", k).partition for k in keys]
        ours = [send_and_confirm(ck, topic, b"b", k).partition for k in keys]
    finally:
        kp.close()
        ck.close()
    assert ours == theirs and len(set(ours)) > 1


@pytest.mark.integration
def test_an_oversized_record_is_refused_not_retriable_and_no_broker_is_unavailable(broker, fresh_topic):
    topic = fresh_topic()
    producer = make_producer(broker, KafkaConfig(client=CK, max_request_size=2000))
    try:
        with pytest.raises(ProduceError) as err:
            send_all_and_confirm(producer, [(topic, b"ok"), (topic, b"x" * 5000)], timeout_s=10)
    finally:
        producer.close()
    assert not err.value.retriable, "a refusal is not retried: the record is dead-lettered"
    assert "too large" in str(err.value)
    with pytest.raises(BrokerUnavailableError):
        make_producer("127.0.0.1:9", KafkaConfig(client=CK, bootstrap_timeout_ms=500))


# ---------------------------------------------------------------------------------------------
# a stage replica with it
# ---------------------------------------------------------------------------------------------
def prompts(name: str, label: str = "") -> bytes:
    return encode(PromptBatch(batch_id=name, prompt_id=[name], prompt=["x"], label=[label], reference=[""]))


def replica_run(broker: str, client: str, values: list[bytes]) -> dict:
    """A pass-through replica (with ``client``) over ``values``: what came out, the letters, the lag."""
    src, dst = f"in-{uuid.uuid4().hex[:8]}", f"out-{uuid.uuid4().hex[:8]}"
    create_topics(broker, {src: 2, dst: 2}, with_dlq=True)
    topo = load_topology(overrides=[f"stages.generate.output={src}", f"stages.shard-preprocess.output={dst}",
                                    f"kafka.client={client}", "kafka.max_request_size=20000"])

    def process(batch, ctx):  # "big": an output over kafka.max_request_size (the broker refuses it)
        return [batch.replace(label=["y" * 30000]) if batch.batch_id == "big" else batch]

    producer = make_producer(broker, spread=True)
    try:
        send_all_and_confirm(producer, [(src, v) for v in values])
    finally:
        producer.close()
    runner = StageRunner(make_context(topo, "shard-preprocess", run_id=f"c{uuid.uuid4().hex[:6]}"), process, broker)
    running = Running(runner)
    try:
        running.wait(lambda: runner.handled == len(values), 90, "every record")
    finally:
        running.stop()
    letters = sorted((r.value, dict(r.headers)[H_ERROR_CLASS]) for r in read_topic(broker, None, f"{src}.dlq"))
    return {"out": sorted(r.value for r in read_topic(broker, None, dst)), "letters": letters,
            "lag": topic_lag(broker, None, runner.group_id, src), "dead": runner.dead_lettered}


@pytest.mark.integration
def test_a_replica_with_the_confluent_producer_puts_out_what_kafka_python_does(broker):
    """Same inputs, one replica per client: the same outputs (bytes), the same letters (the undecodable
    record's original bytes; the record whose output the broker refuses, whole), every offset committed."""
    values = [prompts(f"b{i}") for i in range(20)] + [b"\xc1 not msgpack", prompts("big")]
    theirs, ours = replica_run(broker, "kafka-python", values), replica_run(broker, CK, values)
    assert len(ours["out"]) == 20 and {peek_header(v)[2] for v in ours["out"]} == {f"b{i}" for i in range(20)}
    assert ours["out"] == theirs["out"]
    assert ours["letters"] == theirs["letters"] == sorted([(b"\xc1 not msgpack", b"DecodeError"),
                                                           (prompts("big"), b"ProduceError")])
    assert ours["lag"] == theirs["lag"] == {0: 0, 1: 0}, "every offset committed"


@pytest.mark.integration
def test_nothing_is_committed_while_the_outputs_cannot_be_acknowledged(broker):
    """The output topic does not exist yet: the replica retries its sends and commits nothing; once the
    topic is there, every output comes out once and every offset is committed."""
    src, dst = f"in-{uuid.uuid4().hex[:8]}", f"out-{uuid.uuid4().hex[:8]}"
    create_topics(broker, {src: 1}, with_dlq=True)
    topo = load_topology(overrides=[f"stages.generate.output={src}", f"stages.shard-preprocess.output={dst}",
                                    f"kafka.client={CK}"])
    producer = make_producer(broker)
    try:
        send_all_and_confirm(producer, [(src, prompts(f"b{i}")) for i in range(3)])
    finally:
        producer.close()
    runner = StageRunner(make_context(topo, "shard-preprocess", run_id=f"n{uuid.uuid4().hex[:6]}"),
                         lambda batch, ctx: [batch], broker)
    running = Running(runner)
    try:
        running.wait(lambda: runner.worker is not None and runner.worker.worked >= 1, 60, "a record in work")
        time.sleep(2.0)  # sends retried meanwhile (WORK_RETRY backoff)
        assert runner.handled == 0 and topic_lag(broker, None, runner.group_id, src) == {0: 3}, "nothing committed"
        create_topics(broker, {dst: 1}, with_dlq=False)
        running.wait(lambda: runner.handled == 3, 90, "every record after the topic came")
    finally:
        running.stop()
    assert sorted(peek_header(r.value)[2] for r in read_topic(broker, None, dst)) == ["b0", "b1", "b2"]
    assert topic_lag(broker, None, runner.group_id, src) == {0: 0} and runner.dead_lettered == 0


@pytest.mark.integration
def test_a_send_while_the_broker_is_away_is_queued_then_acknowledged(tmp_path):
    """As with kafka-python (whose bootstrap metadata knows every topic): a spread send while the broker
    does not answer is queued, not refused; its confirmation fails retriable meanwhile, and once the
    broker is back the record is acknowledged and written once."""
    from expstream.kafka.clients import confirm_all, flush, send_all
    from expstream.launch.localservers import LocalBroker

    with LocalBroker(tmp_path) as own:
        create_topics(own.bootstrap, {"away": 2}, with_dlq=False)
        producer = make_producer(own.bootstrap, KafkaConfig(client=CK, produce_timeout_s=2.0), spread=True)
        try:
            own.pause()
            try:
                sent = send_all(producer, [("away", b"queued")])
                with pytest.raises(ProduceError) as err:
                    confirm_all(sent, 1.0)
                assert err.value.retriable
            finally:
                own.resume()
            flush(producer, 30)
            assert confirm_all(sent, 30)[0].topic == "away"
        finally:
            producer.close()
        assert [r.value for r in read_topic(own.bootstrap, None, "away")] == [b"queued"]
