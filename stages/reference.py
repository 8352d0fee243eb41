"""reference: per-token log-probs of the response under the reference (initial) model, in the
batch's layout (padded or packed)."""

from __future__ import annotations

from expstream.models.forward import forward_log_probs, vision_inputs_for
from expstream.models.resolve import model_dir
from schemas import SampleBatch
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models.hf import load_causal_lm

    ctx.models["lm"] = load_causal_lm(model_dir(ctx.topology, "reference"), device=ctx.topology.models.device)
    ctx.models["vision"] = vision_inputs_for(ctx, "reference")  # a vision-language reference (None otherwise)


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    logp, _ = forward_log_probs(ctx.models["lm"], batch, vision=ctx.models.get("vision"))
    return [batch.replace(base_action_log_probs=logp)]
