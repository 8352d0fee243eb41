"""Redis window buffers: gather micro-batches until a window holds ``size`` samples, then take it.

The streaming form of the seed's cross-batch advantage normalisation (§7.2), which normalises
over a whole rollout batch. A micro-batch joins the window that is open when it first arrives;
the call that brings the window to ``size`` samples closes it and gets every member back, once.
A redelivery of the closing micro-batch gets the same members again (same ids, so readers
dedupe); a redelivery of any other member gets nothing. All of it is one Lua script, so two
advantage replicas never split or double a window.

The last window of a finite run never fills: :func:`flush_window` closes it on demand
(``expstream run`` calls it once every other sample has come out).
"""

from __future__ import annotations

from expstream.state import RedisState

_PARK_WINDOW = """
-- KEYS[1] window-of hash (batch_id -> k), KEYS[2] current window counter
-- ARGV batch_id, payload, n_samples, size, ttl
local k = redis.call('HGET', KEYS[1], ARGV[1])
local prefix = string.sub(KEYS[2], 1, -4)  -- strip 'cur'
if k then
  local closer = redis.call('HGET', prefix .. k .. ':meta', 'closer')
  if closer == ARGV[1] then
    return {1, k, unpack(redis.call('HVALS', prefix .. k .. ':members'))}
  end
  return {0, k}
end
k = redis.call('GET', KEYS[2]) or '0'
local members = prefix .. k .. ':members'
local meta = prefix .. k .. ':meta'
redis.call('HSET', members, ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], k)
local have = redis.call('HINCRBY', meta, 'samples', tonumber(ARGV[3]))
local ttl = tonumber(ARGV[5])
if ttl > 0 then
  redis.call('EXPIRE', members, ttl)
  redis.call('EXPIRE', meta, ttl)
  redis.call('EXPIRE', KEYS[1], ttl)
end
if have >= tonumber(ARGV[4]) then
  redis.call('HSET', meta, 'closer', ARGV[1])
  redis.call('SET', KEYS[2], tostring(tonumber(k) + 1))
  return {1, k, unpack(redis.call('HVALS', members))}
end
return {0, k}
"""

_FLUSH_WINDOW = """
-- KEYS[1] current window counter; ARGV closer id
local prefix = string.sub(KEYS[1], 1, -4)
local k = redis.call('GET', KEYS[1]) or '0'
local meta = prefix .. k .. ':meta'
local have = tonumber(redis.call('HGET', meta, 'samples') or '0')
if have == 0 then return {0, k} end
redis.call('HSET', meta, 'closer', ARGV[1])
redis.call('SET', KEYS[1], tostring(tonumber(k) + 1))
return {1, k, unpack(redis.call('HVALS', prefix .. k .. ':members'))}
"""


def _keys(state: RedisState, name: str) -> tuple[str, str]:
    return state.key("window", name, "of"), state.key("window", name, "cur")


def park_window(state: RedisState, name: str, batch_id: str, payload: bytes, n_samples: int,
                size: int) -> tuple[str, list[bytes]] | None:
    """Add one micro-batch; returns ``(window_id, members)`` when this call closed the window."""
    script = state.client.register_script(_PARK_WINDOW)
    res = state._call("park_window", script, keys=list(_keys(state, name)),
                      args=[batch_id, payload, str(n_samples), str(size), str(state.group_ttl_s)])
    if int(res[0]) == 0:
        return None
    return _window_id(res[1]), [bytes(p) for p in res[2:]]


def flush_window(state: RedisState, name: str) -> tuple[str, list[bytes]] | None:
    """Close the open window whatever its size; None when it is empty."""
    script = state.client.register_script(_FLUSH_WINDOW)
    res = state._call("flush_window", script, keys=[_keys(state, name)[1]], args=["flush"])
    if int(res[0]) == 0:
        return None
    return _window_id(res[1]), [bytes(p) for p in res[2:]]


def pending_samples(state: RedisState, name: str) -> int:
    """Samples parked in the open window."""
    cur = state.client.get(_keys(state, name)[1]) or b"0"
    have = state.client.hget(state.key("window", name) + f":{cur.decode()}:meta", "samples")
    return int(have or 0)


def _window_id(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
