"""`expstream rewind`: positions, the plan, the handshake with live runners, a live embedded run.

* Pure: ``--to`` parsing and resolution against a hand-made index (expected offsets written out).
* State: the rewind request / acknowledgement methods on MemoryState and RedisState.
* Runners (real broker + redis-server): two StageRunner replicas of a copying stage on threads; a
  rewind moves the group and the replicas reprocess exactly the records from the target on; by
  offsets, by a time read from a recording, by batch id; a replica that never acknowledges aborts
  the rewind and nothing moves; --dry-run changes nothing.
* A live `expstream run` (its own broker/redis, tests/test_crash.py's PipelineRun): the reward stage
  is rewound while the run is held open; it reprocesses exactly the records after the target, each
  copy byte-identical to the first, and the run's experiences after dedupe are complete and single.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kafka import TopicPartition

from expstream.cli import main
from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.kafka.clients import make_admin, make_producer, read_topic
from expstream.kafka.topics import create_topics
from expstream.state import RedisState
from expstream.tools.recorder import Position
from expstream.tools.recording import RecordFrame, RecordingWriter
from expstream.tools.rewind import Entry, group_id_of, parse_rewind_position, resolve_targets
from schemas import PromptBatch, decode, encode
from schemas.codec import peek_header
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running

ROOT = Path(__file__).resolve().parents[1]


# --- positions (pure) ------------------------------------------------------------------------------
def test_parse_positions() -> None:
    assert parse_rewind_position("123") == Position("offset", "123", offset=123)
    assert parse_rewind_position("0:12,1:40") == Position("offset", "0:12,1:40", offsets={0: 12, 1: 40})
    assert parse_rewind_position("@1700000000000") == Position("time", "@1700000000000", time_ms=1700000000000)
    # 2023-11-14T22:13:20Z is 1_700_000_000 s after the epoch
    assert parse_rewind_position("2023-11-14T22:13:20Z").time_ms == 1_700_000_000_000
    assert parse_rewind_position("2023-11-14T23:13:20.5+01:00").time_ms == 1_700_000_000_500
    assert parse_rewind_position("batch:p000003/m0") == Position("batch", "batch:p000003/m0",
                                                                          batch_id="p000003/m0")


@pytest.mark.parametrize("text, says", [
    ("yesterday", "as a position"), ("2023-11-14T22:13:20", "no time zone"), ("0:1,0:2", "partition 0 twice"),
    ("batch:", "no batch id"), ("-3", "as a position")])
def test_bad_positions_name_the_flag(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        parse_rewind_position(text)
    assert info.value.field == "--to" and info.value.fix


INDEX = {  # partition -> records (offset, timestamp ms, batch id), as a recording would give them
    0: [Entry(0, 1000, "a"), Entry(1, 3000, "c"), Entry(2, 5000, "e"), Entry(3, 7000, "g")],
    1: [Entry(0, 2000, "b"), Entry(1, 4000, "d"), Entry(2, 6000, "f")],
}
STARTS, ENDS = {0: 0, 1: 0}, {0: 4, 1: 3}


@pytest.mark.parametrize("text, expected", [
    ("2", {0: 2, 1: 2}),
    ("1:1", {1: 1}),
    ("@3500", {0: 2, 1: 1}),  # first records at or after 3.5 s: e (p0@2), d (p1@1)
    ("@4000", {0: 2, 1: 1}),  # at: d itself
    ("@6500", {0: 3, 1: 3}),  # nothing left on p1: its end
    ("@99999", {0: 4, 1: 3}),
    ("batch:d", {0: 2, 1: 1}),  # d's own offset; p0 from the same moment (4 s): e
    ("batch:a", {0: 0, 1: 0}),
])
def test_resolve_targets(text: str, expected: dict[int, int]) -> None:
    assert resolve_targets(parse_rewind_position(text), INDEX, STARTS, ENDS, "scored") == expected


@pytest.mark.parametrize("text, says", [("4", r"offset 4 is outside scored\[1\], which holds 0..3"), ("2:0", "no partition 2"),
                                        ("batch:zz", "no record of scored carries batch id 'zz'")])
def test_resolve_refuses(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        resolve_targets(parse_rewind_position(text), INDEX, STARTS, ENDS, "scored")


# --- state -----------------------------------------------------------------------------------------
def test_state_rewind_handshake(state) -> None:
    assert state.rewind_request("reward") is None
    state.set_rewind_request("reward", "r1", 5.0)
    assert state.rewind_request("reward") == "r1" and state.rewind_request("postprocess") is None
    state.ack_rewind("reward", "r1", "0:11", 5.0)
    state.ack_rewind("reward", "old", "1:12", 5.0)  # an acknowledgement of another request does not count
    assert state.rewind_acks("reward", "r1") == {"0:11"}
    state.clear_rewind_request("reward")
    assert state.rewind_request("reward") is None and state.rewind_acks("reward", "r1") == set()
    state.set_rewind_request("reward", "r2", 0.05)  # a tool that died: the request expires
    time.sleep(0.2)
    assert state.rewind_request("reward") is None


# --- runners on a real broker --------------------------------------------------------------------
def _copy(batch, ctx):  # noqa: ANN001, ANN202 - the stage contract
    return [batch]


def _prompts(batch_id: str) -> bytes:
    return encode(PromptBatch(batch_id=batch_id, prompt_id=[batch_id], prompt=["q"], label=[""], reference=[""]))


class CopyingRunners:
    """What the rigs share: copying stage runners on threads (``running``, with their ``states``) writing to
    the topic ``dst``; ``settle_s``: how long :meth:`wait_outputs` waits on for outputs beyond the count."""

    broker: str
    dst: str
    running: list[Running]
    states: list[RedisState]
    settle_s: float = 0.0

    def outputs(self) -> list[str]:
        return [peek_header(r.value)[2] for r in read_topic(self.broker, None, self.dst)]

    def wait_outputs(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.outputs()) < n:
            for r in self.running:
                assert r.error is None, repr(r.error)
            assert time.monotonic() < deadline, f"{len(self.outputs())} of {n} outputs after {timeout_s}s"
            time.sleep(0.2)
        time.sleep(self.settle_s)

    def close(self) -> None:
        for r in self.running:
            r.runner.stop_requested = True
        for r in self.running:
            r.stop()
        for s in self.states:
            s.close()


class Rig(CopyingRunners):
    """A 2-partition input topic with 12 records (ts 1 s apart), two replicas of a copying stage
    (``assigned``: each given its partitions as ``expstream run`` does, stages/assigning.py)."""

    def __init__(self, broker: str, redis_url: str, tmp_path: Path, replicas: int = 2, assigned: bool = False) -> None:
        self.broker, self.redis_url = broker, redis_url
        self.src, self.dst = f"rin-{uuid.uuid4().hex[:8]}", f"rout-{uuid.uuid4().hex[:8]}"
        create_topics(broker, {self.src: 2, self.dst: 2}, with_dlq=True)
        self.topo_path = tmp_path / "topology.yaml"
        self.topo_path.write_text(yaml.safe_dump(
            {"stages": {"generate": {"output": self.src}, "shard-preprocess": {"output": self.dst}}}))
        self.topo = load_topology(self.topo_path)
        self.run_id = f"rw{uuid.uuid4().hex[:8]}"
        self.t0 = int(time.time() * 1000) - 60_000
        producer = make_producer(broker)
        self.sent: dict[str, tuple[int, int, int]] = {}  # batch id -> partition, offset, timestamp
        for i in range(12):
            bid, ts = f"b{i:02d}", self.t0 + 1000 * i
            md = producer.send(self.src, value=_prompts(bid), partition=i % 2, timestamp_ms=ts).get(10)
            self.sent[bid] = (md.partition, md.offset, ts)
        producer.close()
        self.states = [RedisState(redis_url, self.run_id) for _ in range(replicas)]
        self.running = [Running(StageRunner(make_context(self.topo, "shard-preprocess", state=s, run_id=self.run_id,
                                                         replica_id=str(i)), _copy, broker,
                                                assignment=(i, replicas) if assigned else None))
                        for i, s in enumerate(self.states)]
        self.wait_outputs(12)
        # a commit group is committed after its outputs are confirmed: the outputs show up first
        deadline = time.monotonic() + 30
        while sum(max(c, 0) for c in self.committed().values()) < 12 and time.monotonic() < deadline:
            time.sleep(0.2)

    def committed(self) -> dict[int, int]:
        admin = make_admin(self.broker)
        try:
            got = admin.list_group_offsets({self.group: [TopicPartition(self.src, p) for p in (0, 1)]})[self.group]
            return {tp.partition: c.offset for tp, c in got.items()}
        finally:
            admin.close()

    @property
    def group(self) -> str:
        return group_id_of(self.run_id, "shard-preprocess")

    def rewind(self, *extra: str) -> int:
        return main(["rewind", "--stage", "shard-preprocess", "--bootstrap-servers", self.broker, "--redis-url",
                     self.redis_url, "--run-id", self.run_id, "--topology", str(self.topo_path), *extra])


@pytest.fixture
def rig(broker: str, redis_url: str, tmp_path: Path):
    """Two replicas with their partitions assigned by hand (the demo's way); rig1's one replica joins its group."""
    r = Rig(broker, redis_url, tmp_path, assigned=True)
    try:
        yield r
    finally:
        r.close()


def _reprocessed(rig: Rig) -> Counter:
    """Batch ids output more than once, and how many times more."""
    outs = rig.outputs()
    counts = Counter(outs)
    assert set(counts) == set(rig.sent), "the outputs are the inputs' batch ids"
    return Counter({b: c - 1 for b, c in counts.items() if c > 1})


def _wait_reprocessed(rig: Rig, expected_total: int) -> None:
    rig.wait_outputs(expected_total, timeout_s=90)
    time.sleep(1.5)  # anything beyond the expected count would arrive now (the replicas are idle again)


def test_rewind_by_offsets_reprocesses_exactly_the_records_after_the_target(rig: Rig, capsys) -> None:
    assert rig.committed() == {0: 6, 1: 6}
    # dry run first: the plan, nothing moved
    assert rig.rewind("--to", "0:2,1:5", "--dry-run") == 0
    out = capsys.readouterr().out
    assert f"{rig.src}[0]: 6 -> 2 (end 6): 4 record(s) reprocessed, batches b04 .. b10" in out
    assert f"{rig.src}[1]: 6 -> 5 (end 6): 1 record(s) reprocessed, batches b11 .. b11" in out
    time.sleep(1.0)
    assert rig.committed() == {0: 6, 1: 6} and len(rig.outputs()) == 12
    # partition 0 from offset 2 (b04 b06 b08 b10), partition 1 from offset 5 (b11)
    assert rig.rewind("--to", "0:2,1:5", "--yes") == 0
    expected = {b for b, (p, off, _) in rig.sent.items() if (p == 0 and off >= 2) or (p == 1 and off >= 5)}
    assert expected == {"b04", "b06", "b08", "b10", "b11"}
    _wait_reprocessed(rig, 12 + len(expected))
    again = _reprocessed(rig)
    assert set(again) == expected and set(again.values()) == {1}, again
    assert rig.committed() == {0: 6, 1: 6}
    assert sum(r.runner.rewinds for r in rig.running) == 2, "both replicas left the group once"
    assert RedisState(rig.redis_url, rig.run_id).rewind_request("shard-preprocess") is None


@pytest.fixture
def rig1(broker: str, redis_url: str, tmp_path: Path):
    """The rig with one replica (it owns both partitions)."""
    r = Rig(broker, redis_url, tmp_path, replicas=1)
    try:
        yield r
    finally:
        r.close()


def test_rewind_to_a_recorded_time_and_to_a_batch(rig1: Rig, tmp_path: Path, capsys) -> None:
    rig = rig1
    run_dir = tmp_path / "run"
    with RecordingWriter(run_dir) as w:  # the run's recording of the input topic
        w.extend(RecordFrame.from_consumer_record(r) for r in read_topic(rig.broker, None, rig.src))
    _, _, ts7 = rig.sent["b07"]
    # independent expectation: per partition, the records at or after b07's time are b07..b11
    expected = {b for b, (_, _, ts) in rig.sent.items() if ts >= ts7}
    assert expected == {"b07", "b08", "b09", "b10", "b11"}
    assert rig.rewind("--to", f"@{ts7}", "--run-dir", str(run_dir), "--yes") == 0
    assert "12 records from" in capsys.readouterr().out
    _wait_reprocessed(rig, 12 + 5)
    assert _reprocessed(rig) == Counter(dict.fromkeys(expected, 1))
    # a batch id: b09 is at partition 1 offset 4; partition 0 from the same moment (b10)
    assert rig.rewind("--to", "batch:b09", "--yes") == 0
    _wait_reprocessed(rig, 12 + 5 + 3)
    assert _reprocessed(rig) == Counter({"b07": 1, "b08": 1, "b09": 2, "b10": 2, "b11": 2})


def test_rewind_aborts_when_a_live_replica_never_acknowledges(broker: str, redis_url: str, tmp_path: Path,
                                                              capsys) -> None:
    rig = Rig(broker, redis_url, tmp_path, replicas=1)
    try:
        state = rig.states[0]
        # an old replica heartbeating without the rewind check (it never acknowledges)
        stop = threading.Event()

        def ghost() -> None:
            while not stop.wait(0.5):
                state.heartbeat("shard-preprocess", "ghost:4242")

        threading.Thread(target=ghost, daemon=True).start()
        time.sleep(0.7)
        rc = rig.rewind("--to", "0", "--yes", "--timeout", "3")
        stop.set()
        err = capsys.readouterr().err
        assert rc == 1 and "ghost:4242" in err and "nothing changed" in err, err
        assert rig.committed() == {0: 6, 1: 6}
        assert state.rewind_request("shard-preprocess") is None
        # the real replica went back to work: a new record is handled
        producer = make_producer(broker)
        producer.send(rig.src, value=_prompts("late"), partition=0).get(10)
        producer.close()
        rig.sent["late"] = (0, 6, 0)
        rig.wait_outputs(13, timeout_s=30)
        assert rig.running[0].runner.rewinds == 1
    finally:
        rig.close()


# --- a live embedded run -------------------------------------------------------------------------
def test_rewind_reward_on_a_live_run(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.test_crash import N, PipelineRun

    cache = tmp_path_factory.getbasetemp() / "crash-models"
    cache.mkdir(exist_ok=True)
    run = PipelineRun(tmp_path, cache, n_prompts=8).start()
    try:
        # hold the run open: advantage stopped (SIGSTOP) once it consumes, so no group completes
        deadline = time.monotonic() + 120
        while not run.consuming("advantage[0]"):
            assert run.alive and time.monotonic() < deadline, run.diagnostics()
            time.sleep(0.2)
        adv = run.pids()["advantage[0]"]
        os.kill(adv, signal.SIGSTOP)
        topo = load_topology(ROOT / "topology.yaml")
        src, dst = topo.stages["reward"].input, topo.stages["reward"].output
        group = group_id_of(run.run_id, "reward")
        admin = make_admin(run.bootstrap)
        tps = [TopicPartition(src, p) for p in range(topo.topics.partitions)]

        def committed() -> dict[int, int]:
            got = admin.list_group_offsets({group: tps}).get(group, {})
            return {tp.partition: c.offset for tp, c in got.items() if c.offset is not None and c.offset >= 0}

        inputs = {}  # (partition, offset) -> (batch id, value)
        while True:  # reward has handled every input record (one per group: micro_rollout_batch_size=N)
            assert run.alive and time.monotonic() < deadline, run.diagnostics()
            recs = list(read_topic(run.bootstrap, None, src))
            inputs = {(r.partition, r.offset): peek_header(r.value)[2] for r in recs}
            ends = {p: 1 + max([o for (q, o) in inputs if q == p], default=-1) for p in range(len(tps))}
            if len(inputs) == 8 and committed() == {p: e for p, e in ends.items() if e > 0}:
                break
            time.sleep(0.3)
        first_outputs = {peek_header(r.value)[2]: r.value for r in read_topic(run.bootstrap, None, dst)}
        assert len(first_outputs) == 8
        # rewind partition by partition to half way (at least one record back on each non-empty one)
        targets = {p: e // 2 for p, e in ends.items()}
        to = ",".join(f"{p}:{o}" for p, o in targets.items())
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "expstream", "rewind", "--stage", "reward", "--to", to,
                               "--bootstrap-servers", run.bootstrap, "--redis-url", run.redis_url, "--run-id",
                               run.run_id, "--run-dir", str(run.out), "--yes", "--timeout", "60"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        print(f"rewind of reward took {time.monotonic() - started:.1f}s (process start included)\n{proc.stdout}")
        expected = Counter(b for (p, o), b in inputs.items() if o >= targets[p])
        assert sum(expected.values()) == sum(ends.values()) - sum(targets.values()) > 0
        total = 8 + sum(expected.values())
        while len(outs := [r for r in read_topic(run.bootstrap, None, dst)]) < total:
            assert run.alive and time.monotonic() < deadline, run.diagnostics()
            time.sleep(0.3)
        time.sleep(2.0)  # a record reprocessed twice would show up now
        outs = list(read_topic(run.bootstrap, None, dst))
        counts = Counter(peek_header(r.value)[2] for r in outs)
        assert counts - Counter(first_outputs.keys()) == expected, "exactly the records after the target, once more"
        for r in outs:  # every copy identical to the first output (stable ids, deterministic stage)
            assert r.value == first_outputs[peek_header(r.value)[2]]
        m = re.search(r"(\d+) record\(s\) reprocessed", proc.stdout)
        assert m, proc.stdout
        assert sum(int(x) for x in re.findall(r"(\d+) record\(s\) reprocessed", proc.stdout.split("rewound")[1])) \
            == sum(expected.values())
        os.kill(adv, signal.SIGCONT)
        assert run.wait(180) == 0, run.diagnostics()
        acc = run.account()
        assert not acc.lost and acc.doubled == 0 and not acc.unexpected and not acc.inconsistent, acc.line()
        assert acc.expected == 8 * N
        exps = [decode(r.value) for r in read_topic(run.bootstrap, None, "experiences")]
        by_sample: dict[str, list] = {}
        for e in exps:
            for i, sid in enumerate(e.sample_ids()):
                by_sample.setdefault(sid, []).append(e.advantages.row(i).tobytes())
        assert all(len(set(v)) == 1 for v in by_sample.values()), "a reprocessed sample's copies are identical"
        admin.close()
    finally:
        try:
            os.kill(run.pids().get("advantage[0]", 0) or 0, signal.SIGCONT)
        except (OSError, TypeError):
            pass
        run.close()



# --- generate of a multi-turn run: its second group on the turns topic --------------------------------
def test_parse_move_names_topics_and_reads_the_earlier_form() -> None:
    from stages.rewinding import parse_move

    assert parse_move("prompts/0:3,1:7") == {"prompts": {0: 3, 1: 7}}
    assert parse_move("prompts/0:3/turns/0:5") == {"prompts": {0: 3}, "turns": {0: 5}}
    assert parse_move("0:3,1:7") == {None: {0: 3, 1: 7}}  # a tool of an earlier version: every topic


def test_turns_targets_move_back_to_the_moment_and_never_forward() -> None:
    from expstream.config.kafka import KafkaConfig
    from expstream.tools.rewind import TopicView, turns_targets

    index = {0: [Entry(o, 1000 + 100 * o, f"t{o}") for o in range(10)], 1: [Entry(o, 1050 + 100 * o, None)
                                                                           for o in range(4)]}
    view = TopicView("turns", {0: 0, 1: 0}, {0: 10, 1: 4}, index, {})
    # the moment 1420: partition 0 from offset 5 (ts 1500), partition 1's records all older (end 4)
    assert turns_targets(1420, view, {0: 10, 1: 2}, KafkaConfig()) == ({0: 5}, [1])
    assert turns_targets(1420, view, {0: 5, 1: 4}, KafkaConfig()) == ({}, [])  # already there
    assert turns_targets(None, view, {0: 10, 1: 4}, KafkaConfig()) == ({}, [])  # offsets: the turns group stays


class TurnsRig(CopyingRunners):
    """A generate replica of a multi-turn run (its prompts runner and its turns runner, one process, copying
    stages) on one-partition topics: 6 prompt records p00.. (ts t0 + i s) and 6 turn records t00.. (+0.5 s)."""

    settle_s = 1.5  # anything beyond the expected count would arrive meanwhile

    def __init__(self, broker: str, redis_url: str, tmp_path: Path) -> None:
        from expstream.launch.replica import turns_runner

        self.broker, self.redis_url = broker, redis_url
        tag = uuid.uuid4().hex[:8]
        self.prompts, self.turns, self.dst = f"mp-{tag}", f"mt-{tag}", f"mo-{tag}"
        create_topics(broker, {self.prompts: 1, self.turns: 1, self.dst: 1}, with_dlq=True)
        topo = load_topology(overrides=[f"topics.input={self.prompts}", "environment.fn=tests.envfns:mixed",
                                        f"environment.turns_topic={self.turns}", f"stages.generate.output={self.dst}"])
        self.topo_path = tmp_path / "topology.yaml"
        self.topo_path.write_text(yaml.safe_dump(topo.to_raw()))
        self.run_id = f"rwt{tag}"
        self.t0 = int(time.time() * 1000) - 60_000
        producer = make_producer(broker)
        for i in range(6):
            producer.send(self.prompts, value=_prompts(f"p{i:02d}"), timestamp_ms=self.t0 + 1000 * i).get(10)
            producer.send(self.turns, value=_prompts(f"t{i:02d}"), timestamp_ms=self.t0 + 1000 * i + 500).get(10)
        producer.close()
        self.states = [RedisState(redis_url, self.run_id)]
        ctx = make_context(topo, "generate", state=self.states[0], run_id=self.run_id, replica_id="0")
        main_runner = StageRunner(ctx, _copy, broker)
        self.running = [Running(main_runner), Running(turns_runner(ctx, _copy, main_runner, broker))]
        self.wait_outputs(12)

    def wait_outputs(self, n: int, timeout_s: float = 90) -> None:
        super().wait_outputs(n, timeout_s)

    def again(self) -> Counter:
        return Counter({b: c - 1 for b, c in Counter(self.outputs()).items() if c > 1})

    def committed(self) -> tuple[int, int]:
        admin = make_admin(self.broker)
        try:
            g, t = group_id_of(self.run_id, "generate"), group_id_of(self.run_id, "generate") + ".turns"
            return (admin.list_group_offsets({g: [TopicPartition(self.prompts, 0)]})[g][TopicPartition(self.prompts, 0)]
                    .offset, admin.list_group_offsets({t: [TopicPartition(self.turns, 0)]})[t][TopicPartition(
                        self.turns, 0)].offset)
        finally:
            admin.close()

    def rewind(self, *extra: str) -> int:
        return main(["rewind", "--stage", "generate", "--bootstrap-servers", self.broker, "--redis-url",
                     self.redis_url, "--run-id", self.run_id, "--topology", str(self.topo_path), "--yes", *extra])


def test_rewind_of_generate_in_a_multi_turn_run_moves_the_turns_group_by_time_only(broker: str, redis_url: str,
                                                                                 tmp_path: Path, capsys) -> None:
    """An offset rewind moves the prompts group alone (before: the turns runner also took the offsets as its
    own topic's and reprocessed t02..); a time rewind moves both groups to the same moment."""
    rig = TurnsRig(broker, redis_url, tmp_path)
    try:
        assert rig.committed() == (6, 6)
        assert rig.rewind("--to", "0:2") == 0
        out = capsys.readouterr().out
        assert f"{rig.turns}: unchanged (offsets name {rig.prompts}'s records" in out, out
        rig.wait_outputs(12 + 4)
        assert rig.again() == Counter(dict.fromkeys(["p02", "p03", "p04", "p05"], 1))
        assert rig.committed() == (6, 6)
        # the moment of p03 (t0 + 3 s): prompts from p03, turns from t03 (t0 + 3.5 s)
        assert rig.rewind("--to", f"@{rig.t0 + 3000}") == 0
        out = capsys.readouterr().out
        assert f"{rig.turns}[0]: 6 -> 3 (end 6): 3 record(s) reprocessed, batches t03 .. t05" in out, out
        rig.wait_outputs(12 + 4 + 6)
        assert rig.again() == Counter({"p02": 1, "p03": 2, "p04": 2, "p05": 2, "t03": 1, "t04": 1, "t05": 1})
        assert rig.committed() == (6, 6)
        assert [r.runner.rewinds for r in rig.running] == [2, 2], "both runners paused for both rewinds"
    finally:
        rig.close()
