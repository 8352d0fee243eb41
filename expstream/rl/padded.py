"""The padded layout of a decoded ``SampleBatch``'s rows: the fields an ``Experience`` is built from.

The wire carries ragged rows (no padding bytes); the trainer wants the seed's padded layout
(docs/numerics.md §1.5). :func:`padded_fields` turns rows of one record into the keyword
arguments of :class:`expstream.rl.experience.Experience`; the ragged-to-padded helpers it uses
(:func:`padded_from_ragged` and the row scatter) live here too. torch and numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from expstream.rl.layout import forced_action_rows, rebuild_padded
from schemas.messages import sample_id

__all__ = ["padded_fields", "padded_from_ragged"]


def padded_fields(batch: Any, rows: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``Experience`` fields of rows ``rows`` (all rows when None) of one decoded ``SampleBatch``.

    P = longest prompt, A = longest action row (at least 1), among the rows kept.

    * ``sequences[b] = [pad]*(P-p_b) + prompt_ids_b + action_ids_b + [pad]*(A-a_b)`` (long);
    * ``attention_mask[b]`` = 1 from the first prompt token that is neither pad nor eos through
      the last action token ``P + a_b - 1``; a prompt without such a token starts at the first
      action that is neither (column P for any normal response, docs/numerics.md §1.2); a row with
      no such token at all starts at column P;
    * action-level fields right-padded with 0 to A (``action_mask`` with False); a missing
      wire ``action_mask`` means all a_b actions are valid;
    * ``info`` keeps the wire's per-sample metrics as (B,) float32; ``kl`` is None (the maker
      drops it once advantages are computed; the per-sample mean is ``info["kl"]``);
    * ``forced_mask`` (B, A) bool: the actions the EOS repair forced, from ``response_ids`` vs
      ``action_ids`` (all False when the record carries no ``response_ids``).

    Raises:
        IndexError: a row out of range.
        ValueError: a field the layout needs is missing, or its row lengths differ from action_ids'.
    """
    idx = _checked_rows(batch, rows)
    prompt_vals, prompt_lens = _ragged_rows(batch.prompt_ids, idx)
    act_vals, act_lens = _ragged_rows(batch.action_ids, idx)
    mask_vals = _action_mask_values(batch, idx, act_lens)
    sequences, attention_mask, action_mask = padded_from_ragged(
        (prompt_vals, prompt_lens), (act_vals, act_lens), mask_vals.bool(),
        int(batch.pad_token_id), int(batch.eos_token_id),
    )
    width = int(action_mask.shape[1])

    def action(name: str, required: bool) -> torch.Tensor | None:
        return _action_field(batch, name, idx, act_lens, width, required)

    group_ids = [str(batch.group_id[r]) for r in idx]
    sample_index = [int(batch.sample_index[r]) for r in idx]
    return dict(
        sequences=sequences,
        action_log_probs=action("action_log_probs", required=True),
        base_action_log_probs=action("base_action_log_probs", required=False),
        values=action("values", required=False),
        returns=action("returns", required=True),
        advantages=action("advantages", required=True),
        attention_mask=attention_mask,
        action_mask=action_mask,
        info=_info(batch, idx),
        kl=None,
        action_entropy=action("action_entropy", required=False),
        rollout_log_probs=action("rollout_log_probs", required=False),
        forced_mask=_forced(batch, idx, act_vals, act_lens, width),
        token_versions=_token_versions(batch, idx, act_lens, width),
        rollout_versions=_versions(batch, "rollout_version", idx),
        logprob_versions=_versions(batch, "logprob_version", idx),
        batch_id=str(getattr(batch, "batch_id", "")),
        sample_ids=[sample_id(g, i) for g, i in zip(group_ids, sample_index, strict=True)],
        prompt_ids=[str(batch.prompt_id[r]) for r in idx],
        group_ids=group_ids,
        sample_index=sample_index,
        policy_version=int(getattr(batch, "policy_version", 0) or 0),
        **_visual(batch, idx),
    )


def _checked_rows(batch: Any, rows: Sequence[int] | None) -> list[int]:
    """The row indices to keep, after checking they exist and the batch has its token fields."""
    n_rows = len(batch.prompt_id)
    idx = list(range(n_rows)) if rows is None else [int(r) for r in rows]
    for r in idx:
        if not 0 <= r < n_rows:
            raise IndexError(f"Experience.from_sample_batch: row {r} out of range for {n_rows} rows")
    bid = getattr(batch, "batch_id", "")
    if getattr(batch, "prompt_ids", None) is None:
        raise ValueError(f"SampleBatch {bid!r}.prompt_ids: missing; cannot rebuild sequences")
    if getattr(batch, "action_ids", None) is None:
        raise ValueError(
            f"SampleBatch {bid!r}.action_ids: missing; an Experience needs a batch that went through "
            "shard-preprocess (read the `experiences` topic, not `rollouts`)"
        )
    return idx


def _action_mask_values(batch: Any, idx: list[int], act_lens: torch.Tensor) -> torch.Tensor:
    """Flat action-mask values of rows ``idx`` (all True when the wire carries no mask)."""
    if getattr(batch, "action_mask", None) is None:
        return torch.ones(int(act_lens.sum()), dtype=torch.bool)
    mask_vals, mask_lens = _ragged_rows(batch.action_mask, idx)
    if not torch.equal(mask_lens, act_lens):
        raise ValueError(
            f"SampleBatch {getattr(batch, 'batch_id', '')!r}.action_mask: row lengths {mask_lens.tolist()} "
            f"differ from action_ids {act_lens.tolist()}"
        )
    return mask_vals


def _action_field(
    batch: Any, name: str, idx: list[int], act_lens: torch.Tensor, width: int, required: bool
) -> torch.Tensor | None:
    """(B, width) float32 of an action-level wire field, right-padded with 0 (None when absent and optional)."""
    bid = getattr(batch, "batch_id", "")
    ragged = getattr(batch, name, None)
    if ragged is None:
        if required:
            raise ValueError(
                f"SampleBatch {bid!r}.{name}: missing; experiences must carry it "
                "(was the batch read from the topic written by the advantage stage?)"
            )
        return None
    vals, lens = _ragged_rows(ragged, idx)
    if not torch.equal(lens, act_lens):
        raise ValueError(
            f"SampleBatch {bid!r}.{name}: row lengths {lens.tolist()} differ from "
            f"action_ids {act_lens.tolist()}; every action-level field has the lengths of action_ids"
        )
    out = torch.zeros((len(idx), width), dtype=torch.float32)
    _scatter_rows(out, vals.to(torch.float32), lens, start=torch.zeros(len(idx), dtype=torch.long))
    return out


def _info(batch: Any, idx: list[int]) -> dict[str, torch.Tensor]:
    """Per-sample metrics of rows ``idx`` as (B,) tensors, per-source reward scores flattened in."""
    info: dict[str, torch.Tensor] = {}
    for key, value in (getattr(batch, "info", None) or {}).items():
        info[key] = _tensor(np.asarray(value))[idx]
    # per-source scores when several reward sources combine (the seed's info["reward_metrics"]),
    # flattened so that every info entry stays a (B,) tensor
    for key, value in (getattr(batch, "reward_metrics", None) or {}).items():
        info[f"reward_metrics.{key}"] = _tensor(np.asarray(value))[idx]
    return info


def _visual(batch: Any, idx: list[int]) -> dict[str, Any]:
    """Rows ``idx`` of the visual claim checks and grids (nothing for a text-only record)."""
    out: dict[str, Any] = {}
    for refs_name, grid_name in (("images", "image_grid_thw"), ("videos", "video_grid_thw")):
        refs = list(getattr(batch, refs_name, None) or [])
        if not refs:
            continue
        grid = getattr(batch, grid_name, None)
        rows = [grid.row(r).tolist() if grid is not None else [] for r in idx]
        out[refs_name] = [list(refs[r]) for r in idx]
        out[grid_name] = [[tuple(int(x) for x in g[i:i + 3]) for i in range(0, len(g), 3)] for g in rows]
    return out


def _forced(batch: Any, idx: list[int], act_vals: torch.Tensor, act_lens: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool: the actions of rows ``idx`` the EOS repair forced (all False without response_ids)."""
    out = torch.zeros((len(idx), width), dtype=torch.bool)
    if getattr(batch, "response_ids", None) is None:
        return out
    resp_vals, resp_lens = _ragged_rows(batch.response_ids, idx)
    rows = forced_action_rows([r.numpy() for r in _split(resp_vals, resp_lens)],
                              [r.numpy() for r in _split(act_vals, act_lens)])
    if rows:
        _scatter_rows(out, torch.from_numpy(np.concatenate(rows)), act_lens, start=torch.zeros(len(idx), dtype=torch.long))
    return out


def _token_versions(batch: Any, idx: list[int], act_lens: torch.Tensor, width: int) -> torch.Tensor | None:
    """(B, width) long: the wire's per-token versions of rows ``idx``, 0 past a_b (None when the record has none)."""
    ragged = getattr(batch, "token_versions", None)
    if ragged is None:
        return None
    vals, lens = _ragged_rows(ragged, idx)
    if not torch.equal(lens, act_lens):
        raise ValueError(f"SampleBatch {getattr(batch, 'batch_id', '')!r}.token_versions: row lengths {lens.tolist()} "
                         f"differ from action_ids {act_lens.tolist()}; they are aligned by shard-preprocess")
    out = torch.zeros((len(idx), width), dtype=torch.long)
    _scatter_rows(out, vals.to(torch.long), lens, start=torch.zeros(len(idx), dtype=torch.long))
    return out


def _versions(batch: Any, name: str, idx: list[int]) -> list[int]:
    """Rows ``idx`` of a per-sample version list of the wire ([] when the record has none)."""
    values = list(getattr(batch, name, None) or [])
    return [int(values[r]) for r in idx] if values else []


def padded_from_ragged(
    prompts: tuple[torch.Tensor, torch.Tensor],
    actions: tuple[torch.Tensor, torch.Tensor],
    action_mask_values: torch.Tensor,
    pad_id: int,
    eos_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequences, attention_mask, action_mask) of the padded layout, from flat ragged rows.

    ``prompts``/``actions`` are (flat values, int64 lengths); ``action_mask_values`` is flat
    bool with the action lengths. P = longest prompt, A = max(1, longest action row).

    Uses :func:`expstream.rl.layout.rebuild_padded`, the function the model stages use, so a
    reader sees exactly the tensors the models saw.
    """
    p_rows = _split(*prompts)
    a_rows = _split(*actions)
    m_rows = _split(action_mask_values, actions[1])
    layout = rebuild_padded(p_rows, a_rows, m_rows, pad_id, eos_id)
    return layout.sequences, layout.attention_mask, layout.action_mask


def _split(values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(values, [int(n) for n in lengths.tolist()]))


def _tensor(arr: np.ndarray, wire_dtype: str = "") -> torch.Tensor:
    """A torch copy of a (possibly read-only, zero-copy decoded) numpy array."""
    if wire_dtype == "bfloat16":
        return torch.from_numpy(np.array(arr, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))


def _ragged_rows(ragged: Any, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat values and int64 lengths of rows ``idx`` of a ``schemas.Ragged``."""
    lengths = np.asarray(ragged.lengths, dtype=np.int64)
    if len(idx) != len(lengths) or idx != list(range(len(lengths))):
        ragged = ragged.select(np.asarray(idx, dtype=np.int64))
        lengths = np.asarray(ragged.lengths, dtype=np.int64)
    return _tensor(ragged.values, getattr(ragged, "dtype", "")), torch.from_numpy(lengths.copy())


def _scatter_rows(out: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor) -> None:
    """Write row b of a flat ragged ``values`` into ``out[b, start[b] : start[b] + lengths[b]]``."""
    if values.numel() == 0:
        return
    b = lengths.shape[0]
    row = torch.repeat_interleave(torch.arange(b), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    col = torch.arange(values.numel()) - offsets[row] + start[row]
    out[row, col] = values

