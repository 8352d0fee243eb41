"""The commit group of a stage replica: confirm the outputs of the records in hand, account, commit, release.

Commit protocol, per input record (one record = one micro-batch; polled up to
``kafka.max_poll_records`` at a time), with step 3 done for a *commit group*: consecutive records,
at most ``MAX_COMMIT_GROUP`` of them, closed once its first record has waited ``CONFIRM_GROUP_MAX_S``
or a poll finds nothing more (so a backlog pays one flush and one statistics round trip per group), and
step 4 for every confirmed record at once when the oldest of them has waited ``COMMIT_GROUP_MAX_S``
(0.5 s) or there are ``MAX_COMMIT_GROUP`` of them, or at a stop, a rewind or a rebalance (so records arriving one by one, the steady state, pay one
commit per 0.5 s instead of one each):

1. A record larger than ``max_record_bytes`` is dead-lettered without being decoded. Otherwise its
   bytes are decoded inside the stage (never in the fetcher), under try/except.
2. ``process(batch, ctx)`` returns zero or more output batches (Redis updates inside it are
   idempotent by batch id, so a redelivered record changes nothing twice). Outputs are encoded
   (and so validated) right away: an output that breaks the contract is a failure of ``process``.
3. Every output and dead letter is handed to the producer as soon as its record is done; at the
   end of the group the producer is flushed once and every send future ``.get()``-ed (``flush()``
   does not raise per-record errors). A record with a failed future is sent again the per-record
   way (retries, then the dead-letter fallbacks of stages/deadletters.py) before anything is
   committed. Then each record's statistics go to the run state.
3b. The run state's writes of the group are acknowledged by a replica (``state.sync_writes``: ``WAIT``,
   expstream/state/durability.py). When they may be lost (their primary failed over first) or no
   replica acknowledged them in time, nothing is committed and the records are processed again.
4. ``offset + 1`` of the group's last record of each partition is committed, only if this consumer
   still owns the partition; every partition of the group in one OffsetCommit request. Nothing is committed before every output of every record up to it is
   acknowledged: the same at-least-once guarantee as a commit per record; a crash redoes the
   group at most (downstream is idempotent by batch id).
   Rebalance listeners run on kafka-python's IO thread, so they only record revocations
   (stages/revocations.py); the loop acts on them.
5. The stage's optional ``committed(batches, ctx)`` hook gets the decoded batches of the records
   now committed (a record whose partition's commit failed waits for the next commit that
   succeeds on its partition): run state that only a redelivery could still need is released
   there (advantage frees settled group buffers, generate marks its admissions delivered). A crash
   between 4 and 5 leaves that state to its TTL; nothing is lost or doubled.

Steps 1-2 (and the hand-over of step 3) are the runner's worker (stages/working.py); this module
does the rest of 3, and 4-5: the confirmation and the hook on the confirm thread, the commit on the
main thread (the consumer is not thread-safe). Committing retries like the work does; a commit
refused because the group rebalanced (``CommitFailedError``) is logged and skipped: the new owner
gets the record again and processing is idempotent.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition
from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

from expstream.errors import ExpstreamError, ShutdownRequested
from expstream.kafka.clients import confirm_all, flush
from expstream.kafka.letters import H_STAGE, header_value
from expstream.observe.metrics import StageMetrics
from expstream.retry import Attempt, Policy, retry
from schemas import PromptBatch
from stages.context import StageContext
from stages.deadletters import DeadLetters
from stages.pausing import PausedPolling
from stages.revocations import RevocationTracker
from stages.sending import RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_START_S, SLOW_SEND_WARN_S, Out
from stages.slowwatch import SlowWatch
from stages.splitting import first_line

__all__ = ["COMMIT_GIVE_UP_S", "COMMIT_GROUP_MAX_S", "CONFIRM_GROUP_MAX_S", "MAX_COMMIT_GROUP", "CommitGroup", "Done", "Pending"]

# Why 16 and 50 ms: consecutive records are flushed and confirmed together, their statistics written in one
# round trip (the per-record round trips are what a hop costs), but a group closes after 16 records, once
# its first record has waited 50 ms or when a poll finds nothing, so the run state (status, accounting)
# hears of a record within ~50 ms of its outputs.
MAX_COMMIT_GROUP = 16
CONFIRM_GROUP_MAX_S = 0.05
# Why 0.5 s: the offsets of confirmed records are committed once the oldest of them has waited 0.5 s (or at
# a stop, a rewind, a rebalance), not at every group: in the steady state records arrive one by one (every
# stage is faster than generate), and a commit per record was a third of a hop's CPU. Measured with
# bench/runner_cpu.py --trickle-ms 50 --partitions 8 (a pass-through replica, one record every ~55 ms):
# 2.95-3.00 ms of CPU per record committing each group, 2.47-2.59 committing per 0.5 s (bench/README.md).
# A crash or a rebalance redoes at most 0.5 s of confirmed records (downstream is idempotent by batch id).
# A slow stage's record is still committed 0.5 s after it is done, while its successor is in work
# (stages/runner.py).
COMMIT_GROUP_MAX_S = 0.5
# Why 60 s: a commit that cannot reach the broker for a minute is given up (logged); the record is
# redelivered after the next rebalance, and a later commit on the partition covers it anyway.
COMMIT_GIVE_UP_S = 60.0
COMMIT_RETRY = Policy(RETRY_BACKOFF_START_S, RETRY_BACKOFF_MAX_S, COMMIT_GIVE_UP_S)
# Commit errors that mean "the group moved on": retrying cannot succeed, redelivery covers it.
REBALANCED = tuple(
    t for t in (getattr(kafka_errors, n, None) for n in (
        "CommitFailedError", "IllegalGenerationError", "UnknownMemberIdError", "RebalanceInProgressError",
        "FencedMemberEpochError", "StaleMemberEpochError"))
    if isinstance(t, type)
)  # fmt: skip
# a group's offsets to commit: partition -> (its last record's offset, topic[partition]@offset, batch id)
Offsets = dict[TopicPartition, tuple[int, str, "str | None"]]
CommitFn = Callable[[Offsets], set[TopicPartition]]


@dataclasses.dataclass
class Done:
    """What the worker did with one record."""

    batch_id: str | None
    samples: int
    outputs: int
    letters: int
    seconds: float


@dataclasses.dataclass
class Pending:
    """One record worked on, its outputs and letters handed to the producer, not yet confirmed."""

    tp: TopicPartition
    record: Any
    where: str  # topic[partition]@offset, for log lines
    batch: Any  # the decoded batch; None when the record could not be decoded
    outputs: list[Out]
    letters: list[Out]
    sent: list | None  # (record, future) pairs of outputs + letters; None: the producer refused them at once
    started: float  # time.monotonic() when the work began

    @property
    def batch_id(self) -> str | None:
        return self.batch.batch_id if self.batch is not None else None


@dataclasses.dataclass
class Clients:
    """What a commit group works with, made once the replica is connected and subscribed."""

    consumer: Any
    producer: Any
    tracker: RevocationTracker
    pausing: PausedPolling
    confirmer: concurrent.futures.ThreadPoolExecutor  # the confirm thread (flush, confirm, statistics, hook)


class CommitGroup:
    """The open commit group of one replica and what happens when it closes (steps 3-5)."""

    def __init__(self, ctx: StageContext, log: logging.Logger, clients: Clients, dead_letters: DeadLetters, *,
                 metrics: StageMetrics | None, slow: SlowWatch, commit: CommitFn | None = None,
                 committed: Callable[[list, StageContext], None] | None = None,
                 stopping: Callable[[], bool], fault: Callable[[str], None],
                 stage_rows: Callable[[str, dict[str, int]], dict[str, tuple]] | None = None) -> None:
        """
        Args:
            ctx: the stage's context.
            log: the stage's logger.
            clients: consumer, producer, revocation tracker, paused polling, confirm thread.
            dead_letters: the per-record way for a record whose sends failed.
            metrics: the replica's metrics, or None.
            slow: warns about a broker slow to acknowledge.
            commit: commits the group's partitions, one request (default :meth:`commit_offsets`; the runner hands in
                its own seam so a test can count or refuse commits).
            committed: the stage's hook after a commit (step 5), or None.
            stopping: true once the replica is asked to stop.
            fault: the fault-injection point hook (expstream/faults.py).
            stage_rows: a chain's statistics per inner stage (stages/chain.py ``Chain.rows``): given a
                record's batch id and its dead-lettered samples per failing stage, each stage's row;
                None: the record's row goes under this stage's name.
        """
        self.ctx, self.log, self.stage, self.dead_letters = ctx, log, ctx.stage.name, dead_letters
        self.consumer, self.producer, self.tracker = clients.consumer, clients.producer, clients.tracker
        self.pausing, self.confirmer = clients.pausing, clients.confirmer
        self.metrics, self.slow, self.committed, self.stopping, self.fault = metrics, slow, committed, stopping, fault
        self.commit = commit or self.commit_offsets
        self.stage_rows = stage_rows
        self.records: list[Pending] = []  # the open group: worked on, not yet confirmed
        self.confirmed: list[tuple[Pending, Done]] = []  # confirmed, offsets not committed yet
        # batches handled but not known committed yet, per partition (only kept with a hook)
        self.uncommitted: dict[TopicPartition, list[Any]] = {}
        self.handled = 0
        self.commits_skipped = 0
        self.redo_from: dict[TopicPartition, int] = {}  # partitions sent back by redo: the offset read again

    def age_s(self) -> float:
        """How long the open group's first record has waited (0 for an empty group)."""
        return time.monotonic() - self.records[0].started if self.records else 0.0

    def closes(self) -> bool:
        """Whether the open group is full or old (MAX_COMMIT_GROUP, CONFIRM_GROUP_MAX_S)."""
        return len(self.records) >= MAX_COMMIT_GROUP or self.age_s() >= CONFIRM_GROUP_MAX_S

    def commit_wait_s(self) -> float | None:
        """How long until the confirmed records' offsets are due for their commit (None: nothing confirmed)."""
        if not self.confirmed:
            return None
        return max(0.0, COMMIT_GROUP_MAX_S - (time.monotonic() - self.confirmed[0][0].started))

    def finish(self, commit: bool = False) -> None:
        """Step 3 for the records in hand (main thread): one flush, every future checked (a record whose
        sends failed goes the per-record way: retries, then the dead-letter fallbacks), the statistics,
        the durability wait. Then steps 4-5 (:meth:`commit_confirmed`) when ``commit`` or once the oldest
        confirmed record has waited COMMIT_GROUP_MAX_S. A stop request while confirming leaves the
        records uncommitted (they are redelivered)."""
        if self.records:
            items = self.records[:]
            self.records.clear()
            fut = self.confirmer.submit(self.confirm, items)
            self.pausing.wait(fut, items[-1].where)
            try:
                dones = fut.result()
            except ShutdownRequested as exc:
                self.log.warning("stage %s %s: %s; not committing %d records (they are redelivered)", self.stage,
                                 items[0].where, exc, len(items))
                dones = None
            except ExpstreamError as exc:  # the durability wait: the group's state writes are not known on a replica
                self.redo(items, exc)
                dones = None
            if dones is not None:
                stale = self.stale_after_redo(items)
                self.confirmed += [(p, d) for p, d in zip(items, dones, strict=True) if id(p) not in stale]
        if self.confirmed and (commit or self.commit_wait_s() == 0.0 or len(self.confirmed) >= MAX_COMMIT_GROUP):
            self.commit_confirmed()

    def commit_confirmed(self) -> None:
        """Steps 4-5 for every confirmed record: one commit of the highest offset per partition (all
        partitions in one request), the hook, the per-record accounting and log line."""
        items, self.confirmed = self.confirmed, []
        if not items:
            return
        last: dict[TopicPartition, Pending] = {}
        for p, _ in items:  # offsets rise within a partition: the last one of each is the highest
            last[p.tp] = p
            if self.committed is not None and p.batch is not None:
                self.uncommitted.setdefault(p.tp, []).append(p.batch)
        # every partition in one OffsetCommit request (records come round robin over the partitions: a
        # request per partition was a request per record again)
        done = self.commit({tp: (p.record.offset, p.where, p.batch_id) for tp, p in last.items()})
        committed = [tp for tp in last if tp in done]
        self.fault("after_commit")
        if self.committed is not None:
            self.after_commit([b for tp in committed for b in self.uncommitted.pop(tp, [])], items[-1][0].where)
        for p, d in items:
            self.handled += 1
            if self.metrics is not None:
                self.observe(d, p.tp)
            if d.batch_id is not None:
                self.log.info("stage %s %s batch=%s: %d samples -> %d records, %d dead letters in %.3fs",
                              self.stage, p.where, d.batch_id, d.samples, d.outputs, d.letters, d.seconds)

    def redo(self, items: list[Pending], exc: ExpstreamError) -> None:
        """Step 3b failed: the state writes of ``items`` may be lost (their primary failed over before a
        replica acknowledged them) or no replica acknowledged them in time. Nothing is committed; each
        partition is moved back to the group's first record, so the records are processed again (the
        state updates are idempotent by id, and downstream readers drop the repeated outputs)."""
        first: dict[TopicPartition, Pending] = {}
        for p in items:
            first.setdefault(p.tp, p)
        if self.metrics is not None:
            self.metrics.retry("state_writes_lost")
        for tp, p in first.items():
            if self.tracker.owns(tp):
                self.consumer.seek(tp, p.record.offset)
                self.redo_from[tp] = p.record.offset
        self.log.error("stage %s %s batch=%s: %s: %s; not committing %d records, processing them again from %s",
                       self.stage, items[0].where, items[0].batch_id, type(exc).__name__, first_line(exc),
                       len(items), ", ".join(p.where for p in first.values()))

    def stale_after_redo(self, items: list[Pending]) -> set[int]:
        """Records worked on before a redo's seek reached them (a successor already in work when the group
        was sent back): neither committed nor counted, since their partition is read again from the redo
        offset; a commit past it would cover the records processed again before they are. The record at
        the redo offset, read again, ends this. Returns the ``id`` of each stale Pending."""
        stale: set[int] = set()
        for p in items:
            start = self.redo_from.get(p.tp)
            if start is None:
                continue
            if p.record.offset == start:
                del self.redo_from[p.tp]
            elif p.record.offset > start:
                stale.add(id(p))
        return stale

    def after_commit(self, batches: list, where: str) -> None:
        """Step 5: the stage's ``committed`` hook on the confirm thread (the main thread keeps polling).
        A failure is logged and dropped: what the hook would release stays until its TTL."""
        if not batches:
            return

        def run() -> None:
            try:
                self.committed(batches, self.ctx)
            except ExpstreamError as exc:
                self.log.warning("stage %s %s: after the commit of %d records (batches %s..%s), releasing their "
                                 "run state failed (%s: %s); it stays until it expires", self.stage, where,
                                 len(batches), batches[0].batch_id, batches[-1].batch_id, type(exc).__name__,
                                 first_line(exc))
            except Exception:  # a bug in the hook: loud, but it never costs a record
                self.log.exception("stage %s %s: the committed hook failed after the commit of %d records",
                                   self.stage, where, len(batches))

        self.pausing.wait(self.confirmer.submit(run), where)

    def observe(self, done: Done, tp: TopicPartition) -> None:
        """Per-record metrics after the commit; the lag reads the consumer's own fetch metadata (no round trip)."""
        m = self.metrics
        m.records.inc()
        m.samples.inc(done.samples)
        m.batch_seconds.observe(done.seconds)
        if done.letters:
            m.dead_letters.inc(done.letters)
        with contextlib.suppress(Exception):  # measurement only
            lag = 0
            for part in self.consumer.assignment():
                if part.topic == tp.topic:
                    high = self.consumer.highwater(part)
                    if high is not None:
                        lag += max(0, int(high) - int(self.consumer.position(part)))
            m.lag(tp.topic, lag)

    def confirm(self, items: list[Pending]) -> list[Done]:
        """Confirm thread: flush once, check each record's futures (the per-record way for one that
        failed), then each record's statistics."""
        started = time.monotonic()
        timeout_s = self.ctx.topology.kafka.produce_timeout_s
        # a flush only when an output is still unacknowledged (after linger_ms they usually all are: the
        # flush then only woke the producer's thread)
        if any(not fut.is_done for p in items if p.sent for _, fut in p.sent):
            with self.slow.watch(self.log, "stage %s %s: still waiting for the broker to acknowledge the "
                                  "outputs of %d records after %.0fs (broker unreachable or paused?)",
                                  self.stage, items[0].where, len(items), SLOW_SEND_WARN_S):
                flush(self.producer, timeout_s)
        for p in items:
            what = f"{p.where} batch={p.batch_id}"
            try:
                if p.sent is None:
                    raise ExpstreamError("not handed to the producer")
                confirm_all(p.sent, max(timeout_s - (time.monotonic() - started), 0.0))
            except ExpstreamError as exc:  # again the per-record way: retries, then dead-letter fallbacks
                if self.stopping():  # as a retry would: the group stays uncommitted (redelivered)
                    raise ShutdownRequested(f"stop requested while the outputs of {what} were unconfirmed "
                                            f"({first_line(exc)})") from exc
                self.log.warning("stage %s %s: sending %d records failed with %s %s: %s; sending them again "
                                 "record by record", self.stage, what, len(p.outputs) + len(p.letters),
                                 "retriable" if exc.retriable else "non-retriable", type(exc).__name__,
                                 first_line(exc))
                self.dead_letters.deliver(p.record, p.where, p.outputs, p.letters, p.batch)
                if exc.retriable:
                    self.log.info("stage %s %s: sent after retrying record by record (%.1fs); broker reachable "
                                  "again", self.stage, what, time.monotonic() - started)
            else:
                self.dead_letters.after_delivery(p.letters, p.where, what)
        if self.metrics is not None:
            self.metrics.send_seconds.observe(time.monotonic() - started)
        self.fault("after_produce")
        dones, rows = [], {}
        for p in items:
            done, row = self.account(p)
            dones.append(done)
            if row is None:
                continue
            per_stage = {self.stage: row} if self.stage_rows is None else self.stage_rows(row[0], self.dead_by_stage(p))
            for stage, r in per_stage.items():
                rows.setdefault(stage, []).append(r)
        for stage, stage_rows in rows.items():
            try:  # the group's statistics in one Redis round trip (per stage of a chain), before the commit
                self.ctx.state.record_batches(stage, stage_rows)
            except ExpstreamError as exc:  # statistics only
                self.log.warning("stage %s %s: stage time and sample accounting of %d records not recorded: %s",
                                 stage, items[0].where, len(stage_rows), exc)
        # 3b: a replica has every state write of these records before their offsets are committed (WAIT;
        # StateWritesLost or StateUnavailableError: they are processed again, see redo)
        t0 = time.monotonic()
        self.ctx.state.sync_writes()
        if self.metrics is not None:
            self.metrics.state_wait_seconds.observe(time.monotonic() - t0)
        return dones

    def dead_by_stage(self, p: Pending) -> dict[str, int]:
        """Samples of ``p``'s letters per stage that failed (the letters' ``stage`` header), for a chain."""
        per = self.ctx.topology.generate.n_samples_per_prompt if isinstance(p.batch, PromptBatch) else 1
        dead: dict[str, int] = {}
        for lt in p.letters:
            stage = header_value(lt.headers, H_STAGE) or self.stage
            rows = len(lt.batch) if lt.batch is not None else len(p.batch) if p.batch is not None else 0
            dead[stage] = dead.get(stage, 0) + rows * per
        return dead

    def account(self, p: Pending) -> tuple[Done, tuple | None]:
        """Statistics of one record: the time of every record the stage did its work on, including
        those parked in a group buffer (no output yet), samples the record's own or, for a prompt
        record, the samples generated from it; and the accounting (status, summary.json): in = out
        + dead + dropped + in flight. Returns the record's row for ``state.record_batches``."""
        batch, outputs, letters = p.batch, p.outputs, p.letters
        seconds = time.monotonic() - p.started
        samples, row = 0, None
        # a generation that went back to the input topic (stages/context.py BackToInput) is accounted once, by
        # the record that finishes it (the flow of a batch id counts once: the first row would stay in flight)
        if batch is not None and not any(o.topic == self.ctx.stage.input for o in outputs):
            samples = sum(o.samples for o in outputs) if isinstance(batch, PromptBatch) else len(batch)
            per = self.ctx.topology.generate.n_samples_per_prompt if isinstance(batch, PromptBatch) else 1
            flow = {"in": len(batch) * per, "out": sum(o.samples for o in outputs),
                    "dead": sum(len(lt.batch) * per if lt.batch is not None else len(batch) * per for lt in letters)}
            row = (batch.batch_id, flow, seconds if (outputs or not letters) else None, samples)
        return Done(p.batch_id, samples, len(outputs), len(letters), seconds), row

    def commit_offsets(self, offsets: Offsets) -> set[TopicPartition]:
        """Step 4: commit ``offset + 1`` of each partition this consumer still owns, in one request (main thread).

        Args:
            offsets: partition -> (its group's last record, topic[partition]@offset and batch id for the logs).
        Returns:
            The partitions committed. One revoked meanwhile, refused in a rebalance or given up after
            COMMIT_GIVE_UP_S is not (each counted in :attr:`commits_skipped`; its records are redelivered).
        """
        timeout_ms = self.ctx.topology.kafka.request_timeout_ms
        retries = [0]
        todo = dict(offsets)
        last_where, last_batch = next(reversed(todo.values()))[1:]

        def commit() -> set[TopicPartition]:
            for tp in [tp for tp in todo if not self.tracker.owns(tp)]:
                self.commits_skipped += 1
                _, where, batch_id = todo.pop(tp)
                self.log.warning("stage %s %s batch=%s: partition revoked meanwhile; not committing (the new owner "
                                 "re-processes it, idempotently)", self.stage, where, batch_id)
            if not todo:
                return set()
            try:
                with self.slow.watch(self.log, "stage %s %s batch=%s: commit of %d partitions still waiting for the "
                                     "broker after %.0fs (broker unreachable or paused?)", self.stage, last_where,
                                     last_batch, len(todo), SLOW_SEND_WARN_S):
                    t0 = time.monotonic()
                    self.consumer.commit({tp: OffsetAndMetadata(off + 1, "", -1) for tp, (off, _, _) in todo.items()},
                                         timeout_ms=timeout_ms)
                    if self.metrics is not None:
                        self.metrics.commit_seconds.observe(time.monotonic() - t0)
            except REBALANCED as exc:
                self.commits_skipped += len(todo)
                self.log.warning("stage %s %s batch=%s: commit of %d partitions refused, the group rebalanced (%s); "
                                 "their records are redelivered to the partitions' owners and re-processed "
                                 "idempotently", self.stage, last_where, last_batch, len(todo), type(exc).__name__)
                return set()
            if retries[0]:
                self.log.info("stage %s %s batch=%s: committed after %d retries", self.stage, last_where,
                              last_batch, retries[0])
            return set(todo)

        def on_retry(a: Attempt) -> None:
            retries[0] = a.number
            self.log.warning("stage %s %s batch=%s: commit failed (%s: %s; broker unreachable?); retry %d in "
                             "%.1fs", self.stage, last_where, last_batch, type(a.exc).__name__, a.exc, a.number,
                             a.delay_s)

        def give_up(a: Attempt) -> set[TopicPartition]:
            self.commits_skipped += len(todo)
            self.log.error("stage %s %s batch=%s: commit failed for %.0fs (%s: %s); giving up on it, the "
                           "records are redelivered after the next rebalance or restart", self.stage,
                           last_where, last_batch, a.waited_s, type(a.exc).__name__, a.exc)
            return set()

        # the backoff is spent polling with paused partitions, so the consumer stays in its group
        return retry(commit, policy=COMMIT_RETRY, retriable=lambda exc: isinstance(exc, kafka_errors.KafkaError),
                     on_retry=on_retry, on_give_up=give_up, stop=lambda: self.stopping(),
                     sleep=lambda seconds: self.pausing.sleep(seconds, lambda: self.stopping()))
