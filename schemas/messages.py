"""The two message types of the pipeline: :class:`PromptBatch` and :class:`SampleBatch`.

Fields, types and meaning follow docs/ARCHITECTURE.md ("Wire format"). Construction validates
(``__post_init__`` -> :meth:`validate`) and raises :class:`schemas.errors.ValidationError`
naming the field and the fix. Fields assigned after construction are re-checked by
:func:`schemas.codec.encode` (it calls ``validate()``); prefer :meth:`replace`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from schemas.errors import ValidationError
from schemas.tensors import Ragged, all_finite, as_dtype, normalise_indices, short_repr

__all__ = ["ACTION_FIELDS", "LAYOUTS", "PromptBatch", "SampleBatch", "V2_FIELDS", "V3_FIELDS", "V4_FIELDS", "V5_FIELDS",
           "PROMPT_V2_FIELDS"]

#: Allowed values of ``SampleBatch.layout``.
LAYOUTS = ("", "padded", "packed")
#: Action-level ragged fields: each must have exactly the lengths of ``action_ids``.
ACTION_FIELDS = (
    "action_mask", "action_log_probs", "action_entropy", "base_action_log_probs",
    "values", "kl", "token_rewards", "advantages", "returns", "rollout_log_probs", "token_versions",
)  # fmt: skip
#: Action-level fields that exist before shard-preprocess too: there (no ``action_ids`` yet) they
#: are response-level, with the lengths of ``response_ids``; shard-preprocess aligns them.
RESPONSE_LEVEL_BEFORE_ACTIONS = ("rollout_log_probs", "token_versions")
#: SampleBatch fields added by schema version 2 (a version-1 record has none of them).
V2_FIELDS = ("rollout_log_probs", "rollout_version", "logprob_version")
#: SampleBatch fields added by schema version 3 (visual inputs by claim check; schemas/README.md).
V3_FIELDS = ("images", "videos", "image_grid_thw", "video_grid_thw")
#: SampleBatch fields added by schema version 4 (multi-turn episodes; docs/multi_turn.md).
V4_FIELDS = ("turn_lengths", "turn_rewards", "turn_versions")
#: SampleBatch fields added by schema version 5 (per-token policy versions, docs/async.md "In-flight updates").
V5_FIELDS = ("token_versions",)
#: PromptBatch fields added by schema version 2.
PROMPT_V2_FIELDS = ("images", "videos")
#: Wire dtype of every ragged field of SampleBatch.
RAGGED_DTYPES = {
    "prompt_ids": "int32", "response_ids": "int32", "action_ids": "int32", "action_mask": "bool",
    "image_grid_thw": "int32", "video_grid_thw": "int32", "token_versions": "int32",
    "turn_lengths": "int32", "turn_rewards": "float32", "turn_versions": "int32",
    **{f: "float32" for f in ACTION_FIELDS if f not in ("action_mask", "token_versions")},
}  # fmt: skip


def sample_id(group_id: str, sample_index: int) -> str:
    """The stable id of one sample: ``f"{group_id}#{sample_index}"`` (docs/ARCHITECTURE.md, ids)."""
    return f"{group_id}#{sample_index}"


def _err(msg: Any, name: str, text: str) -> ValidationError:
    path = f"{type(msg).__name__}.{name}"
    return ValidationError(f"{path}: {text}", field=path)


class _LazyIds:
    """A message's sample ids, built on first use (only error messages read them)."""

    def __init__(self, msg: SampleBatch) -> None:
        self._msg = msg
        self._ids: list[str] | None = None

    def _all(self) -> list[str]:
        if self._ids is None:
            self._ids = self._msg.sample_ids()
        return self._ids

    def __getitem__(self, i: int) -> str:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())


def _ids_text(ids: Any, rows: np.ndarray) -> str:
    """Sample ids of ``rows`` for an error message (row numbers when ids are unavailable)."""
    return short_repr([ids[i] if i < len(ids) else f"row {i}" for i in rows.tolist()], limit=5)


class _Message:
    """Behaviour shared by the message dataclasses."""

    SCHEMA: ClassVar[str]
    VERSION: ClassVar[int]
    #: field name -> kind: str | int | float | strs | ints | opt_ints | ragged | array | arrays
    #: (dataclass order). ``opt_ints``: a per-sample int list that may be empty (= absent; then
    #: omitted from the wire) or hold one entry per sample.
    FIELDS: ClassVar[dict[str, str]]

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def with_checked_floats(cls, fields: dict[str, Any]) -> Any:
        """``cls(**fields)``, validated as usual but for the finiteness of its float arrays, which the
        caller has checked (the framed decoder checks every float of a record in one pass)."""
        msg = cls.__new__(cls)
        msg.__dict__["_floats_checked"] = True
        try:
            msg.__init__(**fields)  # type: ignore[misc]
        finally:
            msg.__dict__.pop("_floats_checked", None)
        return msg

    def _finite(self, name: str, values: np.ndarray) -> bool:
        """Whether every value of the float array ``values`` (field ``name``) is finite.

        Checked once per array object: a message remembers the arrays it found finite, so ``encode``
        after construction does not read them again, while a field assigned since (another object)
        is checked. An array written *in place* after it was checked is not checked again here; the
        reader's ``decode`` checks every value and dead-letters the record.
        """
        known = self.__dict__.setdefault("_finite_known", {})
        if known.get(name) is values or self.__dict__.get("_floats_checked") or all_finite(values):
            known[name] = values
            return True
        return False

    def validate(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def replace(self, **changes: Any) -> Any:
        """Copy with ``changes`` applied (validated again): ``dataclasses.replace``."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def __len__(self) -> int:
        return len(self.prompt_id)  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_value_eq(getattr(self, f), getattr(other, f)) for f in self.FIELDS)

    __hash__ = None  # type: ignore[assignment]

    # -- field checks (each normalises the attribute in place) --------------------------------
    def _str(self, name: str) -> None:
        if not isinstance(getattr(self, name), str):
            raise _err(self, name, f"expected str, got {type(getattr(self, name)).__name__}")

    def _int(self, name: str) -> None:
        v = getattr(self, name)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise _err(self, name, f"expected int, got {type(v).__name__} {v!r}")
        setattr(self, name, int(v))

    def _list(self, name: str, kind: type, B: int | None) -> None:
        v = getattr(self, name)
        if isinstance(v, np.ndarray) and kind is int and v.ndim == 1 and v.dtype.kind in "iu":
            v = v.tolist()
        if not isinstance(v, (list, tuple)):
            raise _err(self, name, f"expected list[{kind.__name__}], got {type(v).__name__}")
        v = list(v)
        if not set(map(type, v)) <= {kind}:  # the common case (every entry exactly str / int) at C speed
            ok = (int, np.integer) if kind is int else (kind,)
            for i, x in enumerate(v):
                if isinstance(x, (bool, np.bool_)) or not isinstance(x, ok):
                    raise _err(self, name, f"entry {i} is {type(x).__name__} {x!r}, expected {kind.__name__}")
            if kind is int:
                v = [int(x) for x in v]
        setattr(self, name, v)
        if B is not None and len(v) != B:
            raise _err(
                self, name, f"has {len(v)} entries but B={B} (len(prompt_id)); give one entry per sample"
            )

    def _refs(self, name: str, B: int) -> None:
        """A per-row list of blob references: [] (absent: no row has any) or B lists of 'sha256:' strings."""
        v = getattr(self, name)
        if not isinstance(v, (list, tuple)):
            raise _err(self, name, f"expected a list of lists of blob references, got {type(v).__name__}")
        v = [list(r) if isinstance(r, (list, tuple)) else r for r in v]
        if v and len(v) != B:
            raise _err(self, name, f"has {len(v)} entries but B={B} (len(prompt_id)); give one list per row "
                                   "([] for a text-only row), or [] for a batch without any")
        for i, row in enumerate(v):
            if not isinstance(row, list):
                raise _err(self, name, f"entry {i} is {type(row).__name__}, expected a list of blob references")
            for ref in row:
                if not isinstance(ref, str) or not ref.startswith("sha256:") or len(ref) != 71:
                    raise _err(self, name, f"entry {i} holds {short_repr([ref], 1)}, not a blob reference "
                                           "('sha256:' + 64 hex digits, written by the feeder's blob store)")
        setattr(self, name, v)

    def _vector(self, name: str, value: Any, B: int, ids: Any) -> np.ndarray:
        """A float32 (B,) finite vector; Python lists are converted, other arrays rejected."""
        if not isinstance(value, np.ndarray):
            value = as_dtype(value, "float32", field=f"{type(self).__name__}.{name}")
        elif value.dtype != np.float32:
            raise _err(self, name, f"has dtype {value.dtype}; cast it to float32 (arr.astype(np.float32))")
        if value.shape != (B,):
            raise _err(self, name, f"has shape {value.shape} but must be (B,) = ({B},), one value per sample")
        bad = None if self._finite(name, value) else np.flatnonzero(~np.isfinite(value))
        if bad is not None and bad.size:
            raise _err(self, name, f"non-finite values (NaN or inf) for samples {_ids_text(ids, bad)}; "
                                   "fix or drop those samples upstream")  # fmt: skip
        return value


def _value_eq(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
            and a.shape == b.shape and a.tobytes() == b.tobytes()
        )  # fmt: skip
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_value_eq(a[k], b[k]) for k in a)
    return bool(a == b)


@dataclass(eq=False)
class PromptBatch(_Message):
    """G prompts read by the feeder (topic ``prompts``). ``len(batch)`` = G."""

    SCHEMA: ClassVar[str] = "expstream.PromptBatch"
    VERSION: ClassVar[int] = 2
    FIELDS: ClassVar[dict[str, str]] = {
        "batch_id": "str", "prompt_id": "strs", "prompt": "strs", "label": "strs", "reference": "strs",
        "images": "opt_refs", "videos": "opt_refs",
    }  # fmt: skip

    batch_id: str  # stable id of this record, e.g. "p000003"
    prompt_id: list[str] = field(default_factory=list)  # (G,) one id per prompt group; unique within a run
    prompt: list[str] = field(default_factory=list)  # (G,) prompt text
    label: list[str] = field(default_factory=list)  # (G,) label for reward functions ("" when none)
    reference: list[str] = field(default_factory=list)  # (G,) reference answer ("" when none)
    # v2: visual inputs by claim check (expstream/models/blobs.py). [] when no prompt has any; else (G; k_g)
    # blob references: images are image files' bytes, videos are frame-list manifests (expstream/models/media.py)
    images: list[list[str]] = field(default_factory=list)
    videos: list[list[str]] = field(default_factory=list)

    def validate(self) -> None:
        """Check types and that every list has G = len(prompt_id) entries."""
        self._str("batch_id")
        self._list("prompt_id", str, None)
        for name in ("prompt", "label", "reference"):
            self._list(name, str, len(self.prompt_id))
        for name in PROMPT_V2_FIELDS:
            self._refs(name, len(self.prompt_id))


@dataclass(eq=False)
class SampleBatch(_Message):
    """B samples (responses) of a micro-batch; every topic after ``prompts``. ``len(batch)`` = B.

    ``Ragged (B; x)`` below is a :class:`Ragged` with B rows, row b of length x_b; a_b is the
    number of action tokens of sample b (the lengths of ``action_ids``).
    """

    SCHEMA: ClassVar[str] = "expstream.SampleBatch"
    VERSION: ClassVar[int] = 4
    FIELDS: ClassVar[dict[str, str]] = {
        "batch_id": "str", "policy_version": "int", "n_samples_per_prompt": "int",
        "eos_token_id": "int", "pad_token_id": "int",
        "prompt_id": "strs", "group_id": "strs", "sample_index": "ints", "prompt": "strs",
        "label": "strs", "reference": "strs", "response": "strs",
        "prompt_ids": "ragged", "response_ids": "ragged", "rollout_log_probs": "ragged",
        "rollout_version": "opt_ints", "layout": "str",
        "action_ids": "ragged", "action_mask": "ragged", "action_log_probs": "ragged",
        "action_entropy": "ragged", "logprob_version": "opt_ints",
        "base_action_log_probs": "ragged", "values": "ragged",
        "rewards": "array", "reward_metrics": "arrays", "kl": "ragged", "kl_coef": "float",
        "processed_rewards": "array", "token_rewards": "ragged", "advantages": "ragged",
        "returns": "ragged", "info": "arrays",
        "images": "opt_refs", "videos": "opt_refs", "image_grid_thw": "ragged", "video_grid_thw": "ragged",
        "turn_lengths": "ragged", "turn_rewards": "ragged", "turn_versions": "ragged",
        "token_versions": "ragged",
    }  # fmt: skip
    #: Fields describing the whole micro-batch (not sliced by select / joined by concat).
    PER_BATCH: ClassVar[tuple[str, ...]] = (
        "batch_id", "policy_version", "n_samples_per_prompt", "eos_token_id", "pad_token_id", "layout", "kl_coef",
    )  # fmt: skip

    batch_id: str  # stable micro-batch id (feeder p{k:06d}; shard-preprocess appends /m{j}; g/{group_id})
    policy_version: int  # version of the actor weights that generated the responses
    n_samples_per_prompt: int  # n, the group size (>= 1)
    eos_token_id: int  # actor tokenizer EOS id
    pad_token_id: int  # actor tokenizer pad id
    prompt_id: list[str] = field(default_factory=list)  # (B,) prompt id of each sample; defines B
    group_id: list[str] = field(default_factory=list)  # (B,) group id (= prompt_id)
    sample_index: list[int] = field(default_factory=list)  # (B,) 0..n-1 within the group
    prompt: list[str] = field(default_factory=list)  # (B,) prompt text
    label: list[str] = field(default_factory=list)  # (B,) label ("" when none)
    reference: list[str] = field(default_factory=list)  # (B,) reference answer ("" when none)
    response: list[str] = field(default_factory=list)  # (B,) decoded response text
    prompt_ids: Ragged | None = None  # Ragged int32 (B; p_b) prompt tokens after prompt_max_len truncation
    response_ids: Ragged | None = None  # Ragged int32 (B; o_b) raw engine output tokens
    # v2: behaviour log-probs from the engine (the distribution sampled from: after temperature,
    # top-k, top-p). Ragged float32 (B; o_b) response-level from generate; (B; a_b) aligned with
    # action_ids from shard-preprocess on (docs/async.md, "wire").
    rollout_log_probs: Ragged | None = None
    rollout_version: list[int] = field(default_factory=list)  # (B,) or []: policy version that generated each sample
    layout: str = ""  # "" before shard-preprocess, then "padded" or "packed"
    action_ids: Ragged | None = None  # Ragged int32 (B; a_b) response tokens after EOS repair, incl. EOS
    action_mask: Ragged | None = None  # Ragged bool (B; a_b) action mask cut to a_b
    action_log_probs: Ragged | None = None  # Ragged float32 (B; a_b) log-probs under the current policy
    action_entropy: Ragged | None = None  # Ragged float32 (B; a_b) entropy (high_entropy_token_ratio > 0)
    logprob_version: list[int] = field(default_factory=list)  # (B,) or []: actor version behind action_log_probs
    base_action_log_probs: Ragged | None = None  # Ragged float32 (B; a_b) reference-model log-probs
    values: Ragged | None = None  # Ragged float32 (B; a_b) critic values
    rewards: np.ndarray | None = None  # float32 (B,) raw scalar reward r_b
    reward_metrics: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 (B,)
    kl: Ragged | None = None  # Ragged float32 (B; a_b) token KL (masked positions 0)
    kl_coef: float | None = None  # beta used for this batch
    processed_rewards: np.ndarray | None = None  # float32 (B,) postprocess: r + overlong; advantage: final R_b
    token_rewards: Ragged | None = None  # Ragged float32 (B; a_b) -beta*kl + R_b at the last valid action
    advantages: Ragged | None = None  # Ragged float32 (B; a_b)
    returns: Ragged | None = None  # Ragged float32 (B; a_b)
    info: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 (B,) per-sample metrics
    # v3: visual inputs by claim check (schemas/README.md). [] / None when no sample has any.
    images: list[list[str]] = field(default_factory=list)  # (B; k_b) image blob references, in prompt order
    videos: list[list[str]] = field(default_factory=list)  # (B; v_b) video manifest blob references
    image_grid_thw: Ragged | None = None  # Ragged int32 (B; 3*k_b) (t, h, w) patch grid of each image
    video_grid_thw: Ragged | None = None  # Ragged int32 (B; 3*v_b) (t, h, w) patch grid of each video
    # v4: multi-turn episodes (docs/multi_turn.md); None in a single-turn run. response_ids is then the
    # episode after the prompt: model turn 1, observation 1, model turn 2, ..., always ending with a model turn
    turn_lengths: Ragged | None = None  # Ragged int32 (B; 2k-1 or 2k) lengths of those segments, model first
    turn_rewards: Ragged | None = None  # Ragged float32 (B; k or k-1) the environment's reward per model turn
    turn_versions: Ragged | None = None  # Ragged int32 (B; k) policy version that generated each model turn
    # v5: the policy version each token was sampled under (in-flight weight updates, docs/async.md). Ragged int32
    # with rollout_log_probs' lengths: (B; o_b) from generate, (B; a_b) from shard-preprocess on. None: every
    # token of sample b was sampled under rollout_version[b] (every record before version 5).
    token_versions: Ragged | None = None

    def sample_ids(self) -> list[str]:
        """``f"{group_id}#{sample_index}"`` for every sample."""
        return [sample_id(g, i) for g, i in zip(self.group_id, self.sample_index, strict=True)]

    def _same_lengths(self, name: str, r: Ragged, ref_name: str, ids: Any, missing: str, why: str) -> None:
        """``r``'s row lengths must equal ``ref_name``'s (a ragged field of this batch)."""
        ref_field = getattr(self, ref_name)
        if ref_field is None:
            raise _err(self, name, f"is set but {ref_name} is missing; {missing}")
        ref = ref_field.lengths
        if r.lengths is ref or (r.lengths.shape == ref.shape and r.lengths.tobytes() == ref.tobytes()):
            return  # the common case, cheaper than array_equal (both are int32: Ragged makes them so)
        if not np.array_equal(r.lengths, ref):
            row = int(np.flatnonzero(r.lengths != ref)[0])
            raise _err(self, name, f"ragged lengths {short_repr(r.lengths)} disagree with {ref_name} lengths "
                                   f"{short_repr(ref)} (first at sample {ids[row]}); {why}")  # fmt: skip

    def validate(self) -> None:
        """Check every field against the contract (types, B, dtypes, lengths, finiteness).

        Every check runs each time, but the finiteness of a float array this message already found
        finite (the same object: see ``_finite``); a field assigned since is checked whole.
        """
        self._str("batch_id")
        for name in ("policy_version", "n_samples_per_prompt", "eos_token_id", "pad_token_id"):
            self._int(name)
        n = self.n_samples_per_prompt
        if n < 1:
            raise _err(self, "n_samples_per_prompt", f"must be >= 1, got {n}")
        self._list("prompt_id", str, None)
        B = len(self.prompt_id)
        for name in ("group_id", "prompt", "label", "reference", "response"):
            self._list(name, str, B)
        self._list("sample_index", int, B)
        for name in ("rollout_version", "logprob_version"):
            self._versions(name, B)
        si = self.sample_index
        bad = [i for i, s in enumerate(si) if not 0 <= s < n] if si and (min(si) < 0 or max(si) >= n) else []
        if bad:
            raise _err(self, "sample_index", f"values {short_repr([self.sample_index[i] for i in bad], 5)} at rows "
                                             f"{short_repr(bad, 5)} are outside [0, n_samples_per_prompt={n}); "
                                             "sample_index must be 0..n-1 within its group")  # fmt: skip
        ids: Any = _LazyIds(self)
        self._str("layout")
        if self.layout not in LAYOUTS:
            raise _err(self, "layout", f"unknown layout {self.layout!r}; use one of {list(LAYOUTS)}")
        if self.kl_coef is not None:
            if isinstance(self.kl_coef, (bool, np.bool_)) or not isinstance(
                self.kl_coef, (int, float, np.number)
            ):
                raise _err(self, "kl_coef", f"expected float or None, got {type(self.kl_coef).__name__}")
            self.kl_coef = float(self.kl_coef)
            if not math.isfinite(self.kl_coef):
                raise _err(self, "kl_coef", f"must be finite, got {self.kl_coef}")
        for name, dtype in RAGGED_DTYPES.items():
            self._ragged(name, dtype, B, ids)
        tv = self.token_versions
        if tv is not None and tv.values.size and int(tv.values.min()) < 0:
            raise _err(self, "token_versions", "negative policy versions; versions start at 0 (the initial weights)")
        for name in ("rewards", "processed_rewards"):
            if getattr(self, name) is not None:
                setattr(self, name, self._vector(name, getattr(self, name), B, ids))
        for name in ("reward_metrics", "info"):
            d = {} if getattr(self, name) is None else getattr(self, name)
            if not isinstance(d, dict):
                raise _err(self, name, f"expected dict[str, float32 array (B,)], got {type(d).__name__}")
            for k in d:
                if not isinstance(k, str):
                    raise _err(self, name, f"key {k!r} is {type(k).__name__}; keys must be str")
            setattr(self, name, {k: self._vector(f"{name}[{k!r}]", v, B, ids) for k, v in d.items()})
        self._visual(B, ids)
        self._turns(ids)

    def _turns(self, ids: Any) -> None:
        """turn_lengths covers response_ids exactly; one version per model turn, at most one reward each."""
        tl, tr, tv = self.turn_lengths, self.turn_rewards, self.turn_versions
        if tl is None:
            for name in ("turn_rewards", "turn_versions"):
                if getattr(self, name) is not None:
                    raise _err(self, name, "is set but turn_lengths is missing; a multi-turn record has all three")
            return
        if self.response_ids is None:
            raise _err(self, "turn_lengths", "is set but response_ids is missing; the turns are segments of it")
        rows = tl.rows()
        for b, row in enumerate(rows):
            k = (len(row) + 1) // 2
            if int(np.sum(row)) != int(self.response_ids.lengths[b]) or (row.size and int(row.min()) < 0):
                raise _err(self, "turn_lengths", f"sample {ids[b]}: segments {short_repr(row.tolist())} do not add up "
                                                 f"to its {int(self.response_ids.lengths[b])} response tokens")
            if tv is None or len(tv.row(b)) != k:
                raise _err(self, "turn_versions", f"sample {ids[b]}: give one version per model turn ({k})")
            if tr is None or len(tr.row(b)) not in (k - 1, k):
                raise _err(self, "turn_rewards", f"sample {ids[b]}: give one reward per answered model turn")

    def _visual(self, B: int, ids: Any) -> None:
        """images/videos references and their grids: 3 ints (t, h, w), all >= 1, per reference."""
        for refs, grid in (("images", "image_grid_thw"), ("videos", "video_grid_thw")):
            self._refs(refs, B)
            r, g = getattr(self, refs), getattr(self, grid)
            if g is None:
                continue
            if not r:
                raise _err(self, grid, f"is set but {refs} is empty; a grid describes the {refs} of each sample")
            want = np.asarray([3 * len(row) for row in r], dtype=np.int64)
            if not np.array_equal(g.lengths.astype(np.int64), want):
                row = int(np.flatnonzero(g.lengths != want)[0])
                raise _err(self, grid, f"sample {ids[row]} has {int(g.lengths[row])} grid entries for "
                                       f"{len(r[row])} {refs}; write 3 (t, h, w) per reference")
            if g.values.size and int(g.values.min()) < 1:
                raise _err(self, grid, "grid sizes must be >= 1 (t, h, w patches)")

    def _versions(self, name: str, B: int) -> None:
        """A per-sample policy-version list: [] (absent, e.g. a version-1 record) or B ints >= 0."""
        self._list(name, int, None)
        v = getattr(self, name)
        if v and len(v) != B:
            raise _err(self, name, f"has {len(v)} entries but B={B} (len(prompt_id)); give one version per "
                                   "sample, or none at all")  # fmt: skip
        bad = [i for i, x in enumerate(v) if x < 0] if v and min(v) < 0 else []
        if bad:
            raise _err(self, name, f"negative policy versions {short_repr([v[i] for i in bad], 5)} at rows "
                                   f"{short_repr(bad, 5)}; versions start at 0 (the initial weights)")  # fmt: skip

    def _ragged(self, name: str, dtype: str, B: int, ids: Any) -> None:
        r = getattr(self, name)
        if r is None:
            return
        if not isinstance(r, Ragged):
            raise _err(self, name, f"expected schemas.Ragged or None, got {type(r).__name__}; "
                                   f"build it with Ragged.from_rows(rows, {dtype!r})")  # fmt: skip
        if r.dtype != dtype:
            raise _err(self, name, f"has dtype {r.dtype} but must be {dtype}; "
                                   f"cast it (Ragged.from_rows(r.rows(), {dtype!r}))")  # fmt: skip
        if r.lengths.shape[0] != B:
            raise _err(self, name, f"has {len(r)} rows but B={B} (len(prompt_id)); give one row per sample")
        if name in RESPONSE_LEVEL_BEFORE_ACTIONS and self.action_ids is None:
            self._same_lengths(name, r, "response_ids", ids,
                               "before shard-preprocess it is response-level and needs response_ids to define "
                               "its lengths", "before shard-preprocess it holds one value per generated token")
        elif name in ACTION_FIELDS:
            self._same_lengths(name, r, "action_ids", ids,
                               "action-level fields need action_ids (set by shard-preprocess) to define the "
                               "action lengths", "every action-level field must have one value per action token")
        if dtype == "float32" and not self._finite(name, r.values):
            bad = np.flatnonzero(~np.isfinite(r.values))
            if bad.size:
                rows = np.unique(np.searchsorted(r.offsets, bad, side="right") - 1)
                raise _err(self, name, f"non-finite values (NaN or inf) for samples {_ids_text(ids, rows)}; "
                                       "fix or drop those samples upstream")  # fmt: skip

    def select(self, indices: Sequence[int] | np.ndarray, batch_id: str | None = None) -> SampleBatch:
        """New batch with samples ``indices`` (ints or a bool mask); per-batch fields are kept.

        ``batch_id`` replaces the batch id (kept when None).
        """
        idx = normalise_indices(indices, len(self))
        changes: dict[str, Any] = {} if batch_id is None else {"batch_id": batch_id}
        for name, kind in self.FIELDS.items():
            v = getattr(self, name)
            if name in self.PER_BATCH or v is None:
                continue
            if kind in ("strs", "ints") or (kind in ("opt_ints", "opt_refs") and v):
                changes[name] = [v[i] for i in idx.tolist()]
            elif kind == "ragged":
                changes[name] = v.select(idx)
            elif kind == "array":
                changes[name] = v[idx]
            elif kind == "arrays":
                changes[name] = {k: a[idx] for k, a in v.items()}
        return dataclasses.replace(self, **changes)

    @classmethod
    def concat(cls, batches: Sequence[SampleBatch], batch_id: str) -> SampleBatch:
        """All samples of ``batches`` in order, as one batch called ``batch_id``.

        n_samples_per_prompt, eos/pad token ids and layout must agree; policy_version is the
        minimum; kl_coef is the first batch's (None unless every batch has one); an optional
        field (or an info / reward_metrics key) is kept only if every batch has it.
        """
        if not batches:
            raise ValueError("SampleBatch.concat: no batches; there is nothing to take per-batch fields from")
        first = batches[0]
        kwargs: dict[str, Any] = {
            "batch_id": batch_id,
            "policy_version": min(b.policy_version for b in batches),
        }
        for name in ("n_samples_per_prompt", "eos_token_id", "pad_token_id", "layout"):
            seen = [getattr(b, name) for b in batches]
            if any(s != seen[0] for s in seen):
                raise ValidationError(
                    f"SampleBatch.{name}: batches to concat disagree ({short_repr(seen, 5)}); only batches "
                    "of one run and one layout can be joined", field=f"SampleBatch.{name}")  # fmt: skip
            kwargs[name] = seen[0]
        kwargs["kl_coef"] = first.kl_coef if all(b.kl_coef is not None for b in batches) else None
        for name, kind in cls.FIELDS.items():
            if name in cls.PER_BATCH:
                continue
            vals = [getattr(b, name) for b in batches]
            if kind in ("strs", "ints"):
                kwargs[name] = [x for v in vals for x in v]
            elif kind == "opt_ints":  # kept only when every batch has one entry per sample
                whole = all(len(v) == len(b) for v, b in zip(vals, batches, strict=True))
                kwargs[name] = [x for v in vals for x in v] if whole else []
            elif kind == "opt_refs":  # a text-only batch among image batches: no references per sample
                kwargs[name] = ([x for v, b in zip(vals, batches, strict=True) for x in (v or [[]] * len(b))]
                                if any(vals) else [])
            elif name in ("image_grid_thw", "video_grid_thw") and any(v is not None for v in vals):
                kwargs[name] = Ragged.concat([v if v is not None else Ragged.from_rows(
                    [np.zeros(0, np.int32)] * len(b), "int32") for v, b in zip(vals, batches, strict=True)])
            elif any(v is None for v in vals):
                continue
            elif kind == "ragged":
                kwargs[name] = Ragged.concat(vals)
            elif kind == "array":
                kwargs[name] = np.concatenate(vals)
            elif kind == "arrays":
                keys = [k for k in vals[0] if all(k in v for v in vals)]
                kwargs[name] = {k: np.concatenate([v[k] for v in vals]) for k in keys}
        return cls(**kwargs)
