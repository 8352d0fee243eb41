"""CPU per record of one stage replica's runner against the plainest at-least-once loop, same broker.

A pass-through stage (``process`` returns its input) works through a backlog of N records through
``stages.runner.StageRunner`` — decode, process on its worker thread, encode, confirmed produce,
synchronous commit per commit group, dead-letter routing, metrics, Redis statistics and heartbeats —
and, interleaved, the plainest loops a user could write with the same kafka-python settings:
``poll(max_records=1)``, ``send`` + ``flush`` + ``get``, ``commit`` per record; and the same with
``poll(max_records=16)``, one flush and one commit per poll. No decode, no statistics. The ratio
against the better of the two says what the runner adds per record over the client library's own
cost; the library's cost is what every hop pays (bench/README.md, "Issue 15's goals").

CPU is ``time.process_time()`` of this process (all threads: kafka-python's IO and sender threads,
the runner's worker, heartbeat and metrics threads), from the first to the last record of the
backlog. The broker and redis-server are separate processes, not counted.

``--clients kafka-python,confluent``: the runner with each ``kafka.client`` (its producer and consumer:
kafka-python's, or confluent-kafka's, expstream/kafka/rdkafka.py and rdconsumer.py), interleaved, a row each.

Usage: ``.venv/bin/python bench/runner_cpu.py [--records 400] [--repeats 3]``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from common import checked_sets, fmt, machine, median, progress, save, table

from expstream.config.topology import load_topology
from expstream.kafka.clients import make_consumer, make_producer, send_all_and_confirm
from expstream.kafka.topics import create_topics
from expstream.launch.localservers import LocalBroker, LocalRedis
from expstream.state import RedisState
from schemas import PromptBatch, encode
from stages.context import make_context
from stages.runner import StageRunner


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=400, help="records in each backlog")
    p.add_argument("--repeats", type=int, default=3, help="(runner, bare) pairs, alternating order")
    p.add_argument("--trickle-ms", type=float, default=0.0,
                   help="records arrive one at a time this far apart (the steady state of a pipeline, where a "
                        "stage is faster than generate) instead of as a backlog; the runner only, plus its idle CPU")
    p.add_argument("--idle-s", type=float, default=5.0, help="with --trickle-ms: seconds of idle CPU measured")
    p.add_argument("--partitions", type=int, default=1,
                   help="with --trickle-ms: partitions of the input topic (the pipeline's topics have 8; the "
                        "feeder spreads its records over them round robin)")
    p.add_argument("--ab-set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --trickle-ms: also run the replica with this topology override (repeatable), the two "
                        "interleaved, a row each; e.g. --ab-set kafka.fetch_max_wait_ms=1000")
    p.add_argument("--clients", default="kafka-python",
                   help="comma-separated kafka.client values the runner is measured with, interleaved "
                        "(e.g. kafka-python,confluent)")
    return p.parse_args()


def backlog(boot: str, n: int) -> tuple[str, str]:
    src, dst = f"in-{uuid.uuid4().hex[:6]}", f"out-{uuid.uuid4().hex[:6]}"
    create_topics(boot, {src: 1, dst: 1}, with_dlq=True)
    producer = make_producer(boot)
    try:
        send_all_and_confirm(producer, [(src, encode(PromptBatch(batch_id=f"b{i}", prompt_id=[f"b{i}"], prompt=["x"],
                                                                 label=[""], reference=[""])), f"b{i}".encode(), None)
                                        for i in range(n)], 60)
    finally:
        producer.close()
    return src, dst


def passthrough(boot: str, redis_url: str, src: str, dst: str,
                sets: tuple[str, ...] = ()) -> tuple[StageRunner, threading.Thread]:
    """A pass-through StageRunner (shard-preprocess, output = input) reading ``src``, writing ``dst``, running
    on a daemon thread, with the topology overrides ``sets`` (e.g. ``kafka.client=confluent``); stop it with
    ``stop_requested`` and join the thread."""
    topo = load_topology(None, [f"stages.generate.output={src}", f"stages.shard-preprocess.output={dst}", *sets])
    run_id = uuid.uuid4().hex[:6]
    runner = StageRunner(make_context(topo, "shard-preprocess", run_id=run_id, state=RedisState(redis_url, run_id)),
                         lambda batch, ctx: [batch], boot)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    return runner, thread


def runner_cpu(boot: str, redis_url: str, n: int, client: str = "kafka-python") -> float:
    """ms of CPU per record of a pass-through StageRunner working through a backlog of ``n``."""
    src, dst = backlog(boot, n)
    runner, thread = passthrough(boot, redis_url, src, dst, (f"kafka.client={client}",))
    while runner.handled < 1:  # joined, first record done: the steady part starts here
        time.sleep(0.005)
    c0, first = time.process_time(), runner.handled
    while runner.handled < n:
        time.sleep(0.005)
    cpu = time.process_time() - c0
    runner.stop_requested = True
    thread.join(30)
    return 1000 * cpu / (n - first)


FEEDER = """
import sys, time
from expstream.kafka.clients import make_producer, send_and_confirm
from schemas import PromptBatch, encode
boot, topic, n, gap = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) / 1000
producer = make_producer(boot, spread=True)
for i in range(n):
    send_and_confirm(producer, topic, encode(PromptBatch(batch_id=f"b{i}", prompt_id=[f"b{i}"], prompt=["x"],
                                                         label=[""], reference=[""])), f"b{i}".encode())
    time.sleep(gap)
producer.close()
"""


def trickle_cpu(boot: str, redis_url: str, n: int, gap_ms: float, idle_s: float,
                partitions: int = 1, sets: tuple[str, ...] = ()) -> tuple[float, float, float]:
    """A pass-through StageRunner fed one record every ``gap_ms`` by another process (not counted):
    (ms of CPU per record, ms of CPU per second idle before the records, seconds per record)."""
    import subprocess
    import sys

    src, dst = f"in-{uuid.uuid4().hex[:6]}", f"out-{uuid.uuid4().hex[:6]}"
    create_topics(boot, {src: partitions, dst: 1}, with_dlq=True)
    runner, thread = passthrough(boot, redis_url, src, dst, sets)
    while not (runner.pausing is not None and runner.tracker.assigned):
        time.sleep(0.01)
    time.sleep(1.0)
    c0 = time.process_time() - time.thread_time()
    time.sleep(idle_s)
    idle = 1000 * (time.process_time() - time.thread_time() - c0) / idle_s
    feeder = subprocess.Popen([sys.executable, "-c", FEEDER, boot, src, str(n), str(gap_ms)])
    while runner.handled < 1:
        time.sleep(0.002)
    # the runner's threads only: this thread's own waiting (time.thread_time) is taken out
    c0, w0, first = time.process_time() - time.thread_time(), time.monotonic(), runner.handled
    while runner.handled < n:
        time.sleep(0.01)
    cpu, wall = time.process_time() - time.thread_time() - c0, time.monotonic() - w0
    feeder.wait(30)
    runner.stop_requested = True
    thread.join(30)
    if n <= first:
        raise SystemExit(f"--records {n}: every record was handled before the measurement began; give more")
    return 1000 * cpu / (n - first), idle, wall / (n - first)


def bare_cpu(boot: str, n: int, per_poll: int = 1) -> float:
    """ms of CPU per record of the plainest at-least-once loop (same client settings, no decode):
    ``per_poll`` = 1: send, flush, confirm and commit each record; more: the records of one poll
    sent, one flush, every future checked, one commit (what the runner's commit groups do)."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    src, dst = backlog(boot, n)
    cfg = load_topology(None, []).kafka
    consumer = make_consumer(boot, f"bare-{uuid.uuid4().hex[:6]}", cfg, topics=[src])
    producer = make_producer(boot, cfg)
    done, c0 = 0, None
    try:
        while done < n:
            for tp, records in consumer.poll(timeout_ms=500, max_records=per_poll).items():
                futures = [producer.send(dst, value=rec.value, key=rec.key) for rec in records]
                producer.flush()
                for f in futures:
                    f.get(timeout=30)
                consumer.commit({TopicPartition(tp.topic, tp.partition): OffsetAndMetadata(records[-1].offset + 1,
                                                                                             "", -1)})
                if c0 is None:
                    c0, first = time.process_time(), done + len(records)
                done += len(records)
        return 1000 * (time.process_time() - c0) / max(n - first, 1)
    finally:
        consumer.close(autocommit=False)
        producer.close()


def trickle_main(args: argparse.Namespace, clients: list[str], boot: str, redis_url: str, broker: LocalBroker,
                 redis: LocalRedis, start: dict[str, Any]) -> int:
    """--trickle-ms: the runner fed one record at a time, per client and, with --ab-set, also with the first
    client plus the overrides; all variants interleaved, a row each."""
    variants = {f"kafka.client={c}": (f"kafka.client={c}",) for c in clients}
    if args.ab_set:
        variants[f"kafka.client={clients[0]} " + " ".join(args.ab_set)] = (f"kafka.client={clients[0]}", *args.ab_set)
    got_v: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    try:
        for rep in range(args.repeats):
            for name in list(variants) if rep % 2 == 0 else list(variants)[::-1]:
                got_v[name].append(trickle_cpu(boot, redis_url, args.records, args.trickle_ms, args.idle_s,
                                               args.partitions, variants[name]))
                per, idle, gap = got_v[name][-1]
                progress(f"trickle {name}: {per:.2f} ms CPU per record, idle {idle:.1f} ms CPU per s, "
                         f"{1000 * gap:.1f} ms apart")
    finally:
        broker.stop()
        redis.stop()
    rows = []
    for name, g in got_v.items():
        rows += [[f"{name}: CPU ms per record, one at a time", median([x[0] for x in g]),
                  " ".join(fmt(x[0]) for x in g)],
                 [f"{name}: idle CPU ms per second", median([x[1] for x in g]), " ".join(fmt(x[1]) for x in g)]]
    names = list(variants)
    if len(names) > 1:
        first = median([x[0] for x in got_v[names[0]]])
        rows += [[f"ratio {k} / {names[0]} per record", median([x[0] for x in got_v[k]]) / first, ""]
                 for k in names[1:]]
    print(table(["measure", "median", "runs"], rows,
                title=f"{args.records} records {args.trickle_ms:g} ms apart over {args.partitions} partitions; load avg "
                      f"{start['loadavg']} -> {machine()['loadavg']}"))
    save("runner_cpu_trickle", {"records": args.records, "gap_ms": args.trickle_ms,
                                "runs": {k: [list(g) for g in v] for k, v in got_v.items()}})
    return 0


def main() -> int:
    args = parse_args()
    checked_sets(args.ab_set, "--ab-set")
    start = machine()
    tmp = Path(tempfile.mkdtemp(prefix="bench-runner-"))
    broker, redis = LocalBroker(tmp / "broker"), LocalRedis(tmp / "redis")
    boot, redis_url = broker.start(), redis.start()
    clients = args.clients.split(",")
    if args.trickle_ms:
        return trickle_main(args, clients, boot, redis_url, broker, redis, start)
    sides = {**{f"runner {c}": (lambda c=c: runner_cpu(boot, redis_url, args.records, c)) for c in clients},
             "bare": lambda: bare_cpu(boot, args.records),
             "bare16": lambda: bare_cpu(boot, args.records, per_poll=16)}
    got: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for rep in range(args.repeats):
            for side in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
                ms = sides[side]()
                got[side].append(ms)
                progress(f"{side} repeat {rep + 1}: {ms:.2f} ms CPU per record")
    finally:
        broker.stop()
        redis.stop()
    rs = {c: median(got[f"runner {c}"]) for c in clients}
    r, b1, b16 = rs[clients[0]], median(got["bare"]), median(got["bare16"])
    b = min(b1, b16)  # the baseline: the better plain loop
    end = machine()
    print(table(["loop", "CPU ms per record (median)", "runs"],
                [*[[f"StageRunner, pass-through stage, kafka.client={c}", rs[c], " ".join(fmt(x) for x in
                                                                                        got[f"runner {c}"])]
                   for c in clients],
                 ["plain loop, a commit per record", b1, " ".join(fmt(x) for x in got["bare"])],
                 ["plain loop, a flush + commit per poll of <= 16", b16, " ".join(fmt(x) for x in got["bare16"])],
                 *[[f"ratio runner ({c}) / best plain loop", rs[c] / b if b else float("nan"), ""] for c in clients]],
                title=f"{args.records} records per backlog, {args.repeats} rounds; load avg {start['loadavg']} -> "
                      f"{end['loadavg']}"))
    summary: dict[str, Any] = {"records": args.records, "runner_ms": got[f"runner {clients[0]}"],
                               "runner_ms_by_client": {c: got[f"runner {c}"] for c in clients}, "bare_ms": got["bare"],
                               "bare16_ms": got["bare16"],
                               "ratio": r / b if b else None, "loadavg": [start["loadavg"], end["loadavg"]]}
    save("runner_cpu", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
