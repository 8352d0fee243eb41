"""The Lua scripts of :class:`~expstream.state.redis_state.RedisState`: every multi-step update of the run state.

Each script is one atomic update, idempotent by the id it carries (a ``batch_id``, a ``step_id``), so a
redelivered record or a retried call gets the first answer. They are kept apart from the class that
calls them because they are the state's real contract: the key layout they touch is the table in
``redis_state.py``'s docstring, the formulas they mirror are in :mod:`expstream.rl.moments`, and
their text is pinned (``tests/test_state.py``; a server caches a script by its SHA1). Why the state
is shared and how admission uses it: ``../shared/DESIGN.md``, ``docs/async.md``.

Every script touches keys of ONE hash tag only (a Redis Cluster runs a script on one shard): a group's
keys share the group's tag, everything else the run's (docs/redis.md). PARK_WINDOW and FLUSH_WINDOW
build the window's member and meta key names from ``KEYS[2]``: they share its tag, so its slot.
"""

from __future__ import annotations

__all__ = [
    "MERGE_MOMENTS",
    "PARK_GROUP",
    "SETTLE_GROUP",
    "KL_INIT",
    "KL_ADAPTIVE",
    "STAGE_TIME",
    "FLOW",
    "RECORD_BATCH",
    "POLICY_VERSION",
    "INCR_COUNTER",
    "PARK_WINDOW",
    "FLUSH_WINDOW",
    "ADMIT",
    "MARK_DELIVERED",
    "RECORD_LOST",
    "FOLD_ADMISSION",
    "SCRIPTS",
]

# Numbers cross the Lua boundary as strings: Lua numbers are doubles, ``tonumber`` of a Python
# ``repr`` is exact, and ``%.17g`` prints a double that parses back to the same double. (A Lua
# number returned to Redis as a reply would be truncated to an integer.)

MERGE_MOMENTS = """
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

PARK_GROUP = """
-- KEYS[1] members hash, KEYS[2] meta hash, KEYS[3] done marker (one hash tag: the group's)
-- ARGV n, batch_id, ttl, idx1, payload1, idx2, ...
if redis.call('EXISTS', KEYS[3]) == 1 then return {2} end
local n = tonumber(ARGV[1])
local stored_n = redis.call('HGET', KEYS[2], 'n')
if stored_n then
  if tonumber(stored_n) ~= n then
    return redis.error_reply('GROUPSIZE group already parked with n=' .. stored_n .. ', got n=' .. ARGV[1])
  end
else
  redis.call('HSET', KEYS[2], 'n', ARGV[1])
end
for i = 4, #ARGV, 2 do
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

SETTLE_GROUP = """
-- A record of the advantage stage is committed: mark its members of ONE group committed; free the
-- group when its completing record and every member's record are committed, leaving a "done" marker
-- that expires after the dedupe window. One call per group: a group's keys share one hash tag, and two
-- groups may live on different shards of a cluster (settle_groups pipelines the calls).
-- KEYS[1] members hash, KEYS[2] meta hash, KEYS[3] done marker
-- ARGV batch_id (the record's, no '~' suffix), now_ms, done_ttl_ms, then the member sample indices
local n = tonumber(redis.call('HGET', KEYS[2], 'n') or '0')
if n == 0 then return 0 end
for i = 4, #ARGV do
  local idx = tonumber(ARGV[i])
  if idx < n then redis.call('HSET', KEYS[2], 'c' .. idx, '1') end
end
local completer = redis.call('HGET', KEYS[2], 'completer')
if not completer then return 0 end
local cut = string.find(completer, '~', 1, true)
if cut then completer = string.sub(completer, 1, cut - 1) end
if completer == ARGV[1] then redis.call('HSET', KEYS[2], 'settled', '1') end
if redis.call('HEXISTS', KEYS[2], 'settled') == 0 then return 0 end
for idx = 0, n - 1 do
  if redis.call('HEXISTS', KEYS[2], 'c' .. idx) == 0 then return 0 end
end
redis.call('DEL', KEYS[1], KEYS[2])
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3]) end
return 1
"""

KL_INIT = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return redis.call('GET', KEYS[1])
"""

KL_ADAPTIVE = """
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

STAGE_TIME = """
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

FLOW = """
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

# (The comment inside names STAGE_TIME and FLOW by their former private names: the text is kept
# byte for byte, as servers cache a script by its SHA1.)
RECORD_BATCH = """
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

POLICY_VERSION = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local v = tonumber(ARGV[1])
if v > cur then redis.call('SET', KEYS[1], ARGV[1]); return ARGV[1] end
return tostring(cur)
"""

INCR_COUNTER = """
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


PARK_WINDOW = """
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

FLUSH_WINDOW = """
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

# The admission ledger (expstream/rl/admission.py; docs/async.md "What the admission ledger keeps").
# Counts by version: ``admission:admitted`` / ``admission:lost`` (version -> samples) and the sums in
# ``admission:totals`` (admitted, lost, and ``folded``: the versions below it are summed under the
# field '-1', FOLD_ADMISSION). Records: ``admission:of`` holds the records admitted and not yet
# delivered ("version samples"); MARK_DELIVERED moves a record to the delivered hash of its window
# (``admission:delivered:<w>``, w = unix time // dedupe_window_s) and lost ids go to
# ``admission:lost_of:<w>``; each such hash is read for three windows (the caller passes the keys of
# w, w-1, w-2) and expires after them. So a delivered record read again by a rewind is known for at
# least two windows (beyond its groups' "done" markers, one window), then it is new work again.

ADMIT = """
-- KEYS[1] admission:of, KEYS[2] admission:admitted, KEYS[3] admission:totals,
-- KEYS[4..6] admission:delivered:<w>, <w-1>, <w-2>; ARGV batch_id, samples, version, bound
for i = 4, 6 do
  if redis.call('HEXISTS', KEYS[i], ARGV[1]) == 1 then return 1 end  -- delivered: a rewind, counted once
end
local t = redis.call('HMGET', KEYS[3], 'admitted', 'lost', 'folded')
local folded = tonumber(t[3] or '0')
local function bucket(v) if tonumber(v) < folded then return '-1' end return v end
local prev = redis.call('HGET', KEYS[1], ARGV[1])
if prev then
  local pv, pn, delivered = string.match(prev, '^(%d+) (%d+)( ?d?)$')
  if delivered == ' d' then return 1 end  -- marked by a version that kept delivered records here
  if tonumber(ARGV[3]) < tonumber(pv) then return 0 end
  if pv ~= ARGV[3] then
    redis.call('HINCRBY', KEYS[2], bucket(pv), -tonumber(pn))
    redis.call('HINCRBY', KEYS[2], bucket(ARGV[3]), pn)
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ' ' .. pn)
  end
  return 1
end
local outstanding = tonumber(t[1] or '0') - tonumber(t[2] or '0')
if outstanding + tonumber(ARGV[2]) > tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ' ' .. ARGV[2])
redis.call('HINCRBY', KEYS[2], bucket(ARGV[3]), ARGV[2])
redis.call('HINCRBY', KEYS[3], 'admitted', ARGV[2])
return 1
"""

MARK_DELIVERED = """
-- KEYS[1] admission:of, KEYS[2] admission:delivered:<w>; ARGV ttl, then the batch ids whose generate
-- record is committed. Each admitted one moves to this window's delivered hash. Returns how many moved.
local new = 0
for i = 2, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HSET', KEYS[2], ARGV[i], v)
    new = new + 1
  end
end
if new > 0 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return new
"""

RECORD_LOST = """
-- KEYS[1..3] admission:lost_of:<w>, <w-1>, <w-2>, KEYS[4] admission:lost, KEYS[5] admission:totals
-- ARGV batch_id, version, samples, ttl
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[4])
local folded = tonumber(redis.call('HGET', KEYS[5], 'folded') or '0')
redis.call('HINCRBY', KEYS[4], tonumber(ARGV[2]) < folded and '-1' or ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[5], 'lost', ARGV[3])
return 1
"""

FOLD_ADMISSION = """
-- KEYS[1] admission:admitted, KEYS[2] admission:lost, KEYS[3] admission:totals; ARGV below
-- Sums the counts of every version < below into the field '-1' of each hash and raises 'folded' to
-- below. Monotone, so a retry or a repeat folds nothing more. Returns the fold point in effect.
local below = tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[3], 'folded') or '0')
if below <= cur then return cur end
for i = 1, 2 do
  local flat = redis.call('HGETALL', KEYS[i])
  local sum = 0
  for j = 1, #flat, 2 do
    local v = tonumber(flat[j])
    if v >= 0 and v < below then
      sum = sum + tonumber(flat[j + 1])
      redis.call('HDEL', KEYS[i], flat[j])
    end
  end
  if sum ~= 0 then redis.call('HINCRBY', KEYS[i], '-1', sum) end
end
redis.call('HSET', KEYS[3], 'folded', ARGV[1])
return below
"""

#: Every script by the name :class:`RedisState` registers and calls it under.
SCRIPTS: dict[str, str] = {
    "merge": MERGE_MOMENTS,
    "park": PARK_GROUP,
    "kl_init": KL_INIT,
    "kl_adaptive": KL_ADAPTIVE,
    "stage_time": STAGE_TIME,
    "flow": FLOW,
    "record_batch": RECORD_BATCH,
    "policy": POLICY_VERSION,
    "incr": INCR_COUNTER,
    "park_window": PARK_WINDOW,
    "flush_window": FLUSH_WINDOW,
    "admit": ADMIT,
    "mark_delivered": MARK_DELIVERED,
    "settle": SETTLE_GROUP,
    "record_lost": RECORD_LOST,
    "fold_admission": FOLD_ADMISSION,
}
