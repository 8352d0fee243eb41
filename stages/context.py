"""What every stage's ``process(batch, ctx)`` is handed: configuration, state and its models."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from expstream.config.topology import StageConfig, Topology
from expstream.state import MemoryState, State


@dataclass
class StageContext:
    topology: Topology
    stage: StageConfig
    # Never None: RedisState in stage processes, MemoryState in-process (LocalChain, tests, replay).
    state: State = field(default_factory=MemoryState)
    models: dict[str, Any] = field(default_factory=dict)  # filled by the stage's setup()
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("expstream.stage"))
    run_id: str = "local"
    replica_id: str = "0"
    # True once the process was asked to stop (SIGTERM): long work (a generation) checks it and
    # raises expstream.errors.ShutdownRequested, abandoning the micro-batch uncommitted.
    should_stop: Callable[[], bool] = lambda: False
    # expstream.observe.metrics.StageMetrics of a stage process (set by the runner); None in-process (tests, LocalChain)
    metrics: Any = None


@dataclass
class BackToInput:
    """An output of ``process`` that goes to the stage's own input topic instead of its output topic: generate's
    partial generations, continued by whichever replica reads them (docs/async.md "Resumable generations")."""

    batch: Any


def make_context(topology: Topology, stage_name: str, state: State | None = None, run_id: str = "local",
                 replica_id: str = "0") -> StageContext:
    """A context for calling a stage in-process (tests, replay, the synchronous bench).

    Without ``state`` the stage gets a fresh :class:`MemoryState` of its own; pass one state to
    several contexts to let them share groups and windows (LocalChain does).
    """
    return StageContext(
        topology=topology,
        stage=topology.stages[stage_name],
        state=state if state is not None else MemoryState(run_id),
        log=logging.getLogger(f"expstream.stage.{stage_name}"),
        run_id=run_id,
        replica_id=replica_id,
    )


@dataclass
class Routed:
    """An output of ``process`` for a topic other than the stage's output (the environment stage sends
    unfinished episodes back to generate on the turns topic); the runner sends ``batch`` to ``topic``."""

    topic: str
    batch: Any
