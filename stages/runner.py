"""The one Kafka loop every stage runs in: consume -> decode -> process -> produce -> commit.

Commit protocol, per input record (one record = one micro-batch):

1. A record larger than ``max_record_bytes`` is dead-lettered without being decoded. Otherwise its
   bytes are decoded inside the stage (never in the fetcher), under try/except.
2. ``process(batch, ctx)`` returns zero or more output batches (Redis updates inside it are
   idempotent by batch id, so a redelivered record changes nothing twice). Outputs are encoded
   (and so validated) right away: an output that breaks the contract is a failure of ``process``.
3. Every output and dead letter is sent, the producer flushed, and every send future ``.get()``-ed
   (``flush()`` does not raise per-record errors).
4. ``offset + 1`` is committed for the record's partition, only if this consumer still owns it.
   Rebalance listeners run on kafka-python's IO thread, so they only record revocations; the
   loop acts on them.

Long model work. Steps 1-3 run on a worker thread; the main thread owns the consumer (which is not
thread-safe). When the worker is not done after ``BUSY_GRACE_S``, the main thread pauses every
assigned partition and keeps calling ``poll()`` until it is: a paused partition returns nothing,
but each poll keeps the group membership that kafka-python drops after ``max_poll_interval_ms``
without one. A rebalance can still happen meanwhile (another replica joins); a partition assigned
during the pause is paused too, and anything a poll returned for it before that is rewound with
``seek`` to the first returned offset, so nothing is skipped. When the work is done, everything
paused is resumed; the commit is made only if the record's partition is still ours, and if the
assignment changed meanwhile, the fetch position of the partition is set past the record so that
it is not fetched a second time from the (older) committed offset.

Bad input goes to ``<input topic>.dlq`` and the partition moves on: undecodable bytes, an unknown
schema or version, missing/mistyped/inconsistent fields or non-finite floats (all ``SchemaError``),
a record over ``max_record_bytes``, a ``PoisonRecordError`` or any other non-retriable exception
from ``process``. A letter carries the original bytes and the headers listed in expstream/dlq.py.

Splitting. When ``process`` fails with a non-retriable error on a micro-batch of B > 1 samples
(a SampleBatch, or a PromptBatch of several prompts), the batch is bisected: each half is
processed as ``select``-ed sub-batch ``f"{batch_id}~{start}-{end}"`` (absolute, deterministic
indices, so a redelivered record gives the same ids), a failing half is halved again, down to
single samples. The outputs of the sub-batches that succeed are produced; each sample that fails
on its own is dead-lettered as a 1-row batch with the id ``f"{batch_id}~{i}-{i+1}"`` and the
headers ``split_from=<batch_id>`` and ``sample_ids``, plus the original position. If no sub-batch
succeeds (a batch-level problem rather than a bad sample), nothing is salvaged and the original
record is dead-lettered whole, bytes untouched, so a redrive reproduces it exactly. One bad sample
in B costs about 2·log2(B) extra ``process`` calls. Sub-batches that fail may have done
idempotent-by-id Redis updates under their own ids before failing; stages validate before writing.

Retries. A retriable error (``ExpstreamError.retriable``: broker or Redis briefly away) is retried
with exponential backoff from ``RETRY_BACKOFF_START_S`` to ``RETRY_BACKOFF_MAX_S``, naming the
record and batch in the log; ``process`` is retried alone for its errors and the sends alone for
theirs (the model is not re-run because the broker was away). After ``RETRY_GIVE_UP_S`` the error
is raised (the process exits 1 and the supervisor restarts it with its own backoff). Connecting at
start, polling and committing retry the same way; a commit refused because the group rebalanced
(``CommitFailedError``) is logged and skipped: the new owner gets the record again and processing
is idempotent. SIGTERM/SIGINT finish the micro-batch in hand, commit, and exit 0; a stop during a
retry backoff abandons the record uncommitted (it is redelivered) and exits 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from kafka import ConsumerRebalanceListener, TopicPartition
from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

from expstream import dlq as dlq_headers
from expstream.bus import make_consumer, make_producer, send_all_and_confirm
from expstream.errors import BrokerUnavailableError, ExpstreamError, PoisonRecordError, ShutdownRequested
from schemas import PromptBatch, SampleBatch, decode, encode
from schemas.codec import peek_header
from schemas.errors import SchemaError
from stages.context import StageContext

# Why 500 ms: short enough that SIGTERM is noticed quickly, long enough not to spin on an idle topic.
POLL_TIMEOUT_MS = 500
# Why 1 s: most micro-batches finish well within it and then pay nothing for pausing; a batch that
# takes longer is still far from max_poll_interval_ms (60 s by default, >= 6 s in any sane setup).
BUSY_GRACE_S = 1.0
# Why 200 ms: the poll() made while the partitions are paused; each returns after about this long,
# so the end of the work is noticed within 200 ms and heartbeats/rebalances are served promptly.
BUSY_POLL_MS = 200
# Why these bounds: a retriable failure (broker or Redis briefly away) is retried with exponential
# backoff up to 10 s between tries, so a stage neither crash-loops nor hammers a recovering service.
RETRY_BACKOFF_START_S = 0.2
RETRY_BACKOFF_MAX_S = 10.0
# Why 5 minutes: after this long a retriable error is treated as a stage failure (exit 1) so the
# supervisor restarts the process and the record is redelivered to a fresh one.
RETRY_GIVE_UP_S = 300.0
# Why 60 s: a commit that cannot reach the broker for a minute is given up (logged); the record is
# redelivered after the next rebalance, and a later commit on the partition covers it anyway.
COMMIT_GIVE_UP_S = 60.0
# Header values are truncated so one enormous error message cannot make the DLQ record oversized.
MAX_HEADER_CHARS = 2000
# Why 5 s: an acknowledgement normally takes milliseconds; after 5 s the operator should hear that the
# broker is slow or away, long before kafka.produce_timeout_s (30 s) turns it into a retry.
SLOW_SEND_WARN_S = 5.0
# Why 2 s: Redis heartbeats say the replica is alive; often enough for a dashboard, cheap for Redis.
HEARTBEAT_INTERVAL_S = 2.0
# Why 30 s: how often "no partitions assigned" is repeated in the log while the group is not joined.
UNASSIGNED_LOG_INTERVAL_S = 30.0

ProcessFn = Callable[[Any, StageContext], list]
# Fault injection for crash tests: EXPSTREAM_FAULT="<stage>:<point>:<k>" makes the k-th record this
# process handles SIGKILL the process at <point> (before_produce | after_produce | after_commit).
FAULT_ENV = "EXPSTREAM_FAULT"
# Commit errors that mean "the group moved on": retrying cannot succeed, redelivery covers it.
_REBALANCED = tuple(
    t for t in (getattr(kafka_errors, n, None) for n in (
        "CommitFailedError", "IllegalGenerationError", "UnknownMemberIdError", "RebalanceInProgressError",
        "FencedMemberEpochError", "StaleMemberEpochError"))
    if isinstance(t, type)
)  # fmt: skip


def _fault_plan(stage: str) -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV, "")
    for item in filter(None, spec.split(",")):
        name, _, rest = item.partition(":")
        point, _, k = rest.partition(":")
        if name == stage and point in ("before_produce", "after_produce", "after_commit"):
            return point, int(k or 1)
    return None


class RecordTooLargeError(PoisonRecordError):
    """A record over the runner's ``max_record_bytes``: dead-lettered before decoding."""


class _RevocationTracker(ConsumerRebalanceListener):
    """Runs on the client's IO thread: only records what happened; the main loop acts on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revoked: set[TopicPartition] = set()
        self.assigned: set[TopicPartition] = set()
        self.changes = 0  # bumped on every callback: "the assignment may have moved"

    def on_partitions_revoked(self, revoked: Any) -> None:
        with self.lock:
            self.revoked.update(revoked)
            self.assigned.difference_update(revoked)
            self.changes += 1

    def on_partitions_assigned(self, assigned: Any) -> None:
        with self.lock:
            self.assigned.update(assigned)
            self.revoked.difference_update(assigned)
            self.changes += 1

    def owns(self, tp: TopicPartition) -> bool:
        with self.lock:
            return tp in self.assigned


def _headers(**items: Any) -> list[tuple[str, bytes]]:
    return [(k, str(v)[:MAX_HEADER_CHARS].encode()) for k, v in items.items() if v is not None]


@dataclasses.dataclass
class _Out:
    """One record to send (an output or a dead letter)."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]] | None = None


@dataclasses.dataclass
class _Done:
    """What the worker did with one record."""

    batch_id: str | None
    samples: int
    outputs: int
    letters: int
    seconds: float


class StageRunner:
    """Runs ``process`` for one stage replica against Kafka until stopped."""

    def __init__(self, ctx: StageContext, process: ProcessFn, bootstrap: str,
                 max_records: int | None = None, max_record_bytes: int | None = None) -> None:
        self.ctx = ctx
        self.process = process
        self.bootstrap = bootstrap
        self.max_records = max_records
        self.max_record_bytes = int(max_record_bytes or ctx.topology.kafka.max_request_size)
        self._stop = threading.Event()
        self.stage = ctx.stage
        self.log = logging.getLogger(f"expstream.stage.{self.stage.name}")
        self.group_id = f"expstream.{ctx.run_id}.{self.stage.name}"
        self.dlq_topic = f"{self.stage.input}.dlq"
        self.fault = _fault_plan(self.stage.name)
        # counters (read by tests and the final log line)
        self.handled = 0
        self.dead_lettered = 0
        self.split_batches = 0
        self.rewound = 0
        self.commits_skipped = 0
        self.longest_busy_s = 0.0
        self.producer: Any = None
        self.consumer: Any = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closing = threading.Event()
        self._unassigned_since: float | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        if value:
            self._stop.set()
        else:
            self._stop.clear()

    def install_signal_handlers(self) -> None:
        def _stop(signum: int, _frame: Any) -> None:
            self.log.info("stage %s: got signal %d; finishing the micro-batch in hand", self.stage.name, signum)
            self._stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    def run(self) -> int:
        if not self._connect():
            return 0
        self.tracker = _RevocationTracker()
        self.consumer.subscribe([self.stage.input], listener=self.tracker)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage-{self.stage.name}")
        self.log.info("stage %s replica %s: consuming %s as group %s, producing %s (max_poll_interval_ms=%d, "
                      "max_record_bytes=%d)", self.stage.name, self.ctx.replica_id, self.stage.input,
                      self.group_id, self.stage.output, self.ctx.topology.kafka.max_poll_interval_ms,
                      self.max_record_bytes)
        if self.ctx.state is not None:
            threading.Thread(target=self._heartbeats, name=f"heartbeat-{self.stage.name}", daemon=True).start()
        try:
            while not self.stop_requested:
                polled = self._poll(POLL_TIMEOUT_MS)
                self._handle_polled(polled)
                if self.max_records is not None and self.handled >= self.max_records:
                    break
        finally:
            self._closing.set()
            self._close()
        self.log.info("stage %s replica %s: stopped after %d records (%d dead letters, %d batches split, "
                      "%d records rewound, %d commits skipped)", self.stage.name, self.ctx.replica_id,
                      self.handled, self.dead_lettered, self.split_batches, self.rewound, self.commits_skipped)
        return 0

    def _connect(self) -> bool:
        """Create the producer and consumer, retrying while the broker is unreachable."""
        cfg = self.ctx.topology.kafka
        started, backoff = time.monotonic(), RETRY_BACKOFF_START_S
        while True:
            try:
                self.producer = make_producer(self.bootstrap, cfg)
                self.consumer = make_consumer(self.bootstrap, self.group_id, cfg)
                return True
            except BrokerUnavailableError as exc:
                if self.producer is not None:
                    self.producer.close(timeout=1)
                    self.producer = None
                waited = time.monotonic() - started
                if waited > RETRY_GIVE_UP_S:
                    raise
                self.log.warning("stage %s: broker %s unreachable (%s); retrying in %.1fs (%.0fs so far)",
                                 self.stage.name, self.bootstrap, exc, backoff, waited)
                if self._stop.wait(backoff):
                    return False
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)

    def _close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            if self.producer is not None:
                self.producer.flush(timeout=10)
                self.producer.close(timeout=10)
        finally:
            if self.consumer is not None:
                self.consumer.close(autocommit=False)

    def _heartbeats(self) -> None:
        """Redis heartbeats on their own thread: a slow Redis must never delay the consumer's polls."""
        while True:
            try:
                self.ctx.state.heartbeat(self.stage.name, f"{self.ctx.replica_id}:{os.getpid()}")
            except ExpstreamError as exc:  # heartbeats are best effort; the work path retries properly
                self.log.warning("stage %s: heartbeat failed: %s", self.stage.name, exc)
            if self._closing.wait(HEARTBEAT_INTERVAL_S):
                return

    # -- polling (main thread only) -------------------------------------------------------------
    _poll_backoff = RETRY_BACKOFF_START_S

    def _poll(self, timeout_ms: int) -> dict:
        try:
            polled = self.consumer.poll(timeout_ms=timeout_ms)
        except kafka_errors.KafkaError as exc:
            self.log.warning("stage %s: poll of %s failed (%s: %s); retrying in %.1fs", self.stage.name,
                             self.stage.input, type(exc).__name__, exc, self._poll_backoff)
            if self.stop_requested:  # still polling for a micro-batch in hand: do not spin
                time.sleep(min(self._poll_backoff, 1.0))
            else:
                self._stop.wait(self._poll_backoff)
            self._poll_backoff = min(self._poll_backoff * 2, RETRY_BACKOFF_MAX_S)
            return {}
        self._poll_backoff = RETRY_BACKOFF_START_S
        self._note_assignment()
        return polled

    def _note_assignment(self) -> None:
        now = time.monotonic()
        if self.tracker.assigned:
            if self._unassigned_since is not None and now - self._unassigned_since > UNASSIGNED_LOG_INTERVAL_S:
                self.log.info("stage %s: partitions assigned again: %s", self.stage.name,
                              sorted(tp.partition for tp in self.tracker.assigned))
            self._unassigned_since = None
        elif self._unassigned_since is None:
            self._unassigned_since = self._unassigned_logged = now
        elif now - self._unassigned_logged > UNASSIGNED_LOG_INTERVAL_S:
            self._unassigned_logged = now
            self.log.warning("stage %s: no partition of %s assigned for %.0fs (group %s still joining, more "
                             "replicas than partitions, or the broker %s unreachable)", self.stage.name,
                             self.stage.input, now - self._unassigned_since, self.group_id, self.bootstrap)

    def _handle_polled(self, polled: dict) -> None:
        todo = [(tp, rec) for tp, records in polled.items() for rec in records]
        for i, (tp, record) in enumerate(todo):
            if self.stop_requested:
                return
            if not self.tracker.owns(tp):
                continue  # revoked: the new owner fetches it from the committed offset
            changes = self.tracker.changes
            self._handle(tp, record)
            if self.tracker.changes != changes:
                # The assignment moved while the record was in hand: a partition we (re)gained fetches
                # from its committed offset, not from what this loop still holds. Set every owned
                # position to the first record not handled yet, and poll afresh.
                nxt = {tp: record.offset + 1}
                for other, rec in todo[i + 1:]:
                    nxt.setdefault(other, rec.offset)
                for other, offset in nxt.items():
                    self._reposition(other, offset)
                return
            if self.max_records is not None and self.handled >= self.max_records:
                return

    def _reposition(self, tp: TopicPartition, offset: int) -> None:
        if not self.tracker.owns(tp):
            return
        try:
            self.consumer.seek(tp, offset)
        except (kafka_errors.KafkaError, AssertionError) as exc:  # not assigned after all
            self.log.debug("stage %s: seek %s to %d skipped: %r", self.stage.name, tp, offset, exc)

    def _pause_all(self) -> None:
        todo = [tp for tp in self.consumer.assignment() if tp not in self.consumer.paused()]
        if todo:
            self.consumer.pause(*todo)

    def _poll_paused(self) -> None:
        """One poll with every assigned partition paused; rewinds anything a new partition returned."""
        self._pause_all()
        polled = self._poll(BUSY_POLL_MS)
        for tp, recs in polled.items():
            if not recs:
                continue
            first = min(r.offset for r in recs)
            try:
                self.consumer.seek(tp, first)
            except (kafka_errors.KafkaError, AssertionError) as exc:
                self.log.warning("stage %s: could not rewind %s[%d] to %d: %r", self.stage.name, tp.topic,
                                 tp.partition, first, exc)
                continue
            self.rewound += len(recs)
            self.log.info("stage %s: %s[%d] assigned while a micro-batch is in hand; rewound to %d (%d records "
                          "returned before it was paused)", self.stage.name, tp.topic, tp.partition, first, len(recs))
        self._pause_all()

    def _await(self, fut: concurrent.futures.Future, where: str) -> None:
        """Wait for the worker, polling with paused partitions once it takes longer than BUSY_GRACE_S."""
        started = time.monotonic()
        grace = min(BUSY_GRACE_S, self.ctx.topology.kafka.max_poll_interval_ms / 4000)
        if concurrent.futures.wait([fut], timeout=grace).done:
            return
        self.log.info("stage %s %s: micro-batch still in hand after %.1fs; pausing %d partitions and polling "
                      "to keep the group membership", self.stage.name, where, grace,
                      len(self.consumer.assignment()))
        try:
            while not fut.done():
                self._poll_paused()
        finally:
            self._resume_all()
        busy = time.monotonic() - started
        self.longest_busy_s = max(self.longest_busy_s, busy)
        self.log.info("stage %s %s: micro-batch done after %.1fs; partitions resumed", self.stage.name, where, busy)

    def _sleep_polling(self, seconds: float) -> None:
        """Back off for ``seconds`` without leaving the group (paused polls)."""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and not self.stop_requested:
                self._poll_paused()
        finally:
            self._resume_all()

    def _resume_all(self) -> None:
        paused = self.consumer.paused()
        if paused:
            self.consumer.resume(*paused)
            dropped = _drop_parked_records(self.consumer, paused)
            if dropped:
                self.log.debug("stage %s: dropped parked fetch data of %s (fetched again from the position)",
                               self.stage.name, dropped)

    # -- one record -----------------------------------------------------------------------------
    def _handle(self, tp: TopicPartition, record: Any) -> None:
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        fut = self._executor.submit(self._work, record, where)
        self._await(fut, where)
        try:
            done = fut.result()
        except ShutdownRequested as exc:
            self.log.warning("stage %s %s: %s; not committing it (it is redelivered)", self.stage.name, where, exc)
            return
        self._commit(tp, record.offset, where, done.batch_id)
        self._maybe_fault("after_commit")
        self.handled += 1
        if done.batch_id is not None:
            self.log.info("stage %s %s batch=%s: %d samples -> %d records, %d dead letters in %.3fs",
                          self.stage.name, where, done.batch_id, done.samples, done.outputs, done.letters,
                          done.seconds)

    def _work(self, record: Any, where: str) -> _Done:
        """Worker thread: decode, process (split on failure), send and confirm. Never touches the consumer."""
        started = time.monotonic()
        value = record.value
        size = len(value) if value is not None else 0
        batch = None
        outputs: list[_Out] = []
        if size > self.max_record_bytes:
            exc: Exception = RecordTooLargeError(
                f"record is {size} bytes, over max_record_bytes={self.max_record_bytes}; not decoded. Split the "
                "micro-batch upstream (smaller algo.micro_rollout_batch_size) or raise the limit")
            letters = [self._letter(record, exc)]
        else:
            try:
                batch = decode(value)
            except SchemaError as exc:
                letters = [self._letter(record, exc)]
            else:
                outputs, letters = self._compute(batch, record, where)
        self._maybe_fault("before_produce")
        self._deliver(record, where, outputs, letters, batch)
        self._maybe_fault("after_produce")
        seconds = time.monotonic() - started
        # statistics: every record the stage did its work on, including those parked in a group
        # buffer (no output yet); samples are generated samples for a prompt record
        if batch is not None and (outputs or not letters) and self.ctx.state is not None:
            samples = len(batch) * (self.ctx.topology.generate.n_samples_per_prompt
                                    if isinstance(batch, PromptBatch) else 1)
            try:
                self.ctx.state.record_stage_time(self.stage.name, seconds, samples, batch.batch_id)
            except ExpstreamError as exc:  # statistics only
                self.log.warning("stage %s %s: stage time not recorded: %s", self.stage.name, where, exc)
        return _Done(batch.batch_id if batch is not None else None, len(batch) if batch is not None else 0,
                     len(outputs), len(letters), seconds)

    # -- process, with retries and splitting (worker thread) ---------------------------------------
    def _compute(self, batch: Any, record: Any, where: str) -> tuple[list[_Out], list[_Out]]:
        started, backoff, attempt = time.monotonic(), RETRY_BACKOFF_START_S, 0
        while True:
            try:
                return self._process_or_split(batch, record, where)
            except ExpstreamError as exc:
                if not exc.retriable:
                    raise
                attempt += 1
                self._backoff_or_give_up(exc, started, backoff, attempt, f"{where} batch={batch.batch_id}",
                                         "process")
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)

    def _backoff_or_give_up(self, exc: Exception, started: float, backoff: float, attempt: int, what: str,
                            step: str) -> None:
        waited = time.monotonic() - started
        if waited > RETRY_GIVE_UP_S:
            self.log.error("stage %s %s: %s still failing after %.0fs (%s: %s); giving up so the supervisor "
                           "restarts the stage", self.stage.name, what, step, waited, type(exc).__name__, exc)
            raise exc
        if self.stop_requested:
            raise ShutdownRequested(f"stop requested while retrying {step} ({type(exc).__name__}: {exc})")
        self.log.warning("stage %s %s: %s failed with retriable %s: %s; retry %d in %.1fs (%.1fs so far)",
                         self.stage.name, what, step, type(exc).__name__, exc, attempt, backoff, waited)
        if self._stop.wait(backoff):
            raise ShutdownRequested(f"stop requested while retrying {step} ({type(exc).__name__}: {exc})")

    def _run_process(self, batch: Any) -> list[_Out]:
        """``process`` + encode; non-retriable failures come out as SchemaError, ExpstreamError or _Poison."""
        try:
            outs = self.process(batch, self.ctx)
            if isinstance(outs, (SampleBatch, PromptBatch)):
                outs = [outs]
            return [_Out(self.stage.output, encode(o), _key(o)) for o in outs]
        except (SchemaError, ExpstreamError):
            raise
        except Exception as exc:  # a bug or a bad sample: data routed to the DLQ, never swallowed
            # the class travels in the error_class header; the message gets a short traceback
            raise _Poison(f"{exc}\n{traceback.format_exc(limit=6)}") from exc

    def _process_or_split(self, batch: Any, record: Any, where: str) -> tuple[list[_Out], list[_Out]]:
        try:
            return self._run_process(batch), []
        except Exception as exc:
            if _retriable(exc):
                raise
            first = exc
        n = len(batch) if isinstance(batch, (SampleBatch, PromptBatch)) else 0
        if n <= 1:
            return [], [self._letter(record, first, batch=batch)]
        self.split_batches += 1
        self.log.warning("stage %s %s batch=%s: failed as a whole (%s: %s); splitting its %d samples to isolate "
                         "the bad ones", self.stage.name, where, batch.batch_id, _error_class(first),
                         _first_line(first), n)
        good: list[_Out] = []
        bad: list[tuple[Any, Exception]] = []
        self._bisect(batch, 0, n, good, bad)
        if len(bad) == n:
            # Nothing salvaged: a batch-level problem, not a bad sample. Keep the record whole.
            self.log.warning("stage %s %s batch=%s: every sample fails on its own too; dead-lettering the record "
                             "whole", self.stage.name, where, batch.batch_id)
            return [], [self._letter(record, first, batch=batch)]
        letters = []
        for sub, exc in bad:
            try:
                value = encode(sub)
            except SchemaError as enc_exc:  # cannot happen for a select() of a decoded batch; be safe
                self.log.error("stage %s %s: bad sample %s cannot be re-encoded (%s); dead-lettering the record "
                               "whole", self.stage.name, where, sub.batch_id, enc_exc)
                return [], [self._letter(record, first, batch=batch)]
            letters.append(self._letter(record, exc, value=value, batch=sub, split_from=batch.batch_id))
        self.log.warning("stage %s %s batch=%s: split: %d of %d samples dead-lettered (%s), the rest produced",
                         self.stage.name, where, batch.batch_id, len(bad), n,
                         ", ".join(",".join(_sample_ids(sub)) for sub, _ in bad)[:500])
        return good, letters

    def _bisect(self, batch: Any, lo: int, hi: int, good: list[_Out], bad: list[tuple[Any, Exception]]) -> None:
        """[lo, hi) failed as a whole (hi - lo > 1): process each half, recurse into failing ones."""
        mid = (lo + hi) // 2
        for a, b in ((lo, mid), (mid, hi)):
            sub = _subset(batch, a, b)
            try:
                good.extend(self._run_process(sub))
            except Exception as exc:
                if _retriable(exc):
                    raise
                if b - a == 1:
                    bad.append((sub, exc))
                else:
                    self._bisect(batch, a, b, good, bad)

    # -- dead letters and sends (worker thread) ---------------------------------------------------
    def _letter(self, record: Any, exc: Exception, *, value: Any = ..., batch: Any = None,
                split_from: str | None = None) -> _Out:
        original = record.value
        value = original if value is ... else value
        schema, version, batch_id = peek_header(value) if value else (None, None, None)
        if schema is None and original is not None and value is original:
            schema, version, batch_id = peek_header(original)
        taken = set(dlq_headers.RUNNER_HEADERS)
        kept = [(k, v) for k, v in (record.headers or []) if k not in taken]
        headers = kept + _headers(**{
            dlq_headers.H_STAGE: self.stage.name,
            dlq_headers.H_REPLICA: self.ctx.replica_id,
            dlq_headers.H_ERROR_CLASS: _error_class(exc),
            dlq_headers.H_ERROR_MESSAGE: str(exc),
            dlq_headers.H_TOPIC: record.topic,
            dlq_headers.H_PARTITION: record.partition,
            dlq_headers.H_OFFSET: record.offset,
            dlq_headers.H_SCHEMA: schema,
            dlq_headers.H_VERSION: version,
            dlq_headers.H_BATCH_ID: batch_id,
            dlq_headers.H_SIZE: len(original) if original is not None else 0,
            dlq_headers.H_SPLIT_FROM: split_from,
            dlq_headers.H_SAMPLE_IDS: ",".join(_sample_ids(batch)) if batch is not None else None,
        })
        return _Out(self.dlq_topic, value, record.key, headers)

    def _send(self, items: list[_Out], what: str) -> None:
        """Send and confirm ``items``, retrying retriable failures; raises a non-retriable ProduceError."""
        started, backoff, attempt = time.monotonic(), RETRY_BACKOFF_START_S, 0
        while True:
            try:
                with _warn_if_slow(self.log, "stage %s %s: still waiting for the broker to acknowledge %d records "
                                   "after %.0fs (broker unreachable or paused?); retrying after "
                                   "kafka.produce_timeout_s=%.0fs", self.stage.name, what, len(items),
                                   SLOW_SEND_WARN_S, self.ctx.topology.kafka.produce_timeout_s):
                    send_all_and_confirm(self.producer, [(o.topic, o.value, o.key, o.headers) for o in items],
                                         self.ctx.topology.kafka.produce_timeout_s)
                if attempt:
                    self.log.info("stage %s %s: sent after %d retries (%.1fs); broker reachable again",
                                  self.stage.name, what, attempt, time.monotonic() - started)
                return
            except ExpstreamError as exc:
                if not exc.retriable:
                    raise
                attempt += 1
                self._backoff_or_give_up(exc, started, backoff, attempt, what, f"sending {len(items)} records")
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)

    def _deliver(self, record: Any, where: str, outputs: list[_Out], letters: list[_Out], batch: Any) -> None:
        what = f"{where} batch={batch.batch_id if batch is not None else peek_header(record.value)[2]}"
        try:
            self._send(outputs + letters, what)
        except ExpstreamError as exc:  # non-retriable: the broker refuses a record (e.g. too large)
            self.log.error("stage %s %s: the broker refused an output or letter (%s); dead-lettering the input "
                           "record whole", self.stage.name, what, exc)
            letters[:] = [self._letter(record, exc, batch=batch)]
            outputs[:] = []
            try:
                self._send(letters, what)
            except ExpstreamError as exc2:
                if exc2.retriable:
                    raise
                # Even the original is too large for the dead-letter topic: send its position only.
                letters[0].value = b""
                letters[0].headers = [*(letters[0].headers or []), *_headers(**{
                    dlq_headers.H_VALUE_OMITTED: f"the broker refused the original value ({exc2}); read it at "
                                                 f"{where}"})]
                self._send(letters, what)
        for letter in letters:
            self.dead_lettered += 1
            self.log.error("stage %s %s batch=%s: dead-lettered %s to %s: %s: %s", self.stage.name, where,
                           _header(letter, dlq_headers.H_BATCH_ID) or "?", _header(letter, dlq_headers.H_SAMPLE_IDS)
                           or "the record", self.dlq_topic, _header(letter, dlq_headers.H_ERROR_CLASS),
                           _first_line(_header(letter, dlq_headers.H_ERROR_MESSAGE)))

    def _maybe_fault(self, point: str) -> None:
        if self.fault is not None and self.fault[0] == point and self.handled + 1 >= self.fault[1]:
            self.log.warning("stage %s: fault injection %s: SIGKILL at %s", self.stage.name, FAULT_ENV, point)
            os.kill(os.getpid(), signal.SIGKILL)

    # -- commit (main thread) --------------------------------------------------------------------
    def _commit(self, tp: TopicPartition, offset: int, where: str, batch_id: str | None) -> bool:
        started, backoff, attempt = time.monotonic(), RETRY_BACKOFF_START_S, 0
        timeout_ms = self.ctx.topology.kafka.request_timeout_ms
        while True:
            if not self.tracker.owns(tp):
                self.commits_skipped += 1
                self.log.warning("stage %s %s batch=%s: partition revoked meanwhile; not committing (the new owner "
                                 "re-processes it, idempotently)", self.stage.name, where, batch_id)
                return False
            try:
                with _warn_if_slow(self.log, "stage %s %s batch=%s: commit still waiting for the broker after "
                                   "%.0fs (broker unreachable or paused?)", self.stage.name, where, batch_id,
                                   SLOW_SEND_WARN_S):
                    self.consumer.commit({tp: OffsetAndMetadata(offset + 1, "", -1)}, timeout_ms=timeout_ms)
                if attempt:
                    self.log.info("stage %s %s batch=%s: committed after %d retries", self.stage.name, where,
                                  batch_id, attempt)
                return True
            except _REBALANCED as exc:
                self.commits_skipped += 1
                self.log.warning("stage %s %s batch=%s: commit refused, the group rebalanced (%s); the record is "
                                 "redelivered to the partition's owner and re-processed idempotently",
                                 self.stage.name, where, batch_id, type(exc).__name__)
                return False
            except kafka_errors.KafkaError as exc:
                attempt += 1
                waited = time.monotonic() - started
                if waited > COMMIT_GIVE_UP_S or self.stop_requested:
                    self.commits_skipped += 1
                    self.log.error("stage %s %s batch=%s: commit failed for %.0fs (%s: %s); giving up on it, the "
                                   "record is redelivered after the next rebalance or restart", self.stage.name,
                                   where, batch_id, waited, type(exc).__name__, exc)
                    return False
                self.log.warning("stage %s %s batch=%s: commit failed (%s: %s; broker unreachable?); retry %d in "
                                 "%.1fs", self.stage.name, where, batch_id, type(exc).__name__, exc, attempt, backoff)
                self._sleep_polling(backoff)
                backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)


@contextlib.contextmanager
def _warn_if_slow(log: logging.Logger, message: str, *args: Any) -> Iterator[None]:
    """Log ``message`` once if the block is still running after SLOW_SEND_WARN_S."""
    timer = threading.Timer(SLOW_SEND_WARN_S, log.warning, args=(message, *args))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class _Poison(Exception):
    """A failure inside process() that is not retriable: the record goes to the DLQ."""


def _drop_parked_records(consumer: Any, partitions: Any) -> list[TopicPartition]:
    """Work around a kafka-python 3.0.x fetcher bug; returns the partitions whose data was dropped.

    Since dpkp/kafka-python#2981 (KAFKA-7548), records fetched for a partition that is paused while
    they are being drained are parked in ``Fetcher._paused_partition_records``. They are put back
    only when the fetcher's in-line slot is empty (``_next_partition_records is None``), which it
    almost never is once any partition has returned records, and a partition with parked data is
    never fetched again. Measured here: pause one of two partitions, poll, resume -> the partition
    returns nothing, forever; with the parked entry dropped it resumes at its position. Dropping
    loses nothing: the data is fetched again from the partition's position (which the parked copy
    never moved). A no-op when the attribute is missing (other versions).
    """
    parked = getattr(getattr(consumer, "_fetcher", None), "_paused_partition_records", None)
    if not isinstance(parked, dict):
        return []
    return [tp for tp in partitions if parked.pop(tp, None) is not None]


def _retriable(exc: BaseException) -> bool:
    return bool(getattr(exc, "retriable", False)) and isinstance(exc, ExpstreamError)


def _error_class(exc: BaseException) -> str:
    if isinstance(exc, _Poison) and exc.__cause__ is not None:
        return type(exc.__cause__).__name__
    return type(exc).__name__


def _first_line(exc: BaseException | str) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _header(out: _Out, name: str) -> str:
    for k, v in out.headers or []:
        if k == name:
            return v.decode(errors="replace")
    return ""


def _sample_ids(batch: Any) -> list[str]:
    if isinstance(batch, SampleBatch):
        return batch.sample_ids()
    if isinstance(batch, PromptBatch):
        return list(batch.prompt_id)
    return []


def _subset(batch: Any, lo: int, hi: int) -> Any:
    """Samples [lo, hi) of ``batch`` as a batch called ``f"{batch_id}~{lo}-{hi}"``."""
    batch_id = f"{batch.batch_id}~{lo}-{hi}"
    if isinstance(batch, SampleBatch):
        return batch.select(list(range(lo, hi)), batch_id=batch_id)
    return PromptBatch(batch_id=batch_id, prompt_id=batch.prompt_id[lo:hi], prompt=batch.prompt[lo:hi],
                       label=batch.label[lo:hi], reference=batch.reference[lo:hi])


def _key(batch: Any) -> bytes:
    group_ids = getattr(batch, "group_id", None)
    return (group_ids[0] if group_ids else batch.batch_id).encode()
