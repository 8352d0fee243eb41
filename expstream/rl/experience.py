"""Experiences for the trainer: the padded ``Experience`` batch rebuilt from the ``experiences`` topic.

The wire carries ragged ``SampleBatch`` records (no padding bytes). A trainer wants the seed's
padded layout (docs/numerics.md §1.5), so this module rebuilds it:

* :class:`Experience` -- one micro-batch, padded: ``sequences``/``attention_mask`` (B, P+A) with the
  prompt left-padded and the response right-padded, every action-level tensor (B, A) right-padded
  with 0 (``action_mask`` with False). It also carries the stable ids of every row.
* :func:`read_experiences` -- read a recorded ``experiences.msgpack`` file (or the Kafka topic) into
  Experiences, with the documented consumer-side dedupe by sample id.
* :class:`BufferItem`, :func:`split_experience_batch`, :func:`make_experience_batch`,
  :func:`zero_pad_sequences`, :func:`remove_padding_in_sequences` -- the replay-buffer helpers of
  ``lightrft.trainer.replay_buffer_utils`` (seed 004, docs/numerics.md §1.6), for a trainer that re-batches.

Only torch, numpy and msgpack are needed to *use* the results; ``schemas`` decodes the records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from expstream.rl.expfile import iter_experience_batches, iter_records  # torch-free readers; re-exported here
from expstream.rl.padded import padded_fields, padded_from_ragged  # padded_from_ragged re-exported here
from schemas.messages import sample_id  # the id is the wire format's; re-exported here

__all__ = [
    "ACTION_FIELDS",
    "BufferItem",
    "Experience",
    "iter_experience_batches",
    "iter_records",
    "make_experience_batch",
    "padded_from_ragged",
    "read_experiences",
    "remove_padding_in_sequences",
    "sample_id",
    "split_experience_batch",
    "zero_pad_sequences",
]

#: Action-level (B, A) tensor fields of Experience / (A,) fields of BufferItem, in seed order.
ACTION_FIELDS: tuple[str, ...] = (
    "action_log_probs",
    "base_action_log_probs",
    "values",
    "returns",
    "advantages",
    "action_mask",
    "action_entropy",
    "rollout_log_probs",
    "forced_mask",
    "token_versions",
)
#: Token-level (B, S) tensor fields.
TOKEN_FIELDS: tuple[str, ...] = ("sequences", "attention_mask")
_REQUIRED = ("sequences", "action_log_probs", "returns", "advantages", "attention_mask", "action_mask")




# ----------------------------------------------------------------------------------------------
# Experience
# ----------------------------------------------------------------------------------------------


@dataclass
class Experience:
    """One padded micro-batch of experience (seed ``Experience``; docs/numerics.md §1.5).

    B rows, P = longest prompt, A = longest action row (``a_b`` = response up to and including
    its EOS). Padded positions of every action-level tensor are 0 (False for ``action_mask``).

    In a packed Experience (``make_experience_batch(..., packing_samples=True)``) the token tensors
    are (1, T) and the action tensors (1, N) instead; see ``packed_seq_lens``.
    """

    sequences: torch.Tensor  # (B, P+A) long: [pad]*(P-p_b) + prompt_b + actions_b + [pad]*(A-a_b)
    action_log_probs: torch.Tensor  # (B, A) float32: behaviour-policy log-probs, 0 past a_b
    base_action_log_probs: torch.Tensor | None  # (B, A) float32 reference log-probs, or None
    values: torch.Tensor | None  # (B, A) float32 critic values (gae only), or None
    returns: torch.Tensor  # (B, A) float32, 0 past a_b
    advantages: torch.Tensor  # (B, A) float32, 0 past a_b
    attention_mask: torch.Tensor  # (B, P+A) long 0/1: 1 from the first real prompt token to the last action
    action_mask: torch.Tensor  # (B, A) bool: True on the a_b valid actions (a True prefix when well-formed)
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,) tensor (float32 on the wire)
    kl: torch.Tensor | None = None  # (B, A) float32; None: the maker drops it once advantages exist
    action_entropy: torch.Tensor | None = None  # (B, A) float32 when high_entropy_token_ratio > 0, else None
    # (B, A) float32 behaviour log-probs from the engine (the distribution sampled from), 0 past a_b
    # and at tokens the EOS repair wrote; None when the records carry none (schema version 1)
    rollout_log_probs: torch.Tensor | None = None
    # (B, A) bool: True at actions the EOS repair forced (not sampled by the policy: a truncated row's
    # last token, an appended EOS; expstream.rl.layout.forced_action_rows); they carry no KL penalty and
    # no policy-loss term (docs/numerics.md §14.12). None for a hand-built batch (nothing forced known)
    forced_mask: torch.Tensor | None = None
    # (B, A) long: the policy version each action was sampled under (schema v5, in-flight weight updates), 0 past
    # a_b; None when the records carry none: every action of row b is of rollout_versions[b] (expstream/rl/versions.py)
    token_versions: torch.Tensor | None = None
    rollout_versions: list[int] = field(default_factory=list)  # (B,) policy version that generated each row
    logprob_versions: list[int] = field(default_factory=list)  # (B,) actor version behind action_log_probs
    # ---- stable ids (one entry per row; empty lists mean "unknown", e.g. a hand-built batch) ----
    batch_id: str = ""
    sample_ids: list[str] = field(default_factory=list)  # f"{group_id}#{sample_index}"
    prompt_ids: list[str] = field(default_factory=list)  # prompt ids (strings), not token ids
    group_ids: list[str] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    policy_version: int = 0
    # ---- visual inputs (schema v3; empty for text-only rows): what a trainer needs to rebuild pixel_values ----
    images: list[list[str]] = field(default_factory=list)  # (B; k_b) image blob references (expstream/models/blobs.py)
    image_grid_thw: list[list[tuple[int, int, int]]] = field(default_factory=list)  # (B; k_b) (t, h, w) per image
    videos: list[list[str]] = field(default_factory=list)  # (B; v_b) video manifest blob references
    video_grid_thw: list[list[tuple[int, int, int]]] = field(default_factory=list)  # (B; v_b) (t, h, w) per video
    # ---- packed layout only (None for the padded layout) ----
    packed_seq_lens: list[int] | None = None  # per sample: tokens in `sequences`
    num_actions: list[int] | None = None  # per sample: actions in the action-level row

    def high_entropy_mask(self, ratio: float) -> torch.Tensor:
        """docs/numerics.md §11: the (B, A) bool mask of the top ``ratio`` share of valid
        tokens by rollout entropy.

        The policy loss uses it in place of ``action_mask`` when ``high_entropy_token_ratio > 0``;
        needs ``action_entropy`` (the actor stage computes it when the ratio is set).
        """
        from expstream.rl.numerics import high_entropy_mask

        if self.action_entropy is None:
            raise ValueError("Experience.action_entropy: None; set algo.high_entropy_token_ratio > 0 so the "
                             "actor stage computes per-token entropy")
        return high_entropy_mask(self.action_entropy, self.action_mask, ratio)

    def __post_init__(self) -> None:
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"Experience.{name}: expected a torch.Tensor, got {type(value).__name__}")
        if self.packed_seq_lens is not None:
            self._check_packed()
            return
        if self.sequences.dim() != 2:
            raise ValueError(
                f"Experience.sequences: expected shape (B, P+A), got {tuple(self.sequences.shape)}"
            )
        b, s = self.sequences.shape
        if tuple(self.attention_mask.shape) != (b, s):
            raise ValueError(
                f"Experience.attention_mask: shape {tuple(self.attention_mask.shape)} does not match "
                f"sequences {(b, s)}; both are (B, P+A)"
            )
        if self.action_mask.dim() != 2 or self.action_mask.shape[0] != b:
            raise ValueError(
                f"Experience.action_mask: expected shape (B={b}, A), got {tuple(self.action_mask.shape)}"
            )
        if self.action_mask.dtype != torch.bool:
            raise ValueError(f"Experience.action_mask: expected dtype torch.bool, got {self.action_mask.dtype}")
        a = self.action_mask.shape[1]
        if a > s:
            raise ValueError(
                f"Experience.action_mask: {a} actions but sequences has only {s} columns; "
                "sequences must hold the prompt and the actions (P+A columns)"
            )
        for name in (*ACTION_FIELDS, "kl"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, a):
                raise ValueError(
                    f"Experience.{name}: shape {tuple(value.shape)} does not match action_mask {(b, a)}; "
                    "every action-level tensor is (B, A)"
                )
        self._check_info_and_ids(b)

    def _check_packed(self) -> None:
        lens = self.packed_seq_lens or []
        n = len(lens)
        t = sum(lens)
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if tuple(value.shape) != (1, t):
                raise ValueError(
                    f"Experience.{name}: packed layout expects shape (1, sum(packed_seq_lens)={t}), "
                    f"got {tuple(value.shape)}"
                )
        if self.num_actions is None or len(self.num_actions) != n:
            raise ValueError(
                f"Experience.num_actions: packed layout needs one action count per sample ({n}), "
                f"got {self.num_actions!r}"
            )
        total = sum(self.num_actions)
        for name in (*ACTION_FIELDS, "kl"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (1, total):
                raise ValueError(
                    f"Experience.{name}: packed layout expects shape (1, sum(num_actions)={total}), "
                    f"got {tuple(value.shape)}"
                )
        self._check_info_and_ids(n)

    def _check_info_and_ids(self, b: int) -> None:
        for key, value in self.info.items():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b,):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"Experience.info[{key!r}]: expected a tensor of shape (B={b},), got {shape}")
        for name in ("sample_ids", "prompt_ids", "group_ids", "sample_index", "rollout_versions",
                     "logprob_versions", *VISUAL_FIELDS):
            ids = getattr(self, name)
            if ids and len(ids) != b:
                raise ValueError(
                    f"Experience.{name}: {len(ids)} entries for {b} rows; give one per row (or none)"
                )

    # ---- convenience --------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Number of samples (rows; samples of a packed batch)."""
        if self.packed_seq_lens is not None:
            return len(self.packed_seq_lens)
        return int(self.sequences.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    def _map_tensors(self, fn: Any) -> Experience:
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        changes["info"] = {k: fn(v) for k, v in self.info.items()}
        return dataclasses.replace(self, **changes)

    def to_device(self, device: torch.device | str) -> Experience:
        """A copy with every tensor (info included) moved to ``device``."""
        return self._map_tensors(lambda t: t.to(device))

    def pin_memory(self) -> Experience:
        """A copy with every tensor in pinned memory (for faster host-to-GPU copies)."""
        return self._map_tensors(lambda t: t.pin_memory())

    # ---- from the wire ------------------------------------------------------------------------
    @classmethod
    def from_sample_batch(cls, batch: Any, rows: Sequence[int] | None = None) -> Experience:
        """Rebuild the padded layout from one decoded ``SampleBatch`` (advantage stage output).

        ``rows`` (optional) keeps only those rows, in that order; P and A are then the longest
        prompt and action row among them, exactly as if the batch had held only those rows.
        The layout of every field is :func:`expstream.rl.padded.padded_fields`'s (docs/numerics.md §1.5).
        """
        return cls(**padded_fields(batch, rows))


#: Per-row visual fields of Experience and BufferItem (schema v3; empty for text-only rows).
VISUAL_FIELDS = ("images", "image_grid_thw", "videos", "video_grid_thw")


# ----------------------------------------------------------------------------------------------
# Reading recorded experiences
# ----------------------------------------------------------------------------------------------


def _kafka_batches(bootstrap: str, topic: str, timeout_s: float, kafka_config: Any = None) -> Iterator[Any]:
    from expstream.kafka.clients import read_topic
    from schemas import decode

    for record in read_topic(bootstrap, kafka_config, topic, timeout_s=timeout_s):
        value = getattr(record, "value", record)
        if isinstance(value, (bytes, bytearray, memoryview)):
            yield decode(bytes(value))
        else:  # already decoded by the bus
            yield value


def read_experiences(
    source: str | Path | None,
    *,
    dedupe: bool = True,
    bootstrap: str | None = None,
    topic: str = "experiences",
    timeout_s: float = 30,
    kafka_config: Any = None,
) -> list[Experience]:
    """Experiences, one per record, from a recorded file or from a Kafka topic.

    ``source``: path to a file of concatenated msgpack records (one encoded ``SampleBatch`` each,
    e.g. ``runs/<id>/experiences.msgpack``). With ``bootstrap`` given, ``source`` is ignored and
    ``topic`` is read from that broker with :func:`expstream.kafka.clients.read_topic`: every record
    present when the call starts, from the beginning of each partition (in offset order within a
    partition); ``timeout_s`` bounds the whole read; ``kafka_config`` is an
    optional ``expstream.kafka.clients.KafkaConfig`` (the topology's ``kafka`` block).

    ``dedupe`` (default on) is the documented consumer-side dedupe: Kafka delivers at least once,
    so a sample id (``f"{group_id}#{sample_index}"``) seen before is dropped (the first occurrence
    is kept), and a record whose samples were all seen before is dropped whole. Records are never
    merged: each Experience is one record, less its duplicate rows.
    """
    if bootstrap is not None:
        batches: Iterable[Any] = _kafka_batches(bootstrap, topic, timeout_s, kafka_config)
    elif source is None:
        raise ValueError("read_experiences: give a file path as source, or bootstrap= to read a Kafka topic")
    else:
        batches = iter_experience_batches(source)
    seen: set[str] = set()
    out: list[Experience] = []
    for batch in batches:
        ids = [sample_id(str(g), int(i)) for g, i in zip(batch.group_id, batch.sample_index, strict=True)]
        if not dedupe:
            out.append(Experience.from_sample_batch(batch))
            continue
        keep = []
        for row, sid in enumerate(ids):
            if sid not in seen:
                seen.add(sid)
                keep.append(row)
        if not keep:
            continue
        out.append(Experience.from_sample_batch(batch, rows=None if len(keep) == len(ids) else keep))
    return out


# ----------------------------------------------------------------------------------------------
# Replay-buffer helpers (seed 004, docs/numerics.md §1.6)
# ----------------------------------------------------------------------------------------------


@dataclass
class BufferItem:
    """One row of an Experience (seed ``BufferItem``), plus its ids.

    Shapes: sequences (S,), attention_mask (S,), every action-level tensor (A,), info: name ->
    Python scalar. Unlike the seed's docstring, values/returns/advantages are per token (A,),
    as they are in the Experience they come from.
    """

    sequences: torch.Tensor  # (S,) long
    action_log_probs: torch.Tensor  # (A,) float32
    base_action_log_probs: torch.Tensor | None  # (A,) or None
    values: torch.Tensor | None  # (A,) or None
    returns: torch.Tensor  # (A,)
    advantages: torch.Tensor  # (A,)
    attention_mask: torch.Tensor | None  # (S,) long
    action_mask: torch.Tensor | None  # (A,) bool
    info: dict[str, Any] | None  # name -> Python scalar
    action_entropy: torch.Tensor | None = None  # (A,) or None
    rollout_log_probs: torch.Tensor | None = None  # (A,) float32 behaviour log-probs, or None
    forced_mask: torch.Tensor | None = None  # (A,) bool: actions the EOS repair forced, or None
    token_versions: torch.Tensor | None = None  # (A,) long: policy version of each action, or None (all rollout_version)
    rollout_version: int = -1  # policy version that generated this sample (-1: unknown)
    logprob_version: int = -1  # actor version behind action_log_probs (-1: unknown)
    sample_id: str = ""  # f"{group_id}#{sample_index}"
    prompt_id: str = ""
    group_id: str = ""
    sample_index: int = -1
    batch_id: str = ""
    policy_version: int = 0
    # visual inputs of this sample (empty for a text-only one): blob references and (t, h, w) grids
    images: list[str] = field(default_factory=list)
    image_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    video_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)


def split_experience_batch(experience: Experience) -> list[BufferItem]:
    """Split a padded Experience into one BufferItem per row (padding kept)."""
    if experience.packed_seq_lens is not None:
        raise ValueError("split_experience_batch: packed experiences cannot be split; split before packing")
    b = experience.batch_size
    items = []
    for i in range(b):
        kwargs: dict[str, Any] = {}
        for name in (*TOKEN_FIELDS, *ACTION_FIELDS):
            value = getattr(experience, name)
            kwargs[name] = None if value is None else value[i]
        kwargs["info"] = {k: v[i].item() for k, v in experience.info.items()}

        def pick(ids: list[Any], default: Any, i: int = i) -> Any:
            return ids[i] if ids else default

        items.append(
            BufferItem(
                **kwargs,
                sample_id=pick(experience.sample_ids, ""),
                prompt_id=pick(experience.prompt_ids, ""),
                group_id=pick(experience.group_ids, ""),
                sample_index=pick(experience.sample_index, -1),
                rollout_version=pick(experience.rollout_versions, -1),
                logprob_version=pick(experience.logprob_versions, -1),
                batch_id=experience.batch_id,
                policy_version=experience.policy_version,
                **{name: list(pick(getattr(experience, name), [])) for name in VISUAL_FIELDS},
            )
        )
    return items


def zero_pad_sequences(sequences: Sequence[torch.Tensor], side: str = "left") -> torch.Tensor:
    """Stack 1-D tensors into (N, max_len), padding with zeros (False for bool) on ``side``.

    ``[[1,2,3],[4,5],[6,7,8,9]]`` -> left: ``[[0,1,2,3],[0,0,4,5],[6,7,8,9]]``,
    right: ``[[1,2,3,0],[4,5,0,0],[6,7,8,9]]``.
    """
    if side not in ("left", "right"):
        raise ValueError(f"zero_pad_sequences: side must be 'left' or 'right', got {side!r}")
    if not sequences:
        raise ValueError("zero_pad_sequences: no sequences to pad")
    width = max(int(s.shape[-1]) for s in sequences)
    out = sequences[0].new_zeros((len(sequences), width))
    for i, s in enumerate(sequences):
        n = int(s.shape[-1])
        if n:
            if side == "left":
                out[i, width - n :] = s
            else:
                out[i, :n] = s
    return out


def _join_ids(ids: list[str]) -> str:
    unique = list(dict.fromkeys(ids))
    return unique[0] if len(unique) == 1 else "+".join(unique)


def make_experience_batch(items: Sequence[BufferItem], packing_samples: bool = False) -> Experience:
    """Batch BufferItems into one Experience (the seed's ``make_experience_batch``).

    Padded (default): token tensors and every action-level tensor are zero-padded on the LEFT
    (as the seed's trainer does: responses end up right-aligned), ``info`` scalars are stacked to
    (B,). Items split from one Experience without trimming come back exactly as they were.

    Packed (``packing_samples=True``, docs/numerics.md §1.4 intended layout): the rows are concatenated into
    (1, T) token tensors and (1, N) action tensors; ``attention_mask`` holds the 1-based segment
    id of each token; ``packed_seq_lens``/``num_actions`` give the per-sample sizes. Trim the
    items first with :func:`remove_padding_in_sequences`, or the padding is packed too.

    ``batch_id`` is the items' common batch id (``"a+b"`` when they come from several records);
    ``policy_version`` is the oldest among the items. ``rollout_versions`` / ``logprob_versions``
    are per row, empty unless every item knows its version.
    """
    if not items:
        raise ValueError("make_experience_batch: no items")
    kwargs: dict[str, Any] = {}
    for name in (*TOKEN_FIELDS, *ACTION_FIELDS):
        vals = [getattr(it, name) for it in items]
        present = [v is not None for v in vals]
        if not any(present):
            kwargs[name] = None
            continue
        if not all(present):
            raise ValueError(f"make_experience_batch: {name} is None in some items but not in others")
        if not packing_samples:
            kwargs[name] = zero_pad_sequences(vals, "left")
        elif name == "attention_mask":
            kwargs[name] = torch.cat(
                [torch.full((int(v.shape[0]),), i + 1, dtype=torch.long) for i, v in enumerate(vals)]
            ).unsqueeze(0)
        else:
            kwargs[name] = torch.cat(vals).unsqueeze(0)
    info: dict[str, torch.Tensor] = {}
    for key in (items[0].info or {}):
        vals = [(it.info or {})[key] for it in items]
        info[key] = torch.stack([torch.as_tensor(v) for v in vals]) if isinstance(vals[0], torch.Tensor) \
            else torch.tensor(vals)
    if packing_samples:
        kwargs["packed_seq_lens"] = [int(it.sequences.shape[0]) for it in items]
        kwargs["num_actions"] = [int(it.action_log_probs.shape[0]) for it in items]
        if kwargs["action_mask"] is None:
            kwargs["action_mask"] = torch.ones((1, sum(kwargs["num_actions"])), dtype=torch.bool)
        if kwargs["attention_mask"] is None:
            kwargs["attention_mask"] = torch.cat(
                [torch.full((n,), i + 1, dtype=torch.long) for i, n in enumerate(kwargs["packed_seq_lens"])]
            ).unsqueeze(0)
    elif kwargs["action_mask"] is None or kwargs["attention_mask"] is None:
        raise ValueError("make_experience_batch: padded batches need action_mask and attention_mask in every item")
    return Experience(
        **kwargs,
        info=info,
        kl=None,
        batch_id=_join_ids([it.batch_id for it in items]),
        sample_ids=[it.sample_id for it in items] if all(it.sample_id for it in items) else [],
        prompt_ids=[it.prompt_id for it in items] if all(it.prompt_id for it in items) else [],
        group_ids=[it.group_id for it in items] if all(it.group_id for it in items) else [],
        sample_index=[it.sample_index for it in items] if all(it.sample_index >= 0 for it in items) else [],
        rollout_versions=[it.rollout_version for it in items] if all(it.rollout_version >= 0 for it in items) else [],
        logprob_versions=[it.logprob_version for it in items] if all(it.logprob_version >= 0 for it in items) else [],
        policy_version=min(it.policy_version for it in items),
        **_visual_of_items(items),
    )


def _visual_of_items(items: Sequence[BufferItem]) -> dict[str, Any]:
    """The per-row visual fields of a batch of items: none when every item is text-only."""
    if not any(getattr(it, name) for it in items for name in VISUAL_FIELDS):
        return {}
    return {name: [list(getattr(it, name)) for it in items] for name in VISUAL_FIELDS}


def remove_padding_in_sequences(items: Iterable[BufferItem]) -> list[BufferItem]:
    """Trim each item's padding (docs/numerics.md §1.6); returns new items, the inputs are not changed.

    ``k`` = number of False in ``action_mask``: every action-level tensor keeps ``[:A-k]``;
    ``sequences`` and ``attention_mask`` keep ``[first_valid : S-k]``, first_valid being the
    first position where ``attention_mask`` is 1 (0 when none). This assumes the mask is a True
    prefix; a fully masked row keeps no actions and only its prompt in ``sequences``.
    """
    out = []
    for item in items:
        if item.action_mask is None or item.attention_mask is None:
            raise ValueError("remove_padding_in_sequences: items need action_mask and attention_mask")
        a = int(item.action_mask.shape[0])
        s = int(item.sequences.shape[0])
        k = int((~item.action_mask.bool()).sum())
        first = int(item.attention_mask.long().argmax()) if s else 0
        changes: dict[str, Any] = {}
        for name in ACTION_FIELDS:
            value = getattr(item, name)
            if value is not None:
                changes[name] = value[: a - k]
        changes["sequences"] = item.sequences[first : s - k]
        changes["attention_mask"] = item.attention_mask[first : s - k]
        out.append(dataclasses.replace(item, **changes))
    return out
