"""The recording format: what crossed a topic, record by record, in a run directory.

A run directory holds ``topics/<topic>/partition-<p>.rec``, one append-only file per topic
partition (dead-letter twins ``<topic>.dlq`` included). Written by the run's recorder while the
records flow, by ``expstream record`` from a live deployment, and by ``expstream replay`` for its
outputs; read by replay, show, diff and rewind. The byte layout (documented for readers in other
languages in ``schemas/README.md``, "Recording format"):

1. A file starts with the 8-byte magic ``b"EXPREC\\x00\\x01"`` (format version 1).
2. Then frames, each ``length`` (uint32 big-endian, bytes of the payload), ``crc32`` (uint32
   big-endian, zlib CRC-32 of the payload), then the payload: a msgpack map with the keys
   ``offset`` (int), ``timestamp`` (int, ms since the epoch, the broker's), ``timestamp_type``
   (int, 0 create time, 1 log-append time, -1 unknown), ``key`` (bin or nil), ``headers`` (array of
   ``[name: str, value: bin]``) and ``value`` (bin or nil: the original record bytes, untouched).
3. Frames of one file are in increasing ``offset`` order; a writer appends and flushes whole
   frames only.

A killed writer leaves at most one incomplete frame at the end of a file: readers stop there and
report it (:attr:`PartitionReader.torn_tail`), so a killed run's recording is readable up to its
last complete record. A bad frame *followed by more data* is corruption, not a torn tail, and is
an error naming the file and the byte position.
"""

from __future__ import annotations

import heapq
import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from expstream.errors import ExpstreamError

__all__ = [
    "MAGIC",
    "TOPICS_DIR",
    "RecordFrame",
    "RecordingError",
    "RecordingWriter",
    "PartitionReader",
    "recorded_topics",
    "recorded_partitions",
    "iter_topic",
    "partition_path",
]

MAGIC = b"EXPREC\x00\x01"
#: The run-directory folder that holds the recording.
TOPICS_DIR = "topics"
_HEAD = struct.Struct(">II")
_PART_RE = re.compile(r"^partition-(\d+)\.rec$")
_KEYS = ("offset", "timestamp", "timestamp_type", "key", "headers", "value")


class RecordingError(ExpstreamError):
    """A recording file is not in the format (bad magic, a corrupt frame before the end). Not retriable."""

    retriable = False


@dataclass(frozen=True)
class RecordFrame:
    """One recorded Kafka record."""

    topic: str
    partition: int
    offset: int
    timestamp: int  # ms since the epoch (the broker's timestamp of the record)
    key: bytes | None
    value: bytes | None  # the original record bytes, untouched (None for a tombstone)
    headers: tuple[tuple[str, bytes], ...] = field(default_factory=tuple)
    timestamp_type: int = -1  # 0 create time, 1 log-append time, -1 unknown

    @property
    def where(self) -> str:
        """``topic[partition]@offset``, as log lines name a record."""
        return f"{self.topic}[{self.partition}]@{self.offset}"

    def header(self, name: str) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @classmethod
    def from_consumer_record(cls, rec: Any) -> RecordFrame:
        """From a kafka-python ``ConsumerRecord`` (header values ``None`` become ``b""``)."""
        headers = tuple((str(k), bytes(v) if v is not None else b"") for k, v in (rec.headers or []))
        ts = rec.timestamp if rec.timestamp is not None else -1
        return cls(rec.topic, int(rec.partition), int(rec.offset), int(ts),
                   None if rec.key is None else bytes(rec.key), None if rec.value is None else bytes(rec.value),
                   headers, int(getattr(rec, "timestamp_type", -1) if rec.timestamp_type is not None else -1))


def partition_path(root: str | Path, topic: str, partition: int) -> Path:
    """``<root>/topics/<topic>/partition-<p>.rec``; ``root`` is a run directory."""
    if not topic or "/" in topic or topic in (".", ".."):
        raise RecordingError(f"topic name {topic!r} cannot name a recording folder")
    return Path(root) / TOPICS_DIR / topic / f"partition-{int(partition)}.rec"


def encode_frame(frame: RecordFrame) -> bytes:
    payload = msgpack.packb({
        "offset": frame.offset, "timestamp": frame.timestamp, "timestamp_type": frame.timestamp_type,
        "key": frame.key, "headers": [[k, v] for k, v in frame.headers], "value": frame.value,
    }, use_bin_type=True)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


class RecordingWriter:
    """Appends frames to the partition files under ``root`` (a run directory); one writer per file.

    ``append`` buffers; ``flush`` writes every buffered frame whole and flushes the files (what a
    reader sees after a kill is whatever was flushed); ``close`` flushes and closes. Appending an
    offset not above the file's last one is skipped (a re-read after a restart records nothing
    twice) and counted in :attr:`skipped`.
    """

    def __init__(self, root: str | Path, *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.skipped = 0
        self.written = 0
        self._files: dict[tuple[str, int], BinaryIO] = {}
        self._last: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], list[bytes]] = {}

    def last_offset(self, topic: str, partition: int) -> int | None:
        """The highest offset recorded for the partition (reading the file once), or None."""
        key = (topic, int(partition))
        if key not in self._last:
            path = partition_path(self.root, topic, partition)
            last = None
            if path.exists():
                reader = PartitionReader(path, topic, int(partition))
                for f in reader:
                    last = f.offset
            self._last[key] = -1 if last is None else last
        return None if self._last[key] < 0 else self._last[key]

    def append(self, frame: RecordFrame) -> bool:
        key = (frame.topic, frame.partition)
        last = self.last_offset(*key)
        if last is not None and frame.offset <= last:
            self.skipped += 1
            return False
        self._last[key] = frame.offset
        self._pending.setdefault(key, []).append(encode_frame(frame))
        return True

    def extend(self, frames: Iterable[RecordFrame]) -> int:
        return sum(self.append(f) for f in frames)

    def _file(self, key: tuple[str, int]) -> BinaryIO:
        f = self._files.get(key)
        if f is None:
            path = partition_path(self.root, *key)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "ab")  # noqa: SIM115 - kept open across appends, closed in close()
            if f.tell() == 0:
                f.write(MAGIC)
            self._files[key] = f
        return f

    def flush(self) -> None:
        for key, frames in self._pending.items():
            if not frames:
                continue
            f = self._file(key)
            f.write(b"".join(frames))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            self.written += len(frames)
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PartitionReader:
    """Iterates the frames of one partition file; stops at a torn tail and says so."""

    def __init__(self, path: str | Path, topic: str, partition: int) -> None:
        self.path, self.topic, self.partition = Path(path), topic, int(partition)
        self.torn_tail = False  # True when the file ends inside a frame (a killed writer)

    def __iter__(self) -> Iterator[RecordFrame]:
        data = self.path.read_bytes()
        if data[: len(MAGIC)] != MAGIC:
            if len(data) < len(MAGIC) and MAGIC.startswith(data):
                self.torn_tail = bool(data)
                return
            raise RecordingError(f"{self.path}: not an expstream recording (bad magic {data[:8]!r}); "
                                 "recordings start with b'EXPREC\\x00\\x01'")
        pos = len(MAGIC)
        while pos < len(data):
            if pos + _HEAD.size > len(data):
                self.torn_tail = True
                return
            length, crc = _HEAD.unpack_from(data, pos)
            start, end = pos + _HEAD.size, pos + _HEAD.size + length
            if end > len(data):
                self.torn_tail = True
                return
            payload = data[start:end]
            if zlib.crc32(payload) != crc:
                if end == len(data):
                    self.torn_tail = True
                    return
                raise RecordingError(f"{self.path}: corrupt frame at byte {pos} (CRC mismatch) with more data "
                                     "after it; the recording was modified, not just cut short")
            obj = msgpack.unpackb(payload, raw=False)
            if not isinstance(obj, dict) or any(k not in obj for k in _KEYS):
                raise RecordingError(f"{self.path}: frame at byte {pos} lacks one of {', '.join(_KEYS)}")
            yield RecordFrame(self.topic, self.partition, int(obj["offset"]), int(obj["timestamp"]), obj["key"],
                              obj["value"], tuple((str(k), bytes(v)) for k, v in obj["headers"]),
                              int(obj["timestamp_type"]))
            pos = end


def recorded_topics(root: str | Path) -> list[str]:
    """Topics with a recording folder under the run directory ``root``, sorted."""
    base = Path(root) / TOPICS_DIR
    return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def recorded_partitions(root: str | Path, topic: str) -> list[int]:
    base = Path(root) / TOPICS_DIR / topic
    if not base.is_dir():
        return []
    return sorted(int(m.group(1)) for p in base.iterdir() if (m := _PART_RE.match(p.name)))


def iter_topic(root: str | Path, topic: str, partitions: Sequence[int] | None = None, *,
               order: str = "time") -> Iterator[RecordFrame]:
    """Every recorded frame of ``topic``: per partition in offset order, partitions merged by
    ``(timestamp, partition, offset)`` (``order="time"``, the order the records were written to
    the broker) or one partition after the other (``order="partition"``)."""
    if topic not in recorded_topics(root):
        raise RecordingError(f"{root}: no recording of topic {topic!r}; recorded: "
                             f"{', '.join(recorded_topics(root)) or 'none'}")
    parts = recorded_partitions(root, topic) if partitions is None else list(partitions)
    readers = [iter(PartitionReader(partition_path(root, topic, p), topic, p)) for p in parts
               if partition_path(root, topic, p).exists()]
    if order == "partition":
        for r in readers:
            yield from r
        return
    if order != "time":
        raise ValueError(f"order must be 'time' or 'partition', got {order!r}")
    yield from heapq.merge(*readers, key=lambda f: (f.timestamp, f.partition, f.offset))
