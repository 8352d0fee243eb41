"""The Lua scripts of RedisState against their Python reference functions in expstream.rl.moments.

Production updates the running reward/advantage moments and the adaptive KL coefficient inside
Redis (Lua, atomic and once per id); :func:`expstream.rl.moments.moments_merge` and
:func:`expstream.rl.moments.adaptive_kl_update` are the same formulas in Python (MemoryState calls
them). Here both run on the same inputs (a real redis-server, no mock) and must agree to float
tolerance, so the Lua is the formula the docs and the numerics tests describe.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expstream.errors import ConfigError
from expstream.rl import moments as running
from expstream.state import MemoryState, RedisState, State
from tests.tensors import moments_std

pytestmark = pytest.mark.integration

# Each example talks to Redis a few times (~1 ms each); 60 examples keep a test under a few seconds.
SETTINGS = settings(max_examples=60, deadline=None)


KINDS = ["redis", "memory"]


@contextmanager
def fresh_state(kind: str, redis_url: str) -> Iterator[State]:
    """A state under a new run id, so every hypothesis example starts from empty keys."""
    run_id = f"ref{uuid.uuid4().hex[:12]}"
    state = RedisState(redis_url, run_id) if kind == "redis" else MemoryState(run_id)
    try:
        yield state
    finally:
        state.close()


# --- moments merge (Chan et al.) ----------------------------------------------------------------

value = st.one_of(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([0.0, 1.0, -1.0, 1e-12]),
)
batches = st.lists(st.lists(value, min_size=0, max_size=8), min_size=1, max_size=6)


def _assert_moments_equal(lua, count: float, mean: float, m2: float, scale: float) -> None:
    assert lua.count == count
    assert lua.mean == pytest.approx(mean, rel=1e-12, abs=1e-12 * scale)
    # M2 sums squared deviations: its rounding error grows with scale² (numpy and torch sum in
    # different orders), hence the absolute term.
    assert lua.m2 == pytest.approx(m2, rel=1e-9, abs=1e-12 * scale * scale)
    if count >= 1:
        assert lua.std == pytest.approx(moments_std(count, max(m2, 0.0)), rel=1e-6, abs=1e-6 * scale)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(batches)
def test_lua_moments_merge_matches_numerics(redis_url, kind, bats):
    scale = 1.0 + max((abs(v) for b in bats for v in b), default=0.0)
    c, m, m2 = 0.0, 0.0, 0.0
    snapshots = []
    with fresh_state(kind, redis_url) as state:
        for i, bat in enumerate(bats):
            lua = state.merge_reward_moments(f"b{i}", np.asarray(bat, dtype=np.float64), name="ref")
            c, m, m2 = running.moments_merge(c, m, m2, torch.tensor(bat, dtype=torch.float64))
            _assert_moments_equal(lua, c, m, m2, scale)
            snapshots.append((c, m, m2))
        # a redelivered first batch gets the snapshot the Python merge had right after it
        again = state.merge_reward_moments("b0", np.asarray(bats[0], dtype=np.float64), name="ref")
        _assert_moments_equal(again, *snapshots[0], scale)
        assert state.get_moments("ref") == lua


@pytest.mark.parametrize(
    "bats",
    [
        [[1.0, 2.0, 3.0], [10.0]],  # the hand-worked case of test_numerics: (4, 4, 50)
        [[2.5]],  # one value: std inf
        [[], [0.0, 0.0, 0.0]],  # empty first batch, then an all-equal history: std 0
        [[1e6 + 0.5, 1e6 - 0.5] * 4, [1e6] * 3],  # large mean, small spread
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_lua_moments_merge_grid(redis_url, kind, bats):
    c, m, m2 = 0.0, 0.0, 0.0
    with fresh_state(kind, redis_url) as state:
        for i, bat in enumerate(bats):
            lua = state.merge_reward_moments(f"b{i}", np.asarray(bat, dtype=np.float64), name="grid")
            c, m, m2 = running.moments_merge(c, m, m2, torch.tensor(bat, dtype=torch.float64))
            _assert_moments_equal(lua, c, m, m2, 1e6)
    if c == 1:
        assert math.isinf(lua.std)


# --- adaptive KL controller ---------------------------------------------------------------------

kl_steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=10.0, allow_nan=False),  # measured KL
        st.integers(min_value=0, max_value=20000),  # n_steps
    ),
    min_size=1,
    max_size=5,
)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(
    st.floats(min_value=1e-4, max_value=1.0),  # init_kl_coef
    st.floats(min_value=1e-3, max_value=10.0),  # target
    st.integers(min_value=1, max_value=100000),  # horizon
    kl_steps,
)
def test_lua_kl_update_matches_numerics(redis_url, kind, init, target, horizon, steps):
    value = init
    with fresh_state(kind, redis_url) as state:
        for i, (kl, n_steps) in enumerate(steps):
            lua = state.update_kl_adaptive(f"s{i}", kl, target, n_steps, horizon, default=init)
            value = running.adaptive_kl_update(value, kl, target, n_steps, horizon)
            assert lua == pytest.approx(value, rel=1e-12, abs=0.0)
        # a retried report is applied once: the stored value, not a second step
        assert state.update_kl_adaptive("s0", 5.0, target, 1000, horizon) == pytest.approx(
            running.adaptive_kl_update(init, steps[0][0], target, steps[0][1], horizon), rel=1e-12, abs=0.0)
        assert state.kl_coef(init) == pytest.approx(value, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("current", [0.0, 0.005, 0.0079, 0.008, 0.0099, 0.01, 0.0101, 0.012, 0.0121, 0.05])
@pytest.mark.parametrize(("n_steps", "horizon"), [(1, 10000), (1000, 10000), (16, 1), (20000, 10000)])
@pytest.mark.parametrize("kind", KINDS)
def test_lua_kl_update_grid(redis_url, kind, current, n_steps, horizon):
    # target 0.01: the error current/target − 1 crosses both clip edges (±0.2) in this grid
    with fresh_state(kind, redis_url) as state:
        state.kl_coef(0.05)
        lua = state.update_kl_adaptive("s", current, 0.01, n_steps, horizon)
    assert lua == pytest.approx(running.adaptive_kl_update(0.05, current, 0.01, n_steps, horizon), rel=1e-12, abs=0.0)


@pytest.mark.parametrize(("target", "horizon"), [(0.0, 10000), (-1.0, 10000), (0.1, 0)])
@pytest.mark.parametrize("kind", KINDS)
def test_both_refuse_bad_controller_settings(redis_url, kind, target, horizon):
    with pytest.raises(ConfigError):
        running.adaptive_kl_update(0.05, 0.1, target, 10, horizon)
    with fresh_state(kind, redis_url) as state, pytest.raises(ConfigError):
        state.update_kl_adaptive("s", 0.1, target, 10, horizon, default=0.05)
