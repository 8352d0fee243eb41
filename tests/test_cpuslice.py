"""expstream/cpuslice.py: a thread's CPU slice on this kernel (Linux >= 6.12), and run.cpu_slice_ms's checks."""

from __future__ import annotations

import threading

import pytest

from expstream.config.topology import load_topology
from expstream.cpuslice import set_thread_slice, thread_slice_ms
from expstream.errors import ConfigError

DEFAULT = thread_slice_ms()
needs_custom_slices = pytest.mark.skipif(DEFAULT is None, reason="no sched_getattr here (not Linux x86_64/aarch64)")


def on_thread(fn):  # noqa: ANN001, ANN201 - a callable's result, run on a fresh thread
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@needs_custom_slices
def test_a_slice_is_the_calling_threads_and_its_later_childrens_only() -> None:
    def inside() -> tuple[bool, float | None, float | None]:
        took = set_thread_slice(30)
        return took, thread_slice_ms(), on_thread(thread_slice_ms)

    took, own, child = on_thread(inside)
    assert took and own == 30.0, "the kernel took the slice and reads it back"
    assert child == 30.0, "a thread started afterwards inherits it"
    assert thread_slice_ms() == DEFAULT != 30.0, "the thread that did not ask keeps the kernel's default"
    assert on_thread(thread_slice_ms) == DEFAULT, "and so do the threads it starts"


@needs_custom_slices
def test_zero_gives_the_kernels_default_back_and_the_nice_value_is_kept() -> None:
    import os

    def inside() -> tuple[float | None, float | None, int]:
        os.setpriority(os.PRIO_PROCESS, 0, 5)  # Linux: this thread's nice value
        set_thread_slice(50)
        during = thread_slice_ms()
        set_thread_slice(0)
        return during, thread_slice_ms(), os.getpriority(os.PRIO_PROCESS, 0)

    during, after, nice = on_thread(inside)
    assert (during, after) == (50.0, DEFAULT)
    assert nice == 5, "sched_setattr sets the nice value too: the thread's own is passed, not 0"


@pytest.mark.parametrize("ms", [0.05, 100.5, -1])
def test_a_slice_outside_the_kernels_range_is_a_value_error(ms: float) -> None:
    with pytest.raises(ValueError, match=r"give 0 \(the kernel's default\) or 0.1-100.0 ms"):
        set_thread_slice(ms)


@pytest.mark.parametrize(("value", "says"), [("0.05", "got 0.05; give 0"), ("250", "got 250.0; give 0"),
                                             ("true", "expected a number")])
def test_run_cpu_slice_ms_is_checked_when_the_topology_loads(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match="run.cpu_slice_ms") as err:
        load_topology(overrides=[f"run.cpu_slice_ms={value}"])
    assert says in str(err.value)
    assert load_topology(overrides=["run.cpu_slice_ms=0"]).run.cpu_slice_ms == 0
    assert load_topology().run.cpu_slice_ms == 30.0
