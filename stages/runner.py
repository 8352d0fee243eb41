"""The one Kafka loop every stage runs in: consume -> decode -> process -> produce -> commit.

:class:`StageRunner` keeps the loop and the replica's lifecycle (connect, join the group while the
stage's ``setup`` runs, poll, heartbeats, signals, stop) and hands the rest to
plain collaborators, one concern each (the seams of quixstreams' Checkpoint, PausingManager and
ProcessingContext):

* stages/commitgroup.py: the commit group (confirm, account, commit, the ``committed`` hook), with
  the numbered commit protocol in its docstring;
* stages/working.py: one record decoded, processed, handed to the producer (and the fault plan);
* stages/splitting.py: bisecting a failing batch (pure functions, shared with replay);
* stages/deadletters.py: dead letters and their fallbacks; stages/sending.py: sends and work retries;
* stages/polling.py: polls of up to kafka.max_poll_records; stages/pausing.py: pause/poll/resume while a record is in
  hand; stages/revocations.py: the rebalance listener; stages/rewinding.py: the replica's side of
  the rewind handshake.

Long model work. Steps 1-3 run on a worker thread, a group's confirmation on a confirm thread (so
that a group whose first record has waited ``CONFIRM_GROUP_MAX_S`` is confirmed, and confirmed records
waiting ``COMMIT_GROUP_MAX_S`` are committed, while the next record is still in work); the main thread owns the consumer (which is not thread-safe).
When the worker takes longer than a short grace, the main thread pauses every assigned partition and
keeps polling so that kafka-python does not drop the group membership after
``max_poll_interval_ms``; a partition assigned meanwhile is paused too and anything it returned is
rewound with ``seek``. When the work is done, everything paused is resumed; the commit is made only
if the record's partition is still ours, and if the assignment changed meanwhile, the fetch position
of the partition is set past the record so that it is not fetched a second time from the (older)
committed offset.

Connecting at start and polling retry like the work does (stages/sending.py). SIGTERM/SIGINT finish
the micro-batch in hand, commit, and exit 0; a stop during a retry backoff abandons the record
uncommitted (it is redelivered) and exits 0.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from expstream.cpuslice import set_thread_slice
from expstream.errors import BrokerUnavailableError, ExpstreamError, ShutdownRequested
from expstream.faults import RUNNER_POINTS, fault_plan
from expstream.kafka.clients import (
    make_producer,
    make_runner_consumer,
)
from expstream.kafka.topics import dlq_topic, stage_group
from expstream.observe.metrics import StageMetrics
from expstream.observe.metrics import enabled as metrics_on
from expstream.observe.timeline import mark_stage
from expstream.retry import retry
from stages.assigning import assign_share
from stages.commitgroup import CONFIRM_GROUP_MAX_S, Clients, CommitGroup, Pending
from stages.context import StageContext
from stages.deadletters import (
    DeadLetters,
)
from stages.pausing import PausedPolling
from stages.polling import POLL_TIMEOUT_MS, Poller
from stages.revocations import RevocationTracker
from stages.rewinding import ReplicaRewind
from stages.sending import (
    SLOW_SEND_WARN_S,
    WORK_RETRY,
    Sender,
)
from stages.slowwatch import SlowWatch
from stages.splitting import (
    first_offsets,
)
from stages.working import Worker

# Why 2 s: Redis heartbeats say the replica is alive; often enough for a dashboard, cheap for Redis.
HEARTBEAT_INTERVAL_S = 2.0
ProcessFn = Callable[[Any, StageContext], list]
CommittedFn = Callable[[list, StageContext], None]
class StageRunner:
    """Runs ``process`` for one stage replica against Kafka until stopped."""

    def __init__(self, ctx: StageContext, process: ProcessFn, bootstrap: str,
                 max_records: int | None = None, max_record_bytes: int | None = None,
                 committed: CommittedFn | None = None,
                 stage_rows: Callable[[str, dict[str, int]], dict[str, tuple]] | None = None,
                 produced_by: str | None = None, label: str | None = None, *, group_suffix: str = "",
                 metrics: bool = True, stop: threading.Event | None = None,
                 assignment: tuple[int, int] | None = None) -> None:
        """``group_suffix``, ``metrics=False`` and ``stop`` (shared with another runner) are for a second
        runner in one replica: generate's consumer of the turns topic (expstream/launch/replica.py).
        ``assignment`` ``(i, n)``: take the input partitions ``p % n == i`` by hand instead of joining the
        group (stages/assigning.py; ``expstream stage --assign i/n``)."""
        self.ctx = ctx
        # a chain (stages/chain.py): its statistics per inner stage, and the last stage names the outputs
        self.stage_rows, self.produced_by = stage_rows, produced_by
        self.process = process
        self.committed = committed  # the stage's hook after a commit (step 5 of the module docstring)
        self.bootstrap = bootstrap
        self.max_records = max_records
        self.max_record_bytes = int(max_record_bytes or ctx.topology.kafka.max_request_size)
        self._stop = stop if stop is not None else threading.Event()
        self.stage = ctx.stage
        # a chain's log lines come from its unit (``expstream.stage.postprocess+advantage``)
        self.log = logging.getLogger(f"expstream.stage.{label or self.stage.name}")
        self.group_id = stage_group(ctx.run_id, self.stage.name) + group_suffix
        self.group_suffix = group_suffix  # also on its rewind acknowledgements (stages/rewinding.py)
        self.assignment = assignment
        self.dlq_topic = dlq_topic(self.stage.input)
        self.fault = fault_plan(self.stage.name, RUNNER_POINTS)
        # counters (read by tests and the final log line)
        self.longest_busy_s = 0.0
        self.producer: Any = None
        self.consumer: Any = None
        self.sender: Sender | None = None  # made once the producer is there (run)
        self.dead_letters: DeadLetters | None = None
        self.worker: Worker | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # decode, process, hand over
        self._confirmer: concurrent.futures.ThreadPoolExecutor | None = None  # flush, confirm, statistics
        self._closing = threading.Event()
        self.pausing: PausedPolling | None = None
        self.rewinding: ReplicaRewind | None = None  # made once the consumer is subscribed
        # Prometheus metrics (expstream/observe/metrics.py); served from run(); None when switched off
        self.metrics: StageMetrics | None = (StageMetrics(label or self.stage.name, str(ctx.replica_id))
                                             if metrics_on() and metrics else None)
        ctx.metrics = self.metrics
        self._join_thread: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._assigned_marked = False
        self._first_marked = False
        self.group: CommitGroup | None = None  # the open commit group (made in run)
        self._setup_done = threading.Event()
        self._slow = SlowWatch(SLOW_SEND_WARN_S, name=f"slow-watch-{self.stage.name}")

    def _mark(self, event: str) -> None:
        """A start-up mark of this replica (expstream/observe/timeline.py; summary.json ``startup``)."""
        mark_stage(event, stage=self.stage.name, replica=self.ctx.replica_id)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def rewound(self) -> int:
        """Records a poll returned for a partition assigned during a pause, rewound (stages/pausing.py)."""
        return self.pausing.rewound if self.pausing is not None else 0

    @property
    def handled(self) -> int:
        """Records confirmed and committed (or given up on) by the commit group."""
        return self.group.handled if self.group is not None else 0

    @property
    def commits_skipped(self) -> int:
        """Commits not made: partition revoked, rebalanced, or the broker away too long."""
        return self.group.commits_skipped if self.group is not None else 0

    @property
    def split_batches(self) -> int:
        """Batches bisected to isolate their bad samples (stages/splitting.py)."""
        return self.worker.split_batches if self.worker is not None else 0

    @property
    def dead_lettered(self) -> int:
        """Letters sent (stages/deadletters.py)."""
        return self.dead_letters.dead_lettered if self.dead_letters is not None else 0

    @property
    def rewinds(self) -> int:
        """Rewind requests this replica left its group for (stages/rewinding.py)."""
        return self.rewinding.rewinds if self.rewinding is not None else 0

    @property
    def stop_event(self) -> threading.Event:
        """Set when this replica is asked to stop (a second runner of the replica shares it)."""
        return self._stop

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

    @property
    def replica_key(self) -> str:
        """This process's name in heartbeats and rewind acknowledgements: ``<replica>:<pid>``."""
        return f"{self.ctx.replica_id}:{os.getpid()}"

    def _subscribe(self) -> None:
        self.tracker = RevocationTracker()
        if self.assignment is None:
            self.consumer.subscribe([self.stage.input], listener=self.tracker)
        else:  # no group join: this replica's share of the partitions, given by the run (stages/assigning.py)
            assign_share(self.consumer, self.tracker, self.stage.input, self.assignment, self.log)
        self.poller = Poller(self.consumer, self.tracker, self.log, stage=self.stage, group_id=self.group_id,
                             bootstrap=self.bootstrap, stop=self._stop, on_assigned=self._on_assigned)
        self.pausing = PausedPolling(self.consumer, self.poller.poll, self.tracker.owns, self.log, self.stage.name,
                                     self.ctx.topology.kafka.max_poll_interval_ms)
        self.rewinding = ReplicaRewind(self.ctx, self.consumer, self.pausing, self.replica_key + self.group_suffix,
                                       self.log, lambda: self.stop_requested)

    def start_joining(self) -> None:
        """Connect and join the consumer group on a thread while the stage's ``setup`` loads its models.

        A first group join takes seconds on its own (the broker's initial rebalance delay: 3 s on
        Tansu and on Apache Kafka's defaults), model loading takes seconds too: done one after the
        other they add up before the first record. The thread is the consumer's only user until
        :meth:`run` takes it over (the consumer is not thread-safe): it polls with every assigned
        partition paused (stages/pausing.py: nothing is consumed, anything returned is rewound), so
        the membership is kept however long ``setup`` takes, then resumes them and ends.
        """
        def join() -> None:
            try:
                if not self._connect():
                    return
                self._subscribe()
                while not self._setup_done.is_set() and not self.stop_requested:
                    self.pausing.poll_paused()
                self.pausing.resume_all()
            except BaseException as exc:  # noqa: BLE001 - handed to run(), which raises it as before
                self._join_error = exc

        self._join_thread = threading.Thread(target=join, name=f"join-{self.stage.name}", daemon=True)
        self._join_thread.start()

    def run(self) -> int:
        self._mark("setup_done")  # run() is called once the stage's setup (models) is done
        if self.metrics is not None and self.metrics.port is None:
            try:
                self.metrics.port = self.metrics.serve()
            except OSError as exc:  # observability must never stop a stage
                self.log.warning("stage %s: metrics endpoint not started: %s", self.stage.name, exc)
        if self._join_thread is not None:  # joined (or joining) while setup ran: take the consumer over
            self._setup_done.set()
            self._join_thread.join()
            if self._join_error is not None:  # e.g. a broker that refuses the client: as if run() connected
                raise self._join_error
            if self.consumer is None or self.pausing is None:  # stopped while connecting
                self._close()
                self._log_stopped()
                return 0
        else:
            if not self._connect():
                self._log_stopped()
                return 0
            self._subscribe()
        self.sender = Sender(self.ctx, self.producer, self.log, self._stop, self.metrics, self._slow)
        self.dead_letters = DeadLetters(self.ctx, self.log, self.sender)
        self.worker = Worker(self.ctx, self.process, self.log, producer=self.producer, sender=self.sender,
                             dead_letters=self.dead_letters, metrics=self.metrics,
                             max_record_bytes=self.max_record_bytes, fault=self.fault,
                             produced_by=self.produced_by)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage-{self.stage.name}",
                                                                initializer=self._compute_thread_started)
        self._confirmer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"confirm-{self.stage.name}")
        self.group = CommitGroup(self.ctx, self.log, Clients(self.consumer, self.producer, self.tracker, self.pausing,
                                                             self._confirmer), self.dead_letters,
                                 metrics=self.metrics, slow=self._slow, commit=self._commit, committed=self.committed,
                                 stopping=lambda: self.stop_requested, fault=self.worker.maybe_fault,
                                 stage_rows=self.stage_rows)
        self.log.info("stage %s replica %s: consuming %s as group %s, producing %s (max_poll_interval_ms=%d, "
                      "max_record_bytes=%d)", self.stage.name, self.ctx.replica_id, self.stage.input,
                      self.group_id, self.stage.output, self.ctx.topology.kafka.max_poll_interval_ms,
                      self.max_record_bytes)
        threading.Thread(target=self._heartbeats, name=f"heartbeat-{self.stage.name}", daemon=True).start()
        try:
            while not self.stop_requested:
                if (self.group.records or self.group.confirmed) and self.rewinding.due():
                    self.group.finish(commit=True)  # a rewind starts with nothing in hand
                if self.rewinding.maybe_rewind():
                    continue
                self._seek_resume_points()
                polled = self.poller.poll(self._poll_timeout_ms())
                if any(polled.values()):
                    self._handle_polled(polled)
                else:  # nothing more came: confirm what is in hand (and commit the confirmed once due)
                    self.group.finish()
                if self.max_records is not None and self.handled >= self.max_records:
                    break
            self.group.finish(commit=True)  # a stop: the records in hand are done; confirm and commit them
        finally:
            self._closing.set()
            self._close()
        self._log_stopped()
        return 0

    def stop_before_run(self) -> None:
        """A stop that came during ``setup``: end the joining thread, close the clients (the consumer
        leaves its group now, not a session timeout later) and log the replica's last line."""
        self._stop.set()
        self._setup_done.set()
        if self._join_thread is not None:
            self._join_thread.join()
        self._closing.set()
        self._close()
        self._log_stopped()

    def _compute_thread_started(self) -> None:
        """The compute thread's CPU slice (``run.cpu_slice_ms``): this thread only, so that the polling
        thread and the clients' I/O threads keep the kernel's short default (expstream/cpuslice.py)."""
        ms = self.ctx.topology.run.cpu_slice_ms
        if ms and not set_thread_slice(ms):
            self.log.info("stage %s replica %s: run.cpu_slice_ms=%s not applied (it needs Linux >= 6.12 and sched_setattr "
                          "allowed); the kernel's default slice stays", self.stage.name, self.ctx.replica_id, ms)

    def _log_stopped(self) -> None:
        """The replica's last line, on every way out of :meth:`run` that is not an error (also a stop
        that came while it was still connecting: operators and tests look for this line)."""
        self.log.info("stage %s replica %s: stopped after %d records (%d dead letters, %d batches split, "
                      "%d records rewound, %d commits skipped, %d rewind requests)", self.stage.name,
                      self.ctx.replica_id, self.handled, self.dead_lettered, self.split_batches, self.rewound,
                      self.commits_skipped, self.rewinds)

    def _connect(self) -> bool:
        """Create the producer and consumer, retrying while the broker is unreachable."""
        cfg = self.ctx.topology.kafka

        def connect() -> bool:
            try:
                self.producer = make_producer(self.bootstrap, cfg, spread=True)
                self.consumer = make_runner_consumer(self.bootstrap, self.group_id, cfg)
            except BrokerUnavailableError:
                if self.producer is not None:
                    self.producer.close(timeout=1)
                    self.producer = None
                raise
            return True

        def wait(seconds: float) -> None:
            if self._stop.wait(seconds):
                raise ShutdownRequested("stop requested while connecting")

        try:
            return retry(connect, policy=WORK_RETRY, retriable=lambda exc: isinstance(exc, BrokerUnavailableError),
                         on_retry=lambda a: self.log.warning(
                             "stage %s: broker %s unreachable (%s); retrying in %.1fs (%.0fs so far)", self.stage.name,
                             self.bootstrap, a.exc, a.delay_s, a.waited_s),
                         sleep=wait)
        except ShutdownRequested:
            return False

    def _close(self) -> None:
        for pool in (self._executor, self._confirmer):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
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
                self.ctx.state.heartbeat(self.stage.name, self.replica_key)
            except ExpstreamError as exc:  # heartbeats are best effort; the work path retries properly
                self.log.warning("stage %s: heartbeat failed: %s", self.stage.name, exc)
            if self._closing.wait(HEARTBEAT_INTERVAL_S):
                return

    # -- polling (main thread only) -------------------------------------------------------------
    def _on_assigned(self) -> None:
        """After a poll with partitions assigned: the start-up mark ``assigned``, once, before any record."""
        if not self.handled and not self._assigned_marked:
            self._assigned_marked = True
            self._mark("assigned")

    def _poll_timeout_ms(self) -> int:
        """How long a poll may wait: POLL_TIMEOUT_MS, or what is left of the open group's time."""
        if self.group.records:  # confirmed at CONFIRM_GROUP_MAX_S
            return max(0, int(1000 * (CONFIRM_GROUP_MAX_S - self.group.age_s())))
        due = self.group.commit_wait_s()  # the confirmed records' commit
        return POLL_TIMEOUT_MS if due is None else min(POLL_TIMEOUT_MS, int(1000 * due))

    def _handle_polled(self, polled: dict) -> None:
        """Add the polled records to the open commit group one by one (see the module docstring, steps
        3-4); the group is confirmed and committed when it is full or old, on a stop, a rewind or a
        rebalance, and when its time is up with no record in hand (the run loop). Records left unhandled because
        the assignment moved get a resume point (stages/revocations.py)."""
        skip = self._seek_resume_points()  # a partition given back: its records here are past its resume point
        todo = [(tp, rec) for tp, records in polled.items() if tp not in skip for rec in records]
        tenure = {tp: self.tracker.tenure(tp) for tp in polled}
        group = self.group.records
        moved = False
        for i, (tp, record) in enumerate(todo):
            if self.stop_requested:
                break
            if self.rewinding.due():
                self.group.finish(commit=True)  # a rewind starts with nothing in hand
                if self.rewinding.maybe_rewind(first_offsets(todo[i:])):
                    return
            if not self.tracker.owns(tp):
                # revoked (maybe only for the rebalance in progress): if it comes back with this fetch
                # position, the position is past this record; it is sought back then
                self.tracker.leave_unhandled(tp, record.offset, tenure[tp])
                continue
            changes = self.tracker.changes
            pending = self._start(tp, record, group)
            if pending is None:  # a stop abandoned it: not committed, redelivered
                break
            group.append(pending)
            if self.tracker.changes != changes:
                # The assignment moved while the record was in hand: a partition we (re)gained fresh
                # fetches from its committed offset, one given back keeps its position past the rest
                # of this poll. This record's partition continues after it; every other record of the
                # poll is left to a resume point, and the loop polls afresh.
                if self.tracker.owns(tp):
                    self.pausing.reposition(tp, record.offset + 1)
                else:
                    self.tracker.leave_unhandled(tp, record.offset + 1, tenure[tp])
                for other, rec in todo[i + 1:]:
                    self.tracker.leave_unhandled(other, rec.offset, tenure[other])
                moved = True
                break
            if self.max_records is not None and self.handled + len(self.group.confirmed) + len(group) >= self.max_records:
                self.group.finish(commit=True)
                return
            if self.group.closes():
                self.group.finish()
        if moved or self.stop_requested:
            self.group.finish(commit=True)
        self._seek_resume_points()

    def _seek_resume_points(self) -> set[TopicPartition]:
        """Seek every partition given back to this replica to its first record not handled (main
        thread; stages/revocations.py). Returns the partitions sought."""
        if not self.tracker.pending:
            return set()
        due = self.tracker.due_seeks()
        for tp, offset in due.items():
            self.log.info("stage %s: %s[%d]: the assignment moved with records of it polled and not "
                          "handled; resuming at %d", self.stage.name, tp.topic, tp.partition, offset)
            self.pausing.reposition(tp, offset)
        return set(due)

    # -- one record -----------------------------------------------------------------------------
    def _start(self, tp: TopicPartition, record: Any, group: list[Pending]) -> Pending | None:
        """Steps 1-3 of one record on the worker (its outputs handed to the producer, not confirmed).

        If this record's work outlasts what is left of the open ``group``'s CONFIRM_GROUP_MAX_S, the
        group is confirmed meanwhile (on the confirm thread), and the confirmed records are committed
        once due (COMMIT_GROUP_MAX_S): a record must not wait for its successor's work, which can take
        minutes (a generate blocked at the staleness bound).
        """
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        if not self._first_marked:
            self._first_marked = True
            self._mark("first_record")
        fut = self._executor.submit(self.worker.work, tp, record, where)
        if group:
            budget = CONFIRM_GROUP_MAX_S - (time.monotonic() - group[0].started)
            if not concurrent.futures.wait([fut], timeout=max(budget, 0.0)).done:
                self.group.finish()
        due = self.group.commit_wait_s()
        if due is not None and not concurrent.futures.wait([fut], timeout=due).done:
            self.group.commit_confirmed()
        busy = self.pausing.wait(fut, where)
        if busy is not None:
            self.longest_busy_s = max(self.longest_busy_s, busy)
        try:
            return fut.result()
        except ShutdownRequested as exc:
            self.log.warning("stage %s %s: %s; not committing it (it is redelivered)", self.stage.name, where, exc)
            return None

    # -- commit (main thread) --------------------------------------------------------------------
    def _commit(self, offsets: dict[TopicPartition, tuple[int, str, str | None]]) -> set[TopicPartition]:
        """Step 4 for a group's partitions, one request (stages/commitgroup.py); the seam a test overrides to
        count or refuse commits. Returns the partitions committed."""
        return self.group.commit_offsets(offsets)
