"""Start stage processes from a fork server that has torch and transformers imported already.

Why: importing torch and transformers costs a stage process seconds of CPU before any work, and
many stages starting at once on few cores paid it many times; the fork server imports them once
and every stage (first start or restart) is a fork of it, still its own OS process, ready in
milliseconds. The server imports, and loads the tiny actor once with one thread
(expstream/launch/forkwarm.py); it starts no thread pool, so forking is safe. Nothing outlives
``expstream run``: the server and every forked stage carry ``PDEATHSIG``, and a stage drops the
server's "alive" pipe end. A preload that fails is reported, not fatal to the server.
The numbered lifetimes, the measured start-up cost and the preload rules: docs/ARCHITECTURE.md
"The fork server".
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from expstream.procs import die_with, die_with_parent, prepare_title

# transformers imports model code lazily: name the modules a stage's first from_pretrained touches
# (the Llama family of the built-in tiny models; other architectures import in the child).
PRELOAD = ["expstream.launch.forkserver", "torch", "transformers", "transformers.modeling_utils", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.tokenization_utils_fast", "transformers.models.llama.modeling_llama",
           "expstream.models.hf", "expstream.models.passes", "expstream.rl.numerics", "expstream.state",
           "expstream.kafka.clients", "stages", "stages.runner",
           # what every forked process imports after the fork otherwise (its command line, metrics endpoint, title):
           # private pages in each child (~2-3 MiB apiece), shared when the server has them (bench/README.md item 5)
           "expstream.cli", "expstream.launch.replica", "stages.chain", "expstream.tools.recorder", "prometheus_client",
           "http.server", "wsgiref.simple_server", "setproctitle", "encodings.idna", "expstream.models.tiny"]
#: glibc malloc settings of the fork server and so of every stage process (why: in start()).
#: 32 MiB is the largest mmap threshold glibc accepts on 64-bit; larger values are ignored.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TRIM_THRESHOLD_": str(64 * 1024 * 1024),
              "MALLOC_ARENA_MAX": "2"}
_CONTEXT: multiprocessing.context.BaseContext | None = None
_PRELOADS: list[str] = []  # what the server imports after this module (set with _CONTEXT)
#: Set (to the starting process's pid) only in the environment the fork server starts with.
PARENT_ENV = "EXPSTREAM_FORKSERVER_PARENT"
#: Set (comma-separated module names) only in the environment the fork server starts with: what it preloads.
PRELOAD_ENV = "EXPSTREAM_FORKSERVER_PRELOAD"
#: In the fork server and its children: the server's pid (None elsewhere).
SERVER_PID: int | None = None
#: In the process that started the fork server: when (``time.time()``), for the start-up timeline.
STARTED_AT: float | None = None


class ForkServerError(RuntimeError):
    """The fork server is gone: no stage process can be forked from it."""


def _guard_server() -> None:
    """At import: in the fork server (step 1 of the module docstring), die with the process that started
    it, then preload the modules it was started with."""
    global SERVER_PID
    parent = os.environ.pop(PARENT_ENV, None)
    names = [n for n in os.environ.pop(PRELOAD_ENV, "").split(",") if n]
    if parent is None or parent == str(os.getpid()):
        return
    die_with(int(parent))
    SERVER_PID = os.getpid()
    _preload(names)


def _preload(names: list[str]) -> None:
    """Import ``names`` in the fork server; a module that fails is reported and left out (see the module
    docstring, "Preloading"): the child that needs it imports it again and reports the error itself."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a syntax error in a stage module must not end the server
            print(f"expstream fork server: preloading {name} failed ({type(exc).__name__}: {exc}); a process "
                  "that imports it reports the error in its log", file=sys.stderr, flush=True)


_guard_server()


def _context(extra: tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        # the server preloads the rest itself (_preload, named in PRELOAD_ENV by warm_up); then expstream.launch.forkwarm
        # (one tiny model load, when warm_up named one); expstream.launch.forkfreeze last: gc.freeze() once every
        # import is done (shared pages stay shared)
        ctx.set_forkserver_preload([PRELOAD[0], "expstream.launch.forkwarm", "expstream.launch.forkfreeze"])
        _CONTEXT = ctx
        _PRELOADS.extend(PRELOAD[1:] + list(extra))
    return _CONTEXT


def warm_up(extra: tuple[str, ...] = (), warm_model: str | None = None) -> None:
    """Start the fork server now (it imports PRELOAD, then ``extra``, in the background of the caller's work).

    Call from the main thread: the server dies when the thread that started it ends (PDEATHSIG).
    Idempotent; :class:`ForkedProcess` calls it too. ``extra`` and ``warm_model`` (a causal LM directory the
    server loads once, expstream/launch/forkwarm.py) count only for the first call.
    """
    from multiprocessing import forkserver

    from expstream.launch.forkwarm import WARM_ENV

    global STARTED_AT
    STARTED_AT = STARTED_AT or time.time()
    _context(extra)
    # libgomp reads this once, when the server's torch import loads it, so it is set before the start.
    # Why PASSIVE: a waiting OpenMP thread that spins takes a core the other stage processes need;
    # with run.torch_threads > 1 on a busy machine spinning made 2 threads 2-10x slower than 1
    # (bench/README.md, "Noise"). An explicit OMP_WAIT_POLICY in the environment wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ[PARENT_ENV] = str(os.getpid())
    os.environ[PRELOAD_ENV] = ",".join(_PRELOADS)
    if warm_model:
        os.environ[WARM_ENV] = warm_model
    # glibc reads these when a process starts (the fork server; its children inherit the settings).
    # Why: multi-MB records otherwise get fresh pages and a page fault per 4 KiB each time; the
    # settings and their measured effect: bench/README.md "Issue 15's goals", Settings.
    added = malloc_env()
    os.environ.update(added)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(PARENT_ENV, None)
        os.environ.pop(PRELOAD_ENV, None)
        os.environ.pop(WARM_ENV, None)
        for k in added:
            os.environ.pop(k, None)


def server_context() -> multiprocessing.context.BaseContext:
    """The fork server's multiprocessing context (the server started if it is not yet): its ``Process``
    forks from the server, torch imported already. For work that needs torch only briefly, done apart from
    the process that starts the run (expstream/launch/modelbuild.py)."""
    warm_up()
    return _context()


def warm_up_for(topo: Any) -> None:
    """:func:`warm_up` with the extra preloads a topology needs: vllm when it generates with it (an
    import only, 3-6 s per generate replica saved; its engine is built in the stage); and the built-in tiny
    actor to load once, when the model cache has it and generate.backend is transformers
    (expstream/launch/forkwarm.py)."""
    from expstream.models.cache import is_complete, tiny_root

    tiny = tiny_root(topo.models.cache_dir)
    # not beside vLLM: its in-process engine deadlocks in a child of a process that ran torch multithreaded
    # (docs/vllm.md); the warm-up runs one thread, but the vllm server stays one that only imports
    warm = is_complete(tiny) and topo.generate.backend == "transformers"
    warm_up(("vllm",) if topo.generate.backend == "vllm" else (),
            warm_model=str((tiny / "actor").resolve()) if warm else None)


def malloc_env() -> dict[str, str]:
    """The :data:`MALLOC_ENV` settings the environment does not set itself (explicit values win)."""
    return {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}


def _child_main(entry: str, argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """Runs in the forked stage process: own session, output to its log, then ``entry(argv)``."""
    os.setsid()
    if SERVER_PID is not None:
        die_with(SERVER_PID)  # step 2; exits at once if the server died since the fork
    else:  # pragma: no cover - a server started without warm_up()
        die_with_parent()
    _close_alive_pipe()  # step 3
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    prepare_title()  # before the environment is swapped: the stage names itself later (expstream/launch/replica.py)
    os.environ.clear()
    os.environ.update(env)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    module_name, _, func_name = entry.partition(":")
    main = getattr(importlib.import_module(module_name), func_name)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # step 5: multiprocessing's finalizers of priority >= 0 (named semaphores unlinked, pools terminated), what
    # its own exit handler runs first; not the rest of it, which joins child processes (a stuck one would
    # hold the exit). Then out, without waiting for threads.
    multiprocessing.util._run_finalizers(0)
    os._exit(code)


def _close_alive_pipe() -> None:
    """Step 3 of the module docstring: drop this child's copy of the server's "alive" pipe end.

    A stage never starts processes through the fork server itself, so it has no use for it.
    """
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover - already closed
            pass
        forkserver._forkserver._forkserver_alive_fd = None


class ForkedProcess:
    """A forked child calling ``entry`` (``"module:function"``) with what ``argv`` passes after
    ``python -m MODULE``: the same work an exec of ``argv`` would do, without the interpreter start."""

    def __init__(self, entry: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        if len(argv) < 3 or argv[1] != "-m" or ":" not in entry:
            raise ValueError(f"fork spawn runs `python -m MODULE ...` commands with a 'module:function' entry, "
                             f"got {argv[:3]} and {entry!r}")
        warm_up()
        self._proc = _context().Process(target=_child_main, args=(entry, argv[3:], str(log_path), dict(env)),
                                        daemon=False)
        try:
            self._proc.start()
        except (EOFError, OSError) as exc:  # the server died (killed, out of memory) before it forked
            raise ForkServerError(f"the fork server that starts stage processes is gone ({type(exc).__name__}: "
                                  f"{exc}); its last words, if any, are on this process's stderr. Set run.spawn: "
                                  "exec to start each stage as a fresh interpreter") from exc
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
