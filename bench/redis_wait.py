"""The durability wait's cost: records/s of a stage's state traffic with and without WAIT, same run.

A local Redis Cluster (3 primaries, one replica each, expstream/launch/localcluster.py) and, for
comparison, a lone redis-server with one replica. One "record" is what the advantage stage writes
per input record: ``park_group`` of its members (``--payload`` bytes each) into its group and the
record's statistics (``record_batch``); every ``--group`` records (the runner's commit group, 16)
the stage syncs (``sync_writes``) before it would commit. Measured per setup, interleaved over
``--repeats`` rounds, with ``redis.wait_replicas`` 0 (no wait, the baseline) and null (auto: one
replica). Prints records/s, the ratio to the baseline, and the wait's cost per record.

    .venv/bin/python bench/redis_wait.py            # ~30 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from common import machine, progress, save  # noqa: E402

from expstream.launch.localcluster import LocalRedisCluster  # noqa: E402
from expstream.launch.localservers import LocalRedis  # noqa: E402
from expstream.state import RedisState  # noqa: E402


def one_pass(url: str, wait_replicas: int | None, records: int, group: int, n: int, payload: int) -> tuple[float, int]:
    """records/s of ``records`` advantage-like records on ``url``; and the WAITs sent."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    body = b"x" * payload
    with RedisState(url, run_id, wait_replicas=wait_replicas) as st:
        t0 = time.perf_counter()
        for r in range(records):
            g, i = divmod(r, n)  # one member per record: n records complete a group
            st.park_group(f"q{g}", n, f"b{r}", {i: body})
            st.record_batch("advantage", f"b{r}", {"in": 1, "out": 1 if i == n - 1 else 0}, 0.001, 1)
            if (r + 1) % group == 0:
                st.sync_writes()
        st.sync_writes()
        return records / (time.perf_counter() - t0), st.durability.waits


def measure(name: str, url: str, args: argparse.Namespace) -> dict:
    rates: dict[str, list[float]] = {"no wait": [], "wait 1 replica": []}
    waits = 0
    for _ in range(args.repeats):  # interleaved: drift in the machine's load hits both alike
        rates["no wait"].append(one_pass(url, 0, args.records, args.group, args.n, args.payload)[0])
        rate, w = one_pass(url, None, args.records, args.group, args.n, args.payload)
        rates["wait 1 replica"].append(rate)
        waits += w
    base, wait = statistics.median(rates["no wait"]), statistics.median(rates["wait 1 replica"])
    out = {"setup": name, "records_per_s_no_wait": round(base, 1), "records_per_s_wait": round(wait, 1),
           "ratio_wait_to_no_wait": round(wait / base, 3),
           "wait_cost_us_per_record": round((1 / wait - 1 / base) * 1e6, 1),
           "waits_per_pass": waits // args.repeats}
    print(f"{name:28s} no wait {base:9.1f} rec/s   wait {wait:9.1f} rec/s   ratio {wait / base:5.3f}   "
          f"+{out['wait_cost_us_per_record']:.1f} us/record   {out['waits_per_pass']} WAITs/pass")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1600)
    ap.add_argument("--group", type=int, default=16, help="records per commit group (one sync each)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt group")
    ap.add_argument("--payload", type=int, default=4096, help="bytes per parked member")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalRedisCluster(Path(tmp) / "cluster")
        try:
            progress("starting a 3x1 Redis Cluster")
            url = cluster.start()
            results.append(measure("cluster 3 primaries x 1", url, args))
        finally:
            cluster.stop()
        primary, replica = LocalRedis(Path(tmp) / "p", appendonly=False), LocalRedis(Path(tmp) / "r", appendonly=False)
        try:
            url = primary.start()
            replica.start()
            r = redis.Redis.from_url(replica.url)
            r.replicaof("127.0.0.1", primary.port)
            deadline = time.monotonic() + 30
            while r.info("replication").get("master_link_status") != "up" and time.monotonic() < deadline:
                time.sleep(0.1)
            r.close()
            results.append(measure("lone server + 1 replica", url, args))
        finally:
            replica.stop()
            primary.stop()
    summary = {"bench": "redis_wait", "machine": machine(), "records": args.records, "group": args.group, "payload": args.payload,
               "results": results}

    save("redis_wait", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
