"""critic: per-token values V_t of the state before action t (token-classification head, §1.3)."""

from __future__ import annotations

from schemas import SampleBatch
from stages.common import model_dir, padded, to_ragged
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models import load_critic

    ctx.models["critic"] = load_critic(model_dir(ctx.topology, "critic"), device=ctx.topology.models.device)


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    from expstream.models import forward_values

    lay = padded(batch)
    values = forward_values(ctx.models["critic"], lay.sequences, lay.attention_mask, lay.num_actions)
    return [batch.replace(values=to_ragged(values, batch))]
