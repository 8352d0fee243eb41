"""critic: per-token values V_t of the state before action t (token-classification head,
docs/numerics.md §1.3), in the batch's layout (padded or packed).

A vision-language critic (expstream/models/vl.py VisionValueModel) is fed the samples' pixels, grids and
``mm_token_type_ids`` like actor-logprob feeds the actor; a batch with images then runs padded.
"""

from __future__ import annotations

from expstream.models.forward import forward_values, vision_inputs_for
from expstream.models.resolve import model_dir
from expstream.train.weights import follower_for, refresh_weights
from schemas import SampleBatch
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models.vl import load_critic

    ctx.models["critic"] = load_critic(model_dir(ctx.topology, "critic"), device=ctx.topology.models.device)
    ctx.models["vision"] = vision_inputs_for(ctx, "critic")  # a vision-language critic (None otherwise)
    # The continuous loop: follow the trainer's critic versions when it trains one (None otherwise).
    ctx.models["critic_follower"] = follower_for(ctx, "critic", ctx.models["critic"])


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    refresh_weights(ctx, "critic")  # a newer critic version, loaded between micro-batches
    return [batch.replace(values=forward_values(ctx.models["critic"], batch, vision=ctx.models.get("vision")))]
