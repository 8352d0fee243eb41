"""The trainer's checkpoint (expstream/train/checkpoint.py) on disk: the trained and dropped ids go to an
append-only ledger, so a step's checkpoint writes the ids new since the last one, not every id of the run
(format 1 rewrote them all into meta.json at every step: its size and CPU grew with the run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from expstream.train.checkpoint import Checkpoint, read_checkpoint, write_checkpoint

BATCH = 16


def ids(step: int) -> list[tuple[str, int]]:
    """The ids trained by ``step`` steps of BATCH samples each (sample id, version)."""
    return [(f"poem-{i % 7}@e{i // 48}#{i % 4}-{i}", i // BATCH) for i in range(step * BATCH)]


def ckpt(step: int, taken: list, dropped: list | None = None) -> Checkpoint:
    w = torch.nn.Parameter(torch.ones(3))
    return Checkpoint(step=step, version=step, positions={0: step * 4}, taken=taken, actor={"w": w.detach()},
                      actor_optim=torch.optim.Adam([w]).state_dict(), dropped=dropped or [])


def current(out: Path) -> tuple[dict, Path]:
    target = (out / "train" / "checkpoint").resolve()
    meta = json.loads((target / "meta.json").read_text())
    return meta, out / "train" / meta["ledger"]["file"]


def test_each_checkpoint_writes_only_the_new_ids_and_reads_them_all(tmp_path):
    sizes, ledger_sizes = [], []
    for step in range(1, 41):
        write_checkpoint(tmp_path, ckpt(step, ids(step), dropped=[("late#0", 0)] if step >= 20 else []))
        meta, ledger = current(tmp_path)
        sizes.append(len(json.dumps(meta)))
        ledger_sizes.append(ledger.stat().st_size)
    assert ids(1)[0][0] not in json.dumps(meta)  # the first step's ids are not written again
    assert max(sizes) - min(sizes) < 200  # meta.json: the same size at step 40 as at step 1 (counts' digits aside)
    growth = [b - a for a, b in zip(ledger_sizes, ledger_sizes[1:], strict=False)]
    assert max(growth) - min(growth) < 100, growth  # one batch of ids per step, whatever came before
    back = read_checkpoint(tmp_path)
    assert [tuple(x) for x in back.taken] == ids(40)
    assert [tuple(x) for x in back.dropped] == [("late#0", 0)]
    assert back.step == 40 and back.positions == {0: 160}
    assert len(list((tmp_path / "train").glob("ledger-*"))) == 1
    assert len(list((tmp_path / "train").glob("ckpt-*"))) == 1


def test_what_a_write_that_never_became_current_appended_is_not_read_and_is_cut_off(tmp_path):
    write_checkpoint(tmp_path, ckpt(1, ids(1)))
    write_checkpoint(tmp_path, ckpt(2, ids(2)))
    _, ledger = current(tmp_path)
    with open(ledger, "ab") as fh:  # a crash after step 0 of the next write: its ids appended, never switched to
        fh.write(json.dumps({"taken": [["ghost#0", 2]], "dropped": []}).encode() + b"\n" + b'{"taken": [["to')
    assert [tuple(x) for x in read_checkpoint(tmp_path).taken] == ids(2)
    write_checkpoint(tmp_path, ckpt(3, ids(3)))  # the resumed trainer's next checkpoint
    assert [tuple(x) for x in read_checkpoint(tmp_path).taken] == ids(3)
    assert b"ghost" not in current(tmp_path)[1].read_bytes()


def test_ids_that_do_not_continue_the_ledger_start_a_fresh_one(tmp_path):
    write_checkpoint(tmp_path, ckpt(2, ids(2)))
    other = [(f"other#{i}", 5) for i in range(40)]  # more ids than before, but not the same ones first
    write_checkpoint(tmp_path, ckpt(3, other))
    assert [tuple(x) for x in read_checkpoint(tmp_path).taken] == other
    write_checkpoint(tmp_path, ckpt(4, ids(1)))  # fewer ids than the ledger holds
    assert [tuple(x) for x in read_checkpoint(tmp_path).taken] == ids(1)


def test_a_format_1_checkpoint_is_read_and_continued(tmp_path):
    write_checkpoint(tmp_path, ckpt(2, ids(2)))
    meta, ledger = current(tmp_path)
    del meta["ledger"]
    meta.update(format=1, taken=[list(x) for x in ids(2)], dropped=[["late#1", 0]])
    ((tmp_path / "train" / "checkpoint").resolve() / "meta.json").write_text(json.dumps(meta))
    ledger.unlink()
    back = read_checkpoint(tmp_path)
    assert [tuple(x) for x in back.taken] == ids(2) and back.dropped == [["late#1", 0]]
    write_checkpoint(tmp_path, ckpt(3, ids(3), dropped=[("late#1", 0)]))
    back = read_checkpoint(tmp_path)
    assert [tuple(x) for x in back.taken] == ids(3) and [tuple(x) for x in back.dropped] == [("late#1", 0)]


def test_the_trainers_mapping_of_ids_is_written_like_a_list(tmp_path):
    """The trainer hands its dicts (sample id -> version, in the order trained) over as they are: no copy of
    every id per step; what is read back is the same list."""
    taken = dict(ids(1))
    write_checkpoint(tmp_path, ckpt(1, taken))
    taken.update(ids(3))
    write_checkpoint(tmp_path, ckpt(3, taken, dropped={"late#2": 1}))
    back = read_checkpoint(tmp_path)
    assert [tuple(x) for x in back.taken] == ids(3) and back.dropped == [["late#2", 1]]
    write_checkpoint(tmp_path, ckpt(4, ids(4), dropped=[("late#2", 1)]))  # a list continues a mapping's ledger
    meta, ledger = current(tmp_path)
    assert ledger.read_bytes().count(b"\n") == 3 and [tuple(x) for x in read_checkpoint(tmp_path).taken] == ids(4)
