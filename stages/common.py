"""Helpers shared by the stages: padded views of a ragged micro-batch, model resolution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from expstream import numerics
from expstream.errors import ConfigError
from expstream.topology import BUILTIN_TINY, Topology
from schemas import Ragged, SampleBatch


def rows_of(ragged: Ragged) -> list[torch.Tensor]:
    """Ragged (B; x_b) -> B torch tensors (copies: the wire buffers are read-only views)."""
    return [torch.from_numpy(np.array(r)) for r in ragged.rows()]


def padded(batch: SampleBatch) -> numerics.PaddedLayout:
    """The (B, P+A) padded layout of a micro-batch whose actions were cut by shard-preprocess."""
    if batch.action_ids is None or batch.action_mask is None:
        raise ValueError(
            f"SampleBatch {batch.batch_id}: action_ids/action_mask missing; this stage must run after "
            "shard-preprocess (check the topology's stage order)"
        )
    return numerics.rebuild_padded(
        rows_of(batch.prompt_ids), rows_of(batch.action_ids), rows_of(batch.action_mask), batch.pad_token_id,
        eos_id=batch.eos_token_id,
    )


def action_field(batch: SampleBatch, name: str, width: int) -> torch.Tensor:
    """A ragged action-level field as a right-zero-padded (B, width) float32 tensor."""
    ragged = getattr(batch, name)
    if ragged is None:
        raise ValueError(f"SampleBatch {batch.batch_id}: field {name} missing; the stage that sets it is "
                         "switched off or did not run before this one")
    return numerics.pad_rows(rows_of(ragged), side="right", value=0, width=width).to(torch.float32)


def to_ragged(x: torch.Tensor, batch: SampleBatch) -> Ragged:
    """(B, A) tensor -> Ragged float32 with the batch's action lengths (no padding on the wire)."""
    lengths = batch.action_ids.lengths
    rows = [x[b, : int(n)].detach().to(torch.float32).cpu().numpy() for b, n in enumerate(lengths)]
    return Ragged.from_rows(rows, "float32")


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
