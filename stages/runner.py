"""The one Kafka loop every stage runs in: consume -> decode -> process -> produce -> commit.

Commit protocol, per input record (one record = one micro-batch):

1. Decode the record's bytes inside the stage (never in the fetcher), under try/except.
2. Call ``process(batch, ctx)``; it returns zero or more output batches (Redis updates inside
   it are idempotent by batch id, so a redelivered record changes nothing twice).
3. Send every output, flush the producer, then ``.get()`` every send future: ``flush()`` does not
   raise per-record errors.
4. Commit ``offset + 1`` for the record's partition, only if this consumer still owns it
   (revocations are recorded by the rebalance listener and acted on here, never inside it).

A record that cannot be decoded or validated, or whose processing fails with a non-retriable
error, is routed to ``<input topic>.dlq`` with its original bytes and headers naming the stage,
the error and the original position; that send is confirmed before the input offset is
committed, so nothing is lost. A retriable error is retried with bounded backoff and the offset
is not committed until it succeeds. SIGTERM/SIGINT finish the record in hand, commit, exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.structs import OffsetAndMetadata

from expstream.bus import make_consumer, make_producer, send_all_and_confirm
from expstream.errors import ExpstreamError
from schemas import SampleBatch, decode, encode
from schemas.codec import peek_header
from schemas.errors import SchemaError
from stages.context import StageContext

# Why 500 ms: short enough that SIGTERM is noticed quickly, long enough not to spin on an idle topic.
POLL_TIMEOUT_MS = 500
# Why these bounds: a retriable failure (broker or Redis briefly away) is retried with exponential
# backoff up to 10 s between tries, so a stage neither crash-loops nor hammers a recovering service.
RETRY_BACKOFF_START_S = 0.2
RETRY_BACKOFF_MAX_S = 10.0
# Why 5 minutes: after this long a retriable error is treated as a stage failure (exit 1) so the
# supervisor restarts the process and the record is redelivered to a fresh one.
RETRY_GIVE_UP_S = 300.0
# Header values are truncated so one enormous error message cannot make the DLQ record oversized.
MAX_HEADER_CHARS = 2000

ProcessFn = Callable[[Any, StageContext], list]
# Fault injection for crash tests: EXPSTREAM_FAULT="<stage>:<point>:<k>" makes the k-th record this
# process handles SIGKILL the process at <point> (before_produce | after_produce | after_commit).
FAULT_ENV = "EXPSTREAM_FAULT"


def _fault_plan(stage: str) -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV, "")
    for item in filter(None, spec.split(",")):
        name, _, rest = item.partition(":")
        point, _, k = rest.partition(":")
        if name == stage and point in ("before_produce", "after_produce", "after_commit"):
            return point, int(k or 1)
    return None


class _RevocationTracker(ConsumerRebalanceListener):
    """Runs on the client's IO thread: only records what happened; the main loop acts on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revoked: set[TopicPartition] = set()
        self.assigned: set[TopicPartition] = set()

    def on_partitions_revoked(self, revoked: Any) -> None:
        with self.lock:
            self.revoked.update(revoked)
            self.assigned.difference_update(revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        with self.lock:
            self.assigned.update(assigned)
            self.revoked.difference_update(assigned)

    def owns(self, tp: TopicPartition) -> bool:
        with self.lock:
            return tp in self.assigned


def _headers(**items: Any) -> list[tuple[str, bytes]]:
    return [(k, str(v)[:MAX_HEADER_CHARS].encode()) for k, v in items.items()]


class StageRunner:
    """Runs ``process`` for one stage replica against Kafka until stopped."""

    def __init__(self, ctx: StageContext, process: ProcessFn, bootstrap: str,
                 max_records: int | None = None) -> None:
        self.ctx = ctx
        self.process = process
        self.bootstrap = bootstrap
        self.max_records = max_records
        self.stop_requested = False
        self.stage = ctx.stage
        self.log = logging.getLogger(f"expstream.stage.{self.stage.name}")
        self.group_id = f"expstream.{ctx.run_id}.{self.stage.name}"
        self.dlq_topic = f"{self.stage.input}.dlq"
        self.handled = 0
        self.dead_lettered = 0
        self.fault = _fault_plan(self.stage.name)

    # -- lifecycle -----------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def _stop(signum: int, _frame: Any) -> None:
            self.log.info("stage %s: got signal %d; finishing the micro-batch in hand", self.stage.name, signum)
            self.stop_requested = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def run(self) -> int:
        cfg = self.ctx.topology.kafka
        self.producer = make_producer(self.bootstrap, cfg)
        self.consumer = make_consumer(self.bootstrap, self.group_id, cfg)
        self.tracker = _RevocationTracker()
        self.consumer.subscribe([self.stage.input], listener=self.tracker)
        self.log.info("stage %s replica %s: consuming %s as group %s, producing %s", self.stage.name,
                      self.ctx.replica_id, self.stage.input, self.group_id, self.stage.output)
        try:
            while not self.stop_requested:
                polled = self.consumer.poll(timeout_ms=POLL_TIMEOUT_MS, max_records=1)
                for tp, records in polled.items():
                    for record in records:
                        if self.stop_requested:
                            break
                        self._handle(tp, record)
                if self.ctx.state is not None:
                    self._heartbeat()
                if self.max_records is not None and self.handled >= self.max_records:
                    break
        finally:
            self._close()
        self.log.info("stage %s replica %s: stopped after %d records (%d dead-lettered)", self.stage.name,
                      self.ctx.replica_id, self.handled, self.dead_lettered)
        return 0

    def _close(self) -> None:
        try:
            self.producer.flush(timeout=10)
            self.producer.close(timeout=10)
        finally:
            self.consumer.close(autocommit=False)

    _last_beat = 0.0

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat > 2.0:
            self._last_beat = now
            try:
                self.ctx.state.heartbeat(self.stage.name, f"{self.ctx.replica_id}:{os.getpid()}")
            except ExpstreamError as exc:  # heartbeats are best effort; the work path retries properly
                self.log.warning("stage %s: heartbeat failed: %s", self.stage.name, exc)

    # -- one record -----------------------------------------------------------------------------
    def _handle(self, tp: TopicPartition, record: Any) -> None:
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        started = time.monotonic()
        backoff = RETRY_BACKOFF_START_S
        while True:
            try:
                outputs, batch_id, samples = self._process_bytes(record.value, where)
                self._maybe_fault("before_produce")
                send_all_and_confirm(
                    self.producer,
                    [(self.stage.output, encode(out), _key(out), None) for out in outputs],
                    self.ctx.topology.kafka.produce_timeout_s,
                )
                self._maybe_fault("after_produce")
                break
            except (SchemaError, _Poison) as exc:
                self._dead_letter(record, where, exc)
                batch_id, samples, outputs = None, 0, []
                break
            except ExpstreamError as exc:
                if not exc.retriable:
                    self._dead_letter(record, where, exc)
                    batch_id, samples, outputs = None, 0, []
                    break
                if time.monotonic() - started > RETRY_GIVE_UP_S:
                    raise
                self.log.warning("stage %s %s: retriable %s: %s; retrying in %.1fs", self.stage.name, where,
                                 type(exc).__name__, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
        self._commit(tp, record.offset, where)
        self._maybe_fault("after_commit")
        self.handled += 1
        elapsed = time.monotonic() - started
        if batch_id is not None:
            self.log.info("stage %s %s batch=%s: %d samples -> %d records in %.3fs", self.stage.name, where,
                          batch_id, samples, len(outputs), elapsed)
            if self.ctx.state is not None:
                self.ctx.state.record_stage_time(self.stage.name, elapsed, samples, batch_id)

    def _maybe_fault(self, point: str) -> None:
        if self.fault is not None and self.fault[0] == point and self.handled + 1 >= self.fault[1]:
            self.log.warning("stage %s: fault injection %s: SIGKILL at %s", self.stage.name, FAULT_ENV, point)
            os.kill(os.getpid(), signal.SIGKILL)

    def _process_bytes(self, value: bytes, where: str) -> tuple[list, str, int]:
        batch = decode(value)
        try:
            outputs = self.process(batch, self.ctx)
        except (SchemaError, ExpstreamError):
            raise
        except Exception as exc:  # a bug or a bad sample: data routed to the DLQ, never swallowed
            raise _Poison(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}") from exc
        if isinstance(outputs, SampleBatch):
            outputs = [outputs]
        return list(outputs), batch.batch_id, len(batch)

    def _dead_letter(self, record: Any, where: str, exc: Exception) -> None:
        schema, version, batch_id = peek_header(record.value)
        error_class = type(exc.__cause__ or exc).__name__ if isinstance(exc, _Poison) else type(exc).__name__
        headers = list(record.headers or []) + _headers(
            stage=self.stage.name,
            error_class=error_class,
            error_message=str(exc),
            original_topic=record.topic,
            original_partition=record.partition,
            original_offset=record.offset,
            schema=schema,
            schema_version=version,
            batch_id=batch_id,
        )
        send_all_and_confirm(self.producer, [(self.dlq_topic, record.value, record.key, headers)],
                             self.ctx.topology.kafka.produce_timeout_s)
        self.dead_lettered += 1
        self.log.error("stage %s %s batch=%s: dead-lettered to %s: %s: %s", self.stage.name, where, batch_id,
                       self.dlq_topic, error_class, str(exc).splitlines()[0] if str(exc) else "")

    def _commit(self, tp: TopicPartition, offset: int, where: str) -> None:
        if not self.tracker.owns(tp):
            self.log.warning("stage %s %s: partition revoked meanwhile; not committing (the new owner "
                             "re-processes it, idempotently)", self.stage.name, where)
            return
        self.consumer.commit({tp: OffsetAndMetadata(offset + 1, "", -1)})


class _Poison(Exception):
    """A failure inside process() that is not retriable: the record goes to the DLQ."""


def _key(batch: Any) -> bytes:
    group_ids = getattr(batch, "group_id", None)
    return (group_ids[0] if group_ids else batch.batch_id).encode()
