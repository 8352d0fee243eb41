"""Service outages during `expstream run`: a Redis restart (AOF on) and a paused broker.

* Redis: the run's redis-server (appendonly) is stopped mid-run, kept down a few seconds and started
  again on the same port and directory. Group buffers and reward moments must survive (the moments
  count right after the restart is at least the count right before it, and at the end every batch
  is merged exactly once), stages must ride it out with retries (no restart), and every prompt
  group comes out exactly once.
* Broker: the run's Tansu broker is SIGSTOPped mid-run for BROKER_PAUSE_S seconds (it keeps its
  sockets but answers nothing), then SIGCONTed. The run completes, every group exactly once, no
  stage crash-loops; the stage logs are checked for a line saying the broker was unreachable
  (the runner warns after SLOW_SEND_WARN_S while a send or commit waits for the broker).

EXPSTREAM_REDIS_DOWN_S / EXPSTREAM_BROKER_PAUSE_S change the outage lengths (3 s / 8 s), e.g. 40 s
of broker pause to see the runner's produce/commit timeouts and retries.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime

import pytest
from test_crash import (
    GROUP_NORM_STAGES,
    PipelineRun,
    assert_exactly_once,
    finish,
    parse_ts,
)

pytestmark = pytest.mark.integration
e2e = pytest.mark.e2e  # the tests that run `expstream run`

REDIS_DOWN_S = float(os.environ.get("EXPSTREAM_REDIS_DOWN_S", "3"))
BROKER_PAUSE_S = float(os.environ.get("EXPSTREAM_BROKER_PAUSE_S", "8"))
N_PROMPTS = 48
# A stage line about a broker it cannot reach (stages/runner.py wording: "broker ... unreachable",
# "poll of ... failed", "commit failed (...; broker unreachable?)", "retriable ...; retry").
BROKER_RETRY_RE = re.compile(r"unreachable|poll of \S+ failed|commit failed|commit refused|retriable|retrying|"
                             r"retry \d+")
REDIS_RETRY_RE = re.compile(r"redis \S+ failed .*; retry \d+")


def _mid_flow(run: PipelineRun, label: str, records: int, timeout_s: float = 240) -> None:
    """Wait until ``label`` logged ``records`` handled records (the run is mid-flow)."""
    deadline = time.monotonic() + timeout_s
    while run.alive and time.monotonic() < deadline:
        if run.handled(label) >= records:
            return
        time.sleep(0.05)
    raise AssertionError(f"{label} never handled {records} records\n{run.diagnostics()}")


def _stage_lines_between(run: PipelineRun, pattern: re.Pattern, start: float, end: float) -> list[str]:
    ts = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
    out = []
    for path in sorted((run.out / "run" / "logs").glob("*.log")):
        for line in run.lines(path.name):
            m = ts.match(line)
            if m and start <= parse_ts(m.group(1)) <= end and pattern.search(line):
                out.append(f"{path.name}: {line}")
    return out


# ------------------------------------------------------------------------------------------------
# Redis restart
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_restart(tmp_path_factory: pytest.TempPathFactory, model_cache):
    run = PipelineRun(tmp_path_factory.mktemp("redis-restart"), model_cache, n_prompts=N_PROMPTS,
                      sets=["algo.advantage_estimator=group_norm", "algo.reward_running_norm=true"])
    try:
        run.start()
        _mid_flow(run, "postprocess[0]", 4)
        with run.state() as st:
            # the moments are merged by advantage (issue 21's reward order), a hop after postprocess: wait
            # for the first merge so that the restart really comes mid-run
            until = time.monotonic() + 60
            while st.get_moments().count == 0 and run.alive and time.monotonic() < until:
                time.sleep(0.05)
            before = st.get_moments().count
            parked_before = {p: st.group_status(p)[0] for p in run.prompt_ids}
        t_down = time.time()
        run.redis.restart(down_s=REDIS_DOWN_S)
        t_up = time.time()
        with run.state() as st:
            after = st.get_moments().count
            # a group completed and committed meanwhile is freed (issue 21 item 6): done, not lost
            parked_after = {p: (st.group_status(p)[0], st.group_done(p)) for p in run.prompt_ids}
        outcome = finish(run, tmp_path_factory, "redis-restart", stages=GROUP_NORM_STAGES, running_norm=True,
                         group_buffers=True, redis_down_s=round(t_up - t_down, 2), moments_before=before,
                         moments_after_restart=after, parked_before=sum(parked_before.values()),
                         parked_after=sum(n for n, _ in parked_after.values()),
                         freed_after=sum(done for _, done in parked_after.values()))
        yield outcome, (before, after, parked_before, parked_after), (t_down, t_up)
    finally:
        run.close()


@e2e
def test_redis_restart_keeps_state(redis_restart) -> None:
    _, (before, after, parked_before, parked_after), _ = redis_restart
    assert before > 0, "the restart came before any reward moments were merged: not mid-run"
    assert after >= before, f"reward moments lost in the restart: count {before} -> {after}"
    lost = {g: (n, parked_after[g]) for g, n in parked_before.items()
            if parked_after[g][0] < n and not parked_after[g][1]}
    assert not lost, f"group buffers lost in the restart (parked before -> (parked, done) after): {lost}"


@e2e
def test_redis_restart_every_group_exactly_once(redis_restart) -> None:
    outcome, _, _ = redis_restart
    assert_exactly_once(outcome)
    assert outcome.redis_problems == []
    assert outcome.overcount_problems == []


@e2e
def test_redis_restart_stages_retry_without_crashing(redis_restart) -> None:
    outcome, _, (t_down, t_up) = redis_restart
    assert outcome.acct is not None
    assert outcome.acct.summary["stage_restarts"] == {}, "stages rode out the outage with retries"
    retries = _stage_lines_between(outcome.run, REDIS_RETRY_RE, t_down, t_up + 5)
    print(f"\n[redis-restart] {len(retries)} redis retry lines in stage logs, e.g. {retries[:2]}")
    assert retries, "a stage said that it retried Redis"


# ------------------------------------------------------------------------------------------------
# Broker pause
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker_pause(tmp_path_factory: pytest.TempPathFactory, model_cache):
    run = PipelineRun(tmp_path_factory.mktemp("broker-pause"), model_cache, n_prompts=N_PROMPTS,
                      sets=["algo.advantage_estimator=group_norm", "algo.reward_running_norm=true"])
    try:
        run.start()
        _mid_flow(run, "reward[0]", 2)
        t_pause = time.time()
        run.broker.pause()
        time.sleep(BROKER_PAUSE_S)
        run.broker.resume()
        t_resume = time.time()
        outcome = finish(run, tmp_path_factory, "broker-pause", stages=GROUP_NORM_STAGES, running_norm=True,
                         group_buffers=True, paused_s=round(t_resume - t_pause, 2))
        yield outcome, (t_pause, t_resume)
    finally:
        run.close()


@e2e
def test_broker_pause_every_group_exactly_once(broker_pause) -> None:
    outcome, _ = broker_pause
    assert_exactly_once(outcome)
    assert outcome.redis_problems == []
    assert outcome.overcount_problems == []


@e2e
def test_broker_pause_no_crash_loop(broker_pause) -> None:
    outcome, (t_pause, t_resume) = broker_pause
    assert outcome.acct is not None
    restarts = outcome.acct.summary["stage_restarts"]
    print(f"\n[broker-pause] stage restarts: {restarts or 0}")
    assert all(n <= 1 for n in restarts.values()), f"a stage crash-looped on the paused broker: {restarts}"


@e2e
def test_broker_pause_is_logged(broker_pause) -> None:
    outcome, (t_pause, t_resume) = broker_pause
    lines = _stage_lines_between(outcome.run, BROKER_RETRY_RE, t_pause, t_resume + 30)
    print(f"\n[broker-pause] {len(lines)} stage log lines about the broker, e.g.:\n" + "\n".join(lines[:5]))
    assert lines, (f"no stage logged that the broker was unreachable during the {BROKER_PAUSE_S:.0f}s pause "
                   f"({datetime.fromtimestamp(t_pause):%H:%M:%S} - {datetime.fromtimestamp(t_resume):%H:%M:%S})")


# ------------------------------------------------------------------------------------------------
# RedisState calls that span a Redis restart (no pipeline run: seconds)
# ------------------------------------------------------------------------------------------------


def test_redis_state_pipelined_reads_retry_across_a_hang(tmp_path) -> None:
    """Pipelined reads (group_status, stage_stats) are rebuilt on every retry: redis-py clears a
    pipeline's command stack when execute() fails after sending (here: the socket timeout of a
    hung server), so retrying the same pipeline object returned [] instead of the answer."""
    import threading

    from expstream.launch.localservers import LocalRedis
    from expstream.state import RedisState

    redis = LocalRedis(tmp_path / "redis", appendonly=True)
    url = redis.start()
    try:
        st = RedisState(url, "outage", socket_timeout_s=0.5, retry_deadline_s=20)
        st.park_group("g1", 2, "b1", {0: b"x"})
        st.record_stage_time("reward", 0.5, 4, "b1")
        results: dict[str, object] = {}

        def read() -> None:
            for name, fn in (("group", lambda: st.group_status("g1")), ("stats", st.stage_stats)):
                try:
                    results[name] = fn()
                except Exception as exc:  # noqa: BLE001 - compared below
                    results[name] = repr(exc)

        redis.pause()  # SIGSTOP: connections stay open, nothing answers
        t = threading.Thread(target=read)
        t.start()
        time.sleep(1.5)
        redis.resume()
        t.join(30)
        assert results == {"group": (1, 2, None),
                           "stats": {"reward": {"batches": 1, "samples": 4, "seconds": 0.5}}}
        st.close()
    finally:
        redis.stop()


def test_redis_updates_once_per_id_across_a_restart(tmp_path) -> None:
    """KL coefficient steps, reward moments and group buffers survive a restart (AOF) and a
    redelivered id after it changes nothing."""
    import numpy as np

    from expstream.launch.localservers import LocalRedis
    from expstream.state import RedisState

    redis = LocalRedis(tmp_path / "redis", appendonly=True)
    url = redis.start()
    try:
        st = RedisState(url, "restart", retry_deadline_s=20)
        st.kl_coef(0.01)
        beta = st.update_kl_adaptive("step-1", 0.2, 0.1, 16, 1000)
        moments = st.merge_reward_moments("b1", np.array([1.0, 2.0, 4.0]))
        assert st.park_group("g1", 2, "b1", {0: b"a"}) is None
        redis.restart(down_s=0.5)
        assert st.update_kl_adaptive("step-1", 0.2, 0.1, 16, 1000) == beta
        assert st.kl_coef(0.5) == beta
        assert st.merge_reward_moments("b1", np.array([1.0, 2.0, 4.0])) == moments
        assert st.get_moments() == moments
        assert st.park_group("g1", 2, "b2", {1: b"b"}) == [b"a", b"b"], "the parked half survived"
        assert st.park_group("g1", 2, "b2", {1: b"b"}) == [b"a", b"b"], "the completer's redelivery"
        assert st.update_kl_adaptive("step-2", 0.2, 0.1, 16, 1000) != beta
        st.close()
    finally:
        redis.stop()
