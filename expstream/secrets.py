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
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["REDACTED", "REDIS_URL_ENV", "redact_url", "url_password", "write_private", "env_redis_url"]

#: What a password is replaced with when shown.
REDACTED = "***"
#: The environment variable that carries the real Redis URL to stage processes (and that
#: ``expstream run|stage`` read when ``--redis-url`` is absent, so a password never has to be typed
#: on a command line).
REDIS_URL_ENV = "EXPSTREAM_REDIS_URL"
# Query parameters redis-py accepts that carry a secret.
_SECRET_QUERY_KEYS = frozenset({"password"})


def url_password(url: str | None) -> str | None:
    """The password a URL carries (userinfo or ``?password=``), else None."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        if parts.password:
            return unquote(parts.password)
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key.lower() in _SECRET_QUERY_KEYS and value:
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


def env_redis_url() -> str | None:
    """The Redis URL from :data:`REDIS_URL_ENV` (None when unset or empty)."""
    return os.environ.get(REDIS_URL_ENV) or None


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
