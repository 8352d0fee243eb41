"""Helpers shared by the stages: the model forwards that dispatch on ``SampleBatch.layout``. The
padded / packed views are in :mod:`expstream.rl.layout`; model directories are resolved by
:mod:`expstream.models.resolve`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from expstream.rl.layout import is_packed, packed, padded, ragged_from_flat, to_ragged
from schemas import Ragged, SampleBatch


def vision_inputs_for(ctx: Any, role: str) -> Any:
    """The :class:`expstream.models.vl.VisionInputs` of a stage whose ``models.<role>`` is a vision-language
    model (None for a text model)."""
    from expstream.models.resolve import model_dir
    from expstream.models.vl import vision_for

    return vision_for(ctx.topology, model_dir(ctx.topology, role))


def with_pixels(vision: Any, batch: SampleBatch) -> bool:
    """Whether ``batch`` goes through a vision-language model with its visual inputs: the model is a
    VL one (``vision`` not None) and some sample has an image or a video. Such a batch runs padded."""
    return vision is not None and (any(batch.images) or any(batch.videos or []))


def visual_inputs(vision: Any, batch: SampleBatch, lay: Any) -> dict[str, Any] | None:
    """A vision-language model's extra inputs for the padded layout ``lay`` of ``batch`` (None for a
    text model or a batch without images): pixels from the claim checks, the repaired input ids."""
    if not with_pixels(vision, batch):
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
    model's :class:`expstream.models.vl.VisionInputs` (images are fed in the padded layout)."""
    from expstream.models.passes import forward_action_log_probs, forward_packed_action_log_probs_and_entropy

    if with_pixels(vision, batch):
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


def forward_values(critic: Any, batch: SampleBatch, vision: Any = None) -> Ragged:
    """Per-action critic values V(state before action t), ragged (B; a_b), in the batch's layout.
    ``vision``: a vision-language critic's :class:`expstream.models.vl.VisionInputs` (images fed padded)."""
    from expstream.models import passes as models

    if with_pixels(vision, batch):
        lay = padded(batch)
        return to_ragged(models.forward_values(critic, lay.sequences, lay.attention_mask, lay.num_actions,
                                               visual=visual_inputs(vision, batch, lay)), batch)
    if is_packed(batch):
        pk = packed(batch)
        return ragged_from_flat(
            models.forward_packed_values(critic, pk.sequences, pk.position_ids, pk.seq_lens, pk.num_actions), batch)
    lay = padded(batch)
    return to_ragged(models.forward_values(critic, lay.sequences, lay.attention_mask, lay.num_actions), batch)


def forward_reward(rm: Any, batch: SampleBatch, vision: Any = None) -> np.ndarray:
    """Reward-model scores (B,) float32: at the last token of each sequence (the repaired EOS).
    ``vision``: a vision-language reward model's :class:`expstream.models.vl.VisionInputs` (images fed padded)."""
    from expstream.models import passes as models

    if with_pixels(vision, batch):
        lay = padded(batch)
        return scalar(models.forward_reward(rm, lay.sequences, lay.attention_mask,
                                            visual=visual_inputs(vision, batch, lay)))
    if is_packed(batch):
        pk = packed(batch)
        return scalar(models.forward_packed_reward(rm, pk.sequences, pk.position_ids, pk.seq_lens))
    lay = padded(batch)
    return scalar(models.forward_reward(rm, lay.sequences, lay.attention_mask))


def scalar(x: torch.Tensor) -> np.ndarray:
    """A model output as a float32 numpy array (detached, on the CPU)."""
    return x.detach().to(torch.float32).cpu().numpy().astype(np.float32)
