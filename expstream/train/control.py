"""What a trainer tells a running pipeline: its KL (for the adaptive controller) and new policy versions.

The KL coefficient β lives in Redis so that every postprocess replica uses the same value. With
``algo.kl_target`` null (the default) the controller is fixed: β stays ``algo.init_kl_coef`` and
reports change nothing. With a target, each report applies docs/numerics.md §10 once per ``step_id``:

    e = clip(kl / target − 1, −0.2, 0.2);   β ← β · (1 + e · n_steps / horizon)

where ``n_steps`` defaults to ``rollout_batch_size`` (samples per step), as in the seed's
``kl_ctl.update(status.kl, rollout_batch_size * n)``. A report repeated with the same step id
(a trainer retrying) is applied once.
"""

from __future__ import annotations

from expstream.config.topology import Topology
from expstream.state import RedisState


class PipelineControl:
    def __init__(self, redis_url: str, run_id: str, topology: Topology) -> None:
        self.topology = topology
        self.state = RedisState(redis_url, run_id, group_ttl_s=topology.redis.group_ttl_s)

    def kl_coef(self) -> float:
        """The β the postprocess stages use now."""
        return self.state.kl_coef(self.topology.algo.init_kl_coef)

    def report_kl(self, step_id: str, kl: float, n_steps: int | None = None) -> float:
        """Report the trainer's measured KL for one step; returns β after the update."""
        algo = self.topology.algo
        current = self.kl_coef()
        if algo.kl_target is None:
            return current
        steps = int(n_steps if n_steps is not None else algo.rollout_batch_size)
        return self.state.update_kl_adaptive(step_id, float(kl), float(algo.kl_target), steps,
                                              int(algo.kl_horizon), default=algo.init_kl_coef)

    def set_policy_version(self, version: int) -> int:
        """Announce new actor weights; generate stamps later rollouts with this version."""
        return self.state.set_policy_version(int(version))

    def close(self) -> None:
        self.state.close()
