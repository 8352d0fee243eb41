"""Bounding a recording: ``record.max_bytes`` and ``record.max_age_s``, the oldest records dropped first.

A run's recording (expstream/tools/recording.py) grows with every record; a continuous run's grows
without end. The recorder's :class:`expstream.tools.recording.RecordingWriter` calls
:func:`enforce` at most every ``CHECK_INTERVAL_S`` after a flush:

* **age** (``max_age_s``): in every partition file, the leading frames whose broker timestamp is
  older than ``now - max_age_s`` are dropped;
* **size** (``max_bytes``): when the partition files together exceed ``max_bytes``, the oldest
  frames across all of them (by broker timestamp) are dropped until they hold at most
  ``TRIM_TO`` x ``max_bytes``. Trimming below the bound leaves room: a trim rewrites what is kept,
  so it happens once per (1 - TRIM_TO) x ``max_bytes`` recorded (each byte is written at most
  1 / (1 - TRIM_TO) = 4 times), not after every poll.

Only whole leading frames go: a file keeps its magic and stays in offset order, so every reader
(replay, show, diff, rewind) reads a trimmed file as a recording that starts later; a replay or a
rewind reaches only what is kept. A file is rewritten to a temporary file and renamed over the old
one (a reader sees the old or the new file, never half of one). Frames of the same broker
timestamp are kept or dropped together per file; a file's frames are kept from the first one at or
after the cut, so a record produced later but timestamped earlier (clock skew) is never dropped
ahead of its predecessors.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgpack

__all__ = ["CHECK_INTERVAL_S", "TRIM_TO", "Trimmed", "enforce", "frame_spans"]

# Why 1 s: a recorder flushes after every poll (several per second); a bound checked once a second
# overshoots by at most a second of records, and a stat() of every file per second costs nothing.
CHECK_INTERVAL_S = 1.0
# Why 0.75: see the module docstring (write amplification at most 4x, a trim every quarter bound).
TRIM_TO = 0.75
_HEAD = struct.Struct(">II")
_MAGIC_LEN = 8

log = logging.getLogger("expstream.recording")


@dataclass
class Trimmed:
    """What one :func:`enforce` dropped."""

    files: int = 0
    frames: int = 0
    bytes: int = 0


def frame_spans(path: Path) -> list[tuple[int, int, int]]:
    """``(start byte, end byte, broker timestamp)`` of every whole frame of a partition file.

    Stops at the first frame that is not whole (a torn tail: kept as it is, after the last span).
    """
    data = path.read_bytes()
    spans, pos = [], _MAGIC_LEN
    while pos + _HEAD.size <= len(data):
        n, _crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + n
        if end > len(data):
            break
        try:
            ts = int(msgpack.unpackb(data[pos + _HEAD.size:end], raw=False)["timestamp"])
        except Exception:  # noqa: BLE001 - a damaged frame: nothing after it is trimmed
            break
        spans.append((pos, end, ts))
        pos = end
    return spans


def _cut_for_size(spans: dict[Path, list[tuple[int, int, int]]], sizes: dict[Path, int], target: int) -> int | None:
    """The broker timestamp from which the newest frames of all files fit in ``target`` bytes (None: all fit)."""
    frames = sorted(((ts, end - start) for s in spans.values() for start, end, ts in s), reverse=True)
    overhead = sum(sizes.values()) - sum(n for _, n in frames)  # magics, torn tails
    kept = overhead
    for ts, n in frames:
        if kept + n > target:
            return ts + 1  # this frame and every older one go (frames of its timestamp too)
        kept += n
    return None


def _rewrite(path: Path, cut: int) -> None:
    """Keep the magic and the bytes from ``cut`` on (a temporary file renamed over ``path``)."""
    tmp = path.with_name(path.name + ".trim")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(src.read(_MAGIC_LEN))
        src.seek(cut)
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, path)


def enforce(paths: Iterable[Path], *, max_bytes: int | None, max_age_s: float | None, now_ms: int) -> Trimmed:
    """Drop the oldest frames of the partition files ``paths`` to honour the bounds (module docstring).

    Args:
        paths: the recording's partition files (the caller closes its append handles of trimmed files).
        max_bytes: the bound on the files' total size, or None.
        max_age_s: the bound on a frame's age by broker timestamp, or None.
        now_ms: the present, ms since the epoch.
    Returns:
        What was dropped; :attr:`Trimmed.files` > 0 means files were rewritten.
    """
    out = Trimmed()
    files = [p for p in paths if p.exists()]
    sizes = {p: p.stat().st_size for p in files}
    over = max_bytes is not None and sum(sizes.values()) > max_bytes
    if not over and max_age_s is None:
        return out
    spans = {p: frame_spans(p) for p in files}
    cut_ts = None if max_age_s is None else now_ms - int(1000 * max_age_s)
    if over:
        by_size = _cut_for_size(spans, sizes, int(TRIM_TO * max_bytes))
        if by_size is not None:
            cut_ts = by_size if cut_ts is None else max(cut_ts, by_size)
    if cut_ts is None:
        return out
    for p, s in spans.items():
        drop = 0
        while drop < len(s) and s[drop][2] < cut_ts:
            drop += 1
        if not drop:
            continue
        cut = s[drop - 1][1]
        _rewrite(p, cut)
        out.files += 1
        out.frames += drop
        out.bytes += cut - _MAGIC_LEN
    if out.files:
        log.info("recording: dropped the %d oldest records (%d bytes) of %d files (record.max_bytes=%s, "
                 "record.max_age_s=%s)", out.frames, out.bytes, out.files, max_bytes, max_age_s)
    return out
