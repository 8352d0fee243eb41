"""The recording format: what crossed a topic, record by record, in a run directory.

``topics/<topic>/partition-<p>.rec`` is one append-only file per topic partition (``.dlq`` twins
included): an 8-byte magic, then CRC-checked frames holding each record's offset, timestamp, key,
headers and original value bytes, in offset order. Written by the run's recorder, ``expstream
record`` and ``expstream replay``; read by replay, show, diff and rewind. Readers tell a *torn*
tail (a killed writer) from *corrupt* bytes (:class:`Damage`, :func:`classify`). The byte layout:
schemas/README.md section 10; torn vs corrupt and what each reader does: docs/replay.md
"Recording".
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from expstream.errors import ExpstreamError

__all__ = [
    "MAGIC",
    "MIN_PAYLOAD",
    "Damage",
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
#: Bytes of the smallest payload a writer can produce (the 6 keys, each value one byte: offset 0,
#: nil key and value, no headers): a header announcing less is not a frame (zero padding: length 0).
MIN_PAYLOAD = 57
# msgpack map markers of a map with >= 6 entries: fixmap 0x86-0x8f, map16, map32.
_MAP_MARKERS = frozenset(range(0x86, 0x90)) | {0xDE, 0xDF}
# A torn payload's start is checked on at most this many bytes (a prefix of a prefix is a prefix).
_PREFIX_CHECK = 1 << 16

log = logging.getLogger("expstream.recording")


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

    def __init__(self, root: str | Path, *, fsync: bool = False, max_bytes: int | None = None,
                 max_age_s: float | None = None) -> None:
        self.root = Path(root)
        self.fsync = fsync
        # record.max_bytes / record.max_age_s: the oldest records dropped first (expstream/tools/retention.py)
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.trimmed = 0  # records dropped by the bounds
        self._next_check = 0.0
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
        if (self.max_bytes is not None or self.max_age_s is not None) and time.monotonic() >= self._next_check:
            self.enforce_bounds()

    def enforce_bounds(self) -> None:
        """Drop the oldest records of the files this writer has written beyond the bounds (retention.py)."""
        from expstream.tools.retention import CHECK_INTERVAL_S, enforce

        self._next_check = time.monotonic() + CHECK_INTERVAL_S
        paths = {partition_path(self.root, *key): key for key in self._files}
        dropped = enforce(paths, max_bytes=self.max_bytes, max_age_s=self.max_age_s, now_ms=int(time.time() * 1000))
        if dropped.files:
            self.trimmed += dropped.frames
            for key in paths.values():  # reopened (appending to the renamed file) on the next flush
                self._files.pop(key).close()

    def close(self) -> None:
        self.flush()
        if self.max_bytes is not None or self.max_age_s is not None:
            self.enforce_bounds()  # the recording left behind is within the bounds too
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Damage:
    """Where and how one partition file stops being readable (see the module doc)."""

    path: Path
    kind: str  # "torn" (a writer killed mid-write) | "corrupt" (modified or damaged after writing)
    position: int  # byte offset in the file of the frame (or magic) that is bad
    detail: str  # what the bytes there are
    records_before: int  # whole records read before it

    def message(self) -> str:
        if self.kind == "torn":
            return (f"{self.path}: torn last frame at byte {self.position} ({self.detail}): a writer killed "
                    f"mid-write; the {self.records_before} record(s) before it are read")
        return (f"{self.path}: corrupt at byte {self.position} ({self.detail}); the file was modified or damaged "
                f"after it was written, not cut short by a killed writer ({self.records_before} record(s) "
                "before it are intact)")


def _plausible_payload_start(partial: bytes) -> bool:
    """Can ``partial`` (the bytes of a frame's payload up to the end of the file) begin a frame payload?"""
    if not partial:
        return True
    if partial[0] not in _MAP_MARKERS:
        return False
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(partial[:_PREFIX_CHECK])
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return True  # an incomplete map: what a cut write leaves
    except Exception:  # noqa: BLE001 - any other decoding failure: not the start of a map
        return False
    return False  # a whole object shorter than the announced length: not a cut write


def _header(h: Any) -> tuple[str, bytes]:
    k, v = h
    if not isinstance(k, str) or not isinstance(v, bytes):
        raise TypeError(f"header {h!r:.80} is not [str, bin]")
    return k, v


def _frame(payload: bytes, topic: str, partition: int) -> RecordFrame | str:
    """The frame a payload holds, or why it holds none (a string)."""
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # noqa: BLE001 - any bytes may be in a damaged file
        return f"the payload is not msgpack ({type(exc).__name__}: {exc})"
    if not isinstance(obj, dict) or any(k not in obj for k in _KEYS):
        return f"the payload lacks one of {', '.join(_KEYS)}"
    key, value = obj["key"], obj["value"]
    try:
        if not (key is None or isinstance(key, bytes)) or not (value is None or isinstance(value, bytes)):
            raise TypeError("key and value must be bin or nil")
        return RecordFrame(topic, partition, int(obj["offset"]), int(obj["timestamp"]), key, value,
                           tuple(_header(h) for h in obj["headers"]), int(obj["timestamp_type"]))
    except (TypeError, ValueError) as exc:
        return f"a payload field has the wrong type ({exc})"


class PartitionReader:
    """Iterates the frames of one partition file; stops at a torn tail and says so.

    Corruption raises :class:`RecordingError` (naming the file and the byte position) unless
    ``strict`` is false; then iteration stops there too. Either way :attr:`damage` says what
    stopped it once the iteration ended (None: the file was read to its end).
    """

    def __init__(self, path: str | Path, topic: str, partition: int, *, strict: bool = True) -> None:
        self.path, self.topic, self.partition = Path(path), topic, int(partition)
        self.strict = strict
        self.damage: Damage | None = None

    @property
    def torn_tail(self) -> bool:
        """True when the file ends inside a frame (a killed writer)."""
        return self.damage is not None and self.damage.kind == "torn"

    @property
    def corrupt(self) -> bool:
        return self.damage is not None and self.damage.kind == "corrupt"

    def _stop(self, kind: str, position: int, detail: str, records: int) -> None:
        self.damage = Damage(self.path, kind, position, detail, records)
        if kind == "corrupt" and self.strict:
            raise RecordingError(self.damage.message())

    def __iter__(self) -> Iterator[RecordFrame]:
        self.damage = None
        data = self.path.read_bytes()
        if data[: len(MAGIC)] != MAGIC:
            if len(data) < len(MAGIC) and MAGIC.startswith(data):
                if data:
                    self._stop("torn", 0, f"{len(data)} of the {len(MAGIC)} magic bytes", 0)
                return
            raise RecordingError(f"{self.path}: not an expstream recording (bad magic {data[:8]!r}); "
                                 "recordings start with b'EXPREC\\x00\\x01'")
        pos, n, records = len(MAGIC), len(data), 0
        while pos < n:
            rest = n - pos
            if rest >= 4 and (length := int.from_bytes(data[pos:pos + 4], "big")) < MIN_PAYLOAD:
                zeros = " (zero bytes)" if not any(data[pos:pos + min(rest, _HEAD.size)]) else ""
                self._stop("corrupt", pos, f"a frame header announcing {length} payload bytes{zeros}, fewer than "
                                           f"the smallest frame ({MIN_PAYLOAD}); {rest} bytes to the end", records)
                return
            if rest < _HEAD.size:
                self._stop("torn", pos, f"{rest} of the {_HEAD.size} bytes of a frame header", records)
                return
            length, crc = _HEAD.unpack_from(data, pos)
            start, end = pos + _HEAD.size, pos + _HEAD.size + length
            if end > n:
                if not _plausible_payload_start(data[start:]):
                    self._stop("corrupt", pos, f"a header announcing {length} payload bytes followed by bytes "
                                               "that cannot start a frame payload", records)
                else:
                    self._stop("torn", pos, f"the file ends {rest} bytes into a frame of {_HEAD.size + length}",
                               records)
                return
            payload = data[start:end]
            if zlib.crc32(payload) != crc:
                after = f"; {n - end} more bytes after it" if end < n else "; the last frame, whole but wrong"
                self._stop("corrupt", pos, f"CRC mismatch on a complete frame of {length} payload bytes{after}",
                           records)
                return
            frame = _frame(payload, self.topic, self.partition)
            if isinstance(frame, str):
                self._stop("corrupt", pos, frame, records)
                return
            records += 1
            yield frame
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


def _reported(reader: PartitionReader, on_damage: Callable[[Damage], None] | None) -> Iterator[RecordFrame]:
    yield from reader
    if reader.damage is not None:
        if on_damage is not None:
            on_damage(reader.damage)
        else:
            log.warning("recording: %s", reader.damage.message())


def iter_topic(root: str | Path, topic: str, partitions: Sequence[int] | None = None, *,
               order: str = "time", strict: bool = True,
               on_damage: Callable[[Damage], None] | None = None) -> Iterator[RecordFrame]:
    """Every recorded frame of ``topic``: per partition in offset order, partitions merged by
    ``(timestamp, partition, offset)`` (``order="time"``, the order the records were written to
    the broker) or one partition after the other (``order="partition"``).

    A partition file that ends torn (or, with ``strict=False``, corrupt) is read up to there and
    its :class:`Damage` handed to ``on_damage`` (default: a warning in the log); with ``strict``
    corruption raises RecordingError."""
    if topic not in recorded_topics(root):
        raise RecordingError(f"{root}: no recording of topic {topic!r}; recorded: "
                             f"{', '.join(recorded_topics(root)) or 'none'}")
    if order not in ("time", "partition"):
        raise ValueError(f"order must be 'time' or 'partition', got {order!r}")
    parts = recorded_partitions(root, topic) if partitions is None else list(partitions)
    readers = [_reported(PartitionReader(partition_path(root, topic, p), topic, p, strict=strict), on_damage)
               for p in parts if partition_path(root, topic, p).exists()]
    if order == "partition":
        for r in readers:
            yield from r
        return
    yield from heapq.merge(*readers, key=lambda f: (f.timestamp, f.partition, f.offset))
