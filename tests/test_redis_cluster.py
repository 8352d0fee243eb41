"""Issue 24: the run state on a Redis Cluster (3 primaries, one replica each, on loopback: the session's
``redis_cluster``), the durability wait (WAIT before a stage's offset commit), the preflight of a cluster.

The State contract suite runs on the cluster through ``state_handles`` (tests/conftest.py); the runs of
``expstream run`` on it (one clean, one with a primary and a stage SIGKILLed) are at the end.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
import redis

from expstream.errors import ConfigError
from expstream.launch.localcluster import LocalRedisCluster
from expstream.launch.localservers import LocalRedis
from expstream.launch.preflight import check_redis
from expstream.state import RedisState
from expstream.state.durability import StateWritesLost, hash_tag

pytestmark = pytest.mark.integration


def owner_port(cluster: LocalRedisCluster, key: str) -> int:
    """The port of the primary that serves ``key``, asked of the cluster itself (CLUSTER KEYSLOT + SLOTS)."""
    c = cluster.client(cluster.primary_ports()[0])
    try:
        slot = int(c.execute_command("CLUSTER KEYSLOT", key))
        for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                return int(primary[1])
    finally:
        c.close()
    raise AssertionError(f"slot of {key} not served")


def keys_by_primary(cluster: LocalRedisCluster, pattern: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for port in cluster.primary_ports():
        c = cluster.client(port)
        try:
            keys = sorted(k.decode() for k in c.scan_iter(match=pattern, count=1000))
        finally:
            c.close()
        if keys:
            out[port] = keys
    return out


def test_a_url_naming_any_node_is_the_cluster(redis_cluster, run_id):
    """Each node answers with the same state: the client follows the slots (a plain client got MOVED)."""
    states = [RedisState(f"redis://127.0.0.1:{p}/0", run_id) for p in redis_cluster.ports]
    try:
        assert all(s.cluster for s in states)
        for i, s in enumerate(states):
            s.merge_reward_moments(f"b{i}", np.array([float(i)]))
        assert {s.get_moments().count for s in states} == {len(states)}
    finally:
        for s in states:
            s.close()


def test_a_cluster_url_with_another_database_is_refused(redis_cluster, run_id):
    with pytest.raises(ConfigError, match=r"--redis-url: .*cluster.*database 3.*fix: end the URL with /0"):
        RedisState(f"redis://127.0.0.1:{redis_cluster.ports[0]}/3", run_id)


def test_group_buffers_spread_over_the_primaries_and_each_group_stays_on_one(redis_cluster, run_id):
    with RedisState(redis_cluster.url, run_id) as st:
        for g in range(12):
            assert st.park_group(f"q{g}", 2, f"r{g}", {0: b"a"}) is None
        spread = keys_by_primary(redis_cluster, f"expstream:{{{run_id}{{*")
        assert len(spread) > 1, f"every group buffer on one primary: {spread}"
        for g in range(12):  # members and meta of a group on the primary that serves the group's tag
            members, meta = st.group_key(f"q{g}", "group"), st.group_key(f"q{g}", "group", "meta")
            assert members in spread[owner_port(redis_cluster, members)]
            assert meta in spread[owner_port(redis_cluster, members)]
        # the run-wide keys (moments, statistics, admission) keep the run's one tag: one slot
        st.merge_reward_moments("b0", np.array([1.0]))
        st.record_batch("advantage", "b0", {"in": 2, "out": 2}, 0.1, 2)
        st.admit("p0", 2, 0, 10)
        run_wide = [k for k in st.run_keys() if k.startswith(st.prefix)]
        assert len(run_wide) >= 5 and {hash_tag(k) for k in run_wide} == {run_id}
        assert len({owner_port(redis_cluster, k) for k in run_wide}) == 1


def test_the_wait_puts_every_write_on_the_replica_of_each_primary_written(redis_cluster, run_id):
    with RedisState(redis_cluster.url, run_id) as writer, RedisState(redis_cluster.url, run_id) as other:
        for g in range(6):  # writes from two clients (two connection pools): the wait covers both
            (writer if g % 2 else other).park_group(f"w{g}", 2, f"r{g}", {0: b"x" * 100})
            writer.durability.wrote(writer.group_key(f"w{g}", "group"))
        primaries = {owner_port(redis_cluster, writer.group_key(f"w{g}", "group")) for g in range(6)}
        before = writer.durability.waits
        writer.sync_writes()
        assert writer.durability.waits - before == len(primaries)  # one WAIT per primary written
        assert writer.durability.pending() == 0
        for g in range(6):  # each replica has it (a replica answers READONLY reads of its primary's slots)
            key = writer.group_key(f"w{g}", "group")
            port = owner_port(redis_cluster, key)
            replica = next(p for p in redis_cluster.ports if p != port and redis_cluster.alive(p)
                           and redis_cluster.client(p).info("replication").get("master_port") == port)
            c = redis_cluster.client(replica)
            try:
                c.execute_command("READONLY")
                assert c.hget(key, "0") == b"x" * 100
            finally:
                c.close()


def test_writes_whose_primary_failed_over_before_the_wait_are_reported_lost(redis_cluster, run_id):
    """A failover between the writes and the wait: the new primary may lack them, so the records are
    processed again (StateWritesLost), not committed; a wait after the failover works again."""
    with RedisState(redis_cluster.url, run_id) as st:
        st.park_group("f0", 2, "r0", {0: b"a"})
        key = st.group_key("f0", "group")
        old = owner_port(redis_cluster, key)
        failover_of(redis_cluster, key)  # a graceful one: the replica takes the primary's slots
        st.client.nodes_manager.initialize()  # the client learns the new slot map (as after a MOVED)
        with pytest.raises(StateWritesLost, match=f"127.0.0.1:{old}"):
            st.sync_writes()
        assert st.durability.pending() == 0  # not carried over: the records are processed again, writing anew
        # processed again: the write goes to the new primary, and the wait for it succeeds
        redis_cluster.wait_ok()
        with RedisState(redis_cluster.url, run_id) as again:
            assert again.park_group("f0", 2, "r0", {0: b"a"}) is None
            again.sync_writes()
            assert again.group_status("f0") == (1, 2, None)


def test_a_lone_server_with_a_replica_waits_and_without_one_sends_no_wait(tmp_path, run_id):
    primary, replica = LocalRedis(tmp_path / "p", appendonly=False), LocalRedis(tmp_path / "r", appendonly=False)
    url = primary.start()
    replica.start()
    try:
        with RedisState(url, run_id) as alone:
            alone.park_group("g", 2, "r0", {0: b"a"})
            alone.sync_writes()
            assert alone.durability.waits == 0  # no replica: nothing to wait for (the single-node default)
        r = redis.Redis.from_url(replica.url)
        r.replicaof("127.0.0.1", primary.port)
        deadline = time.monotonic() + 20
        while r.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica did not attach"
            time.sleep(0.1)
        with RedisState(url, run_id) as st:
            st.park_group("h", 2, "r1", {0: b"b"})
            st.sync_writes()
            assert st.durability.waits == 1
            assert r.hget(st.group_key("h", "group"), "0") == b"b"  # on the replica once the wait returned
        r.close()
    finally:
        replica.stop()
        primary.stop()


def failover_of(cluster: LocalRedisCluster, key: str) -> int:
    """A graceful failover of the primary serving ``key``; returns the new primary's port once it serves it."""
    old = owner_port(cluster, key)
    replica = next(p for p in cluster.ports if cluster.alive(p)
                   and cluster.client(p).info("replication").get("master_port") == old)
    c = cluster.client(replica)
    try:
        c.execute_command("CLUSTER FAILOVER")
    finally:
        c.close()
    deadline = time.monotonic() + 30
    while owner_port(cluster, key) != replica:
        assert time.monotonic() < deadline, "manual failover did not happen"
        time.sleep(0.1)
    return replica


def test_a_stage_whose_writes_failed_over_before_the_wait_processes_its_records_again(broker, redis_cluster, caplog):
    """The runner's side (stages/commitgroup.py step 3b): the primary that took a record's group write
    fails over before the commit group's wait; the records are not committed but processed again, then
    committed, every one out (the repeat is dropped downstream by id) and every offset committed."""
    import uuid

    from expstream.kafka.clients import read_topic, topic_lag
    from schemas import PromptBatch, encode
    from schemas.codec import peek_header
    from stages.context import make_context
    from stages.runner import StageRunner
    from tests.runners import Running
    from tests.test_runner import produce, stage_topology

    topo = stage_topology(broker, "shard-preprocess", "kafka.max_poll_records=16")
    src, dst = topo.stages["shard-preprocess"].input, topo.stages["shard-preprocess"].output
    run_id = f"c{uuid.uuid4().hex[:8]}"
    state = RedisState(redis_cluster.url, run_id)
    seen: list[str] = []

    def process(batch, ctx):
        ctx.state.park_group(f"g-{batch.batch_id}", 2, batch.batch_id, {0: b"member"})
        seen.append(batch.batch_id)
        if seen == ["b0"]:  # the first time only: its primary fails over before the wait
            failover_of(redis_cluster, ctx.state.group_key("g-b0", "group"))
            ctx.state.client.nodes_manager.initialize()
        return [batch]

    names = [f"b{i}" for i in range(4)]
    produce(broker, src, [encode(PromptBatch(batch_id=b, prompt_id=[b], prompt=["x"], label=[""], reference=[""]))
                          for b in names])
    runner = StageRunner(make_context(topo, "shard-preprocess", state=state, run_id=run_id), process, broker)
    running = Running(runner)
    try:
        with caplog.at_level(logging.ERROR, logger=runner.log.name):
            running.wait(lambda: runner.handled == len(names), 90, "every record")
    finally:
        running.stop()
        state.close()
        redis_cluster.wait_ok()
    assert seen.count("b0") == 2, seen  # processed again after the failover
    assert any("StateWritesLost" in r.getMessage() and "processing them again" in r.getMessage()
               for r in caplog.records)
    out = [peek_header(r.value)[2] for r in read_topic(broker, topo.kafka, dst, timeout_s=5)]
    assert set(out) == set(names) and out.count("b0") == 2
    assert topic_lag(broker, topo.kafka, runner.group_id, src) == {0: 0}, "every offset committed"
    # the Prometheus series: one redo, and a durability wait per commit group that went through
    reg = runner.metrics.registry
    assert reg.get_sample_value("expstream_retries_total", {"stage": "shard-preprocess",
                                                            "step": "state_writes_lost"}) == 1
    assert reg.get_sample_value("expstream_state_wait_seconds_count", {"stage": "shard-preprocess"}) >= 1


# --- preflight ------------------------------------------------------------------------------------------


def test_preflight_passes_a_healthy_cluster(redis_cluster):
    check_redis(redis_cluster.url, timeout_s=2)


def test_preflight_names_uncovered_slots_and_a_refusing_primary(tmp_path, broker):
    """A node with half the slots, its peer owning the rest: fine; the peer SIGKILLed: the node it was
    is named with the fix; a node owning nothing: the uncovered slots are named."""
    small = LocalRedisCluster(tmp_path / "c", primaries=2, replicas=0)
    small.start_nodes()
    a, b = (small.client(p) for p in small.ports)
    try:
        url = f"redis://127.0.0.1:{small.ports[0]}/0"
        with pytest.raises(ConfigError, match=r"serves 0 of 16384 hash slots.*--cluster fix"):
            check_redis(url, timeout_s=2)
        a.execute_command("CLUSTER ADDSLOTSRANGE", 0, 8191)
        b.execute_command("CLUSTER ADDSLOTSRANGE", 8192, 16383)
        a.execute_command("CLUSTER MEET", "127.0.0.1", small.ports[1], small.bus[small.ports[1]])
        small.wait_ok(30)
        check_redis(url, timeout_s=2)
        small.kill(small.ports[1])
        with pytest.raises(ConfigError) as ei:
            check_redis(url, timeout_s=2)
        text = str(ei.value)
        assert f"127.0.0.1:{small.ports[1]}" in text and "refuses" in text and "\n" not in text
        # expstream run stops before any stage starts: exit 2, one line naming the node and the fix
        from tests.test_startup_errors import run_cli

        (tmp_path / "run").mkdir()
        proc = run_cli(tmp_path / "run", "--bootstrap-servers", broker, "--redis-url", url)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = [x for x in proc.stderr.splitlines() if "configuration error" in x]
        assert len(line) == 1 and f"node 127.0.0.1:{small.ports[1]}" in line[0] and "fix" in line[0], proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "out").exists()
    finally:
        a.close()
        b.close()
        small.stop()


# --- expstream run on the cluster ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_run_on_the_cluster_completes_with_status_and_metrics(tmp_path, model_cache, redis_cluster):
    from tests.harness import run_expstream

    proc, out = run_expstream(tmp_path, "--redis-url", redis_cluster.url, cache=model_cache,
                              sets=["algo.advantage_estimator=group_norm", "generate.max_new_tokens=8"], check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["groups_complete"] == 6 and not summary["lost_groups"]
    # the status sampler (what `expstream status` shows) read the run's flows and timings off the cluster,
    # and scraped the stages' Prometheus metrics
    last = json.loads((out / "status.jsonl").read_text().splitlines()[-1])
    assert last["finished"] and last["scrape"]
    for stage in ("generate", "reward", "advantage"):
        row = last["stages"][stage]
        assert row["samples_out"] == 24 and row["balanced"] and row["batch_p50_s"] > 0, (stage, row)
    services = json.loads((out / "run" / "services.json").read_text())
    assert services["redis_url"].endswith(f":{redis_cluster.ports[0]}/0")


class ClusterAsRedis:
    """What tests/test_crash.py's PipelineRun starts as its Redis: the session's cluster (left running)."""

    def __init__(self, cluster: LocalRedisCluster, port: int) -> None:
        self.cluster, self.port = cluster, port

    def start(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        return None


@pytest.mark.e2e
def test_a_primary_and_a_stage_sigkilled_mid_run_every_group_comes_out_once(tmp_path_factory, model_cache,
                                                                            redis_cluster):
    """Mid-run (advantage has handled a record, group buffers are parked), the primary holding most of
    the run's group buffers is SIGKILLed, and advantage[0] with it: its replica takes over (node timeout
    1 s), the stages ride through the failover (retries; a commit group whose writes went to the dead
    primary is processed again), and every group comes out exactly once."""
    from tests.test_crash import PipelineRun, assert_exactly_once, finish

    run = PipelineRun(tmp_path_factory.mktemp("cluster-failover"), model_cache, n_prompts=48,
                      sets=["algo.advantage_estimator=group_norm"])
    # the URL names a replica, which survives (a restarted stage connects through it)
    seed = next(p for p in redis_cluster.ports if p not in redis_cluster.primary_ports())
    run.redis = ClusterAsRedis(redis_cluster, seed)
    victim = None
    try:
        run.start()
        deadline = time.monotonic() + 240
        while victim is None and run.alive and time.monotonic() < deadline:
            pid = run.pids().get("advantage[0]")
            spread = keys_by_primary(redis_cluster, f"expstream:{{{run.run_id}{{*:group")
            if pid is not None and run.handled("advantage[0]", pid) >= 1 and spread:
                victim = max(spread, key=lambda p: len(spread[p]))
                redis_cluster.kill(victim)
                run.kill("advantage[0]", pid)
            time.sleep(0.05)
        assert victim is not None, f"never killed (run alive: {run.alive})\n{run.diagnostics()}"
        outcome = finish(run, tmp_path_factory, "cluster-failover", stages=[], running_norm=False,
                         group_buffers=False, timeout_s=300)
        assert_exactly_once(outcome)
        # a quick run can finish before the cluster has marked the victim failed (node timeout 1 s) and
        # promoted its replica: wait for that before reading the primaries (the dead one refuses)
        until = time.monotonic() + 60
        while victim in redis_cluster.primary_ports() and time.monotonic() < until:
            time.sleep(0.2)
        # what the run left (the done markers of its freed groups, a buffer left by a kill) is spread
        assert len(keys_by_primary(redis_cluster, f"expstream:{{{run.run_id}{{*")) > 1
        assert victim not in redis_cluster.primary_ports()  # it failed over
    finally:
        run.close()
        if victim is not None:  # back as a replica of its successor, for the tests after this one
            redis_cluster.revive(victim)
            redis_cluster.wait_ok(60)
