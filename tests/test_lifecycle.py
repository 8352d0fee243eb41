"""`expstream run` leaves nothing behind, Ctrl-C stops it cleanly, the supervisor restarts the dead.

That a run which finished leaves no process and no open port is checked after each run of tests/test_e2e.py
(its ``run`` helper): a run of its own here repeated one of those.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expstream.launch.supervisor import Supervisor, SupervisorError
from tests.harness import leftovers, start_expstream

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache  # the session's tiny-model cache (tests/conftest.py)


def start_run(tmp_path: Path, cache: Path, prompts: int = 6) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(prompts)))
    proc, out = start_expstream(tmp_path, prompts=path, cache=cache,
                                sets=["generate.max_new_tokens=6", "generate.n_samples_per_prompt=2"])
    return proc, out / "run"


@pytest.mark.e2e
def test_ctrl_c_stops_every_stage_cleanly(tmp_path, cache):
    proc, run_dir = start_run(tmp_path, cache, prompts=200)
    deadline = time.monotonic() + 120
    while not (run_dir / "pids.json").exists() or len(json.loads((run_dir / "pids.json").read_text())) < 7:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(3)  # stages are up and working
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "stopping every stage cleanly" in err
    summary = json.loads((run_dir.parent / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert leftovers(run_dir) == []


def test_supervisor_restarts_a_dying_child_with_backoff_and_logs_it(tmp_path, caplog):
    sup = Supervisor(tmp_path / "logs", max_restarts=2, spawn="exec")
    sup.add("flaky", 0, [sys.executable, "-c", "import sys; print('up'); sys.exit(3)"])
    caplog.set_level("INFO", logger="expstream.supervisor")
    sup.start()
    starts = [time.monotonic()]
    with pytest.raises(SupervisorError, match="died 3 times"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            before = sup.children[0].proc
            sup.poll()
            if sup.children[0].proc is not None and sup.children[0].proc is not before:
                starts.append(time.monotonic())
            time.sleep(0.02)
    child = sup.children[0]
    assert child.exit_codes == [3, 3, 3]
    # backoff doubles: 0.5 s, then 1 s between restarts
    assert starts[1] - starts[0] >= 0.45 and starts[2] - starts[1] >= 0.95
    assert sum("exited with code 3; restart" in r.getMessage() for r in caplog.records) == 2
    assert (tmp_path / "logs" / "flaky-0.log").read_text().count("up") == 3


def test_supervisor_does_not_restart_a_configuration_error(tmp_path):
    sup = Supervisor(tmp_path / "logs", spawn="exec")
    sup.add("bad", 0, [sys.executable, "-c", "import sys; sys.exit(2)"])
    sup.start()
    sup.children[0].proc.wait(timeout=10)
    with pytest.raises(SupervisorError, match="configuration error"):
        sup.poll()
