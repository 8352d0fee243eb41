"""msgpack codec: :func:`encode` a message to one Kafka record value, :func:`decode` it back.

The encoding is canonical: top-level keys are ``schema``, ``version`` and then the message's
fields in declaration order (``None`` optional fields omitted), dict-of-array fields have their
keys sorted, tensors are little-endian C-order. So ``encode(decode(encode(m))) == encode(m)``
byte for byte, and the same message always gives the same bytes.

:func:`decode` raises only :class:`schemas.errors.SchemaError` subclasses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from schemas import frame as framing
from schemas.errors import DecodeError, SchemaError, UnknownSchemaError, ValidationError, VersionError
from schemas.messages import (
    PROMPT_V2_FIELDS,
    V2_FIELDS,
    V3_FIELDS,
    V4_FIELDS,
    V5_FIELDS,
    PromptBatch,
    SampleBatch,
)
from schemas.tensors import DTYPES, Ragged, decode_tensor

__all__ = ["MESSAGE_TYPES", "READ_VERSIONS", "SCHEMA_VERSIONS", "Message", "decode", "encode", "peek_header", "write_version"]

Message = PromptBatch | SampleBatch
#: Schema name -> the version this writer writes (and the newest this reader reads).
SCHEMA_VERSIONS: dict[str, int] = {"expstream.PromptBatch": 2, "expstream.SampleBatch": 6}
#: Schema name -> every version this reader reads. SampleBatch version 1 has no V2_FIELDS; a
#: version-1 record decodes with them absent (None / []).
#: Version 3 of SampleBatch and 2 of PromptBatch add the visual fields (V3_FIELDS, PROMPT_V2_FIELDS);
#: version 4 of SampleBatch adds the multi-turn fields (V4_FIELDS), version 5 the per-token policy
#: versions (V5_FIELDS). A record is written at the lowest version that holds its fields, unless it is
#: framed: version 6 holds every field of version 5, its tensors' bytes after a msgpack header
#: (schemas/frame.py), and is written for a SampleBatch whose tensors hold >= FRAME_MIN_BYTES.
READ_VERSIONS: dict[str, tuple[int, ...]] = {"expstream.PromptBatch": (1, 2),
                                             "expstream.SampleBatch": (1, 2, 3, 4, 5, 6)}
#: Schema name -> message class.
MESSAGE_TYPES: dict[str, type[PromptBatch] | type[SampleBatch]] = {
    PromptBatch.SCHEMA: PromptBatch,
    SampleBatch.SCHEMA: SampleBatch,
}
_ENVELOPE = ("schema", "version")
_RAGGED_KEYS = frozenset(("lengths", "values"))


def write_version(msg: Message) -> int:
    """The version a message is written at: the newest only when it holds the newest fields.

    A text-only batch (no images/videos) is written at the version before the visual fields
    (PromptBatch 1, SampleBatch 2), so readers that predate them still read every text-only record,
    and records of text-only runs are byte-identical to those written before; a batch with visual
    inputs is written at the newest version, which an older reader refuses with a VersionError.
    """
    if isinstance(msg, PromptBatch):
        return 2 if any(getattr(msg, f) for f in PROMPT_V2_FIELDS) else 1
    if msg.token_versions is not None:  # only a record of in-flight weight updates carries them
        return 5
    if any(getattr(msg, f) is not None for f in V4_FIELDS):  # a multi-turn episode
        return 4
    return 3 if any(getattr(msg, f) is not None and getattr(msg, f) != [] for f in V3_FIELDS) else 2


def encode(msg: Message) -> bytes:
    """The msgpack bytes of ``msg`` (validated first; raises ValidationError if it is invalid).

    A SampleBatch whose tensors hold at least ``FRAME_MIN_BYTES`` is framed (version 6: the tensor
    bytes after the header, schemas/frame.py); every other message is one plain msgpack map at the
    lowest version that holds its fields (:func:`write_version`).
    """
    if not isinstance(msg, (PromptBatch, SampleBatch)):
        raise TypeError(f"encode() takes a PromptBatch or SampleBatch, got {type(msg).__name__}")
    msg.validate()  # fields may have been assigned since construction
    out: dict[str, Any] = {"schema": msg.SCHEMA, "version": write_version(msg)}
    nbytes = 0  # of the tensors
    for name, kind in msg.FIELDS.items():
        value = getattr(msg, name)
        if value is None or (kind in ("opt_ints", "opt_refs") and not value):
            continue
        if kind == "ragged":
            value = {"lengths": _tensor(value.lengths, "int32"), "values": _tensor(value.values, value.dtype)}
            nbytes += value["lengths"]["data"].nbytes + value["values"]["data"].nbytes
        elif kind == "array":
            value = _tensor(value, "float32")
            nbytes += value["data"].nbytes
        elif kind == "arrays":
            value = {k: _tensor(value[k], "float32") for k in sorted(value)}
            nbytes += sum(t["data"].nbytes for t in value.values())
        out[name] = value
    if isinstance(msg, SampleBatch) and nbytes >= framing.FRAME_MIN_BYTES:
        out["version"] = framing.FRAME_VERSION
        return framing.frame(out)  # the tensors' bytes appended, one copy
    for parent, key, t, _ in framing.tensor_maps(out):  # the tensors as bins of the map: packed right below, one copy
        parent[key] = {"dtype": t["dtype"], "shape": t["shape"], "data": memoryview(t["data"].reshape(-1).view(np.uint8))}
    return msgpack.packb(out, use_bin_type=True)


def _tensor(a: np.ndarray, name: str) -> dict[str, Any]:
    """A validated field's array as ``{dtype, shape, data}``, ``data`` the array itself made C-contiguous
    and little-endian (a copy only when it is not already)."""
    target = DTYPES[name]
    if a.dtype != target or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=target)
    return {"dtype": name, "shape": list(a.shape), "data": a}


def _unpack(data: Any) -> dict[str, Any]:
    """The top-level map of ``data``, or DecodeError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected the record value as bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except msgpack.ExtraData as e:
        raise DecodeError(
            f"trailing bytes after the message map ({len(e.extra)} extra bytes); one record must hold "
            "exactly one msgpack map"
        ) from None
    except Exception as e:  # truncated, malformed, bad UTF-8, non-str map keys, ...
        if "incomplete" in str(e) or isinstance(e, msgpack.OutOfData):
            what = "truncated"
        elif "exceeds max_" in str(e):  # a length prefix larger than the whole record
            what = "truncated or corrupt"
        else:
            what = "not valid msgpack"
        raise DecodeError(
            f"record value is {what} ({type(e).__name__}: {e}); the producer must write one complete "
            "msgpack map made by schemas.encode"
        ) from None
    if not isinstance(obj, dict):
        raise DecodeError(
            f"record value is a msgpack {type(obj).__name__}, expected a map with schema and version"
        )
    return obj


def _check_envelope(obj: dict[str, Any]) -> tuple[type[PromptBatch] | type[SampleBatch], int]:
    schema = obj.get("schema")
    if not isinstance(schema, str):
        raise UnknownSchemaError(
            f"message has no 'schema' string (got {schema!r}); every map needs schema: "
            f"one of {sorted(SCHEMA_VERSIONS)}"
        )
    if schema not in MESSAGE_TYPES:
        raise UnknownSchemaError(
            f"unknown schema {schema!r}; this reader knows {sorted(SCHEMA_VERSIONS)} — check the topic "
            "wiring or upgrade the reader"
        )
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise VersionError(
            f"{schema}: message has no integer 'version' (got {version!r}); write version: int"
        )
    readable = READ_VERSIONS[schema]
    if version not in readable:
        known = " or ".join(str(v) for v in readable)
        raise VersionError(
            f"{schema}: version {version} is not supported by this reader (it reads version "
            f"{known}); upgrade the reader or have the writer emit version {SCHEMA_VERSIONS[schema]}"
        )
    return MESSAGE_TYPES[schema], version


def _fields_of(cls: type[PromptBatch] | type[SampleBatch], version: int) -> dict[str, str]:
    """The fields a record of ``cls`` at ``version`` may hold."""
    if cls is SampleBatch and version < 5:
        gone = (V5_FIELDS + (V4_FIELDS if version < 4 else ()) + (V3_FIELDS if version < 3 else ())
                + (V2_FIELDS if version < 2 else ()))
        return {k: v for k, v in cls.FIELDS.items() if k not in gone}
    if cls is PromptBatch and version < 2:
        return {k: v for k, v in cls.FIELDS.items() if k not in PROMPT_V2_FIELDS}
    return cls.FIELDS


def _field_value(cls: type, name: str, kind: str, value: Any) -> Any:
    path = f"{cls.__name__}.{name}"
    if value is None or kind not in ("ragged", "array", "arrays"):
        return value  # scalars and lists: type-checked by the dataclass
    if kind == "ragged":
        return Ragged.from_dict(value, field=path)
    if kind == "array":
        return _float_tensor(value, path)
    if not isinstance(value, dict):
        raise ValidationError(
            f"{path}: expected a map of name -> float32 tensor, got {type(value).__name__}", field=path
        )
    return {k: _float_tensor(v, f"{path}[{k!r}]") for k, v in value.items()}


def _float_tensor(value: Any, path: str) -> Any:
    arr = decode_tensor(value, field=path)
    if value["dtype"] != "float32":
        raise ValidationError(
            f"{path}: wire dtype is {value['dtype']} but must be float32; write float32", field=path
        )
    return arr


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in ``data``; tensors view the decoded bytes without copying (read-only).

    A framed record's (version 6) tensors view ``data`` itself (a bytearray or memoryview is copied
    into bytes first, so that nothing can change under the views). Raises DecodeError (not one msgpack
    map, or a corrupt frame), UnknownSchemaError, VersionError or ValidationError
    (unknown/missing/ill-typed fields, failed message validation).
    """
    if isinstance(data, (bytes, bytearray, memoryview)) and framing.is_framed(data):
        record = data if isinstance(data, bytes) else bytes(data)
        obj, start, length = framing.read_header(record)
        area = framing.area_of(start, length, start)
        fast = _decode_framed(obj, record, area)
        if fast is not None:
            return fast
        obj = framing.read_header(record)[0]  # something failed a check: the whole way, for its precise error
        return _decode_map(obj, (record, *area))
    obj = _unpack(data)
    if obj.get("version") == framing.FRAME_VERSION and obj.get("schema") == SampleBatch.SCHEMA:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        payload, record_start = framing.split(obj, size)  # another writer's key order: the payload was copied
        return _decode_map(obj, (payload, *framing.area_of(0, len(payload), record_start)))
    return _decode_map(obj, None)


def _checked_envelope(obj: dict[str, Any]) -> tuple[type[PromptBatch] | type[SampleBatch], dict[str, str]]:
    """The message class and the fields of the map's version; raises for an unknown field."""
    cls, version = _check_envelope(obj)
    fields = _fields_of(cls, version)
    unknown = [k for k in obj if k not in _ENVELOPE and k not in fields]
    if unknown:
        path = f"{cls.__name__}.{unknown[0]}"
        raise ValidationError(
            f"{path}: unknown field {unknown[0]!r} for {cls.SCHEMA} version {version}; "
            "the writer is newer than this reader (upgrade the reader) or misspelt the field",
            field=path,
        )
    return cls, fields


def _decode_framed(obj: dict[str, Any], record: bytes, area: tuple[int, int]) -> Message | None:
    """A framed record's message, its tensors checked in bulk (one pass over every float, one check of
    each distinct ragged ``lengths``) and viewed in ``record``; None when a tensor fails a check (the
    caller then decodes the record the whole way, which names the field and the fix)."""
    cls, fields = _checked_envelope(obj)
    if not framing.attach(obj, record, *area, cls.__name__, views=True):
        return None
    kwargs: dict[str, Any] = {}
    lengths: dict[bytes, tuple[np.ndarray, int]] = {}  # equal lengths arrays: checked once, one object
    try:
        for name, value in obj.items():
            kind = fields.get(name)
            if kind == "ragged" and value is not None:
                if type(value) is not dict or value.keys() != _RAGGED_KEYS:
                    return None
                (lname, lens), (vname, values) = value["lengths"], value["values"]
                if lname != "int32" or lens.ndim != 1 or values.ndim != 1:
                    return None
                seen = lengths.get(key := lens.tobytes())
                if seen is None:
                    if lens.size and int(lens.min()) < 0:
                        return None
                    seen = lengths[key] = (lens, int(lens.sum(dtype=np.int64)))
                if seen[1] != values.shape[0] or (vname == "bool" and values.size and int(values.view(np.uint8).max()) > 1):
                    return None
                value = Ragged.checked(values, seen[0], vname)
            elif kind == "array" and value is not None:
                if value[0] != "float32":
                    return None
                value = value[1]
            elif kind == "arrays" and value is not None:
                if type(value) is not dict or any(v[0] != "float32" for v in value.values()):
                    return None
                value = {k: v[1] for k, v in value.items()}
            if name not in _ENVELOPE:
                kwargs[name] = value
        return cls.with_checked_floats(kwargs)
    except SchemaError:
        raise  # the message's own validation: the same error the whole way gives
    except Exception:  # a tensor where a list belongs, a missing field, ...: the whole way says which
        return None


def _decode_map(obj: dict[str, Any], framed: tuple[bytes, int, int] | None) -> Message:
    """The message of an unpacked map; ``framed``: a version-6 record's bytes and its payload's area."""
    cls, fields = _checked_envelope(obj)
    if framed is not None:  # its tensor maps become {dtype, shape, data} views of the payload
        framing.attach(obj, framed[0], framed[1], framed[2], cls.__name__, views=False)
    kwargs: dict[str, Any] = {}
    try:
        for f in dataclasses.fields(cls):
            if f.name in obj:
                kwargs[f.name] = _field_value(cls, f.name, fields[f.name], obj[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                path = f"{cls.__name__}.{f.name}"
                raise ValidationError(
                    f"{path}: required field is missing; the writer must set it", field=path
                )
        return cls(**kwargs)
    except SchemaError:
        raise
    except Exception as e:  # defensive: never let a KeyError/TypeError escape
        raise ValidationError(f"{cls.__name__}: invalid message ({type(e).__name__}: {e})") from None


def peek_header(data: Any) -> tuple[str | None, int | None, str | None]:
    """``(schema, version, batch_id)`` read without decoding tensors; ``None`` for what is unreadable.

    Best effort, for logs and dead-letter headers: never raises.
    """
    found: dict[str, Any] = {}
    types = {"schema": str, "version": int, "batch_id": str}
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data))
        unpacker.feed(data)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in types and key not in found:
                value = unpacker.unpack()
                if isinstance(value, types[key]) and not isinstance(value, bool):
                    found[key] = value
                if len(found) == len(types):
                    break
            else:
                unpacker.skip()
    except Exception:
        pass
    return found.get("schema"), found.get("version"), found.get("batch_id")
