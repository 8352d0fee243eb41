"""RedisState against a real redis-server: atomic, idempotent Lua updates."""

from __future__ import annotations

import math
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from expstream.errors import ConfigError, PoisonRecordError, StateUnavailableError
from expstream.localservers import LocalRedis
from expstream.state import Moments, RedisState

pytestmark = pytest.mark.integration


def _pooled(values):
    v = np.concatenate([np.asarray(x, dtype=np.float64) for x in values])
    return v.size, v.mean(), v.std(ddof=1)


# --- reward moments -----------------------------------------------------------------------------


def test_moments_of_three_batches_equal_pooled_numpy(redis_state):
    rng = np.random.default_rng(0)
    batches = [
        rng.normal(3.0, 2.0, 17),
        rng.normal(-1.0, 0.5, 5).astype(np.float32),
        rng.normal(10.0, 4.0, 64),
    ]
    for i, b in enumerate(batches):
        m = redis_state.merge_reward_moments(f"b{i}", b)
    n, mean, std = _pooled(batches)
    assert m.count == n
    assert m.mean == pytest.approx(mean, rel=1e-9, abs=1e-9)
    assert m.std == pytest.approx(std, rel=1e-9)
    assert m.var == pytest.approx(std**2, rel=1e-9)
    assert redis_state.get_moments() == m
    assert redis_state.get_moments("other").count == 0


def test_moments_single_value_and_empty_batch(redis_state):
    m = redis_state.merge_reward_moments("a", np.array([2.5]), name="r")
    assert (m.count, m.mean, m.m2) == (1, 2.5, 0.0) and math.isinf(m.std)
    assert redis_state.merge_reward_moments("b", np.array([]), name="r") == m
    with pytest.raises(PoisonRecordError):
        redis_state.merge_reward_moments("c", np.array([1.0, np.nan]), name="r")


def test_same_batch_id_applied_once_and_returns_identical_snapshot(redis_state):
    first = redis_state.merge_reward_moments("b0", np.array([1.0, 2.0, 3.0]))
    after_b1 = redis_state.merge_reward_moments("b1", np.array([10.0, 20.0]))
    again = redis_state.merge_reward_moments("b0", np.array([1.0, 2.0, 3.0]))
    assert again == first  # the snapshot taken right after b0's merge, not the current state
    assert redis_state.get_moments() == after_b1
    assert after_b1.count == 5


def _merge_worker(url, run_id, worker, n_batches):
    state = RedisState(url, run_id)
    for j in range(n_batches):
        vals = np.random.default_rng(1000 * worker + j).normal(worker, 1.0, 8 + j)
        state.merge_reward_moments(f"w{worker}-b{j}", vals)
        state.merge_reward_moments(f"w{worker}-b{j}", vals)  # a redelivery, interleaved with others
    state.close()


def test_concurrent_merges_from_processes_and_threads_give_pooled_result(redis_url, run_id):
    n_batches = 25
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_merge_worker, args=(redis_url, run_id, w, n_batches)) for w in (0, 1)]
    threads = [threading.Thread(target=_merge_worker, args=(redis_url, run_id, w, n_batches)) for w in (2, 3)]
    for t in procs + threads:
        t.start()
    for t in threads + procs:
        t.join(60)
    assert all(p.exitcode == 0 for p in procs)
    batches = [
        np.random.default_rng(1000 * w + j).normal(w, 1.0, 8 + j) for w in range(4) for j in range(n_batches)
    ]
    n, mean, std = _pooled(batches)
    with RedisState(redis_url, run_id) as state:
        m = state.get_moments()
    assert m.count == n
    assert m.mean == pytest.approx(mean, rel=1e-9)
    assert m.std == pytest.approx(std, rel=1e-9)


# --- group buffers -------------------------------------------------------------------------------


def test_park_group_completes_exactly_once(redis_state):
    g = "prompt-7"
    assert redis_state.park_group(g, 4, "m0", {0: b"s0", 2: b"s2"}) is None
    assert redis_state.group_status(g) == (2, 4, None)
    assert redis_state.park_group(g, 4, "m1", {1: b"s1"}) is None
    done = redis_state.park_group(g, 4, "m2", {3: b"s3"})
    assert done == [b"s0", b"s1", b"s2", b"s3"]
    assert redis_state.group_status(g) == (4, 4, "m2")
    # the completer's redelivery gets the group again; a non-completer's redelivery gets nothing
    assert redis_state.park_group(g, 4, "m2", {3: b"s3"}) == done
    assert redis_state.park_group(g, 4, "m1", {1: b"s1"}) is None
    assert redis_state.park_group(g, 4, "m0", {0: b"changed", 2: b"s2"}) is None
    assert redis_state.park_group(g, 4, "m2", {3: b"s3"}) == done  # first payloads kept (HSETNX)
    ttl = redis_state.client.ttl(redis_state.key("group", g))
    assert 0 < ttl <= redis_state.group_ttl_s


def test_park_group_rejects_inconsistent_records(redis_state):
    with pytest.raises(PoisonRecordError, match="sample_index"):
        redis_state.park_group("g", 2, "m0", {2: b"x"})
    redis_state.park_group("g", 2, "m0", {0: b"x"})
    with pytest.raises(PoisonRecordError, match="n=2"):
        redis_state.park_group("g", 3, "m1", {1: b"y"})


def test_concurrent_parkers_exactly_one_gets_the_group(redis_url, run_id):
    n_groups, parkers = 20, 8
    results: dict[int, list] = {i: [] for i in range(parkers)}
    barrier = threading.Barrier(parkers)

    def park(i):
        state = RedisState(redis_url, run_id)
        barrier.wait()
        for g in range(n_groups):
            # every parker holds 2 samples of an 16-sample group; together they complete it
            members = {2 * i: f"{g}:{2 * i}".encode(), 2 * i + 1: f"{g}:{2 * i + 1}".encode()}
            results[i].append(state.park_group(f"g{g}", 2 * parkers, f"m{i}", members))
        state.close()

    threads = [threading.Thread(target=park, args=(i,)) for i in range(parkers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for g in range(n_groups):
        winners = [i for i in range(parkers) if results[i][g] is not None]
        assert len(winners) == 1, f"group g{g}: {winners}"
        assert results[winners[0]][g] == [f"{g}:{k}".encode() for k in range(2 * parkers)]


# --- KL coefficient ------------------------------------------------------------------------------


def test_kl_adaptive_update_once_per_step(redis_state):
    assert redis_state.kl_coef(0.1) == 0.1
    assert redis_state.kl_coef(0.5) == 0.1  # initialised once
    # step 1: current 0.15 vs target 0.1 -> e = clip(0.5) = 0.2; value = 0.1 * (1 + 0.2 * 64 / 1000)
    v1 = redis_state.update_kl_adaptive("s1", 0.15, 0.1, 64, 1000)
    assert v1 == pytest.approx(0.1 * 1.0128, rel=1e-12)
    assert redis_state.update_kl_adaptive("s1", 5.0, 0.1, 64, 1000) == v1  # repeat: unchanged
    # step 2: current 0.095 -> e = -0.05; value = v1 * (1 - 0.05 * 100 / 1000)
    v2 = redis_state.update_kl_adaptive("s2", 0.095, 0.1, 100, 1000)
    assert v2 == pytest.approx(0.1 * 1.0128 * 0.995, rel=1e-12)
    assert redis_state.kl_coef(0.1) == v2
    redis_state.set_kl_coef(0.3)
    assert redis_state.kl_coef(0.1) == 0.3


def test_kl_adaptive_needs_initialised_coefficient(redis_state):
    with pytest.raises(ConfigError, match="kl_coef"):
        redis_state.update_kl_adaptive("s1", 0.1, 0.1, 1, 10)
    assert redis_state.update_kl_adaptive("s1", 0.1, 0.1, 1, 10, default=0.05) == 0.05


# --- stats, versions, counters -------------------------------------------------------------------


def test_stage_stats_heartbeats_versions_counters(redis_state):
    assert redis_state.record_stage_time("reward", 0.5, 16, "b0") is True
    assert redis_state.record_stage_time("reward", 0.5, 16, "b0") is False
    redis_state.record_stage_time("reward", 0.25, 8, "b1")
    redis_state.record_stage_time("generate", 2.0, 16, "b0")
    assert redis_state.stage_stats() == {
        "generate": {"batches": 1, "samples": 16, "seconds": 2.0},
        "reward": {"batches": 2, "samples": 24, "seconds": 0.75},
    }
    before = time.time()
    redis_state.heartbeat("reward", 1)
    ((key, ts),) = redis_state.heartbeats().items()
    assert key == ("reward", "1") and ts >= before - 1
    assert redis_state.policy_version() == 0
    assert redis_state.set_policy_version(3) == 3
    assert redis_state.set_policy_version(2) == 3  # never backwards
    assert redis_state.policy_version() == 3
    assert redis_state.mark_once("emitted", "g/1") is True
    assert redis_state.mark_once("emitted", "g/1") is False
    assert redis_state.incr_counter("stale", 2, once_id="b0") == 2
    assert redis_state.incr_counter("stale", 2, once_id="b0") == 2
    assert redis_state.incr_counter("stale", 1) == 3
    assert redis_state.counters() == {"stale": 3.0}


def test_keys_are_scoped_by_run(redis_url, redis_state):
    other = RedisState(redis_url, redis_state.run_id + "x")
    redis_state.merge_reward_moments("b0", np.array([1.0, 2.0]))
    assert other.get_moments().count == 0
    mine = [k for k in redis_state.client.keys("expstream:*") if redis_state.run_id.encode() in k]
    assert mine and all(k.startswith(f"expstream:{{{redis_state.run_id}}}:".encode()) for k in mine)
    other.close()


# --- restarts ------------------------------------------------------------------------------------


def test_redis_restart_keeps_state_and_client_reconnects(tmp_path):
    server = LocalRedis(tmp_path / "redis", appendonly=True)
    url = server.start()
    try:
        state = RedisState(url, "restart", retry_deadline_s=10)
        m = state.merge_reward_moments("b0", np.array([1.0, 2.0, 4.0]))
        assert state.park_group("g", 3, "m0", {0: b"a", 1: b"b"}) is None
        state.update_kl_adaptive("s0", 0.2, 0.1, 10, 100, default=0.1)
        pid = server.pid
        assert server.restart() == url
        assert server.pid != pid
        # the same client object reconnects (its pooled connection died with the server)
        assert state.get_moments() == m
        assert state.merge_reward_moments("b0", np.array([1.0, 2.0, 4.0])) == m  # still applied once
        assert state.park_group("g", 3, "m1", {2: b"c"}) == [b"a", b"b", b"c"]
        assert state.kl_coef(0.5) == pytest.approx(0.1 * 1.02)
        state.close()

        server.stop()
        t0 = time.monotonic()
        with pytest.raises(StateUnavailableError) as ei:
            RedisState(url, "restart", retry_deadline_s=0.5)
        assert ei.value.retriable and time.monotonic() - t0 < 5
    finally:
        server.stop()


def test_moments_dataclass():
    m = Moments.from_triple(3, 2.0, 8.0)
    assert m.var == 4.0 and m.std == 2.0
