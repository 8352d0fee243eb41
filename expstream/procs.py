"""Process helpers shared by the supervisor, the fork server and the local servers.

* :func:`set_death_signal` / :func:`die_with_parent` / :func:`die_with`: ``PR_SET_PDEATHSIG``, so a
  child (the fork server, a stage, the broker, redis-server) dies with the process that started it
  even when that one is SIGKILLed, and no orphan is left holding a port or a consumer-group
  membership. :func:`die_with` also closes the race where the parent died before the call.
* :func:`watch_parent`: the belt and braces for a stage: a thread that notices the parent is gone
  (re-parented to init or a subreaper, where ``PDEATHSIG`` did not fire or was reset) and stops it.
* :func:`set_stage_title`: names a stage process in ``ps``/``top`` (``expstream stage
  reward[1] run=<id>``) instead of ``python -B -c from multiprocessing...``, so an operator (and
  a kill test) can find a stage by name; :func:`set_role_title` names the trainer the same way
  (``expstream trainer run=<id>``): forked from the fork server, it showed the server's command
  line, and bench/growth.py took its memory curve for the server's.

libc's ``prctl`` is looked up once, at import, in the parent: ``preexec_fn`` runs between fork
and exec, where only async-signal-safe calls belong (a ``dlopen`` there, in a forked child of a
threaded process, can deadlock on the loader lock). The functions below make one plain call.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "EXIT_WITH_PARENT_ENV", "PR_SET_PDEATHSIG", "ORPHAN_EXIT_CODE", "PARENT_CHECK_S", "set_death_signal", "die_with_parent", "die_with",
    "watch_parent", "stage_title", "prepare_title", "set_stage_title", "role_title", "set_role_title",
]

#: Set to "1" by the supervisor for every child: a stage replica, the trainer and the recorder then
#: stop when their parent is gone (expstream/launch/replica.py, train/trainer.py, tools/recorder.py).
EXIT_WITH_PARENT_ENV = "EXPSTREAM_EXIT_WITH_PARENT"
#: From <sys/prctl.h>.
PR_SET_PDEATHSIG = 1
#: Exit code of a process that found its parent gone at start (before doing any work).
ORPHAN_EXIT_CODE = 1
# Why 1 s: how often a stage looks at its parent pid. PDEATHSIG is the real mechanism (immediate);
# this only catches what it cannot (a reset by a setuid exec, a parent that died before the prctl
# of a grandchild), so a second of delay costs nothing and the check (one getppid) is free.
PARENT_CHECK_S = 1.0


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None


_PRCTL = _load_prctl()


def set_death_signal(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent *thread* dies (Linux; else a no-op).

    Async-signal-safe (one call through the pointer resolved at import), so it may run as, or in,
    a ``preexec_fn``. Start children from the main thread or another long-lived one: a
    short-lived starter thread would take them down when it ends.
    """
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent() -> None:
    """``preexec_fn`` for a child that must not outlive its parent: SIGKILL when the parent dies."""
    set_death_signal(signal.SIGKILL)


def die_with(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """``PDEATHSIG`` on this process, then exit at once if ``parent_pid`` is not the parent any more.

    The parent may die between the fork and the prctl; the kernel then never sends the signal, and
    the child would live on re-parented. Checking the parent *after* the prctl closes that window.
    Async-signal-safe (usable in a ``preexec_fn`` via ``functools.partial(die_with, os.getpid())``).
    """
    set_death_signal(sig)
    if os.getppid() != parent_pid:
        os._exit(ORPHAN_EXIT_CODE)


def watch_parent(on_orphan: Callable[[int], None], interval_s: float = PARENT_CHECK_S) -> threading.Thread:
    """Call ``on_orphan(old_parent_pid)`` once, from a daemon thread, when this process's parent changes.

    A process whose parent died is re-parented (to init or a subreaper): ``os.getppid()`` changes.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        on_orphan(parent)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def stage_title(name: str, replica: str | int, run_id: str) -> str:
    """``expstream stage reward[1] run=<id>``: what ``ps`` shows for a stage process."""
    return f"expstream stage {name}[{replica}] run={run_id}"


def prepare_title() -> None:
    """Make the title settable later, even after ``os.environ`` is replaced wholesale.

    setproctitle finds the argv memory it overwrites through the C ``environ`` (which lies right
    after it) and only looks on its first call; once ``os.environ.clear()`` has moved ``environ``
    to the heap, the title can no longer be set. A forked child that swaps its environment (the
    fork server's, see expstream/launch/forkserver.py) calls this first.
    """
    from setproctitle import getproctitle

    getproctitle()


def set_stage_title(name: str, replica: str | int, run_id: str) -> None:
    """Set this process's title (``/proc/<pid>/cmdline``, ``ps``, ``top``) to :func:`stage_title`."""
    from setproctitle import setproctitle

    setproctitle(stage_title(name, replica, run_id))


def role_title(role: str, run_id: str) -> str:
    """``expstream trainer run=<id>``: what ``ps`` shows for a run's process that is not a stage replica."""
    return f"expstream {role} run={run_id}"


def set_role_title(role: str, run_id: str) -> None:
    """Set this process's title to :func:`role_title`."""
    from setproctitle import setproctitle

    setproctitle(role_title(role, run_id))
