"""Every stage process names itself in ps/top: ``expstream stage reward[1] run=<id>``.

Started the way ``expstream run`` starts them (the supervisor, with ``run.stage_argv``), on both
spawn paths: a fresh interpreter (``exec``, as docker-compose does) and a fork of the fork server
(``fork``, the default of ``expstream run``, whose processes otherwise show as
``python -B -c from multiprocessing...``). The title is read from ``/proc/<pid>/cmdline``, as
``ps`` does. No broker is needed: the title is set before the stage imports torch, so the test
stops the process as soon as it shows its name.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from expstream.config.topology import load_topology
from expstream.launch.forkserver import MALLOC_ENV
from expstream.launch.localservers import free_port
from expstream.launch.run import FORK_ENTRY, stage_argv, stage_env, write_resolved_topology
from expstream.launch.supervisor import Supervisor
from expstream.procs import stage_title

ROOT = Path(__file__).resolve().parents[1]
# Why 120 s: the fork server imports torch and transformers before its first fork (seconds on a
# busy 2-core machine); the exec path shows its title within a second of starting.
TITLE_TIMEOUT_S = 120.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/cmdline")


def cmdline(pid: int) -> str | None:
    """What ``ps -o args`` shows for ``pid`` (setproctitle pads the old argv area with NULs)."""
    try:
        data = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


def wait_for_title(pid: int, want: str, timeout_s: float = TITLE_TIMEOUT_S) -> str | None:
    deadline = time.monotonic() + timeout_s
    seen = cmdline(pid)
    while seen != want and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = cmdline(pid)
    return seen


def test_the_title_names_stage_replica_and_run():
    assert stage_title("reward", 1, "20250101-abc") == "expstream stage reward[1] run=20250101-abc"


@pytest.mark.parametrize("spawn", ["exec", "fork"])
def test_a_stage_process_shows_its_name(tmp_path, spawn):
    run_id = f"title-{spawn}"
    topo = load_topology(None, [f"models.cache_dir={tmp_path / 'models'}"])
    topo_path = tmp_path / "topology.yaml"
    write_resolved_topology(topo, topo_path)
    # Nothing listens on these ports: the stage never gets past its setup, which is all we need.
    argv = stage_argv(topo_path, "reward", 1, f"127.0.0.1:{free_port()}", run_id)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    sup = Supervisor(tmp_path / "logs", spawn=spawn, fork_entry=FORK_ENTRY if spawn == "fork" else None,
                     env={"PYTHONPATH": path, **stage_env(f"redis://127.0.0.1:{free_port()}/0")})
    sup.add("reward", 1, argv)
    sup.start()
    try:
        pid = sup.children[0].proc.pid
        want = "expstream stage reward[1] run=" + run_id
        seen = wait_for_title(pid, want)
        log = (tmp_path / "logs" / "reward-1.log").read_text(errors="replace")[-2000:]
        assert seen == want, f"pid {pid} shows {seen!r}; log:\n{log}"
        # glibc read its malloc settings from this environment when the process (or the fork server
        # it was forked from) started: multi-MB records reuse warm pages (expstream/launch/forkserver.py)
        if spawn == "fork":  # the server's start-up environment (an exec'd stage's is overwritten by its title)
            environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in kv)
        else:
            environ = sup.env
        for key, value in MALLOC_ENV.items():
            assert environ.get(key) == os.environ.get(key, value), (key, environ.get(key))
    finally:
        sup.stop(grace_s=5)


def test_the_trainer_shows_its_name_not_the_fork_servers(tmp_path):
    """The trainer of a continuous run is forked from the fork server too; untitled, it showed the server's
    command line and bench/growth.py took its memory curve (a trainer's, growing) for the server's."""
    from expstream.launch.continuous import TRAINER, trainer_argv

    topo = load_topology(None, [f"models.cache_dir={tmp_path / 'models'}", "train.enabled=true"])
    topo_path = tmp_path / "topology.yaml"
    write_resolved_topology(topo, topo_path)
    argv = trainer_argv(topo_path, f"127.0.0.1:{free_port()}", "title-trainer", tmp_path / "out")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    sup = Supervisor(tmp_path / "logs", spawn="fork", fork_entry=FORK_ENTRY,
                     env={"PYTHONPATH": path, **stage_env(f"redis://127.0.0.1:{free_port()}/0")})
    sup.add(TRAINER, 0, argv, one_shot=True)
    sup.start()
    try:
        pid = sup.children[0].proc.pid
        seen = wait_for_title(pid, "expstream trainer run=title-trainer")
        log = (tmp_path / "logs" / f"{TRAINER}-0.log").read_text(errors="replace")[-2000:]
        assert seen == "expstream trainer run=title-trainer", f"pid {pid} shows {seen!r}; log:\n{log}"
    finally:
        sup.stop(grace_s=5)
