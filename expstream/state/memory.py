"""MemoryState: the :class:`~expstream.state.base.State` contract in one process, on dicts.

For everything that runs stages without Redis: LocalChain, tests, the synchronous bench, replay
of a recorded topic. It gives the answers RedisState gives — the same apply-once-per-id rules,
the same group and window hand-out, the same float arithmetic (the merge and KL formulas of
:mod:`expstream.rl.moments`, which the Lua mirrors operation for operation) — so a group
split across micro-batches completes here exactly as it does across Redis.

What it does not do: share anything between processes (each process has its own), or expire
buffers (``group_ttl_s`` is kept for the contract; the state lives as long as the object). A settled
group is freed and its "done" marker kept ``dedupe_window_s`` here too, as on Redis.
Thread-safe: one lock around every call (a stage runner heartbeats from a second thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from expstream.rl.moments import adaptive_kl_update, batch_moments, check_kl_update, merge_batch_moments
from expstream.state.base import (
    ADMISSION_WINDOWS,
    DEFAULT_DEDUPE_WINDOW_S,
    DEFAULT_GROUP_TTL_S,
    FOLDED,
    RECENT_BATCHES,
    Moments,
    WindowTaken,
    check_admission,
    check_group_members,
    check_settle,
    group_size_error,
    kl_not_initialised,
    settle_root,
)

__all__ = ["MemoryState"]


@dataclass
class _Group:
    n: int
    members: dict[int, bytes] = field(default_factory=dict)
    completer: str | None = None
    committed: set[int] = field(default_factory=set)  # sample indices whose records are committed
    completer_committed: bool = False  # the completing record itself is committed


@dataclass
class _Applied:
    """Ids counted in the current and the previous window of ``dedupe_window_s`` (RedisState's per-window sets)."""

    windows: dict[int, set[str]] = field(default_factory=dict)

    def add(self, id: str, width: int, now: float) -> bool:
        """True (and remembered) the first time ``id`` is seen within the last one to two windows."""
        w = int(now) // width
        for old in [k for k in self.windows if k < w - 1]:
            del self.windows[old]
        if id in self.windows.get(w, ()) or id in self.windows.get(w - 1, ()):
            return False
        self.windows.setdefault(w, set()).add(id)
        return True


@dataclass
class _Window:
    members: dict[str, bytes] = field(default_factory=dict)  # batch_id -> payload, arrival order
    samples: int = 0
    closer: str | None = None


@dataclass
class _Windows:
    of: dict[str, int] = field(default_factory=dict)  # batch_id -> window k it joined
    cur: int = 0
    windows: dict[int, _Window] = field(default_factory=dict)

    def window(self, k: int) -> _Window:
        return self.windows.setdefault(k, _Window())


class MemoryState:
    """Run state in this process's memory (see the module docstring)."""

    def __init__(self, run_id: str = "local", *, group_ttl_s: int = DEFAULT_GROUP_TTL_S,
                 dedupe_window_s: int = DEFAULT_DEDUPE_WINDOW_S) -> None:
        self.run_id = run_id
        self.group_ttl_s = int(group_ttl_s)
        self.dedupe_window_s = int(dedupe_window_s)
        self.shared = False  # one process: no other replica reads these buffers
        self._lock = threading.RLock()
        self._moments: dict[str, tuple[int, float, float]] = {}
        self._moments_applied: dict[str, dict[str, str]] = {}
        self._groups: dict[str, _Group] = {}
        self._done: dict[str, float] = {}  # freed group id -> unix time it was freed (insertion = time order)
        self._windows: dict[str, _Windows] = {}
        self._kl: float | None = None
        self._kl_applied: dict[str, float] = {}
        self._stages: dict[str, dict[str, float]] = {}
        self._stage_applied: dict[str, _Applied] = {}
        self._heartbeats: dict[tuple[str, str], float] = {}
        self._rewind: dict[str, tuple[str, float]] = {}  # stage -> (request id, monotonic expiry)
        self._rewind_acks: dict[str, dict[str, tuple[str, float]]] = {}  # stage -> replica -> (request id, expiry)
        self._policy_version = 0
        self._recent: dict[str, list[tuple[float, float, int]]] = {}
        self._flows: dict[str, dict[str, int]] = {}
        self._flow_applied: dict[str, _Applied] = {}
        self._once: dict[str, set[str]] = {}
        self._counters: dict[str, float] = {}
        self._counter_applied: dict[str, _Applied] = {}
        self._admitted_of: dict[str, tuple[int, int]] = {}  # admitted, not delivered: batch_id -> (version, samples)
        # window w -> batch_id -> (version, samples): delivered records and lost ids of the last windows
        self._delivered: dict[int, dict[str, tuple[int, int]]] = {}
        self._lost_of: dict[int, dict[str, tuple[int, int]]] = {}
        self._admitted: dict[int, int] = {}  # version -> samples; FOLDED: the versions below the fold point
        self._lost: dict[int, int] = {}
        self._folded = 0

    def close(self) -> None:
        return None

    def sync_writes(self) -> None:
        """Nothing to wait for: one process's dicts have no replica."""
        return None

    def __enter__(self) -> MemoryState:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- reward moments ------------------------------------------------------------------------
    def merge_reward_moments(self, batch_id: str, values: np.ndarray, name: str = "reward") -> Moments:
        """Merge ``values`` into moments ``name`` once per ``batch_id`` (see RedisState)."""
        k, mean_b, m2_b = batch_moments(values)
        with self._lock:
            applied = self._moments_applied.setdefault(name, {})
            if batch_id not in applied:
                merged = merge_batch_moments(*self._moments.get(name, (0, 0.0, 0.0)), k, mean_b, m2_b)
                snap = Moments.from_triple(*merged).snapshot()
                # Keep exactly what the snapshot text holds, as Redis keeps the Lua's strings.
                stored = Moments.parse(snap)
                self._moments[name] = (stored.count, stored.mean, stored.m2)
                applied[batch_id] = snap
            return Moments.parse(applied[batch_id])

    def get_moments(self, name: str = "reward") -> Moments:
        with self._lock:
            return Moments.from_triple(*self._moments.get(name, (0, 0.0, 0.0)))

    # --- group buffers -------------------------------------------------------------------------
    def park_group(self, group_id: str, n: int, batch_id: str,
                   members: Mapping[int, bytes]) -> list[bytes] | None:
        """Park members once each; the completing call (and its redelivery) gets all n, in order."""
        checked = check_group_members(group_id, n, members)
        with self._lock:
            if self._is_done(group_id, time.time()):
                return None  # a record of a settled group read again: a duplicate, nothing to park
            group = self._groups.get(group_id)
            if group is None:
                group = self._groups[group_id] = _Group(n)
            elif group.n != n:
                raise group_size_error(group_id, group.n, n)
            for i, payload in checked.items():
                group.members.setdefault(i, payload)
            if len(group.members) < n:
                return None
            if group.completer is None:
                group.completer = batch_id
            if group.completer != batch_id:
                return None
            return [group.members[i] for i in range(n)]

    def park_groups(self, batch_id: str, groups: Mapping[str, tuple[int, Mapping[int, bytes]]]
                    ) -> dict[str, list[bytes] | None]:
        """:meth:`park_group` for each ``group_id -> (n, members)`` of one record (RedisState: one round trip)."""
        return {g: self.park_group(g, n, batch_id, members) for g, (n, members) in groups.items()}

    def group_status(self, group_id: str) -> tuple[int, int | None, str | None]:
        with self._lock:
            group = self._groups.get(group_id)
            if group is None:
                return 0, None, None
            return len(group.members), group.n, group.completer

    def settle_groups(self, batch_id: str, members: Mapping[str, Sequence[int]]) -> list[str]:
        """Record ``batch_id`` committed with ``members`` (group id -> sample indices); free every group
        now complete whose members' records and completing record are all committed (see RedisState)."""
        checked = check_settle(batch_id, members)
        now = time.time()
        freed = []
        with self._lock:
            for group_id, indices in checked.items():
                group = self._groups.get(group_id)
                if group is None:
                    continue
                group.committed.update(i for i in indices if i < group.n)
                if group.completer is not None and settle_root(group.completer) == batch_id:
                    group.completer_committed = True
                if group.completer_committed and len(group.committed) == group.n:
                    del self._groups[group_id]
                    self._done.pop(group_id, None)
                    self._done[group_id] = now
                    freed.append(group_id)
            if freed:
                cutoff = now - self.dedupe_window_s
                for gid in [g for g, t in self._done.items() if t < cutoff]:
                    del self._done[gid]
        return freed

    def settle_records(self, records: Sequence[tuple[str, Mapping[str, Sequence[int]]]]) -> list[str]:
        """:meth:`settle_groups` for each ``(batch_id, members)`` in order (RedisState: one round trip)."""
        return [g for batch_id, members in records for g in self.settle_groups(batch_id, members)]

    def group_done(self, group_id: str) -> bool:
        """True while the "done" marker of a settled group is kept."""
        with self._lock:
            return self._is_done(group_id, time.time())

    def _is_done(self, group_id: str, now: float) -> bool:
        freed = self._done.get(group_id)
        return freed is not None and freed >= now - self.dedupe_window_s

    # --- normalisation windows -----------------------------------------------------------------
    def park_window(self, name: str, batch_id: str, payload: bytes, n_samples: int,
                    size: int) -> WindowTaken | None:
        """Add one micro-batch to window ``name``; ``(window_id, members)`` when this call closed it."""
        with self._lock:
            ws = self._windows.setdefault(name, _Windows())
            if batch_id in ws.of:
                k = ws.of[batch_id]
                w = ws.window(k)
                return (str(k), list(w.members.values())) if w.closer == batch_id else None
            k = ws.cur
            w = ws.window(k)
            w.members[batch_id] = bytes(payload)
            ws.of[batch_id] = k
            w.samples += int(n_samples)
            if w.samples >= int(size):
                w.closer = batch_id
                ws.cur = k + 1
                return str(k), list(w.members.values())
            return None

    def flush_window(self, name: str) -> WindowTaken | None:
        """Close the open window whatever its size; None when it is empty."""
        with self._lock:
            ws = self._windows.setdefault(name, _Windows())
            k = ws.cur
            w = ws.window(k)
            if w.samples == 0:
                return None
            w.closer = "flush"
            ws.cur = k + 1
            return str(k), list(w.members.values())

    def pending_window_samples(self, name: str) -> int:
        with self._lock:
            ws = self._windows.get(name)
            return ws.window(ws.cur).samples if ws is not None else 0

    # --- KL coefficient ------------------------------------------------------------------------
    def kl_coef(self, default: float) -> float:
        with self._lock:
            if self._kl is None:
                self._kl = float(default)
            return self._kl

    def set_kl_coef(self, value: float) -> None:
        with self._lock:
            self._kl = float(value)

    def update_kl_adaptive(self, step_id: str, current_kl: float, target: float, n_steps: int,
                           horizon: int, *, default: float | None = None) -> float:
        """Adaptive KL controller step, applied once per ``step_id`` (see RedisState)."""
        check_kl_update(target, horizon)
        with self._lock:
            if step_id in self._kl_applied:
                return self._kl_applied[step_id]
            value = self._kl if self._kl is not None else default
            if value is None:
                raise kl_not_initialised()
            new = adaptive_kl_update(float(value), float(current_kl), float(target), float(n_steps),
                                     float(horizon))
            self._kl = self._kl_applied[step_id] = new
            return new

    # --- stage statistics, heartbeats ----------------------------------------------------------
    def record_stage_time(self, stage: str, seconds: float, samples: int, batch_id: str) -> bool:
        with self._lock:
            if not self._stage_applied.setdefault(stage, _Applied()).add(batch_id, self.dedupe_window_s, time.time()):
                return False
            row = self._stages.setdefault(stage, {"batches": 0, "samples": 0, "seconds": 0.0})
            row["batches"] += 1
            row["samples"] += int(samples)
            row["seconds"] += float(seconds)
            recent = self._recent.setdefault(stage, [])
            recent.insert(0, (time.time(), float(seconds), int(samples)))
            del recent[RECENT_BATCHES:]
            return True

    def stage_recent(self, stage: str) -> list[tuple[float, float, int]]:
        with self._lock:
            return list(self._recent.get(stage, []))

    def record_flow(self, stage: str, batch_id: str, counts: dict[str, int]) -> bool:
        with self._lock:
            if not self._flow_applied.setdefault(stage, _Applied()).add(batch_id, self.dedupe_window_s, time.time()):
                return False
            row = self._flows.setdefault(stage, {})
            for k, v in counts.items():
                row[k] = row.get(k, 0) + int(v)
            return True

    def record_batch(self, stage: str, batch_id: str, counts: dict[str, int], seconds: float | None = None,
                     samples: int = 0) -> None:
        """:meth:`record_flow`, and :meth:`record_stage_time` when ``seconds`` is given (the runner's per-record call)."""
        if seconds is not None:
            self.record_stage_time(stage, seconds, samples, batch_id)
        self.record_flow(stage, batch_id, counts)

    def record_batches(self, stage: str, rows: Sequence[tuple[str, dict[str, int], float | None, int]]) -> None:
        """:meth:`record_batch` for each ``(batch_id, counts, seconds, samples)`` row (a runner's commit group)."""
        for batch_id, counts, seconds, samples in rows:
            self.record_batch(stage, batch_id, counts, seconds, samples)

    def flows(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {s: dict(self._flows[s]) for s in sorted(self._flows)}

    def stage_stats(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {s: dict(self._stages[s]) for s in sorted(self._stages)}

    def heartbeat(self, stage: str, replica_id: str | int) -> None:
        with self._lock:
            self._heartbeats[(stage, str(replica_id))] = time.time()

    def heartbeats(self) -> dict[tuple[str, str], float]:
        with self._lock:
            return dict(self._heartbeats)

    # --- policy version ------------------------------------------------------------------------
    def policy_version(self) -> int:
        with self._lock:
            return self._policy_version

    def set_policy_version(self, version: int) -> int:
        with self._lock:
            self._policy_version = max(self._policy_version, int(version))
            return self._policy_version

    # --- generic idempotence and counters ------------------------------------------------------
    def mark_once(self, namespace: str, id: str) -> bool:
        with self._lock:
            seen = self._once.setdefault(namespace, set())
            if id in seen:
                return False
            seen.add(id)
            return True

    def incr_counter(self, name: str, by: float = 1, once_id: str | None = None) -> float:
        with self._lock:
            if once_id and not self._counter_applied.setdefault(name, _Applied()).add(
                    once_id, self.dedupe_window_s, time.time()):
                return self._counters.get(name, 0.0)
            self._counters[name] = self._counters.get(name, 0.0) + float(by)
            return self._counters[name]

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    # --- admission control (expstream/rl/admission.py) ------------------------------------------
    def _ledger_windows(self, by_window: dict[int, dict[str, tuple[int, int]]]) -> list[dict[str, tuple[int, int]]]:
        """The live windows of ``by_window`` (RedisState's ``admission:<name>:<w>`` hashes), this one first;
        older ones are dropped, as their keys expire on Redis."""
        w = int(time.time()) // self.dedupe_window_s
        for old in [k for k in by_window if k <= w - ADMISSION_WINDOWS]:
            del by_window[old]
        return [by_window.setdefault(w - i, {}) for i in range(ADMISSION_WINDOWS)]

    def _bucket(self, version: int) -> int:
        return FOLDED if version < self._folded else int(version)

    def admit(self, batch_id: str, samples: int, version: int, bound: int) -> bool:
        """Admit ``samples`` under ``version`` iff admitted - lost + samples <= ``bound`` (see RedisState)."""
        check_admission("admit", batch_id, samples, version, bound)
        with self._lock:
            if any(batch_id in d for d in self._ledger_windows(self._delivered)):
                return True  # read again after its commit (a rewind): counted once
            prev = self._admitted_of.get(batch_id)
            if prev is not None:
                old_version, n = prev
                if version < old_version:  # never regenerate with older weights than admitted with
                    return False
                if old_version != version:  # regenerated under newer weights: its count moves along
                    self._admitted[self._bucket(old_version)] -= n
                    new = self._bucket(version)
                    self._admitted[new] = self._admitted.get(new, 0) + n
                    self._admitted_of[batch_id] = (int(version), n)
                return True
            if sum(self._admitted.values()) - sum(self._lost.values()) + int(samples) > int(bound):
                return False
            self._admitted_of[batch_id] = (int(version), int(samples))
            b = self._bucket(version)
            self._admitted[b] = self._admitted.get(b, 0) + int(samples)
            return True

    def record_lost(self, batch_id: str, version: int, samples: int) -> bool:
        """Count ``samples`` of ``version`` that never reach the trainer, once per ``batch_id`` (see RedisState)."""
        check_admission("record_lost", batch_id, samples, version)
        with self._lock:
            windows = self._ledger_windows(self._lost_of)
            if any(batch_id in d for d in windows):
                return False
            windows[0][batch_id] = (int(version), int(samples))
            b = self._bucket(version)
            self._lost[b] = self._lost.get(b, 0) + int(samples)
            return True

    def admission_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        with self._lock:
            return ({v: n for v, n in sorted(self._admitted.items()) if n},
                    {v: n for v, n in sorted(self._lost.items()) if n})

    def admitted_version(self, batch_id: str) -> int | None:
        with self._lock:
            prev = self._admitted_of.get(batch_id) or next(
                (d[batch_id] for d in self._ledger_windows(self._delivered) if batch_id in d), None)
            return prev[0] if prev is not None else None

    def mark_delivered(self, batch_ids: Sequence[str]) -> int:
        """Admitted records whose generate record is committed (see RedisState); returns how many are new."""
        with self._lock:
            here = self._ledger_windows(self._delivered)[0]
            new = [b for b in dict.fromkeys(batch_ids) if b in self._admitted_of]
            for b in new:
                here[b] = self._admitted_of.pop(b)
            return len(new)

    def fold_admission(self, below: int) -> int:
        """Sum the counts of every version < ``below`` under FOLDED (see RedisState); the fold point in effect."""
        if isinstance(below, bool) or not isinstance(below, int):
            raise ValueError(f"fold_admission: below must be an int, got {below!r}")
        with self._lock:
            if below <= self._folded:
                return self._folded
            for counts in (self._admitted, self._lost):
                old = [v for v in counts if 0 <= v < below]
                total = sum(counts.pop(v) for v in old)
                if total:
                    counts[FOLDED] = counts.get(FOLDED, 0) + total
            self._folded = int(below)
            return self._folded

    # --- the rewind handshake (expstream/tools/rewind.py) -----------------------------------------------
    def set_rewind_request(self, stage: str, request_id: str, ttl_s: float) -> None:
        with self._lock:
            self._rewind[stage] = (request_id, time.monotonic() + ttl_s)

    def rewind_request(self, stage: str) -> str | None:
        with self._lock:
            req = self._rewind.get(stage)
            return req[0] if req is not None and req[1] > time.monotonic() else None

    def ack_rewind(self, stage: str, request_id: str, replica_id: str, ttl_s: float) -> None:
        with self._lock:
            self._rewind_acks.setdefault(stage, {})[str(replica_id)] = (request_id, time.monotonic() + ttl_s)

    def rewind_acks(self, stage: str, request_id: str) -> set[str]:
        with self._lock:
            now = time.monotonic()
            return {r for r, (req, exp) in self._rewind_acks.get(stage, {}).items() if req == request_id and exp > now}

    def clear_rewind_request(self, stage: str) -> None:
        with self._lock:
            self._rewind.pop(stage, None)
            self._rewind_acks.pop(stage, None)
