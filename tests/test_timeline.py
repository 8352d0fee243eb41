"""expstream/observe/timeline.py: when a process was created, read from /proc, to a clock tick."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from expstream.observe.timeline import process_started_at

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")


def test_a_process_start_time_falls_between_before_and_after_it_was_created():
    """The creation time lies between the clock read before Popen and after it returned (fork + exec
    happen inside): /proc/stat's whole-second btime once put it up to a second too early."""
    tick = 0.011  # starttime counts clock ticks (10 ms); float rounding
    for _ in range(3):
        before = time.time()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
        after = time.time()
        try:
            started = process_started_at(proc.pid)
        finally:
            proc.kill()
            proc.wait()
        assert before - tick <= started <= after + tick, (before, started, after)
