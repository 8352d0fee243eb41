"""Rewards: rule reward functions, reward sources, the reward JSON API's client and server.

The rule functions are re-exported here so that ``expstream.rewards:NAME`` (the spelling of
``models.reward_fn`` and of ``kind: fn`` sources in every topology written so far) keeps naming them;
they live in expstream/rewards/functions.py. Importing this package imports nothing heavy.
"""

from expstream.rewards.functions import (
    contains_label,
    reference_in_response,
    response_length,
    target_char_rate,
)

__all__ = ["contains_label", "reference_in_response", "response_length", "target_char_rate"]
