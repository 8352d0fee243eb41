"""The padded and packed layouts of a micro-batch (torch tensors) and the views of a SampleBatch in them.

A ``SampleBatch`` carries ragged rows (no padding on the wire, ARCHITECTURE.md). The model stages
and the RL math need them laid out: as a padded ``(B, P+A)`` batch with attention and action masks
(docs/numerics.md §1.1, §1.2, §1.5), or packed into one ``(1, T)`` row without padding
(docs/numerics.md §1.4). This module builds both, and turns action-level tensors back into ragged rows. The RL
math itself (KL, reward shaping, estimators) lives in :mod:`expstream.rl.numerics`, which works on
the padded views built here.

Conventions: action-level tensors are padded ``(B, A)`` views whose positions past a row's valid
actions are 0 (or False for masks); ``action_mask`` is a bool ``(B, A)`` tensor (any dtype is
accepted and converted with ``!= 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from expstream.errors import PoisonRecordError
from schemas import Ragged, SampleBatch

__all__ = [
    "PackedView",
    "PaddedLayout",
    "action_field",
    "action_lengths",
    "align_rollout_log_probs",
    "REPAIRED_TOKEN_LOG_PROB",
    "as_bool_mask",
    "check_2d",
    "forced_action_mask",
    "forced_action_rows",
    "is_packed",
    "pad_rows",
    "packed",
    "packed_layout",
    "padded",
    "padded_layout",
    "position_ids_from_attention",
    "ragged_from_flat",
    "rebuild_padded",
    "rows_of",
    "to_ragged",
]


# ----------------------------------------------------------------------------------------------
# helpers (shared with expstream.rl.numerics)
# ----------------------------------------------------------------------------------------------


def _row(x) -> Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D row, got shape {tuple(t.shape)}")
    return t


def as_bool_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    """``mask`` as a bool tensor of ``like``'s shape (``None``: every position valid); a shape
    mismatch is a ValueError, so a mask of the wrong micro-batch never broadcasts silently."""
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    m = torch.as_tensor(mask)
    m = m if m.dtype == torch.bool else m != 0
    if m.shape != like.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} does not match tensor shape {tuple(like.shape)}")
    return m


def check_2d(name: str, x: Tensor) -> None:
    """Refuse anything but a 2-D ``(B, A)`` tensor, naming the argument."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, A), got shape {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §1 tensor layouts
# ----------------------------------------------------------------------------------------------


@dataclass
class PaddedLayout:
    """A padded micro-batch (docs/numerics.md §1.1, §1.5).

    * ``sequences`` (B, P+A) long: left-padded prompt + EOS-repaired output + right padding;
    * ``attention_mask`` (B, P+A) long 0/1;
    * ``action_mask`` (B, A) bool: action t is the token at ``P + t``;
    * ``prompt_width`` = P (longest prompt); ``num_actions`` = A (longest output, ≥ 1).
    """

    sequences: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    prompt_width: int
    num_actions: int

    @property
    def response_length(self) -> Tensor:
        """``action_mask.sum(-1)`` as float32 (docs/numerics.md §1.1): valid actions including the EOS."""
        return self.action_mask.sum(-1).to(torch.float32)

    @property
    def total_length(self) -> Tensor:
        """``attention_mask.sum(-1)`` as float32 (docs/numerics.md §1.1)."""
        return self.attention_mask.sum(-1).to(torch.float32)


def pad_rows(
    rows: list[Tensor],
    side: str = "right",
    value=0,
    width: int | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Stack ragged 1-D rows into a ``(B, W)`` tensor padded with ``value``.

    ``side="right"`` puts each row at the start (responses, docs/numerics.md §1.1); ``side="left"``
    right-aligns it (prompts). ``W = width`` or the longest row (0 for no rows); a row longer than ``width``
    is a ValueError. The dtype is ``dtype``, else the first row's dtype (float32 for no rows).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    rs = [_row(r) for r in rows]
    longest = max((r.numel() for r in rs), default=0)
    w = longest if width is None else int(width)
    if longest > w:
        raise ValueError(f"a row of length {longest} does not fit in width {w}")
    if dtype is None:
        dtype = rs[0].dtype if rs else torch.float32
    out = torch.full((len(rs), w), value, dtype=dtype)
    for b, r in enumerate(rs):
        n = r.numel()
        if n == 0:
            continue
        if side == "right":
            out[b, :n] = r.to(dtype)
        else:
            out[b, w - n :] = r.to(dtype)
    return out


def action_lengths(action_mask: Tensor) -> Tensor:
    """Per row, the index of the last True in ``action_mask`` plus 1 (0 when none): the a_b of
    the wire format (ARCHITECTURE.md, ``action_ids``). Returns a LongTensor (B,)."""
    m = as_bool_mask(action_mask, torch.as_tensor(action_mask))
    check_2d("action_mask", m)
    b, a = m.shape
    if a == 0:
        return torch.zeros(b, dtype=torch.long)
    idx = torch.arange(1, a + 1, dtype=torch.long).expand(b, a)
    return torch.where(m, idx, torch.zeros_like(idx)).max(dim=1).values


#: Behaviour log-prob of an action token the EOS repair wrote or appended (docs/async.md, "wire"):
#: the pipeline, not the policy, forced it, with probability 1 given the tokens before it.
REPAIRED_TOKEN_LOG_PROB = 0.0


def forced_action_rows(response_rows: list[np.ndarray], action_rows: list[np.ndarray]) -> list[np.ndarray]:
    """Per row, a bool (a_b,) array: True at the actions the EOS repair forced (docs/numerics.md §1.2).

    Action t is response token t (docs/numerics.md §1.2: action t sits at column P + t); it was
    *forced* -- written by the pipeline, not sampled by the policy -- when it differs from the
    response token there (a truncated row's last sampled token overwritten by the EOS; a stop token
    other than the tokenizer's EOS rewritten) or lies past the response (an EOS appended). Those
    tokens carry no KL penalty and no policy-loss term (docs/numerics.md §14.12).
    """
    if len(response_rows) != len(action_rows):
        raise ValueError(f"row counts differ: {len(response_rows)} responses, {len(action_rows)} action rows")
    out = []
    for resp, act in zip(response_rows, action_rows, strict=True):
        resp, act = np.asarray(resp), np.asarray(act)
        row = np.ones(len(act), dtype=bool)
        n = min(len(resp), len(act))
        row[:n] = resp[:n] != act[:n]
        out.append(row)
    return out


def forced_action_mask(batch: SampleBatch, width: int | None = None) -> Tensor:
    """(B, width) bool: :func:`forced_action_rows` of a micro-batch cut by shard-preprocess, right-padded
    with False (``width`` defaults to the longest action row, at least 1).

    A batch without ``response_ids`` (they are optional on the wire) gives all False: every action is
    then taken as sampled, as the seed does.
    """
    _require_actions(batch)
    act = rows_of(batch.action_ids)
    w = max(1, max((r.numel() for r in act), default=0)) if width is None else int(width)
    if batch.response_ids is None:
        return torch.zeros((len(act), w), dtype=torch.bool)
    rows = forced_action_rows([r.numpy() for r in rows_of(batch.response_ids)], [r.numpy() for r in act])
    return pad_rows([torch.from_numpy(r) for r in rows], side="right", value=False, width=w, dtype=torch.bool)


def align_rollout_log_probs(
    response_rows: list[np.ndarray], log_prob_rows: list[np.ndarray], action_rows: list[np.ndarray]
) -> list[np.ndarray]:
    """Behaviour log-probs (response-level, o_b per row) moved onto the repaired actions (a_b per row).

    Action t is response token t (docs/numerics.md §1.2: action t sits at column P + t), so it keeps
    the engine's log-prob when t < o_b and the token is unchanged; a token the EOS repair overwrote
    (a truncated row's last token, a stop token other than the tokenizer's EOS) or appended past
    o_b gets :data:`REPAIRED_TOKEN_LOG_PROB`. Every value stays finite. Returns float32 rows.
    """
    if not len(response_rows) == len(log_prob_rows) == len(action_rows):
        raise ValueError(f"row counts differ: {len(response_rows)} responses, {len(log_prob_rows)} log-prob "
                         f"rows, {len(action_rows)} action rows")
    out = []
    for b, (resp, lp, act) in enumerate(zip(response_rows, log_prob_rows, action_rows, strict=True)):
        resp, lp, act = np.asarray(resp), np.asarray(lp, dtype=np.float32), np.asarray(act)
        if len(resp) != len(lp):
            raise ValueError(f"row {b}: {len(resp)} response tokens but {len(lp)} behaviour log-probs")
        row = np.full(len(act), REPAIRED_TOKEN_LOG_PROB, dtype=np.float32)
        n = min(len(resp), len(act))
        same = ~forced_action_rows([resp], [act])[0][:n]
        row[:n][same] = lp[:n][same]
        out.append(row)
    return out


def _process_sequences(seq: Tensor, prompt_width: int, eos_id: int, pad_id: int):
    """docs/numerics.md §1.2: EOS repair, attention_mask and action_mask of a (B, P+A) padded batch."""
    bsz, length = seq.shape
    num_actions = length - prompt_width
    valid = (seq != eos_id) & (seq != pad_id)
    pos = torch.arange(length, dtype=torch.long).expand(bsz, length)
    has_valid = valid.any(dim=1)
    last = torch.where(valid, pos, torch.full_like(pos, -1)).max(dim=1).values
    # eos_b = last_b + 1 if last_b < L-1, else L-1 (also when the row has no valid token).
    eos_pos = torch.where(has_valid & (last < length - 1), last + 1, torch.full_like(last, length - 1))
    seq = seq.clone()
    seq[torch.arange(bsz), eos_pos] = eos_id
    first = torch.where(valid, pos, torch.full_like(pos, length)).min(dim=1).values
    first = torch.where(has_valid, first, torch.zeros_like(first))
    attention_mask = ((pos >= first[:, None]) & (pos <= eos_pos[:, None])).to(torch.long)
    # action t has its state token at P-1+t (read after the repair); [:, 0] forced True.
    action_mask = torch.zeros((bsz, num_actions), dtype=torch.bool)
    if num_actions > 0:
        state = seq[:, prompt_width : length - 1]
        action_mask[:, 1:] = (state != eos_id) & (state != pad_id)
        action_mask[:, 0] = True
    return seq, attention_mask, action_mask


def padded_layout(
    prompt_rows: list[Tensor], response_rows: list[Tensor], eos_id: int, pad_id: int
) -> PaddedLayout:
    """Build a padded micro-batch exactly as docs/numerics.md §1.1 step 3 + §1.2 (``process_sequences``).

    ``sequences[b] = [pad]*(P-p_b) + prompt_b + output_b + [pad]*(A-o_b)`` with P = longest prompt
    and A = max(1, longest output); then, with ``valid = token ∉ {eos_id, pad_id}``:

    * EOS repair: ``eos_b = last_b + 1`` if the last valid position ``last_b < L-1``, else ``L-1``
      (also for a row without a valid token); ``seq[b, eos_b] = eos_id``. A truncated row's last
      generated token is overwritten by EOS (docs/numerics.md §14.12);
    * ``attention_mask[b, j] = first_b <= j <= eos_b`` (first_b = first valid position, 0 if none);
    * ``action_mask[b, t] = seq[b, P-1+t] ∉ {eos, pad}`` after the repair, ``[:, 0] = True``.
    """
    if len(prompt_rows) != len(response_rows):
        raise ValueError(f"{len(prompt_rows)} prompts but {len(response_rows)} responses")
    prompts = [_row(r).to(torch.long) for r in prompt_rows]
    responses = [_row(r).to(torch.long) for r in response_rows]
    p_width = max((r.numel() for r in prompts), default=0)
    a_width = max(1, max((r.numel() for r in responses), default=0))
    left = pad_rows(prompts, "left", pad_id, p_width, dtype=torch.long)
    right = pad_rows(responses, "right", pad_id, a_width, dtype=torch.long)
    seq = torch.cat([left, right], dim=1)
    seq, attention_mask, action_mask = _process_sequences(seq, p_width, int(eos_id), int(pad_id))
    return PaddedLayout(seq, attention_mask, action_mask, p_width, a_width)


def rebuild_padded(
    prompt_rows: list[Tensor],
    action_rows: list[Tensor],
    action_mask_rows: list[Tensor],
    pad_id: int,
    eos_id: int | None = None,
) -> PaddedLayout:
    """Rebuild a padded micro-batch from the wire's ragged fields (no EOS repair is redone).

    Inputs are the prompt tokens, the ALREADY-REPAIRED action tokens (response up to and
    including the EOS, a_b tokens) and the a_b-long action masks. With P = longest prompt and
    A = max(1, max a_b):

    * ``sequences`` = left-padded prompt + actions + right padding (``pad_id``);
    * ``attention_mask`` = 1 from ``first_b`` through the last action token ``P + a_b - 1``, where
      ``first_b`` is the first token of the row (prompt, then actions) that is neither pad nor
      ``eos_id``: inside the prompt in the usual case; if the prompt has no valid token it is the
      first valid action (exactly what docs/numerics.md §1.2 computes); a row with no valid token at all is
      attended from position P;
    * ``action_mask`` = the given masks right-padded with False.

    ``eos_id=None`` treats only ``pad_id`` as invalid when searching ``first_b`` (enough unless a
    prompt starts with the EOS token).

    For engine-shaped outputs this reproduces :func:`padded_layout` on columns ``[0, P + max a_b)``
    and the original's remaining columns are pad / 0 / False. It cannot when the original row
    loses information in the cut: a row without any valid token, a row whose repaired EOS is not
    its last valid action (e.g. an output that fills the width and ends ``…, eos, x``, or a prompt
    ending in pad/eos followed by an output with no valid token), or trailing EOS tokens after the
    stop token.
    """
    n = len(prompt_rows)
    if len(action_rows) != n or len(action_mask_rows) != n:
        raise ValueError(
            f"row counts differ: {n} prompts, {len(action_rows)} action rows, "
            f"{len(action_mask_rows)} action masks"
        )
    prompts = [_row(r).to(torch.long) for r in prompt_rows]
    actions = [_row(r).to(torch.long) for r in action_rows]
    masks = [_row(r) for r in action_mask_rows]
    masks = [m if m.dtype == torch.bool else m != 0 for m in masks]
    for b, (a, m) in enumerate(zip(actions, masks, strict=True)):
        if a.numel() != m.numel():
            raise ValueError(f"row {b}: {a.numel()} action tokens but an action mask of {m.numel()}")
    p_width = max((r.numel() for r in prompts), default=0)
    lens = torch.tensor([a.numel() for a in actions], dtype=torch.long)
    a_width = max(1, int(lens.max()) if n else 0)
    left = pad_rows(prompts, "left", pad_id, p_width, dtype=torch.long)
    right = pad_rows(actions, "right", pad_id, a_width, dtype=torch.long)
    seq = torch.cat([left, right], dim=1)
    action_mask = pad_rows(masks, "right", False, a_width, dtype=torch.bool)
    length = p_width + a_width
    pos = torch.arange(length, dtype=torch.long).expand(n, length)
    end = p_width + lens - 1  # last action token (P-1 when a row has no action)
    valid = seq != pad_id
    if eos_id is not None:
        valid &= seq != eos_id
    valid &= pos <= end[:, None]
    first = torch.where(valid, pos, torch.full_like(pos, length)).min(dim=1).values
    first = torch.where(valid.any(dim=1), first, torch.full_like(first, p_width))
    attention_mask = ((pos >= first[:, None]) & (pos <= end[:, None])).to(torch.long)
    return PaddedLayout(seq, attention_mask, action_mask, p_width, a_width)


def position_ids_from_attention(attention_mask: Tensor) -> Tensor:
    """docs/numerics.md §1.3: ``cumsum(attention_mask) - 1`` along the last axis, with
    masked positions set to 1."""
    am = torch.as_tensor(attention_mask).to(torch.long)
    pos = am.cumsum(dim=-1) - 1
    return pos.masked_fill(am == 0, 1)


def packed_layout(
    prompt_rows: list[Tensor], action_rows: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor, list[int], list[int]]:
    """docs/numerics.md §1.4 packed layout (intended; no EOS repair).

    Returns ``(sequences (1,T) long, segment_ids (1,T) long 1-based, position_ids (1,T) long
    restarting at 0 in each segment, seq_lens list[int] = [p_i + o_i], num_actions list[int] =
    [max(1, o_i)])``. A sample with no token at all is a ValueError.
    """
    if len(prompt_rows) != len(action_rows):
        raise ValueError(f"{len(prompt_rows)} prompts but {len(action_rows)} action rows")
    seqs, segs, poss, seq_lens, num_actions = [], [], [], [], []
    for i, (p, a) in enumerate(zip(prompt_rows, action_rows, strict=True)):
        s = torch.cat([_row(p).to(torch.long), _row(a).to(torch.long)])
        if s.numel() == 0:
            raise ValueError(f"packed sample {i} has no token")
        seqs.append(s)
        segs.append(torch.full((s.numel(),), i + 1, dtype=torch.long))
        poss.append(torch.arange(s.numel(), dtype=torch.long))
        seq_lens.append(int(s.numel()))
        num_actions.append(max(1, int(_row(a).numel())))
    if not seqs:
        empty = torch.zeros((1, 0), dtype=torch.long)
        return empty, empty.clone(), empty.clone(), [], []
    return (
        torch.cat(seqs)[None],
        torch.cat(segs)[None],
        torch.cat(poss)[None],
        seq_lens,
        num_actions,
    )



# ----------------------------------------------------------------------------------------------
# SampleBatch views: ragged wire rows <-> padded / packed tensors
# ----------------------------------------------------------------------------------------------


def rows_of(ragged: Ragged) -> list[Tensor]:
    """Ragged (B; x_b) -> B torch tensors (copies: the wire buffers are read-only views)."""
    return [torch.from_numpy(np.array(r)) for r in ragged.rows()]


def is_packed(batch: SampleBatch) -> bool:
    """True when the model stages run this micro-batch in the packed layout (docs/numerics.md §1.4)."""
    return batch.layout == "packed"


def _require_actions(batch: SampleBatch) -> None:
    if batch.action_ids is None or batch.action_mask is None:
        raise ValueError(
            f"SampleBatch {batch.batch_id}: action_ids/action_mask missing; this stage must run after "
            "shard-preprocess (check the topology's stage order)"
        )


def padded(batch: SampleBatch) -> PaddedLayout:
    """The (B, P+A) padded layout of a micro-batch whose actions were cut by shard-preprocess."""
    _require_actions(batch)
    return rebuild_padded(
        rows_of(batch.prompt_ids), rows_of(batch.action_ids), rows_of(batch.action_mask), batch.pad_token_id,
        eos_id=batch.eos_token_id,
    )


@dataclass
class PackedView:
    """The packed layout (docs/numerics.md §1.4) of a micro-batch cut by shard-preprocess: one
    (1, T) row with no padding.

    Segment b is prompt_b (from its first token that is neither pad nor EOS) + the a_b repaired action
    tokens; ``position_ids`` restart at 0 per segment and the forwards attend block-diagonally, so
    every segment sees exactly the tokens the padded layout's attention mask lets it see.
    """

    sequences: Tensor  # (1, T) long, T = sum(seq_lens)
    position_ids: Tensor  # (1, T) long
    seq_lens: list[int]  # per segment: kept prompt tokens + a_b
    num_actions: list[int]  # a_b (the wire's action lengths, not max(1, o_b))


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
    sequences, _, position_ids, seq_lens, _ = packed_layout(prompts, actions)
    return PackedView(sequences, position_ids, seq_lens, [int(a.numel()) for a in actions])


def action_field(batch: SampleBatch, name: str, width: int) -> Tensor:
    """A ragged action-level field as a right-zero-padded (B, width) float32 tensor."""
    ragged = getattr(batch, name)
    if ragged is None:
        raise ValueError(f"SampleBatch {batch.batch_id}: field {name} missing; the stage that sets it is "
                         "switched off or did not run before this one")
    return pad_rows(rows_of(ragged), side="right", value=0, width=width).to(torch.float32)


def to_ragged(x: Tensor, batch: SampleBatch) -> Ragged:
    """(B, A) tensor -> Ragged float32 with the batch's action lengths (no padding on the wire)."""
    lengths = batch.action_ids.lengths
    rows = [x[b, : int(n)].detach().to(torch.float32).cpu().numpy() for b, n in enumerate(lengths)]
    return Ragged.from_rows(rows, "float32")


def ragged_from_flat(flat: Tensor, batch: SampleBatch) -> Ragged:
    """A packed (N,) action-level row -> Ragged float32 with the batch's action lengths
    (docs/numerics.md §1.4)."""
    values = flat.detach().to(torch.float32).cpu().numpy().astype(np.float32)
    return Ragged(values=values, lengths=np.array(batch.action_ids.lengths, dtype=np.int32), dtype="float32")
