"""The admission ledger of :class:`~expstream.state.redis_state.RedisState` (a mixin of its methods).

Admission control of the continuous loop (expstream/rl/admission.py) keeps, in the run's hash tag:

==================================  ======  ================================================
``P admission:of``                  hash    admitted, not yet delivered batch_id -> "version samples"
``P admission:delivered:<w>``       hash    batch_id -> "version samples", delivered in window w (TTL)
``P admission:lost_of:<w>``         hash    lost batch_id -> "version samples", counted in window w (TTL)
``P admission:admitted``            hash    version -> samples admitted under it; '-1': the folded versions
``P admission:lost``                hash    version -> samples lost of it; '-1': the folded versions
``P admission:totals``              hash    admitted, lost (sums, for the O(1) check), folded (fold point)
==================================  ======  ================================================

Windows are ``dedupe_window_s`` long (w = unix time // it); a delivered record and a lost id are
known for :data:`~expstream.state.base.ADMISSION_WINDOWS` windows (at least all but one of them),
then forgotten; the trainer folds the versions no step can train any more (:meth:`fold_admission`).
So the ledger holds what is in flight, what was delivered or lost in the last windows and one count
per version of the staleness window: its size does not grow with the run (docs/async.md "What the
admission ledger keeps").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from expstream.state.base import ADMISSION_WINDOWS, check_admission

__all__ = ["RedisAdmission"]


class RedisAdmission:
    """Admission control's methods of RedisState (the scripts: expstream/state/lua.py)."""

    # provided by RedisState / RedisConnection
    dedupe_window_s: int
    _r: redis.Redis

    def _windows(self, name: str) -> list[str]:
        """The ledger hashes ``admission:<name>:<w>`` read now: this window's first, then the older ones."""
        w = int(time.time()) // self.dedupe_window_s
        return [self.key("admission", name, str(w - i)) for i in range(ADMISSION_WINDOWS)]

    def _window_ttl(self) -> str:
        return str(ADMISSION_WINDOWS * self.dedupe_window_s)

    def admit(self, batch_id: str, samples: int, version: int, bound: int) -> bool:
        """Admit a prompt record of ``samples`` samples generated under ``version``; one Lua script.

        0. A ``batch_id`` marked delivered (:meth:`mark_delivered`: its generate record was committed, so
           it is read again only by a rewind) within the last windows is admitted (True) and nothing is
           counted or moved. Once forgotten (after the windows) it is admitted as new work.
        1. A ``batch_id`` admitted before is admitted again (True) at once; when ``version`` is newer
           (the record was redelivered and is generated under newer weights), its count moves from the
           old version to the new one. An older ``version`` is refused (False): a record is never
           regenerated with older weights than it was admitted with (its samples could arrive after
           the trainer stopped waiting for that version); the caller reloads and tries again.
        2. Otherwise it is admitted iff ``sum(admitted) - sum(lost) + samples <= bound``; then
           ``admitted[version] += samples`` (the folded total when ``version`` is below the fold point).
           False leaves everything unchanged.
        """
        check_admission("admit", batch_id, samples, version, bound)
        res = self._script("admit", [self.key("admission", "of"), self.key("admission", "admitted"),
                                     self.key("admission", "totals"), *self._windows("delivered")],
                           [batch_id, str(int(samples)), str(int(version)), str(int(bound))])
        return bool(int(res))

    def record_lost(self, batch_id: str, version: int, samples: int) -> bool:
        """Count ``samples`` of ``version`` that will never reach the trainer (dead-lettered, dropped by
        dynamic sampling), once per ``batch_id`` within the last windows. True when counted now, False
        for a repeat."""
        check_admission("record_lost", batch_id, samples, version)
        res = self._script("record_lost", [*self._windows("lost_of"), self.key("admission", "lost"),
                                           self.key("admission", "totals")],
                           [batch_id, str(int(version)), str(int(samples)), self._window_ttl()])
        return bool(int(res))

    def admission_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """(samples admitted by version, samples lost by version); versions with 0 left out; the versions
        folded away (:meth:`fold_admission`) are summed under the key ``FOLDED`` (-1)."""
        def read(pipe: redis.client.Pipeline) -> None:
            pipe.hgetall(self.key("admission", "admitted"))
            pipe.hgetall(self.key("admission", "lost"))

        admitted, lost = self._pipeline("admission_counts", read, transaction=True)
        return tuple({int(v): int(n) for v, n in sorted(raw.items(), key=lambda kv: int(kv[0])) if int(n)}
                     for raw in (admitted, lost))

    def admitted_version(self, batch_id: str) -> int | None:
        """The version ``batch_id`` is admitted under, None when it never was (or was delivered before
        the last windows)."""
        def read(pipe: redis.client.Pipeline) -> None:
            for key in (self.key("admission", "of"), *self._windows("delivered")):
                pipe.hget(key, batch_id)

        raw = next((r for r in self._pipeline("admitted_version", read, transaction=True) if r is not None), None)
        return int(raw.split(b" ", 1)[0]) if raw is not None else None

    def mark_delivered(self, batch_ids: Sequence[str]) -> int:
        """Generate's records ``batch_ids`` are committed (their samples are on their way): from now on, for
        the next windows, an admission of one of them (a rewind reading it again) is granted without
        counting anything, since the samples it regenerates are duplicates of counted ones. Ids never
        admitted are skipped. Returns how many were marked now (idempotent)."""
        ids = list(dict.fromkeys(batch_ids))
        if not ids:
            return 0
        return int(self._script("mark_delivered", [self.key("admission", "of"), self._windows("delivered")[0]],
                                [self._window_ttl(), *ids]))

    def fold_admission(self, below: int) -> int:
        """Sum the counts of every version < ``below`` into the folded total (``FOLDED``): the trainer calls
        it with its durable checkpoint's step - k, below which no step it can take (or resume at) trains
        a sample. Monotone and idempotent; returns the fold point in effect."""
        if isinstance(below, bool) or not isinstance(below, int):
            raise ValueError(f"fold_admission: below must be an int, got {below!r}")
        return int(self._script("fold_admission", [self.key("admission", "admitted"), self.key("admission", "lost"),
                                                   self.key("admission", "totals")], [str(int(below))]))
