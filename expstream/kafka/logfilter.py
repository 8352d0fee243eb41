"""A logging filter for kafka-python 3.0.12's close race (docs/kafka-notes.md, "close race").

kafka-python 3.0.12 runs each client's I/O on its own thread, and ``close()`` cancels the client's
tasks from the caller's thread. When the I/O thread is in the middle of one of them, closing its
coroutine raises ``ValueError: generator already executing``, which the library logs at ERROR with a
traceback ("Error closing coroutine for cancelled task"). Nothing is lost: the client is being closed,
every offset we keep was committed before, and ``close()`` then joins the I/O thread. The filter turns
exactly that record into one DEBUG-worthy line, shown only when the ``kafka`` logger is at DEBUG.
"""

from __future__ import annotations

import logging

#: The logger and message kafka-python uses for the record (kafka/net/selector.py, ``Task.close``).
SELECTOR_LOGGER = "kafka.net.selector"
CLOSE_RACE_MESSAGE = "Error closing coroutine for cancelled task"


def is_close_race(record: logging.LogRecord) -> bool:
    """True for kafka-python's "generator already executing" record of a close, and for nothing else."""
    if record.name != SELECTOR_LOGGER or record.msg != CLOSE_RACE_MESSAGE or not record.exc_info:
        return False
    exc = record.exc_info[1]
    return isinstance(exc, ValueError) and "generator already executing" in str(exc)


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
