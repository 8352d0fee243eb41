"""Where a store lives: a local directory or an object-store URL, told apart once, by one parser.

``train.weight_store`` and ``run.blob_store`` (docs/deploy.md "Adding machines") take either a
directory path (the default: under the run's ``--output``) or ``s3://BUCKET[/PREFIX]``: any
S3-compatible store (AWS S3, MinIO, Ceph, GCS's S3 API), reached with the standard AWS environment
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``), never with credentials in the topology.

:func:`parse_store` is the one place that decides which: a value that starts like a URL scheme
(``s3:``, ``s3:/bucket``, ``gs://b``, ``http://...``) but is not a valid ``s3://`` or ``file://``
URL is a ConfigError naming the field, never a local directory called ``s3:`` in the working
directory (what ``--set train.weight_store=s3:`` used to create). Pure: no I/O, no imports beyond
the standard library, so the topology checks it when it is loaded (exit 2 before anything starts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from expstream.errors import ConfigError

__all__ = ["StoreLocation", "parse_store", "is_object_url", "S3_SCHEME"]

S3_SCHEME = "s3://"
# A scheme as RFC 3986 spells it, followed by ':' (a Windows drive letter "C:" is one letter: not a scheme).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
# S3 bucket names: 3-63 of lowercase letters, digits, dots and hyphens, starting and ending alphanumeric.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_FIX = ("give a directory path, or s3://BUCKET[/PREFIX] with the endpoint and credentials in AWS_ENDPOINT_URL, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_DEFAULT_REGION")


@dataclass(frozen=True)
class StoreLocation:
    """A parsed store value: ``kind`` "dir" (``path``) or "s3" (``bucket``, ``prefix`` without slashes at
    either end, "" for the bucket's root)."""

    kind: str
    path: str = ""
    bucket: str = ""
    prefix: str = ""

    @property
    def url(self) -> str:
        """The canonical text: the directory path, or ``s3://bucket/prefix``."""
        if self.kind == "dir":
            return self.path
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{S3_SCHEME}{self.bucket}"

    def join(self, *parts: str) -> StoreLocation:
        """The location ``parts`` below this one (a sub-prefix, or a sub-directory)."""
        if self.kind == "dir":
            return StoreLocation("dir", path="/".join([self.path.rstrip("/"), *parts]))
        prefix = "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))
        return StoreLocation("s3", bucket=self.bucket, prefix=prefix)


def is_object_url(text: str | None) -> bool:
    """True when ``text`` names an object store (``s3://``), not a directory."""
    return bool(text) and str(text).startswith(S3_SCHEME)


def parse_store(text: str, field: str) -> StoreLocation:
    """``text`` as a StoreLocation; ConfigError (naming ``field`` and the fix) when it looks like a URL but
    is not one this build can open, or is empty."""
    value = str(text).strip()
    if not value:
        raise ConfigError("the store location is empty", field=field, fix=_FIX)
    match = _SCHEME.match(value)
    if match is None:
        return StoreLocation("dir", path=str(text))
    scheme = match.group(1).lower()
    if scheme == "file":
        if not value.startswith("file://") or not value[len("file://"):]:
            raise ConfigError(f"{value!r} is not a file:// URL", field=field, fix="write file:///ABSOLUTE/PATH")
        return StoreLocation("dir", path=value[len("file://"):])
    if scheme != "s3":
        raise ConfigError(f"{value!r}: the scheme {scheme}: is not supported (s3:// and directories are)",
                          field=field, fix=_FIX)
    if not value.startswith(S3_SCHEME):
        raise ConfigError(f"{value!r} is not an s3:// URL (it would have been a local directory named "
                          f"{value.split('/')[0]!r})", field=field, fix=_FIX)
    rest = value[len(S3_SCHEME):]
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        raise ConfigError("an s3:// URL takes no credentials or port (they would be written to the run "
                          "directory)", field=field, fix=_FIX)
    if not _BUCKET.match(bucket):
        raise ConfigError(f"{value!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, dots, "
                          "hyphens)", field=field, fix=_FIX)
    if any(p in (".", "..") for p in prefix.split("/")) or "//" in prefix.strip("/"):
        raise ConfigError(f"{value!r}: the prefix has an empty, '.' or '..' part", field=field, fix=_FIX)
    return StoreLocation("s3", bucket=bucket, prefix=prefix.strip("/"))
