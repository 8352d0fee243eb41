"""Run state shared by stage replicas (see :mod:`expstream.state.base` for the contract)."""

from expstream.state.redis_state import *  # noqa: F401,F403
from expstream.state.redis_state import __all__  # noqa: F401
