"""``kafka.fetch_max_wait_ms`` on the embedded broker: latency per hop and idle CPU per wait, and the demo.

Tansu answers a waiting fetch on a halving schedule (docs/kafka-notes.md), so the wait W trades
latency for CPU. For each W (interleaved over ``--repeats`` rounds): a consumer polling without pause
on 8 partitions, a producer sending ``--records`` records at random gaps (0.05-1 s), the time from the
confirmed send to the poll that returns the record (median, p90), and the consumer process's idle CPU
(no records, ``--idle-s``). With ``--demo``, the README's demo command per W, interleaved (first
experience, whole command). Every row is also given as a ratio against the best W of that column.

Usage: ``.venv/bin/python bench/fetch_wait.py [--waits 50,200,500,1000] [--records 25] [--demo 3]``.
Nothing is asserted. CPU per record of a stage replica per W: ``bench/runner_cpu.py --trickle-ms 50
--partitions 8 --ab-set kafka.fetch_max_wait_ms=W``; the pipeline: ``bench/pipeline.py --ab-set ...``.
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from common import checked_sets, fmt, machine, median, progress, save, table

from expstream.config.topology import load_topology
from expstream.kafka.clients import make_consumer, make_producer, send_and_confirm
from expstream.kafka.topics import create_topics
from expstream.launch.localservers import LocalBroker

PARTITIONS = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waits", default="50,200,500,1000", help="comma-separated fetch_max_wait_ms values")
    p.add_argument("--records", type=int, default=25, help="records timed per wait and round")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the waits (order alternates)")
    p.add_argument("--idle-s", type=float, default=4.0, help="seconds of idle CPU measured per wait and round")
    p.add_argument("--demo", type=int, default=0, help="demo runs per wait (0: none)")
    return p.parse_args()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def latency_and_idle(boot: str, wait_ms: int, n: int, idle_s: float, rng: random.Random) -> dict[str, Any]:
    """One wait: the idle consumer's CPU per second, then ``n`` records' send → poll latency (ms)."""
    from kafka import TopicPartition

    cfg = load_topology(None, [f"kafka.fetch_max_wait_ms={wait_ms}"]).kafka
    topic = f"fw-{uuid.uuid4().hex[:6]}"
    create_topics(boot, {topic: PARTITIONS}, with_dlq=False)
    consumer, producer = make_consumer(boot, None, cfg), make_producer(boot, cfg)
    consumer.assign([TopicPartition(topic, k) for k in range(PARTITIONS)])
    consumer.poll(timeout_ms=300)
    seen: dict[bytes, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    seen[r.value] = time.monotonic()

    thread = threading.Thread(target=poll, daemon=True)
    try:
        thread.start()
        time.sleep(0.5)
        c0 = _cpu_s()  # this process is the consumer's (the producer is idle until the records)
        time.sleep(idle_s)
        idle = 1000 * (_cpu_s() - c0) / idle_s
        sent: dict[bytes, float] = {}
        for i in range(n):
            time.sleep(rng.uniform(0.05, 1.0))
            value = f"{wait_ms}-{i}".encode()
            sent[value] = time.monotonic()
            send_and_confirm(producer, topic, value)
        deadline = time.monotonic() + 5
        while len(seen) < n and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(5)
        consumer.close()
        producer.close()
    lat = sorted(1000 * (seen[v] - sent[v]) for v in sent if v in seen)
    return {"idle_cpu_ms_per_s": idle, "latency_ms": lat, "missing": n - len(lat)}


def main() -> int:
    args = parse_args()
    waits = [w.strip() for w in args.waits.split(",") if w.strip()]
    checked_sets([f"kafka.fetch_max_wait_ms={w}" for w in waits], "--waits")
    waits = [int(w) for w in waits]
    start, rng = machine(), random.Random(1)
    got: dict[int, list[dict[str, Any]]] = {w: [] for w in waits}
    demos: dict[int, list[dict[str, Any]]] = {w: [] for w in waits}
    tmp = Path(tempfile.mkdtemp(prefix="bench-fetch-wait-"))
    with LocalBroker(tmp / "broker") as broker:
        for rep in range(args.repeats):
            for w in waits if rep % 2 == 0 else waits[::-1]:
                r = latency_and_idle(broker.bootstrap, w, args.records, args.idle_s, rng)
                got[w].append(r)
                progress(f"W {w} round {rep + 1}: latency median {fmt(median(r['latency_ms']), '.1f')} ms, idle "
                         f"{r['idle_cpu_ms_per_s']:.1f} ms/s, missing {r['missing']}")
    if args.demo:
        from pipeline import demo_run

        for rep in range(args.demo):
            for w in waits if rep % 2 == 0 else waits[::-1]:
                d = demo_run(tmp / f"demo-{w}-{rep}", sets=(f"kafka.fetch_max_wait_ms={w}",))
                demos[w].append(d)
                progress(f"demo W {w} run {rep + 1}: first experience {fmt(d['first_experience_s'])} s, "
                         f"command {d['cmd_wall_s']:.2f} s")
    rows, out = [], {}
    for w in waits:
        lat = sorted(x for r in got[w] for x in r["latency_ms"])
        p90 = lat[math.ceil(0.9 * len(lat)) - 1] if lat else float("nan")  # nearest rank
        idle = median([r["idle_cpu_ms_per_s"] for r in got[w]])
        first = median([d["first_experience_s"] for d in demos[w]]) if demos[w] else None
        cmd = median([d["cmd_wall_s"] for d in demos[w]]) if demos[w] else None
        out[w] = {"latency_median_ms": median(lat) if lat else None, "latency_p90_ms": p90, "idle_cpu_ms_per_s": idle,
                  "demo_first_experience_s": first, "demo_command_s": cmd,
                  "missing": sum(r["missing"] for r in got[w])}
    best = {k: min(v[k] for v in out.values() if v[k] is not None) if any(v[k] is not None for v in out.values())
            else None for k in ("latency_median_ms", "latency_p90_ms", "idle_cpu_ms_per_s", "demo_first_experience_s",
                                "demo_command_s")}
    for w, o in out.items():
        def cell(k: str, o: dict[str, Any] = o) -> str:
            return "n/a" if o[k] is None else f"{o[k]:.2f} ({o[k] / best[k]:.2f}x)" if best[k] else f"{o[k]:.2f}"

        rows.append([w, cell("latency_median_ms"), cell("latency_p90_ms"), cell("idle_cpu_ms_per_s"),
                     cell("demo_first_experience_s"), cell("demo_command_s"), o["missing"]])
    end = machine()
    print(table(["fetch_max_wait_ms", "latency ms median (x best)", "p90 (x best)", "idle CPU ms/s (x best)",
                 "demo first experience s (x best)", "demo command s (x best)", "records missing"], rows,
                title=f"{args.records} records x {args.repeats} round(s) per wait, {PARTITIONS} partitions; "
                      f"load avg {start['loadavg']} -> {end['loadavg']}"))
    save("fetch_wait", {"waits": out, "records": args.records, "repeats": args.repeats,
                        "loadavg": [start["loadavg"], end["loadavg"]]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
