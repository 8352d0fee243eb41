"""Start stage processes from a fork server that has torch and transformers imported already.

Why: a stage process spends ~4 s of CPU importing torch and transformers before it does any
work; eight of them starting at once on two cores took ~14 s of a 27 s demo run. A fork server
(``multiprocessing``'s ``forkserver`` start method with those modules preloaded) imports them
once; every stage process, first start or restart after a crash, is then a fork of it: still
its own OS process with its own pid, log file, session and signals, ready in milliseconds.

Fork safety: the server only *imports* modules; it loads no model and starts no thread pool
(torch's intra-op pool starts at the first parallel op, in the child). ``expstream stage`` run
by hand or by docker-compose does not use this: it is the plain exec path.

The caller names what a forked process runs (``entry``, ``"module:function"``, e.g.
``"expstream.cli:main"``): this module does not import the command line that imports it.

``ForkedProcess`` offers the part of ``subprocess.Popen`` the supervisor uses (``pid``, ``poll``,
``send_signal``, ``kill``, ``wait``, ``returncode``), with the same exit-code convention
(negative = killed by that signal).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from expstream.procs import die_with_parent, prepare_title

# transformers imports model code lazily: name the modules a stage's first from_pretrained touches
# (the Llama family of the built-in tiny models; other architectures import in the child).
PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.tokenization_utils_fast", "transformers.models.llama.modeling_llama",
           "expstream.models", "expstream.numerics", "expstream.state", "expstream.bus", "stages",
           "stages.runner"]
_CONTEXT: multiprocessing.context.BaseContext | None = None


def _context() -> multiprocessing.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def warm_up() -> None:
    """Start the fork server now (it imports PRELOAD in the background of the caller's work)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def _child_main(entry: str, argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """Runs in the forked stage process: own session, output to its log, then ``entry(argv)``."""
    os.setsid()
    die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    prepare_title()  # before the environment is swapped: the stage names itself later (expstream/stage.py)
    os.environ.clear()
    os.environ.update(env)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    module_name, _, func_name = entry.partition(":")
    main = getattr(importlib.import_module(module_name), func_name)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkedProcess:
    """A forked child calling ``entry`` (``"module:function"``) with what ``argv`` passes after
    ``python -m MODULE``: the same work an exec of ``argv`` would do, without the interpreter start."""

    def __init__(self, entry: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        if len(argv) < 3 or argv[1] != "-m" or ":" not in entry:
            raise ValueError(f"fork spawn runs `python -m MODULE ...` commands with a 'module:function' entry, "
                             f"got {argv[:3]} and {entry!r}")
        self._proc = _context().Process(target=_child_main, args=(entry, argv[3:], str(log_path), dict(env)),
                                        daemon=False)
        self._proc.start()
        self.pid: int = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.returncode
