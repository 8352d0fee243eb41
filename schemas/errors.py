"""Errors raised by the wire contract.

Every failure to decode or validate a message raises a :class:`SchemaError` subclass. None of
them is retriable: the same bytes fail the same way every time, so the stage runner sends the
record to the dead-letter topic instead of retrying it.

Messages name the field (``SampleBatch.rewards: ...``) and say how to fix the problem.
"""

from __future__ import annotations

__all__ = ["SchemaError", "DecodeError", "UnknownSchemaError", "VersionError", "ValidationError"]


class SchemaError(ValueError):
    """Base class of every wire-contract error (a ``ValueError``; never retriable).

    ``field`` is the dotted field name (``"SampleBatch.rewards"``) when the error is about one
    field, else ``None``.
    """

    retriable = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class DecodeError(SchemaError):
    """The bytes are not one msgpack map (not msgpack, truncated, trailing bytes, not a map)."""


class UnknownSchemaError(SchemaError):
    """The map's ``schema`` is missing, not a string, or not a schema this reader knows."""


class VersionError(SchemaError):
    """The map's ``version`` is missing, not an int, or not supported for its schema."""


class ValidationError(SchemaError):
    """A field is missing, unknown, of the wrong type/dtype/shape, or inconsistent with others."""
