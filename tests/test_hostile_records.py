"""Hostile records on every stage's input topic: each becomes a dead letter with a reason, never a crash.

One runner per stage (all 8, each on fresh topics), driven on threads of this process against the
session broker. The runner/letters path is shared by every stage, so each runner's ``process`` is
a cheap pass-through that refuses batches called ``bad-*`` (as a stage refuses a bad sample); what
is under test is what happens around it: no value (a tombstone), no key, odd headers (None
values, bytes that are not UTF-8, forged dead-letter header names, a header too large to carry),
values of 0 bytes, over ``max_record_bytes`` and over the producer's ``max_request_size``.
Each kind is followed by a good record, which must come out: the partition is never blocked.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from expstream.config.topology import load_topology
from expstream.errors import PoisonRecordError
from expstream.kafka.clients import make_producer, read_topic, topic_lag
from expstream.kafka.topics import create_topics
from schemas import PromptBatch, decode, encode
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running

pytestmark = pytest.mark.integration

STAGES = ["generate", "shard-preprocess", "actor-logprob", "reference", "critic", "reward", "postprocess",
          "advantage"]
# The runner's producer refuses records over this (so a letter carrying such a value cannot be sent) ...
MAX_REQUEST_SIZE = 256 * 1024
# ... and the runner refuses to decode records over this.
MAX_RECORD_BYTES = 64 * 1024
JUNK = b"\xc1\xc1 not msgpack"
# kafka-python's producer refuses a None header value, but the protocol allows one and other clients
# write them; the test's raw producer writes this placeholder, which null_header_values() turns into
# a real null on the wire (the broker stores it; the runner's consumer reads it back as None).
NULL = b"\x00null-header-placeholder\x00"


def prompts(batch_id: str) -> bytes:
    return encode(PromptBatch(batch_id=batch_id, prompt_id=[f"{batch_id}-0"], prompt=["x"], label=[""],
                              reference=[""]))


# kind -> (value, key, headers, expected error_class, value carried in the letter (None: omitted))
KINDS: dict[str, tuple[bytes | None, bytes | None, list | None, str, bytes | None]] = {
    "tombstone": (None, b"k-tomb", None, "TombstoneRecordError", None),
    "empty value": (b"", b"k", None, "DecodeError", b""),
    "no key, undecodable": (JUNK, None, None, "DecodeError", JUNK),
    "no key, refused by the stage": (prompts("bad-nokey"), None, None, "PoisonRecordError", prompts("bad-nokey")),
    "binary key": (JUNK + b"k", b"\xff\x00\xfe", None, "DecodeError", JUNK + b"k"),
    "header value None": (prompts("bad-hnone"), b"k", [("trace", NULL)], "PoisonRecordError", prompts("bad-hnone")),
    "header value not UTF-8": (prompts("bad-h8"), b"k", [("trace", b"\xff\xfe\x00")], "PoisonRecordError",
                               prompts("bad-h8")),
    "forged dead-letter headers": (
        prompts("bad-forged"), b"k",
        [("original_topic", b"elsewhere"), ("stage", b"x"), ("stage", b"y"), ("error_class", b"z"),
         ("original_offset", b"\xff"), ("value_omitted", NULL), ("redrive_attempt", b"not a number")],
        "PoisonRecordError", prompts("bad-forged")),
    "header too large to carry": (prompts("bad-bigheader"), b"k", [("blob", b"h" * (MAX_REQUEST_SIZE + 1000))],
                                  "PoisonRecordError", prompts("bad-bigheader")),
    "value over max_record_bytes": (b"\x00" * (MAX_RECORD_BYTES + 10), b"k", None, "RecordTooLargeError",
                                    b"\x00" * (MAX_RECORD_BYTES + 10)),
    "value over max_request_size": (b"\x01" * (MAX_REQUEST_SIZE + 10), b"k", None, "RecordTooLargeError", None),
}


def stage_topology(broker: str, stage: str):
    """All 8 stages enabled (gae); ``stage`` reads a fresh topic (with a .dlq twin), writes a fresh one."""
    src, dst = f"hin-{uuid.uuid4().hex[:10]}", f"hout-{uuid.uuid4().hex[:10]}"
    create_topics(broker, {src: 1, dst: 1}, with_dlq=True)
    base = ["algo.advantage_estimator=gae", f"kafka.max_request_size={MAX_REQUEST_SIZE}"]
    order = list(load_topology(overrides=base).stages)
    prev = order.index(stage) - 1
    feed = "topics.input" if prev < 0 else f"stages.{order[prev]}.output"
    topo = load_topology(overrides=[*base, f"{feed}={src}", f"stages.{stage}.output={dst}"])
    assert topo.stages[stage].input == src and topo.stages[stage].output == dst
    return topo


@contextlib.contextmanager
def null_header_values() -> Iterator[None]:
    """While open, a header value ``NULL`` sent by any producer of this process goes out as null."""
    from kafka.record.default_records import DefaultRecordBatchBuilder

    original = DefaultRecordBatchBuilder.append

    def append(self, offset, timestamp, key, value, headers, *args, **kwargs):
        headers = [(k, None if v == NULL else v) for k, v in headers]
        return original(self, offset, timestamp, key, value, headers, *args, **kwargs)

    DefaultRecordBatchBuilder.append = append
    try:
        yield
    finally:
        DefaultRecordBatchBuilder.append = original


def headers_of(rec) -> dict[str, bytes | None]:
    return dict(rec.headers or [])


@pytest.fixture(scope="module")
def hostile_run(broker):
    """Every kind, each followed by a good record, on every stage's input; returns what came out."""
    # a producer that may write what the runners' producers refuse (records over their max_request_size)
    producer = make_producer(broker, None, max_request_size=4 * MAX_REQUEST_SIZE)
    runs: dict[str, SimpleNamespace] = {}
    try:
        for stage in STAGES:
            topo = stage_topology(broker, stage)
            src = topo.stages[stage].input
            processed: list[str] = []

            def process(batch, ctx, processed=processed):
                processed.append(batch.batch_id)
                if batch.batch_id.startswith("bad-"):
                    raise PoisonRecordError(f"PromptBatch.prompt: refused {batch.batch_id} (test)")
                return [batch]

            futures = []
            with null_header_values():
                for i, (value, key, headers, _, _) in enumerate(KINDS.values()):
                    futures.append(producer.send(src, value=value, key=key, headers=headers))
                    futures.append(producer.send(src, value=prompts(f"good-{i}"), key=b"g"))
                producer.flush()
                offsets = [f.get(timeout=30).offset for f in futures]
            runner = StageRunner(make_context(topo, stage, run_id=f"h{uuid.uuid4().hex[:6]}"), process, broker,
                                 max_record_bytes=MAX_RECORD_BYTES)
            runs[stage] = SimpleNamespace(topo=topo, src=src, offsets=offsets, processed=processed,
                                          running=Running(runner))
    finally:
        producer.close()
    try:
        for run in runs.values():
            run.running.wait(lambda r=run: r.running.runner.handled >= len(r.offsets), 120, "every record handled")
    finally:
        for run in runs.values():
            run.running.stop(reraise=False)
    for stage, run in runs.items():
        run.letters = list(read_topic(broker, run.topo.kafka, f"{run.src}.dlq"))
        run.outputs = list(read_topic(broker, run.topo.kafka, run.topo.stages[stage].output))
        run.lag = topic_lag(broker, run.topo.kafka, run.running.runner.group_id, run.src)
    return runs


CASES = [(s, k) for s in STAGES for k in KINDS]


@pytest.mark.parametrize(("stage", "kind"), CASES, ids=[f"{s}:{k}" for s, k in CASES])
def test_hostile_record_is_dead_lettered_and_the_stage_carries_on(hostile_run, stage, kind):
    run = hostile_run[stage]
    value, key, headers, error_class, carried = KINDS[kind]
    i = list(KINDS).index(kind)
    offset = run.offsets[2 * i]
    assert run.running.error is None, f"the runner raised {run.running.error!r}"
    found = [r for r in run.letters if headers_of(r).get("original_offset") == str(offset).encode()]
    assert len(found) == 1, f"{len(found)} letters for {run.src}[0]@{offset}: {[headers_of(r) for r in run.letters]}"
    letter = found[0]
    h = headers_of(letter)
    assert h["error_class"] == error_class.encode(), h.get("error_class")
    assert h["error_message"], "a letter says why"
    assert h["stage"] == stage.encode() and h["original_topic"] == run.src.encode()
    assert [k for k, _ in letter.headers].count("stage") == 1, "forged runner headers are replaced, not kept"
    assert h["size"] == str(len(value or b"")).encode()
    if carried is None:
        assert letter.value == b"" and h.get("value_omitted"), h
    else:
        assert letter.value == carried and "value_omitted" not in h
    assert letter.key == key
    if kind == "header too large to carry":
        assert "blob" not in h and h.get("headers_omitted"), "headers that cannot travel are dropped, and it says so"
    for k, v in headers or []:
        if k in ("trace", "redrive_attempt"):  # the record's own headers travel with it, byte for byte
            # (a null header value cannot be re-sent by kafka-python's producer: it travels as empty)
            assert (k, b"" if v == NULL else v) in letter.headers, letter.headers
    # the good record after it was processed and came out; the stage never died
    assert f"good-{i}" in run.processed
    assert run.lag == {0: 0}, f"offsets not committed to the end: {run.lag}"


def test_good_records_come_out_once_and_every_letter_is_accounted_for(hostile_run):
    for stage, run in hostile_run.items():
        good = [f"good-{i}" for i in range(len(KINDS))]
        assert [decode(r.value).batch_id for r in run.outputs] == good, stage
        assert len(run.letters) == len(KINDS), stage
        assert run.running.runner.dead_lettered == len(KINDS)
        assert run.running.runner.handled == 2 * len(KINDS)
