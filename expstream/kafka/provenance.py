"""Provenance headers: every record says which stage produced it, under which policy, and when.

Every record the pipeline writes carries three headers (DESIGN.md, "The run directory"):

=====================  ==========================================================================
``producer``           the stage that wrote it (``generate``, ``reward``, ...; the end-of-input
                       flush the run publishes is named after the stage it speaks for), ``feeder``
                       (the prompt records) or ``trainer`` (policy announcements)
``policy_version``     ASCII decimal: the SampleBatch's ``policy_version`` (the weights that
                       generated it), or the announced version for other records
``produced_at_ms``     ASCII decimal: wall-clock milliseconds since the epoch when it was sent
=====================  ==========================================================================

So lag in *time* (not only in offsets), staleness and provenance are measurable per hop: a stage
observes ``now - produced_at_ms`` of each input (``expstream_record_age_seconds``), ``status``
shows the mean age of the records each stage handled since its previous snapshot, and the report
plots records written per second by producer from the recording when a run has no status.jsonl.

The names do not collide with the dead-letter headers (expstream/kafka/letters.py: ``stage`` is the
stage that *failed*); a dead letter keeps the original record's three headers byte for byte.
Readers are tolerant: a record from another client without them, or with garbled values, reads
as ``None`` fields, never an exception.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

H_PRODUCER, H_POLICY_VERSION, H_PRODUCED_AT = "producer", "policy_version", "produced_at_ms"
PROVENANCE_HEADERS = (H_PRODUCER, H_POLICY_VERSION, H_PRODUCED_AT)


@dataclass(frozen=True)
class Provenance:
    producer: str | None
    policy_version: int | None
    produced_at_ms: int | None

    def age_s(self, now_ms: int | None = None) -> float | None:
        """Seconds since the record was produced (None without a production time)."""
        if self.produced_at_ms is None:
            return None
        return max(0.0, ((now_ms if now_ms is not None else now_millis()) - self.produced_at_ms) / 1000.0)


def now_millis() -> int:
    return int(time.time() * 1000)


def provenance_headers(producer: str, policy_version: int, now_ms: int | None = None) -> list[tuple[str, bytes]]:
    """The three headers for a record written now by ``producer`` under ``policy_version``."""
    return [(H_PRODUCER, producer.encode()), (H_POLICY_VERSION, str(int(policy_version)).encode()),
            (H_PRODUCED_AT, str(now_millis() if now_ms is None else int(now_ms)).encode())]


def _int(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None


def read_provenance(headers: Iterable[tuple[str, bytes | None]] | None) -> Provenance | None:
    """The provenance of a record's headers; None when it carries none of the three."""
    found: dict[str, bytes | None] = {}
    for name, value in headers or ():
        if name in PROVENANCE_HEADERS and name not in found:
            found[name] = value
    if not found:
        return None
    producer = found.get(H_PRODUCER)
    try:
        who = producer.decode("utf-8") if producer is not None else None
    except (UnicodeDecodeError, AttributeError):
        who = None
    return Provenance(who, _int(found.get(H_POLICY_VERSION)), _int(found.get(H_PRODUCED_AT)))
