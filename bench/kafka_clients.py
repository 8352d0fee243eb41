"""A hop's broker round trips with kafka-python (what the stages use) and with confluent-kafka (librdkafka).

One record at a time through the embedded broker (LocalBroker): produce and wait for the acknowledgement,
fetch it as a consumer-group member, commit its offset synchronously -- the three round trips a stage pays
per record when records arrive one by one (bench/README.md "Item 2"). Both clients in the same run,
interleaved; CPU is the process's (every thread, the clients' IO threads included), per record.

confluent-kafka is not a dependency of expstream: ``pip install confluent-kafka==2.16.1`` (or
``--ck-path DIR`` for a ``pip install --target DIR``); without it only kafka-python is measured.
Why this bench: the question of the next speed step, whether a compiled client takes the hop under 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from expstream.config.kafka import KafkaConfig  # noqa: E402
from expstream.kafka.clients import make_consumer, make_producer  # noqa: E402
from expstream.kafka.topics import create_topics  # noqa: E402
from expstream.launch.localservers import LocalBroker  # noqa: E402

VALUE = b"x" * 5000  # a tiny-model record is 5-10 KB


def kafka_python_hops(bootstrap: str, n: int) -> dict[str, float]:
    """n records one by one with the stages' own kafka-python settings (expstream/kafka/clients.py)."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    cfg = KafkaConfig()
    topic = f"kp-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, {topic: 1}, with_dlq=False)
    producer = make_producer(bootstrap, cfg)
    consumer = make_consumer(bootstrap, f"g-{topic}", cfg, topics=[topic])
    try:
        while not consumer.assignment():
            consumer.poll(timeout_ms=100)
        return _timed(n, lambda: producer.send(topic, VALUE).get(10), lambda: _kp_fetch(consumer),
                      lambda rec: consumer.commit({TopicPartition(topic, rec.partition):
                                                   OffsetAndMetadata(rec.offset + 1, "", -1)}))
    finally:
        consumer.close()
        producer.close()


def _kp_fetch(consumer: Any) -> Any:
    while True:
        for records in consumer.poll(timeout_ms=1000, max_records=1).values():
            return records[0]


def confluent_hops(bootstrap: str, n: int) -> dict[str, float]:
    """The same with confluent-kafka, settings as close as its names allow (acks all, no linger, session 6 s)."""
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"ck-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # held: a dropped handle cancels its futures
    for fut in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        fut.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all", "log_level": 3})
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{topic}", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False, "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000,
                         "fetch.wait.max.ms": 10, "log_level": 3})
    consumer.subscribe([topic])
    try:
        while not consumer.assignment():
            consumer.poll(0.1)

        def produce() -> None:
            producer.produce(topic, value=VALUE)
            if producer.flush(10):
                raise RuntimeError("confluent-kafka: a produce was not acknowledged in 10 s")

        def fetch() -> Any:
            while True:
                msg = consumer.poll(1.0)
                if msg is not None:
                    if msg.error():
                        raise RuntimeError(f"confluent-kafka fetch: {msg.error()}")
                    return msg

        return _timed(n, produce, fetch, lambda msg: consumer.commit(message=msg, asynchronous=False))
    finally:
        consumer.close()


def _timed(n: int, produce: Any, fetch: Any, commit: Any) -> dict[str, float]:
    for _ in range(10):  # warm-up: connections, metadata, the first fetch session
        produce()
        commit(fetch())
    walls = []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        produce()
        commit(fetch())
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    return {"cpu_ms_per_record": 1000 * cpu / n, "wall_ms_median": 1000 * statistics.median(walls),
            "wall_ms_p90": 1000 * sorted(walls)[int(0.9 * (n - 1))]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=300, help="records one by one per client and repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per client")
    p.add_argument("--ck-path", type=Path, help="a directory confluent-kafka was pip-installed into (--target)")
    args = p.parse_args()
    if args.ck_path:
        sys.path.insert(0, str(args.ck_path))
    try:
        import confluent_kafka  # noqa: F401

        clients = {"kafka-python": kafka_python_hops, "confluent-kafka": confluent_hops}
    except ImportError:
        print("confluent-kafka not importable: kafka-python only (pip install confluent-kafka==2.16.1)",
              file=sys.stderr)
        clients = {"kafka-python": kafka_python_hops}
    tmp = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    broker = LocalBroker(tmp / "broker")
    bootstrap = broker.start()
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in clients}
    load0 = os.getloadavg()
    try:
        for rep in range(args.repeats):
            for name in (list(clients) if rep % 2 == 0 else list(reversed(clients))):
                rows[name].append(clients[name](bootstrap, args.records))
    finally:
        broker.stop()
    load1 = os.getloadavg()
    print(f"one record at a time: acknowledged produce + group fetch + synchronous commit, {args.records} records x "
          f"{args.repeats}; load avg {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"{'client':16s} {'CPU ms/record':>14s} {'wall ms median':>15s} {'wall ms p90':>12s}")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    for name, m in med.items():
        print(f"{name:16s} {m['cpu_ms_per_record']:14.3f} {m['wall_ms_median']:15.3f} {m['wall_ms_p90']:12.3f}")
    if "confluent-kafka" in med:
        print(f"kafka-python CPU / confluent-kafka CPU: "
              f"{med['kafka-python']['cpu_ms_per_record'] / med['confluent-kafka']['cpu_ms_per_record']:.2f}x")
    out = ROOT / "bench" / "results" / "kafka_clients.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"loadavg": [load0, load1], "records": args.records, "runs": rows, "median": med},
                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
