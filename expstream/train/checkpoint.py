"""The trainer's checkpoint: everything needed to resume exactly once, written together, atomically.

A checkpoint is a directory ``DIR/train/ckpt-<step>-<uuid>/`` and ``DIR/train/checkpoint`` is a
symlink to the current one (a symlink can be replaced atomically; a non-empty directory cannot):

* ``actor.safetensors`` (+ ``critic.safetensors``) -- the model weights;
* ``actor.optim.safetensors`` + ``actor.optim.json`` (and critic's) -- the Adam state: per-parameter
  tensors in safetensors, the hyper-parameters and layout in JSON (no pickle anywhere);
* ``buffer.msgpack`` -- the buffered-but-untrained experience records: their encoded bytes, the rows
  still untrained and where they were read (``topic[partition]@offset``);
* ``meta.json`` -- policy version, step, consumed positions per partition, the sample ids settled
  within the dedupe horizon (``settled``: trained or dropped as stale, one entry per step,
  expstream/train/settled.py), counters, and the ``train.jsonl`` line of the checkpointed step.

Format 2 (issue 28): ``settled`` holds the ids of the horizon only. Format 1 held every id of the run
(``taken`` and ``dropped``, without times); it is still read, as one entry of the checkpoint's step
settled when ``meta.json`` was written (so its ids are kept the whole horizon after that).

Protocol (:func:`write_checkpoint`), each step numbered as in the code:

1. write every file into a fresh ``ckpt-<step>-<uuid>`` directory, fsync each file and the directory;
2. point a temporary symlink at it and ``os.replace`` it over ``DIR/train/checkpoint`` (atomic: a
   reader sees the previous checkpoint or this one, never a mixture), fsync ``DIR/train``;
3. delete the previous checkpoint directory (and leftovers of a crash during step 1).

Only after :func:`write_checkpoint` returns does the trainer announce the version and commit the
positions to Kafka, so the committed offsets never run ahead of a durable checkpoint. Resuming
(:func:`read_checkpoint`) loads the directory the symlink names; leftovers are ignored.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
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
#: Formats :func:`read_checkpoint` reads: 1 (every taken and dropped id of the run) and 2.
READABLE_FORMATS = (1, 2)


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
    actor: dict[str, torch.Tensor]  # name -> tensor (state_dict, contiguous CPU tensors)
    actor_optim: dict[str, Any]  # torch optimizer state_dict
    critic: dict[str, torch.Tensor] | None = None
    critic_optim: dict[str, Any] | None = None
    buffer: list[BufferedRecord] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    last_line: dict[str, Any] | None = None  # train.jsonl line of step `step - 1`
    # the ids settled within the dedupe horizon: [{"step", "time", "taken": [[id, version]...], "dropped": [...]}]
    settled: list[dict[str, Any]] = field(default_factory=list)
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
            "positions": {str(p): o for p, o in ckpt.positions.items()}, "settled": ckpt.settled,
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
        if meta.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"{target}: checkpoint format {meta.get('format')!r}, expected one of "
                                  f"{READABLE_FORMATS}")
        settled = _settled(meta, (target / "meta.json").stat().st_mtime)

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
        positions={int(p): int(o) for p, o in meta["positions"].items()}, settled=settled,
        actor=actor, actor_optim=actor_optim or {}, critic=critic, critic_optim=critic_optim,
        buffer=[BufferedRecord(value=bytes(r["value"]), rows=list(r["rows"]), topic=r["topic"],
                               partition=int(r["partition"]), offset=int(r["offset"])) for r in raw],
        counters=dict(meta.get("counters") or {}), last_line=meta.get("last_line"),
    )


def _settled(meta: dict[str, Any], written: float) -> list[dict[str, Any]]:
    """The ``settled`` entries of ``meta``; format 1's whole-run ``taken`` / ``dropped`` lists become one
    entry of the checkpoint's last step, settled at ``written`` (when meta.json was written)."""
    if meta.get("format") != 1:
        return list(meta.get("settled") or [])
    taken, dropped = list(meta.get("taken") or []), list(meta.get("dropped") or [])
    if not taken and not dropped:
        return []
    return [{"step": max(int(meta["step"]) - 1, 0), "time": float(written), "taken": taken, "dropped": dropped}]
