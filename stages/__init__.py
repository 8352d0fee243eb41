"""The eight stages (nine with a multi-turn run's environment), and the contract every stage module keeps.

Required: ``setup(ctx) -> None`` (load models into ``ctx.models``) and
``process(batch, ctx) -> list[SampleBatch]`` (one input micro-batch -> zero or more outputs).

Optional hooks, for a stage that holds samples back across calls (in ``ctx.state``):

* ``held_samples(ctx) -> int`` — how many samples it holds that only ``end_of_input`` can release;
* ``end_of_input(ctx) -> list[SampleBatch]`` — the input is finite and ended: release them.

And one for a stage that holds resources beyond its models: ``teardown(ctx) -> None`` — close them
(HTTP sessions, thread pools); called once when the stage process ends (expstream/launch/replica.py), safe to
call twice.

``expstream run`` (a finite prompt file) and LocalChain call :func:`end_of_input` once all input
has gone through; a stage without the hooks holds nothing back.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from stages import (
    actor_logprob,
    advantage,
    critic,
    environment,
    generate,
    postprocess,
    reference,
    reward,
    shard_preprocess,
)

if TYPE_CHECKING:
    from schemas import SampleBatch
    from stages.context import StageContext

STAGES: dict[str, ModuleType] = {
    "generate": generate,
    "environment": environment,
    "shard-preprocess": shard_preprocess,
    "actor-logprob": actor_logprob,
    "reference": reference,
    "critic": critic,
    "reward": reward,
    "postprocess": postprocess,
    "advantage": advantage,
}


def held_samples(ctx: StageContext) -> int:
    """Samples ``ctx.stage`` holds back until the end of input (0 for a stage without the hook)."""
    hook = getattr(STAGES[ctx.stage.name], "held_samples", None)
    return int(hook(ctx)) if hook is not None else 0


def end_of_input(ctx: StageContext) -> list[SampleBatch]:
    """Release what ``ctx.stage`` holds back at the end of a finite input ([] without the hook)."""
    hook = getattr(STAGES[ctx.stage.name], "end_of_input", None)
    return list(hook(ctx)) if hook is not None else []


def teardown(ctx: StageContext) -> None:
    """Release what ``ctx.stage`` holds beyond its models (a no-op for a stage without the hook)."""
    hook = getattr(STAGES[ctx.stage.name], "teardown", None)
    if hook is not None:
        hook(ctx)
