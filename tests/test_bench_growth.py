"""bench/growth.py's naming of the run's processes (the runs themselves are the bench's, not a test's)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import growth  # noqa: E402

SERVER = "/venv/bin/python -B -c from multiprocessing.forkserver import main; main(3, 5, ['expstream.launch.forkserver'])"


def test_only_the_clis_own_child_is_the_fork_server() -> None:
    # an untitled child of the fork server shows the server's command line: its curve is its own,
    # never merged into (or overwriting) the server's
    assert growth.process_name(20, 10, SERVER, ppid=10) == "forkserver"
    assert growth.process_name(30, 10, SERVER, ppid=20) == "forked (30)"
    assert growth.process_name(31, 10, "expstream trainer run=growth1", ppid=20) == "trainer"
    assert growth.process_name(32, 10, "expstream stage reward[1] run=growth1", ppid=20) == "stage reward[1]"
    assert growth.process_name(33, 10, "expstream recorder run=growth1", ppid=20) == "record"
    assert growth.process_name(10, 10, "python -m expstream run", ppid=1) == "cli"
