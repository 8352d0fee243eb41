"""actor-logprob: per-token log-probs (and entropy when asked) of the response under the
actor (docs/numerics.md §1.3).

Runs in the batch's layout (padded, or packed with ``algo.packing_samples``); the output is ragged
(B; a_b) either way.
"""

from __future__ import annotations

from expstream.models.forward import forward_log_probs, vision_inputs_for
from expstream.models.resolve import model_dir
from expstream.train.weights import follower_for, refresh_weights
from schemas import SampleBatch
from stages.context import StageContext

MODEL_ROLE = "actor"


def setup(ctx: StageContext) -> None:
    from expstream.models.hf import load_causal_lm

    ctx.models["lm"] = load_causal_lm(model_dir(ctx.topology, MODEL_ROLE), device=ctx.topology.models.device)
    ctx.models["vision"] = vision_inputs_for(ctx, MODEL_ROLE)  # a vision-language actor (None otherwise)
    # The continuous loop: follow the trainer's published actor versions (None otherwise).
    ctx.models["actor_follower"] = follower_for(ctx, "actor", ctx.models["lm"])


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    version = refresh_weights(ctx, "actor")  # loaded between micro-batches; stamped as logprob_version
    want_entropy = ctx.topology.algo.high_entropy_token_ratio > 0
    logp, entropy = forward_log_probs(ctx.models["lm"], batch, with_entropy=want_entropy,
                                      vision=ctx.models.get("vision"))
    changes = {"action_log_probs": logp, "logprob_version": [int(version)] * len(batch)}
    if entropy is not None:
        changes["action_entropy"] = entropy
    return [batch.replace(**changes)]
