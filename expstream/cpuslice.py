"""A longer CPU time slice for a stage's compute thread (Linux's EEVDF scheduler, kernel >= 6.12).

A pipeline on a machine with fewer cores than busy stage processes (a laptop, the 2-core CI box) is
time-shared: at the kernel's default slice (~1.4 ms here) the cores switch between model stages every
millisecond or so, and each switch refills the caches with another model's weights. On the 2-core
machine, four copies of the generate stage's work took 1.48 ms of CPU per sample against 1.14 ms for
two, and 1.19 ms with a 30 ms slice (bench/README.md "The compute thread's CPU slice").

``sched_setattr(2)`` with ``sched_runtime`` sets a SCHED_OTHER thread's slice (the kernel clamps it to
0.1-100 ms); threads the thread starts later inherit it. Only the calling thread is changed: a stage
calls this from its compute thread, so the thread that polls Kafka, the client's I/O threads, the
broker and Redis keep the short default and, waking, still pre-empt a long slice. Unprivileged; a
kernel without custom slices (before 6.12, another OS) or a seccomp filter that refuses the call leaves
the default, and :func:`set_thread_slice` says so by its return value.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

__all__ = ["MAX_SLICE_MS", "MIN_SLICE_MS", "is_slice", "set_thread_slice", "thread_slice_ms"]

#: The range the kernel accepts for a custom slice (it clamps to it).
MIN_SLICE_MS = 0.1
MAX_SLICE_MS = 100.0
# struct sched_attr (uapi/linux/sched/types.h): size, policy, flags, nice, priority, runtime, deadline,
# period, util_min, util_max
_ATTR = struct.Struct("IIQiIQQQII")
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275)}  # (setattr, getattr)
_SCHED_OTHER = 0


def is_slice(ms: object) -> bool:
    """Whether ``ms`` is a slice :func:`set_thread_slice` takes: 0 (the kernel's default) or a number of ms
    in ``MIN_SLICE_MS``..``MAX_SLICE_MS`` (not a bool)."""
    return isinstance(ms, (int, float)) and not isinstance(ms, bool) and (ms == 0 or MIN_SLICE_MS <= ms <= MAX_SLICE_MS)


def _syscalls() -> tuple[int, int] | None:
    if not hasattr(os, "sched_getscheduler"):
        return None
    return _SYSCALLS.get(platform.machine())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def thread_slice_ms() -> float | None:
    """The calling thread's slice in ms (the kernel's default where none was asked), None where it cannot be read.

    Returns:
        ``sched_runtime`` of ``sched_getattr(2)`` in ms (the kernel reports its default slice there on
        kernels with custom slices), or None on another OS or architecture or when the call fails.
    """
    calls = _syscalls()
    if calls is None:
        return None
    buf = ctypes.create_string_buffer(_ATTR.size)
    if _libc().syscall(calls[1], 0, buf, _ATTR.size, 0) != 0:
        return None
    return _ATTR.unpack(buf.raw)[5] / 1e6


def set_thread_slice(ms: float) -> bool:
    """Give the calling thread (and the threads it starts afterwards) a CPU slice of ``ms``.

    Args:
        ms: the slice, ``MIN_SLICE_MS``..``MAX_SLICE_MS``; 0 restores the kernel's default.

    Returns:
        True when the kernel took it (read back as set), False where it cannot (no custom slices in this
        kernel, another OS, a refused call): the thread then keeps the default, which is only slower.

    Raises:
        ValueError: ``ms`` outside 0 or ``MIN_SLICE_MS``..``MAX_SLICE_MS``.
    """
    if not is_slice(ms):
        raise ValueError(f"a CPU slice of {ms} ms: give 0 (the kernel's default) or {MIN_SLICE_MS}-{MAX_SLICE_MS} ms")
    calls = _syscalls()
    if calls is None or os.sched_getscheduler(0) != _SCHED_OTHER:
        return False
    runtime = int(ms * 1e6)
    attr = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, _SCHED_OTHER, 0, os.getpriority(os.PRIO_PROCESS, 0),
                                                  0, runtime, 0, 0, 0, 0), _ATTR.size)
    if _libc().syscall(calls[0], 0, attr, 0) != 0:
        return False
    got = thread_slice_ms()
    return got is not None and (runtime == 0 or abs(got - ms) < 1e-6)
