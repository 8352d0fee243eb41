"""kafka-python 3.0.12's close race: its traceback is dropped, everything else kafka logs is kept."""

from __future__ import annotations

import io
import logging

import pytest
from kafka.net.selector import Task

from expstream.kafka.logfilter import CloseRaceFilter, install_close_race_filter


def _self_closing_task() -> Task:
    """A kafka-python ``Task`` whose step closes the task itself: ``Task.close`` then meets its coroutine on the
    stack, as the closing thread does in the race ("generator already executing", logged by kafka-python)."""
    task: Task | None = None

    def body():  # noqa: ANN202
        task.close()
        yield

    task = Task(body())
    return task


def _step_as_the_io_thread(task: Task) -> None:
    """One step of ``task`` as kafka-python's ``_poll_once`` runs it: what it raises is logged with that
    method's call (kafka/net/selector.py)."""
    try:
        task()
    except BaseException:  # noqa: BLE001 - what _poll_once catches
        logging.getLogger("kafka.net.selector").exception("Unhandled exception in task %s:", task)


def _close_while_executing() -> None:
    """The closing thread's record alone."""
    with pytest.raises(TypeError):  # the task's stack was taken down under it; the record is what matters
        _self_closing_task()()


def _run_a_task_cancelled_under_it() -> None:
    """Both records: the close's, then the I/O thread's ``TypeError`` of the task cancelled under it."""
    _step_as_the_io_thread(_self_closing_task())


@pytest.fixture
def captured():
    """Records of the ``kafka`` loggers as a handler at the root would print them, with the filter installed."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    kafka, selector = logging.getLogger("kafka"), logging.getLogger("kafka.net.selector")
    old_level, old_filters = kafka.level, list(selector.filters)
    kafka.addHandler(handler)
    kafka.setLevel(logging.WARNING)
    for f in old_filters:
        selector.removeFilter(f)
    installed = install_close_race_filter()
    try:
        yield stream, installed
    finally:
        kafka.removeHandler(handler)
        kafka.setLevel(old_level)
        selector.removeFilter(installed)
        for f in old_filters:
            selector.addFilter(f)


def test_without_the_filter_kafka_python_prints_the_race_with_a_traceback():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    selector = logging.getLogger("kafka.net.selector")
    saved = list(selector.filters)
    for f in saved:
        selector.removeFilter(f)
    selector.addHandler(handler)
    try:
        _close_while_executing()
    finally:
        selector.removeHandler(handler)
        for f in saved:
            selector.addFilter(f)
    assert "Traceback" in stream.getvalue() and "generator already executing" in stream.getvalue()


def test_the_close_race_prints_nothing_at_warning(captured):
    stream, installed = captured
    _close_while_executing()
    assert stream.getvalue() == "" and installed.seen == 1


def test_the_io_threads_record_of_the_cancelled_task_prints_nothing_at_warning(captured):
    stream, installed = captured
    _run_a_task_cancelled_under_it()
    assert stream.getvalue() == "" and installed.seen == 2  # the closing side's record, then the I/O thread's


def test_a_task_that_raises_while_not_cancelled_keeps_its_traceback(captured):
    stream, installed = captured

    def body():  # noqa: ANN202
        missing = None
        yield missing[0]

    _step_as_the_io_thread(Task(body()))
    assert "Traceback" in stream.getvalue() and "TypeError" in stream.getvalue() and installed.seen == 0


def test_the_close_race_is_one_line_without_a_traceback_at_debug(captured):
    stream, installed = captured
    logging.getLogger("kafka").setLevel(logging.DEBUG)
    _close_while_executing()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("DEBUG kafka.net.selector") and "close race" in lines[0]
    assert "Traceback" not in stream.getvalue()


@pytest.mark.parametrize("msg, exc", [
    ("Error closing coroutine for cancelled task", RuntimeError("something else")),
    ("Error closing coroutine for cancelled task", ValueError("another value error")),
    ("IO loop crashed (client_id=%s)", ValueError("generator already executing")),
])
def test_other_selector_errors_keep_their_traceback(captured, msg, exc):
    stream, installed = captured
    log = logging.getLogger("kafka.net.selector")
    try:
        raise exc
    except Exception:
        log.exception(msg, "c1") if "%s" in msg else log.exception(msg)
    assert "Traceback" in stream.getvalue() and installed.seen == 0


def test_install_is_idempotent_and_the_cli_installs_it():
    from expstream.cli import setup_logging

    selector = logging.getLogger("kafka.net.selector")
    setup_logging("INFO", stream=io.StringIO())
    first = install_close_race_filter()
    assert install_close_race_filter() is first
    assert sum(isinstance(f, CloseRaceFilter) for f in selector.filters) == 1
