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

This module chooses what to show and prints it; the reading side shared with ``expstream diff`` is
expstream/tools/samples.py, the views (JSON and text, the per-token table) expstream/tools/showview.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from expstream.config.cli_args import Command
from expstream.errors import EXIT_OK, ConfigError
from expstream.kafka.letters import H_BATCH_ID, H_SAMPLE_IDS, decode_headers
from expstream.tools.recording import Damage, RecordingError, recorded_topics
from expstream.tools.samples import (
    EXPERIENCES_TOPIC,
    Located,
    Sample,
    is_dlq,
    iter_located,
    refuse_damaged,
    split_samples,
)
from expstream.tools.showview import format_record, format_sample, record_dict, sample_dict

__all__ = [
    "Found",
    "add_show_arguments",
    "find",
    "load_run_topology",
    "show",
    "show_command",
]

#: Sample ids named in the error for a sample that is not there (enough to see the id pattern).
LISTED_IDS = 6


def load_run_topology(run: str | Path) -> Any:
    """The run's recorded configuration (``<run>/topology.yaml``, else ``<run>/run/topology.yaml``), or None."""
    from expstream.config.topology import load_topology

    for path in (Path(run) / "topology.yaml", Path(run) / "run" / "topology.yaml"):
        if path.is_file():
            return load_topology(path)
    return None


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


def show_command(args: argparse.Namespace) -> int:
    try:
        return show(args.run_dir, args.topic, sample=args.sample, batch=args.batch, offset=args.offset,
                    as_json=args.json, tokenizer=not args.no_tokenizer)
    except RecordingError as exc:
        raise refuse_damaged(exc, "RUN_DIR") from exc


SHOW = Command("show", "one recorded sample decoded: ids, offsets, texts, per-token table, rewards",
               add_show_arguments, show_command, reads_topology=False)
