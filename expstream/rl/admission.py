"""Bounded staleness by backpressure: generate's admission control and the trainer's gate.

Admission (generate, :func:`wait_for_admission`): a prompt record of ``s`` samples, to be generated
by the loaded weights of version ``v``, starts only if ``admitted - lost + s <= (v + k + 1) * B``
(:func:`admission_bound`; one atomic check-and-add in the run state, shared by every replica);
otherwise generate waits with its partitions paused. The gate (the trainer,
:class:`StalenessGate`): before step ``u`` wait for the stragglers of versions ``<= u - k``, then
train every buffered sample with ``v <= u - k`` plus the oldest others, up to ``B``. Together no
trained sample has staleness > ``k = async.max_staleness`` and steps stay about ``B``.

The proof, idempotence per root batch id, rewinds and the crash cases that break the counts:
docs/async.md, "Staleness is bounded by backpressure". The ledger stays bounded (same page, "The
ledger stays bounded"): the trainer folds the versions below its checkpoint's step - k into one
total (``State.fold_admission``, the key ``-1`` of ``admission_counts``), which the gate never waits
for, and delivered records are kept for a horizon of windows of ``redis.dedupe_window_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from expstream.config.topology import Topology
from expstream.errors import ShutdownRequested

__all__ = [
    "ADMISSION_POLL_S",
    "BLOCKED_LOG_EVERY_S",
    "StalenessGate",
    "admission_bound",
    "admission_id",
    "backpressure_on",
    "blocked_counter",
    "wait_for_admission",
]

# Why 200 ms: a newly published version is noticed within 200 ms, which is small next to a training
# step (seconds); one Redis script call per blocked replica per 200 ms is negligible load.
ADMISSION_POLL_S = 0.2
# Why 30 s: a long block is restated in the log this often, so an operator sees why generate is idle
# without a line per poll.
BLOCKED_LOG_EVERY_S = 30.0


def admission_bound(version: int, k: int, batch_size: int) -> int:
    """``(version + k + 1) * batch_size``: the samples admitted and not lost that version ``version``
    may bring the run to (see the module docstring)."""
    return (int(version) + int(k) + 1) * int(batch_size)


def admission_id(batch_id: str) -> str:
    """The id a record is admitted under: a split sub-batch ``<id>~<lo>-<hi>`` belongs to ``<id>``."""
    return batch_id.split("~", 1)[0]


def backpressure_on(topology: Topology) -> bool:
    """True when generate admits by the bound: the loop runs and ``async.on_stale`` is backpressure."""
    return bool(topology.train.enabled) and topology.async_.on_stale == "backpressure"


def blocked_counter(stage: str) -> str:
    """The run-state counter of seconds ``stage`` spent blocked by backpressure."""
    return f"blocked_s:{stage}"


def wait_for_admission(ctx, batch_id: str, samples: int, refresh: Callable[[], int]) -> int:
    """Block until the record ``batch_id`` (``samples`` samples) is admitted; returns the policy version
    it is admitted under (= the version of the weights ``refresh()`` has loaded: stamp it on the samples).

    1. Loop off (``train.enabled`` false or ``async.on_stale: drop``): ``refresh()`` once and return.
    2. A split sub-batch whose root is admitted: the root's version, without reloading (the weights the
       root was admitted with are still the ones loaded in this process).
    3. Otherwise, until admitted: ``v = refresh()`` (loads newer weights if any), ``state.admit(root,
       samples, v, admission_bound(v, k, B))``; when refused, sleep :data:`ADMISSION_POLL_S` (adding the
       time to the counter ``blocked_s:<stage>``), raising ``ShutdownRequested`` once ``ctx.should_stop()``.
    """
    if not backpressure_on(ctx.topology):
        return int(refresh())
    state = ctx.state
    root = admission_id(batch_id)
    if root != batch_id:
        version = state.admitted_version(root)
        if version is not None:
            return version
    k, size = ctx.topology.async_.max_staleness, ctx.topology.train.batch_size
    counter = blocked_counter(ctx.stage.name)
    started = last_log = None
    while True:
        version = int(refresh())
        if state.admit(root, int(samples), version, admission_bound(version, k, size)):
            if started is not None:
                ctx.log.info("%s batch=%s: admitted under policy version %d after %.1fs blocked by backpressure",
                             ctx.stage.name, batch_id, version, time.monotonic() - started)
            return version
        now = time.monotonic()
        if started is None or now - last_log >= BLOCKED_LOG_EVERY_S:
            admitted, lost = state.admission_counts()
            ctx.log.info("%s batch=%s: blocked by backpressure: %d samples admitted and not lost + %d > bound "
                         "(v+k+1)*B = (%d+%d+1)*%d = %d; waiting for a newer policy version (async.max_staleness)",
                         ctx.stage.name, batch_id, sum(admitted.values()) - sum(lost.values()), samples, version, k,
                         size, admission_bound(version, k, size))
            last_log = now
            started = now if started is None else started
        if ctx.should_stop():
            raise ShutdownRequested(f"stop requested while batch {batch_id} waited for admission")
        time.sleep(ADMISSION_POLL_S)
        state.incr_counter(counter, time.monotonic() - now)


@dataclass
class StalenessGate:
    """The trainer's side of bounded staleness (pure logic; the counts come from the run state).

    ``add`` every received sample; before step ``u`` wait while ``wait_for(u, admitted, lost)`` names
    versions (stragglers), then train ``select(versions of the buffered samples, u)``.
    """

    k: int
    batch_size: int
    received: dict[int, int] = field(default_factory=dict)  # version -> unique (sample id, version) pairs
    _seen: set[tuple[str, int]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"StalenessGate: k (async.max_staleness) must be >= 0, got {self.k}")
        if self.batch_size < 1:
            raise ValueError(f"StalenessGate: batch_size (train.batch_size) must be >= 1, got {self.batch_size}")

    def add(self, sample_id: str, version: int) -> bool:
        """Count one received sample; a repeated (sample_id, version) pair counts once. True if new."""
        key = (str(sample_id), int(version))
        if key in self._seen:
            return False
        self._seen.add(key)
        self.received[key[1]] = self.received.get(key[1], 0) + 1
        return True

    def wait_for(self, step: int, admitted: dict[int, int], lost: dict[int, int]) -> list[int]:
        """Versions ``v <= step - k`` with samples admitted and neither received nor lost: the
        stragglers to wait for before ``step`` (ascending). Negative keys (the total of the versions
        folded away, ``State.fold_admission``: no step can train them any more) are never waited for."""
        return [v for v in sorted(admitted) if 0 <= v <= step - self.k
                and admitted[v] > self.received.get(v, 0) + lost.get(v, 0)]

    def forget_below(self, version: int) -> None:
        """Drop what the gate keeps of versions ``< version`` (folded in the run state: never waited for)."""
        self.received = {v: n for v, n in self.received.items() if v >= version}
        self._seen = {key for key in self._seen if key[1] >= version}

    def select(self, buffer_versions: list[int], step: int) -> list[int]:
        """Indices into the buffer to train at ``step``: every sample with ``v <= step - k`` (mandatory,
        however many), then the oldest versions first up to ``batch_size``; oldest first, stable."""
        order = sorted(range(len(buffer_versions)), key=lambda i: (int(buffer_versions[i]), i))
        mandatory = [i for i in order if int(buffer_versions[i]) <= step - self.k]
        rest = [i for i in order if int(buffer_versions[i]) > step - self.k]
        return mandatory + rest[:max(0, self.batch_size - len(mandatory))]

    def staleness_ok(self, step: int, version: int) -> bool:
        """True when a sample of ``version`` may be trained at ``step`` (staleness ``step - version <= k``)."""
        return int(step) - int(version) <= self.k

    def in_flight(self, admitted: dict[int, int], lost: dict[int, int]) -> int:
        """Samples admitted and neither received nor lost, over every version not folded away (a sample of
        a folded version would be stale on arrival)."""
        return sum(max(0, n - self.received.get(v, 0) - lost.get(v, 0)) for v, n in admitted.items() if v >= 0)

    def starved(self, step: int, admitted: dict[int, int], lost: dict[int, int], record_samples: int) -> bool:
        """True when no more samples can arrive before step ``step`` publishes: nothing admitted is in flight
        and the room left under the bound of version ``step`` is smaller than one prompt record of
        ``record_samples`` samples (losses left a gap). The trainer then trains the short batch it has
        instead of waiting for ``batch_size`` samples that backpressure will never let in."""
        outstanding = sum(admitted.values()) - sum(lost.values())
        room = admission_bound(step, self.k, self.batch_size) - outstanding
        return self.in_flight(admitted, lost) == 0 and room < record_samples
