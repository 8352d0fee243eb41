"""Partitions assigned by the run instead of a group join (stages/assigning.py, ``run.assign_partitions``):
the shares, the replicas that read them against the real broker, and the new shares at a scale
(Supervisor.reassign, the Scaler's hook)."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from expstream.errors import ConfigError
from expstream.kafka.clients import topic_lag
from expstream.launch.scale import MANUAL, Scaler
from expstream.launch.supervisor import Supervisor
from schemas import PromptBatch, encode
from stages.assigning import parse_assignment, share
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running
from tests.test_runner import produce, stage_topology

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_the_shares_of_n_replicas_are_disjoint_and_cover_every_partition() -> None:
    for parts, n in ((8, 1), (8, 2), (8, 3), (3, 3), (5, 4)):
        shares = [share(range(parts), i, n) for i in range(n)]
        assert sorted(p for s in shares for p in s) == list(range(parts)), (parts, n, shares)
    assert share(range(8), 1, 3) == [1, 4, 7]


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "0/0", "1/2/3"])
def test_a_bad_assign_is_a_config_error_naming_the_flag(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_assignment(text)
    assert err.value.field == "--assign" and text in str(err.value)


def test_a_bad_assign_stops_the_stage_command_before_it_tries_redis() -> None:
    """``expstream stage NAME --assign 3/2``: exit 2 naming the flag, with no retry of the (closed) Redis
    port in between (the check once ran after the state client was made: 30 s of retries, then exit 1)."""
    import subprocess

    from expstream.launch.localservers import free_port

    port = free_port()  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "expstream", "stage", "shard-preprocess", "--assign", "3/2",
                           "--bootstrap-servers", "127.0.0.1:1", "--redis-url", f"redis://127.0.0.1:{port}/0",
                           "--run-id", "x"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--assign '3/2'" in proc.stderr and "unavailable" not in proc.stderr and "retry" not in proc.stderr


def test_assigned_replicas_read_every_record_once_commit_under_the_group_and_resume_after_a_restart(broker):
    """Two replicas given 0/2 and 1/2 take disjoint halves of a 4-partition topic without joining the
    group, handle every record once and commit under the stage's group id (the autoscaler's lag reads
    0); a replica started again with the same assignment resumes after the committed offsets."""
    topo = stage_topology(broker, "shard-preprocess", partitions=4)
    src = topo.stages["shard-preprocess"].input
    run_id = f"as{uuid.uuid4().hex[:6]}"
    seen: list[tuple[str, str]] = []

    def replicas(tag: str) -> list[StageRunner]:
        def process_as(r: int):
            return lambda batch, ctx: seen.append((f"{tag}{r}", batch.batch_id)) or []

        return [StageRunner(make_context(topo, "shard-preprocess", run_id=run_id, replica_id=r), process_as(r),
                            broker, assignment=(r, 2)) for r in range(2)]

    def batch(name: str) -> bytes:
        return encode(PromptBatch(batch_id=name, prompt_id=[name], prompt=["x"], label=[""], reference=[""]))

    first = [f"a-{p}-{i}" for p in range(4) for i in range(2)]
    produce(broker, src, [batch(n) for n in first], partitions=[int(n.split("-")[1]) for n in first])
    runners = replicas("first")
    running = [Running(r) for r in runners]
    try:
        for run in running:
            run.wait(lambda: sum(r.handled for r in runners) == len(first), 60, "every record of the first round")
        time.sleep(0.5)  # a second delivery would show up here
    finally:
        for run in running:
            run.stop()
    assert sorted(tp.partition for tp in runners[0].tracker.assigned) == [0, 2]
    assert sorted(tp.partition for tp in runners[1].tracker.assigned) == [1, 3]
    assert Counter(b for _, b in seen) == Counter(first), seen
    assert {b.split("-")[1] for who, b in seen if who == "first0"} == {"0", "2"}, seen
    assert topic_lag(broker, topo.kafka, runners[0].group_id, src) == {0: 0, 1: 0, 2: 0, 3: 0}

    later = [f"b-{p}" for p in range(4)]
    produce(broker, src, [batch(n) for n in later], partitions=list(range(4)))
    seen.clear()
    again = replicas("again")
    running = [Running(r) for r in again]
    try:
        for run in running:
            run.wait(lambda: sum(r.handled for r in again) == len(later), 60, "the records sent after the restart")
        time.sleep(0.5)
    finally:
        for run in running:
            run.stop()
    assert Counter(b for _, b in seen) == Counter(later), f"read again or lost after the restart: {seen}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


def test_reassign_stops_every_replica_before_it_starts_the_new_count_with_their_new_shares(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs")
    for r in range(2):
        sup.add("reward", r, [*SLEEPER, f"--assign={r}/2"])
    sup.add("generate", 0, SLEEPER)
    sup.start()
    try:
        old = {c.label: c.proc.pid for c in sup.children}

        def started(n: int, before: dict[str, int]) -> bool:
            """``n`` reward replicas run, none of them one of ``before`` (pids() lists a retiring replica too: one
            old replica still exiting while the new one waits was once taken for the new count of 1)."""
            sup.poll()
            running = [pid for label, pid in sup.pids().items() if label.startswith("reward")]
            return sup.replicas("reward") == n and len(running) == n and not set(running) & set(before.values())

        assert sup.reassign("reward", 3, lambda replica: [*SLEEPER, f"--assign={replica}/3"]) == 2
        assert sup.replicas("reward") == 3  # the count wanted, while the old replicas finish
        deadline = time.monotonic() + 30
        while not started(3, old):
            assert time.monotonic() < deadline, "the new replicas never started"
            newer = [pid for label, pid in sup.pids().items() if label.startswith("reward") and pid not in old.values()]
            if newer:  # none starts before every old one is gone
                assert all(not alive(old[label]) for label in ("reward[0]", "reward[1]")), "two shares at once"
            time.sleep(0.05)
        new = sup.pids()
        assert not any(alive(old[label]) for label in ("reward[0]", "reward[1]")), "an old share's replica still runs"
        assert new["generate[0]"] == old["generate[0]"], "another stage was touched"
        assert {new["reward[0]"], new["reward[1]"]}.isdisjoint({old["reward[0]"], old["reward[1]"]})
        assert sorted(c.argv[-1] for c in sup.children if c.name == "reward" and not c.retired) == [
            "--assign=0/3", "--assign=1/3", "--assign=2/3"]
        three = sup.pids()
        assert sup.reassign("reward", 1, lambda replica: [*SLEEPER, f"--assign={replica}/1"]) == 3
        deadline = time.monotonic() + 30
        while not started(1, three):
            assert time.monotonic() < deadline, "the new replica never started"
            time.sleep(0.05)
        assert not any(alive(three[f"reward[{r}]"]) for r in range(3))
        assert [c.argv[-1] for c in sup.children if c.name == "reward" and not c.retired] == ["--assign=0/1"]
        assert sorted(sup.pids()) == ["generate[0]", "reward[0]"]
        assert sup.total_restarts == 0, "a reassignment is not a failure"
    finally:
        sup.stop(grace_s=5)


def test_the_scaler_reassigns_a_hand_assigned_stage_and_scales_a_grouped_one(tmp_path: Path) -> None:
    from expstream.config.topology import load_topology

    topo = load_topology(overrides=["topics.partitions=3"])

    class CountingSupervisor:
        def __init__(self) -> None:
            self.counts = {u.name: 1 for u in topo.units()}
            self.scaled: list[tuple[str, int]] = []

        def replicas(self, name: str) -> int:
            return self.counts[name]

        def scale_to(self, name: str, count: int, argv_for) -> int:  # noqa: ANN001
            before, self.counts[name] = self.counts[name], count
            self.scaled.append((name, count))
            return before

    sup = CountingSupervisor()
    calls: list[tuple[str, int]] = []

    def reassign(name: str, count: int) -> int | None:
        if name != "reward":  # what RunServices.reassign does for a unit of group members
            return None
        calls.append((name, count))
        before, sup.counts[name] = sup.counts[name], count
        return before

    scaler = Scaler(topo, sup, tmp_path, lambda name, replica: SLEEPER, reassign=reassign)
    assert scaler.apply("reward", 1, MANUAL, None) is None and calls == [], "no change, no restart"
    sup.scaled.clear()
    assert scaler.apply("reward", 3, MANUAL, None)["from"] == 1
    assert scaler.apply("reward", 2, MANUAL, None)["from"] == 3
    assert calls == [("reward", 3), ("reward", 2)] and sup.scaled == []
    assert scaler.apply("generate", 2, MANUAL, None)["to"] == 2
    assert sup.scaled == [("generate", 2)]


def test_a_generation_less_commit_is_refused_while_the_group_has_members(broker, fresh_topic):
    """What makes the switch at a scale safe (stages/assigning.py): a hand-assigned consumer's commit carries
    no generation, and the broker refuses it while the group has members (a straggler cannot move a grouped
    stage's offsets); once the group is empty again it is accepted (a restarted hand-assigned replica)."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    from expstream.kafka.clients import make_consumer

    topic = fresh_topic(1)
    produce(broker, topic, [b"x"] * 10)
    group, tp = f"g-{uuid.uuid4().hex[:8]}", TopicPartition(topic, 0)
    member = make_consumer(broker, group, topics=[topic])
    straggler = make_consumer(broker, group)
    try:
        deadline = time.monotonic() + 60
        while not member.assignment():
            assert time.monotonic() < deadline, "the member never joined"
            member.poll(200)
        straggler.assign([tp])
        with pytest.raises(Exception) as err:
            straggler.commit({tp: OffsetAndMetadata(5, "", -1)})
        assert "UnknownMemberId" in repr(err.value)
        assert member.committed(tp) is None
        member.close()
        straggler.commit({tp: OffsetAndMetadata(7, "", -1)})
        assert straggler.committed(tp) == 7
    finally:
        member.close()
        straggler.close()


def test_partitions_are_assigned_by_default_only_with_the_runs_own_broker() -> None:
    from expstream.config.topology import load_topology
    from expstream.launch.services import assigns_partitions

    default = load_topology()
    assert assigns_partitions(default, own_broker=True) and not assigns_partitions(default, own_broker=False)
    on, off = load_topology(overrides=["run.assign_partitions=true"]), load_topology(overrides=["run.assign_partitions=false"])
    assert assigns_partitions(on, own_broker=False) and not assigns_partitions(off, own_broker=True)
    with pytest.raises(ConfigError) as err:
        load_topology(overrides=["run.assign_partitions=sometimes"])
    assert "run.assign_partitions" in str(err.value)
