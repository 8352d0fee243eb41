"""stages/slowwatch.py: one watchdog thread warns once about a block still running after the deadline."""

from __future__ import annotations

import logging
import threading
import time

from stages.slowwatch import SlowWatch


def test_a_slow_block_is_warned_once_and_a_quick_one_never(caplog):
    log = logging.getLogger("test.slowwatch")
    watch = SlowWatch(0.2)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(50):  # quick blocks: no warning, and no thread per block
            with watch.watch(log, "quick %d", i):
                pass
        threads = threading.active_count()
        with watch.watch(log, "slow block %s still waiting", "b7"):
            time.sleep(0.7)  # more than three deadlines: still one warning
        with watch.watch(log, "after the slow one %d", 1):
            pass
        assert threading.active_count() == threads
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["slow block b7 still waiting"], messages


def test_blocks_on_several_threads_are_each_warned_by_their_own_deadline(caplog):
    log = logging.getLogger("test.slowwatch.threads")
    watch = SlowWatch(0.3)
    with watch.watch(log, "warm"):
        pass  # the watchdog thread now sleeps with no deadline: a new block must wake it

    def block(name: str, seconds: float) -> None:
        with watch.watch(log, "%s slow", name):
            time.sleep(seconds)

    with caplog.at_level(logging.WARNING, logger=log.name):
        wall_start = time.time()
        workers = [threading.Thread(target=block, args=(n, s)) for n, s in (("a", 0.6), ("b", 0.05), ("c", 0.8))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        warned = {r.getMessage(): r.created for r in caplog.records}
    assert set(warned) == {"a slow", "c slow"}, warned
    assert all(t - wall_start >= 0.25 for t in warned.values()), "warned before the deadline"
