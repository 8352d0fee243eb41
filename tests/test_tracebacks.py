"""Commands end with one clear line, never a traceback (issue 21 item 11).

An unreachable broker for `record` and `replay --into`, `status --watch` when the run ends, a reader
that goes away (`| head`), a train.jsonl line missing a field for `report`, and a run whose stage
code cannot be imported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expstream.config.topology import load_topology
from expstream.errors import EXIT_BROKEN_PIPE, EXIT_CONFIG
from expstream.launch.localservers import LocalRedis, free_port
from expstream.launch.run import write_resolved_topology
from expstream.launch.rundir import lock_run_dir
from expstream.tools.report import write_report

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def expstream(*args: str, timeout: float = 120, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "expstream", *args], cwd=cwd, env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)


def closed_address() -> str:
    """HOST:PORT where nothing listens (a free port, not bound)."""
    return f"127.0.0.1:{free_port()}"


def run_dir_with_topology(path: Path) -> Path:
    (path / "run").mkdir(parents=True)
    topo = load_topology(None, [])
    write_resolved_topology(topo, path / "run" / "topology.yaml")
    write_resolved_topology(topo, path / "topology.yaml")
    return path


def test_record_with_an_unreachable_broker_fails_with_one_line_and_creates_no_directory(tmp_path):
    out = tmp_path / "rec"
    proc = expstream("record", "--bootstrap-servers", closed_address(), "--topics", "prompts", "--output", str(out))
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "cannot reach Kafka" in proc.stderr, proc.stderr[-3000:]
    assert "leave it out to start a local one" not in proc.stderr  # record starts no broker of its own
    assert not out.exists(), "an unreachable broker must leave no empty recording directory behind"


def test_replay_into_an_unreachable_broker_fails_with_one_line(tmp_path):
    run = run_dir_with_topology(tmp_path / "run")
    proc = expstream("replay", str(run), "--from", "prompts", "--into", "prompts", "--bootstrap-servers",
                     closed_address())
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "cannot reach Kafka" in proc.stderr, proc.stderr[-3000:]


def stale_run_dir(path: Path, *, snapshot: bool) -> Path:
    """A run directory whose services are gone (nothing listens at its Redis), with or without status.jsonl."""
    run = run_dir_with_topology(path)
    (run / "run" / "services.json").write_text(json.dumps(
        {"run_id": "r-gone", "bootstrap_servers": closed_address(), "redis_url": f"redis://{closed_address()}/0"}))
    if snapshot:
        stage = {"replicas_alive": 0, "replicas_wanted": 1, "restarts": 0, "records_per_s": 0.0, "samples_per_s": 0.0,
                 "batch_p50_s": None, "batch_p95_s": None, "busy_share": 0.0, "last_progress_s": 1.0,
                 "input_lag_records": 0, "input_lag_s": None, "dead_letters": 0, "samples_in": 8, "samples_out": 8,
                 "samples_dead": 0, "samples_dropped": 0, "in_flight": 0, "balanced": True,
                 "policy_version_seen": 0, "staleness_versions": None}
        snap = {"t": time.time(), "run_id": "r-gone", "policy_version": 0, "bottleneck": None, "topics": {},
                "stages": {f"stage-{i}": dict(stage) for i in range(400)}}  # a long table: many writes
        (run / "status.jsonl").write_text(json.dumps(snap) + "\n")
    return run


def test_a_command_whose_reader_goes_away_exits_quietly(tmp_path):
    run = stale_run_dir(tmp_path / "run", snapshot=True)
    proc = subprocess.Popen([PY, "-m", "expstream", "status", "--run-dir", str(run), "--json"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head` that has read what it wanted, before the command writes anything
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == EXIT_BROKEN_PIPE, err[-3000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err[-3000:]


def test_status_of_a_killed_run_says_it_is_not_running_and_blames_no_flag_it_was_not_given(tmp_path):
    run = stale_run_dir(tmp_path / "run", snapshot=False)
    proc = expstream("status", "--run-dir", str(run))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "not running" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--redis-url" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.integration
def test_status_watch_ends_with_a_message_when_the_run_ends(tmp_path, broker):
    redis = LocalRedis(tmp_path / "redis")
    url = redis.start()
    run = run_dir_with_topology(tmp_path / "run")
    (run / "run" / "services.json").write_text(json.dumps(
        {"run_id": "r-watch", "bootstrap_servers": broker, "redis_url": url}))
    lock = lock_run_dir(run)  # what a running `expstream run` holds
    out_path = tmp_path / "status.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([PY, "-m", "expstream", "status", "--run-dir", str(run), "--watch", "--interval", "0.2"],
                                cwd=ROOT, env={**ENV, "TTY_COMPATIBLE": "1", "COLUMNS": "120"}, stdout=out,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while "bottleneck" not in out_path.read_text():  # the first snapshot is drawn: it is watching
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "status --watch drew nothing"
            time.sleep(0.1)
        redis.stop()  # the run ends: its Redis goes, then its lock
        lock.release()
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        redis.stop()
    text = out_path.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "the run has ended" in text, (err[-3000:], text[-2000:])


def test_report_skips_a_train_jsonl_line_missing_a_field_and_names_it(tmp_path, caplog):
    lines = [{"step": 0, "reward_mean": 0.1, "staleness_hist": {"0": 8}},
             {"step": 1, "staleness_hist": {"0": 8}},  # no reward_mean
             {"reward_mean": 0.3},  # no step
             {"step": 3, "reward_mean": 0.4, "staleness_hist": {"0": "eight"}},  # a histogram that is not one
             [1, 2]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level(logging.WARNING, logger="expstream.report"):
        html = write_report(tmp_path).read_text()
    said = caplog.text
    for no, what in ((2, "reward_mean"), (3, "step"), (4, "staleness_hist"), (5, "not a JSON object")):
        assert f"train.jsonl:{no}" in said and what in said, (no, said)
    assert "train.jsonl:1 " not in said
    assert "report/reward_curve.png" in html and (tmp_path / "report" / "reward_curve.png").read_bytes()[:4] == \
        b"\x89PNG"


BROKEN_STAGES = "from __future__ import annotations\nSTAGES = {  # a syntax error in the stage code\n"


@pytest.mark.e2e
@pytest.mark.integration
def test_a_run_whose_stage_code_cannot_be_imported_fails_at_once_with_that_error(tmp_path):
    # a `stages` package that cannot be imported, ahead of the real one on the path of every process
    shadow = tmp_path / "shadow"
    (shadow / "stages").mkdir(parents=True)
    (shadow / "stages" / "__init__.py").write_text(BROKEN_STAGES)
    env = {**ENV, "PYTHONPATH": str(shadow) + os.pathsep + ENV["PYTHONPATH"]}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say 1"}) + "\n")
    out = tmp_path / "out"
    proc = expstream("run", "--prompts", str(prompts), "--output", str(out), "--no-progress", "--no-report",
                     "--set", f"models.cache_dir={ROOT / '.cache' / 'expstream' / 'models'}",  # shared with other runs
                     "--set", "record.enabled=false",
                     timeout=300, env=env, cwd=tmp_path)  # not ROOT: `-m` puts the working directory first
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "EOFError" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("expstream: run failed: stage ") and "cannot import its code: SyntaxError" in last, last
    assert not re.search(r"redis \w+ failed", proc.stderr), "the run read the stage statistics from a stopped Redis"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "SyntaxError" in summary["error"], summary["error"]
