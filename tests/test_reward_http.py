"""The remote reward API: `expstream serve-reward` and HttpRewardSource against real HTTP servers on loopback.

Servers run either in a background thread (reward_server.ServerThread: the same aiohttp app) or as a real
`expstream serve-reward` process, which the outage tests SIGKILL and start again on the same port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from expstream.errors import ConfigError, PoisonRecordError
from expstream.localservers import free_port, wait_for_port
from expstream.reward_http import (
    CircuitBreaker,
    HttpRewardSource,
    RewardRejected,
    RewardServerUnavailable,
    items_from_batch,
    score_url,
)
from expstream.reward_server import FnScorer, ServerConfig, ServerThread

ROOT = Path(__file__).resolve().parents[1]


def items(labels: list[str], prompts: list[str] | None = None) -> list[dict[str, str]]:
    prompts = prompts or [f"prompt {i}" for i in range(len(labels))]
    return [{"id": f"g{i}#0", "prompt": p, "response": " answer", "label": lab}
            for i, (p, lab) in enumerate(zip(prompts, labels, strict=True))]


@pytest.fixture
def fn_server():
    started: list[ServerThread] = []

    def start(fn: str = "tests.rewardfns_http:label_length", **kw) -> ServerThread:
        srv = ServerThread(FnScorer(fn), **kw)
        srv.start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/score", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_round_trip_keeps_order_across_requests(fn_server):
    srv = fn_server()
    labels = ["x" * k for k in (3, 0, 7, 1, 5, 2, 9, 4, 6, 8, 11)]  # 11 items: requests of 3, 3, 3, 2
    src = HttpRewardSource("judge", srv.url, batch_size=3, max_in_flight=4)
    try:
        scores = src.score_items(items(labels))
        assert scores.dtype == np.float32
        assert scores.tolist() == [3.0, 0.0, 7.0, 1.0, 5.0, 2.0, 9.0, 4.0, 6.0, 8.0, 11.0]
        assert src.stats["requests"] == 4 and src.stats["retries"] == 0
        assert src.score_items([]).shape == (0,)
    finally:
        src.close()
    with urllib.request.urlopen(srv.url + "/health", timeout=5) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok" and health["model"] == "tests.rewardfns_http:label_length"
    assert health["kind"] == "fn" and health["requests"] == 4 and health["items"] == 11


def test_server_names_the_bad_field_and_index(fn_server):
    srv = fn_server()
    good = {"id": "a#0", "prompt": "p", "response": "r"}
    status, body = post(srv.url, json.dumps({"items": [good, {"id": "b#0", "response": "r"}]}).encode())
    assert status == 400 and body["index"] == 1 and "items[1].prompt" in body["error"]
    status, body = post(srv.url, json.dumps({"items": [good, good, {**good, "label": 3}]}).encode())
    assert status == 400 and body["index"] == 2 and "items[2].label" in body["error"]
    status, body = post(srv.url, b"{not json")
    assert status == 400 and body["index"] is None and "not JSON" in body["error"]
    status, body = post(srv.url, json.dumps({"samples": []}).encode())
    assert status == 400 and body["index"] is None and "items" in body["error"]
    status, body = post(srv.url, json.dumps({"items": [good], "extra": 1}).encode())
    assert status == 200 and body == {"scores": [0.0]}


def test_a_400_for_one_item_names_that_sample(fn_server):
    srv = fn_server("tests.rewardfns_http:reject_poison")
    src = HttpRewardSource("judge", srv.url, batch_size=4)
    try:
        prompts = ["fine", "also fine", "a poison prompt", "fine again", "fine 5"]
        with pytest.raises(RewardRejected) as info:
            src.score_items(items([""] * 5, prompts))
        assert isinstance(info.value, PoisonRecordError) and not info.value.retriable
        assert info.value.sample_id == "g2#0"
        assert "g2#0" in str(info.value) and "this prompt is poison" in str(info.value)
        assert src.stats["retries"] == 0  # a 400 is never retried
        assert src.breaker.state == "closed"  # the server answered: it is up
        assert src.score_items(items(["", ""], ["fine", "fine"])).tolist() == [1.0, 1.0]
    finally:
        src.close()


def test_a_server_fault_is_retriable_not_poison(fn_server):
    srv = fn_server("tests.rewardfns_http:server_fault")
    src = HttpRewardSource("judge", srv.url, retries=2, breaker=CircuitBreaker(failures=100))
    try:
        with pytest.raises(RewardServerUnavailable) as info:
            src.score_items(items(["a"]))
        assert info.value.retriable and "HTTP 500" in str(info.value)
        assert src.stats["requests"] == 3 and src.stats["retries"] == 2
    finally:
        src.close()


def test_requests_in_flight_overlap(fn_server):
    """8 requests against a 200 ms server: 8 in flight take about one latency, serial about eight."""
    srv = fn_server(latency_ms=200)
    batch = items(["x"] * 8)
    took = {}
    for n in (1, 8):
        src = HttpRewardSource("judge", srv.url, batch_size=1, max_in_flight=n)
        try:
            src.score_items(batch[:1])  # connect first: the comparison is of scoring, not of connecting
            start = time.perf_counter()
            assert src.score_items(batch).tolist() == [1.0] * 8
            took[n] = time.perf_counter() - start
        finally:
            src.close()
    ratio = took[1] / took[8]
    print(f"8 requests, 200 ms each: serial {took[1]:.2f}s, 8 in flight {took[8]:.2f}s, speed-up {ratio:.1f}x")
    assert ratio > 3


def test_breaker_transitions():
    now = [0.0]
    b = CircuitBreaker(failures=3, reset_s=2.0, clock=lambda: now[0])
    assert b.admit() == "closed"
    assert [b.failure() for _ in range(3)] == [False, False, True] and b.state == "open"
    assert b.admit() == "open"
    now[0] = 2.5
    assert b.state == "half-open" and b.admit() == "probe" and b.admit() == "open"  # one probe at a time
    assert b.failure() is True and b.state == "open" and b.opened == 2  # the probe failed: open again
    now[0] = 5.0
    assert b.admit() == "probe"
    b.success()
    assert b.state == "closed" and b.admit() == "closed"
    assert b.failure() is False  # the count started over


def test_bad_source_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"rewards\.sources\.judge\.max_in_flight"):
        HttpRewardSource("judge", "http://127.0.0.1:1", max_in_flight=0)
    with pytest.raises(ConfigError, match="http://host:port"):
        HttpRewardSource("judge", "127.0.0.1:8000")
    assert score_url("http://h:1/") == "http://h:1/score" and score_url("http://h:1/score") == "http://h:1/score"
    with pytest.raises(ConfigError, match="--model"):
        ServerConfig()


# --- a real `expstream serve-reward` process, killed and started again ---------------------------------


def serve_reward(port: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "expstream", "serve-reward", "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_port("127.0.0.1", port, 120, process=proc)
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_retries_ride_out_a_restart_and_the_breaker_fails_fast_until_a_probe_succeeds():
    port = free_port()
    proc = serve_reward(port, "--fn", "tests.rewardfns_http:label_length")
    breaker = CircuitBreaker(failures=3, reset_s=0.5)
    src = HttpRewardSource("judge", f"http://127.0.0.1:{port}", retries=1, timeout_s=5, breaker=breaker)
    try:
        assert src.score_items(items(["ab"])).tolist() == [2.0]
        kill(proc)
        # down: bounded retries, then a retriable error; the third failed try opens the breaker
        with pytest.raises(RewardServerUnavailable) as info:
            src.score_items(items(["ab"]))
        assert info.value.retriable and src.stats["retries"] == 1
        with pytest.raises(RewardServerUnavailable):
            src.score_items(items(["ab"]))
        assert breaker.state == "open" and breaker.opened == 1
        sent = src.stats["requests"]
        with pytest.raises(RewardServerUnavailable, match="circuit breaker open"):
            src.score_items(items(["ab"]))
        assert src.stats["requests"] == sent and src.stats["fast_failures"] == 1  # failed fast: no request
        proc = serve_reward(port, "--fn", "tests.rewardfns_http:label_length")
        time.sleep(breaker.reset_s)  # not a timing assertion: wait out the open state
        assert src.score_items(items(["abc", "d"])).tolist() == [3.0, 1.0]  # the probe closes it
        assert breaker.state == "closed"
        # a restart inside one call's retries is ridden out without an error reaching the stage
        kill(proc)
        patient = HttpRewardSource("patient", f"http://127.0.0.1:{port}", retries=8,
                                   breaker=CircuitBreaker(failures=100))
        restarted: list[subprocess.Popen] = []
        later = threading.Timer(0.3, lambda: restarted.append(serve_reward(port, "--fn", "tests.rewardfns_http:label_length")))
        later.start()
        try:
            assert patient.score_items(items(["abcd"])).tolist() == [4.0]
            assert patient.stats["retries"] >= 1
        finally:
            later.join()
            patient.close()
            proc = restarted[0] if restarted else proc
    finally:
        src.close()
        if proc.poll() is None:
            kill(proc)


def test_serve_reward_model_process_scores_in_batches_like_one_by_one(tmp_path):
    """The builtin tiny reward model behind `expstream serve-reward`: padding must not change a score."""
    port = free_port()
    proc = serve_reward(port, "--model", "builtin:tiny", "--cache-dir", str(ROOT / ".cache/expstream/models"))
    src = HttpRewardSource("rm", f"http://127.0.0.1:{port}", batch_size=8, timeout_s=60)
    try:
        prompts = ["short", "a much longer prompt than the first one", "mid length", "x"]
        batch = items(["", "", "", ""], prompts)
        together = src.score_items(batch)
        alone = np.array([src.score_items([it])[0] for it in batch])
        assert np.all(np.isfinite(together)) and len(set(together.tolist())) > 1  # not one constant
        np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(src.score_items(batch[::-1]), together[::-1], rtol=1e-4, atol=1e-5)
    finally:
        src.close()
        kill(proc)


def test_score_sends_each_sample_with_its_id_and_texts(fn_server):
    """score(SampleBatch): one item per row, id = the sample id; query = prompt + response without a tokenizer."""
    from tests.runners import exp_batch

    batch = exp_batch("b1", "grp", [0, 1, 2]).replace(label=["a", "abcd", "ab"])
    assert [it["id"] for it in items_from_batch(batch)] == ["grp#0", "grp#1", "grp#2"]
    assert items_from_batch(batch)[0]["query"] == "pr"
    srv = fn_server()
    src = HttpRewardSource("judge", srv.url, batch_size=2)
    try:
        assert src.score(batch).tolist() == [1.0, 4.0, 2.0]
    finally:
        src.close()


def test_serve_reward_refuses_both_or_neither():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "expstream", "serve-reward", "--fn", "no_such_module:f"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--fn" in proc.stderr and "no_such_module" in proc.stderr


# --- the tests: `expstream run` with one http reward source (real broker, redis, server) ----------


def run_with_judge(tmp_path: Path, rows: list[dict], port: int, *sets: str) -> subprocess.Popen:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(tmp_path / "out"),
           "--no-progress", "--set", f"models.cache_dir={ROOT / '.cache/expstream/models'}",
           "--set", "generate.max_new_tokens=4", "--set", "models.reward=null", "--set", "run.timeout_s=180",
           "--set", "rewards.sources.judge.kind=http", "--set", f"rewards.sources.judge.url=http://127.0.0.1:{port}",
           "--set", "rewards.sources.judge.batch_size=2", "--set", "rewards.sources.judge.retries=1"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(run: subprocess.Popen, tmp_path: Path) -> tuple[dict, list]:
    from expstream import read_experiences

    out, err = run.communicate(timeout=400)
    assert run.returncode == 0, f"exit {run.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return summary, read_experiences(tmp_path / "out" / "experiences.msgpack")


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.e2e
@pytest.mark.integration
def test_run_survives_its_reward_server_killed_and_restarted(tmp_path):
    from collections import Counter
    port = free_port()
    serve = ("--fn", "tests.rewardfns_http:label_length", "--latency-ms", "500")  # each request sleeps: killed mid-request
    server = serve_reward(port, *serve)
    rows = [{"id": f"q{i}", "prompt": f"Question {i}?", "label": "x" * (i + 1)} for i in range(4)]
    run = run_with_judge(tmp_path, rows, port, "generate.n_samples_per_prompt=2", "run.prompt_batch_size=1")
    try:
        deadline = time.monotonic() + 300
        while health(port)["requests"] == 0:  # the first request is asleep in the server: kill it now
            assert run.poll() is None and time.monotonic() < deadline, "the run never asked the reward server"
            time.sleep(0.05)
        kill(server)
        time.sleep(3)  # the reward stage fails over retries and the open breaker, and backs off
        server = serve_reward(port, *serve)
        summary, exps = finish(run, tmp_path)
        served_after = health(port)["items"]
    finally:
        if run.poll() is None:
            run.kill()
        kill(server)
    assert summary["status"] == "ok" and summary["groups_complete"] == 4
    assert not summary["dead_letters"] and not summary["groups_dead_lettered"], "nothing dead-lettered for an outage"
    ids = Counter(s for e in exps for s in e.sample_ids)
    assert set(ids) == {f"q{i}#{k}" for i in range(4) for k in range(2)} and set(ids.values()) == {1}
    assert served_after >= 2, "the micro-batch in flight at the kill was scored by the restarted server"
    for e in exps:  # every reward is the server's: len(label) = i + 1 for prompt q{i}
        for sid, r in zip(e.sample_ids, e.info["reward"].tolist(), strict=True):
            assert r == float(int(sid[1:].split("#")[0]) + 1), sid


@pytest.mark.e2e
@pytest.mark.integration
def test_a_400_for_one_sample_dead_letters_that_sample_only(tmp_path):
    from collections import Counter
    port = free_port()
    server = serve_reward(port, "--fn", "tests.rewardfns_http:reject_poison")
    rows = [{"id": f"ok{i}", "prompt": f"Question {i}?"} for i in range(4)] + [{"id": "bad", "prompt": "a poison question"}]
    # one sample per prompt, all five prompts in one micro-batch: the server refuses one item of it
    run = run_with_judge(tmp_path, rows, port, "generate.n_samples_per_prompt=1", "run.prompt_batch_size=5",
                         "algo.advantage_estimator=reinforce", "run.max_lost_group_share=0.5")
    try:
        summary, exps = finish(run, tmp_path)
    finally:
        if run.poll() is None:
            run.kill()
        kill(server)
    assert summary["groups_complete"] == 4 and summary["groups_dead_lettered"] == ["bad"]
    assert [d["stage"] for d in summary["dead_letters"]] == ["reward"]
    assert "bad#0" in summary["lost_groups"]["bad"] and "this prompt is poison" in summary["lost_groups"]["bad"]
    ids = Counter(s for e in exps for s in e.sample_ids)
    assert set(ids) == {f"ok{i}#0" for i in range(4)} and set(ids.values()) == {1}
