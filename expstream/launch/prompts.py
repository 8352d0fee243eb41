"""Prompt files -> PromptBatch records on the input topic (what ``expstream run`` feeds).

Record ids ``p{k:06d}`` are stable across runs (the idempotence keys downstream), and every send
is confirmed before the run counts the prompts as fed.

A continuous run (``expstream run --continuous``) feeds the file epoch after epoch through
:class:`EpochFeeder`: epoch ``e`` visits the prompts in a permutation seeded by ``(run.seed, e)``,
a prompt's id in epoch ``e`` is ``<id>@e<e>`` (unique per epoch, so groups, samples and the
idempotence keys downstream never collide), and every record holds exactly
``run.prompt_batch_size`` prompts (a record spans an epoch boundary when the file size is not a
multiple of it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from expstream.config.kafka import KafkaConfig
from expstream.errors import ConfigError
from expstream.kafka.clients import make_producer, send_all_and_confirm
from expstream.kafka.letters import (
    H_BATCH_ID,
    H_ERROR_CLASS,
    H_ERROR_MESSAGE,
    H_REPLICA,
    H_SAMPLE_IDS,
    H_SCHEMA,
    H_SIZE,
    H_STAGE,
    H_TOPIC,
    H_VERSION,
    encode_headers,
)
from expstream.kafka.topics import dlq_topic
from expstream.models.blobs import blob_ref
from expstream.models.media import (
    DEFAULT_MEDIA_MAX_BYTES,
    DEFAULT_MEDIA_MAX_MB,
    MediaPolicy,
    RefusedItem,
    RefusedMediaError,
    read_image,
    read_video,
    store_video,
    video_manifest,
)
from schemas import PromptBatch, encode
from schemas.codec import peek_header

log = logging.getLogger("expstream.prompts")
#: The ``stage`` header of the dead letters the feeder writes (a prompt whose media it refused).
FEEDER = "feeder"


@dataclass
class PromptRow:
    prompt_id: str
    prompt: str
    label: str = ""
    reference: str = ""
    # Visual inputs (expstream/models/media.py): image file bytes / video frame bytes as read (or PIL images
    # from a Python caller), until store_media() replaces them with blob references (str) for the wire.
    images: list[Any] = field(default_factory=list)
    videos: list[list[Any] | str] = field(default_factory=list)
    # Where the row was read, e.g. "prompts.jsonl:3" (messages); "" for a row built in Python.
    source: str = ""
    # Why the feeder refuses the row's media ("" when it does not): its images/videos then hold the
    # references their bytes would have had, nothing is stored, and the feeder dead-letters the row.
    refused: str = ""
    # read_prompts checked its media (signature, size, decode): store_media does not decode them again.
    media_checked: bool = False


def _media(path: str | Path, lineno: int, obj: dict, key: str, policy: MediaPolicy) -> list:
    """``images`` / ``videos`` of one line, read and checked (a refused item as its RefusedItem)."""
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f'{path}:{lineno}: "{key}" is {_shown(value)}; it must be a list',
                          field="--prompts", fix=f'write e.g. "{key}": ["a.png"]')
    read = read_image if key == "images" else read_video
    return [read(item, f'{path}:{lineno}: {key}[{i}]', policy) for i, item in enumerate(value)]


def _refuse_if_any(row: PromptRow) -> None:
    """When an item of ``row`` was refused: ``row.refused`` says why (every refused item) and its
    media become the references their bytes would have had; none of them is stored."""
    items = [*row.images, *row.videos]
    reasons = [x.reason for x in items if isinstance(x, RefusedItem)]
    if not reasons:
        return
    row.refused = "; ".join(reasons)
    row.images = [_ref_of(x) for x in row.images]
    row.videos = [_ref_of(x, video=True) for x in row.videos]
    log.warning("prompt %s%s: refused, nothing of it stored; the feeder dead-letters it: %s", row.prompt_id,
                f" ({row.source})" if row.source else "", row.refused)


def _ref_of(item: Any, video: bool = False) -> str:
    if isinstance(item, RefusedItem):
        return item.ref
    if isinstance(item, str):
        return item  # a blob reference already
    if video:
        return blob_ref(video_manifest([blob_ref(f) for f in item]))
    return blob_ref(item)


def _check_row(row: PromptRow, max_bytes: int) -> None:
    """Check the media a Python caller put in ``row`` (bytes, PIL images; a str is a reference)."""
    policy = MediaPolicy(max_bytes=max_bytes)  # no root: a Python row names no path
    where = row.source or f"prompt {row.prompt_id}"
    row.images = [x if isinstance(x, str) else read_image(x, f"{where}: images[{i}]", policy)
                  for i, x in enumerate(row.images)]
    row.videos = [x if isinstance(x, str) else read_video(x, f"{where}: videos[{i}]", policy)
                  for i, x in enumerate(row.videos)]
    _refuse_if_any(row)
    row.media_checked = True


def store_media(rows: list[PromptRow], store: object, max_bytes: int = DEFAULT_MEDIA_MAX_BYTES) -> int:
    """Put every image and video of ``rows`` into the blob store, in place; returns the blobs referenced.

    Nothing of a refused row is stored (``row.refused``); media a Python caller put in a row are
    checked first (signature, size, decode) and refuse their row the same way.
    """
    count = 0
    for row in rows:
        if not row.refused and not row.media_checked:
            _check_row(row, max_bytes)
        if row.refused:
            continue
        row.images = [x if isinstance(x, str) else store.put(x)  # type: ignore[attr-defined]
                      for x in row.images]
        row.videos = [x if isinstance(x, str) else store_video(store, x)  # type: ignore[arg-type]
                      for x in row.videos]
        count += len(row.images) + len(row.videos)
    return count


def has_media(rows: list[PromptRow]) -> bool:
    return any(r.images or r.videos for r in rows)


class _JsonNumber(str):
    """A JSON number kept as the text written in the file (``1.50`` stays ``"1.50"``)."""


def _parse_line(path: str | Path, lineno: int, raw: bytes) -> dict | None:
    """One line as a JSON object (None for a blank line); numbers arrive as :class:`_JsonNumber`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}:{lineno}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})",
                          field="--prompts", fix="save the prompt file as UTF-8") from exc
    if lineno == 1:
        line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark, as some editors write
    if not line.strip():
        return None
    try:
        obj = json.loads(line, parse_int=_JsonNumber, parse_float=_JsonNumber)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{lineno}: not JSON ({exc}); write one JSON object per line") from exc
    if not isinstance(obj, dict) or type(obj.get("prompt")) is not str:
        raise ConfigError(f'{path}:{lineno}: needs a string "prompt" field, e.g. {{"prompt": "2+2?"}}')
    return obj


def _shown(value: object) -> str:
    """``value`` as the JSON it was written as (numbers back from :class:`_JsonNumber`), for messages."""
    def plain(v: object) -> object:
        if isinstance(v, _JsonNumber):
            return json.loads(v)
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return json.dumps(plain(value))[:60]


def _text_field(path: str | Path, lineno: int, obj: dict, key: str) -> str:
    """``label``/``reference``: a string as is, a number as the text written, absent or null -> ""."""
    value = obj.get(key)
    if value is None:
        return ""
    if isinstance(value, str):  # a string, or a number kept as its text (_JsonNumber)
        return str(value)
    kind = "" if isinstance(value, bool) else f" (a {'list' if isinstance(value, list) else 'JSON object'})"
    raise ConfigError(f'{path}:{lineno}: "{key}" is {_shown(value)}{kind}; it must be a string or a number',
                      field="--prompts", fix=f'write it as text, e.g. "{key}": "4"')


def _prompt_id(path: str | Path, lineno: int, obj: dict) -> str:
    """``id``: a string as is, a number as the text written, absent -> the line number; null,
    empty or anything else is refused (a silent "None" would collide across lines)."""
    if "id" not in obj:
        return str(lineno)
    value = obj["id"]
    if isinstance(value, str) and value != "":
        return str(value)
    shown = _shown(value)
    raise ConfigError(f'{path}:{lineno}: "id" is {shown}; it must be a non-empty string or a number',
                      field="--prompts", fix='give every line its own id, or leave "id" out to use the line number')


def read_prompts(path: str | Path, *, media_root: str | os.PathLike[str] | None = None,
                 media_max_mb: float = DEFAULT_MEDIA_MAX_MB) -> list[PromptRow]:
    """A JSON-lines file (UTF-8): ``{"prompt": ..., "label": ..., "reference": ..., "id": ...}`` per line.

    ``prompt`` must be a string. ``id`` defaults to the line number; a number is taken as the text
    written (``7`` -> ``"7"``); ``null`` or ``""`` is refused. ``label``/``reference`` default to
    "" (also when null); a number is taken as the text written (``0`` -> ``"0"``, ``1.50`` ->
    ``"1.50"``); a list, an object or true/false is refused. Every refusal, and a line that is
    not UTF-8 or not a JSON object, is a ConfigError naming the file and the line.

    ``images``/``videos`` (expstream/models/media.py) are read under ``media_root`` (default: the prompt
    file's directory) and checked, items of at most ``media_max_mb`` MiB: a path that leaves the
    root or is not a regular file is a ConfigError; bytes that are not an image or video refuse
    their row alone (``PromptRow.refused``: the feeder dead-letters it, nothing of it is stored).
    A file whose every row is refused is a ConfigError.
    """
    policy = MediaPolicy.for_prompt_file(path, media_root, media_max_mb)
    rows: list[PromptRow] = []
    seen: set[str] = set()
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            obj = _parse_line(path, lineno, raw)
            if obj is None:
                continue
            pid = _prompt_id(path, lineno, obj)
            if pid in seen:
                raise ConfigError(f"{path}:{lineno}: duplicate id {pid!r}; prompt ids must be unique in a run")
            seen.add(pid)
            row = PromptRow(pid, str(obj["prompt"]), _text_field(path, lineno, obj, "label"),
                            _text_field(path, lineno, obj, "reference"), _media(path, lineno, obj, "images", policy),
                            _media(path, lineno, obj, "videos", policy), source=f"{path}:{lineno}")
            _refuse_if_any(row)
            row.media_checked = True
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no prompts; add JSON lines with a \"prompt\" field")
    if all(r.refused for r in rows):
        raise ConfigError(f"{path}: every prompt's images or videos were refused, e.g. {rows[0].refused}",
                          field="--prompts", fix="give image or video files (PNG, JPEG, GIF, BMP, WebP, TIFF; MP4, "
                          "MOV, AVI, MKV, WebM) of at most run.media_max_mb MiB")
    return rows


def prompt_batches(rows: list[PromptRow], batch_size: int, first_index: int = 0,
                   id_suffix: str = "") -> Iterator[PromptBatch]:
    """Records of ``batch_size`` prompts, ids ``p{first_index:06d}{id_suffix}`` onwards (stable across
    runs; ``expstream feed`` puts the epoch in the suffix). A refused row is a ValueError: it is
    dead-lettered (:func:`refused_letters`), never fed."""
    refused = [r.prompt_id for r in rows if r.refused]
    if refused:
        raise ValueError(f"PromptRow {refused[0]!r} was refused ({len(refused)} rows): feed the others and "
                         "dead-letter these (feed_prompts, dead_letter_refused)")
    for k, start in enumerate(range(0, len(rows), batch_size), start=first_index):
        chunk = rows[start: start + batch_size]
        yield PromptBatch(batch_id=f"p{k:06d}{id_suffix}", prompt_id=[r.prompt_id for r in chunk],
                          prompt=[r.prompt for r in chunk], label=[r.label for r in chunk],
                          reference=[r.reference for r in chunk], **media_fields(chunk))


def media_fields(chunk: list[PromptRow]) -> dict[str, list]:
    """``images``/``videos`` of a PromptBatch: [] when no prompt of the chunk has any (a text-only record)."""
    out: dict[str, list] = {}
    for name in ("images", "videos"):
        lists = [getattr(r, name) for r in chunk]
        if any(lists):
            if any(not isinstance(x, str) for v in lists for x in v):
                raise ValueError(f"PromptRow.{name}: bytes not yet in the blob store; call store_media(rows, store)")
            out[name] = lists
    return out


def send_prompt_batches(producer: object, cfg: KafkaConfig, topic: str, batches: list[PromptBatch],
                        policy_version: int = 0) -> int:
    """Send ``batches`` to ``topic`` (key = batch id, provenance headers of the feeder) and confirm
    every send; returns the count."""
    from expstream.kafka.provenance import provenance_headers

    items = [(topic, encode(b), b.batch_id.encode(), provenance_headers("feeder", policy_version)) for b in batches]
    send_all_and_confirm(producer, items, cfg.produce_timeout_s)
    return len(items)


def refused_letters(rows: list[PromptRow], topic: str) -> list[tuple[str, bytes, bytes, list]]:
    """The dead letters of the refused rows: ``(dlq topic, value, key, headers)`` each.

    A letter holds the row as a one-prompt PromptBatch (its images/videos the references the refused
    bytes would have had, none stored: a redrive fails again on the missing blob) and the runner's
    headers (expstream/kafka/letters.py) with ``stage`` = ``feeder`` and ``original_topic`` = ``topic``;
    no partition or offset, as the record was never on ``topic``. The run's collector counts the
    group lost, with the reason, as it does for a stage's dead letter.
    """
    from expstream.kafka.provenance import provenance_headers

    out = []
    for row in rows:
        if not row.refused:
            continue
        batch = PromptBatch(batch_id=f"refused/{row.prompt_id}", prompt_id=[row.prompt_id], prompt=[row.prompt],
                            label=[row.label], reference=[row.reference], **media_fields([row]))
        value = encode(batch)
        schema, version, batch_id = peek_header(value)
        headers = provenance_headers(FEEDER, 0) + encode_headers(**{
            H_STAGE: FEEDER, H_REPLICA: os.getpid(), H_ERROR_CLASS: RefusedMediaError.__name__,
            H_ERROR_MESSAGE: row.refused, H_TOPIC: topic, H_SCHEMA: schema, H_VERSION: version,
            H_BATCH_ID: batch_id, H_SIZE: len(value), H_SAMPLE_IDS: row.prompt_id})
        out.append((dlq_topic(topic), value, batch.batch_id.encode(), headers))
    return out


def _send_refused(producer: object, cfg: KafkaConfig, topic: str, rows: list[PromptRow]) -> list[PromptRow]:
    """Send the refused rows' dead letters (confirmed); returns the rows that are not refused."""
    letters = refused_letters(rows, topic)
    if letters:
        send_all_and_confirm(producer, letters, cfg.produce_timeout_s)
        log.warning("feeder: %d prompts dead-lettered to %s (images or videos refused), e.g. %s", len(letters),
                    dlq_topic(topic), next(r.refused for r in rows if r.refused))
    return [r for r in rows if not r.refused]


def dead_letter_refused(bootstrap: str, cfg: KafkaConfig, topic: str, rows: list[PromptRow]) -> list[PromptRow]:
    """The refused rows' dead letters sent once (a continuous run's epochs feed the others); returns
    the rows that are not refused."""
    if not any(r.refused for r in rows):
        return rows
    producer = make_producer(bootstrap, cfg)
    try:
        return _send_refused(producer, cfg, topic, rows)
    finally:
        producer.close(timeout=10)


def feed_prompts(bootstrap: str, cfg: KafkaConfig, topic: str, rows: list[PromptRow], batch_size: int,
                 first_index: int = 0, id_suffix: str = "") -> int:
    """Publish the prompts and confirm every send; returns the number of records. Refused rows
    (``PromptRow.refused``) go to the dead-letter twin of ``topic`` instead, one letter each."""
    producer = make_producer(bootstrap, cfg, spread=True)
    try:
        rows = _send_refused(producer, cfg, topic, rows)
        batches = list(prompt_batches(rows, batch_size, first_index, id_suffix))
        return send_prompt_batches(producer, cfg, topic, batches)
    finally:
        producer.close(timeout=10)


#: What joins a prompt id and its epoch: ``arith-1@e0``, ``arith-1@e1``, ...
EPOCH_SEPARATOR = "@e"


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order epoch ``epoch`` visits ``n`` prompts in: a permutation seeded by ``(seed, epoch)``
    (numpy's SeedSequence, so the same on every machine and numpy version with PCG64)."""
    if n < 1:
        raise ValueError(f"epoch_order: n must be >= 1, got {n}")
    return [int(i) for i in np.random.default_rng([int(seed), int(epoch)]).permutation(n)]


def epoch_prompt_id(prompt_id: str, epoch: int) -> str:
    """The id a prompt gets in ``epoch``: unique per epoch, the file's id still readable."""
    return f"{prompt_id}{EPOCH_SEPARATOR}{epoch}"


class EpochFeeder:
    """Endless PromptBatch records over ``rows``, epoch after epoch, each epoch reshuffled.

    ``next_batch()`` returns the next record (ids ``p{k:06d}`` counting on from ``first_index``)
    with exactly ``batch_size`` prompts; :attr:`epoch` is the epoch the next prompt comes from and
    :attr:`prompts_fed` how many prompts the records handed out so far hold. The sequence is a
    pure function of ``(rows, batch_size, seed)``: the same arguments give the same records.
    """

    def __init__(self, rows: list[PromptRow], batch_size: int, seed: int, first_index: int = 0) -> None:
        if not rows:
            raise ValueError("EpochFeeder needs at least one prompt row")
        if batch_size < 1:
            raise ValueError(f"EpochFeeder: batch_size must be >= 1, got {batch_size}")
        if any(r.refused for r in rows):
            raise ValueError("EpochFeeder: refused rows are dead-lettered once (dead_letter_refused), not fed")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.records_fed = 0
        self.prompts_fed = 0
        self._next_index = first_index
        self.epoch = 0
        self._order = epoch_order(len(rows), seed, 0)
        self._pos = 0  # next position in self._order

    def _next_row(self) -> PromptRow:
        if self._pos == len(self._order):
            self.epoch += 1
            self._order, self._pos = epoch_order(len(self.rows), self.seed, self.epoch), 0
        row = self.rows[self._order[self._pos]]
        self._pos += 1
        return PromptRow(epoch_prompt_id(row.prompt_id, self.epoch), row.prompt, row.label, row.reference,
                         row.images, row.videos)

    def next_batch(self) -> PromptBatch:
        chunk = [self._next_row() for _ in range(self.batch_size)]
        batch = PromptBatch(batch_id=f"p{self._next_index:06d}", prompt_id=[r.prompt_id for r in chunk],
                            prompt=[r.prompt for r in chunk], label=[r.label for r in chunk],
                            reference=[r.reference for r in chunk], **media_fields(chunk))
        self._next_index += 1
        self.records_fed += 1
        self.prompts_fed += len(chunk)
        return batch

    def batches(self, count: int) -> list[PromptBatch]:
        """The next ``count`` records."""
        return [self.next_batch() for _ in range(count)]

    @property
    def epochs_started(self) -> int:
        """Epochs begun so far (1 while the first is being fed)."""
        return self.epoch + 1 if self.prompts_fed else 0
