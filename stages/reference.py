"""reference: per-token log-probs of the response under the reference (initial) model."""

from __future__ import annotations

from schemas import SampleBatch
from stages.common import model_dir, padded, to_ragged
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models import load_causal_lm

    ctx.models["lm"] = load_causal_lm(model_dir(ctx.topology, "reference"), device=ctx.topology.models.device)


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    from expstream.models import forward_action_log_probs

    lay = padded(batch)
    logp, _ = forward_action_log_probs(ctx.models["lm"], lay.sequences, lay.attention_mask, lay.num_actions)
    return [batch.replace(base_action_log_probs=to_ragged(logp, batch))]
