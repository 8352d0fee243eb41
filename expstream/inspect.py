"""``expstream show RUN_DIR``: one recorded sample, decoded for a human.

Reads a run directory's recording (expstream/recording.py) -- or, for topic ``experiences`` when
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

This module also holds the reading side shared with ``expstream diff`` (:func:`read_samples`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from expstream.errors import EXIT_OK, ConfigError
from expstream.letters import decode_headers
from expstream.recording import RecordFrame, RecordingError, iter_topic, recorded_topics

__all__ = [
    "EXPERIENCES_FILE",
    "Located",
    "Sample",
    "TOKEN_COLUMNS",
    "add_show_parser",
    "iter_located",
    "load_run_topology",
    "read_samples",
    "refuse_damaged",
    "sample_dict",
    "show",
    "show_command",
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
    """One row of a decoded SampleBatch, every field as that sample's own value."""

    sample_id: str  # f"{group_id}#{sample_index}"
    row: int  # row in its record
    located: Located
    # field -> value: str/int/float for per-sample and per-batch scalars, np.ndarray (x_b,) for a
    # ragged row, float for a (B,) array's entry; dict fields flattened to "info.<key>" /
    # "reward_metrics.<key>"; absent optional fields are left out
    fields: dict[str, Any] = field(default_factory=dict)


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


def iter_located(run: str | Path, topic: str, *, flag: str = "RUN_DIR") -> Iterator[Located]:
    """Every record of ``topic`` in ``run``, decoded, in recording order (merged by time).

    Reads ``topics/<topic>/`` when recorded; else, for ``experiences``, ``experiences.msgpack``
    (file order); else a ConfigError naming ``--topic`` and the recorded topics.
    """
    run = Path(run)
    _check_run_dir(run, flag)
    topics = recorded_topics(run)
    if topic in topics:
        for frame in iter_topic(run, topic, order="time"):
            batch, error = _decode(frame.value)
            yield Located(frame.where, frame, batch, error)
        return
    exp = run / EXPERIENCES_FILE
    if topic == EXPERIENCES_TOPIC and exp.is_file():
        from expstream.expfile import iter_records

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


@dataclass
class SampleSet:
    """A topic's samples, first occurrence per sample id (read_experiences' dedupe rule)."""

    source: str  # what was read: "<run>/topics/<topic>" or "<run>/experiences.msgpack"
    samples: dict[str, Sample] = field(default_factory=dict)
    duplicates: int = 0  # rows whose sample id was seen before (dropped)
    records: int = 0
    undecodable: list[str] = field(default_factory=list)  # "where: error" per record that did not decode


def read_samples(run: str | Path, topic: str, *, flag: str = "RUN_DIR") -> SampleSet:
    """Every sample of ``topic`` in ``run``, the first occurrence per sample id winning."""
    run = Path(run)
    source = str(run / "topics" / topic) if topic in recorded_topics(run) else str(run / EXPERIENCES_FILE)
    out = SampleSet(source)
    for loc in iter_located(run, topic, flag=flag):
        out.records += 1
        if loc.batch is None:
            out.undecodable.append(f"{loc.where}: {loc.error}")
            continue
        for s in split_samples(loc.batch, loc):
            if s.sample_id in out.samples:
                out.duplicates += 1
            else:
                out.samples[s.sample_id] = s
    return out


def load_run_topology(run: str | Path) -> Any:
    """The run's recorded configuration (``<run>/topology.yaml``, else ``<run>/run/topology.yaml``), or None."""
    from expstream.topology import load_topology

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
        lines.append(f"recorded at {d['where']}  time {d['time']} ({d['timestamp']} ms)  key={d['key'] or '-'}")
        for k, v in d["headers"].items():
            lines.append(f"  header {k}={' '.join(v.split())[:200]}")
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
        for loc in iter_located(run, t):
            if loc.batch is not None and hasattr(loc.batch, "sample_ids") and sid in loc.batch.sample_ids():
                found.append(t)
                break
    return found


def find(run: Path, topic: str, *, sample: str | None, batch: str | None,
         offset: tuple[int, int] | None) -> tuple[list[Sample], list[str]]:
    """The samples selected (module docstring) and the other places the first one was recorded."""
    chosen: list[Sample] = []
    others: list[str] = []
    seen: list[str] = []  # a few of the topic's sample ids, for the error when nothing matches
    for loc in iter_located(run, topic):
        if loc.batch is None:
            continue
        if len(seen) < LISTED_IDS and hasattr(loc.batch, "sample_ids"):
            seen += loc.batch.sample_ids()[: LISTED_IDS - len(seen)]
        if batch is not None and loc.batch.batch_id != batch:
            continue
        if offset is not None and (loc.frame is None or (loc.frame.partition, loc.frame.offset) != offset):
            continue
        for s in split_samples(loc.batch, loc):
            if sample is not None and s.sample_id != sample:
                continue
            if sample is not None and chosen:
                others.append(loc.where)
            else:
                chosen.append(s)
        if chosen and sample is None:  # --batch / --offset: every sample of the first matching record
            break
    if not chosen:
        what = " ".join(x for x in (f"sample {sample}" if sample else "", f"batch {batch}" if batch else "",
                                    f"offset {offset[0]}:{offset[1]}" if offset else "") if x)
        fix = f"check the id (`expstream show {run} --topic {topic} --batch ID` lists a record's samples)"
        if sample is not None:
            elsewhere = _where_else(run, topic, sample)
            if elsewhere:
                fix = f"the sample is recorded in: {', '.join(elsewhere)}; pass --topic with one of them"
            else:
                fix = (f"no {'other ' if recorded_topics(run) else ''}recorded topic holds it either; check the "
                       f"id (group#index); {topic} holds e.g. {', '.join(seen) or 'no samples'}")
        raise ConfigError(f"{run}: topic {topic!r} holds no {what}", field="--sample" if sample else
                          ("--batch" if batch else "--offset"), fix=fix)
    return chosen, others


def _tokenizer_dir(topo: Any) -> Path | None:
    """``models.tokenizer``'s directory; for builtin:tiny the already built one under ``cache_dir``
    (relative to the working directory, as for ``expstream run``), or None: looking never builds."""
    from expstream.topology import BUILTIN_TINY

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
        from expstream.models import load_tokenizer

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
    """Print the selected sample(s) of ``topic`` in ``run`` (module docstring); returns EXIT_OK."""
    out, err = out or sys.stdout, err or sys.stderr
    run = Path(run)
    if sample is None and batch is None and offset is None:
        raise ConfigError("nothing chosen to show", field="--sample",
                          fix="pass --sample GROUP#INDEX (e.g. 3#0), --batch ID or --offset PARTITION:OFFSET")
    if sample is not None and "#" not in sample:
        raise ConfigError(f"--sample {sample!r} is not a sample id", field="--sample",
                          fix="a sample id is group_id#sample_index, e.g. --sample 3#0")
    chosen, others = find(run, topic, sample=sample, batch=batch,
                          offset=None if offset is None else _parse_offset(offset))
    tok = _tokenizer(run, err) if tokenizer else None
    views = [sample_dict(s, tok) for s in chosen]
    if as_json:
        print(json.dumps({"samples": views, "also_at": others}, sort_keys=True), file=out)
    else:
        print("\n\n".join(format_sample(v, others) for v in views), file=out)
    return EXIT_OK


def add_show_parser(sub: Any, add_topology_args: Any) -> None:
    """``expstream show`` (``add_topology_args`` is unused: the run directory holds the configuration)."""
    p = sub.add_parser("show", help="one recorded sample decoded: ids, offsets, texts, per-token table, rewards")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<name>)")
    p.add_argument("--topic", default=EXPERIENCES_TOPIC,
                   help="the recorded topic to look in (default: experiences), e.g. rewarded")
    p.add_argument("--sample", help="sample id GROUP#INDEX, e.g. 3#0")
    p.add_argument("--batch", help="every sample of the record with this batch id (e.g. p000003/m0)")
    p.add_argument("--offset", help="every sample of the record at PARTITION:OFFSET (e.g. 0:12)")
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
