"""Dead letters: what the stage runner writes to ``<topic>.dlq``, and ``expstream dlq inspect|redrive``.

The header names and how they are built and read are in expstream/kafka/letters.py, shared with
the runner. ``redrive`` re-publishes each letter to its ``original_topic`` (checked, never
trusted: only ``T`` for a letter of ``T.dlq``, a topology topic, or ``--to``), commits its
progress per confirmed letter, and stops a partition at a refused letter so that the next redrive
sees it again. ``inspect`` escapes control characters in header values. The rules and why:
docs/dead-letters.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from kafka import TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from expstream.config.cli_args import Command, add_topology_args
from expstream.config.kafka import KafkaConfig
from expstream.errors import ConfigError, ExpstreamError
from expstream.kafka.clients import end_offsets, make_admin, make_consumer, make_producer, send_and_confirm
from expstream.kafka.letters import (
    H_BATCH_ID,
    H_ERROR_CLASS,
    H_ERROR_MESSAGE,
    H_OFFSET,
    H_PARTITION,
    H_SAMPLE_IDS,
    H_SCHEMA,
    H_SIZE,
    H_SPLIT_FROM,
    H_STAGE,
    H_TOPIC,
    H_VALUE_OMITTED,
    H_VERSION,
    decode_headers,
    redrive_attempt,
    redrive_headers,
)
from expstream.kafka.topics import DLQ_SUFFIX, dlq_topic
from expstream.tools.terminal import printable

#: Consumer group used by redrive, per dead-letter topic.
REDRIVE_GROUP = "expstream.dlq-redrive.{topic}"
# How long one inspect/redrive waits for the broker (topic metadata, reaching the end snapshot).
READ_TIMEOUT_S = 30.0
POLL_MS = 200


@dataclass
class DeadLetter:
    """One record of a dead-letter topic, with its headers decoded."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]
    raw_headers: list[tuple[str, bytes]] = field(default_factory=list, repr=False)

    @classmethod
    def from_record(cls, rec: Any) -> DeadLetter:
        raw = list(rec.headers or [])
        return cls(rec.topic, rec.partition, rec.offset, rec.key, rec.value, decode_headers(raw), raw)

    @property
    def attempt(self) -> int:
        return redrive_attempt(self.headers)

    @property
    def original_topic(self) -> str | None:
        return self.headers.get(H_TOPIC) or None

    @property
    def origin(self) -> str:
        return (f"{self.headers.get(H_TOPIC, '?')}[{self.headers.get(H_PARTITION, '?')}]"
                f"@{self.headers.get(H_OFFSET, '?')}")

    @property
    def error_first_line(self) -> str:
        msg = self.headers.get(H_ERROR_MESSAGE, "")
        return msg.splitlines()[0] if msg else ""

    def summary(self) -> dict[str, Any]:
        """The fields ``inspect`` prints."""
        return {
            "dlq": f"{self.topic}[{self.partition}]@{self.offset}",
            "stage": self.headers.get(H_STAGE),
            "error_class": self.headers.get(H_ERROR_CLASS),
            "error": self.error_first_line,
            "original": self.origin,
            "batch_id": self.headers.get(H_BATCH_ID),
            "size": len(self.value or b""),
            "original_size": int(self.headers[H_SIZE]) if self.headers.get(H_SIZE, "").isdigit() else None,
            "schema": self.headers.get(H_SCHEMA),
            "schema_version": self.headers.get(H_VERSION),
            "split_from": self.headers.get(H_SPLIT_FROM),
            "sample_ids": self.headers.get(H_SAMPLE_IDS),
            "value_omitted": self.headers.get(H_VALUE_OMITTED),
            "redrive_attempt": self.attempt,
        }

    def redrive_headers(self) -> list[tuple[str, bytes]]:
        """The original record's own headers plus ``redrive_attempt`` = attempt + 1."""
        return redrive_headers(self.raw_headers, self.attempt)


def format_letter(s: dict[str, Any]) -> str:
    """One letter for a terminal: every value from a header escaped (module doc)."""
    t = {k: printable(str(v)) for k, v in s.items()}
    extra = ""
    if s["split_from"]:
        extra += f" split_from={t['split_from']}"
    if s["sample_ids"]:
        extra += f" samples={t['sample_ids']}"
    if s["value_omitted"]:
        extra += " value_omitted"
    return (f"{t['dlq']}  stage={t['stage']}  {t['error_class']}  from {t['original']}  batch={t['batch_id']}  "
            f"size={t['size']}B  attempt={t['redrive_attempt']}{extra}\n    {t['error']}")


def _partitions(consumer: Any, topic: str, timeout_s: float) -> list[TopicPartition]:
    if topic not in consumer.topics():
        raise ConfigError(f"topic {topic!r} does not exist on the broker", field="--topic",
                          fix="name an existing dead-letter topic (`expstream topics list` shows them), "
                              "e.g. batches.dlq")
    deadline = time.monotonic() + timeout_s
    parts = consumer.partitions_for_topic(topic)
    while not parts and time.monotonic() < deadline:
        time.sleep(0.05)
        parts = consumer.partitions_for_topic(topic)
    return [TopicPartition(topic, p) for p in sorted(parts or [])]


def read_letters(bootstrap: str, cfg: KafkaConfig | None, topic: str, *, limit: int | None = None,
                 timeout_s: float = READ_TIMEOUT_S) -> list[DeadLetter]:
    """Every letter of ``topic`` present now (at most ``limit``), read without a consumer group."""
    from expstream.kafka.clients import read_topic

    cfg = cfg or KafkaConfig()
    probe = make_consumer(bootstrap, None, cfg)
    try:
        if not _partitions(probe, topic, timeout_s):
            return []
    finally:
        probe.close()
    return [DeadLetter.from_record(r) for r in read_topic(bootstrap, cfg, topic, timeout_s=timeout_s,
                                                          max_records=limit)]


def inspect(bootstrap: str, cfg: KafkaConfig | None, topics: list[str], *, limit: int | None = None,
            as_json: bool = False, out: TextIO | None = None) -> int:
    """Print the letters of ``topics``; returns how many were printed."""
    out = out or sys.stdout
    n = 0
    for topic in topics:
        letters = read_letters(bootstrap, cfg, topic, limit=None if limit is None else max(limit - n, 0))
        if not as_json:
            print(f"{topic}: {len(letters)} dead letter(s)", file=out)
        for letter in letters:
            s = letter.summary()
            print(json.dumps(s, sort_keys=True) if as_json else format_letter(s), file=out)
        n += len(letters)
        if limit is not None and n >= limit:
            break
    return n


@dataclass
class RedriveReport:
    topic: str
    redriven: list[str] = field(default_factory=list)  # "dlq[p]@o -> topic (attempt k)"
    skipped_max_attempts: list[str] = field(default_factory=list)
    skipped_other: list[str] = field(default_factory=list)  # no original topic, value omitted
    refused: list[str] = field(default_factory=list)  # no original_topic, or not this DLQ's topology topic
    waiting: list[str] = field(default_factory=list)  # partitions stopped at a refused letter (module doc)
    dry_run: bool = False

    def lines(self) -> list[str]:
        verb = "would redrive" if self.dry_run else "redrove"
        out = [f"{self.topic}: {verb} {len(self.redriven)}, skipped {len(self.skipped_max_attempts)} at max "
               f"attempts, {len(self.skipped_other)} not redrivable, {len(self.refused)} refused (target topic "
               "not allowed)"]
        out += [f"  {verb}: {x}" for x in self.redriven]
        out += [f"  skipped (max attempts): {x}" for x in self.skipped_max_attempts]
        out += [f"  skipped: {x}" for x in self.skipped_other]
        out += [f"  refused: {x}" for x in self.refused]
        out += [f"  waiting: {x}" for x in self.waiting]
        return out


@dataclass(frozen=True)
class Targets:
    """Where the letters of one dead-letter topic may be re-published (see the module doc)."""

    allowed: frozenset[str]  # the topology's topics
    to: str | None = None  # --to: every letter goes there

    def check(self, letter: DeadLetter) -> tuple[str | None, str]:
        """``(target, "")`` or ``(None, why not)``."""
        if self.to is not None:
            return self.to, ""
        target = letter.original_topic
        if not target:
            return None, "no original_topic header; not published. Use --to TOPIC to name where it goes"
        twin = letter.topic[: -len(DLQ_SUFFIX)]
        if target != twin:
            return None, (f"original_topic header names {target!r}, but letters of {letter.topic} come from "
                          f"{twin!r} (forged or copied header?); not published. Use --to {twin} to send it back "
                          "there anyway")
        if target not in self.allowed:
            return None, (f"original_topic {target!r} is not a topic of the topology ({', '.join(sorted(self.allowed))})"
                          "; not published. Pass the run's --topology/--set, or --to TOPIC")
        return target, ""


def redrive(bootstrap: str, cfg: KafkaConfig | None, topic: str, *, max_attempts: int = 3, dry_run: bool = False,
            timeout_s: float = READ_TIMEOUT_S, allowed_topics: Iterable[str] = (), to: str | None = None,
            allow_any_topic: bool = False, skip_refused: bool = False) -> RedriveReport:
    """Re-publish the letters of ``topic`` not yet redriven by an earlier call (see the module doc): each to
    its ``original_topic`` when that is ``topic``'s twin and one of ``allowed_topics``, or all to ``to``.
    A refused letter stops its partition uncommitted (``skip_refused``: committed past, as settled)."""
    if not topic.endswith(DLQ_SUFFIX):
        raise ConfigError(f"{topic!r} is not a dead-letter topic", field="--topic",
                          fix=f"name a topic ending in {DLQ_SUFFIX}, e.g. batches.dlq")
    if max_attempts < 1:
        raise ConfigError(f"must be >= 1, got {max_attempts}", field="--max-attempts", fix="use e.g. 3")
    allowed = frozenset(allowed_topics)
    if allow_any_topic and to is None:
        raise ConfigError("only applies to a topic named with --to", field="--allow-any-topic",
                          fix="add --to TOPIC, or leave --allow-any-topic out")
    if to is not None and to not in allowed and not allow_any_topic:
        raise ConfigError(f"{to!r} is not a topic of the topology ({', '.join(sorted(allowed))})", field="--to",
                          fix="name one of them, pass the run's --topology/--set, or add --allow-any-topic")
    targets = Targets(allowed, to)
    cfg = cfg or KafkaConfig()
    report = RedriveReport(topic, dry_run=dry_run)
    consumer = make_consumer(bootstrap, REDRIVE_GROUP.format(topic=topic), cfg, max_poll_records=100)
    producer = None if dry_run else make_producer(bootstrap, cfg)
    try:
        if to is not None and to not in consumer.topics():  # never create a topic by publishing to it
            raise ConfigError(f"topic {to!r} does not exist on the broker", field="--to",
                              fix="create it first (`expstream topics create`), or name an existing topic")
        tps = _partitions(consumer, topic, timeout_s)
        if not tps:
            return report
        ends = end_offsets(bootstrap, cfg, tps, timeout_s=timeout_s)
        consumer.assign(tps)  # no group join: the group only stores redrive's progress
        for tp in tps:
            committed = consumer.committed(tp)
            if committed is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, committed)
        deadline = time.monotonic() + timeout_s
        remaining = {tp for tp in tps if consumer.position(tp) < ends[tp]}
        stopped: dict[TopicPartition, int] = {}  # partition -> the refused letter it stopped at
        while remaining:
            if time.monotonic() > deadline:
                raise ConfigError(f"did not reach the end of {topic} within {timeout_s:.0f}s",
                                  field="--bootstrap-servers", fix="check that the broker is reachable")
            for tp, recs in consumer.poll(timeout_ms=POLL_MS).items():
                for rec in recs:
                    if rec.offset >= ends[tp] or tp in stopped:
                        continue
                    outcome = _redrive_one(DeadLetter.from_record(rec), producer, cfg, max_attempts, targets, report)
                    if outcome == REFUSED and not skip_refused:  # not committed: the next redrive starts here
                        stopped[tp] = rec.offset
                        consumer.pause(tp)
                        continue
                    if not dry_run:  # progress is stored only once the re-publish is confirmed
                        consumer.commit({tp: OffsetAndMetadata(rec.offset + 1, "", -1)})
            remaining = {tp for tp in remaining if tp not in stopped and consumer.position(tp) < ends[tp]}
        for tp, at in sorted(stopped.items()):
            report.waiting.append(f"{topic}[{tp.partition}]: stopped at the refused letter @{at}; "
                                  f"{ends[tp] - at - 1} letter(s) after it wait, unread. Resolve it (--to TOPIC, "
                                  "or the run's --topology) and redrive again, or pass --skip-refused to leave "
                                  "refused letters behind")
        return report
    finally:
        if producer is not None:
            producer.close(timeout=10)
        consumer.close(autocommit=False)


#: What became of one letter: re-published (or would be, dry run), settled (never publishable by a
#: redrive: at the attempt cap, no value), refused (its target is not allowed; ``--to`` can resolve it).
PUBLISHED, SETTLED, REFUSED = "published", "settled", "refused"


def _redrive_one(letter: DeadLetter, producer: Any, cfg: KafkaConfig, max_attempts: int, targets: Targets,
                 report: RedriveReport) -> str:
    where = printable(f"{letter.topic}[{letter.partition}]@{letter.offset} (from {letter.origin}, "
                      f"batch {letter.headers.get(H_BATCH_ID)}, {letter.headers.get(H_ERROR_CLASS)})")
    if letter.attempt >= max_attempts:
        report.skipped_max_attempts.append(f"{where}: already redriven {letter.attempt} time(s)")
        return SETTLED
    target, why_not = targets.check(letter)
    if target is None:
        report.refused.append(f"{where}: {printable(why_not)}")
        return REFUSED
    if letter.headers.get(H_VALUE_OMITTED) or letter.value is None:
        report.skipped_other.append(f"{where}: value omitted ({printable(letter.headers.get(H_VALUE_OMITTED) or '')}); "
                                    "re-publish it from its original position by hand")
        return SETTLED
    if producer is not None:
        send_and_confirm(producer, target, letter.value, letter.key, letter.redrive_headers(),
                         timeout_s=cfg.produce_timeout_s)
    report.redriven.append(f"{where} -> {target} (attempt {letter.attempt + 1})")
    return PUBLISHED


def _dlq_topics_of(bootstrap: str, cfg: KafkaConfig, topo: Any) -> list[str]:
    admin = make_admin(bootstrap, cfg)
    try:
        existing = set(admin.list_topics())
    finally:
        admin.close()
    return [dlq_topic(t) for t in topo.all_topics() if dlq_topic(t) in existing]


def dlq_command(topo: Any, args: argparse.Namespace) -> int:
    """``expstream dlq inspect|redrive`` (wired in expstream/cli.py)."""
    if not args.bootstrap_servers:
        raise ConfigError("needed to read dead letters", field="--bootstrap-servers", fix="e.g. --bootstrap-servers kafka:9092")
    cfg = topo.kafka
    try:
        return _dlq_action(args, cfg, topo)
    except (ExpstreamError, KafkaError) as exc:  # ConfigError goes to cli.main (exit 2); the rest: exit 1
        if isinstance(exc, ConfigError):
            raise
        print(f"expstream dlq {args.dlq_action}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _dlq_action(args: argparse.Namespace, cfg: KafkaConfig, topo: Any) -> int:
    if args.dlq_action == "inspect":
        if bool(args.topic) == bool(args.all):
            raise ConfigError("give exactly one of --topic T.dlq or --all", field="--topic",
                              fix="--topic batches.dlq, or --all (every .dlq twin of the topology's topics)")
        topics = [args.topic] if args.topic else _dlq_topics_of(args.bootstrap_servers, cfg, topo)
        inspect(args.bootstrap_servers, cfg, topics, limit=args.limit, as_json=args.json)
        return 0
    report = redrive(args.bootstrap_servers, cfg, args.topic, max_attempts=args.max_attempts, dry_run=args.dry_run,
                     allowed_topics=topo.all_topics(), to=args.to, allow_any_topic=args.allow_any_topic,
                     skip_refused=args.skip_refused)
    for line in report.lines():
        print(line)
    return 1 if report.refused else 0


def add_dlq_arguments(dlq: argparse.ArgumentParser) -> None:
    """The ``dlq`` subcommand's actions and their arguments."""
    actions = dlq.add_subparsers(dest="dlq_action", required=True)
    ins = actions.add_parser("inspect", help="print each dead letter's headers")
    add_topology_args(ins)
    ins.add_argument("--topic", help="a dead-letter topic, e.g. batches.dlq")
    ins.add_argument("--all", action="store_true", help="every .dlq twin of the topology's topics")
    ins.add_argument("--limit", type=int, default=None, help="print at most N letters")
    ins.add_argument("--json", action="store_true", help="one JSON object per letter")
    red = actions.add_parser("redrive", help="re-publish dead letters to their original topics")
    add_topology_args(red)
    red.add_argument("--topic", required=True, help="the dead-letter topic, e.g. batches.dlq")
    red.add_argument("--max-attempts", type=int, default=3,
                     help="skip letters already redriven this many times (default 3)")
    red.add_argument("--dry-run", action="store_true", help="report what would be sent; send and commit nothing")
    red.add_argument("--to", default=None, metavar="TOPIC",
                     help="send every letter to TOPIC (a topic of the topology) instead of its original_topic")
    red.add_argument("--allow-any-topic", action="store_true",
                     help="let --to name an existing topic outside the topology")
    red.add_argument("--skip-refused", action="store_true",
                     help="commit past refused letters (no later redrive, --to included, sees them again); "
                          "default: a refused letter stops its partition until it is resolved")


DLQ = Command("dlq", "inspect or re-drive dead letters (<topic>.dlq)", add_dlq_arguments, dlq_command,
              reads_topology=True)
