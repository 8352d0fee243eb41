"""What every stage's ``process(batch, ctx)`` is handed: configuration, state and its models."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from expstream.topology import StageConfig, Topology


@dataclass
class StageContext:
    topology: Topology
    stage: StageConfig
    state: Any = None  # expstream.state.RedisState, or None for pure in-memory runs
    models: dict[str, Any] = field(default_factory=dict)  # filled by the stage's setup()
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("expstream.stage"))
    run_id: str = "local"
    replica_id: str = "0"

    def require_state(self) -> Any:
        if self.state is None:
            raise RuntimeError(
                f"stage {self.stage.name}: needs Redis state (ctx.state) for this configuration; "
                "pass a RedisState when calling process() outside the runner"
            )
        return self.state


def make_context(topology: Topology, stage_name: str, state: Any = None, run_id: str = "local",
                 replica_id: str = "0") -> StageContext:
    """A context for calling a stage in-process (tests, replay, the synchronous bench)."""
    return StageContext(
        topology=topology,
        stage=topology.stages[stage_name],
        state=state,
        log=logging.getLogger(f"expstream.stage.{stage_name}"),
        run_id=run_id,
        replica_id=replica_id,
    )
