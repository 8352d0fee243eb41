"""RedisState: the :class:`~expstream.state.base.State` contract on Redis, shared by every replica.

The run-wide keys of a run live under ``expstream:{<run_id>}:``, the keys of one prompt group under
``expstream:{<run_id>{<group_id>}:``. The braces are a Redis Cluster hash tag: every key a script
touches shares one tag, so every script runs on one shard of a cluster, and a run's group buffers (its
bulk: every sample's payload) spread over the shards while the run-wide keys stay together. A ``{``
cannot be part of a run id, so a group's tag is never another run's. The same names on a lone server;
on a cluster (found by :meth:`RedisConnection.connect`) redis-py's cluster client routes each key.
Which keys live together and why: docs/redis.md.

Rules that make Kafka's at-least-once delivery exactly-once in effect:

* every multi-step update is ONE Lua script, so it is atomic across replicas;
* every update carries an id (a ``batch_id``, a ``step_id``) and is applied once per id; the set
  of applied ids is kept in Redis next to the data, inside the same script. A redelivered batch
  gets the same answer as the first delivery (the stored post-update snapshot).

Connection errors and timeouts are retried with bounded exponential backoff (a Redis restart or
failover; :mod:`expstream.state.connection`); after :data:`RETRY_DEADLINE_S` a retriable
:class:`StateUnavailableError` is raised and the stage runner backs off at its level. Retrying a script is safe because scripts are idempotent
by id; plain setters (``set_kl_coef``, ``heartbeat``) are idempotent by nature; ``incr_counter``
without ``once_id`` may count twice when a reply is lost.

Keys (``P`` = ``expstream:{<run_id>}:``, ``G`` = ``expstream:{<run_id>{<group_id>}:``):

==============================  ======  =================================================
``P moments:<name>``            hash    count, mean, m2 (``%.17g`` strings: exact doubles)
``P moments:<name>:applied``    hash    batch_id -> post-merge snapshot "count mean m2"
``G group``                     hash    sample_index -> payload bytes (TTL ``group_ttl_s``; freed when settled)
``G group:meta``                hash    n, completer, c<i> per committed member, settled (TTL, freed alike)
``G done``                      string  unix ms the settled group was freed; expires after ``dedupe_window_s``
``P sync``, ``G sync``          string  the durability wait's sentinel write (expstream/state/durability.py; 60 s)
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
``P admission:*``               hash    the admission ledger: expstream/state/redis_admission.py
``P rewind:<stage>``            string  the pending rewind request id (TTL, refreshed by the tool)
``P rewind:<stage>:acks``       hash    replica -> request id it acknowledged (TTL)
==============================  ======  =================================================
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import redis

from expstream.errors import ConfigError, PoisonRecordError
from expstream.rl.moments import batch_moments, check_kl_update
from expstream.state.base import (
    DEFAULT_DEDUPE_WINDOW_S,
    DEFAULT_GROUP_TTL_S,
    RECENT_BATCHES,
    Moments,
    WindowTaken,
    check_group_members,
    check_settle,
    kl_not_initialised,
    parse_recent,
)
from expstream.state.cluster import scan_keys
from expstream.state.connection import RETRY_DEADLINE_S, SOCKET_TIMEOUT_S, RedisConnection
from expstream.state.durability import DEFAULT_WAIT_TIMEOUT_MS, ReplicaWait
from expstream.state.lua import SCRIPTS
from expstream.state.redis_admission import RedisAdmission

__all__ = ["RedisState"]


class RedisState(RedisAdmission, RedisConnection):
    """Run-scoped state in Redis, shared by every replica of every stage.

    ``RedisState(url, run_id)`` connects (and pings) at once; :class:`StateUnavailableError` when
    Redis does not answer within the retry budget. Thread-safe (redis-py connection pool). The
    connection and its retries: :class:`~expstream.state.connection.RedisConnection`; the scripts:
    :mod:`expstream.state.lua`.
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
        wait_replicas: int | None = None,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
    ) -> None:
        if not run_id or any(c in run_id for c in "{}") or any(c.isspace() for c in run_id):
            raise ConfigError(
                f"bad run_id {run_id!r}",
                field="run_id",
                fix="use a non-empty id without braces or whitespace",
            )
        self.run_id = run_id
        self.shared = True  # every replica of every stage reads and writes these keys
        self.prefix = f"expstream:{{{run_id}}}:"
        self.group_ttl_s = int(group_ttl_s)
        self.dedupe_window_s = int(dedupe_window_s)
        super().__init__(url, connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s,
                         retry_deadline_s=retry_deadline_s, scripts=SCRIPTS)
        self.connect()
        #: the wait for replicas before a stage's offset commit (:meth:`sync_writes`)
        self.durability = ReplicaWait(lambda: self._r, lambda: self.cluster, "expstream:", wait_replicas,
                                      wait_timeout_ms, retry_deadline_s)

    # --- keys ----------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        """The full Redis key for ``parts`` joined by ':' under this run's prefix."""
        return self.prefix + ":".join(parts)

    def group_key(self, group_id: str, *parts: str) -> str:
        """The full Redis key for ``parts`` of group ``group_id`` (its own hash tag: ``{<run_id>{<group_id>}``)."""
        return f"expstream:{{{self.run_id}{{{group_id}}}:" + ":".join(parts)

    def _group_keys(self, group_id: str) -> list[str]:
        return [self.group_key(group_id, "group"), self.group_key(group_id, "group", "meta"),
                self.group_key(group_id, "done")]

    def run_keys(self) -> list[str]:
        """Every key of this run (SCAN; on a cluster over every primary): the tests' and tools' view."""
        patterns = [self.prefix + "*", f"expstream:{{{self.run_id}{{*"]
        return sorted({k.decode() for k in self._call("run_keys", lambda: list(scan_keys(self._r, patterns)))})

    # --- durability ----------------------------------------------------------------------------
    def _script(self, name: str, keys: list[str], args: list) -> object:
        res = super()._script(name, keys, args)
        self.durability.wrote(keys[0])
        return res

    def sync_writes(self) -> None:
        """Before a stage commits its Kafka offsets: wait until a replica of every primary this client
        wrote to since the last call acknowledged the writes (``redis.wait_replicas``). Raises
        :class:`~expstream.state.durability.StateWritesLost` when they may be gone (a failover before
        the acknowledgement): the records behind them are to be processed again, not committed."""
        self.durability.sync()

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
        return self.park_groups(batch_id, {group_id: (n, members)})[group_id]

    def park_groups(self, batch_id: str, groups: Mapping[str, tuple[int, Mapping[int, bytes]]]
                    ) -> dict[str, list[bytes] | None]:
        """:meth:`park_group` for each ``group_id -> (n, members)`` of the record ``batch_id``, the scripts
        in one pipeline (one round trip per record instead of one per group; on a cluster each goes to
        its group's shard). Each script is atomic and idempotent on its own, as alone: a retry of the
        whole pipeline (a connection lost) parks nothing twice and names the same completer."""
        calls = []
        for g, (n, members) in groups.items():
            args: list = [str(n), batch_id, str(self.group_ttl_s)]
            for i, payload in check_group_members(g, n, members).items():
                args += [str(i), payload]
            calls.append((self._group_keys(g), args))
        try:  # one group: a plain script call, no pipeline
            results = [self._script("park", *calls[0])] if len(calls) == 1 else self._evalsha_many("park", calls)
        except redis.ResponseError as exc:
            if "GROUPSIZE" in str(exc):
                where = f"group {next(iter(groups))!r}" if len(groups) == 1 else f"a group of {batch_id!r}"
                raise PoisonRecordError(f"{where}: {exc}") from exc
            raise
        # 1: this caller completes the group (its payloads follow); 0: not complete, or not this caller's;
        # 2: settled already
        return {g: list(res[1:]) if int(res[0]) == 1 else None for g, res in zip(groups, results, strict=True)}

    def settle_groups(self, batch_id: str, members: Mapping[str, Sequence[int]]) -> list[str]:
        """The advantage record ``batch_id`` is committed, carrying ``members`` (group id -> sample indices).

        One Lua script: each member is marked committed in its group's meta hash (groups not parked
        here, e.g. settled already, are skipped); the group's completing record is marked committed
        when ``batch_id`` is the completer (or the record its split sub-batch came from). A complete
        group whose completing record and n members' records are all committed can never be
        redelivered (only read again by a rewind): its two keys are deleted and its "done" marker is
        set, where :meth:`park_group` finds it for ``dedupe_window_s``. One script call per group (a
        group's keys share its own hash tag; groups may live on different shards), all in one pipeline.
        Returns the group ids freed by this call. Idempotent: a repeated call frees nothing more.
        """
        return self.settle_records([(batch_id, members)])

    def settle_records(self, records: Sequence[tuple[str, Mapping[str, Sequence[int]]]]) -> list[str]:
        """:meth:`settle_groups` for each ``(batch_id, members)`` of a commit group, every script in one
        pipeline, in order (the same as one call each: each script is atomic and idempotent on its own).
        Returns the group ids freed, for logs only: a pipeline sent again (a retried connection error, a
        cluster redirect) re-runs scripts that already freed their groups, which then report nothing."""
        now_ms, window_ms = str(int(time.time() * 1000)), str(self.dedupe_window_s * 1000)
        groups: list[str] = []
        calls: list[tuple[list[str], list]] = []
        for batch_id, members in records:
            for g, indices in check_settle(batch_id, members).items():
                groups.append(g)
                calls.append((self._group_keys(g), [batch_id, now_ms, window_ms, *map(str, indices)]))
        if not calls:
            return []
        freed = self._evalsha_many("settle", calls)
        return [g for g, res in zip(groups, freed, strict=True) if int(res) == 1]

    def group_done(self, group_id: str) -> bool:
        """True while the "done" marker of a settled group is kept (``dedupe_window_s``)."""
        return bool(self._call("group_done", self._r.exists, self.group_key(group_id, "done")))

    def group_status(self, group_id: str) -> tuple[int, int | None, str | None]:
        """(members parked, group size n or None if unknown, completer batch_id or None)."""
        def read(pipe: redis.client.Pipeline) -> None:
            pipe.hlen(self.group_key(group_id, "group"))
            pipe.hmget(self.group_key(group_id, "group", "meta"), "n", "completer")

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
        self.durability.wrote(self.key("kl_coef"))

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
        self._evalsha_many("record_batch", [self._record_batch_call(stage, *row) for row in rows])

    def _evalsha_many(self, name: str, calls: list[tuple[list[str], list]]) -> list:
        """Script ``name`` once per ``(keys, args)`` in one pipeline (non-transactional: on a cluster the
        calls go to their shards). The script is loaded again if the server forgot it (NOSCRIPT: a
        restart, SCRIPT FLUSH, a replica promoted); every script is idempotent per id, so a retry is safe."""
        script = self._scripts[name]

        def attempt() -> list:
            for tries in (1, 2):
                pipe = self._r.pipeline(transaction=False)
                for keys, args in calls:
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # a cluster pipeline blocks .evalsha
                try:
                    return pipe.execute()
                except redis.exceptions.NoScriptError:
                    if tries == 2:
                        raise
                    self._r.script_load(script.script)
            return []

        res = self._call(name, attempt)
        for keys, _ in calls:
            self.durability.wrote(keys[0])
        return res

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



def _window_taken(res: list) -> WindowTaken | None:
    if int(res[0]) == 0:
        return None
    k = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
    return k, [bytes(p) for p in res[2:]]
