"""The environment of bench/multi_turn.py (``environment.fn: bench.multi_turn_env:answer``; no other imports,
so a stage process imports it from the repository root): it answers after EXPSTREAM_BENCH_ENV_S seconds
(default 0.2) and ends every episode after three model turns."""

from __future__ import annotations

import os
import time


def answer(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    time.sleep(float(os.environ.get("EXPSTREAM_BENCH_ENV_S", "0.2")))
    return (None, 1.0, True) if len(turns) >= 3 else ("go on", None, False)
