"""A run's recorded topic as entries: decoded records (:class:`Located`) and compared entries (:class:`Sample`).

The reading side that ``expstream show`` and ``expstream diff`` share: every record of a topic in
recording order (:func:`iter_located`; ``experiences.msgpack`` when that topic was not recorded),
the rows of a SampleBatch, the prompts of a PromptBatch and the dead letters of a ``.dlq`` topic as
entries keyed by id, the first occurrence winning (:func:`read_samples`). Apart from ``show`` so that
``diff`` reads a run without the views or the tokenizer. The format: docs/replay.md ("show", "diff").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from expstream.errors import ConfigError
from expstream.kafka.letters import H_BATCH_ID, H_REPLICA, H_TOPIC, decode_headers, redrive_attempt
from expstream.kafka.provenance import H_PRODUCED_AT
from expstream.kafka.topics import DLQ_SUFFIX
from expstream.tools.recording import Damage, RecordFrame, RecordingError, iter_topic, recorded_topics

__all__ = [
    "EXPERIENCES_FILE",
    "EXPERIENCES_TOPIC",
    "LETTER_POSITION_HEADERS",
    "Located",
    "Sample",
    "SampleSet",
    "is_dlq",
    "iter_located",
    "letter_entry",
    "letter_key",
    "read_samples",
    "refuse_damaged",
    "split_prompts",
    "split_samples",
]

#: The run's finished experiences (outcome.py writes it); read for topic ``experiences`` when the
#: run has no recording of that topic (runs made before recording existed).
EXPERIENCES_FILE = "experiences.msgpack"
EXPERIENCES_TOPIC = "experiences"
#: Dead-letter headers that say *where* or *when*, not *what*: which replica, the producing time, the
#: original's partition and offset (they follow scheduling: two runs of one prompt file differ in
#: them). ``diff`` leaves them out of a letter's comparison; ``show`` prints them.
LETTER_POSITION_HEADERS: tuple[str, ...] = (H_REPLICA, H_PRODUCED_AT, "original_partition", "original_offset")


@dataclass
class Located:
    """One decoded record and where it came from (a recording frame, or a record of experiences.msgpack)."""

    where: str  # topic[partition]@offset, or "experiences.msgpack#<k>"
    frame: RecordFrame | None  # None when read from experiences.msgpack
    batch: Any = None  # the decoded SampleBatch (None when undecodable)
    error: str | None = None  # "ErrorClass: message" when the value could not be decoded


@dataclass
class Sample:
    """One compared entry of a topic: a row of a decoded SampleBatch (``kind`` "sample"), a prompt
    of a PromptBatch ("prompt") or a dead letter ("letter"), every field as its own value."""

    sample_id: str  # f"{group_id}#{sample_index}"; a prompt: its prompt id; a letter: letter_key()
    row: int  # row in its record (a letter: 0)
    located: Located
    # field -> value: str/int/float for per-sample and per-batch scalars, np.ndarray (x_b,) for a
    # ragged row, float for a (B,) array's entry; dict fields flattened to "info.<key>" /
    # "reward_metrics.<key>"; absent optional fields are left out. A letter: "headers.<name>" and
    # "value.<row id>.<field>" (its value decoded) or "value" (its bytes, when it does not decode)
    fields: dict[str, Any] = field(default_factory=dict)
    kind: str = "sample"


def _check_run_dir(run: Path, flag: str) -> None:
    if not run.is_dir():
        raise ConfigError(f"run directory {str(run)!r} does not exist", field=flag,
                          fix="give the directory `expstream run --output` (or replay/record) wrote, e.g. runs/<name>")


def _decode(value: bytes | None) -> tuple[Any, str | None]:
    from schemas.codec import decode

    if value is None:
        return None, "tombstone (no value)"
    try:
        return decode(value), None
    except Exception as exc:  # noqa: BLE001 - any bytes may be on a topic (a .dlq twin above all); reported
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def is_dlq(topic: str) -> bool:
    """A dead-letter twin (``<topic>.dlq``): its records are letters, compared and shown as such."""
    return topic.endswith(DLQ_SUFFIX)


def iter_located(run: str | Path, topic: str, *, flag: str = "RUN_DIR", strict: bool = True,
                 on_damage: Callable[[Damage], None] | None = None) -> Iterator[Located]:
    """Every record of ``topic`` in ``run``, decoded, in recording order (merged by time).

    Reads ``topics/<topic>/`` when recorded; else, for ``experiences``, ``experiences.msgpack``
    (file order); else a ConfigError naming ``--topic`` and the recorded topics. ``strict`` and
    ``on_damage``: as :func:`expstream.tools.recording.iter_topic` (a torn tail or, not strict, a
    corrupt frame ends a partition and is handed to ``on_damage``).
    """
    run = Path(run)
    _check_run_dir(run, flag)
    topics = recorded_topics(run)
    if topic in topics:
        for frame in iter_topic(run, topic, order="time", strict=strict, on_damage=on_damage):
            batch, error = _decode(frame.value)
            yield Located(frame.where, frame, batch, error)
        return
    exp = run / EXPERIENCES_FILE
    if topic == EXPERIENCES_TOPIC and exp.is_file():
        from expstream.rl.expfile import iter_records

        try:
            for k, value in enumerate(iter_records(exp)):
                batch, error = _decode(value)
                yield Located(f"{EXPERIENCES_FILE}#{k}", None, batch, error)
        except ValueError as exc:  # a cut file: everything before the cut was yielded
            raise ConfigError(f"{exp}: {exc}", field=flag,
                              fix="the file is damaged; read the run's recording instead (--topic with a "
                                  "recorded topic) or re-run") from exc
        return
    raise ConfigError(f"{run}: topic {topic!r} is not recorded there"
                      + ("" if topic != EXPERIENCES_TOPIC else f" and there is no {EXPERIENCES_FILE}"),
                      field="--topic", fix=f"name a recorded topic: {', '.join(topics) or 'none recorded'}")


def split_samples(batch: Any, located: Located) -> list[Sample]:
    """The rows of a decoded SampleBatch as :class:`Sample` objects (PromptBatch: none)."""
    if not hasattr(batch, "sample_index"):
        return []
    out = []
    per_batch = set(batch.PER_BATCH)
    for r, sid in enumerate(batch.sample_ids()):
        fields: dict[str, Any] = {}
        for name, kind in batch.FIELDS.items():
            value = getattr(batch, name)
            if value is None:
                continue
            if name in per_batch:
                fields[name] = value
            elif kind in ("strs", "ints"):
                fields[name] = value[r]
            elif kind == "opt_ints":
                if value:
                    fields[name] = value[r]
            elif kind == "opt_refs":  # images / videos: the sample's blob references (text-only: left out)
                if value:
                    fields[name] = list(value[r])
            elif kind == "ragged":
                fields[name] = np.asarray(value.row(r))
            elif kind == "array":
                fields[name] = float(value[r])
            elif kind == "arrays":
                for key, arr in value.items():
                    fields[f"{name}.{key}"] = float(arr[r])
        out.append(Sample(sid, r, located, fields))
    return out


def split_prompts(batch: Any, located: Located) -> list[Sample]:
    """The prompts of a decoded PromptBatch as :class:`Sample` entries keyed by prompt id (kind "prompt")."""
    if hasattr(batch, "sample_index") or not hasattr(batch, "prompt_id"):
        return []
    out = []
    for r, pid in enumerate(batch.prompt_id):
        fields: dict[str, Any] = {"batch_id": batch.batch_id}
        for name, kind in batch.FIELDS.items():
            value = getattr(batch, name)
            if name in ("batch_id", "prompt_id") or value is None:
                continue
            if kind == "opt_refs":
                if value:
                    fields[name] = list(value[r])
            else:
                fields[name] = value[r]
        out.append(Sample(pid, r, located, fields, kind="prompt"))
    return out


def letter_key(headers: dict[str, str], where: str) -> str:
    """A dead letter's identity across runs: the batch id of its value (``batch_id`` header), else the
    original record's position; ``#attempt<k>`` when a redrive made it (``redrive_attempt`` k > 0)."""
    bid = headers.get(H_BATCH_ID)
    base = bid if bid else f"@{headers.get(H_TOPIC, '?')}[{headers.get('original_partition', '?')}]" \
                           f"@{headers.get('original_offset', '?')}"
    attempt = redrive_attempt(headers)
    return f"{base}#attempt{attempt}" if attempt else base


def letter_entry(loc: Located) -> Sample:
    """One record of a dead-letter topic as a compared entry (kind "letter"): its headers but
    :data:`LETTER_POSITION_HEADERS`, and its value's rows (decoded) or bytes."""
    raw = loc.frame.headers if loc.frame is not None else ()
    headers = decode_headers(raw)
    fields: dict[str, Any] = {f"headers.{k}": v for k, v in headers.items() if k not in LETTER_POSITION_HEADERS}
    rows = []
    if loc.batch is not None:
        rows = split_samples(loc.batch, loc) or split_prompts(loc.batch, loc)
    if rows:
        for r in rows:
            fields.update({f"value.{r.sample_id}.{k}": v for k, v in r.fields.items()})
    elif loc.frame is not None:
        fields["value"] = loc.frame.value or b""
    return Sample(letter_key(headers, loc.where), 0, loc, fields, kind="letter")


@dataclass
class SampleSet:
    """A topic's entries (samples, prompts or dead letters), first occurrence per id (read_experiences' rule)."""

    source: str  # what was read: "<run>/topics/<topic>" or "<run>/experiences.msgpack"
    samples: dict[str, Sample] = field(default_factory=dict)
    duplicates: int = 0  # entries whose id was seen before (dropped)
    records: int = 0
    undecodable: list[str] = field(default_factory=list)  # "where: error" per record that did not decode
    kinds: dict[str, int] = field(default_factory=dict)  # entry kind -> how many were kept
    torn: list[str] = field(default_factory=list)  # damage messages of torn partition files (read up to there)


def read_samples(run: str | Path, topic: str, *, flag: str = "RUN_DIR",
                 on_damage: Callable[[Damage], None] | None = None) -> SampleSet:
    """Every entry of ``topic`` in ``run``, the first occurrence per id winning: the samples of
    SampleBatch records, the prompts of PromptBatch records, or (a ``.dlq`` topic) the dead letters.

    A corrupt recording raises RecordingError; a torn tail is read up to there, named in ``torn``
    and handed to ``on_damage``.
    """
    run = Path(run)
    source = str(run / "topics" / topic) if topic in recorded_topics(run) else str(run / EXPERIENCES_FILE)
    out = SampleSet(source)

    def damaged(d: Damage) -> None:
        out.torn.append(d.message())
        if on_damage is not None:
            on_damage(d)

    letters = is_dlq(topic)
    for loc in iter_located(run, topic, flag=flag, on_damage=damaged):
        out.records += 1
        if letters:
            entries = [letter_entry(loc)]
        elif loc.batch is None:
            out.undecodable.append(f"{loc.where}: {loc.error}")
            continue
        else:
            entries = split_samples(loc.batch, loc) or split_prompts(loc.batch, loc)
        for s in entries:
            if s.sample_id in out.samples:
                out.duplicates += 1
            else:
                out.samples[s.sample_id] = s
                out.kinds[s.kind] = out.kinds.get(s.kind, 0) + 1
    return out


def refuse_damaged(exc: RecordingError, flag: str) -> ConfigError:
    """A damaged recording as the command's error: the file, the byte position, what to do."""
    return ConfigError(str(exc), field=flag, fix="the recording was modified after it was written; restore it, or "
                                                 "compare another topic (--topic)")
