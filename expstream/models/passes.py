"""The forward passes on a loaded model: per-action log-probs (and entropies), critic values, reward scores.

They follow docs/numerics.md §1.3 (padded layout):

* ``forward_action_log_probs``: ``log_softmax(logits[b, L-1-A+t])[seq[b, L-A+t]]`` over raw logits
  (no temperature), with ``position_ids = cumsum(attention_mask) - 1`` and masked positions set to 1;
* ``forward_values``: the critic's per-token output at positions ``[:-1]``, last A entries
  (``V_t`` = value of the state before action t);
* ``forward_reward``: the sequence-classification score read at the last non-pad token.

A vision-language critic or reward model (:class:`expstream.models.vl.VisionValueModel`) takes its
visual inputs like the actor's.

The packed variants take the docs/numerics.md §1.4 layout (segments concatenated in one row, position ids
restarting at 0 in each segment) and give the same numbers as the padded layout: segments never attend to each
other (a block-diagonal causal 4-D mask, or the position ids for flash attention).

All outputs are float32, whatever the model's dtype (the seed keeps bf16 log-probs in bf16; we
compute the log-softmax in float32). Tensor-level and layout-agnostic; the dispatch on a
SampleBatch's layout is :mod:`expstream.models.forward`. Apart from :mod:`expstream.models.hf`
(loading, generation) because these are the numerics every scoring stage and the reward server share.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from expstream.rl.layout import position_ids_from_attention

__all__ = [
    "forward_action_log_probs",
    "forward_values",
    "forward_reward",
    "forward_packed_action_log_probs",
    "forward_packed_action_log_probs_and_entropy",
    "forward_packed_values",
    "forward_packed_reward",
]


# ---------------------------------------------------------------------------------------------
# Forward passes (padded layout, docs/numerics.md §1.3)
# ---------------------------------------------------------------------------------------------


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _check_padded(sequences: Tensor, attention_mask: Tensor, num_actions: int | None) -> None:
    if sequences.dim() != 2 or sequences.shape != attention_mask.shape:
        raise ValueError(
            f"sequences and attention_mask must both be (B, L), got {tuple(sequences.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if num_actions is not None and not 1 <= num_actions <= sequences.shape[1] - 1:
        raise ValueError(
            f"num_actions must be in [1, L-1] = [1, {sequences.shape[1] - 1}], got {num_actions}"
        )


def _log_probs_and_entropy(
    logits: Tensor, targets: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = (-(logp_all.exp() * logp_all).sum(-1)).clamp_min(0.0)
    return logp, entropy


def _padded_forward(model: Any, sequences: Tensor, attention_mask: Tensor, visual: dict[str, Any] | None = None,
                    **kwargs: Any) -> tuple[Any, Tensor]:
    """One forward of a padded batch on the model's device with docs/numerics.md §1.3 position ids.

    Returns the model output and ``sequences`` moved to that device. ``visual`` (a vision-language
    model, expstream/models/vl.py): pixel_values / image_grid_thw / mm_token_type_ids, and ``input_ids``
    when the model input differs from ``sequences`` (the image-token repair); the model then
    computes its own (3-D rope) position ids from the attention mask and the grids.
    """
    device = _model_device(model)
    sequences = sequences.to(device)
    attention_mask = attention_mask.to(device)
    if visual:
        extra = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in visual.items()}
        inputs = extra.pop("input_ids", sequences)
        return model(input_ids=inputs, attention_mask=attention_mask, **extra, **kwargs), sequences
    out = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention(attention_mask),
        **kwargs,
    )
    return out, sequences


@torch.inference_mode()
def forward_action_log_probs(
    model: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int, with_entropy: bool = False,
    visual: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of the last ``num_actions`` tokens, each (B, A) float32.

    ``logp[b, t] = log_softmax(logits[b, L-1-A+t])[sequences[b, L-A+t]]`` over raw logits, with
    ``position_ids = cumsum(attention_mask) - 1`` (masked positions set to 1). The entropy is that of
    ``softmax(logits)`` at the same positions; ``None`` unless ``with_entropy``.
    """
    _check_padded(sequences, attention_mask, num_actions)
    kwargs: dict[str, Any] = {"use_cache": False}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = num_actions + 1
    out, sequences = _padded_forward(model, sequences, attention_mask, visual, **kwargs)
    logits = out.logits[:, -(num_actions + 1) : -1]
    return _log_probs_and_entropy(logits, sequences[:, -num_actions:], with_entropy)


@torch.inference_mode()
def forward_values(critic: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                   visual: dict[str, Any] | None = None) -> Tensor:
    """Critic values (B, A) float32: outputs at positions ``[:-1]``, last A (V_t = V(state before t)).

    ``visual``: a vision-language critic's extra inputs, as in :func:`forward_action_log_probs`.
    """
    _check_padded(sequences, attention_mask, num_actions)
    out, _ = _padded_forward(critic, sequences, attention_mask, visual)
    values = out.logits[..., 0] if out.logits.dim() == 3 else out.logits
    return values[:, :-1][:, -num_actions:].float()


@torch.inference_mode()
def forward_reward(rm: Any, sequences: Tensor, attention_mask: Tensor, visual: dict[str, Any] | None = None) -> Tensor:
    """Reward scores (B,) float32: the sequence-classification output at the last non-pad token.

    Needs ``rm.config.pad_token_id`` for batches of more than one row (see ``load_reward_model``).
    ``visual``: a vision-language reward model's extra inputs, as in :func:`forward_action_log_probs`.
    """
    _check_padded(sequences, attention_mask, None)
    out, sequences = _padded_forward(rm, sequences, attention_mask, visual)
    return out.logits.reshape(sequences.shape[0], -1)[:, 0].float()


# ---------------------------------------------------------------------------------------------
# Forward passes (packed layout, docs/numerics.md §1.4)
# ---------------------------------------------------------------------------------------------


def _check_packed(
    sequences: Tensor, position_ids: Tensor, seq_lens: Sequence[int], num_actions: Sequence[int] | None
) -> None:
    if sequences.dim() != 2 or sequences.shape[0] != 1 or tuple(position_ids.shape) != tuple(sequences.shape):
        raise ValueError(
            f"packed sequences and position_ids must both be (1, T), got {tuple(sequences.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    if not seq_lens or any(s < 1 for s in seq_lens):
        raise ValueError(f"seq_lens must be positive, got {list(seq_lens)}")
    if sum(seq_lens) > sequences.shape[1]:
        raise ValueError(f"sum(seq_lens) = {sum(seq_lens)} exceeds T = {sequences.shape[1]}")
    if num_actions is not None:
        if len(num_actions) != len(seq_lens):
            raise ValueError(f"{len(num_actions)} num_actions for {len(seq_lens)} segments")
        for i, (s, a) in enumerate(zip(seq_lens, num_actions, strict=True)):
            if not 1 <= a <= s - 1:
                raise ValueError(f"segment {i}: num_actions {a} must be in [1, seq_len-1] = [1, {s - 1}]")


def _packed_attention_kwargs(model: Any, seq_lens: Sequence[int], total: int) -> dict[str, Any]:
    """A block-diagonal causal additive 4-D mask; flash attention gets none (it uses position_ids)."""
    impl = str(getattr(model.config, "_attn_implementation", "") or "")
    if "flash" in impl:
        return {"attention_mask": None}
    device = _model_device(model)
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    lens = list(seq_lens) + [1] * (total - sum(seq_lens))  # trailing padding: each token alone
    segment = torch.repeat_interleave(
        torch.arange(len(lens), device=device), torch.tensor(lens, device=device)
    )
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(
        total, total, dtype=torch.bool, device=device
    ).tril()
    mask = torch.zeros(total, total, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return {"attention_mask": mask[None, None]}


def _action_index(seq_lens: Sequence[int], num_actions: Sequence[int], device: torch.device) -> Tensor:
    """Positions of the state tokens (the logits that predict each action), concatenated."""
    idx: list[int] = []
    off = 0
    for s, a in zip(seq_lens, num_actions, strict=True):
        idx.extend(range(off + s - a - 1, off + s - 1))
        off += s
    return torch.tensor(idx, dtype=torch.long, device=device)


@torch.inference_mode()
def forward_packed_action_log_probs(
    model: Any, sequences: Tensor, position_ids: Tensor, seq_lens: list[int], num_actions: list[int]
) -> Tensor:
    """Packed log-probs (N,) float32, N = sum(num_actions): the last ``num_actions[i]`` tokens of each
    segment, concatenated. Equal to :func:`forward_action_log_probs` on the padded layout."""
    logp, _ = forward_packed_action_log_probs_and_entropy(model, sequences, position_ids, seq_lens, num_actions)
    return logp


@torch.inference_mode()
def forward_packed_action_log_probs_and_entropy(
    model: Any,
    sequences: Tensor,
    position_ids: Tensor,
    seq_lens: list[int],
    num_actions: list[int],
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`forward_packed_action_log_probs` plus, when ``with_entropy``, the entropy (N,) float32 of
    ``softmax(logits)`` at the same state tokens (as :func:`forward_action_log_probs`), in one pass."""
    _check_packed(sequences, position_ids, seq_lens, num_actions)
    device = _model_device(model)
    sequences = sequences.to(device)
    out = model(
        input_ids=sequences,
        position_ids=position_ids.to(device),
        use_cache=False,
        **_packed_attention_kwargs(model, seq_lens, sequences.shape[1]),
    )
    idx = _action_index(seq_lens, num_actions, device)
    return _log_probs_and_entropy(out.logits[0, idx], sequences[0, idx + 1], with_entropy)


@torch.inference_mode()
def forward_packed_values(
    critic: Any, sequences: Tensor, position_ids: Tensor, seq_lens: list[int], num_actions: list[int]
) -> Tensor:
    """Packed critic values (N,) float32: the value of the state before each action, per segment."""
    _check_packed(sequences, position_ids, seq_lens, num_actions)
    device = _model_device(critic)
    out = critic(
        input_ids=sequences.to(device),
        position_ids=position_ids.to(device),
        **_packed_attention_kwargs(critic, seq_lens, sequences.shape[1]),
    )
    values = out.logits[0, :, 0] if out.logits.dim() == 3 else out.logits[0]
    return values[_action_index(seq_lens, num_actions, device)].float()


@torch.inference_mode()
def forward_packed_reward(rm: Any, sequences: Tensor, position_ids: Tensor, seq_lens: list[int]) -> Tensor:
    """Packed reward scores (num_segments,) float32: the score at each segment's last token.

    Uses the backbone plus the ``score`` head in one pass when the model has them (the transformers
    ``*ForSequenceClassification`` decoders); otherwise runs each segment on its own.
    """
    _check_packed(sequences, position_ids, seq_lens, None)
    device = _model_device(rm)
    sequences = sequences.to(device)
    position_ids = position_ids.to(device)
    ends = torch.tensor(seq_lens, device=device).cumsum(0) - 1
    backbone = getattr(rm, "base_model", None)
    head = getattr(rm, "score", None)
    if backbone is not None and backbone is not rm and isinstance(head, torch.nn.Module):
        hidden = backbone(
            input_ids=sequences,
            position_ids=position_ids,
            use_cache=False,
            **_packed_attention_kwargs(rm, seq_lens, sequences.shape[1]),
        ).last_hidden_state
        return head(hidden[0, ends]).reshape(len(seq_lens), -1)[:, 0].float()
    scores = []
    off = 0
    for s in seq_lens:
        seg = sequences[:, off : off + s]
        out = rm(
            input_ids=seg, attention_mask=torch.ones_like(seg), position_ids=position_ids[:, off : off + s]
        )
        scores.append(out.logits.reshape(-1)[0])
        off += s
    return torch.stack(scores).float()
