"""Run state shared by stage replicas: one :class:`State` contract, two implementations.

* :class:`RedisState` (``redis_state.py``) — across processes and hosts; atomic Lua scripts
  (``lua.py``) over one retrying connection (``connection.py``).
* :class:`MemoryState` (``memory.py``) — one process, dicts; LocalChain, tests, bench, replay.

``base.py`` holds the contract, :class:`Moments` and the checks both use; the merge and KL
formulas are in :mod:`expstream.rl.moments`.
"""

from expstream.state.base import DEFAULT_GROUP_TTL_S, Moments, State, WindowTaken
from expstream.state.connection import (
    RETRY_BASE_DELAY_S,
    RETRY_DEADLINE_S,
    RETRY_MAX_DELAY_S,
    SOCKET_TIMEOUT_S,
)
from expstream.state.memory import MemoryState
from expstream.state.redis_state import RedisState

__all__ = [
    "State",
    "Moments",
    "WindowTaken",
    "MemoryState",
    "RedisState",
    "DEFAULT_GROUP_TTL_S",
    "RETRY_BASE_DELAY_S",
    "RETRY_MAX_DELAY_S",
    "RETRY_DEADLINE_S",
    "SOCKET_TIMEOUT_S",
]
