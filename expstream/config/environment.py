"""The ``environment:`` topology block: multi-turn episodes (docs/multi_turn.md).

Absent (the default), a run is single-turn and has no environment stage and no ``turns`` topic.
Set, ``generate`` hands every sample it generates to the ``environment`` stage (a stage of its own,
between generate and shard-preprocess, with its own consumer group and replicas), which calls the
environment with the episode so far and sends unfinished episodes back to ``generate`` on the
``turns`` topic, finished ones on to shard-preprocess.

Exactly one of ``fn`` (a Python ``module:function``) and ``url`` (an HTTP environment speaking the
JSON contract of docs/multi_turn.md) is given. Whether ``fn`` imports is checked once the topology
is loaded (expstream/models/resolve.py), like a reward function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from expstream.config.fieldtypes import check_block, check_fields
from expstream.config.redaction import redact_url
from expstream.errors import ConfigError, unknown_key_error

__all__ = ["ENVIRONMENT_STAGE", "EnvironmentConfig", "environment_from_raw"]

#: The stage's name (stages.environment in a topology; `expstream stage environment`).
ENVIRONMENT_STAGE = "environment"


@dataclass
class EnvironmentConfig:
    """``environment:``: what answers the model between turns, and the episode's bounds."""

    fn: str | None = None  # "module:function" called as fn(prompt, label, turns) -> (observation, reward, done)
    url: str | None = None  # http://host:port of an environment speaking POST /step (docs/multi_turn.md)
    # model turns per episode; an episode the environment has not ended after this many is finished
    # with info.truncated = 1 (its last observation is not appended: no model turn would follow it)
    max_turns: int = 4
    # seconds one environment call may take (a Python function: then abandoned; HTTP: per request, retried)
    timeout_s: float = 30.0
    # environment calls in flight per replica (one micro-batch's episodes are answered concurrently)
    max_in_flight: int = 16
    retries: int = 2  # http: attempts after the first (5xx, 429, timeouts, refused connections) before giving up
    turns_topic: str = "turns"  # the topic unfinished episodes go back to generate on

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.url is None):
            raise ConfigError("give exactly one of fn and url" + (" (both are set)" if self.fn else ""),
                              field="environment.fn",
                              fix="environment.fn: 'package.module:function' for a Python environment, or "
                                  "environment.url: http://host:port for an HTTP one (docs/multi_turn.md)")
        if self.fn is not None and (not isinstance(self.fn, str) or ":" not in self.fn):
            raise ConfigError(f"got {self.fn!r}", field="environment.fn", fix="write it as 'package.module:function'")
        if self.url is not None and not (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))):
            raise ConfigError(f"got {redact_url(str(self.url))!r}", field="environment.url",
                              fix="give an http:// or https:// address of an environment server")
        if self.max_turns < 1:
            raise ConfigError(f"got {self.max_turns}", field="environment.max_turns",
                              fix="give 1 or more model turns per episode")
        if not self.timeout_s > 0:
            raise ConfigError(f"got {self.timeout_s}", field="environment.timeout_s",
                              fix="give a positive number of seconds, e.g. 30")
        if self.max_in_flight < 1:
            raise ConfigError(f"got {self.max_in_flight}", field="environment.max_in_flight", fix="give 1 or more")
        if self.retries < 0:
            raise ConfigError(f"got {self.retries}", field="environment.retries", fix="give 0 or more")
        if not self.turns_topic or "/" in self.turns_topic:
            raise ConfigError(f"got {self.turns_topic!r}", field="environment.turns_topic",
                              fix="give a topic name, e.g. turns")


def environment_from_raw(raw: Any) -> EnvironmentConfig | None:
    """The ``environment:`` block (None when absent or null), unknown keys named with the closest one."""
    if raw is None:
        return None
    data = check_block(raw, "environment")
    names = list(EnvironmentConfig.__dataclass_fields__)
    for key in data:
        if key not in names:
            raise unknown_key_error("environment", key, names)
    return EnvironmentConfig(**check_fields(EnvironmentConfig, data, "environment"))
