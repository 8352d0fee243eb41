"""Splitting a failing micro-batch to isolate its bad samples: pure functions over batches.

Shared by the stage runner (stages/runner.py) and the in-process replay (expstream/tools/replay.py),
so that a replay bisects exactly as the runner did. When ``process`` fails on a batch of B > 1
samples (a SampleBatch, or a PromptBatch of several prompts), each half is processed as the
sub-batch ``f"{batch_id}~{lo}-{hi}"`` (absolute, deterministic indices: a redelivered record gives
the same ids), a failing half is halved again, down to single samples. The outputs of the
sub-batches that succeed are produced; each sample that fails on its own is dead-lettered as a 1-row
batch ``f"{batch_id}~{i}-{i+1}"`` with the headers ``split_from=<batch_id>`` and ``sample_ids``
(stages/deadletters.py, expstream/kafka/letters.py). If no sub-batch succeeds (a batch-level problem
rather than a bad sample), nothing is salvaged and the original record is dead-lettered whole, bytes
untouched, so a redrive reproduces it exactly. One bad sample in B costs about 2·log2(B) extra
``process`` calls. Sub-batches that fail may have done idempotent-by-id Redis updates under their own
ids before failing; stages validate before writing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from schemas import PromptBatch, SampleBatch

__all__ = ["Split", "first_line", "first_offsets", "process_or_split", "record_key", "sample_errors",
           "sample_ids", "splittable_samples", "subset_batch"]


def subset_batch(batch: Any, lo: int, hi: int) -> Any:
    """Samples [lo, hi) of ``batch`` as a batch called ``f"{batch_id}~{lo}-{hi}"``.

    Args:
        batch: a SampleBatch or a PromptBatch.
        lo, hi: the half-open range of rows, absolute in ``batch``.
    Returns:
        A new batch of the same type with the rows [lo, hi).
    """
    batch_id = f"{batch.batch_id}~{lo}-{hi}"
    if isinstance(batch, SampleBatch):
        return batch.select(list(range(lo, hi)), batch_id=batch_id)
    return PromptBatch(batch_id=batch_id, prompt_id=batch.prompt_id[lo:hi], prompt=batch.prompt[lo:hi],
                       label=batch.label[lo:hi], reference=batch.reference[lo:hi],
                       images=batch.images[lo:hi], videos=batch.videos[lo:hi])


def record_key(batch: Any) -> bytes:
    """The key of an output record: the batch's first group id (its batch id when it has none)."""
    group_ids = getattr(batch, "group_id", None)
    return (group_ids[0] if group_ids else batch.batch_id).encode()


def sample_ids(batch: Any) -> list[str]:
    """The ids a letter names: sample ids of a SampleBatch, prompt ids of a PromptBatch, else none."""
    if isinstance(batch, SampleBatch):
        return batch.sample_ids()
    if isinstance(batch, PromptBatch):
        return list(batch.prompt_id)
    return []


def splittable_samples(batch: Any) -> int:
    """The rows a failing ``batch`` can be split into (0 for anything but a Sample/PromptBatch)."""
    return len(batch) if isinstance(batch, (SampleBatch, PromptBatch)) else 0


def first_line(exc: BaseException | str) -> str:
    """The first line of an error's text ("" when it has none)."""
    text = str(exc)
    return text.splitlines()[0] if text else ""


def first_offsets(todo: list[tuple[Any, Any]]) -> dict[Any, int]:
    """The first offset of each partition in ``todo`` ((TopicPartition, record) pairs polled, not handled yet)."""
    out: dict[Any, int] = {}
    for tp, rec in todo:
        out.setdefault(tp, rec.offset)
    return out


@dataclasses.dataclass
class Split:
    """What :func:`process_or_split` made of one batch."""

    outputs: list  # the whole batch's outputs, or those of the sub-batches that succeeded
    first: Exception | None  # the whole batch's failure; None when it succeeded
    bad: list[tuple[Any, Exception]]  # each sample that failed alone: (its 1-row sub-batch, its error)
    samples: int  # splittable_samples(batch)

    @property
    def whole(self) -> bool:
        """Failed with nothing salvaged: one row (not split), or every sample failed alone too."""
        return self.first is not None and (self.samples <= 1 or len(self.bad) == self.samples)


def process_or_split(batch: Any, run: Callable[[Any], list], *,
                     reraise: Callable[[Exception], bool] = lambda exc: False,
                     on_split: Callable[[Exception, int], None] | None = None) -> Split:
    """``run(batch)``; when it fails and the batch has more than one row, bisect it.

    Args:
        batch: the decoded input batch.
        run: processes a batch (or sub-batch) and returns its outputs; raises on failure.
        reraise: errors that are not a bad batch (retriable, a stop request): they propagate at once.
        on_split: called with the whole batch's error and its rows before the bisection starts.
    Returns:
        A :class:`Split`.
    Raises:
        Whatever ``run`` raises for which ``reraise`` is true.
    """
    n = splittable_samples(batch)
    try:
        return Split(run(batch), None, [], n)
    except Exception as exc:
        if reraise(exc):
            raise
        first = exc
    if n <= 1:
        return Split([], first, [], n)
    if on_split is not None:
        on_split(first, n)
    good: list = []
    bad: list[tuple[Any, Exception]] = []
    _bisect(batch, 0, n, run, reraise, good, bad)
    return Split(good, first, bad, n)


def _bisect(batch: Any, lo: int, hi: int, run: Callable[[Any], list], reraise: Callable[[Exception], bool],
            good: list, bad: list[tuple[Any, Exception]]) -> None:
    """[lo, hi) failed as a whole (hi - lo > 1): process each half, recurse into failing ones."""
    mid = (lo + hi) // 2
    for a, b in ((lo, mid), (mid, hi)):
        sub = subset_batch(batch, a, b)
        try:
            good.extend(run(sub))
        except Exception as exc:
            if reraise(exc):
                raise
            if b - a == 1:
                bad.append((sub, exc))
            else:
                _bisect(batch, a, b, run, reraise, good, bad)


def sample_errors(bad: list[tuple[Any, Exception]], error_class: Callable[[Exception], str]) -> dict[str, str]:
    """Each failing sample's own reason, ``{sample id: "<class>: <first line>"}`` (for a whole-record letter).

    Args:
        bad: :attr:`Split.bad`.
        error_class: the class name a letter gives an error.
    """
    return {sid: f"{error_class(exc)}: {first_line(exc)}" for sub, exc in bad for sid in sample_ids(sub)}
