"""A logging filter for kafka-python 3.0.12's close race (docs/kafka-notes.md, "close race").

kafka-python 3.0.12 runs each client's I/O on its own thread, and ``close()`` cancels the client's
tasks from the caller's thread. When the I/O thread is in the middle of one of them, closing its
coroutine raises ``ValueError: generator already executing``, which the library logs at ERROR with a
traceback ("Error closing coroutine for cancelled task"); if that step then ends the coroutine, the I/O
thread trips over the task taken down under it and logs "Unhandled exception in task" (a ``TypeError``
of the cancelled task). Nothing is lost: the client is being closed, every offset we keep was committed
before, and ``close()`` then joins the I/O thread. The filter turns exactly those two records into one
line, shown only when the ``kafka`` logger is at DEBUG.
"""

from __future__ import annotations

import logging

#: The logger and message kafka-python uses for the record (kafka/net/selector.py, ``Task.close``).
SELECTOR_LOGGER = "kafka.net.selector"
CLOSE_RACE_MESSAGE = "Error closing coroutine for cancelled task"
#: The I/O thread's record of a task that raised (kafka/net/selector.py, ``_poll_once``).
TASK_RAISED_MESSAGE = "Unhandled exception in task %s:"


def is_close_race(record: logging.LogRecord) -> bool:
    """True for the two records of kafka-python's close race, and for nothing else: the closing thread's
    "generator already executing", and the I/O thread's ``TypeError`` from a task already cancelled."""
    if record.name != SELECTOR_LOGGER or not record.exc_info:
        return False
    exc = record.exc_info[1]
    if record.msg == CLOSE_RACE_MESSAGE:
        return isinstance(exc, ValueError) and "generator already executing" in str(exc)
    if record.msg == TASK_RAISED_MESSAGE and isinstance(exc, TypeError) and record.args:
        task = record.args[0] if isinstance(record.args, tuple) else None
        state = getattr(getattr(task, "state", None), "value", None)
        return state == "cancelled" and getattr(task, "is_done", False) is True
    return False


class CloseRaceFilter(logging.Filter):
    """Drops the close race's traceback; keeps a one-line note when ``kafka`` logs at DEBUG.

    Every other record passes unchanged. ``seen`` counts the records it rewrote.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not is_close_race(record):
            return True
        self.seen += 1
        record.msg = ("a client closed while its I/O thread ran one of its tasks (kafka-python 3.0.12's close "
                      "race, harmless: docs/kafka-notes.md)")
        record.args, record.exc_info, record.exc_text = (), None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("kafka").isEnabledFor(logging.DEBUG)


def install_close_race_filter() -> CloseRaceFilter:
    """Attach one :class:`CloseRaceFilter` to kafka-python's selector logger (idempotent); returns it."""
    logger = logging.getLogger(SELECTOR_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, CloseRaceFilter):
            return existing
    installed = CloseRaceFilter()
    logger.addFilter(installed)
    return installed
