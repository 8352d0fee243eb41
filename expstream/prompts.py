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


def read_prompts(path: str | Path) -> list[PromptRow]:
    """A JSON-lines file: ``{"prompt": ..., "label": ..., "reference": ..., "id": ...}`` per line.

    ``id`` defaults to the line number; ``label``/``reference`` default to "". A line that is not a
    JSON object with a string ``prompt`` is a ConfigError naming the line.
    """
    rows: list[PromptRow] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON ({exc}); write one JSON object per line") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f'{path}:{lineno}: needs a string "prompt" field, e.g. {{"prompt": "2+2?"}}')
            pid = str(obj.get("id", lineno))
            if pid in seen:
                raise ConfigError(f"{path}:{lineno}: duplicate id {pid!r}; prompt ids must be unique in a run")
            seen.add(pid)
            rows.append(PromptRow(pid, obj["prompt"], str(obj.get("label", "") or ""),
                                  str(obj.get("reference", "") or "")))
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
