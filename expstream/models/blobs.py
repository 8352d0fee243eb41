"""The claim check: large payloads (images, video frames) stored once, records carry references.

A record never carries megabytes of pixels per hop: the feeder puts each image's bytes into a
content-addressed :class:`BlobStore` once and the records carry the reference
``"sha256:<64 hex>"``; each stage that needs the pixels gets the bytes back by reference. The same
bytes always give the same reference (and are stored once), so a redelivered or replayed record
finds its blobs, and a reference is its own integrity check: :meth:`DirectoryBlobStore.get`
verifies the hash of what it reads.

The default store is a directory, ``<run dir>/blobs/`` (DESIGN.md, "The run directory"), laid out
``blobs/<first 2 hex>/<64 hex>``. ``run.blob_store=s3://BUCKET/PREFIX`` puts them in an
S3-compatible object store instead (:class:`ObjectBlobStore`, the same ``<2 hex>/<64 hex>`` keys
under the prefix), so that stages on other hosts read them (docs/deploy.md "Adding machines").
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Protocol

from expstream.config.storeurl import is_object_url
from expstream.errors import ConfigError, PoisonRecordError
from expstream.models.objstore import ObjectExistsError, ObjectMissingError, ObjectStore, open_object_store

REF_PREFIX = "sha256:"
_REF = re.compile(r"^sha256:[0-9a-f]{64}$")


class MissingBlobError(PoisonRecordError):
    """A reference whose bytes are not in the store (or do not hash to it). Not retriable: the
    sample that needs it is dead-lettered with this reason; the rest of its micro-batch goes on."""


def blob_ref(data: bytes) -> str:
    """The content address of ``data``."""
    return REF_PREFIX + hashlib.sha256(data).hexdigest()


def check_ref(ref: str, field: str = "ref") -> str:
    if not isinstance(ref, str) or not _REF.match(ref):
        raise MissingBlobError(f"{field}: {ref!r} is not a blob reference; expected 'sha256:' and 64 lowercase "
                               "hex digits, as written by the feeder")
    return ref


class BlobStore(Protocol):
    def put(self, data: bytes) -> str: ...
    def get(self, ref: str) -> bytes: ...
    def exists(self, ref: str) -> bool: ...


class DirectoryBlobStore:
    """Blobs as files under ``root``; writes are atomic (temporary file, fsync, rename)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"DirectoryBlobStore({str(self.root)!r})"

    def path(self, ref: str) -> Path:
        digest = check_ref(ref)[len(REF_PREFIX):]
        return self.root / digest[:2] / digest

    def put(self, data: bytes) -> str:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"DirectoryBlobStore.put takes bytes, got {type(data).__name__}")
        data = bytes(data)
        ref = blob_ref(data)
        path = self.path(ref)
        if path.is_file() and path.stat().st_size == len(data):
            return ref  # content-addressed: already there
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ref

    def get(self, ref: str) -> bytes:
        path = self.path(ref)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise MissingBlobError(f"blob {ref} is not in {self.root}; the feeder stores every image of a run under "
                                   "<run dir>/blobs (was the run directory moved or pruned?)") from None
        if blob_ref(data) != ref:
            raise MissingBlobError(f"blob {ref} in {self.root} is corrupt (its bytes hash to {blob_ref(data)}); "
                                   "delete it and feed the prompt again")
        return data

    def exists(self, ref: str) -> bool:
        return self.path(ref).is_file()


class ObjectBlobStore:
    """Blobs as objects ``<prefix>/<2 hex>/<64 hex>`` of an S3-compatible store (expstream/models/objstore.py).

    A put is create-only (content-addressed: an object already there holds the same bytes, checked by
    every get); a get is retried with backoff on failures of the store (then a retriable
    ObjectStoreError: the record waits, nothing is dead-lettered for an outage) and a missing or
    corrupt object is a :class:`MissingBlobError` for the sample that needs it.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"ObjectBlobStore({self.store.url()!r})"

    @staticmethod
    def key(ref: str) -> str:
        digest = check_ref(ref)[len(REF_PREFIX):]
        return f"{digest[:2]}/{digest}"

    def put(self, data: bytes) -> str:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"ObjectBlobStore.put takes bytes, got {type(data).__name__}")
        data = bytes(data)
        ref = blob_ref(data)
        try:
            self.store.put(self.key(ref), data, create_only=True)
        except ObjectExistsError:
            pass  # content-addressed: already there
        return ref

    def get(self, ref: str) -> bytes:
        key = self.key(ref)
        try:
            data = self.store.get(key)
        except ObjectMissingError:
            raise MissingBlobError(f"blob {ref} is not in {self.store.url()}; the feeder stores every image of a run "
                                   "there before feeding it (was the bucket or prefix emptied, or does "
                                   "run.blob_store differ between hosts?)") from None
        if blob_ref(data) != ref:
            raise MissingBlobError(f"blob {ref} in {self.store.url()} is corrupt (its bytes hash to {blob_ref(data)}); "
                                   f"delete {self.store.url(key)} and feed the prompt again")
        return data

    def exists(self, ref: str) -> bool:
        return self.store.exists(self.key(ref))


def open_blob_store(path_or_url: str | os.PathLike[str]) -> BlobStore:
    """A store from a directory path, a ``file://`` URL or an ``s3://BUCKET/PREFIX`` URL."""
    text = str(path_or_url)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif is_object_url(text):
        return ObjectBlobStore(open_object_store(text, "run.blob_store"))
    elif "://" in text:
        raise ConfigError(f"blob store {text!r}: only directories, file:// and s3:// URLs are built in",
                          field="run.blob_store", fix="give a directory or s3://BUCKET/PREFIX")
    return DirectoryBlobStore(text)
