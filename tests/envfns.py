"""Environments for the multi-turn tests (environment.fn: tests.envfns:NAME); each a pure function of the episode."""

from __future__ import annotations

import time


def two_more(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    """Three model turns per episode: observations 'obs 1', 'obs 2'; reward 0.5 per answered turn, 1.0 at the end."""
    k = len(turns)
    if k >= 3:
        return None, 1.0, True
    return f"obs {k}", 0.5, False


def endless(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    """Never done: every episode ends at environment.max_turns, truncated."""
    return "go on", None, False


def fails_on_q1(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    """Raises on the episodes of the prompt labelled 1 at their second turn; the others take two turns."""
    if len(turns) == 2 and label == "1":
        raise RuntimeError("the environment broke on this episode")
    return ("again", None, False) if len(turns) < 2 else (None, 1.0, True)


def slow(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    """Answers after 0.3 s: a SIGKILL lands while episodes are between turns."""
    time.sleep(0.3)
    return ("next", 0.25, False) if len(turns) < 3 else (None, 1.0, True)


def mixed(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    """By label: "done" ends after 3 model turns (0.5 per answered turn, 1.0 at the end); "endless" never
    ends (truncated at max_turns); "fail" raises at the second turn. 0.1 s per call."""
    time.sleep(0.1)
    k = len(turns)
    if label == "fail" and k == 2:
        raise RuntimeError("the environment broke on this episode")
    if label == "done" and k >= 3:
        return None, 1.0, True
    return f"obs {k}", (0.5 if label == "done" else None), False
