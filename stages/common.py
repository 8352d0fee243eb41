"""Helpers shared by the stages: the model forwards that dispatch on ``SampleBatch.layout``. The
padded / packed views are in :mod:`expstream.layout`; model directories are resolved by
:mod:`expstream.resolve`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from expstream.layout import is_packed, packed, padded, ragged_from_flat, to_ragged
from schemas import Ragged, SampleBatch


def forward_log_probs(model: Any, batch: SampleBatch, with_entropy: bool = False) -> tuple[Ragged, Ragged | None]:
    """Per-action log-probs (and entropies when asked) of a causal LM, ragged (B; a_b), in the
    batch's layout (docs/numerics.md §1.3 padded, §1.4 packed)."""
    from expstream.models import forward_action_log_probs, forward_packed_action_log_probs_and_entropy

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
