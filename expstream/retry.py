"""One retry loop with bounded exponential backoff, for every place that waits out a brief outage.

The stage runner (connecting, processing, sending, committing, polling) and the Redis state all
retry the same way: try; on a retriable error wait ``base``, ``2·base``, ``4·base``... capped at
``cap``; after ``give_up_s`` of failing, stop retrying. What differs between them is only what
counts as retriable, what is logged, how the wait is spent (``Event.wait``, paused polls,
``time.sleep``) and what giving up means (raise, or skip and go on). Those are the arguments of
:func:`retry`; the loop itself, the delays and the give-up rule live here once.

Clock and sleep are arguments so that the loop is tested without a broker, a server or real time
(tests/test_retry.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["Attempt", "Backoff", "Policy", "retry"]


class Backoff:
    """Exponential delays ``base, 2·base, 4·base, ...`` capped at ``cap``; :meth:`reset` starts over.

    Used on its own where the retry is spread over calls (the runner's poll, which returns nothing
    on a failure and is called again by the main loop), and inside :func:`retry` otherwise.
    """

    def __init__(self, base_s: float, cap_s: float) -> None:
        self.base_s, self.cap_s = base_s, cap_s
        self._next = base_s

    def next(self) -> float:
        """The delay to wait now; the one after it is twice as long (at most ``cap_s``)."""
        delay = self._next
        self._next = min(delay * 2, self.cap_s)
        return delay

    def reset(self) -> None:
        self._next = self.base_s


@dataclass(frozen=True)
class Policy:
    """How long to wait between tries and when to stop.

    ``give_up_s`` counts from the first try. With ``clip_to_give_up`` the last wait is shortened so
    that the final try happens right at ``give_up_s`` (a caller with a hard deadline, like the
    Redis state, whose own caller has a retry budget of its own); without it every wait is a full
    backoff step and the give-up is noticed at the first failure after ``give_up_s``.
    """

    base_s: float
    cap_s: float
    give_up_s: float
    clip_to_give_up: bool = False


@dataclass(frozen=True)
class Attempt:
    """One failed try, as the callbacks see it."""

    exc: BaseException
    number: int  # failures so far, this one included (1 on the first failure)
    waited_s: float  # seconds since the first try started
    delay_s: float  # the wait before the next try (0.0 when giving up)


def retry(
    fn: Callable[[], T],
    *,
    policy: Policy,
    retriable: Callable[[BaseException], bool],
    on_retry: Callable[[Attempt], Any] | None = None,
    on_give_up: Callable[[Attempt], T] | None = None,
    stop: Callable[[], bool] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call ``fn`` until it returns, retrying exceptions for which ``retriable(exc)`` is true.

    A non-retriable exception propagates at once, untouched. After a retriable failure:

    * if ``give_up_s`` has passed since the first try, or ``stop()`` says so, ``on_give_up(attempt)``
      decides: its return value is returned (a caller that skips and goes on), or it raises; without
      it the exception is re-raised as it is;
    * otherwise ``on_retry(attempt)`` is called (to log; it may raise to abandon the retry, e.g. on
      a stop request), then ``sleep(delay)`` (which may raise to abandon it too).
    """
    started = clock()
    backoff = Backoff(policy.base_s, policy.cap_s)
    number = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not retriable(exc):
                raise
            number += 1
            waited = clock() - started
            if waited >= policy.give_up_s or (stop is not None and stop()):
                if on_give_up is None:
                    raise
                return on_give_up(Attempt(exc, number, waited, 0.0))
            delay = backoff.next()
            if policy.clip_to_give_up:
                delay = min(delay, policy.give_up_s - waited)
            attempt = Attempt(exc, number, waited, delay)
            if on_retry is not None:
                on_retry(attempt)
            sleep(delay)
