"""``expstream topics tail TOPIC``: look at a topic's records from a shell, decoded with the schemas.

The supported way to read expstream topics from outside Python code (kcat from Debian cannot talk to
the embedded Tansu broker: docs/kafka-notes.md). One line per record::

    batches[0]@12 key=p000003 batch_id=p000003/m0 schema=expstream.SampleBatch v1 samples=4 size=5120
    prompts[1]@7 key=- undecodable (13 bytes): DecodeError: record value is not valid msgpack ...
    prompts[0]@8 key=p000009 tombstone (no value)
    prompts.dlq[0]@0 key=p000003 ... headers: stage=generate error_class=DecodeError ...

``--json`` prints one JSON object per record instead, with the decoded message's fields; tensors are
summarised as ``{"dtype", "shape"}`` (ragged: ``{"dtype", "rows", "values"}``), never dumped.

Which records (group-less: no consumer group is joined and nothing is committed):

1. Default: the last :data:`DEFAULT_LAST_N` records of each partition present now, then stop
   (like ``tail(1)``). ``--from-beginning``: every record from the start of each partition.
2. The end is the end offset snapshotted at start (:func:`expstream.kafka.clients.end_offsets`, right on Tansu).
3. ``--follow``: do not stop at the end; wait for new records until Ctrl-C (or ``--max``).
4. ``--max N``: stop after N records in all.

A record that cannot be decoded is printed as such with its length, never a crash: a topic may
hold anything a producer wrote (that is what dead-letter topics are for).

The ``expstream topics`` command is wired here (:data:`TOPICS`): ``tail`` is its action that needs
this module; ``create`` and ``list`` are :func:`expstream.kafka.topics.topics_command`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np

from expstream.config.cli_args import Command, add_topology_args
from expstream.config.kafka import KafkaConfig
from expstream.config.topology import Topology
from expstream.errors import EXIT_INTERRUPTED, EXIT_OK, ConfigError
from expstream.kafka import topics as kafka_topics
from expstream.kafka.clients import end_offsets, make_consumer
from expstream.kafka.letters import decode_headers
from expstream.tools.terminal import printable

__all__ = ["DEFAULT_LAST_N", "format_record", "record_json", "tail", "tail_command", "add_tail_args"]

#: Records per partition shown without --from-beginning: like tail(1), a glance at the latest ones.
DEFAULT_LAST_N = 10
# Why 200 ms: how long one poll waits for records; short, so Ctrl-C and --max end the loop quickly
# and a non-follow tail notices the snapshot end soon after reaching it.
POLL_TIMEOUT_MS = 200
# Why 30 s: how long to wait for the topic's metadata before saying it does not exist; the broker
# answers at once when it is up, and a missing broker is reported by the client after its own
# bootstrap timeout anyway.
METADATA_TIMEOUT_S = 30.0
# Why 200 chars: a dead letter's error_message can be 2000 chars (letters.MAX_HEADER_CHARS); one
# line per record stays readable. --json prints headers whole.
HEADER_VALUE_CHARS = 200


def _key_text(key: bytes | None) -> str:
    return "-" if key is None else key.decode("utf-8", errors="replace")


def _summarise(value: Any) -> Any:
    """A JSON-able view of a message field: tensors as dtype/shape, never their data."""
    from schemas.tensors import Ragged

    if isinstance(value, Ragged):
        return {"dtype": value.dtype, "rows": len(value), "values": int(value.values.shape[0])}
    if isinstance(value, np.ndarray):
        return {"dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, Mapping):
        return {str(k): _summarise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_summarise(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _decode(value: bytes) -> tuple[Any, str | None]:
    """(message, None) or (None, "ErrorClass: message") — never raises."""
    from schemas.codec import decode

    try:
        return decode(value), None
    except Exception as exc:  # noqa: BLE001 - any bytes may be on a topic; report, never crash
        return None, f"{type(exc).__name__}: {exc}"


def _count(msg: Any) -> str:
    from schemas.messages import PromptBatch

    return f"prompts={len(msg.prompt_id)}" if isinstance(msg, PromptBatch) else f"samples={len(msg.prompt_id)}"


def format_record(record: Any) -> str:
    """One line for one ConsumerRecord (see the module docstring)."""
    where = f"{record.topic}[{record.partition}]@{record.offset} key={_key_text(record.key)}"
    if record.value is None:
        line = f"{where} tombstone (no value)"
    else:
        msg, error = _decode(record.value)
        if error is not None:
            line = f"{where} undecodable ({len(record.value)} bytes): {' '.join(error.split())[:300]}"
        else:
            from schemas.codec import peek_header

            version = peek_header(record.value)[1]  # the record's own version (text-only batches stay older)
            line = (f"{where} batch_id={msg.batch_id} schema={msg.SCHEMA} v{version} "
                    f"{_count(msg)} size={len(record.value)}")
    headers = decode_headers(record.headers)
    if headers:
        shown = " ".join(f"{k}={' '.join(v.split())[:HEADER_VALUE_CHARS]}" for k, v in headers.items())
        line += f" headers: {shown}"
    return printable(line)  # keys, ids and headers are whatever the producer sent: no raw escape sequences


def record_json(record: Any) -> dict[str, Any]:
    """One ConsumerRecord as a JSON-able dict; the message's tensors summarised (dtype/shape)."""
    out: dict[str, Any] = {"topic": record.topic, "partition": record.partition, "offset": record.offset,
                           "key": None if record.key is None else _key_text(record.key),
                           "size": None if record.value is None else len(record.value)}
    headers = decode_headers(record.headers)
    if headers:
        out["headers"] = headers
    if record.value is None:
        out["tombstone"] = True
        return out
    msg, error = _decode(record.value)
    if error is not None:
        out["error"] = error
        return out
    out["message"] = {"schema": msg.SCHEMA, **{f: _summarise(getattr(msg, f)) for f in msg.FIELDS
                                               if getattr(msg, f) is not None}}
    return out


def tail(bootstrap: str, cfg: KafkaConfig | None, topic: str, *, from_beginning: bool = False,
         max_records: int | None = None, follow: bool = False, as_json: bool = False,
         out: TextIO | None = None, last_n: int = DEFAULT_LAST_N) -> int:
    """Print ``topic``'s records (module docstring, steps 1-4); returns how many were printed."""
    from kafka import TopicPartition

    out = out or sys.stdout
    if max_records is not None and max_records <= 0:
        return 0
    consumer = make_consumer(bootstrap, None, cfg, max_poll_records=500)
    try:
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        parts = consumer.partitions_for_topic(topic)
        while parts is None and time.monotonic() < deadline:
            time.sleep(0.05)
            parts = consumer.partitions_for_topic(topic)
        if not parts:
            raise ConfigError(f"topic {topic!r} not found on {bootstrap}", field="topic",
                              fix="name an existing topic; `expstream topics list` shows the topology's topics")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        # 1.-2. start and end offsets per partition
        starts = consumer.beginning_offsets(tps)
        ends = end_offsets(bootstrap, cfg, tps)
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, starts[tp] if from_beginning else max(starts[tp], ends[tp] - last_n))
        remaining = {tp for tp in tps if consumer.position(tp) < ends[tp]}
        printed = 0
        while follow or remaining:
            batch = consumer.poll(timeout_ms=POLL_TIMEOUT_MS)
            for tp in tps:  # partition order, offset order within a partition
                for rec in batch.get(tp, []):
                    if not follow and rec.offset >= ends[tp]:
                        continue
                    print(json.dumps(record_json(rec), sort_keys=True) if as_json else format_record(rec),
                          file=out, flush=True)
                    printed += 1
                    # 4. --max
                    if max_records is not None and printed >= max_records:
                        return printed
            remaining = {tp for tp in remaining if consumer.position(tp) < ends[tp]}
        return printed
    finally:
        consumer.close()


def add_tail_args(p: argparse.ArgumentParser) -> None:
    """The ``topics tail`` options (the topic itself is the ``topics`` command's second positional)."""
    p.add_argument("--from-beginning", action="store_true",
                   help=f"tail: every record from the start (default: the last {DEFAULT_LAST_N} per partition)")
    p.add_argument("--max", type=int, default=None, metavar="N", help="tail: stop after N records")
    p.add_argument("--follow", "-f", action="store_true", help="tail: keep printing new records until Ctrl-C")
    p.add_argument("--json", action="store_true", help="tail: one JSON object per record (tensors as dtype/shape)")


def tail_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream topics tail TOPIC``: checks the arguments, then :func:`tail`."""
    if not args.bootstrap_servers:
        raise ConfigError("no broker to read from", field="--bootstrap-servers",
                          fix="pass --bootstrap-servers HOST:PORT (e.g. localhost:29092 for docker-compose)")
    if not args.topic:
        raise ConfigError("no topic named", field="TOPIC",
                          fix="expstream topics tail TOPIC, e.g. `expstream topics tail experiences`")
    if args.max is not None and args.max < 1:
        raise ConfigError(f"--max must be a positive number of records, got {args.max}", field="--max",
                          fix="give --max 1 or more, or leave it out")
    try:
        tail(args.bootstrap_servers, topo.kafka, args.topic, from_beginning=args.from_beginning,
             max_records=args.max, follow=args.follow, as_json=args.json)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK


# ---- the `topics` command (create | list from expstream.kafka.topics; tail here) ---------------
def add_topics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["create", "list", "tail"])
    p.add_argument("topic", nargs="?", help="tail: the topic to print, e.g. experiences or batches.dlq")
    add_topology_args(p)
    add_tail_args(p)


def topics_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream topics create|list|tail``."""
    if args.action == "tail":
        return tail_command(topo, args)
    return kafka_topics.topics_command(topo, args)


TOPICS = Command("topics", "create or list the topology's topics (and .dlq twins); tail one", add_topics_arguments,
                 topics_command, reads_topology=True)
