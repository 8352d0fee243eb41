"""One run per output directory (issue 8 item 5): an exclusive lock, no silent reuse of a previous run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from expstream.errors import ConfigError
from expstream.launch.localservers import LocalRedis
from expstream.launch.rundir import LOCK_NAME, claim_run_dir, lock_run_dir

ROOT = Path(__file__).resolve().parents[1]


def names(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*")}


def previous_run(path: Path, run_id: str = "20250101-000000-abcdef") -> Path:
    """What a finished run leaves behind (summary, experiences, the local servers' files)."""
    (path / "run" / "appendonlydir").mkdir(parents=True)
    (path / "run" / "appendonlydir" / "appendonly.aof.1.incr.aof").write_bytes(b"*1\r\n$4\r\nPING\r\n")
    (path / "run" / "services.json").write_text(json.dumps({"run_id": run_id}))
    (path / "summary.json").write_text(json.dumps({"run_id": run_id, "samples": 160}))
    (path / "experiences.msgpack").write_bytes(b"\x80" * 16)
    return path


def test_a_second_claim_on_a_dir_in_use_fails_and_touches_nothing(tmp_path):
    held = claim_run_dir(tmp_path / "out")
    (tmp_path / "out" / "summary.json").write_text('{"run_id": "first"}')  # the first run's work
    with pytest.raises(ConfigError, match=rf"run directory .*out is in use by pid {os.getpid()}"):
        claim_run_dir(tmp_path / "out", force=True)  # not even --force deletes a live run's files
    assert (tmp_path / "out" / "summary.json").read_text() == '{"run_id": "first"}'
    assert held.held
    held.release()
    claim_run_dir(tmp_path / "out", force=True).release()  # released: the next run may take it
    assert names(tmp_path / "out") == {LOCK_NAME}


def test_the_lock_dies_with_its_process(tmp_path):
    code = f"from expstream.launch.rundir import lock_run_dir; l = lock_run_dir({str(tmp_path)!r}); print('locked', flush=True); " \
           "import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"in use by pid {proc.pid}"):
            lock_run_dir(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    lock_run_dir(tmp_path).release()  # SIGKILL left no stale lock


def test_expstream_run_on_a_locked_dir_exits_2_at_once(tmp_path):
    out = previous_run(tmp_path / "out")
    before = names(out) | {LOCK_NAME}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with lock_run_dir(out):  # a run in progress on this directory (the lock is all the second one sees)
        proc = subprocess.run([sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
                               "--force", "--no-progress", "--set", f"models.cache_dir={tmp_path / 'models'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"run directory {out} is in use by pid {os.getpid()}" in proc.stderr
    # "at once": refused before anything slow started (the model cache below; no local server either)
    assert " broker at " not in proc.stderr and " redis at " not in proc.stderr, proc.stderr[-3000:]
    assert names(out) == before, "the refused run wrote or deleted nothing"
    assert not (tmp_path / "models").exists(), "refused before building models"


def test_a_dir_holding_a_previous_run_is_refused_without_a_flag(tmp_path):
    out = previous_run(tmp_path / "out", run_id="r-old")
    before = names(out)
    with pytest.raises(ConfigError) as exc:
        claim_run_dir(out)
    msg = str(exc.value)
    assert "holds a previous run (summary.json from run r-old)" in msg and "--force" in msg and "--output" in msg
    assert names(out) - {LOCK_NAME} == before


def test_force_empties_the_dir_and_a_fresh_redis_loads_no_old_aof(tmp_path):
    out = tmp_path / "out"
    first = LocalRedis(out / "run", appendonly=True)
    r = redis.Redis.from_url(first.start())
    r.set("expstream:{old}:moments:reward", b"stale")
    r.close()
    first.stop()
    (out / "summary.json").write_text('{"run_id": "old"}')
    with pytest.raises(ConfigError, match="holds a previous run"):
        claim_run_dir(out)
    with claim_run_dir(out, force=True):
        assert names(out) == {LOCK_NAME}
        second = LocalRedis(out / "run", appendonly=True)
        r = redis.Redis.from_url(second.start())
        try:
            assert r.dbsize() == 0, "the new run's redis replayed the previous run's appendonly file"
        finally:
            r.close()
            second.stop()


def test_force_deletes_only_run_directories(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an expstream run directory"):
        claim_run_dir(tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_dir_that_is_not_a_run_is_refused_without_suggesting_force_which_would_refuse_too(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an expstream run directory") as plain:
        claim_run_dir(tmp_path)
    assert "--force deletes run directories only" in str(plain.value)
    assert "pass --force" not in str(plain.value) and plain.value.fix == "give a new or empty directory"
    with pytest.raises(ConfigError) as forced:  # what the message says about --force holds
        claim_run_dir(tmp_path, force=True)
    assert str(forced.value) == str(plain.value)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resume_is_refused_with_the_reason_and_keeps_the_run(tmp_path):
    out = previous_run(tmp_path / "out", run_id="r-old")
    before = names(out)
    with pytest.raises(ConfigError, match=r"--resume: continuing a run is not supported yet .*r-old.*--force"):
        claim_run_dir(out, resume=True)
    assert names(out) - {LOCK_NAME} == before
    lock_run_dir(out).release()  # the refusal released the lock
