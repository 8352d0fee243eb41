"""Helpers shared by the stages: padded / packed views of a ragged micro-batch, the model forwards
that dispatch on ``SampleBatch.layout`` (model directories are resolved by expstream.resolve)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from expstream import numerics
from expstream.errors import PoisonRecordError
from schemas import Ragged, SampleBatch


def rows_of(ragged: Ragged) -> list[torch.Tensor]:
    """Ragged (B; x_b) -> B torch tensors (copies: the wire buffers are read-only views)."""
    return [torch.from_numpy(np.array(r)) for r in ragged.rows()]


def padded(batch: SampleBatch) -> numerics.PaddedLayout:
    """The (B, P+A) padded layout of a micro-batch whose actions were cut by shard-preprocess."""
    _require_actions(batch)
    return numerics.rebuild_padded(
        rows_of(batch.prompt_ids), rows_of(batch.action_ids), rows_of(batch.action_mask), batch.pad_token_id,
        eos_id=batch.eos_token_id,
    )


@dataclass
class PackedView:
    """The packed layout (§1.4) of a micro-batch cut by shard-preprocess: one (1, T) row with no padding.

    Segment b is prompt_b (from its first token that is neither pad nor EOS) + the a_b repaired action
    tokens; ``position_ids`` restart at 0 per segment and the forwards attend block-diagonally, so
    every segment sees exactly the tokens the padded layout's attention mask lets it see.
    """

    sequences: torch.Tensor  # (1, T) long, T = sum(seq_lens)
    position_ids: torch.Tensor  # (1, T) long
    seq_lens: list[int]  # per segment: kept prompt tokens + a_b
    num_actions: list[int]  # a_b (the wire's action lengths, not max(1, o_b))


def _require_actions(batch: SampleBatch) -> None:
    if batch.action_ids is None or batch.action_mask is None:
        raise ValueError(
            f"SampleBatch {batch.batch_id}: action_ids/action_mask missing; this stage must run after "
            "shard-preprocess (check the topology's stage order)"
        )


def packed(batch: SampleBatch) -> PackedView:
    """The packed (1, T) layout of a micro-batch; the same numbers as :func:`padded` without padding.

    Leading pad/EOS tokens of a prompt are dropped (the padded layout leaves them outside the attention
    mask and starts the positions after them). A prompt made only of pad/EOS tokens keeps its last
    token, so that the first action has a state token. An empty prompt is refused: its first action
    would have no state token to be predicted from.
    """
    _require_actions(batch)
    invalid = {int(batch.pad_token_id), int(batch.eos_token_id)}
    prompts, actions = [], []
    for i, (p, a) in enumerate(zip(rows_of(batch.prompt_ids), rows_of(batch.action_ids), strict=True)):
        if p.numel() == 0:
            raise PoisonRecordError(f"SampleBatch {batch.batch_id}: sample {batch.sample_ids()[i]} has an empty "
                                    "prompt; the packed layout needs at least one prompt token per sample")
        if a.numel() == 0:
            raise PoisonRecordError(f"SampleBatch {batch.batch_id}: sample {batch.sample_ids()[i]} has no action; "
                                    "shard-preprocess always keeps at least the first action")
        valid = [j for j, t in enumerate(p.tolist()) if t not in invalid]
        first = valid[0] if valid else p.numel() - 1
        prompts.append(p[first:])
        actions.append(a)
    sequences, _, position_ids, seq_lens, _ = numerics.packed_layout(prompts, actions)
    return PackedView(sequences, position_ids, seq_lens, [int(a.numel()) for a in actions])


def _ragged_from_flat(flat: torch.Tensor, batch: SampleBatch) -> Ragged:
    """A packed (N,) action-level row -> Ragged float32 with the batch's action lengths."""
    values = flat.detach().to(torch.float32).cpu().numpy().astype(np.float32)
    return Ragged(values=values, lengths=np.array(batch.action_ids.lengths, dtype=np.int32), dtype="float32")


def is_packed(batch: SampleBatch) -> bool:
    return batch.layout == "packed"


def forward_log_probs(model: Any, batch: SampleBatch, with_entropy: bool = False) -> tuple[Ragged, Ragged | None]:
    """Per-action log-probs (and entropies when asked) of a causal LM, ragged (B; a_b), in the
    batch's layout (§1.3 padded, §1.4 packed)."""
    from expstream.models import forward_action_log_probs, forward_packed_action_log_probs_and_entropy

    if is_packed(batch):
        pk = packed(batch)
        logp, entropy = forward_packed_action_log_probs_and_entropy(
            model, pk.sequences, pk.position_ids, pk.seq_lens, pk.num_actions, with_entropy=with_entropy)
        return _ragged_from_flat(logp, batch), None if entropy is None else _ragged_from_flat(entropy, batch)
    lay = padded(batch)
    logp, entropy = forward_action_log_probs(model, lay.sequences, lay.attention_mask, lay.num_actions,
                                             with_entropy=with_entropy)
    return to_ragged(logp, batch), None if entropy is None else to_ragged(entropy, batch)


def forward_values(critic: Any, batch: SampleBatch) -> Ragged:
    """Per-action critic values V(state before action t), ragged (B; a_b), in the batch's layout."""
    from expstream import models

    if is_packed(batch):
        pk = packed(batch)
        return _ragged_from_flat(
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
