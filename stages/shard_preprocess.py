"""shard-preprocess: rollouts -> model-ready micro-batches (docs/numerics.md §1.1-1.2).

The EOS repair and action mask depend on the micro-batch's widths, so they are computed here,
once, and travel as ragged ``action_ids``/``action_mask``; every later stage rebuilds the same
padded tensors from them whatever batch it ends up in.

``layout`` says how the model stages run: ``"padded"`` (B, P+A) rows, or ``"packed"`` with
``algo.packing_samples`` (one (1, T) row, no padding, docs/numerics.md §1.4). The repair is the same in both,
so the log-probs, values, rewards and everything after them agree between the layouts; only the
model forwards differ.

A multi-turn episode (``turn_lengths`` set, docs/multi_turn.md) has its observation tokens inside the
response: the same layout and repair, then ``action_mask`` is False on them (they are attended, never
actions), so every later pass and estimator leaves them out.

The behaviour log-probs from generate (``rollout_log_probs``, one per generated token) are moved
onto the repaired actions here (:func:`expstream.rl.layout.align_rollout_log_probs`): a token the
repair wrote or appended gets 0.0.
"""

from __future__ import annotations

import numpy as np

from expstream.errors import PoisonRecordError
from expstream.rl.episodes import model_token_mask
from expstream.rl.layout import action_lengths, align_rollout_log_probs, padded_layout, rows_of
from expstream.rl.versions import align_token_versions
from schemas import Ragged, SampleBatch
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    return None


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    if batch.layout:
        raise PoisonRecordError(f"SampleBatch.layout: {batch.layout!r} already; shard-preprocess takes raw "
                                "rollouts (layout \"\") from generate")
    mrb = ctx.topology.algo.micro_rollout_batch_size
    layout_name = "packed" if ctx.topology.algo.packing_samples else "padded"
    out = []
    for j, start in enumerate(range(0, len(batch), mrb)):
        idx = list(range(start, min(start + mrb, len(batch))))
        mb = batch.select(idx, batch_id=f"{batch.batch_id}/m{j}")
        layout = padded_layout(rows_of(mb.prompt_ids), rows_of(mb.response_ids), mb.eos_token_id, mb.pad_token_id)
        lengths = action_lengths(layout.action_mask)
        p = layout.prompt_width
        action_rows = [layout.sequences[b, p: p + int(n)].numpy().astype(np.int32) for b, n in enumerate(lengths)]
        mask_rows = [layout.action_mask[b, : int(n)].numpy() for b, n in enumerate(lengths)]
        if mb.turn_lengths is not None:  # a multi-turn episode: observation tokens are not actions
            mask_rows = [_model_only(m, t) for m, t in zip(mask_rows, mb.turn_lengths.rows(), strict=True)]
        changes = {"layout": layout_name, "action_ids": Ragged.from_rows(action_rows, "int32"),
                   "action_mask": Ragged.from_rows(mask_rows, "bool")}
        if mb.rollout_log_probs is not None:  # response-level -> aligned with action_ids
            rollout = align_rollout_log_probs(mb.response_ids.rows(), mb.rollout_log_probs.rows(), action_rows)
            changes["rollout_log_probs"] = Ragged.from_rows(rollout, "float32")
        if mb.token_versions is not None:  # per-token versions (in-flight updates): the same alignment
            versions = align_token_versions(mb.response_ids.rows(), mb.token_versions.rows(), action_rows)
            changes["token_versions"] = Ragged.from_rows(versions, "int32")
        # one replace: rollout_log_probs (and token_versions) turn action-level in the same step as action_ids appears
        out.append(mb.replace(**changes))
    return out


def _model_only(mask: np.ndarray, turn_lengths: np.ndarray) -> np.ndarray:
    """``mask`` with its positions on observation tokens False (action t is response token t; an EOS the
    repair appended past the response keeps its value)."""
    model = model_token_mask(turn_lengths)
    out = mask.copy()
    n = min(len(out), len(model))
    out[:n] &= model[:n]
    return out
