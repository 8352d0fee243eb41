"""Dead letters on the wire: the header names, how the runner builds a letter, how one is read back.

A dead letter is the record a stage could not process, sent to the dead-letter twin of the stage's
input topic with its original bytes (or a 1-row batch cut out of a split micro-batch) and headers
saying what went wrong and where it came from. The writer is stages/deadletters.py (through
:func:`letter_headers`), the reader is ``expstream dlq`` (expstream/tools/dlq.py, through
:func:`decode_headers` and :func:`redrive_headers`): one module, so the two cannot drift apart.
Every header, and how the original record's own headers are carried: docs/dead-letters.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from schemas.codec import peek_header

H_STAGE, H_REPLICA, H_ERROR_CLASS, H_ERROR_MESSAGE = "stage", "replica", "error_class", "error_message"
H_TOPIC, H_PARTITION, H_OFFSET = "original_topic", "original_partition", "original_offset"
H_SCHEMA, H_VERSION, H_BATCH_ID, H_SIZE = "schema", "schema_version", "batch_id", "size"
H_SPLIT_FROM, H_SAMPLE_IDS, H_VALUE_OMITTED = "split_from", "sample_ids", "value_omitted"
H_HEADERS_OMITTED, H_SAMPLE_ERRORS = "headers_omitted", "sample_errors"
H_ATTEMPT = "redrive_attempt"
#: Headers that describe one dead-lettering: replaced (never duplicated) when a redriven record
#: fails again, and stripped when redrive re-publishes a letter to its original topic.
RUNNER_HEADERS: tuple[str, ...] = (
    H_STAGE, H_REPLICA, H_ERROR_CLASS, H_ERROR_MESSAGE, H_TOPIC, H_PARTITION, H_OFFSET, H_SCHEMA,
    H_VERSION, H_BATCH_ID, H_SIZE, H_SPLIT_FROM, H_SAMPLE_IDS, H_VALUE_OMITTED, H_HEADERS_OMITTED,
    H_SAMPLE_ERRORS,
)  # fmt: skip
# Header values are truncated so one enormous error message cannot make the DLQ record oversized.
MAX_HEADER_CHARS = 2000
#: Why 300: one sample's reason is one line of a summary (expstream.launch.collector keeps as much), not a traceback.
SAMPLE_ERROR_CHARS = 300

Headers = list[tuple[str, bytes]]


def encode_headers(**items: Any) -> Headers:
    """``name=value`` pairs as Kafka headers: ``str(value)`` truncated, UTF-8; ``None`` values left out."""
    return [(k, str(v)[:MAX_HEADER_CHARS].encode()) for k, v in items.items() if v is not None]


def decode_headers(raw: Iterable[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """Kafka headers as a dict of text (undecodable bytes replaced, a missing value read as empty)."""
    return {k: (v or b"").decode("utf-8", errors="replace") for k, v in raw or []}


def header_value(headers: Headers | None, name: str) -> str:
    """The text of header ``name`` (the first one), or ``""``."""
    for k, v in headers or []:
        if k == name:
            return (v or b"").decode(errors="replace")
    return ""


def letter_headers(record: Any, *, stage: str, replica: str, error_class: str, error_message: str,
                   value: bytes | None, sample_ids: list[str] | None = None,
                   split_from: str | None = None, errors: Mapping[str, str] | None = None) -> Headers:
    """The headers of the letter for input ``record`` carrying ``value`` (the original or a 1-row cut).

    The record's own headers come first, except earlier dead-lettering ones (a redriven record that
    fails again gets fresh ones, not two sets). The envelope fields are read from ``value``, else
    from the original bytes when ``value`` is the original and unreadable. ``errors``: each sample's
    own reason (``sample_errors``), for a record dead-lettered whole after every sample failed alone.
    """
    original = record.value
    schema, version, batch_id = peek_header(value) if value else (None, None, None)
    if schema is None and original is not None and value is original:
        schema, version, batch_id = peek_header(original)
    kept = [(k, v if v is not None else b"") for k, v in (record.headers or []) if k not in RUNNER_HEADERS]
    return kept + encode_headers(**{
        H_STAGE: stage,
        H_REPLICA: replica,
        H_ERROR_CLASS: error_class,
        H_ERROR_MESSAGE: error_message,
        H_TOPIC: record.topic,
        H_PARTITION: record.partition,
        H_OFFSET: record.offset,
        H_SCHEMA: schema,
        H_VERSION: version,
        H_BATCH_ID: batch_id,
        H_SIZE: len(original) if original is not None else 0,
        H_SPLIT_FROM: split_from,
        H_SAMPLE_IDS: ",".join(sample_ids) if sample_ids is not None else None,
        H_SAMPLE_ERRORS: encode_sample_errors(errors) if errors else None,
    })


def encode_sample_errors(errors: Mapping[str, str]) -> str:
    """The ``sample_errors`` header: a JSON object of the first ``SAMPLE_ERROR_CHARS`` of each reason,
    as many ids (in order) as fit in ``MAX_HEADER_CHARS``, so the value is never cut mid-JSON."""
    kept: dict[str, str] = {}
    for sid, reason in errors.items():
        trial = {**kept, str(sid): str(reason)[:SAMPLE_ERROR_CHARS]}
        if len(json.dumps(trial, ensure_ascii=False)) > MAX_HEADER_CHARS:
            break
        kept = trial
    return json.dumps(kept, ensure_ascii=False)


def sample_errors(headers: Mapping[str, str]) -> dict[str, str]:
    """Sample (or prompt) id -> that sample's own reason, from decoded letter headers ({} when absent
    or unreadable: then every sample's reason is the letter's ``error_class``/``error_message``)."""
    raw = headers.get(H_SAMPLE_ERRORS)
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {str(k): str(v) for k, v in parsed.items()}


def value_omitted_headers(headers: Headers | None, reason: str) -> Headers:
    """``headers`` plus ``value_omitted``: the letter goes out empty, the original stays where it was."""
    return [*(headers or []), *encode_headers(**{H_VALUE_OMITTED: reason})]


def headers_omitted_headers(headers: Headers | None, reason: str) -> Headers:
    """``headers`` plus ``headers_omitted``: the original record's own headers did not fit in the letter."""
    return [*(headers or []), *encode_headers(**{H_HEADERS_OMITTED: reason})]


def redrive_headers(raw: Iterable[tuple[str, bytes]], attempt: int) -> Headers:
    """The original record's own headers plus ``redrive_attempt`` = ``attempt`` + 1."""
    kept = [(k, v if v is not None else b"") for k, v in raw if k not in RUNNER_HEADERS and k != H_ATTEMPT]
    return [*kept, (H_ATTEMPT, str(attempt + 1).encode())]


def redrive_attempt(headers: dict[str, str]) -> int:
    """How many times a letter was redriven (0 when the header is absent or unreadable)."""
    try:
        return int(headers.get(H_ATTEMPT, "0") or 0)
    except ValueError:
        return 0
