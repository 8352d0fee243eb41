"""Weights flow back: a write-once, content-hashed weight store, the ``policy`` topic, hot reload.

A trainer publishes each new policy version into a :class:`WeightStore` (default: a directory, a
shared filesystem in a deployment), then *announces* it on the ``policy`` topic and in Redis;
weights never go through the broker. The stages that follow the policy keep a
:class:`PolicyFollower` that loads a newer announced version between micro-batches, in place.
:func:`prune_versions` keeps only the versions that can still be needed, and a deletion unlists a
version before removing its files, so a reader sees a whole version or none (a follower that
loses its version, :class:`VersionGoneError`, loads the newest). Versions, the store's layout and
retention: docs/async.md "Weights flow back" and "What a long run keeps".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import msgpack
import torch

from expstream.config.storeurl import parse_store
from expstream.errors import ConfigError
from expstream.kafka.topics import (
    POLICY_TOPIC,  # one name for the announcement topic; topics.py stays torch-free
)
from expstream.models.objstore import ObjectStoreError, open_object_store
from expstream.train.manifest import (  # noqa: F401  (re-exported: the store's public names stay here)
    MANIFEST_FILE,
    REPUBLISH_FIX,
    ROLES,
    VERSION_DIR,
    WEIGHTS_FILE,
    CorruptWeightsError,
    Manifest,
    VersionGoneError,
    WeightStoreError,
    check_role,
    cpu_tensors,
)
from expstream.train.objweights import ObjectWeightStore

_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
# Why 3: a follower whose version was deleted by retention retries with the newest announced one; the
# trainer would have to publish keep_versions more versions during each single load to exhaust three.
GONE_RETRIES = 3
# Why 1 MiB: hashing reads the file in chunks so that a large model is not held twice in memory.
_HASH_CHUNK = 1024 * 1024

__all__ = [
    "POLICY_TOPIC",
    "ROLES",
    "Manifest",
    "WeightStore",
    "DirectoryWeightStore",
    "WeightStoreError",
    "CorruptWeightsError",
    "VersionGoneError",
    "retained_versions",
    "prune_versions",
    "open_store",
    "announce",
    "read_policy_log",
    "PolicyFollower",
    "follower_for",
    "refresh_weights",
]

# --- the store -------------------------------------------------------------------------------------
class WeightStore(Protocol):
    """Where published versions live. Each (role, version) is written once, atomically.

    ``delete`` is the retention primitive (:func:`prune_versions`): the version first stops being
    listed by ``versions`` (a directory renamed away; in an object store, the manifest object deleted
    first), then its files go; ``manifest``/``load`` of a version not there raise
    :class:`VersionGoneError`. Idempotent: deleting a version not there returns False.
    """

    def publish(self, role: str, version: int, state_dict: Mapping[str, torch.Tensor], *, step: int,
                offsets: Mapping[str, list[int]], run_id: str) -> Manifest: ...
    def manifest(self, role: str, version: int) -> Manifest: ...
    def load(self, role: str, version: int) -> dict[str, torch.Tensor]: ...
    def latest(self, role: str) -> int | None: ...
    def versions(self, role: str) -> list[int]: ...
    def discard_after(self, role: str, version: int) -> list[int]: ...
    def delete(self, role: str, version: int) -> bool: ...
    def describe(self, role: str, version: int) -> str: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class DirectoryWeightStore:
    """The default store: a directory tree (local disk, or a shared filesystem in a deployment)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"DirectoryWeightStore({str(self.root)!r})"

    def role_dir(self, role: str) -> Path:
        """The actor's versions sit at the top (``<root>/v000001``, the run-directory layout of
        DESIGN.md: ``weights/v<N>/``); every other role has a folder of its own (``<root>/critic``)."""
        return self.root if role == "actor" else self.root / role

    def path(self, role: str, version: int) -> Path:
        return self.role_dir(role) / f"v{int(version):06d}"

    def describe(self, role: str, version: int) -> str:
        return str(self.path(role, version) / WEIGHTS_FILE)

    def publish(self, role: str, version: int, state_dict: Mapping[str, torch.Tensor], *, step: int,
                offsets: Mapping[str, list[int]], run_id: str) -> Manifest:
        """Write one version, once. Protocol:

        1. refuse a role not in ROLES, a version < 1, or a version already present;
        2. write model.safetensors into ``<root>/<role>/.tmp-<uuid>/`` and fsync it;
        3. hash the written file (what a reader will hash), write manifest.json, fsync it and the dir;
        4. ``os.rename`` the temporary directory to ``v<version>`` (atomic: a reader sees all or
           nothing; the kernel refuses to replace a non-empty directory, so a concurrent publisher
           of the same version loses with WeightStoreError), then fsync the role directory.
        """
        from safetensors.torch import save_file

        check_role(role)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise WeightStoreError(f"{role} version {version!r}: published versions start at 1 "
                                   "(0 is the initial model, never stored)")
        final = self.path(role, version)
        if final.exists():
            raise WeightStoreError(f"{role} v{version} already exists at {final}: a version is written once; "
                                   "publish the next version, or discard_after() leftovers of a killed trainer")
        tensors, dtype = cpu_tensors(state_dict)
        self.role_dir(role).mkdir(parents=True, exist_ok=True)
        tmp = self.role_dir(role) / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            weights = tmp / WEIGHTS_FILE
            save_file(tensors, str(weights), metadata={"role": role, "version": str(version)})
            _fsync_file(weights)
            manifest = Manifest(version=version, step=int(step), role=role, sha256=sha256_file(weights),
                                dtype=dtype, run_id=str(run_id), created=time.time(),
                                offsets={str(k): [int(v[0]), int(v[1])] for k, v in offsets.items()})
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict(), indent=1, sort_keys=True))
            _fsync_file(tmp / MANIFEST_FILE)
            _fsync_dir(tmp)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                raise WeightStoreError(f"{role} v{version} was published concurrently at {final} ({exc}); "
                                       "only one trainer may publish a run's versions") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.role_dir(role))
        return manifest

    def manifest(self, role: str, version: int) -> Manifest:
        check_role(role)
        path = self.path(role, version) / MANIFEST_FILE
        if not self.path(role, version).is_dir():
            raise VersionGoneError(f"{role} v{version}: {self.path(role, version)} is missing: deleted by retention "
                                   "(train.keep_versions keeps the newest versions), or never published here "
                                   "(check train.weight_store points at the trainer's store)")
        if not path.is_file():
            raise CorruptWeightsError(f"{role} v{version}: {path} is missing; the version was never published "
                                      "completely here (check train.weight_store points at the trainer's store)")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CorruptWeightsError(f"{role} v{version}: {path} is not readable JSON ({exc}); fix: "
                                      f"{REPUBLISH_FIX}") from exc
        try:
            m = Manifest.from_dict(data)
        except CorruptWeightsError as exc:
            raise CorruptWeightsError(f"{role} v{version}: {path}: {exc}; fix: {REPUBLISH_FIX}") from exc
        if m.role != role or m.version != version:
            raise CorruptWeightsError(f"{role} v{version}: {path} describes {m.role} v{m.version}; "
                                      f"fix: {REPUBLISH_FIX}")
        return m

    def load(self, role: str, version: int) -> dict[str, torch.Tensor]:
        """The version's tensors, after checking the file's sha256 against its manifest.

        The bytes that are hashed are the bytes that are parsed (read once), so a file replaced
        between the check and the parse cannot slip through.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load as load_bytes

        m = self.manifest(role, version)
        path = self.path(role, version) / WEIGHTS_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:  # deleted between the manifest and the weights
            raise VersionGoneError(f"{role} v{version}: {path} was deleted while it was being loaded (retention: "
                                   "train.keep_versions)") from exc
        except OSError as exc:
            raise CorruptWeightsError(f"{role} v{version}: cannot read {path} ({exc}); fix: {REPUBLISH_FIX}") from exc
        digest = hashlib.sha256(data).hexdigest()
        if digest != m.sha256:
            raise CorruptWeightsError(
                f"{role} v{version}: {path} has sha256 {digest[:12]}… ({len(data)} bytes) but its manifest "
                f"says {m.sha256[:12]}…; fix: {REPUBLISH_FIX}")
        try:
            return load_bytes(data)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise CorruptWeightsError(f"{role} v{version}: {path} matches its hash but is not a safetensors "
                                      f"file ({exc}); fix: {REPUBLISH_FIX}") from exc

    def versions(self, role: str) -> list[int]:
        """Complete versions, ascending (``.tmp-`` publications in progress are not versions)."""
        check_role(role)
        base = self.role_dir(role)
        if not base.is_dir():
            return []
        out = []
        for entry in base.iterdir():
            m = VERSION_DIR.match(entry.name)
            if m and (entry / MANIFEST_FILE).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self, role: str) -> int | None:
        vs = self.versions(role)
        return vs[-1] if vs else None

    def discard_after(self, role: str, version: int) -> list[int]:
        """Delete every version > ``version`` (and unfinished ``.tmp-`` publications): the leftovers
        of a trainer killed after publishing but before its checkpoint. Returns the versions removed.

        Each version is first renamed out of its name (atomic), then deleted, so a reader never
        sees a partly deleted version under a version name. Call it only from the (one) trainer.
        """
        check_role(role)
        base = self.role_dir(role)
        if not base.is_dir():
            return []
        removed = [v for v in self.versions(role) if v > version and self.delete(role, v)]
        for entry in base.iterdir():
            if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(entry, ignore_errors=True)
        return removed

    def delete(self, role: str, version: int) -> bool:
        """Delete one version: renamed out of its name (atomic: readers stop listing it), then removed.
        False when it is not there. Call it only from the (one) trainer."""
        check_role(role)
        trash = self.role_dir(role) / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
        try:
            os.rename(self.path(role, version), trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True


def retained_versions(versions: list[int], *, keep: int, checkpoint: int | None) -> set[int]:
    """The versions retention keeps out of ``versions``: the newest ``keep`` (``keep`` <= 0: every
    one) and ``checkpoint`` (the latest checkpoint's version: a resumed trainer announces it again)."""
    ordered = sorted(set(versions))
    kept = set(ordered if keep <= 0 else ordered[-keep:])
    if checkpoint is not None and checkpoint in ordered:
        kept.add(checkpoint)
    return kept


def prune_versions(store: WeightStore, role: str, *, keep: int, checkpoint: int | None) -> list[int]:
    """Delete every version of ``role`` that :func:`retained_versions` does not keep; returns them."""
    versions = store.versions(role)
    kept = retained_versions(versions, keep=keep, checkpoint=checkpoint)
    return [v for v in versions if v not in kept and store.delete(role, v)]


def open_store(path_or_url: str) -> WeightStore:
    """The store at ``path_or_url``: a directory path (or ``file://`` URL) -> DirectoryWeightStore;
    ``s3://BUCKET/PREFIX`` -> ObjectWeightStore (expstream/train/objweights.py)."""
    text = str(path_or_url)
    if not text:
        raise ConfigError("weight store path is empty", field="train.weight_store", fix="give a directory path")
    loc = parse_store(text, "train.weight_store")  # `s3:` or `gs://` is an error, not a directory
    if loc.kind == "s3":
        return ObjectWeightStore(open_object_store(loc, "train.weight_store"))
    return DirectoryWeightStore(Path(loc.path).expanduser())


# --- announcement ----------------------------------------------------------------------------------
def announce(manifest: Manifest, *, bootstrap: str, kafka_config: Any, state: Any,
             topic: str = POLICY_TOPIC, producer: Any = None) -> None:
    """Tell the pipeline a version exists (it must already be in the store). Protocol:

    1. one record on ``topic`` (key = run id, value = msgpack of ``manifest.to_dict()``), confirmed;
    2. for the actor, ``state.set_policy_version(version)`` (followers poll it between micro-batches).

    The record comes first so that the policy log is complete: a version followers may load has
    always been logged. A critic is only logged; critic followers load the critic version that
    goes with the announced actor version. ``producer``: the caller's, kept open across announcements (the
    trainer's, one for its life); without it one is made and closed for this record.
    """
    from expstream.kafka.clients import make_producer, send_and_confirm
    from expstream.kafka.provenance import provenance_headers

    own = producer is None
    if own:
        producer = make_producer(bootstrap, kafka_config)
    try:
        send_and_confirm(producer, topic, msgpack.packb(manifest.to_dict(), use_bin_type=True),
                         key=manifest.run_id.encode(), headers=provenance_headers("trainer", manifest.version))
    finally:
        if own:
            producer.close()
    if manifest.role == "actor":
        state.set_policy_version(manifest.version)


def read_policy_log(bootstrap: str, kafka_config: Any, topic: str = POLICY_TOPIC) -> list[Manifest]:
    """Every announcement on ``topic`` so far, in log order. A record that is not a manifest is
    skipped with an error log line naming ``topic[partition]@offset``."""
    from expstream.kafka.clients import read_topic

    log = logging.getLogger("expstream.weights")
    out = []
    for rec in read_topic(bootstrap, kafka_config, topic):
        try:
            out.append(Manifest.from_dict(msgpack.unpackb(rec.value, raw=False)))
        except (CorruptWeightsError, ValueError, TypeError, msgpack.UnpackException) as exc:
            log.error("policy log: %s[%d]@%d is not a manifest, skipped: %s", rec.topic, rec.partition,
                      rec.offset, exc)
    return out


# --- following the policy in a stage ---------------------------------------------------------------
class PolicyFollower:
    """Keeps one stage's model at the announced version, loading new versions in place.

    ``refresh()`` between micro-batches: when Redis announces a version newer than the loaded one,
    load it from the store (hash verified) with ``load_state_dict(strict=True)``. A version that
    cannot be loaded is refused with one log line; the previous weights stay, and it is not tried
    again until a newer version is announced.

    role "actor" loads exactly the announced version (it must be in the store). role "critic"
    loads the newest critic version <= the announced one and stays quietly on what it has when the
    store has none (a trainer that does not train the critic).
    """

    def __init__(self, store: WeightStore, state: Any, role: str, model: Any,
                 log: logging.Logger | None = None, metrics: Any = None) -> None:
        check_role(role)
        self.store = store
        self.state = state
        self.role = role
        self.model = model
        self.log = log or logging.getLogger("expstream.weights")
        self.version = 0
        self.reloads = 0
        self.last_reload_s: float | None = None
        self.refused: int | None = None  # the newest announced version refused (not retried)
        self.metrics = metrics  # expstream.observe.metrics.StageMetrics (reload seconds), or None

    def _target(self, announced: int) -> int | None:
        if self.role == "actor":
            return announced
        have = [v for v in self.store.versions(self.role) if v <= announced]
        return have[-1] if have else None

    def refresh(self) -> int:
        """Load the announced version if it is newer; returns the version now loaded.

        A version deleted by retention before it could be read (:class:`VersionGoneError`: the trainer
        ran ``train.keep_versions`` versions ahead meanwhile) is not an error: the newest announced
        version is loaded instead (up to :data:`GONE_RETRIES` times, then it is refused like a corrupt one).
        """
        announced = int(self.state.policy_version())
        if announced <= self.version or (self.refused is not None and announced <= self.refused):
            return self.version
        try:
            target = self._target(announced)
        except ObjectStoreError as exc:
            self.log.error("weights: cannot list %s versions in %s, keeping v%d; trying again before the next "
                           "micro-batch: %s", self.role, self.store, self.version, exc)
            return self.version
        if target is None or target <= self.version:
            return self.version
        t0 = time.perf_counter()
        try:
            for attempt in range(GONE_RETRIES + 1):
                try:
                    tensors = self.store.load(self.role, target)
                    break
                except VersionGoneError as exc:
                    newer = int(self.state.policy_version())
                    retarget = self._target(newer)
                    if attempt == GONE_RETRIES or retarget is None or retarget <= target:
                        raise
                    self.log.info("weights: %s v%d was deleted before it could be loaded (%s); loading v%d, the "
                                  "newest announced", self.role, target, exc, retarget)
                    announced, target = newer, retarget
            _check_fits(self.model, tensors)  # before load_state_dict, which may copy some tensors then raise
            self.model.load_state_dict(tensors, strict=True)
        except ObjectStoreError as exc:  # the store did not answer (retried already): keep the weights, try again
            self.log.error("weights: cannot read %s v%d from %s, keeping v%d; trying again before the next "
                           "micro-batch: %s", self.role, target, self.store.describe(self.role, target), self.version, exc)
            return self.version
        except (CorruptWeightsError, RuntimeError) as exc:
            self.refused = announced
            self.log.error("weights: refused %s v%d from %s, keeping v%d: %s", self.role, target,
                           self.store.describe(self.role, target), self.version, exc)
            return self.version
        dt = time.perf_counter() - t0
        previous, self.version = self.version, target
        self.reloads += 1
        self.last_reload_s = dt
        self.refused = None
        with contextlib.suppress(Exception):  # measurement only: never fail a micro-batch for it
            if self.metrics is not None:
                self.metrics.reload(self.role, dt)
            self.state.incr_counter(f"reload_s:{self.role}", dt)
            self.state.incr_counter(f"reloads:{self.role}", 1)
        self.log.info("weights: %s v%d -> v%d loaded in place from %s in %.3f s", self.role, previous, target,
                      self.store.describe(self.role, target), dt)
        return self.version


def _check_fits(model: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse tensors that are not exactly the model's state dict (names and shapes), so that a
    refused version leaves every weight untouched."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if own == got:
        return
    missing, extra = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    shapes = [f"{k}: {got[k]} != {own[k]}" for k in sorted(set(own) & set(got)) if own[k] != got[k]]
    raise CorruptWeightsError(f"the tensors do not fit the stage's model (missing {missing[:3]}, unexpected "
                              f"{extra[:3]}, shapes {shapes[:3]}); publish weights of the same architecture as "
                              "models.actor / models.critic")


def follower_for(ctx: Any, role: str, model: Any) -> PolicyFollower | None:
    """A follower for ``model`` when the continuous loop is on and a store is configured, else None."""
    train = ctx.topology.train
    if not train.enabled or not train.weight_store:
        return None
    return PolicyFollower(open_store(train.weight_store), ctx.state, role, model, ctx.log,
                          metrics=getattr(ctx, "metrics", None))


def refresh_weights(ctx: Any, role: str) -> int:
    """Refresh the stage's follower (``ctx.models[f"{role}_follower"]``) and return the version of
    the weights now loaded. Without a follower: the announced version (an external trainer that
    swaps weights itself and announces with PipelineControl)."""
    follower = ctx.models.get(f"{role}_follower")
    if follower is None:
        return int(ctx.state.policy_version())
    return follower.refresh()
