"""The example multi-turn task shipped with expstream: guess a digit, with higher/lower feedback (docs/multi_turn.md).

``environment.fn: expstream.rewards.games:guess_digit`` with a prompt file whose labels are the secret
digits (examples/guess_prompts.jsonl) and ``models.reward_fn: expstream.rewards.games:no_reward`` (the
environment gives every reward). Per model turn:

* the turn's text (special tokens removed) is a guess when it holds a digit; its first digit counts;
* reward = the share of the turn's characters that are digits (dense: a policy learns to answer with
  digits within a few dozen steps), + 1.0 when the guess is right, which ends the episode;
* otherwise the observation is the feedback, "higher" or "lower" (or "Answer with a digit from 0 to 9."
  when the turn held none), and the model takes another turn, up to ``environment.max_turns``.

A pure function of the episode so far, as every environment must be (a redelivered step is asked again).
"""

from __future__ import annotations

import re

__all__ = ["guess_digit", "no_reward"]

_SPECIAL = re.compile(r"<\|[^|]*\|>")


def guess_digit(prompt: str, label: str, turns: list[str]) -> tuple[str | None, float | None, bool]:
    """One step of the guessing game: ``label`` is the secret digit, ``turns[-1]`` the model's last answer."""
    turn = _SPECIAL.sub("", turns[-1])
    digits = [c for c in turn if c in "0123456789"]
    share = len(digits) / len(turn) if turn else 0.0
    if not digits:
        return "Answer with a digit from 0 to 9.", share, False
    if digits[0] == label.strip():
        return None, share + 1.0, True
    return ("higher" if digits[0] < label.strip() else "lower"), share, False


def no_reward(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """0.0 for every sample: the reward function of a run whose environment gives every reward."""
    return [0.0] * len(queries)
