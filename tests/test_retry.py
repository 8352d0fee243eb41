"""expstream/retry.py without Kafka or Redis: a fake clock that the fake sleep advances."""

from __future__ import annotations

import pytest

from expstream.retry import Attempt, Backoff, Policy, retry


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky(Exception):
    pass


def failing(n: int, value: str = "ok", exc: type[Exception] = Flaky):
    """A function that raises ``exc`` on its first ``n`` calls, then returns ``value``."""
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= n:
            raise exc(f"failure {len(calls)}")
        return value

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def is_flaky(exc: BaseException) -> bool:
    return isinstance(exc, Flaky)


def test_backoff_doubles_up_to_the_cap_and_resets() -> None:
    b = Backoff(0.2, 1.0)
    assert [b.next() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next() == 0.2


def test_retries_with_exponential_delays_then_returns() -> None:
    t, seen = FakeTime(), []
    fn = failing(5)
    out = retry(fn, policy=Policy(0.2, 1.0, 300.0), retriable=is_flaky, on_retry=seen.append,
                sleep=t.sleep, clock=t.clock)
    assert out == "ok" and len(fn.calls) == 6
    assert t.sleeps == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])
    assert [a.number for a in seen] == [1, 2, 3, 4, 5]
    assert [a.delay_s for a in seen] == t.sleeps
    assert seen[2].waited_s == pytest.approx(0.2 + 0.4)
    assert str(seen[0].exc) == "failure 1"


def test_no_failure_no_sleep() -> None:
    t = FakeTime()
    assert retry(lambda: 7, policy=Policy(1, 2, 3), retriable=is_flaky, sleep=t.sleep, clock=t.clock) == 7
    assert t.sleeps == []


def test_non_retriable_passes_through_untouched_at_once() -> None:
    t, seen = FakeTime(), []
    fn = failing(3, exc=ValueError)
    with pytest.raises(ValueError, match="failure 1"):
        retry(fn, policy=Policy(0.2, 1.0, 300.0), retriable=is_flaky, on_retry=seen.append,
              on_give_up=lambda a: pytest.fail("not a give-up"), sleep=t.sleep, clock=t.clock)
    assert len(fn.calls) == 1 and t.sleeps == [] and seen == []


def test_gives_up_after_give_up_s_reraising_the_error() -> None:
    t = FakeTime()
    fn = failing(10**6)
    with pytest.raises(Flaky):
        retry(fn, policy=Policy(1.0, 4.0, 10.0), retriable=is_flaky, sleep=t.sleep, clock=t.clock)
    # 1 + 2 + 4 + 4 = 11 >= 10 after the fourth wait: the fifth failure gives up (full steps, no clipping)
    assert t.sleeps == [1.0, 2.0, 4.0, 4.0] and len(fn.calls) == 5


def test_give_up_callback_may_return_a_value_or_raise_its_own_error() -> None:
    t, given = FakeTime(), []

    def skip(a: Attempt) -> str:
        given.append(a)
        return "skipped"

    assert retry(failing(10**6), policy=Policy(1.0, 1.0, 3.0), retriable=is_flaky, on_give_up=skip,
                 sleep=t.sleep, clock=t.clock) == "skipped"
    assert given[0].number == 4 and given[0].waited_s == 3.0 and given[0].delay_s == 0.0

    def wrap(a: Attempt) -> str:
        raise RuntimeError(f"gave up after {a.number}") from a.exc

    with pytest.raises(RuntimeError, match="gave up after 4") as ei:
        retry(failing(10**6), policy=Policy(1.0, 1.0, 3.0), retriable=is_flaky, on_give_up=wrap,
              sleep=t.sleep, clock=t.clock)
    assert isinstance(ei.value.__cause__, Flaky)


def test_clip_to_give_up_shortens_the_last_wait() -> None:
    t = FakeTime()
    with pytest.raises(Flaky):
        retry(failing(10**6), policy=Policy(0.05, 2.0, 1.0, clip_to_give_up=True), retriable=is_flaky,
              sleep=t.sleep, clock=t.clock)
    assert t.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.25])
    assert sum(t.sleeps) == pytest.approx(1.0)


def test_stop_gives_up_early_and_on_retry_or_sleep_may_abandon() -> None:
    t = FakeTime()
    stopped = [False]

    def note(a: Attempt) -> None:
        stopped[0] = a.number >= 2

    assert retry(failing(10**6), policy=Policy(1.0, 1.0, 300.0), retriable=is_flaky, on_retry=note,
                 on_give_up=lambda a: a.number, stop=lambda: stopped[0], sleep=t.sleep, clock=t.clock) == 3
    assert t.sleeps == [1.0, 1.0]

    class Abandon(Exception):
        pass

    def interrupted(_s: float) -> None:
        raise Abandon

    with pytest.raises(Abandon):
        retry(failing(10**6), policy=Policy(1.0, 1.0, 300.0), retriable=is_flaky, sleep=interrupted, clock=t.clock)
