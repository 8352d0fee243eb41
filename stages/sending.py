"""A stage replica's sends and work retries: what the runner, its dead letters and its commit group share.

:class:`Out` is one record to send (an output or a dead letter). :class:`Sender` retries work on
retriable errors (``ExpstreamError.retriable``: broker or Redis briefly away) with exponential backoff
from ``RETRY_BACKOFF_START_S`` to ``RETRY_BACKOFF_MAX_S``, naming the record and batch in the log;
after ``RETRY_GIVE_UP_S`` the error is raised (the process exits 1 and the supervisor restarts it);
a stop request during a backoff abandons the record (``ShutdownRequested``: it stays uncommitted and
is redelivered). It also sends and confirms records with those retries (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from expstream.errors import ExpstreamError, ShutdownRequested
from expstream.kafka.clients import send_all_and_confirm
from expstream.observe.metrics import StageMetrics
from expstream.retry import Attempt, Policy, retry
from stages.context import StageContext
from stages.slowwatch import SlowWatch

__all__ = ["RETRY_BACKOFF_MAX_S", "RETRY_BACKOFF_START_S", "RETRY_GIVE_UP_S", "SLOW_SEND_WARN_S", "WORK_RETRY",
           "Out", "Sender", "retriable"]

# Why these bounds: a retriable failure (broker or Redis briefly away) is retried with exponential
# backoff up to 10 s between tries, so a stage neither crash-loops nor hammers a recovering service.
RETRY_BACKOFF_START_S = 0.2
RETRY_BACKOFF_MAX_S = 10.0
# Why 5 minutes: after this long a retriable error is treated as a stage failure (exit 1) so the
# supervisor restarts the process and the record is redelivered to a fresh one.
RETRY_GIVE_UP_S = 300.0
WORK_RETRY = Policy(RETRY_BACKOFF_START_S, RETRY_BACKOFF_MAX_S, RETRY_GIVE_UP_S)  # connect, process, send
# Why 5 s: an acknowledgement normally takes milliseconds; after 5 s the operator should hear that the
# broker is slow or away, long before kafka.produce_timeout_s (30 s) turns it into a retry.
SLOW_SEND_WARN_S = 5.0
T = TypeVar("T")


def retriable(exc: BaseException) -> bool:
    """Whether ``exc`` is one of ours that says trying again may succeed."""
    return bool(getattr(exc, "retriable", False)) and isinstance(exc, ExpstreamError)


@dataclasses.dataclass
class Out:
    """One record to send (an output or a dead letter)."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]] | None = None
    samples: int = 0  # samples in an output SampleBatch (0 for a PromptBatch or a letter)
    batch: Any = None  # a letter's decoded batch (the record's, or a split sub-batch), for lost accounting


class Sender:
    """Retried work and confirmed sends of one replica (worker and confirm threads; never the consumer)."""

    def __init__(self, ctx: StageContext, producer: Any, log: logging.Logger, stop: threading.Event,
                 metrics: StageMetrics | None, slow: SlowWatch) -> None:
        """
        Args:
            ctx: the stage's context (its topology's kafka.produce_timeout_s).
            producer: the replica's producer.
            log: the stage's logger.
            stop: set when the replica is asked to stop (a backoff ends, the record is abandoned).
            metrics: the replica's metrics, or None.
            slow: the watch that warns about a broker slow to acknowledge.
        """
        self.ctx, self.producer, self.log, self.stop = ctx, producer, log, stop
        self.metrics, self.slow, self.stage = metrics, slow, ctx.stage.name

    def retry_work(self, fn: Callable[[], T], what: str, step: str,
                   recovered: Callable[[Attempt], None] | None = None) -> T:
        """``fn`` retried on retriable errors.

        Args:
            fn: the work.
            what: ``topic[partition]@offset batch=<id>`` for the log lines.
            step: what ``fn`` does ("process", "sending 3 records", ...); its first word names the metric.
            recovered: called with the last failed attempt when ``fn`` succeeded after retries.
        Returns:
            What ``fn`` returned.
        Raises:
            The error after RETRY_GIVE_UP_S (the supervisor restarts the stage); ShutdownRequested when a
            stop is requested while retrying (the record is abandoned); any non-retriable error at once.
        """
        last: list[Attempt] = []

        def stopping(a: Attempt) -> ShutdownRequested:
            return ShutdownRequested(f"stop requested while retrying {step} ({type(a.exc).__name__}: {a.exc})")

        def give_up(a: Attempt) -> T:
            self.log.error("stage %s %s: %s still failing after %.0fs (%s: %s); giving up so the supervisor "
                           "restarts the stage", self.stage, what, step, a.waited_s, type(a.exc).__name__, a.exc)
            raise a.exc

        def on_retry(a: Attempt) -> None:
            if self.stop.is_set():
                raise stopping(a)
            self.log.warning("stage %s %s: %s failed with retriable %s: %s; retry %d in %.1fs (%.1fs so far)",
                             self.stage, what, step, type(a.exc).__name__, a.exc, a.number, a.delay_s, a.waited_s)
            last[:] = [a]
            if self.metrics is not None:
                self.metrics.retry(step.split(" ", 1)[0])

        def wait(seconds: float) -> None:
            if self.stop.wait(seconds):
                raise stopping(last[0])

        out = retry(fn, policy=WORK_RETRY, retriable=retriable, on_retry=on_retry, on_give_up=give_up, sleep=wait)
        if last and recovered is not None:
            recovered(last[0])
        return out

    def send(self, items: list[Out], what: str) -> None:
        """Send and confirm ``items``, retrying retriable failures.

        Args:
            items: the records.
            what: ``topic[partition]@offset batch=<id>`` for the log lines.
        Raises:
            A non-retriable ProduceError (the broker refuses a record), and what :meth:`retry_work` raises.
        """
        started = time.monotonic()
        timeout_s = self.ctx.topology.kafka.produce_timeout_s

        def send() -> None:
            with self.slow.watch(self.log, "stage %s %s: still waiting for the broker to acknowledge %d records "
                                 "after %.0fs (broker unreachable or paused?); retrying after "
                                 "kafka.produce_timeout_s=%.0fs", self.stage, what, len(items),
                                 SLOW_SEND_WARN_S, timeout_s):
                send_all_and_confirm(self.producer, [(o.topic, o.value, o.key, o.headers) for o in items], timeout_s)

        self.retry_work(send, what, f"sending {len(items)} records", recovered=lambda a: self.log.info(
            "stage %s %s: sent after %d retries (%.1fs); broker reachable again", self.stage, what, a.number,
            time.monotonic() - started))
        if self.metrics is not None:
            self.metrics.send_seconds.observe(time.monotonic() - started)
