"""Dead letters of a stage replica: building them, sending them whatever the broker refuses, lost-sample accounting.

Bad input goes to ``<input topic>.dlq`` and the partition moves on: a record with no value (a
tombstone), undecodable bytes, an unknown schema or version, missing/mistyped/inconsistent fields or
non-finite floats (all ``SchemaError``), a record over ``max_record_bytes``, a ``PoisonRecordError``
or any other non-retriable exception from ``process``. A letter carries the original bytes and key
and the headers listed in expstream/kafka/letters.py; when the broker refuses it, it is sent again with
the record's own headers left out, then without the value (:meth:`DeadLetters.deliver`), so no record
a stage cannot handle stops the partition. ``ShutdownRequested`` is never dead-lettered. The splitting
of a failing batch into per-sample letters is stages/splitting.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from expstream.errors import ExpstreamError, PoisonRecordError, ShutdownRequested
from expstream.kafka.letters import (
    H_BATCH_ID,
    H_ERROR_CLASS,
    H_ERROR_MESSAGE,
    H_SAMPLE_IDS,
    H_SPLIT_FROM,
    RUNNER_HEADERS,
    header_value,
    headers_omitted_headers,
    letter_headers,
    value_omitted_headers,
)
from expstream.kafka.topics import dlq_topic
from expstream.rl.admission import admission_id
from schemas import PromptBatch, SampleBatch
from schemas.codec import peek_header
from stages.context import StageContext
from stages.sending import Out, Sender
from stages.splitting import first_line, sample_ids

__all__ = ["DeadLetters", "ProcessFailure", "RecordTooLargeError", "TombstoneRecordError", "error_class",
           "failed_stage", "tag_failure"]

#: The attribute a chained stage's failure carries: which stage of the chain raised it (stages/chain.py).
FAILED_STAGE_ATTR = "expstream_failed_stage"


class RecordTooLargeError(PoisonRecordError):
    """A record over the runner's ``max_record_bytes``: dead-lettered before decoding."""


class TombstoneRecordError(PoisonRecordError):
    """A record with no value (a tombstone): dead-lettered with ``value_omitted``, nothing to decode."""


class ProcessFailure(Exception):
    """A failure inside process() that is not retriable: the record goes to the DLQ (the cause is the error)."""


def error_class(exc: BaseException) -> str:
    """The class name a letter gives ``exc`` (the cause's, for a :class:`ProcessFailure`)."""
    if isinstance(exc, ProcessFailure) and exc.__cause__ is not None:
        return type(exc.__cause__).__name__
    return type(exc).__name__


def tag_failure(exc: BaseException, stage: str) -> None:
    """Mark ``exc`` as raised by ``stage`` (the innermost stage that raised it keeps the mark)."""
    if getattr(exc, FAILED_STAGE_ATTR, None) is None:
        try:
            setattr(exc, FAILED_STAGE_ATTR, stage)
        except AttributeError:  # an exception type without a __dict__: the letter names the chain's first stage
            pass


def failed_stage(exc: BaseException) -> str | None:
    """The stage :func:`tag_failure` marked ``exc`` (or its cause, for a :class:`ProcessFailure`) with."""
    for e in (exc, exc.__cause__):
        stage = getattr(e, FAILED_STAGE_ATTR, None)
        if stage is not None:
            return str(stage)
    return None


def _header(out: Out, name: str) -> str:
    return header_value(out.headers, name)


def _own_headers(out: Out) -> list[tuple[str, bytes]]:
    """The headers of a letter that came from the original record (not written by the runner)."""
    return [(k, v) for k, v in out.headers or [] if k not in RUNNER_HEADERS]


class DeadLetters:
    """The letters of one replica (worker and confirm threads)."""

    def __init__(self, ctx: StageContext, log: logging.Logger, sender: Sender | None) -> None:
        """
        Args:
            ctx: the stage's context (stage, replica, topology, run state for lost samples).
            log: the stage's logger.
            sender: sends and confirms with retries (None: letters are only built, never sent).
        """
        self.ctx, self.log, self.sender, self.stage = ctx, log, sender, ctx.stage.name
        self.topic = dlq_topic(ctx.stage.input)
        self.dead_lettered = 0

    def letter(self, record: Any, exc: Exception, *, value: Any = ..., batch: Any = None,
               split_from: str | None = None, errors: dict[str, str] | None = None) -> Out:
        """The letter of ``record`` (or of a sub-batch of it) failed with ``exc``.

        Args:
            record: the consumed record (its key and headers, its bytes unless ``value`` is given).
            exc: the reason.
            value: the letter's value when not the record's (a split sub-batch's bytes).
            batch: the decoded batch the letter carries (its sample ids; lost-sample accounting).
            split_from: the batch id a split sub-batch came from.
            errors: each sample's own reason, when the record goes whole after every sample failed alone.
        Returns:
            The letter, not sent yet.
        """
        value = record.value if value is ... else value
        # the twin of the record's own topic (generate of a multi-turn run reads prompts and turns)
        topic = dlq_topic(record.topic) if isinstance(getattr(record, "topic", None), str) else self.topic
        headers = letter_headers(
            record, stage=failed_stage(exc) or self.stage, replica=self.ctx.replica_id, error_class=error_class(exc),
            error_message=str(exc), value=value, sample_ids=sample_ids(batch) if batch is not None else None,
            split_from=split_from, errors=errors)
        if value is None:  # a tombstone: a letter always has a value (possibly empty), so say it is omitted
            return Out(topic, b"", record.key, value_omitted_headers(
                headers, "the record had no value (a tombstone); there is nothing to carry or redrive"))
        return Out(topic, value, record.key, headers, batch=batch)

    def deliver(self, record: Any, where: str, outputs: list[Out], letters: list[Out], batch: Any) -> None:
        """Send the outputs and letters of one record; when the broker refuses one (non-retriable), fall
        back step by step, so that a record always leaves as a letter and the partition moves on:

        1. everything as computed;
        2. the input record whole as one letter (the outputs dropped), with the refusal as the reason
           unless the record already was a single whole-record letter (its own reason is kept);
        3. that letter without the record's own headers (``headers_omitted``), the value kept;
        4. with the headers but without the value (``value_omitted``: the original stays at its
           topic[partition]@offset), then 5. without both.

        ``outputs`` and ``letters`` are updated to what was sent.

        Raises:
            ShutdownRequested (a stop is never a refusal: the record stays uncommitted); a retriable
            error still failing after RETRY_GIVE_UP_S; the last refusal when even the smallest letter is refused.
        """
        what = f"{where} batch={batch.batch_id if batch is not None else peek_header(record.value)[2]}"
        try:
            self.sender.send(outputs + letters, what)
        except ShutdownRequested:
            raise
        except ExpstreamError as exc:  # non-retriable: the broker refuses a record (e.g. too large)
            if exc.retriable:  # still failing after RETRY_GIVE_UP_S: the stage fails, the record is redelivered
                raise
            whole = len(letters) == 1 and not outputs and _header(letters[0], H_SPLIT_FROM) == ""
            self.log.error("stage %s %s: the broker refused %s (%s); dead-lettering the input record whole%s",
                           self.stage, what, "the letter" if whole else "an output or letter", exc,
                           "" if whole else " instead")
            first = letters[0] if whole else self.letter(record, exc, batch=batch)
            outputs[:] = []
            letters[:] = [self.send_somehow(first, where, what, exc, tried=whole)]
        self.after_delivery(letters, where, what)

    def after_delivery(self, letters: list[Out], where: str, what: str) -> None:
        """Once a record's outputs and letters are acknowledged: lost-sample accounting, one log line per letter."""
        if letters and self.ctx.topology.train.enabled:
            self.sender.retry_work(lambda: self.record_lost(letters, where), what, "recording lost samples")
        for letter in letters:
            self.dead_lettered += 1
            self.log.error("stage %s %s batch=%s: dead-lettered %s to %s: %s: %s", self.stage, where,
                           _header(letter, H_BATCH_ID) or "?", _header(letter, H_SAMPLE_IDS) or "the record",
                           self.topic, _header(letter, H_ERROR_CLASS), first_line(_header(letter, H_ERROR_MESSAGE)))

    def record_lost(self, letters: list[Out], where: str) -> None:
        """The continuous loop's accounting (expstream/rl/admission.py): samples of admitted work that were
        dead-lettered never reach the trainer; count them lost (idempotent per batch id) before the commit.
        A PromptBatch counts its G x n samples under the version its root record was admitted with (not
        admitted: nothing to count); a SampleBatch counts B under its policy_version, except one read from
        the prompt topic (never admitted; a multi-turn generate's turns records are counted)."""
        n = self.ctx.topology.generate.n_samples_per_prompt
        for letter in letters:
            b = letter.batch
            if isinstance(b, PromptBatch):
                version, samples = self.ctx.state.admitted_version(admission_id(b.batch_id)), len(b) * n
            elif isinstance(b, SampleBatch) and letter.topic != dlq_topic(self.ctx.topology.topics.input):
                version, samples = b.policy_version, len(b)
            else:
                continue
            if version is not None and samples and self.ctx.state.record_lost(b.batch_id, int(version), samples):
                self.log.warning("stage %s %s batch=%s: %d samples of policy version %d counted lost (dead-lettered)",
                                 self.stage, where, b.batch_id, samples, version)

    def send_somehow(self, letter: Out, where: str, what: str, refusal: Exception, *, tried: bool) -> Out:
        """Steps 2-4 of :meth:`deliver`: ``letter`` (unless ``tried`` already), then without the record's
        own headers, then without the value, then without both.

        Returns:
            The letter the broker took.
        Raises:
            The last refusal when even the smallest letter is refused (a broken dead-letter topic).
        """
        own = _own_headers(letter)
        runner_only = [(k, v) for k, v in letter.headers or [] if k in RUNNER_HEADERS]

        def no_headers(out: Out, exc: Exception) -> Out:
            return dataclasses.replace(out, headers=headers_omitted_headers(
                [(k, v) for k, v in out.headers or [] if k in RUNNER_HEADERS],
                f"{len(own)} header(s) of the original record dropped ({', '.join(sorted({k for k, _ in own}))[:200]}): "
                f"the broker refused them ({exc}); read them at {where}"))

        def no_value(out: Out, exc: Exception) -> Out:
            return dataclasses.replace(out, value=b"", headers=value_omitted_headers(
                out.headers, f"the broker refused the original value ({exc}); read it at {where}"))

        steps: list[Callable[[Exception], Out]] = [] if tried else [lambda exc: letter]
        if own:
            steps.append(lambda exc: no_headers(letter, exc))
        if letter.value:
            steps.append(lambda exc: no_value(letter, exc))
            if own:
                steps.append(lambda exc: no_value(no_headers(dataclasses.replace(letter, headers=runner_only), exc),
                                                  exc))
        last = refusal
        for step in steps:
            candidate = step(last)
            try:
                self.sender.send([candidate], what)
                return candidate
            except ShutdownRequested:
                raise
            except ExpstreamError as exc:
                if exc.retriable:
                    raise
                self.log.error("stage %s %s: the broker refused the letter too (%s); trying it with less in it",
                               self.stage, what, first_line(exc))
                last = exc
        raise last  # even the smallest letter is refused (a broken dead-letter topic): the stage fails
