"""Tensors and ragged arrays on the wire.

A tensor travels as the map ``{"dtype": str, "shape": [int, ...], "data": bin}`` where ``data`` is
the little-endian, C-order bytes of the array. ``bfloat16`` has no numpy dtype: it travels (and
lives in Python) as its raw 2-byte pattern in a ``uint16`` array, with the name ``"bfloat16"``
kept next to it (in the tensor map, or in :attr:`Ragged.dtype`).

A ragged field (B rows of varying length) travels as one flat array plus per-row lengths:
``{"lengths": tensor int32 (B,), "values": tensor (sum(lengths),)}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.errors import ValidationError

__all__ = [
    "DTYPES",
    "Ragged",
    "all_finite",
    "as_dtype",
    "decode_tensor",
    "dtype_name_of",
    "encode_tensor",
    "numpy_dtype",
]

#: Wire dtype name -> numpy dtype of the wire bytes (little-endian). bfloat16 is its uint16 bits.
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype("|b1"),
    "int8": np.dtype("|i1"),
    "uint8": np.dtype("|u1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_BY_KIND = {(dt.kind, dt.itemsize): name for name, dt in DTYPES.items() if name != "bfloat16"}
_TENSOR_KEYS = ("dtype", "shape", "data")
_TENSOR_KEYSET = frozenset(_TENSOR_KEYS)


def is_bfloat16(dt: np.dtype) -> bool:
    """Whether ``dt`` is ml_dtypes' bfloat16 (checked by kind first: ``dtype.name`` is slow to build)."""
    return dt.kind not in "biuf" and dt.name == "bfloat16"


def all_finite(values: np.ndarray) -> bool:
    """Whether every value of a float array is finite, in one pass without a temporary in the common case.

    ``x . x`` is NaN or inf when any element is (IEEE: NaN and inf propagate through the products and
    the sum); a finite result proves every element finite. A non-finite result can also come from an
    overflow of finite values (|x| > ~1e19 for float32), so it is confirmed element by element.
    """
    flat = values.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is confirmed below, not warned about
        square = float(np.dot(flat, flat))
    return math.isfinite(square) or bool(np.isfinite(flat).all())


def _same(a: np.dtype, b: np.dtype) -> bool:
    """Same kind and width (byte order ignored)."""
    return a.kind == b.kind and a.itemsize == b.itemsize


def short_repr(xs: Any, limit: int = 8) -> str:
    """``[1, 2, 3]`` rendering of a sequence, cut after ``limit`` items."""
    xs = list(np.asarray(xs).tolist()) if not isinstance(xs, list) else xs
    body = ", ".join(repr(x) for x in xs[:limit])
    return f"[{body}, ... ({len(xs)} in all)]" if len(xs) > limit else f"[{body}]"


def numpy_dtype(name: str, *, field: str = "tensor") -> np.dtype:
    """The numpy dtype that holds wire dtype ``name`` (``uint16`` for ``bfloat16``)."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ValidationError(f"{field}: unknown dtype {name!r}; use one of {', '.join(DTYPES)}", field=field)
    return DTYPES[name]


def dtype_name_of(dtype: Any, *, field: str = "tensor") -> str:
    """The wire dtype name of a numpy dtype (``np.float32`` -> ``"float32"``)."""
    dt = np.dtype(dtype)
    if is_bfloat16(dt):  # ml_dtypes.bfloat16, if someone hands one over
        return "bfloat16"
    name = _BY_KIND.get((dt.kind, dt.itemsize))
    if name is None:
        hint = "; if these are bfloat16 bit patterns, pass dtype 'bfloat16'" if dt == np.uint16 else ""
        raise ValidationError(
            f"{field}: numpy dtype {dt} has no wire dtype{hint}; cast to one of {', '.join(DTYPES)}",
            field=field,
        )
    return name


def as_dtype(x: Any, name: str, *, field: str = "value") -> np.ndarray:
    """``x`` (array or nested lists) as an array of wire dtype ``name``, converting only losslessly.

    Same-kind casts (int64 -> int32 within range, float64 -> float32, int -> float) and 0/1
    integers -> bool are done; anything else (float -> int, out-of-range ints) raises
    :class:`ValidationError`. ``bfloat16`` must be given as uint16 bit patterns.
    """
    target = numpy_dtype(name, field=field)
    a = np.asarray(x)
    if name == "bfloat16" and is_bfloat16(a.dtype):
        return a.view(np.uint16)
    if _same(a.dtype, target):
        return a
    if a.size == 0:
        return a.astype(target)
    if name == "bfloat16":
        raise ValidationError(
            f"{field}: bfloat16 data must be given as uint16 bit patterns, got {a.dtype}; "
            "pass the raw bits (e.g. torch_tensor.view(torch.int16).numpy().view(np.uint16))",
            field=field,
        )
    if target.kind == "b" and a.dtype.kind in "iu" and bool(((a == 0) | (a == 1)).all()):
        return a.astype(target)
    if a.dtype.kind in "biu" and target.kind in "iu":
        info = np.iinfo(target)
        if int(a.min()) >= info.min and int(a.max()) <= info.max:
            return a.astype(target)
    elif np.can_cast(a.dtype, target, "same_kind"):
        return a.astype(target)
    raise ValidationError(
        f"{field}: cannot convert {a.dtype} values to {name} without loss; "
        f"pass {name} values (e.g. np.asarray(x, dtype=np.{target.name}))",
        field=field,
    )


def encode_tensor(arr: Any, dtype_name: str | None = None, *, field: str = "tensor",
                  copy: bool = True) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` map of ``arr`` (little-endian C-order bytes).

    ``dtype_name`` is the wire dtype; by default it is inferred from ``arr``. An ndarray is never
    silently cast (only its byte order is normalised); ``"bfloat16"`` needs uint16 bits.
    Non-arrays (lists, scalars) are converted with :func:`as_dtype`.

    ``copy=False``: ``data`` is a read-only memoryview of the (contiguous) array instead of a bytes
    copy, for a caller that packs the map right away (schemas.encode): msgpack packs it as the same
    bin bytes, and a fresh multi-MB bytes object per tensor costs more in page faults than the copy.
    """
    if not isinstance(arr, np.ndarray):
        a = as_dtype(arr, dtype_name, field=field) if dtype_name else np.asarray(arr)
    else:
        a = arr.view(np.uint16) if is_bfloat16(arr.dtype) else arr
    name = dtype_name or dtype_name_of(arr.dtype if isinstance(arr, np.ndarray) else a.dtype, field=field)
    target = numpy_dtype(name, field=field)
    if not _same(a.dtype, target):
        raise ValidationError(
            f"{field}: array has dtype {a.dtype} but the wire dtype is {name}; "
            f"cast it first (arr.astype(np.{target.name}))",
            field=field,
        )
    a = np.ascontiguousarray(a, dtype=target)
    data = a.tobytes() if copy else memoryview(a.reshape(-1).view(np.uint8)).toreadonly()
    return {"dtype": name, "shape": [int(s) for s in a.shape], "data": data}


def decode_tensor(d: Any, *, field: str = "tensor") -> np.ndarray:
    """The array for a tensor map, viewing its ``data`` bytes without copying (read-only).

    Raises :class:`ValidationError` when the map is malformed or ``len(data)`` is not
    ``prod(shape) * itemsize``.
    """
    if not isinstance(d, dict):
        raise ValidationError(
            f"{field}: expected a tensor map {{dtype, shape, data}}, got {type(d).__name__}; "
            "encode arrays with schemas.encode_tensor",
            field=field,
        )
    if d.keys() != _TENSOR_KEYSET:
        missing = [k for k in _TENSOR_KEYS if k not in d]
        extra = sorted(str(k) for k in d if k not in _TENSOR_KEYS)
        raise ValidationError(
            f"{field}: tensor map must have exactly the keys dtype, shape, data "
            f"(missing {missing}, unexpected {extra})",
            field=field,
        )
    name = d["dtype"]
    dt = numpy_dtype(name, field=field)
    shape = d["shape"]
    one_dim = type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0  # the common case
    if not one_dim and (not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)):
        raise ValidationError(
            f"{field}: shape must be a list of non-negative ints, got {shape!r}", field=field
        )
    data = d["data"]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValidationError(
            f"{field}: data must be msgpack bin (bytes), got {type(data).__name__}; "
            "write it with the bin type (use_bin_type=True), not as a string",
            field=field,
        )
    nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
    count = math.prod(shape)
    if nbytes != count * dt.itemsize:
        raise ValidationError(
            f"{field}: data has {nbytes} bytes but shape {shape} of {name} needs "
            f"{count} x {dt.itemsize} = {count * dt.itemsize}; the tensor is truncated or its shape is wrong",
            field=field,
        )
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    if name == "bool" and count and int(np.frombuffer(data, dtype=np.uint8).max()) > 1:
        raise ValidationError(
            f"{field}: bool tensor has bytes other than 0 and 1; write 0x00/0x01", field=field
        )
    return arr


@dataclass(eq=False, repr=False)
class Ragged:
    """B rows of varying length stored as one flat array plus lengths.

    ``values``: (sum(lengths),) array of wire dtype ``dtype`` (bfloat16 as uint16 bits).
    ``lengths``: int32 (B,), non-negative. ``dtype``: wire dtype name, inferred from ``values``
    when left empty (it must be given for bfloat16). Construction validates all three.
    """

    values: np.ndarray  # (sum(lengths),) of `dtype`
    lengths: np.ndarray  # int32 (B,)
    dtype: str = ""  # wire dtype name, e.g. "int32"; "" = infer from values

    def __post_init__(self) -> None:
        values = self.values if isinstance(self.values, np.ndarray) else np.asarray(self.values)
        if is_bfloat16(values.dtype):
            values, self.dtype = values.view(np.uint16), self.dtype or "bfloat16"
        if values.ndim != 1:
            raise ValidationError(
                f"Ragged: values must be 1-D (sum(lengths),), got shape {values.shape}; "
                "flatten the rows (Ragged.from_rows)"
            )
        name = self.dtype or dtype_name_of(values.dtype, field="Ragged")
        target = numpy_dtype(name, field="Ragged")
        if not _same(values.dtype, target):
            raise ValidationError(
                f"Ragged: values have dtype {values.dtype} but dtype={name!r}; "
                f"cast the values to {target.name} or build with Ragged.from_rows(rows, {name!r})"
            )
        lengths = self.lengths if isinstance(self.lengths, np.ndarray) else np.asarray(self.lengths)
        if lengths.size == 0:
            lengths = lengths.astype(np.int32).reshape(lengths.shape)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu":
            raise ValidationError(
                f"Ragged: lengths must be a 1-D integer array (B,), got {lengths.dtype} {lengths.shape}"
            )
        if lengths.size and int(lengths.min()) < 0:
            raise ValidationError(f"Ragged: lengths must be non-negative, got {short_repr(lengths)}")
        if lengths.dtype != np.int32:
            lengths = as_dtype(lengths, "int32", field="Ragged.lengths")
        total = int(lengths.sum(dtype=np.int64))
        if total != values.shape[0]:
            raise ValidationError(
                f"Ragged: lengths sum to {total} but values has {values.shape[0]} elements; "
                "lengths[i] must be the length of row i and values all rows back to back"
            )
        self.values, self.lengths, self.dtype = values, lengths, name

    @classmethod
    def checked(cls, values: np.ndarray, lengths: np.ndarray, dtype: str) -> Ragged:
        """A Ragged of arrays the caller has checked, built without checking them again: ``values`` 1-D of
        wire dtype ``dtype`` (its numpy dtype), ``lengths`` 1-D int32, non-negative, summing to
        ``len(values)``. The framed decoder (schemas/codec.py) checks a record's tensors in bulk."""
        r = cls.__new__(cls)
        r.values, r.lengths, r.dtype = values, lengths, dtype
        return r

    @classmethod
    def from_rows(cls, rows: Iterable[Any], dtype: str | np.dtype | type) -> Ragged:
        """Ragged of ``rows`` (1-D arrays or lists) converted losslessly to ``dtype``."""
        name = dtype if isinstance(dtype, str) else dtype_name_of(dtype)
        arrays = []
        for i, row in enumerate(rows):
            a = as_dtype(row, name, field=f"Ragged row {i}")
            if a.ndim != 1:
                raise ValidationError(f"Ragged row {i}: rows must be 1-D, got shape {a.shape}")
            arrays.append(a)
        target = numpy_dtype(name)
        values = np.concatenate(arrays).astype(target, copy=False) if arrays else np.empty(0, target)
        return cls(values, np.asarray([a.shape[0] for a in arrays], dtype=np.int32), name)

    @property
    def offsets(self) -> np.ndarray:
        """int64 (B+1,): row i is ``values[offsets[i]:offsets[i+1]]``."""
        off = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=off[1:])
        return off

    @property
    def total(self) -> int:
        """Number of values in all rows (``sum(lengths)``)."""
        return int(self.values.shape[0])

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def row(self, i: int) -> np.ndarray:
        """Row ``i`` (a view of ``values``); negative indices count from the end."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"Ragged row {i} out of range for {n} rows")
        i %= n
        start = int(self.lengths[:i].sum(dtype=np.int64))
        return self.values[start : start + int(self.lengths[i])]

    def rows(self) -> list[np.ndarray]:
        """All rows, as views of ``values``."""
        if len(self) == 0:
            return []
        return np.split(self.values, self.offsets[1:-1])

    def to_padded(self, pad_value: Any = 0, width: int | None = None) -> np.ndarray:
        """(B, width) array, rows left-aligned and padded with ``pad_value`` on the right."""
        longest = int(self.lengths.max()) if len(self) else 0
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"to_padded: width {width} is shorter than the longest row ({longest})")
        out = np.full((len(self), width), pad_value, dtype=self.values.dtype)
        out[np.arange(width)[None, :] < self.lengths[:, None]] = self.values
        return out

    def select(self, indices: Sequence[int] | np.ndarray) -> Ragged:
        """New Ragged with rows ``indices`` (ints, negatives allowed, or a bool mask of B)."""
        idx = normalise_indices(indices, len(self))
        sel = self.lengths[idx]
        total = int(sel.sum(dtype=np.int64))
        if total == 0:
            values = self.values[:0].copy()
        else:
            out_starts = np.cumsum(sel, dtype=np.int64) - sel
            gather = np.repeat(self.offsets[:-1][idx] - out_starts, sel) + np.arange(total, dtype=np.int64)
            values = self.values[gather]
        return Ragged(values, sel.astype(np.int32), self.dtype)

    @classmethod
    def concat(cls, parts: Sequence[Ragged], dtype: str | None = None) -> Ragged:
        """Rows of all ``parts`` in order; they must share one dtype (``dtype`` if given)."""
        names = {p.dtype for p in parts} | ({dtype} if dtype else set())
        if len(names) > 1:
            raise ValidationError(
                f"Ragged.concat: parts have different dtypes {sorted(names)}; cast them to one"
            )
        if not names:
            raise ValueError("Ragged.concat: no parts; pass dtype= to build an empty Ragged")
        name = names.pop()
        target = numpy_dtype(name)
        if not parts:
            return cls(np.empty(0, target), np.empty(0, np.int32), name)
        values = np.concatenate([np.asarray(p.values, dtype=target) for p in parts])
        return cls(values, np.concatenate([p.lengths for p in parts]).astype(np.int32), name)

    def to_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """``{"lengths": tensor int32 (B,), "values": tensor (sum(lengths),)}`` (``copy``: see encode_tensor)."""
        return {
            "lengths": encode_tensor(self.lengths, "int32", copy=copy),
            "values": encode_tensor(self.values, self.dtype, copy=copy),
        }

    @classmethod
    def from_dict(cls, d: Any, *, field: str = "ragged") -> Ragged:
        """Ragged from its wire map (values viewed without copying)."""
        if not isinstance(d, dict) or set(d) != {"lengths", "values"}:
            got = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
            raise ValidationError(
                f"{field}: expected a ragged map with exactly the keys lengths, values; got {got}",
                field=field,
            )
        lengths = decode_tensor(d["lengths"], field=f"{field}.lengths")
        values = decode_tensor(d["values"], field=f"{field}.values")
        if d["lengths"]["dtype"] != "int32" or lengths.ndim != 1:
            raise ValidationError(
                f"{field}.lengths: must be an int32 tensor of shape (B,), got "
                f"{d['lengths']['dtype']} {list(lengths.shape)}; write the lengths as int32",
                field=field,
            )
        if values.ndim != 1:
            raise ValidationError(
                f"{field}.values: must be 1-D (sum(lengths),), got shape {list(values.shape)}; flatten the rows",
                field=field,
            )
        try:
            return cls(values, lengths, d["values"]["dtype"])
        except ValidationError as e:
            raise ValidationError(f"{field}: {e}", field=field) from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        target = DTYPES[self.dtype]
        return (
            self.dtype == other.dtype
            and np.array_equal(self.lengths, other.lengths)
            and np.ascontiguousarray(self.values, target).tobytes()
            == np.ascontiguousarray(other.values, target).tobytes()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Ragged(dtype={self.dtype!r}, rows={len(self)}, total={self.total}, lengths={short_repr(self.lengths)})"


def normalise_indices(indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """int64 row indices in [0, n) from ints (negatives allowed) or a bool mask of length n."""
    idx = np.asarray(indices)
    if idx.dtype.kind == "b":
        if idx.shape != (n,):
            raise IndexError(f"bool mask has shape {idx.shape}, expected ({n},)")
        return np.flatnonzero(idx)
    if idx.size == 0:
        return np.empty(0, dtype=np.int64)
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise IndexError(f"indices must be a 1-D sequence of ints, got {idx.dtype} {idx.shape}")
    idx = idx.astype(np.int64)
    bad = idx[(idx < -n) | (idx >= n)]
    if bad.size:
        raise IndexError(f"row index {int(bad[0])} out of range for {n} rows")
    return np.where(idx < 0, idx + n, idx)
