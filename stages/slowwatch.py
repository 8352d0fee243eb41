"""One watchdog thread per stage replica that warns about a block still running after a deadline.

The runner wraps every confirmed send and every synchronous commit in :meth:`SlowWatch.watch`: a
broker that stops answering shows up in the log after :data:`stages.sending.SLOW_SEND_WARN_S`
instead of as silence. This used to be a ``threading.Timer`` per block, i.e. two thread starts per
record on the hot path (~0.1 ms of CPU each in a profile); one long-lived thread that sleeps until
the earliest deadline costs nothing while the broker answers in time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any


class SlowWatch:
    """Warn once per :meth:`watch` block still running ``after_s`` seconds after it began."""

    def __init__(self, after_s: float, name: str = "slow-watch") -> None:
        self.after_s = after_s
        self.name = name
        self._cond = threading.Condition()
        self._blocks: dict[int, tuple[float, logging.Logger, str, tuple[Any, ...]]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, log: logging.Logger, message: str, *args: Any) -> Iterator[None]:
        """Log ``message % args`` as a warning once if the block is still running after ``after_s``."""
        key = next(self._ids)
        with self._cond:
            self._blocks[key] = (time.monotonic() + self.after_s, log, message, args)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            elif len(self._blocks) == 1:
                self._cond.notify()  # the thread sleeps without a deadline: give it this one
        try:
            yield
        finally:
            with self._cond:
                self._blocks.pop(key, None)

    def _loop(self) -> None:
        while True:
            due: list[tuple[logging.Logger, str, tuple[Any, ...]]] = []
            with self._cond:
                now = time.monotonic()
                for key, (deadline, log, message, args) in list(self._blocks.items()):
                    if deadline <= now:
                        due.append((log, message, args))
                        del self._blocks[key]  # once per block; its exit finds nothing to remove
                if not due:
                    nearest = min((d for d, *_ in self._blocks.values()), default=None)
                    self._cond.wait(None if nearest is None else max(0.0, nearest - now))
            for log, message, args in due:  # outside the lock: a slow log handler holds no block up
                log.warning(message, *args)
