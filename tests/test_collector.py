"""The run's experience collector against a hostile experiences topic (real broker), and the run outcome.

Garbage, tombstones, records of the wrong schema, batches that are not experiences and samples of
groups the run never fed must be counted and kept aside, never raise and never count towards
completion; a run whose losses exceed ``run.max_lost_group_share`` fails with one line; the
outputs are written whatever happened.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
import pytest

from expstream import read_experiences
from expstream.config.topology import load_topology
from expstream.errors import EXIT_FAILED, EXIT_OK, ConfigError
from expstream.kafka.topics import dlq_topic
from expstream.launch.collector import ExperienceCollector
from expstream.launch.outcome import RunOutcome, loss_verdict
from schemas import PromptBatch, SampleBatch, encode
from tests.runners import exp_batch

GARBAGE = b"\x93\xff\x00 not msgpack \xc1"


def prompt_batch(batch_id: str, groups: list[str]) -> PromptBatch:
    return PromptBatch(batch_id=batch_id, prompt_id=groups, prompt=["q"] * len(groups), label=[""] * len(groups),
                       reference=[""] * len(groups))


@pytest.mark.integration
def test_collector_counts_and_keeps_aside_what_is_not_an_experience_of_this_run(broker, fresh_topic, kafka_cfg,
                                                                               tmp_path):
    from expstream.kafka.clients import make_producer

    topic = fresh_topic(1, with_dlq=True)
    mixed = SampleBatch.concat([exp_batch("x", "c", [0, 1, 2, 3]), exp_batch("y", "yy", [0])], "mixed")
    experiences = [  # (value, what the collector must make of it)
        (GARBAGE, "undecodable"),
        (None, "undecodable"),  # a tombstone
        (encode(prompt_batch("p1", ["a"])), "wrong schema"),
        (encode(exp_batch("noadv", "e", [0]).replace(advantages=None, returns=None)), "not an experience"),
        (encode(exp_batch("g/zz", "zz", [0, 1, 2, 3])), "foreign"),
        (encode(exp_batch("g/a", "a", [0, 1, 2, 3])), None),
        (encode(exp_batch("m1", "b", [0, 1])), None),
        (encode(exp_batch("m1", "b", [0, 1])), None),  # at-least-once: a duplicate
        (encode(exp_batch("m2", "b", [2, 3])), None),
        (encode(mixed), None),  # group c is ours, its last row (group yy) is not
    ]
    producer = make_producer(broker, kafka_cfg)
    letter_headers = [("stage", b"reward"), ("error_class", b"TypeError"), ("error_message", b"boom\nsecond line")]
    # before the run: an experience and a dead letter of groups with this run's ids (a previous run)
    producer.send(topic, value=encode(exp_batch("g/a", "a", [0, 1, 2, 3])), key=b"old").get(timeout=30)
    producer.send(dlq_topic(topic), value=encode(prompt_batch("p0", ["c"])), key=b"old", headers=letter_headers).get(30)
    rejected_path = tmp_path / "rejected.msgpack"
    col = ExperienceCollector(broker, kafka_cfg, topic, 4, dlq_topics=[dlq_topic(topic)], rejected_path=rejected_path)
    col.expect_groups(["a", "b", "c", "d", "e"])
    for value, _ in experiences:
        producer.send(topic, value=value, key=b"k").get(timeout=30)
    producer.send(dlq_topic(topic), value=encode(prompt_batch("p2", ["d"])), key=b"d", headers=letter_headers).get(30)
    producer.send(dlq_topic(topic), value=encode(prompt_batch("p3", ["ww"])), key=b"w", headers=letter_headers).get(30)
    producer.send(dlq_topic(topic), value=GARBAGE, key=None, headers=[("stage", b"\xff\xfe")]).get(30)
    producer.close()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (col.rejected_count < 6 or len(col.dead_letters) < 3
                                               or col.complete_groups < 3):
            col.poll(300)  # must never raise
    finally:
        col.close()

    reasons = {r["where"]: r["reason"] for r in col.rejected}
    assert col.rejected_count == 6 and len(reasons) == 6
    assert reasons[f"{topic}[0]@0"].startswith("foreign: 4 samples written before this run started")
    for offset, (_, kind) in enumerate(experiences, start=1):
        if kind is not None:
            assert reasons[f"{topic}[0]@{offset}"].startswith(kind), reasons
    assert col.foreign_samples == 9  # four from before the run, four of group zz, one in the mixed record
    assert col.complete_groups == 3 and col.group_counts == {"a": 4, "b": 4, "c": 4}
    assert col.duplicates == 2
    out = tmp_path / "experiences.msgpack"
    out.write_bytes(b"".join(col.records))
    ids = sorted(s for e in read_experiences(out) for s in e.sample_ids)
    assert ids == sorted(f"{g}#{i}" for g in "abc" for i in range(4)), "foreign samples never reach the file"

    kept = list(msgpack.Unpacker(open(rejected_path, "rb"), raw=False))
    assert [(k["topic"], k["offset"]) for k in kept] == [(topic, o) for o in (0, 1, 2, 3, 4, 5)]
    assert kept[1]["value"] == GARBAGE and kept[2]["value"] is None and kept[1]["key"] == b"k"
    assert kept[3]["value"] == experiences[2][0], "the original bytes are kept"

    assert col.dead_groups == {"d"}, "a dead letter of a group this run did not feed is not a loss of this run"
    assert len(col.dead_letters) == 3 and col.dead_letters_before_run == 1
    assert col.lost_group_reasons(finished=True) == {"d": "dead letter from reward: TypeError: boom"}
    assert col.lost_group_reasons(finished=False) == {"d": "dead letter from reward: TypeError: boom",
                                                      "e": "never completed"}


def test_loss_verdict_is_one_line_naming_groups_and_reasons():
    lost = {f"g{i}": "dead letter from reward: TypeError: f() takes 1 positional argument" for i in range(7)}
    lost["h"] = "never completed"
    line = loss_verdict(lost, 8, 0.0)
    assert line is not None and "\n" not in line
    assert line.startswith("8 of 8 groups lost (over run.max_lost_group_share=0): g0, g1, g2, g3, g4 and 2 more: "
                           "dead letter from reward: TypeError")
    assert "h: never completed" in line
    assert loss_verdict(lost, 8, 1.0) is None
    assert loss_verdict({"g": "x"}, 4, 0.25) is None and loss_verdict({"g": "x"}, 4, 0.2) is not None
    assert loss_verdict({}, 4, 0.0) is None


@pytest.mark.parametrize("bad", [1.5, -0.1])
def test_max_lost_group_share_is_a_share(bad):
    with pytest.raises(ConfigError, match=r"run\.max_lost_group_share"):
        load_topology(None, [f"run.max_lost_group_share={bad}"])
    assert load_topology(None, ["run.max_lost_group_share=1"]).run.max_lost_group_share == 1


def test_outputs_are_written_when_the_run_failed_before_collecting(tmp_path: Path):
    """An exception before the collector existed (broker gone, ...) still leaves both files."""
    topo = load_topology(None, [])
    out = RunOutcome(topo=topo, run_id="r1", out_dir=tmp_path, rows=3, started=time.monotonic())
    assert out.on_exit(RuntimeError, RuntimeError("no broker"), None) is False, "the exception goes on"
    summary = out.summary
    assert out.status == EXIT_FAILED
    assert (tmp_path / "experiences.msgpack").read_bytes() == b""
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary and summary["status"] == "failed" and summary["error"] == "RuntimeError: no broker"
    assert summary["rejected_records"]["count"] == 0 and summary["lost_groups"] == {}
    ok = RunOutcome(topo=topo, run_id="r2", out_dir=tmp_path, rows=3, started=time.monotonic())
    assert ok.write()["status"] == "ok" and ok.status == EXIT_OK
