"""What a published weight version is: the manifest, the roles, the store's errors (every backend's).

Shared by the directory store (expstream/train/weights.py) and the object store
(expstream/train/objweights.py), so that both write the same manifest.json and raise the same
errors; a follower does not know which backend it reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from expstream.errors import ExpstreamError

__all__ = ["ROLES", "WEIGHTS_FILE", "MANIFEST_FILE", "VERSION_DIR", "REPUBLISH_FIX", "Manifest", "WeightStoreError",
           "CorruptWeightsError", "VersionGoneError", "check_role", "cpu_tensors"]

#: The roles a store holds: the policy, and the critic when the trainer trains one (gae).
ROLES = ("actor", "critic")
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
VERSION_DIR = re.compile(r"^v(\d{6,})$")
REPUBLISH_FIX = ("the file was changed or only half written after publication; publish the version again "
                 "from the trainer's checkpoint, or delete that version directory (followers keep the "
                 "previous weights meanwhile)")


class WeightStoreError(ExpstreamError):
    """A weight store operation failed (a version published twice, an unknown role). Not retriable."""

    retriable = False


class CorruptWeightsError(WeightStoreError):
    """A stored version is missing, half written, or does not match its manifest's sha256."""


class VersionGoneError(CorruptWeightsError):
    """The version is not in the store (any more): deleted by retention (``train.keep_versions``) while
    a reader wanted it, or never published here. A follower then loads the newest announced version."""


# --- the manifest ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Manifest:
    """What a published version is: written next to the weights and sent on the ``policy`` topic."""

    version: int  # the policy version this file is (>= 1; 0 = the initial model, never stored)
    step: int  # the trainer step that produced it (version = step + 1 for the reference trainer)
    role: str  # "actor" | "critic"
    sha256: str  # hex digest of model.safetensors, checked by every load
    dtype: str  # torch dtype name of the tensors ("float32"; several joined by "," when mixed)
    run_id: str  # the run that published it
    created: float  # unix time of publication
    # "topic[p]" -> [first, last] experience offsets trained on since the previous version
    offsets: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["offsets"] = {str(k): [int(a), int(b)] for k, (a, b) in self.offsets.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Build from ``to_dict()``'s output; a missing or mistyped field is a CorruptWeightsError."""
        if not isinstance(d, Mapping):
            raise CorruptWeightsError(f"manifest: expected a mapping, got {type(d).__name__}")
        types = {"version": int, "step": int, "role": str, "sha256": str, "dtype": str, "run_id": str,
                 "created": (int, float)}
        for name, typ in types.items():
            if name not in d:
                raise CorruptWeightsError(f"manifest: field {name!r} is missing (fields: {sorted(d)})")
            if not isinstance(d[name], typ) or isinstance(d[name], bool):
                raise CorruptWeightsError(f"manifest: field {name!r} = {d[name]!r} has the wrong type")
        offsets = d.get("offsets") or {}
        if not isinstance(offsets, Mapping) or not all(
                isinstance(v, (list, tuple)) and len(v) == 2 for v in offsets.values()):
            raise CorruptWeightsError(f"manifest: offsets must map 'topic[p]' to [first, last], got {offsets!r}")
        return cls(version=int(d["version"]), step=int(d["step"]), role=str(d["role"]),
                   sha256=str(d["sha256"]), dtype=str(d["dtype"]), run_id=str(d["run_id"]),
                   created=float(d["created"]),
                   offsets={str(k): [int(v[0]), int(v[1])] for k, v in offsets.items()})


def check_role(role: str) -> None:
    if role not in ROLES:
        raise WeightStoreError(f"unknown weight role {role!r}; use one of {', '.join(ROLES)}")


def cpu_tensors(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """Detached, contiguous CPU copies; tensors sharing storage (tied embeddings) are cloned, since
    safetensors refuses shared memory. Returns them and the dtype name(s)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise WeightStoreError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel() > 0:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in out.values()})
    return out, ",".join(dtypes)
