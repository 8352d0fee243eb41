"""The recorder (expstream/tools/recorder.py): positions, export and follow modes, and `expstream run`'s recording.

Kafka is the session's real Tansu broker (or the run's own embedded one); expected values come
from what the test produced or from `expstream.kafka.clients.read_topic`, never from the recorder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from expstream.config.kafka import KafkaConfig
from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.kafka.clients import make_producer, read_topic
from expstream.kafka.topics import dlq_topic
from expstream.tools.recorder import Position, Recorder, cut_torn_tail, parse_position, record_topics
from expstream.tools.recording import (
    PartitionReader,
    iter_topic,
    partition_path,
    recorded_partitions,
    recorded_topics,
)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# ------------------------------------------------------------------------------------------------
# parse_position (pure)
# ------------------------------------------------------------------------------------------------



def _env() -> dict[str, str]:
    """This checkout first on the path: the command runs from a scratch directory."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

def test_parse_position_grammar() -> None:
    assert parse_position("123").offset_for(0) == 123 and parse_position("123").offset_for(5) == 123
    per = parse_position("0:12,1:40")
    assert (per.kind, per.offset_for(0), per.offset_for(1), per.offset_for(2)) == ("offset", 12, 40, None)
    assert parse_position("@1700000000000") == Position("time", "@1700000000000", time_ms=1700000000000)
    # 2026-11-24T10:00:00Z by hand: 56 years of 365 days + 14 leap days + 327 days of 2026 = 20781 days
    assert parse_position("2026-11-24T10:00:00Z").time_ms == (20781 * 86400 + 10 * 3600) * 1000
    assert parse_position("2026-11-24T11:00:00+01:00").time_ms == (20781 * 86400 + 10 * 3600) * 1000
    b = parse_position("batch:p000003")
    assert (b.kind, b.batch_id, b.offset_for(0)) == ("batch", "p000003", None)


@pytest.mark.parametrize("text, says", [
    ("", "empty"), ("abc", "cannot read"), ("2026-11-24T10:00:00", "no time zone"), ("@12x", "epoch"),
    ("0:1,0:2", "twice"), ("batch:", "no batch id"),
])
def test_parse_position_refuses_bad_text_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_position(text, "--to")
    assert says in str(err.value) and err.value.field == "--to"


def test_record_topics_default_and_list() -> None:
    topo = load_topology(None)
    topics = record_topics(topo)
    for t in topo.all_topics():
        assert t in topics and dlq_topic(t) in topics
    assert "policy" not in topics
    assert "policy" in record_topics(load_topology(None, ["train.enabled=true"]))
    assert record_topics(load_topology(None, ["record.topics=[scored, rollouts]"])) == ["scored", "rollouts"]


def test_record_enabled_default_follows_the_broker() -> None:
    topo = load_topology(None)
    assert topo.record.is_on(own_broker=True) and not topo.record.is_on(own_broker=False)
    assert load_topology(None, ["record.enabled=true"]).record.is_on(own_broker=False)
    assert not load_topology(None, ["record.enabled=false"]).record.is_on(own_broker=True)


# ------------------------------------------------------------------------------------------------
# Recorder on the session broker
# ------------------------------------------------------------------------------------------------


def _produce(broker: str, topic: str, partitions: int, per_partition: int, *, pause_every: int = 0) -> None:
    producer = make_producer(broker, KafkaConfig())
    try:
        for i in range(per_partition):
            for p in range(partitions):
                producer.send(topic, f"{topic}-{p}-{i}".encode(), key=f"k{i}".encode(), partition=p,
                              headers=[("h", f"{i}".encode())]).get(timeout=10)
            if pause_every and (i + 1) % pause_every == 0:
                time.sleep(0.05)  # separates the timestamps of the groups
    finally:
        producer.close(timeout=10)


def _frames(root: Path, topic: str) -> dict[int, list]:
    return {p: list(PartitionReader(partition_path(root, topic, p), topic, p)) for p in recorded_partitions(root, topic)}


def test_export_whole_topics_identical_to_the_broker(broker: str, fresh_topic, tmp_path: Path) -> None:
    a, b = fresh_topic(2), fresh_topic(1)
    _produce(broker, a, 2, 5)
    _produce(broker, b, 1, 3)
    stats = Recorder(broker, None, [a, b], tmp_path).run()
    for topic in (a, b):
        want = [(r.partition, r.offset, r.timestamp, r.key, r.value, tuple(r.headers))
                for r in read_topic(broker, None, topic)]
        got = [(f.partition, f.offset, f.timestamp, f.key, f.value, tuple(f.headers))
               for f in iter_topic(tmp_path, topic, order="partition")]
        assert sorted(got) == sorted(want) and len(got) == {a: 10, b: 3}[topic]
        assert stats.records[topic] == len(want)
    # run again (continuing this recording): nothing new on the broker, nothing recorded twice
    again = Recorder(broker, None, [a, b], tmp_path, continue_recording=True).run()
    assert sum(again.records.values()) == 0
    assert len(list(iter_topic(tmp_path, a))) == 10


def test_export_from_to_offsets(broker: str, fresh_topic, tmp_path: Path) -> None:
    topic = fresh_topic(2)
    _produce(broker, topic, 2, 6)
    Recorder(broker, None, [topic], tmp_path / "one", parse_position("2"), parse_position("5")).run()
    assert {p: [f.offset for f in fs] for p, fs in _frames(tmp_path / "one", topic).items()} == {0: [2, 3, 4],
                                                                                                1: [2, 3, 4]}
    Recorder(broker, None, [topic], tmp_path / "per", parse_position("0:4,1:1"), parse_position("0:5")).run()
    got = {p: [f.offset for f in fs] for p, fs in _frames(tmp_path / "per", topic).items()}
    assert got == {0: [4], 1: [1, 2, 3, 4, 5]}  # partition 1 has no --to: up to the end at start
    assert [f.value for f in _frames(tmp_path / "per", topic)[0]] == [f"{topic}-0-4".encode()]


def test_export_from_to_times_on_record_timestamps(broker: str, fresh_topic, tmp_path: Path) -> None:
    topic = fresh_topic(2)
    _produce(broker, topic, 2, 9, pause_every=3)
    recs = list(read_topic(broker, None, topic))
    stamps = sorted({r.timestamp for r in recs})
    lo, hi = stamps[len(stamps) // 3], stamps[2 * len(stamps) // 3]
    want = sorted((r.partition, r.offset) for r in recs if lo <= r.timestamp < hi)
    assert 0 < len(want) < len(recs)
    stats = Recorder(broker, None, [topic], tmp_path, parse_position(f"@{lo}"), parse_position(f"@{hi}")).run()
    got = sorted((f.partition, f.offset) for f in iter_topic(tmp_path, topic))
    assert got == want and stats.filtered == len(recs) - len(want)


def test_record_cli_export_with_iso_times_and_offsets(broker: str, fresh_topic, tmp_path: Path) -> None:
    topic = fresh_topic(1)
    _produce(broker, topic, 1, 4)
    recs = list(read_topic(broker, None, topic))
    from datetime import UTC, datetime

    iso = datetime.fromtimestamp(recs[1].timestamp / 1000, UTC).isoformat(timespec="milliseconds")
    out = tmp_path / "cli"
    proc = subprocess.run([PY, "-m", "expstream", "record", "--bootstrap-servers", broker, "--topics", topic,
                           "--from", iso, "--to", "3", "--output", str(out)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = [r.offset for r in recs if r.timestamp >= recs[1].timestamp and r.offset < 3]
    assert [f.offset for f in iter_topic(out, topic)] == want and want[0] <= 1
    bad = subprocess.run([PY, "-m", "expstream", "record", "--bootstrap-servers", broker, "--topics", "no-such-topic",
                          "--output", str(tmp_path / "x")], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--topics" in bad.stderr and "no-such-topic" in bad.stderr


def test_follow_mode_drains_on_stop(broker: str, fresh_topic, tmp_path: Path) -> None:
    topic = fresh_topic(2)
    _produce(broker, topic, 2, 2)
    rec = Recorder(broker, None, [topic], tmp_path, follow=True)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("stats", rec.run()))
    t.start()
    try:
        _produce(broker, topic, 2, 3)  # while it follows
    finally:
        rec.request_stop()  # right after the last confirmed send: the drain must still get them
        t.join(timeout=60)
    assert not t.is_alive()
    assert result["stats"].drained
    assert sorted((f.partition, f.offset) for f in iter_topic(tmp_path, topic)) == \
        sorted((p, o) for p in range(2) for o in range(5))


def test_torn_tail_is_cut_before_appending(broker: str, fresh_topic, tmp_path: Path) -> None:
    topic = fresh_topic(1)
    _produce(broker, topic, 1, 3)
    Recorder(broker, None, [topic], tmp_path).run()
    path = partition_path(tmp_path, topic, 0)
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # a writer killed inside its last frame
    reader = PartitionReader(path, topic, 0)
    assert [f.offset for f in reader] == [0, 1] and reader.torn_tail
    _produce(broker, topic, 1, 2)
    Recorder(broker, None, [topic], tmp_path, continue_recording=True).run()  # re-records offset 2, appends 3, 4
    reader = PartitionReader(path, topic, 0)
    assert [f.offset for f in reader] == [0, 1, 2, 3, 4] and not reader.torn_tail
    assert cut_torn_tail(path, topic, 0) == 0


def test_a_directory_holding_another_runs_recording_is_refused(broker: str, fresh_topic, tmp_path: Path) -> None:
    topic = fresh_topic(1)
    _produce(broker, topic, 1, 3)
    Recorder(broker, None, [topic], tmp_path / "r", run_id="run-1").run()
    path = partition_path(tmp_path / "r", topic, 0)
    before = path.read_bytes()
    _produce(broker, topic, 1, 2)
    # without --continue: refused, nothing appended (was: appended from offset 3, silently)
    proc = subprocess.run([PY, "-m", "expstream", "record", "--bootstrap-servers", broker, "--topics", topic,
                           "--output", str(tmp_path / "r")], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--output" in proc.stderr and "already holds a recording" in proc.stderr and "run run-1" in proc.stderr
    assert "--continue" in proc.stderr and "Traceback" not in proc.stderr
    assert path.read_bytes() == before
    with pytest.raises(ConfigError, match="holds the recording of run run-1, not of run run-2"):
        Recorder(broker, None, [topic], tmp_path / "r", continue_recording=True, run_id="run-2").run()
    # --continue on the same source: checked, then appended
    stats = Recorder(broker, None, [topic], tmp_path / "r", continue_recording=True, run_id="run-1").run()
    assert stats.records == {topic: 2} and [f.offset for f in iter_topic(tmp_path / "r", topic)] == [0, 1, 2, 3, 4]
    # another run's records under this topic's name (what a restarted local broker looks like), --continue or not
    for n, says in ((5, "holds another record at"), (7, "ends before it")):
        other = fresh_topic(1)
        _produce(broker, other, 1, n)
        Recorder(broker, None, [other], tmp_path / f"o{n}").run()
        (tmp_path / f"o{n}" / "topics" / other).rename(tmp_path / f"o{n}" / "topics" / topic)
        held = partition_path(tmp_path / f"o{n}", topic, 0).read_bytes()
        with pytest.raises(ConfigError, match=says) as err:
            Recorder(broker, None, [topic], tmp_path / f"o{n}", continue_recording=True).run()
        assert err.value.field == "--output" and f"{topic}[0]@{n - 1}" in str(err.value)
        assert partition_path(tmp_path / f"o{n}", topic, 0).read_bytes() == held


def test_missing_topic_is_a_clear_error_in_export_mode(broker: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        Recorder(broker, None, [f"absent-{uuid.uuid4().hex[:6]}"], tmp_path).run()
    assert err.value.field == "--topics"
    with pytest.raises(ConfigError):
        Recorder(broker, None, ["x"], tmp_path, parse_position("batch:p000001"))


# ------------------------------------------------------------------------------------------------
# expstream run records its topics
# ------------------------------------------------------------------------------------------------


def _run_sets(prefix: str) -> list[str]:
    """Topic names of their own on the shared session broker."""
    topo = load_topology(None)
    sets = [f"topics.input={prefix}prompts"]
    for st in topo.enabled_stages():
        sets.append(f"stages.{st.name}.output={prefix}{st.output}")
    return sets


def test_run_records_every_topic_and_dlq_twin(broker: str, redis_url: str, tmp_path: Path) -> None:
    prefix = f"r{uuid.uuid4().hex[:6]}-"
    prompts = tmp_path / "prompts.jsonl"
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()[:3]
    lines.append(json.dumps({"id": "long", "prompt": " ".join(["word"] * 200), "label": "x"}))  # -> prompts.dlq
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    cmd = [PY, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out), "--no-progress",
           "--bootstrap-servers", broker, "--redis-url", redis_url, "--run-id", prefix.rstrip("-"),
           "--set", "record.enabled=true", "--set", "generate.truncate_prompts=false",
           "--set", "run.max_lost_group_share=1", "--set", "run.timeout_s=120"]
    for s in _run_sets(prefix):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    topo = load_topology(out / "topology.yaml")  # the run directory's copy of the configuration
    assert topo.topics.input == f"{prefix}prompts"
    expected = record_topics(topo)
    assert set(recorded_topics(out)) == set(expected)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recording"]["torn_tails"] == 0
    total_dlq = 0
    for topic in expected:
        on_broker = sorted((r.partition, r.offset, r.value) for r in read_topic(broker, None, topic))
        recorded = sorted((f.partition, f.offset, f.value) for f in iter_topic(out, topic))
        assert recorded == on_broker, topic
        assert summary["recording"]["topics"][topic] == len(on_broker)
        if topic.endswith(".dlq"):
            total_dlq += len(on_broker)
    assert total_dlq >= 1  # the over-long prompt's dead letter was recorded too
    assert summary["recording"]["bytes"] == sum(p.stat().st_size for p in (out / "topics").rglob("*.rec"))


# A killed run's recording is readable: checked on the killed run of tests/test_replay.py
# (test_a_killed_run_replays_from_its_partial_recording), which replays from it too.


def test_supervisor_stops_a_stop_last_child_after_the_others(tmp_path: Path) -> None:
    from expstream.launch.supervisor import Supervisor

    flag = tmp_path / "stage-gone"
    seen = tmp_path / "seen"
    # the stage takes 1 s to stop; the recorder notes, when its SIGTERM comes, whether the stage was gone
    stage = ("import signal, sys, time, pathlib\n"
             "def h(*a):\n    time.sleep(1.0); pathlib.Path(sys.argv[1]).write_text('x'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, h)\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)\n")
    last = ("import signal, sys, time, pathlib\n"
            "def h(*a):\n    pathlib.Path(sys.argv[2]).write_text(str(pathlib.Path(sys.argv[1]).exists())); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, h)\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)\n")
    sup = Supervisor(tmp_path / "logs", spawn="exec")
    sup.add("recorder", 0, [PY, "-c", last, str(flag), str(seen)], stop_last=True)
    sup.add("stage", 0, [PY, "-c", stage, str(flag)])
    sup.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            "ready" in (tmp_path / "logs" / f"{n}-0.log").read_text(errors="replace") for n in ("recorder", "stage")):
        time.sleep(0.05)
    sup.stop(grace_s=10)
    assert seen.read_text() == "True"


def test_record_max_bytes_keeps_the_newest_records_within_the_bound(broker: str, fresh_topic, tmp_path: Path) -> None:
    """Issue 28 item 6: the recorder honours record.max_bytes (the oldest records dropped first)."""
    topic = fresh_topic(1)
    producer = make_producer(broker, KafkaConfig())
    try:
        for i in range(60):
            producer.send(topic, bytes([i]) * 2048, partition=0).get(timeout=10)
    finally:
        producer.close(timeout=10)
    stats = Recorder(broker, None, [topic], tmp_path, max_bytes=40_000).run()
    assert stats.records[topic] == 60, "every record was recorded before the oldest were dropped"
    assert partition_path(tmp_path, topic, 0).stat().st_size <= 40_000
    frames = _frames(tmp_path, topic)[0]
    offsets = [f.offset for f in frames]
    assert offsets[-1] == 59 and offsets == list(range(offsets[0], 60)), offsets
    assert 12 <= len(frames) < 20, len(frames)  # 3/4 to all of 40 KB of ~2.1 KB frames
    assert all(f.value == bytes([f.offset]) * 2048 for f in frames)
