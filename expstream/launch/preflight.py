"""Start-up checks of ``expstream run`` that need the outside world: the output directory and the
services given on the command line. Each failure is one ConfigError line (exit code 2) within
seconds, instead of a traceback after half a minute of retries deep inside the run.

Protocol (run.py calls :func:`check_output_dir` and :func:`check_services` after the topology and
the prompt file are read, before models are built, the fork server or any server or stage starts):

1. ``--output``: the directory (or the nearest existing parent it would be created in) is a
   writable directory.
2. Kafka (``--bootstrap-servers``): a TCP connect to every bootstrap address, then a metadata
   request with kafka-python using the topology's kafka block (so SSL/SASL settings apply), each
   within :data:`PREFLIGHT_TIMEOUT_S`.
3. Redis (``--redis-url``): a PING within :data:`PREFLIGHT_TIMEOUT_S`. A refused password
   (WRONGPASS, NOAUTH) is an :class:`~expstream.errors.AuthError` at once, never retried.

Services that ``expstream run`` starts itself (no address given) are not checked here: the local
server start-up waits for them to answer.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from expstream.config.kafka import KafkaConfig
from expstream.config.redaction import redact_url
from expstream.errors import AuthError, ConfigError

__all__ = ["PREFLIGHT_TIMEOUT_S", "check_output_dir", "check_kafka", "check_redis", "check_services"]

log = logging.getLogger("expstream.preflight")

# Why 5 s: a reachable broker or Redis answers a connect and a metadata request/PING in
# milliseconds on a LAN and well under a second across regions or over TLS; a dead address would
# otherwise cost the 30 s bootstrap timeout plus retries (34 s measured) before any message.
PREFLIGHT_TIMEOUT_S = 5.0

_KAFKA_FIX = "check --bootstrap-servers (HOST:PORT of a running broker), or leave it out to start a local one"
#: The advice of commands that read from or publish to a broker that must already run (record, replay --into).
KAFKA_FIX_EXISTING = "check --bootstrap-servers: HOST:PORT of the running broker (is it up?)"
_REDIS_FIX = "check --redis-url (redis://[:PASSWORD@]HOST:PORT/DB), or leave it out to start a local redis-server"


def check_output_dir(path: str | Path, flag: str = "--output") -> None:
    """Step 1: ``path`` is, or can be created as, a writable directory. Creates nothing."""
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} exists and is not a directory", field=flag,
                          fix="give a directory path for the run's outputs")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot create {target}: {parent} is a file, not a directory", field=flag,
                          fix="give a directory path whose parents are directories")
    if not os.access(parent, os.W_OK | os.X_OK):
        what = "" if parent == target else f"cannot create {target}: "
        raise ConfigError(f"{what}{parent} is not writable", field=flag,
                          fix="give a directory you can write to (or fix its permissions)")


def _tcp_reason(host: str, port: int, timeout_s: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror:
        return f"unknown host {host!r}"
    except TimeoutError:
        return "no answer"
    except ConnectionRefusedError:
        return "connection refused"
    except OSError as exc:
        return exc.strerror.lower() if exc.strerror else str(exc)


def _split_hostport(address: str, default_port: int) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep:
        return address.strip(), default_port
    if not port.isdigit():
        raise ValueError(address)
    return host.strip("[]"), int(port)


def _kafka_auth_errors(kafka_errors: object) -> tuple[type[BaseException], ...]:
    names = ("SaslAuthenticationFailedError", "AuthenticationFailedError", "AuthenticationMethodNotSupported")
    return tuple(t for n in names if isinstance(t := getattr(kafka_errors, n, None), type))


def check_kafka(bootstrap: str, cfg: KafkaConfig, timeout_s: float = PREFLIGHT_TIMEOUT_S, *,
                fix: str = _KAFKA_FIX) -> None:
    """Step 2: some bootstrap address accepts TCP, and the cluster answers a metadata request. ``fix``: the
    advice in the error (commands that never start a broker of their own pass theirs)."""
    addresses = [a.strip() for a in bootstrap.split(",") if a.strip()]
    if not addresses:
        raise ConfigError("empty broker address", field="--bootstrap-servers", fix=fix)
    reasons: list[str] = []
    for address in addresses:
        try:
            host, port = _split_hostport(address, 9092)
        except ValueError:
            raise ConfigError(f"{address!r} is not HOST:PORT", field="--bootstrap-servers", fix=fix) from None
        reason = _tcp_reason(host, port, timeout_s)
        if reason is None:
            break
        reasons.append(reason)
    else:
        raise ConfigError(f"cannot reach Kafka at {bootstrap} ({'; '.join(sorted(set(reasons)))}) within "
                          f"{timeout_s:g}s", field="--bootstrap-servers", fix=fix)
    from kafka import KafkaAdminClient
    from kafka import errors as kafka_errors

    ms = int(timeout_s * 1000)
    kw = {**cfg.client_kwargs("admin"), "bootstrap_timeout_ms": ms, "request_timeout_ms": ms}
    admin = None
    try:
        admin = KafkaAdminClient(bootstrap_servers=addresses, **kw)
        admin.list_topics()
    except _kafka_auth_errors(kafka_errors) as exc:
        raise AuthError(f"Kafka at {bootstrap} refused the credentials ({exc})", field="kafka.extra",
                        fix="check the sasl_* settings of the kafka block") from exc
    except Exception as exc:  # noqa: BLE001 - any failure here means "not a usable broker": say so in one line
        raise ConfigError(f"{bootstrap} accepts connections but answered no Kafka metadata request within "
                          f"{timeout_s:g}s ({type(exc).__name__}: {exc})", field="--bootstrap-servers",
                          fix=fix + "; is it a Kafka broker, with kafka.security_protocol matching?") from exc
    finally:
        if admin is not None:
            admin.close()


def check_redis(url: str, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Step 3: Redis answers PING; a refused password is an AuthError at once. A cluster node: every hash
    slot served and every primary answering (expstream/state/cluster.py), else one line naming the node."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from expstream.state.cluster import check_cluster, cluster_enabled
    from expstream.state.connection import is_auth_error

    shown = redact_url(url)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0), health_check_interval=0)
    except ValueError as exc:
        raise ConfigError(f"{shown!r} is not a Redis URL ({exc})", field="--redis-url", fix=_REDIS_FIX) from exc
    kw = client.connection_pool.connection_kwargs
    try:
        if "host" in kw and (reason := _tcp_reason(kw["host"], int(kw.get("port", 6379)), timeout_s)) is not None:
            raise ConfigError(f"cannot reach Redis at {shown} ({reason}) within {timeout_s:g}s", field="--redis-url",
                              fix=_REDIS_FIX)
        # INFO first: a cluster node refuses the connection's SELECT of a database other than 0 (named as such)
        if cluster_enabled(client, url):  # a cluster node: every slot served, every primary answering
            log.info("preflight: Redis at %s is a cluster node; primaries %s", shown,
                     ", ".join(check_cluster(client, url, timeout_s)))
        else:
            client.ping()
    except redis.RedisError as exc:
        if is_auth_error(exc):
            what = "refused the password" if kw.get("password") else "requires a password and the URL has none"
            raise AuthError(f"Redis at {shown} {what} ({exc})", field="--redis-url",
                            fix="put the server's password in the URL: redis://:PASSWORD@HOST:PORT/DB") from exc
        raise ConfigError(f"Redis at {shown} did not answer PING within {timeout_s:g}s ({exc})", field="--redis-url",
                          fix=_REDIS_FIX) from exc
    finally:
        client.close()


def check_services(bootstrap: str | None, redis_url: str | None, cfg: KafkaConfig,
                   timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Steps 2-3 for the services given on the command line (None: started locally, not checked)."""
    if bootstrap:
        check_kafka(bootstrap, cfg, timeout_s)
        log.info("preflight: Kafka at %s answers", bootstrap)
    if redis_url:
        check_redis(redis_url, timeout_s)
        log.info("preflight: Redis at %s answers", redact_url(redis_url))
