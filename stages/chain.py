"""Chained stages: consecutive stages in one process, the micro-batch handed over in memory.

A chain (``chains:`` in topology.yaml; expstream/config/chains.py) runs through the one runner
(stages/runner.py) as if it were one stage: it reads the first stage's input topic under the first
stage's consumer group and writes the last stage's output topic; the topics between its stages are
never created. :class:`Chain` offers the runner what a stage module does (``setup``, ``process``,
``committed``, ``teardown``), so the commit protocol is the runner's: an input record's offset is
committed after the last stage's outputs (and any dead letter) are acknowledged, and a crash redoes
the whole chain for the uncommitted records (every stage's state update is idempotent by batch id,
and an inner stage sees the same batch ids as unchained: ``x``, or ``x~lo-hi`` after a bisection).

What stays per stage inside the chain:

* **Dead letters** name the stage that failed (the ``stage`` header, via :func:`tag_failure`); a
  letter carries the chain's *input* record (or the bisected input rows of the failing samples), so
  a redrive sends it to the chain's input and the whole chain runs it again.
* **Statistics** (``expstream status``, summary.json): each inner stage's time, samples and flow
  (in = out + dead) are recorded under its own name, per input record (:meth:`Chain.rows`).
* **Metrics**: each inner stage's ``expstream_batch_seconds``, records and samples carry
  ``stage=<its name>`` in the chain process's registry (expstream/observe/metrics.py), beside the
  chain's own series under its first stage's name.
* Each inner stage's ``committed`` hook gets the batches *it* processed for the committed records,
  and ``teardown`` runs for each.
* A finite run's last flush (a held normalisation window, ``end_of_input``) is the last stage's, called
  by ``expstream run`` on the run state (expstream/launch/collect.py), chained or not.

What a chained hop does not have: its records are never on a topic, so they are not recorded, not
in ``expstream topics tail``, and a rewind or a replay starts at the chain's input (docs/replay.md).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from expstream.config.chains import Unit
from schemas import PromptBatch, SampleBatch
from stages import STAGES
from stages import teardown as stage_teardown
from stages.context import StageContext
from stages.deadletters import tag_failure

__all__ = ["Chain", "root_id"]

# Why 4096: records whose commit never comes (revoked mid-way) must not grow the in-hand table forever.
MAX_IN_HAND = 4096


def root_id(batch_id: str) -> str:
    """The input record's batch id of a (possibly bisected, ``x~lo-hi``) batch id."""
    return batch_id.split("~", 1)[0]


@dataclass
class _Work:
    """What one input record made each inner stage do (reset when the record is worked on again)."""

    inputs: dict[str, list[Any]] = field(default_factory=dict)  # stage -> the batches it processed
    seconds: dict[str, float] = field(default_factory=dict)
    samples_in: dict[str, int] = field(default_factory=dict)
    samples_out: dict[str, int] = field(default_factory=dict)


def _samples(batch: Any, n: int) -> int:
    if isinstance(batch, PromptBatch):
        return len(batch) * n
    return len(batch) if isinstance(batch, SampleBatch) else 0


class Chain:
    """The stages of one unit over one :class:`StageContext` each (sharing state, run id, replica)."""

    def __init__(self, unit: Unit, ctx: StageContext) -> None:
        """
        Args:
            unit: the chain (expstream/config/chains.py).
            ctx: the runner's context: its ``stage`` reads the first stage's input and writes the last
                stage's output (:meth:`runner_stage`); each inner stage gets a copy with its own stage.
        """
        self.unit = unit
        topo = ctx.topology
        self.contexts = {name: replace(ctx, stage=topo.stages[name], models={},
                                       log=logging.getLogger(f"expstream.stage.{name}")) for name in unit.stages}
        self.n = topo.generate.n_samples_per_prompt
        self.work: dict[str, _Work] = {}  # input record's batch id -> what it made each stage do
        self.lock = threading.Lock()  # process (worker thread) and rows, committed (confirm thread)

    @staticmethod
    def runner_stage(unit: Unit, topo: Any) -> Any:
        """The StageConfig the runner runs: the first stage's name, input, replicas and autoscale, the last
        stage's output."""
        head = topo.stages[unit.head]
        return replace(head, output=topo.stages[unit.last].output)

    def bind(self, ctx: StageContext) -> None:
        """Share the runner's stop flag and give each inner stage its own metrics labels."""
        for name, inner in self.contexts.items():
            inner.should_stop = lambda: ctx.should_stop()  # the runner sets ctx.should_stop after binding
            inner.metrics = ctx.metrics.for_stage(name) if ctx.metrics is not None else None

    # -- the stage contract ----------------------------------------------------------------
    def setup(self, _ctx: StageContext | None = None) -> None:
        for name in self.unit.stages:
            STAGES[name].setup(self.contexts[name])

    def process(self, batch: Any, _ctx: StageContext | None = None) -> list[Any]:
        """Every stage in turn over what the previous one made; a failure is tagged with its stage."""
        rid = root_id(batch.batch_id)
        with self.lock:
            if batch.batch_id == rid or rid not in self.work:  # a record worked on (again) from the start
                if len(self.work) >= MAX_IN_HAND:
                    self.work.pop(next(iter(self.work)))
                self.work[rid] = _Work()
        done = _Work()
        data = [batch]
        for name in self.unit.stages:
            ctx, module, out = self.contexts[name], STAGES[name], []
            started = time.perf_counter()
            for b in data:
                try:
                    made = module.process(b, ctx)
                except BaseException as exc:
                    tag_failure(exc, name)
                    raise
                out.extend([made] if isinstance(made, (SampleBatch, PromptBatch)) else made)
            seconds = time.perf_counter() - started
            done.inputs[name] = data
            done.seconds[name] = seconds
            done.samples_in[name] = sum(_samples(b, self.n) for b in data)
            done.samples_out[name] = sum(_samples(b, self.n) for b in out)
            if ctx.metrics is not None:
                ctx.metrics.observe_batches(len(data), done.samples_in[name], seconds)
            data = out
        self._merge(rid, done)  # only a call that went through: a failed one left letters, counted apart
        return data

    def _merge(self, rid: str, done: _Work) -> None:
        with self.lock:
            work = self.work.setdefault(rid, _Work())
        for name in done.inputs:
            work.inputs.setdefault(name, []).extend(done.inputs[name])
            work.seconds[name] = work.seconds.get(name, 0.0) + done.seconds[name]
            work.samples_in[name] = work.samples_in.get(name, 0) + done.samples_in[name]
            work.samples_out[name] = work.samples_out.get(name, 0) + done.samples_out[name]

    def committed(self, batches: list, _ctx: StageContext | None = None) -> None:
        """Each inner stage's hook with the batches it processed for these committed records."""
        with self.lock:
            works = [self.work.pop(root_id(b.batch_id), None) for b in batches]
        for name in self.unit.stages:
            hook = getattr(STAGES[name], "committed", None)
            mine = [b for w in works if w is not None for b in w.inputs.get(name, [])]
            if hook is not None and mine:
                hook(mine, self.contexts[name])

    def teardown(self, _ctx: StageContext | None = None) -> None:
        for name in self.unit.stages:
            stage_teardown(self.contexts[name])

    # -- statistics --------------------------------------------------------------------------
    def rows(self, batch_id: str, dead: dict[str, int]) -> dict[str, tuple]:
        """Each inner stage's ``state.record_batches`` row for one input record (stages/commitgroup.py).

        ``dead``: samples dead-lettered per failing stage. A stage before the one that failed counts those
        samples in and out (it handed them on), the failing one in and dead, a later one nothing (as the
        unchained stages would have). A stage that never ran for the record has no row."""
        with self.lock:
            work = self.work.get(root_id(batch_id)) or _Work()
        order = self.unit.stages
        out: dict[str, tuple] = {}
        for k, name in enumerate(order):
            later = sum(d for s, d in dead.items() if order.index(s) > k)
            here = dead.get(name, 0)
            s_in = work.samples_in.get(name, 0) + later + here
            if name not in work.inputs and not s_in:
                continue
            flow = {"in": s_in, "out": work.samples_out.get(name, 0) + later, "dead": here}
            out[name] = (batch_id, flow, work.seconds.get(name), s_in)
        return out
