"""Prompt files -> PromptBatch records on the input topic (what ``expstream run`` feeds).

Record ids ``p{k:06d}`` are stable across runs (the idempotence keys downstream), and every send
is confirmed before the run counts the prompts as fed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from expstream.bus import KafkaConfig, make_producer, send_all_and_confirm
from expstream.errors import ConfigError
from schemas import PromptBatch, encode


@dataclass
class PromptRow:
    prompt_id: str
    prompt: str
    label: str = ""
    reference: str = ""


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
                                  _text_field(path, lineno, obj, "reference")))
    if not rows:
        raise ConfigError(f"{path}: no prompts; add JSON lines with a \"prompt\" field")
    return rows


def prompt_batches(rows: list[PromptRow], batch_size: int, first_index: int = 0) -> Iterator[PromptBatch]:
    """Records of ``batch_size`` prompts, ids ``p{first_index:06d}`` onwards (stable across runs)."""
    for k, start in enumerate(range(0, len(rows), batch_size), start=first_index):
        chunk = rows[start: start + batch_size]
        yield PromptBatch(batch_id=f"p{k:06d}", prompt_id=[r.prompt_id for r in chunk],
                          prompt=[r.prompt for r in chunk], label=[r.label for r in chunk],
                          reference=[r.reference for r in chunk])


def feed_prompts(bootstrap: str, cfg: KafkaConfig, topic: str, rows: list[PromptRow], batch_size: int,
                 first_index: int = 0) -> int:
    """Publish the prompts and confirm every send; returns the number of records."""
    producer = make_producer(bootstrap, cfg)
    try:
        items = [(topic, encode(b), b.batch_id.encode(), None)
                 for b in prompt_batches(rows, batch_size, first_index)]
        send_all_and_confirm(producer, items, cfg.produce_timeout_s)
        return len(items)
    finally:
        producer.close(timeout=10)
