"""Replica acknowledgement of a stage's state writes before it commits its Kafka offsets (``WAIT``).

Redis replicates asynchronously: a primary acknowledges a write (a parked group member), the stage
commits its offset, and the primary dies before its replica has the write: after the failover the
member is gone and its record is never read again. :meth:`ReplicaWait.sync`, called by the commit
group before the commit, closes that window:

* every write of a :class:`~expstream.state.redis_state.RedisState` notes the slot it went to and the
  primary that owned it then (:meth:`ReplicaWait.wrote`);
* ``sync`` sends, to each primary written since the last sync, ``SET <sentinel of that slot>`` then
  ``WAIT <replicas> <timeout>`` on one connection. ``WAIT`` covers the writes *of its connection*; the
  sentinel write, made after every write to cover (they were answered before), moves that
  connection's replication offset past them all, whichever pooled connection made them;
* when the slot's primary changed since the write (a failover: the new primary may lack it), or the
  primary stopped answering after it, the writes may be lost: :class:`StateWritesLost`, and the
  stage re-processes the records instead of committing them (idempotent by id);
* ``WAIT`` answered with fewer acknowledgements than asked within the timeout: asked again (the
  topology re-read: a replica that died no longer counts under ``auto``) until the retry deadline, then
  :class:`~expstream.errors.StateUnavailableError` (retriable: not committed, re-processed).

``replicas``: ``None`` (auto, the default) waits for 1 replica where the primary has one (a cluster
slot map's replicas, the map re-read every 30 s; a lone server's ``connected_slaves``, alike) and skips the wait
where it has none; ``0`` never waits; ``k`` waits for ``k``. The guarantee with and without replicas:
docs/redis.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from expstream.errors import ExpstreamError, StateUnavailableError
from expstream.state.cluster import TRANSIENT

__all__ = ["ReplicaWait", "StateWritesLost", "hash_tag", "DEFAULT_WAIT_TIMEOUT_MS"]

# Why 1000 ms: a healthy replica acknowledges within a millisecond on a LAN; a second is a replica that
# is behind or gone (then asked again, the topology re-read, until the retry deadline).
DEFAULT_WAIT_TIMEOUT_MS = 1000
# Why 30 s: how often a lone server's replica count (INFO replication) is re-read under auto.
REPLICA_COUNT_TTL_S = 30.0
# Why 60 s: the sentinel key only has to exist until WAIT answers; it must not pile up.
SENTINEL_TTL_MS = 60_000


class StateWritesLost(ExpstreamError):  # noqa: N818 - named for what happened, as the other errors
    """State writes made since the last sync may be gone (their primary failed over or restarted before a
    replica acknowledged them): the records behind them must be processed again, not committed."""

    retriable = True


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: between its first ``{`` and the next ``}`` (the whole key if none)."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else key


class ReplicaWait:
    """The writes of one RedisState since the last :meth:`sync`, and the wait for their replicas."""

    def __init__(self, client: Callable[[], object], cluster: Callable[[], bool], prefix: str,
                 replicas: int | None, timeout_ms: int, deadline_s: float) -> None:
        if replicas is not None and replicas < 0:
            raise ValueError(f"wait_replicas must be None (auto) or >= 0, got {replicas}")
        self._client, self._cluster, self.prefix = client, cluster, prefix
        self.replicas, self.timeout_ms, self.deadline_s = replicas, int(timeout_ms), float(deadline_s)
        self._lock = threading.Lock()
        self._touched: dict[int, tuple[str, str]] = {}  # slot -> (a key written there, its primary then)
        self._lone_replicas: tuple[float, int] | None = None  # (read at, connected_slaves) of a lone server
        self.waits = 0  # WAIT commands sent (tests, bench)
        self._map_read_at = time.monotonic()  # when the cluster's slot map was last read

    def wrote(self, key: str) -> None:
        """Note a write to ``key`` (after its reply)."""
        if self.replicas == 0:
            return
        client = self._client()
        if self._cluster():
            try:
                slot, node = client.keyslot(key), client.get_node_from_key(key).name
            except (redis.RedisError, redis.exceptions.RedisClusterException):  # no map of the slot (a failover)
                slot, node = client.keyslot(key), "?"
        else:
            slot, node = 0, "-"
        with self._lock:
            self._touched.setdefault(slot, (key, node))

    def pending(self) -> int:
        """Slots written since the last sync."""
        with self._lock:
            return len(self._touched)

    def sync(self) -> None:
        """Wait until a replica of every primary written since the last sync acknowledged the writes
        (module docstring); StateWritesLost when they may be gone, StateUnavailableError after the deadline."""
        with self._lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return
        # When this raises, the writes are not carried over to the next sync: the caller processes their
        # records again, which writes them again (noted anew, with the slot's primary of then)
        if self._cluster():
            self._refresh_slot_map()
            by_node: dict[str, str] = {}
            for key, node in touched.values():
                if node == "?":
                    raise StateWritesLost(f"a state write to {key} went to a primary the client could not "
                                          "name afterwards (a failover under way)")
                by_node.setdefault(node, key)
            for node, key in sorted(by_node.items()):
                self._sync_cluster_node(node, key)
        else:
            self._sync_lone(next(iter(touched.values()))[0])

    # --- a lone server ----------------------------------------------------------------------------
    def _lone_needed(self, client: redis.Redis) -> int:
        if self.replicas is not None:
            return self.replicas
        now = time.monotonic()
        if self._lone_replicas is None or now - self._lone_replicas[0] > REPLICA_COUNT_TTL_S:
            try:
                count = int(client.info("replication").get("connected_slaves", 0))
            except redis.RedisError:
                count = self._lone_replicas[1] if self._lone_replicas else 0
            self._lone_replicas = (now, count)
        return min(1, self._lone_replicas[1])

    def _sync_lone(self, key: str) -> None:
        client = self._client()
        need = self._lone_needed(client)
        if need == 0:
            return
        deadline = time.monotonic() + self.deadline_s
        while True:
            try:
                acked = self._set_and_wait(client, key, need)
            except TRANSIENT as exc:
                raise StateWritesLost(f"Redis stopped answering after state writes, before a replica "
                                      f"acknowledged them ({exc!r})") from exc
            if acked >= need:
                return
            self._lone_replicas = None  # read the replica count again
            need = self._lone_needed(client)
            if need == 0:
                return
            if time.monotonic() > deadline:
                raise StateUnavailableError(f"Redis: {acked} of {need} replicas acknowledged the state writes "
                                            f"within {self.deadline_s:.0f}s (redis.wait_replicas)")

    # --- a cluster --------------------------------------------------------------------------------
    def _refresh_slot_map(self) -> None:
        """Re-read the slot map every REPLICA_COUNT_TTL_S: redis-py re-reads it only after an error, and a
        replica that joined later (a failed primary back as a replica) counts only once it is in the map."""
        now = time.monotonic()
        if now - self._map_read_at > REPLICA_COUNT_TTL_S:
            self._map_read_at = now
            try:
                self._client().nodes_manager.initialize()
            except (redis.RedisError, redis.exceptions.RedisClusterException):  # next time; the sync goes on
                pass

    def _sync_cluster_node(self, node: str, key: str) -> None:
        client = self._client()
        deadline = time.monotonic() + self.deadline_s
        acked, need, delay = 0, 1, 0.05
        while True:
            try:
                owners = client.nodes_manager.slots_cache.get(client.keyslot(key)) or []
                if not owners or owners[0].name != node:
                    raise StateWritesLost(f"the primary {node} took state writes (slot of {key}) and no longer "
                                          f"serves them ({owners[0].name if owners else 'nobody'} does): a failover "
                                          "before a replica acknowledged them")
                need = self.replicas if self.replicas is not None else min(1, len(owners) - 1)
                if need == 0:
                    return
                acked = self._set_and_wait(client.get_redis_connection(owners[0]), key, need)
                if acked >= need:
                    return
            except (redis.exceptions.MovedError, *TRANSIENT) as exc:
                if isinstance(exc, StateWritesLost):
                    raise
                acked = -1
            if time.monotonic() > deadline:
                raise StateUnavailableError(f"Redis Cluster node {node}: {max(acked, 0)} of {need} replicas "
                                            f"acknowledged the state writes within {self.deadline_s:.0f}s")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            try:
                client.nodes_manager.initialize()  # the slot map again: a failover, a replica gone
            except (redis.RedisError, redis.exceptions.RedisClusterException):
                pass

    def _set_and_wait(self, node: redis.Redis, key: str, need: int) -> int:
        pipe = node.pipeline(transaction=False)
        pipe.set(f"{self.prefix}{{{hash_tag(key)}}}:sync", b"1", px=SENTINEL_TTL_MS)
        pipe.wait(need, self.timeout_ms)
        self.waits += 1
        return int(pipe.execute()[1])
