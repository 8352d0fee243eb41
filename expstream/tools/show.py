"""``expstream show RUN_DIR``: one recorded sample, decoded for a human.

Reads a run directory's recording (expstream/tools/recording.py) -- or, for topic ``experiences`` when
nothing was recorded, its ``experiences.msgpack`` -- and prints, for one sample:

1. ids and versions: sample id, batch id, prompt/group id, ``policy_version``,
   ``rollout_version``, ``logprob_version``, ``kl_coef``;
2. where it was recorded: ``topic[partition]@offset``, the broker timestamp (UTC), key, headers;
3. the prompt and response text;
4. an aligned per-token table: position, token id, token text (when the run's tokenizer loads),
   action mask, then every per-token column the record has (rollout log-prob, log-prob, ref
   log-prob, entropy, value, KL, token reward, advantage, return); before shard-preprocess (no
   ``action_ids`` yet) the rows are the raw ``response_ids``;
5. rewards before and after each transform: ``rewards`` (raw), ``reward_metrics`` (per source),
   ``processed_rewards`` (after overlong penalty, running norm, clip) and ``info``.

Which sample: ``--sample group#i``, or every sample of one record chosen by ``--batch ID`` or
``--offset p:o`` (with ``--sample`` too: that sample of that record). The topic's partitions are
searched in recording order; the first occurrence is shown and the others are named (Kafka
delivers at least once, and a rewound stage writes a sample again). A sample the topic does not
hold is an error that names the recorded topics which do.

Any other recorded record is shown whole (``--batch`` / ``--offset``; on a dead-letter topic
``--sample`` too): a PromptBatch prompt by prompt; a dead letter (a ``.dlq`` topic) as its headers
(the error, where it came from) and then its original value, decoded when it decodes (a
SampleBatch's rows as samples, as above), else the decode error and a hex dump of its first
:data:`HEX_BYTES` bytes; a record that is no expstream message (the ``policy`` topic) as msgpack
when it is, else hex. Header values are printed with control characters escaped
(expstream/tools/terminal.py): a header is data anyone who can write to the topic chose.

A damaged recording does not stop ``show``: a torn tail or a corrupt frame is reported on stderr
(file and byte position) and what comes before it is shown.

This module also holds the reading side shared with ``expstream diff`` (:func:`read_samples`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from expstream.config.cli_args import Command
from expstream.errors import EXIT_OK, ConfigError
from expstream.kafka.letters import (
    H_BATCH_ID,
    H_REPLICA,
    H_SAMPLE_IDS,
    H_TOPIC,
    decode_headers,
    redrive_attempt,
)
from expstream.kafka.provenance import H_PRODUCED_AT
from expstream.kafka.topics import DLQ_SUFFIX
from expstream.tools.recording import Damage, RecordFrame, RecordingError, iter_topic, recorded_topics
from expstream.tools.terminal import printable

__all__ = [
    "EXPERIENCES_FILE",
    "Located",
    "Sample",
    "TOKEN_COLUMNS",
    "LETTER_POSITION_HEADERS",
    "add_show_arguments",
    "iter_located",
    "letter_entry",
    "load_run_topology",
    "read_samples",
    "refuse_damaged",
    "sample_dict",
    "show",
    "show_command",
    "split_prompts",
    "split_samples",
]

#: The run's finished experiences (outcome.py writes it); read for topic ``experiences`` when the
#: run has no recording of that topic (runs made before recording existed).
EXPERIENCES_FILE = "experiences.msgpack"
EXPERIENCES_TOPIC = "experiences"
#: Per-token columns of the table: (field of SampleBatch, column header), in pipeline order.
TOKEN_COLUMNS: tuple[tuple[str, str], ...] = (
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
#: Sample ids named in the error for a sample that is not there (enough to see the id pattern).
LISTED_IDS = 6
#: Bytes of an undecodable value shown in hex by ``show``.
HEX_BYTES = 64
#: Dead-letter headers that say *where* or *when*, not *what*: which replica, the producing time, the
#: original's partition and offset (they follow scheduling: two runs of one prompt file differ in
#: them). ``diff`` leaves them out of a letter's comparison; ``show`` prints them.
LETTER_POSITION_HEADERS: tuple[str, ...] = (H_REPLICA, H_PRODUCED_AT, "original_partition", "original_offset")
# Why 40: a token's text is usually a few characters; a longer one (a run of spaces, a byte
# fallback sequence) is cut so the table stays aligned.
TOKEN_TEXT_CHARS = 40


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


# ----------------------------------------------------------------------------------------------
# Reading a run directory
# ----------------------------------------------------------------------------------------------


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


def _row(value: Any, r: int) -> Any:
    return value.row(r) if hasattr(value, "row") else value[r]


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


def load_run_topology(run: str | Path) -> Any:
    """The run's recorded configuration (``<run>/topology.yaml``, else ``<run>/run/topology.yaml``), or None."""
    from expstream.config.topology import load_topology

    for path in (Path(run) / "topology.yaml", Path(run) / "run" / "topology.yaml"):
        if path.is_file():
            return load_topology(path)
    return None


# ----------------------------------------------------------------------------------------------
# One sample, for a human
# ----------------------------------------------------------------------------------------------


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
        names = [(n, h) for n, h in TOKEN_COLUMNS if n == "rollout_log_probs" and n in f]
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


def _parse_offset(text: str) -> tuple[int, int]:
    try:
        p, o = text.split(":")
        part, off = int(p), int(o)
        if part < 0 or off < 0:
            raise ValueError
        return part, off
    except ValueError:
        raise ConfigError(f"--offset {text!r} is not PARTITION:OFFSET", field="--offset",
                          fix="write it as partition:offset, e.g. --offset 0:12") from None


def _where_else(run: Path, topic: str, sid: str) -> list[str]:
    """Recorded topics other than ``topic`` that hold sample ``sid``."""
    found = []
    for t in recorded_topics(run):
        if t == topic:
            continue
        for loc in iter_located(run, t, strict=False, on_damage=lambda d: None):  # warned about by the caller's topic
            if loc.batch is not None and hasattr(loc.batch, "sample_ids") and sid in loc.batch.sample_ids():
                found.append(t)
                break
    return found


def _letter_headers(loc: Located) -> dict[str, str]:
    return decode_headers(loc.frame.headers) if loc.frame is not None else {}


def _batch_matches(loc: Located, batch: str, letters: bool) -> bool:
    if loc.batch is not None and getattr(loc.batch, "batch_id", None) == batch:
        return True
    return letters and _letter_headers(loc).get(H_BATCH_ID) == batch


def _holds_sample(loc: Located, sid: str, letters: bool) -> bool:
    if loc.batch is not None and hasattr(loc.batch, "sample_ids") and sid in loc.batch.sample_ids():
        return True
    return letters and sid in (_letter_headers(loc).get(H_SAMPLE_IDS) or "").split(",")


def _kind_of(loc: Located, letters: bool) -> str:
    if letters:
        return "dead letters"
    if loc.batch is None:
        return "records that are not expstream messages"
    return "PromptBatch records" if not hasattr(loc.batch, "sample_index") else "SampleBatch records"


@dataclass
class Found:
    """What :func:`find` chose: SampleBatch rows (``samples``) or whole records shown as records."""

    samples: list[Sample] = field(default_factory=list)
    records: list[Located] = field(default_factory=list)
    others: list[str] = field(default_factory=list)  # where else the chosen sample was recorded


def find(run: Path, topic: str, *, sample: str | None, batch: str | None,
         offset: tuple[int, int] | None, on_damage: Callable[[Damage], None] | None = None) -> Found:
    """The samples or records selected (module docstring) and the other places the first one was recorded.

    A SampleBatch record of a topic that is not a dead-letter topic gives samples (as before); every
    other record (a PromptBatch, a dead letter, bytes that are no expstream message) is a record.
    """
    found = Found()
    letters = is_dlq(topic)
    ids_seen: list[str] = []  # a few of the topic's sample ids, for the error when nothing matches
    batches_seen: list[str] = []
    kinds: dict[str, int] = {}
    for loc in iter_located(run, topic, strict=False, on_damage=on_damage):
        kinds[_kind_of(loc, letters)] = kinds.get(_kind_of(loc, letters), 0) + 1
        rows = split_samples(loc.batch, loc) if loc.batch is not None and not letters else []
        if len(ids_seen) < LISTED_IDS:
            ids_seen += [r.sample_id for r in rows][: LISTED_IDS - len(ids_seen)]
        bid = getattr(loc.batch, "batch_id", None) or (_letter_headers(loc).get(H_BATCH_ID) if letters else None)
        if bid and len(batches_seen) < LISTED_IDS:
            batches_seen.append(bid)
        if batch is not None and not _batch_matches(loc, batch, letters):
            continue
        if offset is not None and (loc.frame is None or (loc.frame.partition, loc.frame.offset) != offset):
            continue
        if rows:
            for s in rows:
                if sample is not None and s.sample_id != sample:
                    continue
                if sample is not None and found.samples:
                    found.others.append(loc.where)
                else:
                    found.samples.append(s)
            if found.samples and sample is None:  # --batch / --offset: every sample of the first matching record
                break
            continue
        if sample is not None and not _holds_sample(loc, sample, letters):
            continue
        if sample is not None and found.records:
            found.others.append(loc.where)
            continue
        found.records.append(loc)
        if sample is None:
            break
    if not found.samples and not found.records:
        what = " ".join(x for x in (f"sample {sample}" if sample else "", f"batch {batch}" if batch else "",
                                    f"offset {offset[0]}:{offset[1]}" if offset else "") if x)
        holds = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "no records"
        fix = (f"check the id; {topic} holds {holds}, batch ids e.g. {', '.join(batches_seen) or 'none'}"
               f" (`expstream show {run} --topic {topic} --offset 0:0` shows its first record)")
        if sample is not None:
            elsewhere = _where_else(run, topic, sample)
            no_samples = (f"{topic} holds {holds}, no samples: choose a record with --batch ID or --offset "
                          "PARTITION:OFFSET" if not ids_seen and kinds and not letters else "")
            if elsewhere:
                fix = "; ".join(x for x in (no_samples, f"the sample is recorded in: {', '.join(elsewhere)}; pass "
                                                        "--topic with one of them") if x)
            elif no_samples:
                fix = no_samples
            else:
                fix = (f"no {'other ' if recorded_topics(run) else ''}recorded topic holds it either; check the "
                       f"id (group#index); {topic} holds e.g. {', '.join(ids_seen) or 'no samples'}")
        raise ConfigError(f"{run}: topic {topic!r} holds no {what}", field="--sample" if sample else
                          ("--batch" if batch else "--offset"), fix=fix)
    return found


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


def _tokenizer_dir(topo: Any) -> Path | None:
    """``models.tokenizer``'s directory; for builtin:tiny the already built one under ``cache_dir``
    (relative to the working directory, as for ``expstream run``), or None: looking never builds."""
    from expstream.config.topology import BUILTIN_TINY

    if topo.models.tokenizer != BUILTIN_TINY:
        return Path(topo.models.tokenizer).expanduser()
    built = sorted(p for p in Path(topo.models.cache_dir).expanduser().glob("tiny-llama-*/tokenizer")
                   if not p.parent.name.startswith(".") and p.is_dir())  # ".<name>.tmp-*": a build in progress
    return built[0] if built else None


def _tokenizer(run: Path, err: TextIO) -> Any:
    """The run's tokenizer (models.tokenizer of its recorded topology), or None with a note why."""
    try:
        topo = load_run_topology(run)
        if topo is None:
            print(f"note: {run} has no topology.yaml; token text not shown", file=err)
            return None
        from expstream.models.hf import load_tokenizer

        path = _tokenizer_dir(topo)
        if path is None:
            print(f"note: the built-in tiny tokenizer is not built under models.cache_dir={topo.models.cache_dir} "
                  "(show never builds models; `expstream models build` does); token text not shown", file=err)
            return None
        return load_tokenizer(path, field="models.tokenizer")
    except Exception as exc:  # noqa: BLE001 - the text column is a convenience; ids are always shown
        print(f"note: cannot load the run's tokenizer ({type(exc).__name__}: {exc}); token text not shown",
              file=err)
        return None


def show(run: str | Path, topic: str, *, sample: str | None = None, batch: str | None = None,
         offset: str | None = None, as_json: bool = False, tokenizer: bool = True,
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the selected sample(s) or record of ``topic`` in ``run`` (module docstring); returns EXIT_OK."""
    out, err = out or sys.stdout, err or sys.stderr
    run = Path(run)
    if sample is None and batch is None and offset is None:
        raise ConfigError("nothing chosen to show", field="--sample",
                          fix="pass --sample GROUP#INDEX (e.g. 3#0), --batch ID or --offset PARTITION:OFFSET")
    if sample is not None and "#" not in sample:
        raise ConfigError(f"--sample {sample!r} is not a sample id", field="--sample",
                          fix="a sample id is group_id#sample_index, e.g. --sample 3#0")
    warned: set[str] = set()

    def on_damage(d: Damage) -> None:
        if d.message() not in warned:
            warned.add(d.message())
            print(f"expstream show: warning: {d.message()}", file=err)

    found = find(run, topic, sample=sample, batch=batch, offset=None if offset is None else _parse_offset(offset),
                 on_damage=on_damage)
    needs_tokens = found.samples or any(r.batch is not None and hasattr(r.batch, "sample_index")
                                        for r in found.records)
    tok = _tokenizer(run, err) if tokenizer and needs_tokens else None
    views = [sample_dict(s, tok) for s in found.samples]
    records = [record_dict(r, tok, letters=is_dlq(topic)) for r in found.records]
    if as_json:
        print(json.dumps({"samples": views, "records": records, "also_at": found.others}, sort_keys=True), file=out)
    else:
        text = [format_sample(v, found.others) for v in views] + [format_record(r) for r in records]
        if records and found.others:
            text.append(f"also recorded at: {', '.join(found.others)} (the first occurrence is shown)")
        print("\n\n".join(text), file=out)
    return EXIT_OK


def add_show_arguments(p: argparse.ArgumentParser) -> None:
    """``expstream show`` (no topology flags: the run directory holds the configuration)."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<name>)")
    p.add_argument("--topic", default=EXPERIENCES_TOPIC,
                   help="the recorded topic to look in (default: experiences), e.g. rewarded")
    p.add_argument("--sample", help="sample id GROUP#INDEX, e.g. 3#0 (on a .dlq topic: the letter holding it)")
    p.add_argument("--batch", help="the record with this batch id (e.g. p000003/m0): every sample of a SampleBatch, "
                                   "every prompt of a PromptBatch, a dead letter's headers and value")
    p.add_argument("--offset", help="the record at PARTITION:OFFSET (e.g. 0:12), of any kind")
    p.add_argument("--json", action="store_true", help="one JSON object (docs/replay.md, 'show')")
    p.add_argument("--no-tokenizer", action="store_true", help="do not load the run's tokenizer (no token text)")


def refuse_damaged(exc: RecordingError, flag: str) -> ConfigError:
    """A damaged recording as the command's error: the file, the byte position, what to do."""
    return ConfigError(str(exc), field=flag, fix="the recording was modified after it was written; restore it, or "
                                                 "compare another topic (--topic)")


def show_command(args: argparse.Namespace) -> int:
    try:
        return show(args.run_dir, args.topic, sample=args.sample, batch=args.batch, offset=args.offset,
                    as_json=args.json, tokenizer=not args.no_tokenizer)
    except RecordingError as exc:
        raise refuse_damaged(exc, "RUN_DIR") from exc


SHOW = Command("show", "one recorded sample decoded: ids, offsets, texts, per-token table, rewards",
               add_show_arguments, show_command, reads_topology=False)
