"""Helpers shared by the stages: the model forwards that dispatch on ``SampleBatch.layout``, model
resolution. The padded / packed views themselves are in :mod:`expstream.layout`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from expstream.errors import ConfigError
from expstream.layout import is_packed, packed, padded, ragged_from_flat, to_ragged
from expstream.topology import BUILTIN_TINY, Topology
from schemas import Ragged, SampleBatch


def forward_log_probs(model: Any, batch: SampleBatch, with_entropy: bool = False) -> tuple[Ragged, Ragged | None]:
    """Per-action log-probs (and entropies when asked) of a causal LM, ragged (B; a_b), in the
    batch's layout (§1.3 padded, §1.4 packed)."""
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


def model_dir(topology: Topology, role: str) -> Path:
    """Resolve ``models.<role>`` to a directory, building the tiny offline models when asked."""
    value = getattr(topology.models, role)
    if value is None:
        raise ConfigError(f"models.{role}: is null but this stage needs it; set it to a model directory")
    if value == BUILTIN_TINY:
        from expstream.models import build_tiny_models

        key = {"reference": "actor"}.get(role, role)
        return Path(build_tiny_models(topology.models.cache_dir)[key])
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"models.{role}: directory {value!r} does not exist; point it at a directory "
                          "saved with save_pretrained, or use builtin:tiny")
    return path
