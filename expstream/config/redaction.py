"""Secrets in service addresses: redact them where they are shown, keep them out of argv and
world-readable files.

A Redis URL may carry a password (``redis://:PASS@host:6379/0``, ``redis://user:PASS@...``,
``rediss://...``, or ``?password=PASS``). The rules, applied by ``expstream run`` and
``expstream stage``:

1. Everything *shown* (log lines, error messages, ``services.json``, ``summary.json``) uses
   :func:`redact_url`: the password becomes ``***``, the rest of the address stays readable.
2. A stage process gets the real URL in the environment variable :data:`REDIS_URL_ENV`, never on
   its command line (``/proc/<pid>/cmdline`` is readable by every user; ``/proc/<pid>/environ``
   only by the owner). ``--redis-url`` still works by hand and wins over the variable.
3. A file that must hold a secret (the local redis-server's config with ``requirepass``) is
   created mode 0600 by :func:`write_private`.

The same rules hold for any URL of the topology, such as an http reward source's
(``rewards.sources.judge.url: http://user:PASS@judge:8000`` or ``...?token=PASS``): the topology
files ``expstream run`` writes (``<output>/topology.yaml``, ``<output>/run/topology.yaml``) hold it
redacted (:func:`split_secrets`), and the stage processes get the real values in the environment
variable :data:`TOPOLOGY_SECRETS_ENV` (a JSON object ``{dotted key: value}``), which
:func:`apply_secrets` puts back when a topology is loaded, only where the file holds exactly the
redacted form of that value.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["REDACTED", "REDIS_URL_ENV", "REWARD_TOKEN_ENV", "TOPOLOGY_SECRETS_ENV", "redact_url", "url_password",
           "is_redacted", "write_private", "env_redis_url", "env_reward_token", "split_secrets", "apply_secrets",
           "env_topology_secrets"]

#: What a password is replaced with when shown.
REDACTED = "***"
#: The environment variable that carries the real Redis URL to stage processes (and that
#: ``expstream run|stage`` read when ``--redis-url`` is absent, so a password never has to be typed
#: on a command line).
REDIS_URL_ENV = "EXPSTREAM_REDIS_URL"
#: The bearer token of the reward JSON API: `expstream serve-reward` requires it when set, and an
#: http reward source sends it (docs/reward.md "Authentication"). Only ever read from the environment.
REWARD_TOKEN_ENV = "EXPSTREAM_REWARD_TOKEN"
#: The variable carrying the topology's secret values (its URLs' credentials) to stage processes.
TOPOLOGY_SECRETS_ENV = "EXPSTREAM_TOPOLOGY_SECRETS"
# Query parameters redis-py accepts that carry the password.
_PASSWORD_QUERY_KEYS = frozenset({"password"})
# Query parameters that carry a secret, redacted when shown (a judge's ?token=, ?api_key=, ...).
_SECRET_QUERY_KEYS = _PASSWORD_QUERY_KEYS | frozenset(
    {"token", "access_token", "api_key", "apikey", "key", "secret", "auth", "sig", "signature"})


def url_password(url: str | None) -> str | None:
    """The password a URL carries (userinfo or ``?password=``), else None."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        if parts.password:
            return unquote(parts.password)
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key.lower() in _PASSWORD_QUERY_KEYS and value:
                return value
    except ValueError:
        return None
    return None


def redact_url(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***`` (``redis://:***@host:6379/0``); unchanged
    when it holds none. An address that cannot be parsed is replaced whole rather than shown."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:  # "user:pass@" or ":pass@"; a lone "user@" is a user name
            userinfo, _, hostport = netloc.rpartition("@")
            netloc = f"{userinfo.partition(':')[0]}:{REDACTED}@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
                query = urlencode([(k, REDACTED if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs],
                                  safe="*")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<unparsable address, redacted>"


def is_redacted(url: str | None) -> bool:
    """Whether ``url`` holds a ``***`` where :func:`redact_url` puts one (its secret was removed)."""
    if not url:
        return False
    try:
        parts = urlsplit(url)
        if parts.password == REDACTED:
            return True
        return any(k.lower() in _SECRET_QUERY_KEYS and v == REDACTED
                   for k, v in parse_qsl(parts.query, keep_blank_values=True))
    except ValueError:
        return False


def _strings(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, value)`` of every string in a YAML tree of mappings (lists are left alone)."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, str):
                out.append((dotted, value))
            else:
                out.extend(_strings(value, dotted))
    return out


def _node_for(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any], str] | None:
    *path, last = dotted.split(".")
    node: Any = raw
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node, last) if isinstance(node, dict) else None


def split_secrets(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``(a copy of raw with every URL's credentials redacted, {dotted key: the real value})``."""
    shown = copy.deepcopy(raw)
    secrets: dict[str, str] = {}
    for dotted, value in _strings(raw):
        if "://" in value and redact_url(value) != value:
            secrets[dotted] = value
            found = _node_for(shown, dotted)
            if found is not None:
                found[0][found[1]] = redact_url(value)
    return shown, secrets


def apply_secrets(raw: dict[str, Any], secrets: Mapping[str, str]) -> int:
    """Put each secret value back at its dotted key where ``raw`` holds its redacted form; returns how many."""
    count = 0
    for dotted, value in secrets.items():
        found = _node_for(raw, dotted)
        if found is not None and found[0].get(found[1]) == redact_url(value):
            found[0][found[1]] = value
            count += 1
    return count


def env_topology_secrets() -> dict[str, str]:
    """The secrets of :data:`TOPOLOGY_SECRETS_ENV` ({} when unset; a malformed value is a ConfigError)."""
    text = os.environ.get(TOPOLOGY_SECRETS_ENV)
    if not text:
        return {}
    try:
        value = json.loads(text)
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return value
    except ValueError:
        pass
    from expstream.errors import ConfigError

    raise ConfigError(f"${TOPOLOGY_SECRETS_ENV} is not a JSON object of strings", field=TOPOLOGY_SECRETS_ENV,
                      fix='give e.g. {"rewards.sources.judge.url": "http://user:PASS@judge:8000"}, or unset it')


def env_redis_url() -> str | None:
    """The Redis URL from :data:`REDIS_URL_ENV` (None when unset or empty)."""
    return os.environ.get(REDIS_URL_ENV) or None


def env_reward_token() -> str | None:
    """The reward API's bearer token from :data:`REWARD_TOKEN_ENV` (None when unset or empty)."""
    return os.environ.get(REWARD_TOKEN_ENV) or None


def write_private(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (0600), whatever the umask; an existing
    file is truncated and its mode tightened. Returns the path."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        with os.fdopen(fd, "w", closefd=False) as fh:
            fh.write(text)
    finally:
        os.close(fd)
    return path
