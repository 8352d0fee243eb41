"""`expstream run` leaves nothing behind, Ctrl-C stops it cleanly, the supervisor restarts the dead.

That a run which finished leaves no process and no open port is checked after each run of tests/test_e2e.py
(its ``run`` helper): a run of its own here repeated one of those.
"""

from __future__ import annotations

import json
import re
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
    # each child notes when it came up (CLOCK_MONOTONIC is system-wide), then dies
    sup.add("flaky", 0, [sys.executable, "-c", "import sys, time; print('up', time.monotonic()); sys.exit(3)"])
    caplog.set_level("INFO", logger="expstream.supervisor")
    sup.start()
    with pytest.raises(SupervisorError, match="died 3 times"):
        deadline = time.monotonic() + 120  # a deadline on the wait only
        while time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.02)
    child = sup.children[0]
    assert child.exit_codes == [3, 3, 3]
    # backoff doubles: restart 1 after 0.5 s, restart 2 after 1 s
    planned = [re.search(r"exited with code 3; restart (\d+) in ([0-9.]+)s", r.getMessage()) for r in caplog.records]
    assert [(int(m[1]), float(m[2])) for m in planned if m] == [(1, 0.5), (2, 1.0)]
    # and it waited them out: a child comes up after the previous one printed, exited and its delay
    # passed, so these gaps are at least the delays however slow the machine is (an order, not a speed)
    ups = [float(line.split()[1]) for line in (tmp_path / "logs" / "flaky-0.log").read_text().splitlines()
           if line.startswith("up ")]
    assert len(ups) == 3 and ups[1] - ups[0] >= 0.5 and ups[2] - ups[1] >= 1.0, ups


def test_supervisor_does_not_restart_a_configuration_error(tmp_path):
    sup = Supervisor(tmp_path / "logs", spawn="exec")
    sup.add("bad", 0, [sys.executable, "-c", "import sys; sys.exit(2)"])
    sup.start()
    sup.children[0].proc.wait(timeout=10)
    with pytest.raises(SupervisorError, match="configuration error"):
        sup.poll()
