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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from expstream.bus import KafkaConfig, make_producer, send_all_and_confirm
from expstream.errors import ConfigError
from schemas import PromptBatch, encode


@dataclass
class PromptRow:
    prompt_id: str
    prompt: str
    label: str = ""
    reference: str = ""
    # Visual inputs (expstream/vision.py): image file bytes / video frame bytes as read (or PIL images
    # from a Python caller), until store_media() replaces them with blob references (str) for the wire.
    images: list[Any] = field(default_factory=list)
    videos: list[list[Any] | str] = field(default_factory=list)


def _media(path: str | Path, lineno: int, obj: dict, key: str) -> list:
    """``images`` / ``videos`` of one line, read (existence checked; decodability is the stage's)."""
    from expstream.vision import item_bytes, video_frames

    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f'{path}:{lineno}: "{key}" is {_shown(value)}; it must be a list',
                          field="--prompts", fix=f'write e.g. "{key}": ["a.png"]')
    base = Path(path).resolve().parent
    read = item_bytes if key == "images" else video_frames
    return [read(item, f'{path}:{lineno}: {key}[{i}]', base) for i, item in enumerate(value)]


def store_media(rows: list[PromptRow], store: object) -> int:
    """Put every image and video of ``rows`` into the blob store, in place; returns the blobs referenced."""
    from expstream.vision import item_bytes, store_video

    count = 0
    for row in rows:
        # bytes as read from a prompt file, or what a Python caller put in a PromptRow (a PIL image is
        # stored as PNG); a str is a blob reference already
        row.images = [x if isinstance(x, str) else store.put(  # type: ignore[attr-defined]
            item_bytes(x, f"prompt {row.prompt_id}: images[{i}]")) for i, x in enumerate(row.images)]
        row.videos = [x if isinstance(x, str) else store_video(store, [  # type: ignore[arg-type]
            item_bytes(f, f"prompt {row.prompt_id}: videos[{i}][{j}]") for j, f in enumerate(x)])
            for i, x in enumerate(row.videos)]
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


def read_prompts(path: str | Path) -> list[PromptRow]:
    """A JSON-lines file (UTF-8): ``{"prompt": ..., "label": ..., "reference": ..., "id": ...}`` per line.

    ``prompt`` must be a string. ``id`` defaults to the line number; a number is taken as the text
    written (``7`` -> ``"7"``); ``null`` or ``""`` is refused. ``label``/``reference`` default to
    "" (also when null); a number is taken as the text written (``0`` -> ``"0"``, ``1.50`` ->
    ``"1.50"``); a list, an object or true/false is refused. Every refusal, and a line that is
    not UTF-8 or not a JSON object, is a ConfigError naming the file and the line.
    """
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
            rows.append(PromptRow(pid, str(obj["prompt"]), _text_field(path, lineno, obj, "label"),
                                  _text_field(path, lineno, obj, "reference"), _media(path, lineno, obj, "images"),
                                  _media(path, lineno, obj, "videos")))
    if not rows:
        raise ConfigError(f"{path}: no prompts; add JSON lines with a \"prompt\" field")
    return rows


def prompt_batches(rows: list[PromptRow], batch_size: int, first_index: int = 0) -> Iterator[PromptBatch]:
    """Records of ``batch_size`` prompts, ids ``p{first_index:06d}`` onwards (stable across runs)."""
    for k, start in enumerate(range(0, len(rows), batch_size), start=first_index):
        chunk = rows[start: start + batch_size]
        yield PromptBatch(batch_id=f"p{k:06d}", prompt_id=[r.prompt_id for r in chunk],
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
    from expstream.provenance import provenance_headers

    items = [(topic, encode(b), b.batch_id.encode(), provenance_headers("feeder", policy_version)) for b in batches]
    send_all_and_confirm(producer, items, cfg.produce_timeout_s)
    return len(items)


def feed_prompts(bootstrap: str, cfg: KafkaConfig, topic: str, rows: list[PromptRow], batch_size: int,
                 first_index: int = 0) -> int:
    """Publish the prompts and confirm every send; returns the number of records."""
    producer = make_producer(bootstrap, cfg)
    try:
        return send_prompt_batches(producer, cfg, topic, list(prompt_batches(rows, batch_size, first_index)))
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
