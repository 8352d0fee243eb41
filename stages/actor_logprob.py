"""actor-logprob: per-token log-probs (and entropy when asked) of the response under the actor (§1.3)."""

from __future__ import annotations

from schemas import SampleBatch
from stages.common import model_dir, padded, to_ragged
from stages.context import StageContext

MODEL_ROLE = "actor"


def setup(ctx: StageContext) -> None:
    from expstream.models import load_causal_lm

    ctx.models["lm"] = load_causal_lm(model_dir(ctx.topology, MODEL_ROLE), device=ctx.topology.models.device)


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    from expstream.models import forward_action_log_probs

    lay = padded(batch)
    want_entropy = ctx.topology.algo.high_entropy_token_ratio > 0
    logp, entropy = forward_action_log_probs(ctx.models["lm"], lay.sequences, lay.attention_mask,
                                             lay.num_actions, with_entropy=want_entropy)
    changes = {"action_log_probs": to_ragged(logp, batch)}
    if entropy is not None:
        changes["action_entropy"] = to_ragged(entropy, batch)
    return [batch.replace(**changes)]
