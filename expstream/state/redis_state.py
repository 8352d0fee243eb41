"""RedisState: the :class:`~expstream.state.base.State` contract on Redis, shared by every replica.

Every key of a run lives under ``expstream:{<run_id>}:``. The braces are a Redis Cluster hash tag:
all keys of a run hash to one slot, so the multi-key Lua scripts below also run on a cluster.

Rules that make Kafka's at-least-once delivery exactly-once in effect:

* every multi-step update is ONE Lua script, so it is atomic across replicas;
* every update carries an id (a ``batch_id``, a ``step_id``) and is applied once per id; the set
  of applied ids is kept in Redis next to the data, inside the same script. A redelivered batch
  gets the same answer as the first delivery (the stored post-update snapshot).

Connection errors and timeouts are retried with bounded exponential backoff (a Redis restart or
failover); after :data:`RETRY_DEADLINE_S` a retriable :class:`StateUnavailableError` is raised and
the stage runner backs off at its level. Retrying a script is safe because scripts are idempotent
by id; plain setters (``set_kl_coef``, ``heartbeat``) are idempotent by nature; ``incr_counter``
without ``once_id`` may count twice when a reply is lost.

Keys (``P`` = prefix):

==============================  ======  =================================================
``P moments:<name>``            hash    count, mean, m2 (``%.17g`` strings: exact doubles)
``P moments:<name>:applied``    hash    batch_id -> post-merge snapshot "count mean m2"
``P group:<group_id>``          hash    sample_index -> payload bytes (TTL ``group_ttl_s``; freed when settled)
``P group:<group_id>:meta``     hash    n, completer, c<i> per committed member, settled (TTL, freed alike)
``P groups:done``               zset    settled (freed) group id -> unix ms freed; kept ``dedupe_window_s``
``P kl_coef``                   string  current KL coefficient
``P kl_coef:applied``           hash    step_id -> coefficient after that step
``P stage:<stage>``             hash    batches, samples, seconds
``P stage:<stage>:applied:<w>`` set     batch ids counted for this stage in window w (TTL two windows)
``P stages``                    set     stage names seen
``P heartbeats``                hash    "<stage>/<replica>" -> unix time
``P policy_version``            string  int, never decreases
``P once:<namespace>``          set     ids seen by mark_once
``P counters``                  hash    name -> float
``P counters:<name>:applied:<w>`` set   once_ids applied to that counter in window w (TTL two windows)
``P flow:<stage>``              hash    in, out, dead, dropped (sample accounting)
``P flow:<stage>:applied:<w>``  set     batch ids accounted in window w (TTL two windows)
``P window:<name>:of``          hash    batch_id -> window number k it joined
``P window:<name>:cur``         string  the open window's k
``P window:<name>:<k>:members`` hash    batch_id -> payload bytes (TTL ``group_ttl_s``)
``P window:<name>:<k>:meta``    hash    samples, closer (TTL ``group_ttl_s``)
``P admission:of``              hash    admitted batch_id -> "version samples", + " d" once delivered
``P admission:lost_of``         hash    lost batch_id -> "version samples"
``P admission:admitted``        hash    version -> samples admitted under it
``P admission:lost``            hash    version -> samples lost of it
``P admission:totals``          hash    admitted, lost (sums over versions, for the O(1) check)
``P rewind:<stage>``            string  the pending rewind request id (TTL, refreshed by the tool)
``P rewind:<stage>:acks``       hash    replica -> request id it acknowledged (TTL)
==============================  ======  =================================================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from expstream.config.redaction import redact_url
from expstream.errors import AuthError, ConfigError, PoisonRecordError, StateUnavailableError
from expstream.retry import Attempt, Policy, retry
from expstream.rl.moments import batch_moments, check_kl_update
from expstream.state.base import (
    DEFAULT_DEDUPE_WINDOW_S,
    DEFAULT_GROUP_TTL_S,
    RECENT_BATCHES,
    Moments,
    WindowTaken,
    check_admission,
    check_group_members,
    check_settle,
    kl_not_initialised,
    parse_recent,
)

__all__ = [
    "RedisState",
    "Moments",
    "RETRY_BASE_DELAY_S",
    "RETRY_MAX_DELAY_S",
    "RETRY_DEADLINE_S",
    "DEFAULT_GROUP_TTL_S",
]

log = logging.getLogger("expstream.state")

T = TypeVar("T")

# --- timing knobs ----------------------------------------------------------------------------
# Why 50 ms: a local redis-server restarts in ~20-100 ms; the first retry should usually succeed.
RETRY_BASE_DELAY_S = 0.05
# Why 2 s: the backoff doubles per attempt but is capped, so a Redis that comes back after a
# failover (seconds) is found again within ~2 s instead of after an ever-growing sleep.
RETRY_MAX_DELAY_S = 2.0
# Why 30 s: rides through a restart or a Sentinel/cluster failover; longer is an outage, better
# reported (StateUnavailableError, retriable) to the stage runner, which backs off and whose
# supervisor restarts it, than hidden inside one call while the Kafka group evicts the consumer
# (max_poll_interval_ms is 60 s).
RETRY_DEADLINE_S = 30.0
# Why 5 s: a command on a healthy Redis takes well under a millisecond; 5 s only trips on a hung
# server (or a 64 MiB group payload on a slow link).
SOCKET_TIMEOUT_S = 5.0


# --- Lua scripts ------------------------------------------------------------------------------
# Numbers cross the Lua boundary as strings: Lua numbers are doubles, ``tonumber`` of a Python
# ``repr`` is exact, and ``%.17g`` prints a double that parses back to the same double. (A Lua
# number returned to Redis as a reply would be truncated to an integer.)

_MERGE_MOMENTS = """
-- KEYS[1] moments hash, KEYS[2] applied hash; ARGV batch_id, k, mean_b, m2_b
local snap = redis.call('HGET', KEYS[2], ARGV[1])
if snap then return {0, snap} end
local vals = redis.call('HMGET', KEYS[1], 'count', 'mean', 'm2')
local n = tonumber(vals[1] or '0')
local mean = tonumber(vals[2] or '0')
local m2 = tonumber(vals[3] or '0')
local k = tonumber(ARGV[2])
local mb = tonumber(ARGV[3])
local m2b = tonumber(ARGV[4])
if k > 0 then
  local tot = n + k
  local delta = mb - mean
  mean = mean + delta * k / tot
  m2 = m2 + m2b + delta * delta * n * k / tot
  n = tot
end
local sn = string.format('%d', n)
local smean = string.format('%.17g', mean)
local sm2 = string.format('%.17g', m2)
redis.call('HSET', KEYS[1], 'count', sn, 'mean', smean, 'm2', sm2)
snap = sn .. ' ' .. smean .. ' ' .. sm2
redis.call('HSET', KEYS[2], ARGV[1], snap)
return {1, snap}
"""

_PARK_GROUP = """
-- KEYS[1] members hash, KEYS[2] meta hash, KEYS[3] done zset
-- ARGV n, batch_id, ttl, group_id, now_ms, done_ttl_ms, idx1, payload1, idx2, ...
local freed = redis.call('ZSCORE', KEYS[3], ARGV[4])
if freed and tonumber(freed) >= tonumber(ARGV[5]) - tonumber(ARGV[6]) then return {2} end
local n = tonumber(ARGV[1])
local stored_n = redis.call('HGET', KEYS[2], 'n')
if stored_n then
  if tonumber(stored_n) ~= n then
    return redis.error_reply('GROUPSIZE group already parked with n=' .. stored_n .. ', got n=' .. ARGV[1])
  end
else
  redis.call('HSET', KEYS[2], 'n', ARGV[1])
end
for i = 7, #ARGV, 2 do
  redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
end
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
if redis.call('HLEN', KEYS[1]) < n then return {0} end
local completer = redis.call('HGET', KEYS[2], 'completer')
if not completer then
  redis.call('HSET', KEYS[2], 'completer', ARGV[2])
  completer = ARGV[2]
end
if completer ~= ARGV[2] then return {0} end
local out = {1}
for idx = 0, n - 1 do
  out[#out + 1] = redis.call('HGET', KEYS[1], tostring(idx))
end
return out
"""

_SETTLE_GROUPS = """
-- A record of the advantage stage is committed: mark its members committed; free every group whose
-- completing record and every member's record are committed, leaving a "done" marker.
-- KEYS[1] done zset, then per group its members hash and meta hash
-- ARGV batch_id (the record's, no '~' suffix), now_ms, done_ttl_ms, group_ttl_s,
--      then per group: group_id, m, m sample indices
local now = tonumber(ARGV[2])
local freed = {}
local a, k = 5, 2
while a <= #ARGV do
  local gid, m = ARGV[a], tonumber(ARGV[a + 1])
  local members, meta = KEYS[k], KEYS[k + 1]
  local n = tonumber(redis.call('HGET', meta, 'n') or '0')
  if n > 0 then
    for i = 1, m do
      local idx = tonumber(ARGV[a + 1 + i])
      if idx < n then redis.call('HSET', meta, 'c' .. idx, '1') end
    end
    local completer = redis.call('HGET', meta, 'completer')
    if completer then
      local cut = string.find(completer, '~', 1, true)
      if cut then completer = string.sub(completer, 1, cut - 1) end
      if completer == ARGV[1] then redis.call('HSET', meta, 'settled', '1') end
      if redis.call('HEXISTS', meta, 'settled') == 1 then
        local marked = 0
        for idx = 0, n - 1 do marked = marked + redis.call('HEXISTS', meta, 'c' .. idx) end
        if marked == n then
          redis.call('DEL', members, meta)
          redis.call('ZADD', KEYS[1], now, gid)
          freed[#freed + 1] = gid
        end
      end
    end
  end
  a = a + 2 + m
  k = k + 2
end
if #freed > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. tostring(now - tonumber(ARGV[3])))
  local ttl = tonumber(ARGV[4])
  if ttl > 0 then redis.call('EXPIRE', KEYS[1], math.max(ttl, math.ceil(tonumber(ARGV[3]) / 1000))) end
end
return freed
"""

_KL_INIT = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
"""

_KL_ADAPTIVE = """
-- KEYS[1] kl_coef, KEYS[2] applied hash; ARGV step_id, current, target, n_steps, horizon, default
local done = redis.call('HGET', KEYS[2], ARGV[1])
if done then return done end
local v = redis.call('GET', KEYS[1])
if not v then
  if ARGV[6] == '' then return redis.error_reply('NOKL kl_coef not initialised') end
  v = ARGV[6]
end
local value = tonumber(v)
local e = tonumber(ARGV[2]) / tonumber(ARGV[3]) - 1
if e < -0.2 then e = -0.2 elseif e > 0.2 then e = 0.2 end
local mult = 1 + e * tonumber(ARGV[4]) / tonumber(ARGV[5])
value = value * mult
local s = string.format('%.17g', value)
redis.call('SET', KEYS[1], s)
redis.call('HSET', KEYS[2], ARGV[1], s)
return s
"""

# The ids of statistics already counted live in windows of ``dedupe_window_s`` seconds: a set per window
# (``...:applied:<w>``, w = unix time // window), the current one written, it and the previous one
# read, each expiring two windows after it opens. So an id is known for at least one window (a
# redelivery, a rewind within it counts nothing twice) and the sets stop growing (issue 21 item 6).

_STAGE_TIME = """
-- KEYS[1] stage hash, KEYS[2] applied set (this window), KEYS[3] stages set, KEYS[4] recent list,
-- KEYS[5] applied set (the previous window)
-- ARGV batch_id, seconds, samples, stage, recent entry, recent max, applied ttl
if redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 or redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[2], ARGV[7])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'batches', 1)
redis.call('HINCRBY', KEYS[1], 'samples', ARGV[3])
redis.call('HINCRBYFLOAT', KEYS[1], 'seconds', ARGV[2])
redis.call('LPUSH', KEYS[4], ARGV[5])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[6]) - 1)
return 1
"""

_FLOW = """
-- KEYS[1] flow hash, KEYS[2] applied set (this window), KEYS[3] applied set (the previous window),
-- KEYS[4] flow-stages set; ARGV batch_id, applied ttl, stage, then (field, count) pairs. The
-- flow-stages set lists every stage with an accounting, timed batches or not (one whose every record
-- was dead-lettered has no stage time, and is still counted).
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 or redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
for i = 4, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

_RECORD_BATCH = """
-- One record's stage time (when ARGV[2] == '1') and sample accounting: _STAGE_TIME and _FLOW in one
-- script, so the runner's per-record statistics are one EVALSHA (a pipeline of two scripts made
-- redis-py send SCRIPT EXISTS first: two round trips).
-- KEYS[1] flow hash, KEYS[2] flow applied set (this window), KEYS[3] flow applied set (previous window),
-- KEYS[4] flow-stages set, then with a time: KEYS[5] stage hash, KEYS[6] stage applied set (this
-- window), KEYS[7] stages set, KEYS[8] recent list, KEYS[9] stage applied set (previous window)
-- ARGV batch_id, has_time, seconds, samples, stage, recent entry, recent max, applied ttl,
--      then (field, count) pairs
if ARGV[2] == '1' and redis.call('SISMEMBER', KEYS[9], ARGV[1]) == 0
    and redis.call('SADD', KEYS[6], ARGV[1]) == 1 then
  redis.call('EXPIRE', KEYS[6], ARGV[8])
  redis.call('SADD', KEYS[7], ARGV[5])
  redis.call('HINCRBY', KEYS[5], 'batches', 1)
  redis.call('HINCRBY', KEYS[5], 'samples', ARGV[4])
  redis.call('HINCRBYFLOAT', KEYS[5], 'seconds', ARGV[3])
  redis.call('LPUSH', KEYS[8], ARGV[6])
  redis.call('LTRIM', KEYS[8], 0, tonumber(ARGV[7]) - 1)
end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 or redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('SADD', KEYS[4], ARGV[5])
for i = 9, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

_POLICY_VERSION = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local v = tonumber(ARGV[1])
if v > cur then redis.call('SET', KEYS[1], ARGV[1]); return ARGV[1] end
return tostring(cur)
"""

_INCR_COUNTER = """
-- KEYS[1] counters hash, KEYS[2] applied set (this window), KEYS[3] applied set (the previous window)
-- ARGV name, by, once_id ('' = always), applied ttl
if ARGV[3] ~= '' then
  if redis.call('SISMEMBER', KEYS[3], ARGV[3]) == 1 or redis.call('SADD', KEYS[2], ARGV[3]) == 0 then
    return redis.call('HGET', KEYS[1], ARGV[1]) or '0'
  end
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return redis.call('HINCRBYFLOAT', KEYS[1], ARGV[1], ARGV[2])
"""


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

_ADMIT = """
-- KEYS[1] admission:of, KEYS[2] admission:admitted, KEYS[3] admission:totals
-- ARGV batch_id, samples, version, bound
local prev = redis.call('HGET', KEYS[1], ARGV[1])
if prev then
  local pv, pn, delivered = string.match(prev, '^(%d+) (%d+)( ?d?)$')
  if delivered == ' d' then return 1 end  -- read again after its commit (a rewind): counted once already
  if tonumber(ARGV[3]) < tonumber(pv) then return 0 end
  if pv ~= ARGV[3] then
    redis.call('HINCRBY', KEYS[2], pv, -tonumber(pn))
    redis.call('HINCRBY', KEYS[2], ARGV[3], pn)
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ' ' .. pn)
  end
  return 1
end
local t = redis.call('HMGET', KEYS[3], 'admitted', 'lost')
local outstanding = tonumber(t[1] or '0') - tonumber(t[2] or '0')
if outstanding + tonumber(ARGV[2]) > tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ' ' .. ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[3], ARGV[2])
redis.call('HINCRBY', KEYS[3], 'admitted', ARGV[2])
return 1
"""

_MARK_DELIVERED = """
-- KEYS[1] admission:of; ARGV batch ids whose generate record is committed. Returns how many were new.
local new = 0
for i = 1, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v and string.sub(v, -2) ~= ' d' then
    redis.call('HSET', KEYS[1], ARGV[i], v .. ' d')
    new = new + 1
  end
end
return new
"""

_RECORD_LOST = """
-- KEYS[1] admission:lost_of, KEYS[2] admission:lost, KEYS[3] admission:totals; ARGV batch_id, version, samples
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'lost', ARGV[3])
return 1
"""


class RedisState:
    """Run-scoped state in Redis, shared by every replica of every stage.

    ``RedisState(url, run_id)`` connects (and pings) at once; :class:`StateUnavailableError` when
    Redis does not answer within the retry budget. Thread-safe (redis-py connection pool).
    """

    def __init__(
        self,
        url: str,
        run_id: str,
        *,
        connect_timeout_s: float = 5.0,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        retry_deadline_s: float = RETRY_DEADLINE_S,
        group_ttl_s: int = DEFAULT_GROUP_TTL_S,
        dedupe_window_s: int = DEFAULT_DEDUPE_WINDOW_S,
    ) -> None:
        if not run_id or any(c in run_id for c in "{}") or any(c.isspace() for c in run_id):
            raise ConfigError(
                f"bad run_id {run_id!r}",
                field="run_id",
                fix="use a non-empty id without braces or whitespace",
            )
        self.url = url
        self.run_id = run_id
        self.shared = True  # every replica of every stage reads and writes these keys
        self.prefix = f"expstream:{{{run_id}}}:"
        self.retry_deadline_s = float(retry_deadline_s)
        self.group_ttl_s = int(group_ttl_s)
        self.dedupe_window_s = int(dedupe_window_s)
        # redis-py's own retry is switched off: this class owns the policy (see _call).
        self._r = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
            health_check_interval=0,
        )
        self._scripts = {
            name: self._r.register_script(src)
            for name, src in (
                ("merge", _MERGE_MOMENTS),
                ("park", _PARK_GROUP),
                ("kl_init", _KL_INIT),
                ("kl_adaptive", _KL_ADAPTIVE),
                ("stage_time", _STAGE_TIME),
                ("flow", _FLOW),
                ("record_batch", _RECORD_BATCH),
                ("policy", _POLICY_VERSION),
                ("incr", _INCR_COUNTER),
                ("park_window", _PARK_WINDOW),
                ("flush_window", _FLUSH_WINDOW),
                ("admit", _ADMIT),
                ("mark_delivered", _MARK_DELIVERED),
                ("settle", _SETTLE_GROUPS),
                ("record_lost", _RECORD_LOST),
            )
        }
        self._call("ping", self._r.ping)

    # --- plumbing ------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        """The full Redis key for ``parts`` joined by ':' under this run's prefix."""
        return self.prefix + ":".join(parts)

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (bytes replies, no retries of its own)."""
        return self._r

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> RedisState:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run ``fn`` retrying connection errors/timeouts with bounded exponential backoff."""

        def give_up(a: Attempt) -> T:
            raise StateUnavailableError(f"Redis at {redact_url(self.url)} unavailable for {what} after {a.number} attempts "
                                        f"({self.retry_deadline_s:.1f}s): {a.exc!r}") from a.exc

        transient = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)
        try:
            return retry(lambda: fn(*args, **kwargs),
                         # redis-py's AuthenticationError is a ConnectionError: a wrong password is not an outage
                         retriable=lambda exc: isinstance(exc, transient) and not is_auth_error(exc),
                         policy=Policy(RETRY_BASE_DELAY_S, RETRY_MAX_DELAY_S, self.retry_deadline_s,
                                       clip_to_give_up=True),
                         on_retry=lambda a: log.warning("redis %s failed (%r); retry %d in %.2fs", what, a.exc,
                                                        a.number, a.delay_s),
                         on_give_up=give_up)
        except redis.RedisError as exc:
            if is_auth_error(exc):
                kw = self._r.connection_pool.connection_kwargs
                where = f"{kw.get('host', '?')}:{kw.get('port', '?')}" if "host" in kw else kw.get("path", "?")
                what = "refused the password" if kw.get("password") else "requires a password and the URL has none"
                raise AuthError(f"Redis at {where} {what} ({exc})", field="--redis-url",
                                fix="put the server's password in the URL: redis://:PASSWORD@HOST:PORT/DB") from exc
            raise

    def _pipeline(self, what: str, fill: Callable[[redis.client.Pipeline], None], *, transaction: bool) -> list:
        """Run a pipeline of reads with :meth:`_call`'s retries, building it afresh for every attempt:
        redis-py clears a pipeline's command stack when ``execute()`` fails after sending (a socket
        timeout, a connection dropped mid-reply), so re-executing the same object returns ``[]``."""

        def attempt() -> list:
            pipe = self._r.pipeline(transaction=transaction)
            fill(pipe)
            return pipe.execute()

        return self._call(what, attempt)

    def _script(self, name: str, keys: list[str], args: list) -> object:
        return self._call(name, self._scripts[name], keys=keys, args=args)

    # --- reward moments ------------------------------------------------------------------------
    def merge_reward_moments(self, batch_id: str, values: np.ndarray, name: str = "reward") -> Moments:
        """Merge ``values`` into the running moments ``name``, once per ``batch_id``.

        Chan's parallel update of (count, mean, M2) with the batch's (k, mean, M2) computed here in
        float64. Returns the moments right after this batch's merge; a repeated ``batch_id`` returns
        that same stored snapshot (so a redelivered batch is normalised identically) and changes
        nothing. Non-finite values raise PoisonRecordError.
        """
        k, mean_b, m2_b = batch_moments(values)
        res = self._script(
            "merge",
            [self.key("moments", name), self.key("moments", name, "applied")],
            [batch_id, str(k), repr(mean_b), repr(m2_b)],
        )
        return Moments.parse(res[1])

    def get_moments(self, name: str = "reward") -> Moments:
        """The current running moments ``name`` (count 0 when nothing was merged)."""
        c, m, m2 = self._call("get_moments", self._r.hmget, self.key("moments", name), "count", "mean", "m2")
        if c is None:
            return Moments.from_triple(0, 0.0, 0.0)
        return Moments.from_triple(int(c), float(m), float(m2))

    # --- group buffers -------------------------------------------------------------------------
    def park_group(
        self, group_id: str, n: int, batch_id: str, members: Mapping[int, bytes]
    ) -> list[bytes] | None:
        """Atomically park ``members`` (sample_index -> payload) of group ``group_id`` and maybe take it.

        Each member is stored once (HSETNX: a redelivered sample keeps its first payload). When the
        group then holds all ``n`` members, the first caller to see that becomes the group's
        *completer* and gets all ``n`` payloads ordered by sample_index; a later call with the same
        ``batch_id`` (a redelivery of the completing record) gets them again; anyone else gets None.
        A buffer is kept until :meth:`settle_groups` frees it (or it expires after ``group_ttl_s``), so
        that redeliveries stay answerable; a call for a group settled within ``dedupe_window_s`` parks
        nothing and gets None (a record read again after every record of the group was committed).
        """
        args: list = [str(n), batch_id, str(self.group_ttl_s), group_id, str(int(time.time() * 1000)),
                      str(self.dedupe_window_s * 1000)]
        for i, payload in check_group_members(group_id, n, members).items():
            args += [str(i), payload]
        try:
            res = self._script(
                "park", [self.key("group", group_id), self.key("group", group_id, "meta"), self.key("groups", "done")],
                args)
        except redis.ResponseError as exc:
            if "GROUPSIZE" in str(exc):
                raise PoisonRecordError(f"group {group_id!r}: {exc}") from exc
            raise
        if int(res[0]) != 1:  # 0: not complete, or not this caller's; 2: settled already
            return None
        return list(res[1:])

    def settle_groups(self, batch_id: str, members: Mapping[str, Sequence[int]]) -> list[str]:
        """The advantage record ``batch_id`` is committed, carrying ``members`` (group id -> sample indices).

        One Lua script: each member is marked committed in its group's meta hash (groups not parked
        here, e.g. settled already, are skipped); the group's completing record is marked committed
        when ``batch_id`` is the completer (or the record its split sub-batch came from). A complete
        group whose completing record and n members' records are all committed can never be
        redelivered (only read again by a rewind): its two keys are deleted and its id goes into the
        ``groups:done`` sorted set, where :meth:`park_group` finds it for ``dedupe_window_s``.
        Returns the group ids freed by this call. Idempotent: a repeated call frees nothing more.
        """
        checked = check_settle(batch_id, members)
        if not checked:
            return []
        keys = [self.key("groups", "done")]
        args: list[str] = [batch_id, str(int(time.time() * 1000)), str(self.dedupe_window_s * 1000),
                           str(self.group_ttl_s)]
        for group_id, indices in checked.items():
            keys += [self.key("group", group_id), self.key("group", group_id, "meta")]
            args += [group_id, str(len(indices)), *map(str, indices)]
        return [g.decode() for g in self._script("settle", keys, args)]

    def group_done(self, group_id: str) -> bool:
        """True while the "done" marker of a settled group is kept (``dedupe_window_s``)."""
        freed = self._call("group_done", self._r.zscore, self.key("groups", "done"), group_id)
        return freed is not None and freed >= time.time() * 1000 - self.dedupe_window_s * 1000

    def group_status(self, group_id: str) -> tuple[int, int | None, str | None]:
        """(members parked, group size n or None if unknown, completer batch_id or None)."""
        def read(pipe: redis.client.Pipeline) -> None:
            pipe.hlen(self.key("group", group_id))
            pipe.hmget(self.key("group", group_id, "meta"), "n", "completer")

        have, (n, completer) = self._pipeline("group_status", read, transaction=True)
        return (
            int(have),
            (int(n) if n is not None else None),
            (completer.decode() if completer is not None else None),
        )

    # --- normalisation windows ----------------------------------------------------------------
    # The streaming form of the seed's cross-batch advantage normalisation (docs/numerics.md §7.2),
    # which normalises over a whole rollout batch. A micro-batch joins the window that is open when
    # it first arrives; the call that brings the window to ``size`` samples closes it and gets every
    # member back, once. A redelivery of the closing micro-batch gets the same members again (same
    # ids, so readers dedupe); a redelivery of any other member gets nothing. One Lua script, so two
    # advantage replicas never split or double a window. Keys: ``P window:<name>:of`` (batch_id ->
    # window k), ``P window:<name>:cur`` (open k), ``P window:<name>:<k>:members|meta``.
    def _window_keys(self, name: str) -> tuple[str, str]:
        return self.key("window", name, "of"), self.key("window", name, "cur")

    def park_window(self, name: str, batch_id: str, payload: bytes, n_samples: int,
                    size: int) -> WindowTaken | None:
        """Add one micro-batch to window ``name``; ``(window_id, members)`` when this call closed it."""
        res = self._script("park_window", list(self._window_keys(name)),
                           [batch_id, payload, str(n_samples), str(size), str(self.group_ttl_s)])
        return _window_taken(res)

    def flush_window(self, name: str) -> WindowTaken | None:
        """Close the open window whatever its size (end of a finite run); None when it is empty."""
        return _window_taken(self._script("flush_window", [self._window_keys(name)[1]], ["flush"]))

    def pending_window_samples(self, name: str) -> int:
        """Samples parked in the open window ``name``."""
        cur = self._call("pending_window_samples", self._r.get, self._window_keys(name)[1]) or b"0"
        have = self._call("pending_window_samples", self._r.hget,
                          self.key("window", name) + f":{cur.decode()}:meta", "samples")
        return int(have or 0)

    # --- KL coefficient ------------------------------------------------------------------------
    def kl_coef(self, default: float) -> float:
        """The shared KL coefficient, initialised to ``default`` by the first caller (SET NX)."""
        return float(self._script("kl_init", [self.key("kl_coef")], [repr(float(default))]))

    def set_kl_coef(self, value: float) -> None:
        self._call("set_kl_coef", self._r.set, self.key("kl_coef"), repr(float(value)))

    def update_kl_adaptive(
        self,
        step_id: str,
        current_kl: float,
        target: float,
        n_steps: int,
        horizon: int,
        *,
        default: float | None = None,
    ) -> float:
        """Adaptive KL controller step (Ziegler et al.), applied once per ``step_id``.

        ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
        Returns the coefficient after this step (the stored one on a repeated ``step_id``).
        ``default`` initialises a missing coefficient; without it, call :meth:`kl_coef` first.
        """
        check_kl_update(target, horizon)
        args = [
            step_id,
            repr(float(current_kl)),
            repr(float(target)),
            repr(float(n_steps)),
            repr(float(horizon)),
            "" if default is None else repr(float(default)),
        ]
        try:
            return float(
                self._script("kl_adaptive", [self.key("kl_coef"), self.key("kl_coef", "applied")], args)
            )
        except redis.ResponseError as exc:
            if "NOKL" in str(exc):
                raise kl_not_initialised() from exc
            raise

    # --- stage statistics, heartbeats ----------------------------------------------------------
    def record_stage_time(self, stage: str, seconds: float, samples: int, batch_id: str) -> bool:
        """Add one batch's time and sample count to ``stage``'s totals, once per (stage, batch_id).

        Returns True when counted now, False for a repeat.
        """
        return bool(int(self._script("stage_time", *self._stage_time_call(stage, seconds, samples, batch_id))))

    def _applied_keys(self, *parts: str) -> tuple[str, str]:
        """(this window's, the previous window's) applied-id set of ``parts`` (see the scripts' comment)."""
        w = int(time.time()) // self.dedupe_window_s
        base = self.key(*parts, "applied")
        return f"{base}:{w}", f"{base}:{w - 1}"

    def _stage_time_call(self, stage: str, seconds: float, samples: int, batch_id: str) -> tuple[list[str], list[str]]:
        """(keys, args) of the ``stage_time`` script for one batch."""
        cur, prev = self._applied_keys("stage", stage)
        return ([self.key("stage", stage), cur, self.key("stages"), self.key("stage", stage, "recent"), prev],
                [batch_id, repr(float(seconds)), str(int(samples)), stage,
                 f"{time.time():.3f},{float(seconds):.6f},{int(samples)}", str(RECENT_BATCHES),
                 str(2 * self.dedupe_window_s)])

    def stage_recent(self, stage: str) -> list[tuple[float, float, int]]:
        """The last RECENT_BATCHES micro-batches of ``stage``, newest first: (unix time, seconds, samples)."""
        rows = self._call("stage_recent", self._r.lrange, self.key("stage", stage, "recent"), 0, -1)
        return [parse_recent(r) for r in rows]

    def record_flow(self, stage: str, batch_id: str, counts: dict[str, int]) -> bool:
        """Add a record's sample accounting (``in``, ``out``, ``dead``, ``dropped``) once per (stage, batch_id)."""
        return bool(int(self._script("flow", *self._flow_call(stage, batch_id, counts))))

    def _flow_call(self, stage: str, batch_id: str, counts: dict[str, int]) -> tuple[list[str], list[str]]:
        """(keys, args) of the ``flow`` script for one batch."""
        args: list[str] = [batch_id, str(2 * self.dedupe_window_s), stage]
        for k, v in counts.items():
            args += [k, str(int(v))]
        return [self.key("flow", stage), *self._applied_keys("flow", stage), self.key("flow_stages")], args

    def record_batch(self, stage: str, batch_id: str, counts: dict[str, int], seconds: float | None = None,
                     samples: int = 0) -> None:
        """:meth:`record_flow`, and :meth:`record_stage_time` when ``seconds`` is given, in one round trip
        (one ``_RECORD_BATCH`` script call: :meth:`record_batches` with one row)."""
        self.record_batches(stage, [(batch_id, counts, seconds, samples)])

    def _record_batch_call(self, stage: str, batch_id: str, counts: dict[str, int], seconds: float | None,
                           samples: int) -> tuple[list[str], list[str]]:
        """(keys, args) of the ``record_batch`` script for one record."""
        flow_keys, flow_args = self._flow_call(stage, batch_id, counts)
        if seconds is not None:
            time_keys, time_args = self._stage_time_call(stage, seconds, samples, batch_id)
            keys, head = flow_keys + time_keys, ["1", *time_args[1:]]
        else:
            keys, head = flow_keys, ["0", "", "", stage, "", "", str(2 * self.dedupe_window_s)]
        return keys, [batch_id, *head, *flow_args[3:]]  # flow args: batch id, ttl, stage, then the pairs

    def record_batches(self, stage: str, rows: Sequence[tuple[str, dict[str, int], float | None, int]]) -> None:
        """:meth:`record_batch` for each ``(batch_id, counts, seconds, samples)`` row, in one round trip (a
        pipeline of EVALSHAs: the runner's commit group). The script is loaded again if the server
        forgot it (NOSCRIPT: a restart, SCRIPT FLUSH); every call is idempotent per batch id."""
        if not rows:
            return
        script = self._scripts["record_batch"]
        calls = [self._record_batch_call(stage, *row) for row in rows]

        def attempt() -> list:
            for tries in (1, 2):
                pipe = self._r.pipeline(transaction=False)
                for keys, args in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                try:
                    return pipe.execute()
                except redis.exceptions.NoScriptError:
                    if tries == 2:
                        raise
                    self._r.script_load(script.script)
            return []

        self._call("record_batches", attempt)

    def flows(self) -> dict[str, dict[str, int]]:
        """``{stage: {"in", "out", "dead", "dropped"}}`` for every stage that recorded any (timed or not)."""
        stages = sorted(s.decode() for s in self._call("flows", self._r.smembers, self.key("flow_stages")))

        def read(pipe: redis.client.Pipeline) -> None:
            for s in stages:
                pipe.hgetall(self.key("flow", s))

        rows = self._pipeline("flows", read, transaction=False) if stages else []
        return {s: {k.decode(): int(v) for k, v in row.items()} for s, row in zip(stages, rows, strict=True)}

    def stage_stats(self) -> dict[str, dict[str, float]]:
        """``{stage: {"batches": int, "samples": int, "seconds": float}}`` for every stage seen."""
        stages = sorted(s.decode() for s in self._call("stage_stats", self._r.smembers, self.key("stages")))
        if not stages:
            return {}
        def read(pipe: redis.client.Pipeline) -> None:
            for s in stages:
                pipe.hmget(self.key("stage", s), "batches", "samples", "seconds")

        rows = self._pipeline("stage_stats", read, transaction=False)
        return {
            s: {"batches": int(b or 0), "samples": int(n or 0), "seconds": float(sec or 0.0)}
            for s, (b, n, sec) in zip(stages, rows, strict=True)
        }

    def heartbeat(self, stage: str, replica_id: str | int) -> None:
        """Record that ``stage``/``replica_id`` is alive now (unix time of this host)."""
        self._call(
            "heartbeat", self._r.hset, self.key("heartbeats"), f"{stage}/{replica_id}", repr(time.time())
        )

    def heartbeats(self) -> dict[tuple[str, str], float]:
        """``{(stage, replica_id): unix time of its last heartbeat}``."""
        raw = self._call("heartbeats", self._r.hgetall, self.key("heartbeats"))
        out: dict[tuple[str, str], float] = {}
        for k, v in raw.items():
            stage, _, replica = k.decode().rpartition("/")
            out[(stage, replica)] = float(v)
        return out

    # --- policy version ------------------------------------------------------------------------
    def policy_version(self) -> int:
        """The latest published policy version (0 before any)."""
        v = self._call("policy_version", self._r.get, self.key("policy_version"))
        return int(v) if v is not None else 0

    def set_policy_version(self, version: int) -> int:
        """Publish ``version``; never goes backwards (a late, older publish is ignored). Returns the current one."""
        return int(self._script("policy", [self.key("policy_version")], [str(int(version))]))

    # --- generic idempotence and counters ------------------------------------------------------
    def mark_once(self, namespace: str, id: str) -> bool:
        """True the first time ``id`` is marked in ``namespace``, False afterwards."""
        return bool(self._call("mark_once", self._r.sadd, self.key("once", namespace), id))

    def incr_counter(self, name: str, by: float = 1, once_id: str | None = None) -> float:
        """Add ``by`` to counter ``name`` (once per ``once_id`` when given); returns the new value."""
        res = self._script(
            "incr",
            [self.key("counters"), *self._applied_keys("counters", name)],
            [name, repr(float(by)) if isinstance(by, float) else str(int(by)), once_id or "",
             str(2 * self.dedupe_window_s)],
        )
        return float(res)

    def counters(self) -> dict[str, float]:
        raw = self._call("counters", self._r.hgetall, self.key("counters"))
        return {k.decode(): float(v) for k, v in raw.items()}

    # --- admission control (expstream/rl/admission.py) ------------------------------------------
    def admit(self, batch_id: str, samples: int, version: int, bound: int) -> bool:
        """Admit a prompt record of ``samples`` samples generated under ``version``; one Lua script.

        0. A ``batch_id`` marked delivered (:meth:`mark_delivered`: its generate record was committed, so
           it is read again only by a rewind) is admitted (True) and nothing is counted or moved.
        1. A ``batch_id`` admitted before is admitted again (True) at once; when ``version`` is newer
           (the record was redelivered and is generated under newer weights), its count moves from the
           old version to the new one. An older ``version`` is refused (False): a record is never
           regenerated with older weights than it was admitted with (its samples could arrive after
           the trainer stopped waiting for that version); the caller reloads and tries again.
        2. Otherwise it is admitted iff ``sum(admitted) - sum(lost) + samples <= bound``; then
           ``admitted[version] += samples``. False leaves everything unchanged.
        """
        check_admission("admit", batch_id, samples, version, bound)
        res = self._script("admit", [self.key("admission", "of"), self.key("admission", "admitted"),
                                     self.key("admission", "totals")],
                           [batch_id, str(int(samples)), str(int(version)), str(int(bound))])
        return bool(int(res))

    def record_lost(self, batch_id: str, version: int, samples: int) -> bool:
        """Count ``samples`` of ``version`` that will never reach the trainer (dead-lettered, dropped by
        dynamic sampling), once per ``batch_id``. True when counted now, False for a repeat."""
        check_admission("record_lost", batch_id, samples, version)
        res = self._script("record_lost", [self.key("admission", "lost_of"), self.key("admission", "lost"),
                                           self.key("admission", "totals")],
                           [batch_id, str(int(version)), str(int(samples))])
        return bool(int(res))

    def admission_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """(samples admitted by version, samples lost by version); versions with 0 left out."""
        def read(pipe: redis.client.Pipeline) -> None:
            pipe.hgetall(self.key("admission", "admitted"))
            pipe.hgetall(self.key("admission", "lost"))

        admitted, lost = self._pipeline("admission_counts", read, transaction=True)
        return tuple({int(v): int(n) for v, n in sorted(raw.items(), key=lambda kv: int(kv[0])) if int(n)}
                     for raw in (admitted, lost))

    def admitted_version(self, batch_id: str) -> int | None:
        """The version ``batch_id`` is admitted under, None when it never was."""
        raw = self._call("admitted_version", self._r.hget, self.key("admission", "of"), batch_id)
        return int(raw.split(b" ", 1)[0]) if raw is not None else None

    def mark_delivered(self, batch_ids: Sequence[str]) -> int:
        """Generate's records ``batch_ids`` are committed (their samples are on their way): from now on an
        admission of one of them (a rewind reading it again) is granted without counting anything, since
        the samples it regenerates are duplicates of counted ones. Ids never admitted are skipped.
        Returns how many were marked now (idempotent)."""
        ids = list(dict.fromkeys(batch_ids))
        if not ids:
            return 0
        return int(self._script("mark_delivered", [self.key("admission", "of")], ids))

    # --- the rewind handshake (expstream/tools/rewind.py) -----------------------------------------------
    def set_rewind_request(self, stage: str, request_id: str, ttl_s: float) -> None:
        """Set (or refresh) ``stage``'s rewind request; it expires after ``ttl_s`` unless refreshed."""
        self._call("set_rewind_request", self._r.set, self.key("rewind", stage), request_id,
                   px=max(1, int(ttl_s * 1000)))

    def rewind_request(self, stage: str) -> str | None:
        """The pending rewind request id of ``stage`` (None: none, or expired)."""
        raw = self._call("rewind_request", self._r.get, self.key("rewind", stage))
        return raw.decode() if raw is not None else None

    def ack_rewind(self, stage: str, request_id: str, replica_id: str, ttl_s: float) -> None:
        """``replica_id`` has left the group for ``request_id`` and waits (the ack expires with ``ttl_s``)."""
        def fill(pipe: redis.client.Pipeline) -> None:
            pipe.hset(self.key("rewind", stage, "acks"), str(replica_id), request_id)
            pipe.pexpire(self.key("rewind", stage, "acks"), max(1, int(ttl_s * 1000)))

        self._pipeline("ack_rewind", fill, transaction=True)

    def rewind_acks(self, stage: str, request_id: str) -> set[str]:
        """Replicas that acknowledged ``request_id``."""
        raw = self._call("rewind_acks", self._r.hgetall, self.key("rewind", stage, "acks"))
        return {k.decode() for k, v in raw.items() if v.decode() == request_id}

    def clear_rewind_request(self, stage: str) -> None:
        """Remove the request and its acknowledgements: waiting replicas rejoin their group."""
        self._call("clear_rewind_request", self._r.delete, self.key("rewind", stage), self.key("rewind", stage, "acks"))


def is_auth_error(exc: BaseException) -> bool:
    """True for Redis refusing the credentials: a wrong password (WRONGPASS), none given (NOAUTH),
    or a password given to a server without one. Never retriable."""
    if isinstance(exc, redis.AuthenticationError):
        return True
    text = str(exc)
    return isinstance(exc, redis.ResponseError) and (text.startswith(("WRONGPASS", "NOAUTH"))
                                                     or "AUTH <password> called without" in text)


def _window_taken(res: list) -> WindowTaken | None:
    if int(res[0]) == 0:
        return None
    k = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
    return k, [bytes(p) for p in res[2:]]
