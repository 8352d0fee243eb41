"""Redis Cluster: telling a cluster node from a lone server, the cluster client, and what the cluster looks like.

A run's ``--redis-url`` may name any node of a cluster (``redis://HOST:PORT/0``): :func:`cluster_enabled`
asks it (``INFO cluster``), :func:`open_cluster` builds redis-py's ``RedisCluster`` from the same URL
(db must be 0: a cluster has one database). :func:`check_cluster` is the preflight of a cluster (every
slot served, every primary answering), :func:`primaries` and :func:`scan_keys` what ``expstream status``
and the tests read of one. The key layout that spreads a run over the shards: docs/redis.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from expstream.config.redaction import redact_url
from expstream.errors import ConfigError

__all__ = ["TRANSIENT", "SLOTS", "cluster_enabled", "open_cluster", "check_cluster", "primaries", "scan_keys",
           "node_of_key", "cluster_db_error"]

#: Hash slots of a Redis Cluster.
SLOTS = 16384

#: What a failover, a restart or a network blip raises: retried with backoff (expstream/state/connection.py).
#: A cluster answers CLUSTERDOWN / TRYAGAIN while a failover is under way, and a demoted primary READONLY.
TRANSIENT: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError,
    redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.ReadOnlyError,
    redis.exceptions.SlotNotCoveredError, redis.exceptions.ClusterError, redis.exceptions.MasterDownError,
    # the cluster client's own "cannot reach any node / slot map incomplete" while a failover is under way
    redis.exceptions.RedisClusterException,
)

log = logging.getLogger("expstream.state")

_FIX = ("run `redis-cli -h HOST -p PORT cluster info` and `--cluster check HOST:PORT`; "
        "`redis-cli --cluster fix HOST:PORT` assigns uncovered slots")


def cluster_enabled(client: redis.Redis, url: str = "") -> bool:
    """True when the server ``client`` talks to is a Redis Cluster node (``INFO cluster``: ``cluster_enabled:1``).
    A cluster node refusing the URL's database (``SELECT``: a cluster has only database 0): a ConfigError."""
    try:
        return bool(int(client.info("cluster").get("cluster_enabled", 0)))
    except redis.ResponseError as exc:
        if "SELECT is not allowed in cluster mode" in str(exc):
            raise cluster_db_error(url, int(client.connection_pool.connection_kwargs.get("db", 0) or 0)) from exc
        if "unknown command" in str(exc).lower() or str(exc).startswith("NOPERM"):
            client.ping()  # INFO renamed away or not granted (a managed Redis): taken for a lone server
            return False
        raise


def cluster_db_error(url: str, db: int) -> ConfigError:
    return ConfigError(f"Redis at {redact_url(url)} is a cluster node and a cluster has only database 0, "
                       f"the URL asks for database {db}", field="--redis-url",
                       fix="end the URL with /0 (redis://HOST:PORT/0)")


def open_cluster(url: str, connect_timeout_s: float, socket_timeout_s: float) -> RedisCluster:
    """redis-py's cluster client for ``url`` (any node), with no retries of its own: the caller's policy
    retries, and redis-py refreshes its slot map after a connection error or a MOVED reply."""
    db = int(redis.connection.parse_url(url).get("db", 0) or 0)
    if db != 0:
        raise cluster_db_error(url, db)
    return RedisCluster.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
                                 retry=Retry(NoBackoff(), 0), decode_responses=False, health_check_interval=0,
                                 require_full_coverage=False)


def node_of_key(client: RedisCluster, key: str) -> str:
    """``host:port`` of the primary that owns ``key``'s slot in the client's slot map."""
    return client.get_node_from_key(key).name


def primaries(client: RedisCluster) -> list[str]:
    """``host:port`` of every primary the client's slot map knows, sorted."""
    return sorted(n.name for n in client.get_primaries())


def scan_keys(client: redis.Redis | RedisCluster, patterns: list[str]) -> Iterator[bytes]:
    """Every key matching one of ``patterns``: on a cluster over every primary (SCAN is per node)."""
    nodes = ([client.get_redis_connection(n) for n in client.get_primaries()] if isinstance(client, RedisCluster)
             else [client])
    for node in nodes:
        for pattern in patterns:
            yield from node.scan_iter(match=pattern, count=1000)


def check_cluster(client: redis.Redis, url: str, timeout_s: float) -> list[str]:
    """Preflight of the cluster the node behind ``client`` belongs to: every one of the 16384 slots
    served by a primary that answers PING. Returns the primaries (``host:port``); a ConfigError naming
    the node and the fix otherwise (one line)."""
    shown = redact_url(url)
    db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
    if db != 0:
        raise cluster_db_error(url, db)
    covered = 0
    owners: dict[str, tuple[str, int]] = {}
    alone: set[str] = set()
    for start, end, primary, *replicas in client.execute_command("CLUSTER SLOTS"):
        covered += int(end) - int(start) + 1
        host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
        owners[f"{host}:{int(primary[1])}"] = (host, int(primary[1]))
        if not replicas:
            alone.add(f"{host}:{int(primary[1])}")
    if covered < SLOTS:
        info = client.execute_command("CLUSTER INFO")
        state = info.decode() if isinstance(info, bytes) else str(info)
        line = next((x for x in state.splitlines() if x.startswith("cluster_state")), "cluster_state:?").strip()
        raise ConfigError(f"the Redis Cluster of {shown} serves {covered} of {SLOTS} hash slots "
                          f"({SLOTS - covered} uncovered, {line})", field="--redis-url", fix=_FIX)
    kw = client.connection_pool.connection_kwargs
    for name, (host, port) in sorted(owners.items()):
        node = redis.Redis(host=host, port=port, password=kw.get("password"), username=kw.get("username"),
                           socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        try:
            node.ping()
        except redis.RedisError as exc:
            raise ConfigError(f"Redis Cluster node {name} (primary of the cluster of {shown}) refuses: "
                              f"{type(exc).__name__}: {exc}", field="--redis-url",
                              fix=f"start or repair {name}, or wait for its replica to take over; " + _FIX) from exc
        finally:
            node.close()
    if alone:  # not an error (a test cluster, a cache): said once, since the durability wait cannot help there
        log.warning("Redis Cluster of %s: primaries without a replica: %s; the state written there is lost if "
                    "one dies (docs/redis.md \"Durability\")", shown, ", ".join(sorted(alone)))
    return sorted(owners)
