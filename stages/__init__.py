"""The eight stages. Each module has ``setup(ctx)`` and ``process(batch, ctx) -> list[SampleBatch]``."""

from __future__ import annotations

from types import ModuleType

from stages import (
    actor_logprob,
    advantage,
    critic,
    generate,
    postprocess,
    reference,
    reward,
    shard_preprocess,
)

STAGES: dict[str, ModuleType] = {
    "generate": generate,
    "shard-preprocess": shard_preprocess,
    "actor-logprob": actor_logprob,
    "reference": reference,
    "critic": critic,
    "reward": reward,
    "postprocess": postprocess,
    "advantage": advantage,
}
