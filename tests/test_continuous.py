"""`expstream run --continuous`: the epoch feeder, one-shot children, flow control, and whole runs.

The feeder and the supervisor are tested on their own (no broker); the whole-run tests start
`expstream run --continuous` as a subprocess with its own broker and redis-server, as a user does.
"""

from __future__ import annotations

import sys
import time

import pytest

from expstream.prompts import EpochFeeder, PromptRow
from expstream.supervisor import Supervisor, SupervisorError

ROWS = [PromptRow(f"q{i}", f"Question {i}?", label=str(i)) for i in range(5)]


def records(feeder: EpochFeeder, count: int) -> list:
    return [feeder.next_batch() for _ in range(count)]


# ---- the epoch feeder -------------------------------------------------------------------------------------------
def test_every_record_holds_exactly_the_batch_size_and_records_span_epoch_boundaries():
    feeder = EpochFeeder(ROWS, batch_size=2, seed=7)
    got = records(feeder, 6)  # 12 prompts over a 5-prompt file: epochs 0, 1 and the start of 2
    assert [len(b.prompt_id) for b in got] == [2] * 6
    assert [b.batch_id for b in got] == [f"p{k:06d}" for k in range(6)]
    ids = [pid for b in got for pid in b.prompt_id]
    # record p000002 holds the last prompt of epoch 0 and the first of epoch 1
    assert got[2].prompt_id[0].endswith("@e0") and got[2].prompt_id[1].endswith("@e1")
    assert [pid.rsplit("@e", 1)[1] for pid in ids] == ["0"] * 5 + ["1"] * 5 + ["2"] * 2
    assert feeder.prompts_fed == 12 and feeder.records_fed == 6 and feeder.epochs_started == 3


def test_each_epoch_visits_every_prompt_once_with_unique_ids_and_matching_texts():
    feeder = EpochFeeder(ROWS, batch_size=5, seed=1)
    by_text = {r.prompt_id: r for r in ROWS}
    seen: list[str] = []
    for epoch in range(4):
        (batch,) = records(feeder, 1)
        base = [pid.rsplit("@e", 1)[0] for pid in batch.prompt_id]
        assert sorted(base) == sorted(by_text)  # a permutation of the file
        assert all(pid.endswith(f"@e{epoch}") for pid in batch.prompt_id)
        for pid, text, label in zip(base, batch.prompt, batch.label, strict=True):
            assert (text, label) == (by_text[pid].prompt, by_text[pid].label)
        seen += batch.prompt_id
    assert len(seen) == len(set(seen)) == 20


def test_epochs_are_reshuffled_deterministically_from_the_seed():
    def order(seed: int, epochs: int = 6) -> list[list[str]]:
        feeder = EpochFeeder(ROWS, batch_size=5, seed=seed)
        return [[pid.rsplit("@e", 1)[0] for pid in feeder.next_batch().prompt_id] for _ in range(epochs)]

    a, b, c = order(3), order(3), order(4)
    assert a == b  # same seed, same records
    assert len({tuple(e) for e in a}) > 1  # the order changes between epochs (6 epochs of 5! orders)
    assert a != c  # another seed, another order
    plain = [r.prompt_id for r in ROWS]
    assert any(e != plain for e in a)  # actually shuffled, not the file order


def test_a_single_prompt_file_and_an_odd_batch_size_still_give_full_records():
    feeder = EpochFeeder(ROWS[:1], batch_size=3, seed=0)
    got = records(feeder, 2)
    assert [b.prompt_id for b in got] == [["q0@e0", "q0@e1", "q0@e2"], ["q0@e3", "q0@e4", "q0@e5"]]


# ---- one-shot children ------------------------------------------------------------------------------------------
def poll_until(sup: Supervisor, done, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "supervisor did not get there in time"
        sup.poll()
        time.sleep(0.05)


def test_a_one_shot_child_that_exits_0_is_finished_not_restarted(tmp_path, caplog):
    sup = Supervisor(tmp_path / "logs", max_restarts=2, spawn="exec")
    sup.add("trainer", 0, [sys.executable, "-c", "print('trained')"], one_shot=True)
    caplog.set_level("INFO", logger="expstream.supervisor")
    sup.start()
    poll_until(sup, lambda: sup.finished("trainer"))
    for _ in range(10):  # a while longer: nothing is started again
        sup.poll()
        time.sleep(0.1)
    child = sup.children[0]
    assert child.exit_codes == [0] and child.restarts == 0 and child.proc is None
    assert (tmp_path / "logs" / "trainer-0.log").read_text().count("trained") == 1
    assert any("trainer[0] finished (exit 0); not restarted" in r.getMessage() for r in caplog.records)
    assert sup.pids() == {}
    sup.stop()


def test_a_one_shot_child_that_crashes_is_restarted_and_can_then_finish(tmp_path):
    marker = tmp_path / "crashed-once"
    script = (f"import pathlib, sys; m = pathlib.Path({str(marker)!r})\n"
              "if not m.exists():\n    m.write_text('x'); sys.exit(1)\nprint('resumed')")
    sup = Supervisor(tmp_path / "logs", max_restarts=2, spawn="exec")
    sup.add("trainer", 0, [sys.executable, "-c", script], one_shot=True)
    sup.start()
    poll_until(sup, lambda: sup.finished("trainer"))
    child = sup.children[0]
    assert child.exit_codes == [1, 0] and child.restarts == 1
    assert "resumed" in (tmp_path / "logs" / "trainer-0.log").read_text()
    sup.stop()


def test_a_stage_that_exits_0_is_still_restarted_and_finished_is_per_name(tmp_path):
    sup = Supervisor(tmp_path / "logs", max_restarts=1, spawn="exec")
    sup.add("generate", 0, [sys.executable, "-c", "pass"])
    sup.add("trainer", 0, [sys.executable, "-c", "import time; time.sleep(60)"], one_shot=True)
    sup.start()
    with pytest.raises(SupervisorError, match=r"stage generate\[0\] died 2 times"):
        poll_until(sup, lambda: False)
    assert not sup.finished("trainer") and not sup.finished("generate") and not sup.finished("nope")
    sup.stop(grace_s=5)
    assert sup.children[0].exit_codes == [0, 0]  # a stage's exit 0 is a death like any other
