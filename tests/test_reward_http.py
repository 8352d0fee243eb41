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
from expstream.launch.localservers import free_port, wait_for_port
from expstream.rewards.http_client import (
    CircuitBreaker,
    HttpRewardSource,
    RewardRejected,
    RewardServerUnavailable,
    items_from_batch,
    score_url,
)
from expstream.rewards.server import FnScorer, Scorer, ServerConfig, ServerThread

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


class ArrivalScorer(Scorer):
    """Scores 1.0 and notes, at each call, how many /score requests the server has received so far (its
    /health counter, which the event loop serves while the call runs on the scoring thread). With
    ``wait_for``, a call first waits until that many have arrived (a deadline on the wait only)."""

    name, kind = "arrivals", "fn"

    def __init__(self, wait_for: int = 0) -> None:
        self.url, self.wait_for, self.seen = "", wait_for, []

    def arrived(self) -> int:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:
            return json.loads(resp.read())["requests"]

    def score(self, items: list[dict[str, str]]) -> list[float]:
        deadline = time.monotonic() + 60
        while (n := self.arrived()) < self.wait_for and time.monotonic() < deadline:
            time.sleep(0.02)
        self.seen.append(n)
        return [1.0] * len(items)


def test_requests_in_flight_overlap():
    """8 requests of one item: with max_in_flight=8 all 8 are at the server before the first is answered;
    with max_in_flight=1 each goes out only once the previous one was answered. The order of arrivals
    and answers, not a speed-up, so it holds however loaded the machine is."""
    seen = {}
    for n, wait_for in ((1, 0), (8, 8)):
        scorer = ArrivalScorer(wait_for)
        srv = ServerThread(scorer)
        scorer.url = srv.start()
        src = HttpRewardSource("judge", srv.url, batch_size=1, max_in_flight=n, timeout_s=300)
        try:
            assert src.score_items(items(["x"] * 8)).tolist() == [1.0] * 8
            assert src.stats["requests"] == 8 and src.stats["retries"] == 0, src.stats  # no retry came to help
        finally:
            src.close()
            srv.stop()
        seen[n] = scorer.seen
    assert seen[1] == [1, 2, 3, 4, 5, 6, 7, 8], seen  # serial: request k+1 only after answer k
    assert seen[8][0] == 8, seen  # overlapped: every request in flight before the first answer


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


# --- issue 21 item 9: a server that stays up, bounded inputs, a bearer token --------------------------

TOKEN = "tok-7c1e9a52f0"  # distinctive: any occurrence in an error, a log or a file is a leak


def serve_reward_env(port: int, env_extra: dict[str, str], *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "EXPSTREAM_REWARD_TOKEN"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_extra)
    proc = subprocess.Popen([sys.executable, "-m", "expstream", "serve-reward", "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_port("127.0.0.1", port, 120, process=proc)
    return proc


def post_as(url: str, body: bytes, token: str | None = None, path: str = "/score") -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url + path, data=body if path == "/score" else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def test_a_reward_function_raising_systemexit_or_keyboardinterrupt_answers_500_and_the_server_stays_up():
    port = free_port()
    proc = serve_reward_env(port, {}, "--fn", "tests.rewardfns_http:exits_on_label", "--host", "0.0.0.0")
    url = f"http://127.0.0.1:{port}"
    try:
        for label, name in (("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")):
            status, body, _ = post_as(url, json.dumps({"items": items([label])}).encode())
            assert status == 500 and name in body["error"] and body["index"] is None, (status, body)
            assert proc.poll() is None, f"{name} in the reward function stopped the server"
        status, body, _ = post_as(url, json.dumps({"items": items(["abc"])}).encode())
        assert (status, body) == (200, {"scores": [3.0]})
        src = HttpRewardSource("judge", url, retries=0, breaker=CircuitBreaker(failures=100))
        try:  # the client sees a server fault: retriable, nothing is dead-lettered
            with pytest.raises(RewardServerUnavailable, match="HTTP 500"):
                src.score_items(items(["exit"]))
        finally:
            src.close()
        assert proc.poll() is None
    finally:
        kill(proc)
    err = proc.stderr.read()
    assert "listens on 0.0.0.0 without a token" in err and "EXPSTREAM_REWARD_TOKEN" in err


def test_a_deeply_nested_body_is_a_400_not_a_500(fn_server):
    srv = fn_server()
    deep = b'{"items": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    status, body = post(srv.url, deep)
    assert status == 400 and body["index"] is None and "nested too deeply" in body["error"], (status, body)
    nested_field = json.dumps({"items": [{"id": "a#0", "prompt": "p", "response": "r"}]}).encode().replace(
        b'"p"', b"[" * 100_000 + b"]" * 100_000)
    assert post(srv.url, nested_field)[0] == 400
    assert post(srv.url, json.dumps({"items": items(["ab"])}).encode()) == (200, {"scores": [2.0]})


@pytest.fixture(scope="module")
def tiny_rm():
    from expstream.rewards.server import ModelScorer

    return ModelScorer("builtin:tiny", cache_dir=str(ROOT / ".cache/expstream/models"))


def test_a_reward_model_refuses_an_item_longer_than_its_context_with_413_at_once(tiny_rm):
    from expstream.rewards.server import ModelScorer

    assert tiny_rm.max_len == tiny_rm.model.config.max_position_embeddings  # 4096 for the tiny model
    srv = ServerThread(tiny_rm)
    srv.start()
    src = HttpRewardSource("rm", srv.url, batch_size=8, retries=0)
    try:
        huge = items(["", "", ""], ["short", "a " * 120_000, "also short"])  # a 240 KB response
        status, body = post(srv.url, json.dumps({"items": huge}).encode())
        assert status == 413 and body["index"] == 1 and "--max-len" in body["error"] and "4096" in body["error"]
        with pytest.raises(RewardRejected) as info:  # poison for that sample only, never retried
            src.score_items(huge)
        assert info.value.sample_id == "g1#0" and src.stats["retries"] == 0
        ok = src.score_items(items(["", ""], ["short", "also short"]))
        assert np.all(np.isfinite(ok))
    finally:
        src.close()
        srv.stop()
    # a --max-len below the model's: counted in tokens after the character pre-check
    srv = ServerThread(ModelScorer("builtin:tiny", cache_dir=str(ROOT / ".cache/expstream/models"), max_len=16))
    srv.start()
    try:
        words = " ".join(f"w{i}" for i in range(40))
        status, body = post(srv.url, json.dumps({"items": items(["", ""], ["hi", words])}).encode())
        assert status == 413 and body["index"] == 1 and "tokens" in body["error"] and "16" in body["error"]
        status, body = post(srv.url, json.dumps({"items": items([""], ["hi"])}).encode())
        assert status == 200 and len(body["scores"]) == 1
    finally:
        srv.stop()


def test_the_reward_api_takes_an_optional_bearer_token_from_the_environment(fn_server, monkeypatch):
    srv = fn_server(token=TOKEN)
    one = json.dumps({"items": items(["abcd"])}).encode()
    for sent in (None, "wrong", TOKEN + "x"):
        status, body, headers = post_as(srv.url, one, sent)
        assert status == 401 and body["index"] is None and "EXPSTREAM_REWARD_TOKEN" in body["error"]
        assert headers.get("WWW-Authenticate", "").startswith("Bearer") and TOKEN not in body["error"]
    assert post_as(srv.url, one, TOKEN)[:2] == (200, {"scores": [4.0]})
    assert post_as(srv.url, b"", None, "/health")[1] == {"status": "ok"}  # a probe learns nothing more
    assert post_as(srv.url, b"", TOKEN, "/health")[1]["model"] == "tests.rewardfns_http:label_length"
    # the client: the token from the environment; without it a retriable error that names the variable
    monkeypatch.delenv("EXPSTREAM_REWARD_TOKEN", raising=False)
    src = HttpRewardSource("judge", srv.url, retries=0)
    try:
        with pytest.raises(RewardServerUnavailable, match="HTTP 401.*EXPSTREAM_REWARD_TOKEN") as info:
            src.score_items(items(["ab"]))
        assert info.value.retriable
    finally:
        src.close()
    monkeypatch.setenv("EXPSTREAM_REWARD_TOKEN", TOKEN)
    src = HttpRewardSource("judge", srv.url, retries=0)
    try:
        assert src.score_items(items(["ab", "abc"])).tolist() == [2.0, 3.0]
    finally:
        src.close()
    monkeypatch.setenv("EXPSTREAM_REWARD_TOKEN", "not-it")
    src = HttpRewardSource("judge", srv.url, retries=0)
    try:
        with pytest.raises(RewardServerUnavailable, match="refused") as info:
            src.score_items(items(["ab"]))
        assert TOKEN not in str(info.value) and "not-it" not in str(info.value)
    finally:
        src.close()


def test_serve_reward_reads_its_token_from_the_environment_and_warns_only_without_one():
    from expstream.rewards.server import bind_warning

    for host in ("0.0.0.0", "::", "10.1.2.3", "reward.example"):
        assert "without a token" in bind_warning(host, None)
        assert bind_warning(host, TOKEN) is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert bind_warning(host, None) is None
    port = free_port()
    proc = serve_reward_env(port, {"EXPSTREAM_REWARD_TOKEN": TOKEN}, "--fn", "tests.rewardfns_http:label_length",
                            "--host", "0.0.0.0")
    try:
        url = f"http://127.0.0.1:{port}"
        one = json.dumps({"items": items(["abc"])}).encode()
        assert post_as(url, one)[0] == 401 and post_as(url, one, TOKEN)[:2] == (200, {"scores": [3.0]})
        assert TOKEN.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    finally:
        kill(proc)
    err = proc.stderr.read()
    assert "without a token" not in err and TOKEN not in err and "bearer token from EXPSTREAM_REWARD_TOKEN" in err


# --- issue 21 item 14: credentials in an http reward url, redacted where written, given to the stages -----

URL_PASSWORD = "Pw-url-4e2d9b17"


class BasicAuthJudge:
    """A reward server (aiohttp, loopback, own thread) that wants HTTP basic auth ``bob:URL_PASSWORD``,
    as a server behind a proxy might, and scores len(label); it counts the refused requests."""

    def __init__(self) -> None:
        import asyncio
        import base64

        from aiohttp import web

        want = "Basic " + base64.b64encode(f"bob:{URL_PASSWORD}".encode()).decode()
        self.refused = 0

        async def score(request: web.Request) -> web.Response:
            if request.headers.get("Authorization") != want:
                self.refused += 1
                return web.json_response({"error": "who are you", "index": None}, status=401)
            body = await request.json()
            return web.json_response({"scores": [float(len(it.get("label", ""))) for it in body["items"]]})

        app = web.Application()
        app.router.add_post("/score", score)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def up() -> int:
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return self.runner.addresses[0][1]

        self.port = asyncio.run_coroutine_threadsafe(up(), self.loop).result(10)
        self.url = f"http://bob:{URL_PASSWORD}@127.0.0.1:{self.port}"

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def basic_judge():
    judge = BasicAuthJudge()
    yield judge
    judge.stop()


def test_url_credentials_are_redacted_in_the_written_topology_and_reach_the_stage_by_environment(
        basic_judge, tmp_path, monkeypatch):
    from expstream.config.redaction import TOPOLOGY_SECRETS_ENV
    from expstream.config.topology import load_topology
    from expstream.launch.run import stage_env, write_resolved_topology

    monkeypatch.delenv(TOPOLOGY_SECRETS_ENV, raising=False)
    topo = load_topology(None, ["models.reward=null", "rewards.sources.judge.kind=http",
                                f"rewards.sources.judge.url={basic_judge.url}"])
    path = tmp_path / "topology.yaml"
    write_resolved_topology(topo, path)
    text = path.read_text()
    assert URL_PASSWORD not in text and f"http://bob:***@127.0.0.1:{basic_judge.port}" in text
    # a stage without the variable: the redacted url is refused, naming the field and the fix
    with pytest.raises(ConfigError, match=r"rewards\.sources\.judge\.url.*redacted") as info:
        HttpRewardSource("judge", load_topology(path).rewards.sources["judge"].url)
    assert URL_PASSWORD not in str(info.value)
    # a stage with the environment expstream run gives it: the real url, and the server accepts it
    env = stage_env("redis://127.0.0.1:1/0", topo)
    assert URL_PASSWORD in env[TOPOLOGY_SECRETS_ENV]
    monkeypatch.setenv(TOPOLOGY_SECRETS_ENV, env[TOPOLOGY_SECRETS_ENV])
    url = load_topology(path).rewards.sources["judge"].url
    assert url == basic_judge.url
    src = HttpRewardSource("judge", url, retries=0)
    try:
        assert src.score_items(items(["abc", "a"])).tolist() == [3.0, 1.0] and basic_judge.refused == 0
    finally:
        src.close()
    # the variable never replaces a url the file holds otherwise (another judge, no credentials)
    other = tmp_path / "other.yaml"
    other.write_text(text.replace(f"bob:***@127.0.0.1:{basic_judge.port}", "127.0.0.1:9"))
    assert load_topology(other).rewards.sources["judge"].url == "http://127.0.0.1:9"


def test_a_failing_request_does_not_show_the_url_credentials(basic_judge):
    src = HttpRewardSource("judge", basic_judge.url.replace(URL_PASSWORD, URL_PASSWORD + "-wrong"), retries=0,
                           token="")
    try:
        with pytest.raises(RewardServerUnavailable) as info:
            src.score_items(items(["ab"]))
        assert "HTTP 401" in str(info.value) and URL_PASSWORD not in str(info.value)
        assert "bob:***@" in str(info.value)
    finally:
        src.close()


@pytest.mark.e2e
@pytest.mark.integration
def test_a_run_scores_through_a_url_with_credentials_and_writes_them_nowhere(basic_judge, tmp_path):
    topology = tmp_path / "judge.yaml"  # in a file, not on the command line (`ps` shows a command line)
    topology.write_text(f"models:\n  reward: null\n  cache_dir: {ROOT / '.cache/expstream/models'}\n"
                        f"generate:\n  max_new_tokens: 4\n  n_samples_per_prompt: 2\n"
                        f"rewards:\n  sources:\n    judge: {{kind: http, url: '{basic_judge.url}', batch_size: 2}}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}?", "label": "x" * (i + 1)}) + "\n"
                               for i in range(2)))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "EXPSTREAM_TOPOLOGY_SECRETS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "expstream", "run", "--topology", str(topology), "--prompts",
                          str(prompts), "--output", str(out), "--no-progress"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    from expstream import read_experiences

    rewards = {sid: r for e in read_experiences(out / "experiences.msgpack")
               for sid, r in zip(e.sample_ids, e.info["reward"].tolist(), strict=True)}
    assert rewards == {f"q{i}#{k}": float(i + 1) for i in range(2) for k in range(2)} and basic_judge.refused == 0
    for name in ("topology.yaml", "run/topology.yaml"):
        assert f"bob:***@127.0.0.1:{basic_judge.port}" in (out / name).read_text()
    leaks = [p for p in out.rglob("*") if p.is_file() and URL_PASSWORD.encode() in p.read_bytes()]
    assert not leaks and URL_PASSWORD not in res.stderr + res.stdout, leaks
