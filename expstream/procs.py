"""Process helpers shared by the supervisor, the fork server and the local servers.

* :func:`set_death_signal` / :func:`die_with_parent`: ``PR_SET_PDEATHSIG``, so a child (a stage,
  the broker, redis-server) dies with the process that started it even when that one is
  SIGKILLed, and no orphan is left holding a port or a consumer-group membership.
* :func:`set_stage_title`: names a stage process in ``ps``/``top`` (``expstream stage
  reward[1] run=<id>``) instead of ``python -B -c from multiprocessing...``, so an operator (and
  a kill test) can find a stage by name.

libc's ``prctl`` is looked up once, at import, in the parent: ``preexec_fn`` runs between fork
and exec, where only async-signal-safe calls belong (a ``dlopen`` there, in a forked child of a
threaded process, can deadlock on the loader lock). The functions below make one plain call.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

__all__ = [
    "PR_SET_PDEATHSIG", "set_death_signal", "die_with_parent", "stage_title", "prepare_title", "set_stage_title",
]

#: From <sys/prctl.h>.
PR_SET_PDEATHSIG = 1


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


def stage_title(name: str, replica: str | int, run_id: str) -> str:
    """``expstream stage reward[1] run=<id>``: what ``ps`` shows for a stage process."""
    return f"expstream stage {name}[{replica}] run={run_id}"


def prepare_title() -> None:
    """Make the title settable later, even after ``os.environ`` is replaced wholesale.

    setproctitle finds the argv memory it overwrites through the C ``environ`` (which lies right
    after it) and only looks on its first call; once ``os.environ.clear()`` has moved ``environ``
    to the heap, the title can no longer be set. A forked child that swaps its environment (the
    fork server's, see expstream/forkserver.py) calls this first.
    """
    from setproctitle import getproctitle

    getproctitle()


def set_stage_title(name: str, replica: str | int, run_id: str) -> None:
    """Set this process's title (``/proc/<pid>/cmdline``, ``ps``, ``top``) to :func:`stage_title`."""
    from setproctitle import setproctitle

    setproctitle(stage_title(name, replica, run_id))
