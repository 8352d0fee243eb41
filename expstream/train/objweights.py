"""The weight store in an S3-compatible object store: ``train.weight_store=s3://BUCKET/PREFIX``.

The same layout and manifest as the directory store (expstream/train/weights.py), as keys:
``<prefix>/v000001/model.safetensors`` and ``<prefix>/v000001/manifest.json`` for the actor,
``<prefix>/critic/v000001/...`` for the critic. An object store has no rename, so publication is:

1. the weights object, in one PUT (overwriting the leftover of a publisher killed before step 2);
2. the manifest object, **last**, with a create-only PUT (``If-None-Match: *``): the version exists
   from that instant, whole, and a second publisher of the same version loses with WeightStoreError.

Readers trust only a complete manifest: ``versions`` lists a version when its manifest object is
there, ``load`` reads the manifest, then all the weights' bytes (retried with backoff, see
expstream/models/objstore.py), checks their sha256 against the manifest and only then parses them.
A follower never half-loads: it gets a whole, checked state dict or an error and keeps its weights.
Deletion (retention) removes the manifest first (readers stop listing the version), then the
weights; ``discard_after`` also removes weights objects that never got a manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Mapping

import torch

from expstream.models.objstore import ObjectExistsError, ObjectMissingError, ObjectStore, open_object_store
from expstream.train.manifest import (
    MANIFEST_FILE,
    REPUBLISH_FIX,
    VERSION_DIR,
    WEIGHTS_FILE,
    CorruptWeightsError,
    Manifest,
    VersionGoneError,
    WeightStoreError,
    check_role,
    cpu_tensors,
)

__all__ = ["ObjectWeightStore", "open_object_weight_store"]


class ObjectWeightStore:
    """:class:`~expstream.train.weights.WeightStore` on an object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"ObjectWeightStore({self.store.url()!r})"

    @staticmethod
    def role_prefix(role: str) -> str:
        return "" if role == "actor" else role

    def key(self, role: str, version: int, name: str) -> str:
        return "/".join(p for p in (self.role_prefix(role), f"v{int(version):06d}", name) if p)

    def describe(self, role: str, version: int) -> str:
        return self.store.url(self.key(role, version, WEIGHTS_FILE))

    def publish(self, role: str, version: int, state_dict: Mapping[str, torch.Tensor], *, step: int,
                offsets: Mapping[str, list[int]], run_id: str) -> Manifest:
        """Write one version, once: the weights, then the manifest (create-only) last."""
        from safetensors.torch import save

        check_role(role)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise WeightStoreError(f"{role} version {version!r}: published versions start at 1 "
                                   "(0 is the initial model, never stored)")
        manifest_key = self.key(role, version, MANIFEST_FILE)
        if self.store.exists(manifest_key):
            raise WeightStoreError(f"{role} v{version} already exists at {self.store.url(manifest_key)}: a version is "
                                   "written once; publish the next version, or discard_after() leftovers of a "
                                   "killed trainer")
        tensors, dtype = cpu_tensors(state_dict)
        data = save(tensors, metadata={"role": role, "version": str(version)})
        self.store.put(self.key(role, version, WEIGHTS_FILE), data)
        manifest = Manifest(version=version, step=int(step), role=role, sha256=hashlib.sha256(data).hexdigest(),
                            dtype=dtype, run_id=str(run_id), created=time.time(),
                            offsets={str(k): [int(v[0]), int(v[1])] for k, v in offsets.items()})
        text = json.dumps(manifest.to_dict(), indent=1, sort_keys=True).encode()
        try:
            self.store.put(manifest_key, text, create_only=True)
        except ObjectExistsError as exc:
            # a retried PUT whose first try had landed (its answer lost) finds our own manifest: that is success
            with contextlib.suppress(ObjectMissingError):
                if self.store.get(manifest_key) == text:
                    return manifest
            raise WeightStoreError(f"{role} v{version} was published concurrently at {self.store.url(manifest_key)}; "
                                   "only one trainer may publish a run's versions") from exc
        return manifest

    def manifest(self, role: str, version: int) -> Manifest:
        check_role(role)
        key = self.key(role, version, MANIFEST_FILE)
        url = self.store.url(key)
        try:
            raw = self.store.get(key)
        except ObjectMissingError:
            raise VersionGoneError(f"{role} v{version}: {url} is missing: deleted by retention (train.keep_versions "
                                   "keeps the newest versions), or never published here (check train.weight_store "
                                   "points at the trainer's store)") from None
        try:
            m = Manifest.from_dict(json.loads(raw))
        except ValueError as exc:  # CorruptWeightsError is not a ValueError: both are named
            raise CorruptWeightsError(f"{role} v{version}: {url} is not readable JSON ({exc}); fix: "
                                      f"{REPUBLISH_FIX}") from exc
        except CorruptWeightsError as exc:
            raise CorruptWeightsError(f"{role} v{version}: {url}: {exc}; fix: {REPUBLISH_FIX}") from exc
        if m.role != role or m.version != version:
            raise CorruptWeightsError(f"{role} v{version}: {url} describes {m.role} v{m.version}; fix: {REPUBLISH_FIX}")
        return m

    def load(self, role: str, version: int) -> dict[str, torch.Tensor]:
        """The version's tensors: every byte read (retried), hashed, compared with the manifest, then parsed."""
        from safetensors import SafetensorError
        from safetensors.torch import load as load_bytes

        m = self.manifest(role, version)
        url = self.describe(role, version)
        try:
            data = self.store.get(self.key(role, version, WEIGHTS_FILE))
        except ObjectMissingError:
            raise VersionGoneError(f"{role} v{version}: {url} was deleted while it was being loaded (retention: "
                                   "train.keep_versions)") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != m.sha256:
            raise CorruptWeightsError(f"{role} v{version}: {url} has sha256 {digest[:12]}… ({len(data)} bytes) but its "
                                      f"manifest says {m.sha256[:12]}…; fix: {REPUBLISH_FIX}")
        try:
            return load_bytes(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise CorruptWeightsError(f"{role} v{version}: {url} matches its hash but is not a safetensors file "
                                      f"({exc}); fix: {REPUBLISH_FIX}") from exc

    def _keys(self, role: str) -> dict[int, set[str]]:
        """version -> the names of its objects, for the role's ``v<N>/<name>`` keys (nothing deeper)."""
        base = self.role_prefix(role)
        out: dict[int, set[str]] = {}
        for key in self.store.list(base):
            parts = key[len(base) + 1:].split("/") if base else key.split("/")
            if len(parts) == 2 and (m := VERSION_DIR.match(parts[0])):
                out.setdefault(int(m.group(1)), set()).add(parts[1])
        return out

    def versions(self, role: str) -> list[int]:
        """Versions whose manifest is there, ascending (a weights object alone is not a version)."""
        check_role(role)
        return sorted(v for v, names in self._keys(role).items() if MANIFEST_FILE in names)

    def latest(self, role: str) -> int | None:
        vs = self.versions(role)
        return vs[-1] if vs else None

    def discard_after(self, role: str, version: int) -> list[int]:
        """Delete every version > ``version``, and every weights object without a manifest (a publication a
        killed trainer left half done). Returns the versions removed. Only from the (one) trainer."""
        check_role(role)
        keys = self._keys(role)
        removed = [v for v in sorted(keys) if v > version and MANIFEST_FILE in keys[v] and self.delete(role, v)]
        for v, names in keys.items():
            if MANIFEST_FILE not in names:
                for name in names:
                    self.store.delete(self.key(role, v, name))
        return removed

    def delete(self, role: str, version: int) -> bool:
        """Delete one version: the manifest first (readers stop listing it), then the weights."""
        check_role(role)
        manifest_key = self.key(role, version, MANIFEST_FILE)
        if not self.store.exists(manifest_key):
            return False
        self.store.delete(manifest_key)
        self.store.delete(self.key(role, version, WEIGHTS_FILE))
        return True


def open_object_weight_store(url: str) -> ObjectWeightStore:
    return ObjectWeightStore(open_object_store(url, "train.weight_store"))
