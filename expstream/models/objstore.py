"""An S3-compatible object store, for what is too big for Kafka and must reach other hosts.

The weight store (expstream/train/objweights.py) and the blob store (expstream/models/blobs.py)
accept ``s3://BUCKET[/PREFIX]`` besides a directory; both talk to the store through this module,
which wraps **obstore** (Python bindings of the Apache Arrow project's Rust ``object_store`` crate):
one self-contained wheel, no botocore, conditional puts (``If-None-Match: *``: a write-once object
whose second writer loses, the atomic step of a weight publication) and the standard AWS
configuration. Why not fsspec/s3fs: it pulls aiobotocore and botocore (pinned to each other, a
frequent resolver conflict with boto3 users), has no create-only put, and its caching file-system
layer is more than get/put/list/delete by key needs. (docs/deploy.md "Adding machines".)

Configuration comes only from the environment, the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_SESSION_TOKEN``),
which obstore reads itself; nothing of it is logged or written to the run directory (errors name
the ``s3://`` URL, never a key). An ``http://`` endpoint (MinIO, a test server) is allowed because
the operator wrote it.

Errors: a missing object is :class:`ObjectMissingError` (not retriable: the caller decides what it
means: a dead-lettered sample, a version gone); anything else (unreachable, 5xx, timeouts) is
retried here with backoff (:data:`READ_RETRY`) and then raised as :class:`ObjectStoreError`,
retriable (the stage runner retries the record later; nothing is half-read: a get returns all the
bytes or raises). A refused credential is :class:`ObjectStoreAuthError`, retried the same way.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

from expstream.config.storeurl import StoreLocation, parse_store
from expstream.errors import ExpstreamError
from expstream.retry import Attempt, Policy, retry

__all__ = ["ObjectStore", "ObjectStoreError", "ObjectStoreAuthError", "ObjectMissingError", "ObjectExistsError",
           "READ_RETRY", "open_object_store", "ENV_VARS", "STORE_FIX"]

log = logging.getLogger("expstream.objstore")
T = TypeVar("T")

#: The variables the store is configured from (shown by name in errors, never by value).
ENV_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
STORE_FIX = ("check the bucket exists and AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
             "AWS_DEFAULT_REGION are set for it in the environment of every expstream process")
# Why these: a store that is restarting (MinIO in docker-compose) answers again within seconds; a
# minute of backoff rides that out, and a longer outage is the stage runner's retry (the record stays).
READ_RETRY = Policy(base_s=0.2, cap_s=5.0, give_up_s=60.0)
# obstore's own retries are kept short so that ours (logged, bounded) decide.
_CLIENT_RETRY = {"max_retries": 2, "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                                               "max_backoff": datetime.timedelta(seconds=1), "base": 2.0},
                 "retry_timeout": datetime.timedelta(seconds=10)}


class ObjectStoreError(ExpstreamError):
    """The object store did not answer or failed a request; retriable (it may come back)."""

    retriable = True


class ObjectStoreAuthError(ObjectStoreError):
    """The store refused the credentials or the request (403/401). Retried like an outage all the same:
    the records wait (nothing is dead-lettered for a store's configuration) until the credentials are
    fixed; ``expstream run``'s preflight refuses them before anything starts."""


class ObjectMissingError(ExpstreamError):
    """The object is not in the store. Not retriable here; the caller says what it means."""

    retriable = False


class ObjectExistsError(ExpstreamError):
    """A create-only put found the object already there (write-once)."""

    retriable = False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _translate(exc: Exception, url: str) -> Exception:
    """obstore's exception as ours (missing, exists, auth, or a retriable failure), naming ``url``."""
    from obstore import exceptions as ox

    if isinstance(exc, (FileNotFoundError, ox.NotFoundError)):
        return ObjectMissingError(f"{url} is not in the object store")
    if isinstance(exc, (FileExistsError, ox.AlreadyExistsError, ox.PreconditionError)):
        return ObjectExistsError(f"{url} already exists (written once)")
    if isinstance(exc, (PermissionError, ox.PermissionDeniedError, ox.UnauthenticatedError)):
        return ObjectStoreAuthError(f"the object store refused access to {url} ({_first_line(exc)})")
    if isinstance(exc, (ox.BaseError, OSError, TimeoutError, ConnectionError)):
        return ObjectStoreError(f"object store request for {url} failed ({type(exc).__name__}: {_first_line(exc)})")
    return exc


class ObjectStore:
    """Keys under ``s3://bucket/prefix``: get (all bytes or an error), put (optionally create-only), list,
    delete, exists. Thread-safe (obstore's client is); one per process, opened after any fork."""

    def __init__(self, location: StoreLocation, *, read_retry: Policy = READ_RETRY,
                 client_retry: dict[str, Any] | None = None, timeout_s: float | None = None) -> None:
        from obstore.store import S3Store

        if location.kind != "s3":
            raise ValueError(f"ObjectStore takes an s3:// location, got {location.url!r}")
        self.location = location
        self.read_retry = read_retry
        client: dict[str, Any] = {}
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            client["allow_http"] = True  # the operator's own endpoint (MinIO on a LAN, a test server)
        if timeout_s is not None:
            client["timeout"] = f"{timeout_s:g}s"
            client["connect_timeout"] = f"{timeout_s:g}s"
        self._store = S3Store(location.bucket, prefix=location.prefix or None, client_options=client,
                              retry_config=client_retry or _CLIENT_RETRY)

    def __repr__(self) -> str:
        return f"ObjectStore({self.location.url!r})"

    def url(self, key: str = "") -> str:
        """``s3://bucket/prefix/key``: what errors and logs name."""
        return self.location.join(key).url if key else self.location.url

    def _call(self, what: str, key: str, fn: Callable[[], T], policy: Policy | None) -> T:
        url = self.url(key)

        def once() -> T:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - translated: ours propagate, others are re-raised as they are
                raise _translate(exc, url) from exc

        def on_retry(a: Attempt) -> None:
            log.warning("object store: %s %s failed (%s), retry %d in %.1f s", what, url, a.exc, a.number, a.delay_s)

        if policy is None:
            return once()
        return retry(once, policy=policy, retriable=lambda e: isinstance(e, ObjectStoreError) and e.retriable,
                     on_retry=on_retry)

    def get(self, key: str) -> bytes:
        """Every byte of ``key`` (retried with backoff); ObjectMissingError when it is not there."""
        import obstore

        return self._call("get", key, lambda: bytes(obstore.get(self._store, key).bytes()), self.read_retry)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        """Write ``key`` in one request; ``create_only``: ObjectExistsError when it is already there."""
        import obstore

        mode = "create" if create_only else "overwrite"
        self._call("put", key, lambda: obstore.put(self._store, key, bytes(data), mode=mode), self.read_retry)

    def exists(self, key: str) -> bool:
        import obstore

        try:
            self._call("head", key, lambda: obstore.head(self._store, key), self.read_retry)
        except ObjectMissingError:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (relative to the store's prefix), sorted."""
        import obstore

        def keys() -> list[str]:
            out: list[str] = []
            for chunk in obstore.list(self._store, prefix or None):
                out.extend(str(meta["path"]) for meta in chunk)
            return sorted(out)

        return self._call("list", prefix, keys, self.read_retry)

    def delete(self, key: str) -> None:
        """Delete ``key``; a key that is not there is not an error (S3's own rule)."""
        import obstore

        try:
            self._call("delete", key, lambda: obstore.delete(self._store, key), self.read_retry)
        except ObjectMissingError:
            pass

    def probe(self) -> None:
        """One list request (no retries of ours): raises when the bucket cannot be reached or read."""
        import obstore

        self._call("list", "", lambda: obstore.list_with_delimiter(self._store, None), None)


def open_object_store(where: str | StoreLocation, field: str, **kwargs: Any) -> ObjectStore:
    """The object store of ``where`` (an ``s3://`` URL or location); ``field`` names the setting in errors."""
    loc = where if isinstance(where, StoreLocation) else parse_store(where, field)
    return ObjectStore(loc, **kwargs)
