"""Helpers shared by the stages: the model forwards that dispatch on ``SampleBatch.layout``. The
padded / packed views are in :mod:`expstream.layout`; model directories are resolved by
:mod:`expstream.resolve`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from expstream.layout import is_packed, packed, padded, ragged_from_flat, to_ragged
from schemas import Ragged, SampleBatch


def vision_inputs_for(ctx: Any, role: str) -> Any:
    """The :class:`expstream.vl.VisionInputs` of a stage whose ``models.<role>`` is a vision-language
    model (None for a text model)."""
    from expstream.resolve import model_dir
    from expstream.vl import is_vl_dir, vision_for

    path = model_dir(ctx.topology, role)
    if not is_vl_dir(path):
        return None
    from expstream.models import load_tokenizer

    return vision_for(ctx.topology, path, load_tokenizer(path))


def visual_inputs(vision: Any, batch: SampleBatch, lay: Any) -> dict[str, Any] | None:
    """A vision-language model's extra inputs for the padded layout ``lay`` of ``batch`` (None for a
    text model or a batch without images): pixels from the claim checks, the repaired input ids."""
    if vision is None or not (any(batch.images) or any(batch.videos)):
        return None
    inputs = lay.sequences.clone()
    kw = vision.model_kwargs(inputs, batch.images, batch.sample_ids(), [lay.prompt_width] * len(batch),
                             videos=batch.videos)
    kw["input_ids"] = inputs
    return kw


def forward_log_probs(model: Any, batch: SampleBatch, with_entropy: bool = False,
                      vision: Any = None) -> tuple[Ragged, Ragged | None]:
    """Per-action log-probs (and entropies when asked) of a causal LM, ragged (B; a_b), in the
    batch's layout (docs/numerics.md §1.3 padded, §1.4 packed). ``vision``: a vision-language
    model's :class:`expstream.vl.VisionInputs` (images are fed in the padded layout)."""
    from expstream.models import forward_action_log_probs, forward_packed_action_log_probs_and_entropy

    if vision is not None and (any(batch.images) or any(batch.videos)):
        lay = padded(batch)
        logp, entropy = forward_action_log_probs(model, lay.sequences, lay.attention_mask, lay.num_actions,
                                                 with_entropy=with_entropy, visual=visual_inputs(vision, batch, lay))
        return to_ragged(logp, batch), None if entropy is None else to_ragged(entropy, batch)
    if is_packed(batch):
        pk = packed(batch)
        logp, entropy = forward_packed_action_log_probs_and_entropy(
            model, pk.sequences, pk.position_ids, pk.seq_lens, pk.num_actions, with_entropy=with_entropy)
        return ragged_from_flat(logp, batch), None if entropy is None else ragged_from_flat(entropy, batch)
    lay = padded(batch)
    logp, entropy = forward_action_log_probs(model, lay.sequences, lay.attention_mask, lay.num_actions,
                                             with_entropy=with_entropy)
    return to_ragged(logp, batch), None if entropy is None else to_ragged(entropy, batch)


def forward_values(critic: Any, batch: SampleBatch) -> Ragged:
    """Per-action critic values V(state before action t), ragged (B; a_b), in the batch's layout."""
    from expstream import models

    if is_packed(batch):
        pk = packed(batch)
        return ragged_from_flat(
            models.forward_packed_values(critic, pk.sequences, pk.position_ids, pk.seq_lens, pk.num_actions), batch)
    lay = padded(batch)
    return to_ragged(models.forward_values(critic, lay.sequences, lay.attention_mask, lay.num_actions), batch)


def forward_reward(rm: Any, batch: SampleBatch) -> np.ndarray:
    """Reward-model scores (B,) float32: at the last token of each sequence (the repaired EOS)."""
    from expstream import models

    if is_packed(batch):
        pk = packed(batch)
        return scalar(models.forward_packed_reward(rm, pk.sequences, pk.position_ids, pk.seq_lens))
    lay = padded(batch)
    return scalar(models.forward_reward(rm, lay.sequences, lay.attention_mask))


def scalar(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).cpu().numpy().astype(np.float32)
