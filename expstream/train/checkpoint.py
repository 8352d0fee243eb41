"""The trainer's checkpoint: everything needed to resume exactly once, written together, atomically.

A checkpoint is a directory ``DIR/train/ckpt-<step>-<uuid>/`` and ``DIR/train/checkpoint`` is a
symlink to the current one (a symlink can be replaced atomically; a non-empty directory cannot):

* ``actor.safetensors`` (+ ``critic.safetensors``) -- the model weights;
* ``actor.optim.safetensors`` + ``actor.optim.json`` (and critic's) -- the Adam state: per-parameter
  tensors in safetensors, the hyper-parameters and layout in JSON (no pickle anywhere);
* ``buffer.msgpack`` -- the buffered-but-untrained experience records: their encoded bytes, the rows
  still untrained and where they were read (``topic[partition]@offset``);
* ``meta.json`` -- policy version, step, consumed positions per partition, counters, the
  ``train.jsonl`` line of the checkpointed step, and which prefix of the id ledger is this checkpoint's;
* ``DIR/train/ledger-<uuid>.jsonl`` (beside the checkpoint directories, shared by the checkpoints
  that follow one another) -- the sample ids already trained (``taken``) and dropped as stale, one
  line per checkpoint with the ids new since the one before. A checkpoint owns the ledger's first
  bytes (how many: ``ledger.bytes`` in its ``meta.json``); anything after them was appended by a write
  that never became current and is cut off before the next append.

Why a ledger: the ids grow by a batch every step, and written whole into every checkpoint (format 1)
they made each step's checkpoint cost grow with the run (at step 1,000 of the tiny continuous loop,
16,000 ids: a 387 KB ``meta.json``; a checkpoint's CPU 2.1 ms at step 50, 7.9 ms at step 1,000,
bench/README.md "The fork server's curve was the trainer's"). Appending only the new ids keeps a
step's checkpoint the same size however long the run. Format 1 checkpoints (ids in ``meta.json``) are still read.

Protocol (:func:`write_checkpoint`), each step numbered as in the code:

0. append the ids new since the current checkpoint to its ledger (cut back to the length that
   checkpoint owns first), fsync it; or, when the ids are not that checkpoint's plus new ones (no
   checkpoint yet, format 1, another caller's), write a fresh ledger;
1. write every file into a fresh ``ckpt-<step>-<uuid>`` directory, fsync each file and the directory;
2. point a temporary symlink at it and ``os.replace`` it over ``DIR/train/checkpoint`` (atomic: a
   reader sees the previous checkpoint or this one, never a mixture), fsync ``DIR/train``;
3. delete the previous checkpoint directory, ledgers no longer named (and leftovers of a crash
   during step 1).

Only after :func:`write_checkpoint` returns does the trainer announce the version and commit the
positions to Kafka, so the committed offsets never run ahead of a durable checkpoint. Resuming
(:func:`read_checkpoint`) loads the directory the symlink names; leftovers are ignored.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load_file, save_file

from expstream.errors import ExpstreamError

__all__ = ["Checkpoint", "CheckpointError", "BufferedRecord", "checkpoint_dir", "read_checkpoint",
           "write_checkpoint", "optimizer_to_files", "optimizer_from_files"]

log = logging.getLogger("expstream.train.checkpoint")

LINK_NAME = "checkpoint"
FORMAT_VERSION = 2
#: Formats :func:`read_checkpoint` reads: 1 kept the ids in ``meta.json``.
READ_FORMATS = (1, 2)
LEDGER_PREFIX = "ledger-"
#: Sample ids with their versions, oldest first: [sample id, version] pairs, or a mapping sample id -> version.
Ids = Sequence[Any] | Mapping[str, int]


class CheckpointError(ExpstreamError):
    """A checkpoint that cannot be read (corrupt, half-written, another format)."""


@dataclass
class BufferedRecord:
    """One experience record still (partly) untrained at checkpoint time."""

    value: bytes  # the encoded SampleBatch (schemas.encode)
    rows: list[int]  # rows of it not trained yet
    topic: str
    partition: int
    offset: int


@dataclass
class Checkpoint:
    step: int  # optimisation steps done (the next step is `step`)
    version: int  # policy version of the weights below (== step for the reference trainer)
    positions: dict[int, int]  # partition -> next offset to read of the experiences topic
    taken: Ids  # [sample id, rollout version] already trained (never trained again), oldest first (read: a list)
    actor: dict[str, torch.Tensor]  # name -> tensor (state_dict, contiguous CPU tensors)
    actor_optim: dict[str, Any]  # torch optimizer state_dict
    critic: dict[str, torch.Tensor] | None = None
    critic_optim: dict[str, Any] | None = None
    buffer: list[BufferedRecord] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    last_line: dict[str, Any] | None = None  # train.jsonl line of step `step - 1`
    dropped: Ids = field(default_factory=list)  # [sample id, version] dropped as stale, oldest first (read: a list)
    run_id: str = ""


def checkpoint_dir(output: Path) -> Path:
    return Path(output) / "train"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)


def optimizer_to_files(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A torch optimizer state_dict as (tensors for safetensors, JSON-able layout) -- no pickle."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for idx, entry in state["state"].items():
        keys = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{idx}.{k}"] = v.detach().contiguous().cpu()
                keys[k] = "tensor"
            else:
                keys[k] = v
        layout["state"][str(idx)] = keys
    return tensors, layout


def optimizer_from_files(tensors: dict[str, torch.Tensor], layout: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for idx, keys in layout["state"].items():
        state[int(idx)] = {k: (tensors[f"{idx}.{k}"] if v == "tensor" else v) for k, v in keys.items()}
    return {"state": state, "param_groups": layout["param_groups"]}


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def write_checkpoint(output: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` durably and make it the current one (protocol in the module docstring)."""
    root = checkpoint_dir(output)
    root.mkdir(parents=True, exist_ok=True)
    link = root / LINK_NAME
    # 0. the ids new since the current checkpoint onto its ledger (or a fresh ledger)
    ledger = _write_ledger(root, _current_ledger(root), ckpt.taken, ckpt.dropped)
    # 1. everything into a fresh directory, each file fsync'ed, then the directory
    target = root / f"ckpt-{ckpt.step:06d}-{uuid.uuid4().hex[:8]}"
    target.mkdir()
    files = []
    for role, weights, optim in (("actor", ckpt.actor, ckpt.actor_optim), ("critic", ckpt.critic, ckpt.critic_optim)):
        if weights is None:
            continue
        _save_tensors(weights, target / f"{role}.safetensors")
        files.append(target / f"{role}.safetensors")
        if optim is not None:
            tensors, layout = optimizer_to_files(optim)
            _save_tensors(tensors, target / f"{role}.optim.safetensors")
            (target / f"{role}.optim.json").write_text(json.dumps(layout))
            files += [target / f"{role}.optim.safetensors", target / f"{role}.optim.json"]
    buf = [{"value": r.value, "rows": r.rows, "topic": r.topic, "partition": r.partition, "offset": r.offset}
           for r in ckpt.buffer]
    (target / "buffer.msgpack").write_bytes(msgpack.packb(buf, use_bin_type=True))
    meta = {"format": FORMAT_VERSION, "step": ckpt.step, "version": ckpt.version, "run_id": ckpt.run_id,
            "positions": {str(p): o for p, o in ckpt.positions.items()}, "ledger": ledger,
            "counters": ckpt.counters, "last_line": ckpt.last_line,
            "critic": ckpt.critic is not None}
    (target / "meta.json").write_text(json.dumps(meta))
    files += [target / "buffer.msgpack", target / "meta.json"]
    for f in files:
        _fsync_file(f)
    _fsync_dir(target)
    # 2. atomic switch: a temporary symlink renamed over the current one
    tmp_link = root / f".{LINK_NAME}-{uuid.uuid4().hex[:8]}"
    os.symlink(target.name, tmp_link)
    os.replace(tmp_link, link)
    _fsync_dir(root)
    # 3. the previous checkpoint and leftovers of interrupted writes go
    for child in root.iterdir():
        if child.name.startswith("ckpt-") and child.name != target.name:
            shutil.rmtree(child, ignore_errors=True)
        elif child.name.startswith(LEDGER_PREFIX) and child.name != ledger["file"]:
            child.unlink(missing_ok=True)
        elif child.name.startswith(f".{LINK_NAME}-"):
            child.unlink(missing_ok=True)
    return target


def read_checkpoint(output: Path) -> Checkpoint | None:
    """The current checkpoint, or None when there is none. A broken one raises CheckpointError."""
    link = checkpoint_dir(output) / LINK_NAME
    if not link.is_symlink() and not link.exists():
        return None
    target = link.resolve()
    try:
        meta = json.loads((target / "meta.json").read_text())
        if meta.get("format") not in READ_FORMATS:
            raise CheckpointError(f"{target}: checkpoint format {meta.get('format')!r}, expected one of {READ_FORMATS}")
        if meta["format"] == 1:
            taken, dropped = list(meta["taken"]), list(meta.get("dropped") or [])
        else:
            taken, dropped = _read_ledger(target.parent, meta["ledger"])

        def role_files(role: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
            weights = load_file(str(target / f"{role}.safetensors"))
            optim = None
            if (target / f"{role}.optim.json").exists():
                layout = json.loads((target / f"{role}.optim.json").read_text())
                optim = optimizer_from_files(load_file(str(target / f"{role}.optim.safetensors")), layout)
            return weights, optim

        actor, actor_optim = role_files("actor")
        critic, critic_optim = role_files("critic") if meta.get("critic") else (None, None)
        raw = msgpack.unpackb((target / "buffer.msgpack").read_bytes(), raw=False)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable part makes the whole checkpoint unusable
        raise CheckpointError(f"{target}: unreadable checkpoint ({type(exc).__name__}: {exc}); move it away "
                              "to start training from scratch, or restore a backup") from exc
    return Checkpoint(
        step=int(meta["step"]), version=int(meta["version"]), run_id=str(meta.get("run_id", "")),
        positions={int(p): int(o) for p, o in meta["positions"].items()}, taken=taken, dropped=dropped,
        actor=actor, actor_optim=actor_optim or {}, critic=critic, critic_optim=critic_optim,
        buffer=[BufferedRecord(value=bytes(r["value"]), rows=list(r["rows"]), topic=r["topic"],
                               partition=int(r["partition"]), offset=int(r["offset"])) for r in raw],
        counters=dict(meta.get("counters") or {}), last_line=meta.get("last_line"),
    )


def _current_ledger(root: Path) -> dict[str, Any] | None:
    """The ledger entry of the current checkpoint's ``meta.json`` (None: no checkpoint, format 1, unreadable)."""
    try:
        meta = json.loads((root / LINK_NAME / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    ledger = meta.get("ledger") if meta.get("format") == FORMAT_VERSION else None
    if not isinstance(ledger, dict):
        return None
    try:  # shorter than the checkpoint's part: not appended to (a fresh ledger is written)
        return ledger if os.path.getsize(root / str(ledger["file"])) >= int(ledger["bytes"]) else None
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _pairs(ids: Ids, start: int = 0, stop: int | None = None) -> list[tuple[str, int]]:
    """``ids[start:stop]`` as (sample id, version) pairs; a mapping (sample id -> version, in the order the
    ids came) is walked without a copy of the whole of it (the trainer's ``taken`` grows every step)."""
    items = ids.items() if isinstance(ids, Mapping) else ids
    return [(str(s), int(v)) for s, v in itertools.islice(items, start, stop)]


def _continues(ids: Ids, count: int, last: Any) -> bool:
    """Are ``ids`` the ledger's ``count`` ids (the last of them ``last``) plus new ones?"""
    if len(ids) < count:
        return False
    return count == 0 or [list(p) for p in _pairs(ids, count - 1, count)] == [last]


def _write_ledger(root: Path, prev: dict[str, Any] | None, taken: Ids, dropped: Ids) -> dict[str, Any]:
    """Step 0 of the module docstring: the ledger entry of the checkpoint being written."""
    if prev is not None and _continues(taken, prev["taken"], prev["taken_last"]) \
            and _continues(dropped, prev["dropped"], prev["dropped_last"]):
        name, start, taken_from, dropped_from = prev["file"], int(prev["bytes"]), prev["taken"], prev["dropped"]
    else:
        name, start, taken_from, dropped_from = f"{LEDGER_PREFIX}{uuid.uuid4().hex[:8]}.jsonl", 0, 0, 0
    line = json.dumps({"taken": _pairs(taken, taken_from), "dropped": _pairs(dropped, dropped_from)}).encode() + b"\n"
    with open(root / name, "ab") as fh:
        fh.truncate(start)  # what a write that never became current appended after the checkpoint's part
        fh.seek(start)
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())
    if start == 0:
        _fsync_dir(root)

    def last(ids: Ids) -> list[Any] | None:
        if not len(ids):
            return None
        sid, v = next(reversed(ids.items())) if isinstance(ids, Mapping) else ids[-1]
        return [str(sid), int(v)]

    return {"file": name, "bytes": start + len(line), "taken": len(taken), "dropped": len(dropped),
            "taken_last": last(taken), "dropped_last": last(dropped)}


def _read_ledger(root: Path, ledger: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The ids of a format 2 checkpoint: the lines of the ledger's first ``ledger["bytes"]`` bytes."""
    with open(root / ledger["file"], "rb") as fh:
        data = fh.read(int(ledger["bytes"]))
    if len(data) != int(ledger["bytes"]):
        raise ValueError(f"ledger {ledger['file']} has {len(data)} of the checkpoint's {ledger['bytes']} bytes")
    taken: list[Any] = []
    dropped: list[Any] = []
    for raw in data.splitlines():
        part = json.loads(raw)
        taken += part["taken"]
        dropped += part["dropped"]
    if len(taken) != int(ledger["taken"]) or len(dropped) != int(ledger["dropped"]):
        raise ValueError(f"ledger {ledger['file']}: {len(taken)} trained and {len(dropped)} dropped ids, the checkpoint "
                         f"names {ledger['taken']} and {ledger['dropped']}")
    return taken, dropped
