"""The worker of a stage replica: one record decoded, processed (split on failure), handed to the producer.

Steps 1-2 of the commit protocol (stages/commitgroup.py) and the hand-over of step 3, on the
runner's worker thread; it never touches the consumer. A record with no value, one over
``max_record_bytes`` or undecodable bytes becomes a letter (stages/deadletters.py); ``process`` is
retried alone for its retriable errors (stages/sending.py) and a batch it fails on is bisected
(stages/splitting.py). It also holds the fault-injection plan of the replica (expstream/faults.py):
the k-th record this process works on is what a fault point counts.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from expstream.errors import ExpstreamError, ShutdownRequested
from expstream.faults import FAULT_ENV
from expstream.kafka.clients import send_all
from expstream.kafka.provenance import provenance_headers, read_provenance
from expstream.observe.metrics import StageMetrics
from schemas import PromptBatch, SampleBatch, decode, encode
from schemas.errors import SchemaError
from stages.commitgroup import Pending
from stages.context import BackToInput, Routed, StageContext
from stages.deadletters import (
    DeadLetters,
    ProcessFailure,
    RecordTooLargeError,
    TombstoneRecordError,
    error_class,
)
from stages.sending import Out, Sender, retriable
from stages.splitting import first_line, process_or_split, record_key, sample_errors, sample_ids

__all__ = ["Worker"]

ProcessFn = Callable[[Any, StageContext], list]


class Worker:
    """Decode, process and hand over one record at a time (the runner's worker thread)."""

    def __init__(self, ctx: StageContext, process: ProcessFn, log: logging.Logger, *, producer: Any,
                 sender: Sender, dead_letters: DeadLetters, metrics: StageMetrics | None,
                 max_record_bytes: int, fault: tuple[str, int] | None, produced_by: str | None = None) -> None:
        """
        Args:
            ctx: the stage's context (handed to ``process``).
            process: the stage's ``process(batch, ctx)``.
            log: the stage's logger.
            producer: the replica's producer (outputs and letters are handed to it, not confirmed).
            sender: retries ``process`` on retriable errors.
            dead_letters: builds the letters.
            metrics: the replica's metrics, or None.
            max_record_bytes: records over this are dead-lettered undecoded.
            fault: the replica's fault-injection plan ``(point, k)`` (expstream/faults.py), or None.
            produced_by: the ``producer`` header of the outputs (a chain's last stage), else the stage's name.
        """
        self.ctx, self.process, self.log, self.stage = ctx, process, log, ctx.stage
        self.producer, self.sender, self.dead_letters, self.metrics = producer, sender, dead_letters, metrics
        self.max_record_bytes = max_record_bytes
        self.fault_plan = fault
        self.produced_by = produced_by or self.stage.name
        self.worked = 0  # the fault injection's record count: the k-th record this process works on
        self.split_batches = 0

    def maybe_fault(self, point: str) -> None:
        """SIGKILL this process at ``point`` when the fault plan (``EXPSTREAM_FAULT``) names it and its record."""
        if self.fault_plan is not None and self.fault_plan[0] == point and self.worked >= self.fault_plan[1]:
            self.log.warning("stage %s: fault injection %s: SIGKILL at %s", self.stage.name, FAULT_ENV, point)
            os.kill(os.getpid(), signal.SIGKILL)

    def work(self, tp: TopicPartition, record: Any, where: str) -> Pending:
        """Decode, process (split on failure), hand the outputs and letters to the producer.

        Args:
            tp: the record's partition; record: the consumed record; where: ``topic[partition]@offset``.
        Returns:
            The record in hand for the commit group (its sends not confirmed yet).
        Raises:
            ShutdownRequested when a stop came during a retry (the record is abandoned, redelivered);
            a retriable error still failing after RETRY_GIVE_UP_S.
        """
        started = time.monotonic()
        self.worked += 1
        value = record.value
        size = len(value) if value is not None else 0
        batch = None
        outputs: list[Out] = []
        if value is None:
            exc: Exception = TombstoneRecordError(
                "record has no value (a Kafka tombstone, value=None); there is nothing to decode. Stage input "
                "topics carry one message per record: find the writer of null values")
            letters = [self.dead_letters.letter(record, exc)]
        elif size > self.max_record_bytes:
            exc = RecordTooLargeError(
                f"record is {size} bytes, over max_record_bytes={self.max_record_bytes}; not decoded. Split the "
                "micro-batch upstream (smaller algo.micro_rollout_batch_size) or raise the limit")
            letters = [self.dead_letters.letter(record, exc)]
        else:
            try:
                batch = decode(value)
            except SchemaError as exc:
                letters = [self.dead_letters.letter(record, exc)]
            else:
                if self.metrics is not None:
                    self.observe_input(record, batch)
                outputs, letters = self.sender.retry_work(lambda: self.process_or_split(batch, record, where),
                                                          f"{where} batch={batch.batch_id}", "process")
        self.maybe_fault("before_produce")
        sent = None
        try:  # a refusal here (e.g. a record over max_request_size) is handled at the confirmation
            sent = send_all(self.producer, [(o.topic, o.value, o.key, o.headers) for o in outputs + letters])
        except (ExpstreamError, TypeError):
            pass
        return Pending(tp, record, where, batch, outputs, letters, sent, started)

    def observe_input(self, record: Any, batch: Any) -> None:
        """Record age (now - produced_at_ms header) and staleness (announced - the batch's policy version)."""
        m = self.metrics
        prov = read_provenance(record.headers)
        age = prov.age_s() if prov is not None else None
        if age is not None:
            m.record_age.observe(age)
        version = getattr(batch, "policy_version", None)
        if version is not None:
            m.policy_version.set(version)
            m.staleness.observe(max(0, m.announced(self.ctx.state) - int(version)))

    def run_process(self, batch: Any) -> list[Out]:
        """``process`` + encode; non-retriable failures come out as SchemaError, ExpstreamError or ProcessFailure."""
        try:
            outs = self.process(batch, self.ctx)
            if isinstance(outs, (SampleBatch, PromptBatch, BackToInput)):
                outs = [outs]
            return [self.out(o) for o in outs]
        except (SchemaError, ExpstreamError):
            raise
        except Exception as exc:  # a bug or a bad sample: data routed to the DLQ, never swallowed
            # the class travels in the error_class header; the message gets a short traceback
            raise ProcessFailure(f"{exc}\n{traceback.format_exc(limit=6)}") from exc

    def out(self, o: Any) -> Out:
        """One output of ``process`` as a record to send: to the output topic; a Routed one to its own topic
        (the environment stage's unfinished episodes, to turns); a BackToInput one (a partial generation, not
        samples yet) back to the stage's input topic."""
        topic = o.topic if isinstance(o, Routed) else self.stage.input if isinstance(o, BackToInput) else self.stage.output
        batch = o.batch if isinstance(o, (Routed, BackToInput)) else o
        return Out(topic, encode(batch), record_key(batch),
                   headers=provenance_headers(self.produced_by, getattr(batch, "policy_version", 0)),
                   samples=0 if isinstance(o, BackToInput) or not isinstance(batch, SampleBatch) else len(batch))

    def process_or_split(self, batch: Any, record: Any, where: str) -> tuple[list[Out], list[Out]]:
        """(outputs, letters) of one decoded batch: processed whole, or bisected (stages/splitting.py).

        Raises:
            A retriable error or ShutdownRequested (never a bad record): the caller retries or abandons.
        """
        def on_split(first: Exception, n: int) -> None:
            self.split_batches += 1
            self.log.warning("stage %s %s batch=%s: failed as a whole (%s: %s); splitting its %d samples to isolate "
                             "the bad ones", self.stage.name, where, batch.batch_id, error_class(first),
                             first_line(first), n)

        # a stop request (e.g. a generation abandoned on SIGTERM) is never a bad record
        split = process_or_split(batch, self.run_process, on_split=on_split,
                                 reraise=lambda exc: retriable(exc) or isinstance(exc, ShutdownRequested))
        first, bad, n = split.first, split.bad, split.samples
        if first is None:
            return split.outputs, []
        if n <= 1:
            return [], [self.dead_letters.letter(record, first, batch=batch)]
        if split.whole:
            # Nothing salvaged: a batch-level problem, or every sample bad. Keep the record whole (a
            # redrive reproduces it), with each sample's own reason beside the record's.
            errors = sample_errors(bad, error_class)
            self.log.warning("stage %s %s batch=%s: every sample fails on its own too; dead-lettering the record "
                             "whole (%s)", self.stage.name, where, batch.batch_id,
                             "; ".join(f"{sid}: {why}" for sid, why in errors.items())[:1000])
            return [], [self.dead_letters.letter(record, first, batch=batch, errors=errors)]
        letters = []
        for sub, exc in bad:
            try:
                value = encode(sub)
            except SchemaError as enc_exc:  # cannot happen for a select() of a decoded batch; be safe
                self.log.error("stage %s %s: bad sample %s cannot be re-encoded (%s); dead-lettering the record "
                               "whole", self.stage.name, where, sub.batch_id, enc_exc)
                return [], [self.dead_letters.letter(record, first, batch=batch)]
            letters.append(self.dead_letters.letter(record, exc, value=value, batch=sub, split_from=batch.batch_id))
        self.log.warning("stage %s %s batch=%s: split: %d of %d samples dead-lettered (%s), the rest produced",
                         self.stage.name, where, batch.batch_id, len(bad), n,
                         ", ".join(",".join(sample_ids(sub)) for sub, _ in bad)[:500])
        return split.outputs, letters
