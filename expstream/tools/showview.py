"""What ``expstream show`` prints: the JSON view and the text view of one sample and of one record.

:func:`sample_dict` is a sample's ids, versions, where it was recorded, its texts, the per-token table
(:data:`TOKEN_COLUMNS`) and its rewards; :func:`record_dict` a record shown whole (a PromptBatch, a dead
letter, bytes that are no expstream message); :func:`format_sample` and :func:`format_record` print
them. Apart from the selection (``show.py``) so that the documented views (docs/replay.md, "show")
are read in one place; header values are printed through :func:`expstream.tools.terminal.printable`.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np

from expstream.kafka.letters import H_TOPIC, decode_headers, redrive_attempt
from expstream.tools.samples import Located, Sample, split_prompts, split_samples
from expstream.tools.terminal import printable

__all__ = [
    "HEX_BYTES",
    "TOKEN_COLUMNS",
    "format_record",
    "format_sample",
    "record_dict",
    "sample_dict",
]

#: Per-token columns of the table: (field of SampleBatch, column header), in pipeline order.
TOKEN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("token_versions", "version"),  # only in records of in-flight updates (schema v5)
    ("rollout_log_probs", "rollout_lp"),
    ("action_log_probs", "logprob"),
    ("base_action_log_probs", "ref_lp"),
    ("action_entropy", "entropy"),
    ("values", "value"),
    ("kl", "kl"),
    ("token_rewards", "tok_reward"),
    ("advantages", "advantage"),
    ("returns", "return"),
)
#: Bytes of an undecodable value shown in hex by ``show``.
HEX_BYTES = 64
# Why 40: a token's text is usually a few characters; a longer one (a run of spaces, a byte
# fallback sequence) is cut so the table stays aligned.
TOKEN_TEXT_CHARS = 40


def _num(x: Any) -> Any:
    """A JSON-able number (numpy scalars to Python; non-finite floats as their text)."""
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _iso(ms: int) -> str:
    if ms < 0:
        return "unknown"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def sample_dict(s: Sample, tokenizer: Any = None) -> dict[str, Any]:
    """The JSON view of one sample (also what the text view prints); documented in docs/replay.md."""
    f, loc = s.fields, s.located
    out: dict[str, Any] = {
        "sample_id": s.sample_id, "batch_id": f["batch_id"], "row": s.row, "prompt_id": f["prompt_id"],
        "group_id": f["group_id"], "sample_index": f["sample_index"],
        "policy_version": f["policy_version"], "rollout_version": f.get("rollout_version"),
        "logprob_version": f.get("logprob_version"), "kl_coef": f.get("kl_coef"),
        "n_samples_per_prompt": f["n_samples_per_prompt"], "layout": f["layout"],
        "where": loc.where,
    }
    if loc.frame is not None:
        fr = loc.frame
        out.update(topic=fr.topic, partition=fr.partition, offset=fr.offset, timestamp=fr.timestamp,
                   time=_iso(fr.timestamp), key=None if fr.key is None else fr.key.decode("utf-8", "replace"),
                   headers=decode_headers(fr.headers))
    out.update(prompt=f["prompt"], response=f["response"], label=f["label"], reference=f["reference"])
    if "prompt_ids" in f:
        out["prompt_ids"] = [int(x) for x in f["prompt_ids"]]
    # the per-token table: action-level from shard-preprocess on, the raw response before it
    if "action_ids" in f:
        ids = f["action_ids"]
        columns = {"mask": f["action_mask"]} if "action_mask" in f else {}
        names = [(n, h) for n, h in TOKEN_COLUMNS if n in f]
    else:
        ids = f.get("response_ids", np.zeros(0, np.int32))
        columns = {}
        names = [(n, h) for n, h in TOKEN_COLUMNS if n in ("token_versions", "rollout_log_probs") and n in f]
    columns.update({h: f[n] for n, h in names})
    tokens = {"level": "action" if "action_ids" in f else "response", "token_id": [int(x) for x in ids]}
    if tokenizer is not None:
        tokens["text"] = _token_texts(tokenizer, tokens["token_id"])
    for h, col in columns.items():
        tokens[h] = [_num(x) for x in col]
    out["tokens"] = tokens
    out["rewards"] = {
        "reward": None if "rewards" not in f else _num(f["rewards"]),
        "reward_metrics": {k.split(".", 1)[1]: _num(v) for k, v in f.items() if k.startswith("reward_metrics.")},
        "processed_reward": None if "processed_rewards" not in f else _num(f["processed_rewards"]),
        "info": {k.split(".", 1)[1]: _num(v) for k, v in f.items() if k.startswith("info.")},
    }
    return out


def _cell(x: Any) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def format_sample(d: dict[str, Any], others: list[str]) -> str:
    """The text view of :func:`sample_dict`'s output."""
    lines = [f"sample {d['sample_id']}  batch {d['batch_id']} (row {d['row']})  prompt_id {d['prompt_id']}  "
             f"n={d['n_samples_per_prompt']}  layout={d['layout'] or '-'}"]
    versions = [f"policy_version={d['policy_version']}"] + [f"{k}={d[k]}" for k in
                                                           ("rollout_version", "logprob_version", "kl_coef")
                                                           if d[k] is not None]
    lines.append("versions: " + " ".join(versions))
    if "topic" in d:
        lines.append(f"recorded at {d['where']}  time {d['time']} ({d['timestamp']} ms)  "
                     f"key={printable(d['key'] or '-')}")
        lines += _header_lines(d["headers"])
    else:
        lines.append(f"read from {d['where']} (no recording: no offset, time, key or headers)")
    if others:
        lines.append(f"also recorded at: {', '.join(others)} (the first occurrence is shown)")
    lines.append(f"prompt:   {d['prompt']!r}")
    lines.append(f"response: {d['response']!r}")
    if d["label"] or d["reference"]:
        lines.append(f"label: {d['label']!r}  reference: {d['reference']!r}")
    tok = d["tokens"]
    heads = ["pos", "token", *(["text"] if "text" in tok else []),
             *[k for k in tok if k not in ("level", "token_id", "text")]]
    lines.append(f"tokens ({tok['level']}-level, {len(tok['token_id'])}):")
    rows = []
    for i, tid in enumerate(tok["token_id"]):
        row = [str(i), str(tid)]
        if "text" in tok:
            row.append(repr(tok["text"][i])[:TOKEN_TEXT_CHARS])  # quoted: a leading space stays visible
        row += [_cell(tok[h][i]) for h in heads[len(row):]]
        rows.append(row)
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(heads)]
    lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    rw = d["rewards"]
    lines.append("rewards:")
    lines.append(f"  raw reward (reward stage):         {_cell(rw['reward']) if rw['reward'] is not None else '-'}")
    for k, v in rw["reward_metrics"].items():
        lines.append(f"    source {k}: {_cell(v)}")
    lines.append(f"  processed reward (postprocess):    "
                 f"{_cell(rw['processed_reward']) if rw['processed_reward'] is not None else '-'}")
    for k, v in rw["info"].items():
        lines.append(f"  info.{k}: {_cell(v)}")
    return "\n".join(lines)


def _value_view(value: bytes | None, batch: Any, error: str | None) -> dict[str, Any]:
    """What a record's value is, for a reader: its size, the schema it decodes as, or why it does not
    (then msgpack when it is msgpack, and the hex of its first HEX_BYTES bytes)."""
    if value is None:
        return {"bytes": None, "decoded": False, "error": error}
    out: dict[str, Any] = {"bytes": len(value), "decoded": batch is not None}
    if batch is not None:
        out.update(schema=batch.SCHEMA, batch_id=batch.batch_id)
        return out
    out["error"] = error
    try:
        import msgpack

        out["msgpack"] = _short_repr(msgpack.unpackb(value, raw=False))
    except Exception:  # noqa: BLE001 - not msgpack either: hex only
        out["msgpack"] = None
    out["hex"] = value[:HEX_BYTES].hex(" ")
    return out


def _short_repr(obj: Any, n: int = 2000) -> str:
    r = repr(obj)
    return r if len(r) <= n else r[: n - 3] + "..."


def record_dict(loc: Located, tokenizer: Any = None, letters: bool = False) -> dict[str, Any]:
    """The JSON view of one record shown whole (a PromptBatch, a dead letter, any other bytes);
    documented in docs/replay.md ("show")."""
    fr = loc.frame
    out: dict[str, Any] = {"where": loc.where, "kind": "letter" if letters else (
        "other" if loc.batch is None else ("prompts" if not hasattr(loc.batch, "sample_index") else "samples"))}
    if fr is not None:
        out.update(topic=fr.topic, partition=fr.partition, offset=fr.offset, timestamp=fr.timestamp,
                   time=_iso(fr.timestamp), key=None if fr.key is None else fr.key.decode("utf-8", "replace"),
                   headers=decode_headers(fr.headers))
    out["value"] = _value_view(fr.value if fr is not None else None, loc.batch, loc.error)
    if loc.batch is not None and not hasattr(loc.batch, "sample_index"):
        out["prompts"] = [{"prompt_id": p.sample_id, **{k: v for k, v in p.fields.items() if k != "batch_id"}}
                          for p in split_prompts(loc.batch, loc)]
    elif loc.batch is not None:
        out["samples"] = [sample_dict(s, tokenizer) for s in split_samples(loc.batch, loc)]
    return out


def _header_lines(headers: dict[str, str]) -> list[str]:
    return [f"  header {printable(k)}={printable(' '.join(v.split()))[:200]}" for k, v in headers.items()]


def format_record(d: dict[str, Any]) -> str:
    """The text view of :func:`record_dict`'s output."""
    v = d["value"]
    what = {"letter": "dead letter", "prompts": "PromptBatch record", "samples": "SampleBatch record",
            "other": "record"}[d["kind"]]
    lines = [f"{what} {d['where']}" + (f"  time {d['time']} ({d['timestamp']} ms)  key="
                                       f"{printable(d['key'] or '-')}" if "topic" in d else "")]
    if d["kind"] == "letter":
        h = d.get("headers", {})
        lines.append(f"  dead-lettered by stage {printable(h.get('stage', '?'))}: "
                     f"{printable(h.get('error_class', '?'))}: "
                     f"{printable(h.get('error_message', '').splitlines()[0] if h.get('error_message') else '')[:300]}")
        lines.append(f"  from {printable(h.get(H_TOPIC, '?'))}[{printable(h.get('original_partition', '?'))}]"
                     f"@{printable(h.get('original_offset', '?'))}  redrive_attempt={redrive_attempt(h)}")
    lines += _header_lines(d.get("headers", {}))
    if v["bytes"] is None:
        lines.append(f"value: none ({v.get('error') or 'tombstone'})")
    elif v["decoded"]:
        lines.append(f"value: {v['bytes']} bytes, {v['schema']} batch {printable(v['batch_id'])}")
    else:
        lines.append(f"value: {v['bytes']} bytes, not an expstream message ({printable(v.get('error') or '')})")
        if v.get("msgpack") is not None:
            lines.append(f"  msgpack: {printable(v['msgpack'])}")
        lines.append(f"  first {min(v['bytes'], HEX_BYTES)} bytes: {v['hex']}")
    for p in d.get("prompts", []):
        extra = "".join(f"  {k}: {p[k]!r}" for k in ("images", "videos") if k in p)
        lines.append(f"prompt {p['prompt_id']!r}: {p['prompt']!r}  label: {p['label']!r}  "
                     f"reference: {p['reference']!r}{extra}")
    for sd in d.get("samples", []):  # the record's headers are printed above, once
        lines.append("")
        lines.append(format_sample({**sd, "headers": {}}, []))
    return "\n".join(lines)
