"""The HTTP environment client (expstream/rewards/environment.py) against a real server on loopback,
and the Python one's timeout: the JSON contract, per-episode failures, the breaker."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from expstream.config.environment import EnvironmentConfig
from expstream.rewards.environment import (
    EnvironmentFailed,
    EnvironmentUnavailable,
    Episode,
    HttpEnvironment,
    PythonEnvironment,
    Step,
)

EPISODES = [Episode("q#0", "Guess.", "7", ["5", "9"], [[53, 3], [57, 3]], [[10, 11]]),
            Episode("bad#0", "Guess.", "7", ["x"], [[120]], [])]


class Handler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.seen.append({"path": self.path, **body})
        if body["sample_id"].startswith("bad"):
            self._answer(500, {"error": "boom"})
        elif body["sample_id"].startswith("slow"):
            time.sleep(1.0)
            self._answer(200, {"observation": "late", "reward": None, "done": False})
        else:
            guess = int(body["turns"][-1])
            self._answer(200, {"observation": "lower" if guess > 7 else "higher", "reward": None, "done": False})

    def _answer(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up (the timeout test)
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_http_contract_and_a_failing_episode_fails_alone(server):
    env = HttpEnvironment(EnvironmentConfig(url=server, retries=1, timeout_s=5))
    try:
        got = env.step_all(EPISODES)
    finally:
        env.close()
    assert got[0] == Step("lower", None, False)
    assert isinstance(got[1], EnvironmentFailed) and "HTTP 500" in str(got[1]) and "bad#0" in str(got[1])
    first = next(s for s in Handler.seen if s["sample_id"] == "q#0")
    assert first == {"path": "/step", "sample_id": "q#0", "prompt": "Guess.", "label": "7", "turns": ["5", "9"],
                     "turn_ids": [[53, 3], [57, 3]], "observation_ids": [[10, 11]]}
    assert sum(s["sample_id"] == "bad#0" for s in Handler.seen) == 2  # the first try and one retry


def test_http_timeout_fails_the_episode(server):
    env = HttpEnvironment(EnvironmentConfig(url=server, retries=0, timeout_s=0.3))
    try:
        (got,) = env.step_all([Episode("slow#0", "p", "", ["1"], [[1]], [])])
    finally:
        env.close()
    assert isinstance(got, EnvironmentFailed) and "slow#0" in str(got)


def test_refused_connections_open_the_breaker_retriably():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = HttpEnvironment(EnvironmentConfig(url=f"http://127.0.0.1:{port}", retries=6, max_in_flight=1))
    try:
        with pytest.raises(EnvironmentUnavailable) as info:
            env.step_all(EPISODES[:1])
    finally:
        env.close()
    assert info.value.retriable and env.breaker.opened == 1


def test_python_environment_timeout_and_bad_answers():
    def fn(prompt: str, label: str, turns: list[str]):
        if label == "sleep":
            time.sleep(1.0)
        return {"ok": ("obs", 1, False), "bad": ("obs", float("nan"), False), "sleep": (None, None, True)}[label]

    env = PythonEnvironment(EnvironmentConfig(fn="x:y", timeout_s=0.3), fn)
    try:
        ok, bad, slow = env.step_all([Episode(f"{k}#0", "p", k, ["t"], [[1]], []) for k in ("ok", "bad", "sleep")])
    finally:
        env.close()
    assert ok == Step("obs", 1.0, False)
    assert isinstance(bad, EnvironmentFailed) and "reward" in str(bad)
    assert isinstance(slow, EnvironmentFailed) and "timeout_s" in str(slow)
