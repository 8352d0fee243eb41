"""Framed records (SampleBatch version 6): the tensor bytes appended after a msgpack header.

A framed record is still **one msgpack map** (so a file of concatenated records, a recording and
any msgpack reader still see one object per record), with one extra key, ``"payload"``, always the
last entry: a ``bin`` holding every tensor's bytes. A tensor map in the header is
``{"dtype": str, "shape": [int, ...], "at": int}``: its bytes are ``prod(shape) * itemsize`` bytes at
``at`` in the payload's *area*, which starts at the first byte of the bin's contents whose offset in
the record is a multiple of 8 (the writer puts zero bytes before it). ``at`` is a multiple of the
dtype's item size and tensors do not overlap, so a reader can view every tensor in place, aligned
(``np.frombuffer`` on the record, no copy) -- msgpack would have copied every ``bin`` into a new bytes
object. The writer puts the float32 tensors first, back to back, so one pass checks them all finite.

Which records are framed: SampleBatch records whose tensors hold at least :data:`FRAME_MIN_BYTES`
(schemas/README.md §7, "version 6"). Smaller ones stay byte-identical to the versions before: framing
them would save little (0.19 vs 0.23 ms for a 13 KB record of 64 samples, where the header is the
cost) and change every recording, pinned byte and older reader of a tiny-model run.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from schemas.errors import DecodeError
from schemas.tensors import DTYPES, all_finite

__all__ = ["ALIGN", "FRAME_MIN_BYTES", "FRAME_VERSION", "PAYLOAD_KEY", "area_of", "attach", "frame",
           "is_framed", "read_header", "split", "tensor_maps"]

#: The SampleBatch version of a framed record.
FRAME_VERSION = 6
#: A SampleBatch whose tensors hold at least this many bytes is framed.
FRAME_MIN_BYTES = 64 * 1024
#: The payload's area starts at a record offset that is a multiple of this.
ALIGN = 8
#: The last key of a framed record's map.
PAYLOAD_KEY = "payload"
_TAIL = b"\xa7payload\xc0"  # "payload": nil, as msgpack packs the placeholder the writer replaces
_TENSOR_KEYS = frozenset(("dtype", "shape", "at"))
#: The canonical start of a framed SampleBatch after its map header (1 byte, or 3 for a map16).
_PREFIX = b"\xa6schema\xb5expstream.SampleBatch\xa7version\x06"
_CHUNK = 1 << 16  # header bytes fed to the unpacker at first (doubled until the header fits)


def tensor_maps(obj: dict[str, Any], path: str = "") -> list[tuple[dict[str, Any], str, dict[str, Any], str]]:
    """(parent, key, tensor map, the parent's dotted path) of every tensor map in ``obj`` (a field, a
    ragged map, a dict of arrays: two levels down at most)."""
    found = []
    for key, value in obj.items():
        if type(value) is dict:
            if "dtype" in value:
                found.append((obj, key, value, path))
            else:
                for k, v in value.items():
                    if type(v) is dict and "dtype" in v:
                        found.append((value, k, v, f"{path}.{key}"))
    return found


def frame(header: dict[str, Any]) -> bytes:
    """The framed record of ``header`` (a message map whose tensors are ``{dtype, shape, data}``, ``data`` a
    C-contiguous little-endian array).

    The tensor maps are replaced in place by ``{dtype, shape, at}``; their data is appended once
    (``bytes.join``: the one copy of the tensor bytes).
    """
    found = tensor_maps(header)
    order = sorted(range(len(found)), key=lambda i: (found[i][2]["dtype"] != "float32", -DTYPES[found[i][2]["dtype"]].itemsize))
    pos, placed = 0, []
    for i in order:
        t = found[i][2]
        size = DTYPES[t["dtype"]].itemsize
        pos += -pos % size
        placed.append((pos, t["data"]))
        found[i][0][found[i][1]] = {"dtype": t["dtype"], "shape": t["shape"], "at": pos}
        pos += t["data"].nbytes
    head = msgpack.packb({**header, PAYLOAD_KEY: None}, use_bin_type=True)
    assert head.endswith(_TAIL), "the payload key must be the header's last entry"
    head = head[:-1]
    pad = -(len(head) + 5) % ALIGN
    parts: list[Any] = [head, b"\xc6", (pad + pos).to_bytes(4, "big"), bytes(pad)]
    end = 0
    for at, data in placed:
        if at > end:
            parts.append(bytes(at - end))
        parts.append(data)
        end = at + data.nbytes
    return b"".join(parts)


def is_framed(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts like a framed SampleBatch of the canonical writer (cheap; the key
    order of another writer is read the slow way, :func:`split` on the unpacked map)."""
    head = bytes(data[:48])
    return head[1:].startswith(_PREFIX) or (head[:1] == b"\xde" and head[3:].startswith(_PREFIX))


def read_header(data: bytes) -> tuple[dict[str, Any], int, int]:
    """(header map without the payload, start of the bin's contents, their length) of a framed record.

    Only the header's bytes are unpacked; raises DecodeError when the record is not one map ending
    with the payload bin, or is cut short.
    """
    chunk = _CHUNK
    while True:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(data))
        unpacker.feed(memoryview(data)[:chunk])
        try:
            return _entries(unpacker, data)
        except msgpack.OutOfData:
            if chunk >= len(data):
                raise DecodeError(
                    "framed record is truncated (its header ends before the payload); the producer must "
                    "write the whole record made by schemas.encode"
                ) from None
            chunk *= 2
        except DecodeError:
            raise
        except Exception as e:  # malformed msgpack, bad UTF-8, non-str keys
            raise DecodeError(f"framed record's header is not valid msgpack ({type(e).__name__}: {e})") from None


def _entries(unpacker: msgpack.Unpacker, data: bytes) -> tuple[dict[str, Any], int, int]:
    n = unpacker.read_map_header()
    header: dict[str, Any] = {}
    for i in range(n):
        key = unpacker.unpack()
        if key == PAYLOAD_KEY:
            if i != n - 1:
                raise DecodeError(f"framed record: {PAYLOAD_KEY!r} must be the map's last entry, it is entry "
                                  f"{i + 1} of {n}")
            return header, *_bin_at(data, unpacker.tell())
        header[key] = unpacker.unpack()
    raise DecodeError(f"framed record has no {PAYLOAD_KEY!r} entry; a version-6 record ends with the payload bin")


def _bin_at(data: bytes, pos: int) -> tuple[int, int]:
    """(start, length) of the bin whose marker is at ``pos``; the record must end with it."""
    marker = data[pos] if pos < len(data) else None
    widths = {0xC4: 1, 0xC5: 2, 0xC6: 4}
    if marker not in widths:
        raise DecodeError(f"framed record: {PAYLOAD_KEY!r} must be a msgpack bin, found byte "
                          f"{'end of record' if marker is None else hex(marker)} at {pos}")
    start = pos + 1 + widths[marker]
    length = int.from_bytes(data[pos + 1:start], "big")
    if start + length != len(data):
        what = "truncated" if start + length > len(data) else "followed by trailing bytes"
        raise DecodeError(f"framed record is {what}: its payload holds {length} bytes from byte {start}, the record "
                          f"has {len(data)}; the producer must write the whole record made by schemas.encode")
    return start, length


def split(obj: dict[str, Any], size: int) -> tuple[bytes, int]:
    """The payload popped from a version-6 map unpacked whole (a writer of another key order, whose
    record :func:`is_framed` does not recognise), and the record offset of its first byte (the payload
    is the last entry: its bytes end the ``size``-byte record)."""
    if next(reversed(obj)) != PAYLOAD_KEY:
        raise DecodeError(f"framed record: {PAYLOAD_KEY!r} must be the map's last entry (a version-6 record ends "
                          "with its payload bin)")
    payload = obj.pop(PAYLOAD_KEY, None)
    if not isinstance(payload, bytes):
        raise DecodeError(f"version-6 record has no {PAYLOAD_KEY!r} bin (got {type(payload).__name__}); "
                          "its tensors live there")
    return payload, size - len(payload)


def area_of(start: int, length: int, record_start: int) -> tuple[int, int]:
    """(index of the area in the buffer, its size) for bin contents at ``start`` (``length`` bytes) of a
    buffer, whose first byte is at ``record_start`` in the record."""
    pad = -record_start % ALIGN
    if pad > length:
        raise DecodeError(f"framed record: its {length}-byte payload is shorter than the {pad} bytes that align "
                          "its area; the frame is corrupt")
    return start + pad, length - pad


def attach(header: dict[str, Any], buf: bytes, area: int, size: int, schema: str, *, views: bool) -> bool:
    """Replace every ``{dtype, shape, at}`` of ``header`` by its bytes in ``buf``, viewed without a copy.

    ``buf[area:area + size]`` is the payload's area (:func:`area_of`). ``views``: each tensor map becomes
    ``(dtype name, read-only ndarray)`` and the answer is whether every float32 value is finite (one
    pass over them when they lie back to back, the writer's layout); else ``{dtype, shape, data}`` with
    ``data`` a memoryview (the tensor maps of the other versions) and the answer is True. Checks each
    tensor's place first: ``at`` an int, a multiple of the item size, the bytes inside the area, no two
    tensors overlapping (DecodeError naming the field otherwise).
    """
    spans, floats, mv = [], [], memoryview(buf)
    for parent, key, t, where in tensor_maps(header, schema):
        name, shape, at = t.get("dtype"), t.get("shape"), t.get("at")
        dt = DTYPES.get(name) if type(name) is str else None
        one_dim = type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0  # the common case
        if len(t) != 3 or dt is None or not (one_dim or _shape_ok(shape)) or type(at) is not int:
            _refuse(t, f"{where}.{key}")
        count = shape[0] if one_dim else math.prod(shape)
        nbytes = count * dt.itemsize
        if at < 0 or at % dt.itemsize or at + nbytes > size:
            path = f"{where}.{key}"
            raise DecodeError(f"{path}: payload offset {at!r} for {nbytes} bytes of {name} is not a multiple of "
                              f"{dt.itemsize} inside the {size}-byte payload; the frame is corrupt", field=path)
        if views:
            arr = np.frombuffer(buf, dt, count, area + at)
            parent[key] = (name, arr if one_dim else arr.reshape(shape))
        else:
            parent[key] = {"dtype": name, "shape": shape, "data": mv[area + at:area + at + nbytes]}
        spans.append((at, at + nbytes, where, key))
        if name == "float32" and nbytes:
            floats.append((area + at, area + at + nbytes))
    spans.sort()
    for (_, end, *first), (at, _, *second) in zip(spans, spans[1:], strict=False):
        if at < end:
            a, b = ".".join(first), ".".join(second)
            raise DecodeError(f"{b}: its payload bytes overlap {a}'s; the frame is corrupt", field=b)
    return not views or _all_finite(buf, sorted(floats))


def _shape_ok(shape: Any) -> bool:
    return type(shape) is list and all(type(s) is int and s >= 0 for s in shape)


def _refuse(t: dict[str, Any], path: str) -> None:
    """DecodeError for a version-6 tensor map ``t`` that is not ``{dtype, shape, at}`` of a known dtype."""
    if t.keys() != _TENSOR_KEYS:
        raise DecodeError(f"{path}: a version-6 tensor map has exactly the keys dtype, shape, at (got "
                          f"{sorted(map(str, t))}); its bytes live in the payload", field=path)
    if not isinstance(t["dtype"], str) or t["dtype"] not in DTYPES:
        raise DecodeError(f"{path}: unknown dtype {t['dtype']!r}; use one of {', '.join(DTYPES)}", field=path)
    if not _shape_ok(t["shape"]):
        raise DecodeError(f"{path}: shape must be a list of non-negative ints, got {t['shape']!r}", field=path)
    raise DecodeError(f"{path}: payload offset must be an int, got {t['at']!r}; the frame is corrupt", field=path)


def _all_finite(buf: bytes, spans: list[tuple[int, int]]) -> bool:
    """Whether the float32 values of every span of ``buf`` are finite: one pass when they lie back to back."""
    runs: list[list[int]] = []
    for a, b in spans:
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return all(all_finite(np.frombuffer(buf, np.float32, (b - a) // 4, a)) for a, b in runs)
