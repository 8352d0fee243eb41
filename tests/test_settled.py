"""The trainer's settled sample ids (issue 28 item 6): kept for a horizon, not for the run.

Pure logic and files (no servers): the set stays the same size however many steps run, a copy of a
settled sample is dropped either as a duplicate (within the horizon) or by the staleness rule (beyond
it), so nothing is trained twice, and a checkpoint of format 1 (every id of the run) is still read.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from expstream.rl.admission import StalenessGate
from expstream.train.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from expstream.train.settled import SettledSamples


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def run_steps(settled: SettledSamples, clock: Clock, steps: int, *, k: int, batch: int, step_s: float,
              start: int = 0) -> list[tuple[str, int, int, float]]:
    """A trainer's bookkeeping for ``steps`` steps: each trains ``batch`` new samples of versions in
    [step - k, step] and drops one stale sample every third step; returns (id, version, step, time) settled."""
    rng = random.Random(start)
    out = []
    for step in range(start, start + steps):
        clock.t += step_s
        if step % 3 == 0 and step > k:
            sid = f"late{step}"
            settled.drop(sid, step - k - 1, step)
            out.append((sid, step - k - 1, step, clock.t))
        for i in range(batch):
            sid, v = f"g{step}#{i}", max(0, step - rng.randint(0, k))
            settled.take(sid, v, step)
            out.append((sid, v, step, clock.t))
        settled.forget(step + 1 - k)  # as Trainer.train_one: the next step's staleness window
    return out


def test_the_settled_ids_stay_bounded_however_many_steps_run():
    """Before, the trainer kept every id of the run (dicts `taken` and `dropped`, and both lists in every
    checkpoint): 3,000 steps of 8 samples held 25,000 ids. Now: what 1,000 steps hold, 3,000 hold."""
    clock = Clock()
    settled = SettledSamples(horizon_s=20.0, clock=clock)
    sizes, ckpt_bytes = {}, {}
    for done in (1000, 2000, 3000):
        run_steps(settled, clock, 1000, k=2, batch=8, step_s=0.5, start=done - 1000)
        sizes[done] = len(settled)
        ckpt_bytes[done] = len(json.dumps(settled.to_json()))
    # 20 s at 2 steps/s = 40 steps (the horizon is longer than the k + 1 steps of the staleness window),
    # 8 trained + a third of a dropped sample each, plus the step in hand
    bound = (40 + 2) * 9
    assert all(n <= bound for n in sizes.values()), sizes
    assert max(sizes.values()) - min(sizes.values()) <= 1, sizes  # the dropped sample of every third step
    # the checkpoint's share: flat but for the ids' digits (g999#0 -> g2999#0); the whole run's would triple
    assert abs(ckpt_bytes[3000] - ckpt_bytes[2000]) < 0.01 * ckpt_bytes[2000], ckpt_bytes
    assert ckpt_bytes[3000] < 1.15 * ckpt_bytes[1000], ckpt_bytes
    # a slow run (a step every 60 s, far beyond the 20 s horizon) keeps the staleness window's steps
    slow = SettledSamples(horizon_s=20.0, clock=Clock())
    run_steps(slow, slow.clock, 200, k=2, batch=8, step_s=60.0)
    assert len(slow) <= (2 + 2) * 9, len(slow)


@pytest.mark.parametrize("step_s", [0.5, 60.0])
def test_a_copy_is_a_duplicate_within_the_horizon_and_stale_beyond_it(step_s):
    """For every settled sample and every later step: a copy carrying its version (a redelivery) is either
    still known (dropped as a duplicate) or staler than k (dropped by the staleness rule); a copy
    regenerated under the current version (a rewind of generate) is known for the whole horizon."""
    k, horizon = 2, 20.0
    clock = Clock()
    settled = SettledSamples(horizon_s=horizon, clock=clock)
    gate = StalenessGate(k, 8)
    history = run_steps(settled, clock, 120, k=k, batch=8, step_s=step_s)
    # however slow the steps, the staleness window's versions are kept (next step 120: versions >= 118)
    assert all(sid in settled for sid, v, _, _ in history if v >= 120 - k)
    rng = random.Random(7)
    checked = {"duplicate": 0, "stale": 0}
    for step in range(120, 400):
        clock.t += step_s
        for sid, version, at, when in rng.sample(history, 200):
            known = sid in settled
            if known:
                checked["duplicate"] += 1
            else:
                assert not gate.staleness_ok(step, version), (sid, version, at, step)  # never trained twice
                checked["stale"] += 1
            if clock.t - when <= horizon:
                assert known, (sid, version, at, step)  # a regenerated copy (current version) is still a duplicate
        settled.forget(step + 1 - k)
    assert checked["stale"] > 0 and checked["duplicate"] > 0, checked


def test_checkpoint_format_2_round_trip_and_format_1_is_still_read(tmp_path):
    clock = Clock()
    settled = SettledSamples(horizon_s=30.0, clock=clock)
    run_steps(settled, clock, 10, k=1, batch=2, step_s=1.0)
    ckpt = Checkpoint(step=10, version=10, positions={0: 5}, actor={"w": torch.zeros(2)}, actor_optim=None,
                      settled=settled.to_json(), run_id="r")
    write_checkpoint(tmp_path, ckpt)
    back = read_checkpoint(tmp_path)
    assert back.settled == json.loads(json.dumps(settled.to_json()))
    again = SettledSamples.from_json(back.settled, 30.0, clock)
    assert dict(again.items()) == dict(settled.items()) and again.taken_count() == settled.taken_count()
    # format 1 (before issue 28): every id of the run, in `taken` and `dropped`, no times
    meta_path = tmp_path / "train" / "checkpoint" / "meta.json"
    meta = json.loads(meta_path.read_text())
    taken = [[f"old{i}#0", i // 5] for i in range(400)]  # versions 0..79
    dropped = [["stale#1", 0]]
    del meta["settled"]
    meta.update(format=1, taken=taken, dropped=dropped, step=100, version=100)
    meta_path.write_text(json.dumps(meta))
    old = read_checkpoint(tmp_path)
    assert old.step == 100 and old.positions == {0: 5}
    written = meta_path.stat().st_mtime
    clock.t = written + 5
    resumed = SettledSamples.from_json(old.settled, 30.0, clock)
    assert dict(resumed.items()) == {sid: v for sid, v in taken + dropped}
    assert resumed.taken_count() == 400
    resumed.forget(100 - 1)  # all of them are below the staleness window, but settled 5 s ago: kept
    assert len(resumed) == 401 and "old0#0" in resumed and "stale#1" in resumed
    clock.t = written + 31
    resumed.forget(100 - 1)
    assert len(resumed) == 0  # past the horizon: a copy of any of them is stale at step 100 (versions <= 79)
    meta["format"] = 3
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format 3"):
        read_checkpoint(tmp_path)
