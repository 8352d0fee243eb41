"""The run-state contract every stage talks to, and what its two implementations share.

Stages never see Redis: they get a :class:`State` in ``ctx.state``. Two implementations pass one
contract suite (``tests/test_state.py``):

* :class:`expstream.state.RedisState` — shared by every replica of every stage process; atomic
  Lua scripts; what ``expstream stage`` and ``expstream run`` use.
* :class:`expstream.state.MemoryState` — a dict in one process; what LocalChain, tests, the
  synchronous bench and replay use. Same answers, same apply-once-per-id rules, same float
  arithmetic (so a replay on MemoryState reproduces a Redis run bit for bit).

The rules that make Kafka's at-least-once delivery exactly-once in effect hold for both:

* every update carries an id (a ``batch_id``, a ``step_id``) and is applied once per id; a
  repeated id gets the answer of the first application and changes nothing;
* a prompt group is handed out once, to the call that completed it (and again to a redelivery of
  that same call), never to anyone else; once every record that carried one of its members is
  committed (:meth:`State.settle_groups`, called by the runner after the commit) its buffer is
  freed and only a "done" marker stays, for ``dedupe_window_s``: a record of that group read
  again (a rewind) is a duplicate, parks nothing and gets nothing;
* a normalisation window is handed out once, to the call that filled it (or to ``flush_window``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from expstream.errors import ConfigError, PoisonRecordError

__all__ = [
    "State",
    "Moments",
    "WindowTaken",
    "DEFAULT_GROUP_TTL_S",
    "DEFAULT_DEDUPE_WINDOW_S",
    "check_group_members",
    "check_settle",
    "check_admission",
    "ADMISSION_WINDOWS",
    "FOLDED",
]

# Why 24 h: a group buffer is needed until its last sample arrives (seconds to minutes); the TTL
# only garbage-collects groups of an abandoned run (a settled group is freed at once). 0 disables expiry.
DEFAULT_GROUP_TTL_S = 86400
# Why 10 minutes: what Redis keeps to recognise a record applied already, beyond the record's commit:
# the ids of counted statistics and the "done" marker of a freed group. A record is read again after
# its commit only by a rewind (or a consumer-offset reset); before its commit, by a redelivery after a
# crash or a rebalance, which comes within minutes (max_poll_interval 60 s, a stage gives up a retry
# after 300 s and is restarted). What that keeps in Redis (measured) and what a rewind further back
# does: docs/async.md "What a long run keeps".
DEFAULT_DEDUPE_WINDOW_S = 600

# Why 3: a delivered prompt record (and a lost id) is kept in the admission ledger for the current
# and the two previous windows of ``dedupe_window_s``: at least two windows, so longer than the "done"
# markers of its groups (one window after they settle, which follows generate's commit within seconds).
# A rewind of generate within that horizon regenerates the record without counting it (its copies
# are dropped downstream as duplicates); further back both are forgotten together, the record is
# admitted as new work and its copies reach the trainer, which counts them as arrivals: the counts
# stay exact either way (docs/async.md "What the admission ledger keeps").
ADMISSION_WINDOWS = 3
#: The key of ``State.admission_counts()`` under which the versions folded away are summed
#: (``State.fold_admission``): never a real version (versions are >= 0), never waited for.
FOLDED = -1

#: ``(window_id, member payloads)`` handed to the call that closed a normalisation window.
WindowTaken = tuple[str, list[bytes]]


@dataclass(frozen=True)
class Moments:
    """Running moments of a stream of scalars (Chan et al.'s count, mean, M2).

    ``var``/``std`` are unbiased (``M2 / (count - 1)``) and ``inf`` when ``count <= 1``.
    """

    count: int
    mean: float
    m2: float
    var: float
    std: float

    @classmethod
    def from_triple(cls, count: int, mean: float, m2: float) -> Moments:
        var = m2 / (count - 1) if count > 1 else math.inf
        return cls(int(count), float(mean), float(m2), var, math.sqrt(var) if var >= 0 else math.nan)

    @classmethod
    def parse(cls, snapshot: bytes | str) -> Moments:
        """From the stored snapshot ``"count mean m2"`` (the form both implementations keep)."""
        if isinstance(snapshot, bytes):
            snapshot = snapshot.decode()
        c, m, m2 = snapshot.split()
        return cls.from_triple(int(float(c)), float(m), float(m2))

    def snapshot(self) -> str:
        """``"count mean m2"`` with ``%.17g`` floats: exact doubles, the same text the Lua writes."""
        return f"{self.count:d} {self.mean:.17g} {self.m2:.17g}"


@runtime_checkable
class State(Protocol):
    """Run-scoped state shared by the replicas of a run (reward moments, groups, KL, stats).

    ``run_id`` names the run; ``group_ttl_s`` is how long group and window buffers are kept
    (only an abandoned run's buffers ever expire).
    """

    run_id: str
    group_ttl_s: int
    #: how long the "done" marker of a freed group is kept (see :meth:`settle_groups`)
    dedupe_window_s: int
    #: True when other processes (replicas) read and write the same state (RedisState). A stage may
    #: skip a round trip that only matters between processes when it is False (MemoryState).
    shared: bool

    # reward (and advantage) moments
    def merge_reward_moments(self, batch_id: str, values: np.ndarray, name: str = "reward") -> Moments: ...
    def get_moments(self, name: str = "reward") -> Moments: ...

    # prompt groups (group estimators, dynamic sampling)
    def park_group(self, group_id: str, n: int, batch_id: str,
                   members: Mapping[int, bytes]) -> list[bytes] | None: ...
    def park_groups(self, batch_id: str, groups: Mapping[str, tuple[int, Mapping[int, bytes]]]
                    ) -> dict[str, list[bytes] | None]: ...
    def group_status(self, group_id: str) -> tuple[int, int | None, str | None]: ...
    def settle_groups(self, batch_id: str, members: Mapping[str, Sequence[int]]) -> list[str]: ...
    def settle_records(self, records: Sequence[tuple[str, Mapping[str, Sequence[int]]]]) -> list[str]: ...
    def group_done(self, group_id: str) -> bool: ...

    # cross-batch normalisation windows
    def park_window(self, name: str, batch_id: str, payload: bytes, n_samples: int,
                    size: int) -> WindowTaken | None: ...
    def flush_window(self, name: str) -> WindowTaken | None: ...
    def pending_window_samples(self, name: str) -> int: ...

    # KL coefficient
    def kl_coef(self, default: float) -> float: ...
    def set_kl_coef(self, value: float) -> None: ...
    def update_kl_adaptive(self, step_id: str, current_kl: float, target: float, n_steps: int,
                           horizon: int, *, default: float | None = None) -> float: ...

    # stage statistics, heartbeats, policy version, counters
    def record_stage_time(self, stage: str, seconds: float, samples: int, batch_id: str) -> bool: ...
    def stage_stats(self) -> dict[str, dict[str, float]]: ...
    def stage_recent(self, stage: str) -> list[tuple[float, float, int]]: ...
    def record_flow(self, stage: str, batch_id: str, counts: dict[str, int]) -> bool: ...
    def flows(self) -> dict[str, dict[str, int]]: ...
    def record_batch(self, stage: str, batch_id: str, counts: dict[str, int], seconds: float | None = None,
                     samples: int = 0) -> None: ...
    def record_batches(self, stage: str, rows: Sequence[tuple[str, dict[str, int], float | None, int]]) -> None: ...
    def heartbeat(self, stage: str, replica_id: str | int) -> None: ...
    def heartbeats(self) -> dict[tuple[str, str], float]: ...
    def policy_version(self) -> int: ...
    def set_policy_version(self, version: int) -> int: ...
    def mark_once(self, namespace: str, id: str) -> bool: ...
    def incr_counter(self, name: str, by: float = 1, once_id: str | None = None) -> float: ...
    def counters(self) -> dict[str, float]: ...

    # admission control of the continuous loop (expstream/rl/admission.py says why the bound holds)
    def admit(self, batch_id: str, samples: int, version: int, bound: int) -> bool: ...
    def record_lost(self, batch_id: str, version: int, samples: int) -> bool: ...
    def admission_counts(self) -> tuple[dict[int, int], dict[int, int]]: ...
    def admitted_version(self, batch_id: str) -> int | None: ...
    def mark_delivered(self, batch_ids: Sequence[str]) -> int: ...
    def fold_admission(self, below: int) -> int: ...

    # the rewind handshake (expstream/tools/rewind.py): a request per stage, acknowledged per replica;
    # both expire after ttl_s unless refreshed, so a tool that dies never leaves replicas waiting
    def set_rewind_request(self, stage: str, request_id: str, ttl_s: float) -> None: ...
    def rewind_request(self, stage: str) -> str | None: ...
    def ack_rewind(self, stage: str, request_id: str, replica_id: str, ttl_s: float) -> None: ...
    def rewind_acks(self, stage: str, request_id: str) -> set[str]: ...
    def clear_rewind_request(self, stage: str) -> None: ...

    # durability: before a stage commits its offsets, its writes are on a replica (RedisState: WAIT)
    def sync_writes(self) -> None: ...
    def close(self) -> None: ...


# --- shared by both implementations ------------------------------------------------------------
#: Why 512: the status view's window (60 s) holds a few hundred micro-batches of the fastest stage.
RECENT_BATCHES = 512


def parse_recent(raw: bytes | str) -> tuple[float, float, int]:
    """One entry of a stage's recent list: ``"unix_time,seconds,samples"``."""
    t, sec, n = (raw.decode() if isinstance(raw, bytes) else raw).split(",")
    return float(t), float(sec), int(n)


def check_group_members(group_id: str, n: int, members: Mapping[int, bytes]) -> dict[int, bytes]:
    """Validate a park_group call; ``{index: payload}`` with int indices in ``[0, n)``."""
    if not isinstance(n, int) or n < 1:
        raise PoisonRecordError(f"group {group_id!r}: group size n must be a positive int, got {n!r}")
    out: dict[int, bytes] = {}
    for idx, payload in members.items():
        i = int(idx)
        if not 0 <= i < n:
            raise PoisonRecordError(f"group {group_id!r}: sample_index {idx} outside [0, {n})")
        out[i] = bytes(payload)
    return out


def check_settle(batch_id: str, members: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """Validate a settle_groups call; ``{group_id: sorted distinct sample indices}`` (empty groups left out)."""
    if not isinstance(batch_id, str) or not batch_id:
        raise ValueError(f"settle_groups: batch_id must be a non-empty str, got {batch_id!r}")
    out: dict[str, list[int]] = {}
    for group_id, indices in members.items():
        idx = sorted({int(i) for i in indices})
        if any(i < 0 for i in idx):
            raise ValueError(f"settle_groups batch={batch_id}: group {group_id!r}: negative sample_index in {idx}")
        if idx:
            out[str(group_id)] = idx
    return out


def settle_root(batch_id: str) -> str:
    """The record a (sub-)batch id belongs to: the runner's split sub-batch ``<id>~<lo>-<hi>`` is part of ``<id>``."""
    return batch_id.split("~", 1)[0]


def check_admission(what: str, batch_id: str, samples: int, version: int, bound: int | None = None) -> None:
    """Validate the arguments of ``admit`` / ``record_lost`` (``what`` names the call)."""
    if not isinstance(batch_id, str) or not batch_id:
        raise ValueError(f"{what}: batch_id must be a non-empty str, got {batch_id!r}")
    for name, value, low in (("samples", samples, 1), ("version", version, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{what} batch={batch_id}: {name} must be an int >= {low}, got {value!r}")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, np.integer))):
        raise ValueError(f"{what} batch={batch_id}: bound must be an int (admission_bound(...)), got {bound!r}")


def group_size_error(group_id: str, stored_n: int | str, n: int) -> PoisonRecordError:
    return PoisonRecordError(
        f"group {group_id!r}: GROUPSIZE group already parked with n={stored_n}, got n={n}"
    )


def kl_not_initialised() -> ConfigError:
    return ConfigError(
        "the KL coefficient is not initialised",
        field="kl_coef",
        fix="call kl_coef(init_kl_coef) or pass default=",
    )
