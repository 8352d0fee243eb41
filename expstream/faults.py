"""Fault injection for crash tests: one plan, read by the stage runner and the trainer.

``EXPSTREAM_FAULT="<process>:<point>:<k>[,...]"`` makes the named process SIGKILL itself at
``<point>`` once it has handled ``k`` records (a stage) or reached step ``k`` (the trainer). The
crash suites (tests/test_crash.py, tests/test_trainer.py) use it; nothing else sets it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FAULT_ENV", "RUNNER_POINTS", "TRAINER_POINTS", "fault_plan"]

FAULT_ENV = "EXPSTREAM_FAULT"
#: Crash points of a stage replica (stages/working.py, stages/commitgroup.py): around its produce and its commit.
RUNNER_POINTS = ("before_produce", "after_produce", "after_commit")
#: Crash points of the trainer (expstream/train/trainer.py), right after each of a step's effects.
TRAINER_POINTS = ("after_publish", "after_checkpoint", "after_announce")


def fault_plan(process: str, points: tuple[str, ...], env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The ``(point, k)`` planned for ``process`` in ``EXPSTREAM_FAULT``, or None.

    Args:
        process: the stage name, or ``"trainer"``.
        points: the crash points this process knows; entries naming another point are ignored.
        env: the environment to read (default ``os.environ``).

    Returns:
        The first matching entry's point and its count ``k`` (1 when omitted).

    Raises:
        ValueError: ``k`` is not an integer.
    """
    spec = (os.environ if env is None else env).get(FAULT_ENV, "")
    for item in filter(None, spec.split(",")):
        name, _, rest = item.partition(":")
        point, _, k = rest.partition(":")
        if name == process and point in points:
            return point, int(k or 1)
    return None
