"""The sample ids the trainer has settled (trained, or dropped as stale), kept for a horizon, not for the run.

Kafka delivers at least once, and a rewind re-delivers on purpose, so the trainer drops a sample whose
id it has settled before (counted as ``duplicates``). Before issue 28 it kept every id of the run, in
memory and in every checkpoint. Now an id is kept while **either** holds (docs/async.md "The trainer's
dedupe horizon"):

* **its version is within the staleness window**: ``version >= step - k`` (k = ``async.max_staleness``,
  step = the trainer's next step). A copy that carries the version it was trained with (a redelivery
  after a crash or a rebalance, the trainer re-reading from its checkpoint, a rewind of a stage after
  generate: every one of those keeps the version generate stamped) and arrives once the id is forgotten
  has ``step - version > k`` at every later step, so the staleness rule drops it (counted and logged as
  ``dropped_stale``); it is never trained twice;
* **it was settled less than** :func:`settle_horizon_s` **ago** (``ADMISSION_WINDOWS x
  redis.dedupe_window_s``, 30 min by default). Copies that generate made again from a prompt record
  it had already produced (a rewind of generate, a reset of its offsets, a record regenerated after
  a crash before its commit) carry the *current* version, which the staleness rule lets through. The
  admission ledger grants such a re-read without counting it for at most that long after generate's
  commit (which comes before the sample is trained), so the trainer drops those copies as duplicates
  for at least as long; later the ledger counts the re-read as new work, and the trainer trains it as
  new work too: new responses of an old prompt, as a later epoch would bring.

What it keeps is about ``max(k + 1 steps, settle_horizon_s seconds)`` of settled samples: its size
depends on the run's rate, never on its length. Ids are kept in buckets, one per step (the time of its
last id and its newest version); the oldest bucket goes once both conditions let every id of it go.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from expstream.config.topology import Topology
from expstream.state.base import ADMISSION_WINDOWS

__all__ = ["SettledSamples", "settle_horizon_s"]


def settle_horizon_s(topo: Topology) -> float:
    """Seconds a settled id is kept at least (whatever its version): the admission ledger's longest memory
    of a delivered prompt record, ``ADMISSION_WINDOWS x redis.dedupe_window_s``."""
    return float(ADMISSION_WINDOWS * topo.redis.dedupe_window_s)


@dataclass
class _Bucket:
    step: int  # the step whose samples were settled (trained, or dropped before it)
    time: float  # when the last of them was settled (unix seconds)
    newest: int  # the highest version among them
    taken: list[list[Any]] = field(default_factory=list)  # [sample id, version], trained
    dropped: list[list[Any]] = field(default_factory=list)  # [sample id, version], dropped as stale


class SettledSamples:
    """Settled sample ids with their versions, forgotten past the horizon (module docstring)."""

    def __init__(self, horizon_s: float, clock: Callable[[], float] = time.time) -> None:
        self.horizon_s = float(horizon_s)
        self.clock = clock
        self._ids: dict[str, int] = {}
        self._buckets: deque[_Bucket] = deque()

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def items(self) -> Iterator[tuple[str, int]]:
        """(sample id, version) of every id kept, oldest first."""
        return iter(list(self._ids.items()))

    def taken_count(self) -> int:
        """Ids kept that were trained (not dropped)."""
        return sum(len(b.taken) for b in self._buckets)

    def take(self, sample_id: str, version: int, step: int) -> None:
        """``sample_id`` of ``version`` was trained at ``step``."""
        self._add(sample_id, version, step, dropped=False)

    def drop(self, sample_id: str, version: int, step: int) -> None:
        """``sample_id`` of ``version`` was dropped as stale before ``step`` (never trained)."""
        self._add(sample_id, version, step, dropped=True)

    def _add(self, sample_id: str, version: int, step: int, dropped: bool) -> None:
        if sample_id in self._ids:
            return
        now = self.clock()
        if not self._buckets or self._buckets[-1].step != step:
            self._buckets.append(_Bucket(step=int(step), time=now, newest=int(version)))
        bucket = self._buckets[-1]
        bucket.time, bucket.newest = max(bucket.time, now), max(bucket.newest, int(version))
        (bucket.dropped if dropped else bucket.taken).append([str(sample_id), int(version)])
        self._ids[str(sample_id)] = int(version)

    def forget(self, below: int) -> int:
        """Forget the oldest buckets whose every version is ``< below`` (the trainer's step - k: the staleness
        rule drops their copies) and that were settled more than ``horizon_s`` ago. Returns the ids forgotten."""
        cutoff = self.clock() - self.horizon_s
        gone = 0
        while self._buckets and self._buckets[0].newest < below and self._buckets[0].time < cutoff:
            bucket = self._buckets.popleft()
            for sid, _ in (*bucket.taken, *bucket.dropped):
                self._ids.pop(sid, None)
                gone += 1
        return gone

    def to_json(self) -> list[dict[str, Any]]:
        """The checkpoint's ``settled``: one entry per bucket (:meth:`from_json` reads it back)."""
        return [{"step": b.step, "time": b.time, "taken": b.taken, "dropped": b.dropped} for b in self._buckets]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]], horizon_s: float,
                  clock: Callable[[], float] = time.time) -> SettledSamples:
        out = cls(horizon_s, clock)
        for entry in data:
            taken = [[str(s), int(v)] for s, v in entry.get("taken") or []]
            dropped = [[str(s), int(v)] for s, v in entry.get("dropped") or []]
            pairs = [p for p in (*taken, *dropped) if p[0] not in out._ids]
            if not pairs:
                continue
            keep = {p[0] for p in pairs}
            out._buckets.append(_Bucket(step=int(entry["step"]), time=float(entry["time"]),
                                        newest=max(v for _, v in pairs),
                                        taken=[p for p in taken if p[0] in keep],
                                        dropped=[p for p in dropped if p[0] in keep]))
            out._ids.update((s, v) for s, v in pairs)
        return out
