"""A Redis password never shown (issue 8 item 8): redacted in files, logs and errors, off every
command line, and files that hold it are 0600."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
import redis

from expstream.config.redaction import REDIS_URL_ENV, redact_url, url_password, write_private
from expstream.errors import StateUnavailableError
from expstream.launch.localservers import LocalRedis, free_port
from expstream.state import RedisState
from tests.harness import start_expstream

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "Pw-9f3c2e71d0aa"  # distinctive: any occurrence in a file, a log or a cmdline is a leak


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://bob:s3cret@redis:6379/2", "redis://bob:***@redis:6379/2"),
    ("rediss://:s3cret@cache.example:6380/0", "rediss://:***@cache.example:6380/0"),
    ("redis://redis:6379/0?password=s3cret&db=1", "redis://redis:6379/0?password=***&db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://bob@redis:6379/0", "redis://bob@redis:6379/0"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert (url_password(url) == "s3cret") == ("s3cret" in url)


def test_write_private_is_0600_whatever_the_umask_and_the_old_mode(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")
    path.chmod(0o644)
    old = os.umask(0)
    try:
        write_private(path, "secret")
        write_private(tmp_path / "g", "secret")
    finally:
        os.umask(old)
    for p in (path, tmp_path / "g"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == "secret"


def test_an_unreachable_redis_error_does_not_show_the_password():
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    with pytest.raises(StateUnavailableError) as exc:
        RedisState(url, "t-secret", retry_deadline_s=0.3)
    assert PASSWORD not in str(exc.value) and ":***@127.0.0.1" in str(exc.value)


@pytest.fixture(scope="module")
def secret_redis(tmp_path_factory) -> LocalRedis:
    r = LocalRedis(tmp_path_factory.mktemp("secret-redis"), appendonly=False, password=PASSWORD)
    r.start()
    yield r
    r.stop()


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_local_redis_password_lives_in_a_0600_file_only(secret_redis, caplog):
    assert stat.S_IMODE(secret_redis.conf_path.stat().st_mode) == 0o600
    assert PASSWORD.encode() not in cmdline(secret_redis.pid), "redis-server shows the password in ps"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=secret_redis.port).ping()
    assert redis.Redis.from_url(secret_redis.url).ping()


@pytest.mark.e2e
@pytest.mark.integration
def test_a_run_against_a_password_protected_redis_shows_it_nowhere(tmp_path, secret_redis, model_cache):
    """One real run (exec spawn: a stage's argv is its /proc/<pid>/cmdline) with the password given
    the recommended way, in $EXPSTREAM_REDIS_URL; every stage must reach Redis through it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(2)))
    env = {REDIS_URL_ENV: secret_redis.url,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc, out = start_expstream(tmp_path, prompts=prompts, cache=model_cache, env=env, text=False,
                                sets=["generate.n_samples_per_prompt=2", "generate.max_new_tokens=4",
                                      "run.timeout_s=120", "run.spawn=exec"])
    seen: dict[str, bytes] = {}
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:  # every stage's command line while it runs
        try:
            pids = json.loads((out / "run" / "pids.json").read_text())
        except (OSError, ValueError):
            pids = {}
        for label, pid in pids.items():
            seen.setdefault(label, cmdline(pid))
        time.sleep(0.2)
    stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout.decode()}\n{stderr.decode()[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"] == 4
    assert summary["stages"], "the stages wrote their stats to the password-protected redis (env URL read)"
    assert summary["redis_url"] == json.loads((out / "run" / "services.json").read_text())["redis_url"] \
        == f"redis://:***@127.0.0.1:{secret_redis.port}/0"
    assert len(seen) >= 6 and all(seen.values()), seen.keys()
    leaks = [label for label, line in seen.items() if PASSWORD.encode() in line]
    assert not leaks, f"password on the command line of {leaks}"
    assert PASSWORD.encode() not in stdout + stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name.endswith(".log") for p in files)
    holding = [p for p in files if PASSWORD.encode() in p.read_bytes()]
    assert not holding, f"files holding the password: {holding}"


@pytest.mark.parametrize(("url", "shown"), [
    ("http://bob:s3cret@judge:8000", "http://bob:***@judge:8000"),
    ("https://judge.example/v1/score?token=s3cret&model=x", "https://judge.example/v1/score?token=***&model=x"),
    ("http://judge:8000/score?api_key=s3cret", "http://judge:8000/score?api_key=***"),
    ("http://judge:8000", "http://judge:8000"),
])
def test_an_http_reward_url_is_redacted_and_its_secrets_split_off_the_topology(url, shown):
    from expstream.config.redaction import apply_secrets, is_redacted, split_secrets

    assert redact_url(url) == shown and is_redacted(shown) == (shown != url)
    raw = {"rewards": {"sources": {"judge": {"kind": "http", "url": url}}}, "run": {"seed": 3}}
    written, secrets = split_secrets(raw)
    assert "s3cret" not in json.dumps(written) and written["rewards"]["sources"]["judge"]["url"] == shown
    assert raw["rewards"]["sources"]["judge"]["url"] == url  # the topology in memory keeps them
    assert secrets == ({"rewards.sources.judge.url": url} if shown != url else {})
    assert apply_secrets(written, secrets) == len(secrets) and written == raw
