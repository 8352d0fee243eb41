"""The connection to a run's Redis: one redis-py client without retries of its own, and the retry policy.

:class:`RedisConnection` is what :class:`~expstream.state.redis_state.RedisState` is built on: every
command goes through :meth:`RedisConnection._call`, which retries connection errors and timeouts with
bounded exponential backoff (a Redis restart or failover) and turns a refused password into an
:class:`~expstream.errors.AuthError` at once. Kept apart from the state's keys and scripts so that the
outage behaviour (docs/deploy.md, ``tests/test_outages.py``) is read in one place.

A URL that points at any node of a Redis Cluster works as it is: :meth:`RedisConnection.connect` asks
the node (``INFO cluster``) and, on ``cluster_enabled:1``, swaps the plain client for redis-py's
``RedisCluster`` (same timeouts, no retries of its own either). docs/redis.md has the key layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Self, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from expstream.config.redaction import redact_url
from expstream.errors import AuthError, StateUnavailableError
from expstream.retry import Attempt, Policy, retry
from expstream.state.cluster import TRANSIENT, cluster_enabled, open_cluster

__all__ = [
    "RedisConnection",
    "is_auth_error",
    "RETRY_BASE_DELAY_S",
    "RETRY_MAX_DELAY_S",
    "RETRY_DEADLINE_S",
    "SOCKET_TIMEOUT_S",
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


class RedisConnection:
    """A redis-py client (bytes replies, no retries of its own) with this module's retry policy and
    ``scripts`` (name -> Lua source) registered. It does not ping: the caller decides when to connect.
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        retry_deadline_s: float = RETRY_DEADLINE_S,
        scripts: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self.retry_deadline_s = float(retry_deadline_s)
        # redis-py's own retry is switched off: this class owns the policy (see _call).
        self._r = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
            health_check_interval=0,
        )
        self._sources = dict(scripts or {})
        self._scripts = {name: self._r.register_script(src) for name, src in self._sources.items()}
        #: True once :meth:`connect` found a Redis Cluster behind the URL (``client`` is then a RedisCluster)
        self.cluster = False
        self._timeouts = (connect_timeout_s, socket_timeout_s)

    def connect(self) -> None:
        """Ping the server (with :meth:`_call`'s retries); on a cluster node, switch to the cluster client."""
        if self._call("connect", lambda: cluster_enabled(self._r, self.url)):
            self._r.close()
            self._r = open_cluster(self.url, *self._timeouts)
            self.cluster = True
            self._scripts = {name: self._r.register_script(src) for name, src in self._sources.items()}

    # --- plumbing ------------------------------------------------------------------------------
    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (bytes replies, no retries of its own)."""
        return self._r

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run ``fn`` retrying connection errors/timeouts with bounded exponential backoff."""

        def give_up(a: Attempt) -> T:
            raise StateUnavailableError(f"Redis at {redact_url(self.url)} unavailable for {what} after {a.number} attempts "
                                        f"({self.retry_deadline_s:.1f}s): {a.exc!r}") from a.exc

        transient = TRANSIENT
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
                kw = redis.connection.parse_url(self.url)
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


def is_auth_error(exc: BaseException) -> bool:
    """True for Redis refusing the credentials: a wrong password (WRONGPASS), none given (NOAUTH),
    or a password given to a server without one. Never retriable."""
    if isinstance(exc, redis.AuthenticationError):
        return True
    text = str(exc)
    return isinstance(exc, redis.ResponseError) and (text.startswith(("WRONGPASS", "NOAUTH"))
                                                     or "AUTH <password> called without" in text)
