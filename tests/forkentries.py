"""Entry points for processes forked from the fork server in tests (``"forkentries:NAME"``)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

#: What the process keeps until it exits, as tqdm keeps its lock in a class attribute.
KEPT: list[object] = []


def make_named_lock(argv: list[str]) -> int:
    """What tqdm does in the trainer (``save_pretrained``'s progress bar): a multiprocessing lock, a named
    POSIX semaphore, kept for the life of the process; its name is written to ``argv[0]``. Returns 0."""
    lock = multiprocessing.RLock()
    KEPT.append(lock)
    Path(argv[0]).write_text(lock._semlock.name)
    return 0
