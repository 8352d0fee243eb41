"""One run per output directory: an exclusive lock, and no silent reuse of a previous run's files.

Two ``expstream run`` on one ``--output`` used to overwrite each other's ``experiences.msgpack``
and ``summary.json``, and a reused directory made the local redis-server replay the previous run's
appendonly file (its moments, KL state and per-stage stats). :func:`claim_run_dir` stops both:

1. Create the directory (and parents) and open ``DIR/.lock``.
2. Take ``flock(LOCK_EX | LOCK_NB)`` on it. When another process holds it, fail at once:
   ``run directory DIR is in use by pid N`` (ConfigError, exit 2). The lock belongs to the open
   file, so the kernel drops it when the run's process dies, however it dies (no stale locks).
   The descriptor is close-on-exec, so no stage or server inherits it.
3. Write our pid into the lock file (what the message of step 2 reads).
4. Look at what the directory holds besides ``.lock``:
   * nothing: a fresh run;
   * something that does not look like an expstream run directory: refuse, with or without
     ``--force`` (a mistyped ``--output ~`` deletes nothing), and the message does not suggest
     ``--force``, which would be refused too;
   * a previous run, no flag: refuse, naming it (``summary.json from run X``) and suggesting ``--force``;
   * a previous run and ``--force``: delete it and start fresh;
   * ``--resume``: not supported yet (refused with the reason; see README.md, Options).
5. The caller keeps the returned :class:`RunDirLock` for the life of the run and releases it last.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from expstream.errors import ConfigError

__all__ = ["LOCK_NAME", "RunDirLock", "claim_run_dir", "is_locked", "lock_run_dir", "previous_run"]

LOCK_NAME = ".lock"
# What marks a directory as written by `expstream run`: only such a directory is emptied by --force.
_RUN_MARKERS = ("summary.json", "experiences.msgpack", "run")


class RunDirLock:
    """The held lock on one run directory; :meth:`release` (or process exit) drops it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def lock_run_dir(path: Path | str) -> RunDirLock:
    """Steps 1-3: the directory's exclusive lock, or ConfigError naming the pid that holds it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {path} ({exc.strerror or exc})", field="--output",
                          fix="give a directory you can write to") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"pid {holder}" if holder.isdigit() else "another process"
        raise ConfigError(f"run directory {path} is in use by {who}", field="--output",
                          fix="wait for that run to finish, or give another --output") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunDirLock(path, fd)


def is_locked(lock_path: Path | str) -> bool:
    """True when some process holds ``flock`` on ``lock_path`` (a running run's ``DIR/.lock``). Taking a
    shared lock for a moment does not disturb the holder; a missing file is not locked."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def previous_run(path: Path | str) -> str:
    """A short description of what ``path`` holds: ``summary.json from run X`` when it can tell."""
    path = Path(path)
    for name in ("summary.json", "run/services.json"):
        try:
            run_id = json.loads((path / name).read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if run_id:
            return f"{name} from run {run_id}"
    entries = sorted(p.name for p in _entries(path))
    return f"{len(entries)} entries: {', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}"


def _entries(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.name != LOCK_NAME]


def _empty(path: Path) -> None:
    for p in _entries(path):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def claim_run_dir(path: Path | str, *, force: bool = False, resume: bool = False) -> RunDirLock:
    """Steps 1-5: lock ``path`` for this run and make sure it starts empty (or refuse, exit 2)."""
    if force and resume:
        raise ConfigError("--force and --resume contradict each other", field="--force",
                          fix="pass one: --force deletes the previous run, --resume would continue it")
    path = Path(path)
    lock = lock_run_dir(path)
    try:
        if resume:
            raise ConfigError(
                f"--resume: continuing a run is not supported yet ({path} holds {previous_run(path)}); the local "
                "broker keeps its topics in memory, so a stopped run's in-flight records are gone with it",
                field="--resume", fix=f"pass --force to delete {path} and start fresh, or give another --output")
        if not _entries(path):
            return lock
        if not any((path / m).exists() for m in _RUN_MARKERS):  # with or without --force: never deleted
            raise ConfigError(f"{path} is not empty and is not an expstream run directory "
                              f"({previous_run(path)}); --force deletes run directories only", field="--output",
                              fix="give a new or empty directory")
        if not force:
            raise ConfigError(
                f"{path} holds a previous run ({previous_run(path)})", field="--output",
                fix="pass --force to delete it and start fresh, or give another --output "
                    "(--resume, to continue it, is not supported yet)")
        _empty(path)
    except BaseException:
        lock.release()
        raise
    return lock
