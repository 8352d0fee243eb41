"""expstream wire contract: message types, tensors, the msgpack codec and its errors.

Imports only numpy, msgpack and the standard library. See schemas/README.md for the format.
"""

from schemas.codec import MESSAGE_TYPES, SCHEMA_VERSIONS, Message, decode, encode, peek_header
from schemas.errors import DecodeError, SchemaError, UnknownSchemaError, ValidationError, VersionError
from schemas.messages import ACTION_FIELDS, LAYOUTS, PromptBatch, SampleBatch, sample_id
from schemas.tensors import DTYPES, Ragged, as_dtype, decode_tensor, dtype_name_of, encode_tensor, numpy_dtype

__all__ = [
    "sample_id",
    "ACTION_FIELDS",
    "DTYPES",
    "LAYOUTS",
    "MESSAGE_TYPES",
    "SCHEMA_VERSIONS",
    "DecodeError",
    "Message",
    "PromptBatch",
    "Ragged",
    "SampleBatch",
    "SchemaError",
    "UnknownSchemaError",
    "ValidationError",
    "VersionError",
    "as_dtype",
    "decode",
    "decode_tensor",
    "dtype_name_of",
    "encode",
    "encode_tensor",
    "numpy_dtype",
    "peek_header",
]
