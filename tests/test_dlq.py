"""`expstream dlq inspect|redrive` end to end: a stage runner dead-letters records, inspect shows them,
redrive sends them back (and they fail again), the attempt cap stops the loop, a second redrive
sends nothing twice."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from expstream.cli import main
from expstream.config.topology import load_topology
from expstream.errors import PoisonRecordError
from expstream.kafka.clients import make_producer, read_topic
from expstream.kafka.topics import create_topics
from expstream.tools.dlq import REDRIVE_GROUP
from schemas import PromptBatch, decode, encode
from stages.context import make_context
from stages.runner import StageRunner

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
JUNK = b"\xc1 not msgpack"


def prompts(batch_id: str, texts: list[str]) -> bytes:
    return encode(PromptBatch(batch_id=batch_id, prompt_id=[f"{batch_id}-{i}" for i in range(len(texts))],
                              prompt=texts, label=[""] * len(texts), reference=[""] * len(texts)))


def process(batch, ctx):
    if any(p == "bad" for p in batch.prompt):
        raise PoisonRecordError(f"PromptBatch.prompt: 'bad' in {batch.batch_id}\nsecond line")
    return []


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def dead_letters(broker, tmp_path):
    """A runner over a fresh topic that got 5 records, 3 of them bad; yields names and the runner."""
    src, dst = f"in-{uuid.uuid4().hex[:10]}", f"out-{uuid.uuid4().hex[:10]}"
    create_topics(broker, {src: 1, dst: 1}, with_dlq=True)
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump({"stages": {"generate": {"output": src}, "shard-preprocess": {"output": dst}}}))
    topo = load_topology(topo_path)
    runner = StageRunner(make_context(topo, "shard-preprocess", run_id=f"d{uuid.uuid4().hex[:6]}"), process, broker)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    producer = make_producer(broker)
    values = [prompts("good-0", ["ok"]), prompts("bad-a", ["bad"]), JUNK, prompts("mixed", ["ok", "bad"]),
              prompts("good-1", ["ok"])]
    for v in values:
        producer.send(src, value=v, headers=[("trace", b"t-1")])
    producer.flush()
    producer.close()
    wait_for(lambda: runner.handled == 5, 60, "5 records handled")
    try:
        yield {"src": src, "dlq": f"{src}.dlq", "topology": str(topo_path), "runner": runner, "topo": topo}
    finally:
        runner.stop_requested = True
        thread.join(30)


def cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(args))
    return rc, capsys.readouterr().out


def test_inspect_shows_each_letter(broker, dead_letters, capsys):
    dlq = dead_letters["dlq"]
    # through the real console entry once
    proc = subprocess.run([sys.executable, "-m", "expstream", "dlq", "inspect", "--bootstrap-servers", broker,
                           "--topic", dlq], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{dlq}: 3 dead letter(s)" in out
    src = dead_letters["src"]
    assert f"stage=shard-preprocess  PoisonRecordError  from {src}[0]@1  batch=bad-a" in out
    assert f"DecodeError  from {src}[0]@2  batch=None" in out
    assert f"from {src}[0]@3  batch=mixed~1-2" in out and "split_from=mixed samples=mixed-1" in out
    assert "PromptBatch.prompt: 'bad' in bad-a" in out and "second line" not in out  # first line only

    rc, out = cli(capsys, "dlq", "inspect", "--bootstrap-servers", broker, "--topic", dlq, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and len(rows) == 3
    by_batch = {r["batch_id"]: r for r in rows}
    assert by_batch["bad-a"]["error_class"] == "PoisonRecordError"
    assert by_batch["bad-a"]["original"] == f"{src}[0]@1" and by_batch["bad-a"]["size"] == len(prompts("bad-a", ["bad"]))
    assert by_batch[None]["error_class"] == "DecodeError" and by_batch[None]["size"] == len(JUNK)
    assert by_batch["mixed~1-2"]["split_from"] == "mixed" and by_batch["mixed~1-2"]["original_size"] == len(
        prompts("mixed", ["ok", "bad"]))
    assert all(r["stage"] == "shard-preprocess" and r["redrive_attempt"] == 0 for r in rows)

    rc, out = cli(capsys, "dlq", "inspect", "--bootstrap-servers", broker, "--topic", dlq, "--json", "--limit", "2")
    assert rc == 0 and len(out.splitlines()) == 2

    rc, out = cli(capsys, "dlq", "inspect", "--bootstrap-servers", broker, "--all", "--topology",
                  dead_letters["topology"])
    assert rc == 0 and f"{dlq}: 3 dead letter(s)" in out


def test_redrive_republishes_caps_attempts_and_never_sends_twice(broker, dead_letters, capsys):
    dlq, src, runner = dead_letters["dlq"], dead_letters["src"], dead_letters["runner"]
    args = ["dlq", "redrive", "--bootstrap-servers", broker, "--topic", dlq, "--max-attempts", "1",
            "--topology", dead_letters["topology"]]  # redrive only sends to topics of the topology

    rc, out = cli(capsys, *args, "--dry-run")
    assert rc == 0 and "would redrive 3" in out
    rc, out = cli(capsys, *args)  # the dry run committed nothing: all 3 go
    assert rc == 0 and f"{dlq}: redrove 3, skipped 0" in out, out

    # back on the input topic: the letters' values, the original headers, redrive_attempt=1
    redriven = [r for r in read_topic(broker, None, src) if r.offset >= 5]
    assert len(redriven) == 3
    letters = list(read_topic(broker, None, dlq))[:3]
    assert [r.value for r in redriven] == [r.value for r in letters]
    assert {r.value for r in redriven} >= {JUNK, prompts("bad-a", ["bad"])}
    for r in redriven:
        assert dict(r.headers) == {"trace": b"t-1", "redrive_attempt": b"1"}

    # they fail again; the new letters carry redrive_attempt=1
    wait_for(lambda: runner.handled == 8, 60, "the redriven records handled")
    wait_for(lambda: len(list(read_topic(broker, None, dlq))) == 6, 30, "3 new dead letters")
    again = list(read_topic(broker, None, dlq))[3:]
    assert all(dict(r.headers)["redrive_attempt"] == b"1" for r in again)
    assert all([k for k, _ in r.headers].count("stage") == 1 for r in again), "headers replaced, not duplicated"
    assert decode(again[2].value).batch_id == "mixed~1-2"  # a 1-row letter fails whole the second time

    rc, out = cli(capsys, *args)  # at the cap: skipped and reported, nothing sent
    assert rc == 0 and "redrove 0, skipped 3 at max attempts" in out, out
    assert out.count("skipped (max attempts):") == 3 and "already redriven 1 time(s)" in out
    rc, out = cli(capsys, *args)  # everything was handled before: nothing again
    assert rc == 0 and "redrove 0, skipped 0" in out, out
    assert len([r for r in read_topic(broker, None, src) if r.offset >= 5]) == 3, "nothing re-sent"
    assert REDRIVE_GROUP.format(topic=dlq) == f"expstream.dlq-redrive.{dlq}"


def test_redrive_refuses_a_topic_that_is_not_a_dlq(broker, capsys):
    rc = main(["dlq", "redrive", "--bootstrap-servers", broker, "--topic", "prompts"])
    assert rc == 2 and "--topic" in capsys.readouterr().err


def test_redrive_publishes_only_to_the_letters_own_topology_topic(broker, tmp_path, capsys):
    """Letter headers can be forged by anyone who can write to a .dlq topic: redrive sends a letter of
    T.dlq back to T only (a topology topic), or where --to says; anything else is refused and reported."""
    src, dst, outside = (f"{p}-{uuid.uuid4().hex[:10]}" for p in ("in", "out", "outside"))
    create_topics(broker, {src: 1, dst: 1, outside: 1}, with_dlq=True)
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump({"stages": {"generate": {"output": src}, "shard-preprocess": {"output": dst}}}))
    dlq = f"{src}.dlq"

    def forge(*letters: tuple[bytes, str]) -> None:
        producer = make_producer(broker)
        for value, original_topic in letters:
            producer.send(dlq, value=value, headers=[("original_topic", original_topic.encode()),
                                                      ("error_class", b"DecodeError"), ("trace", b"t")])
        producer.flush()
        producer.close()

    forge((b"genuine", src), (b"to-outside", outside), (b"to-another-topology-topic", dst))
    base = ["dlq", "redrive", "--bootstrap-servers", broker, "--topic", dlq, "--topology", str(topo_path)]

    rc, out = cli(capsys, *base, "--dry-run")
    assert rc == 1 and "would redrive 1, skipped 0 at max attempts, 0 not redrivable, 1 refused" in out, out
    # bad option combinations are refused before anything is read
    assert main([*base, "--to", outside]) == 2 and "--to" in capsys.readouterr().err
    assert main([*base, "--allow-any-topic"]) == 2 and "--allow-any-topic" in capsys.readouterr().err
    assert main([*base, "--to", "no-such-topic", "--allow-any-topic"]) == 2 and "does not exist" in (
        capsys.readouterr().err)

    # a refused letter stops its partition: the one after it waits (it would be refused too)
    rc, out = cli(capsys, *base)
    assert rc == 1, out
    assert "redrove 1, skipped 0 at max attempts, 0 not redrivable, 1 refused" in out, out
    refused = [line for line in out.splitlines() if line.startswith("  refused:")]
    assert len(refused) == 1 and f"{dlq}[0]@1" in refused[0] and f"names {outside!r}" in refused[0], refused
    assert f"waiting: {dlq}[0]: stopped at the refused letter @1; 1 letter(s) after it wait" in out, out
    rc, out = cli(capsys, *base, "--skip-refused")  # leave them behind: both refused, both committed
    assert rc == 1 and "redrove 0, skipped 0 at max attempts, 0 not redrivable, 2 refused" in out, out
    assert f"names {dst!r}" in out and "waiting" not in out
    assert list(read_topic(broker, None, outside, timeout_s=5)) == [], "a forged header redirected a record"
    assert list(read_topic(broker, None, dst, timeout_s=5)) == [], "a forged header redirected a record"
    assert [r.value for r in read_topic(broker, None, src)] == [b"genuine"]

    # --to: the operator names the target (a topology topic; outside it only with --allow-any-topic)
    forge((b"again", outside))
    rc, out = cli(capsys, *base, "--to", src)
    assert rc == 0 and "redrove 1," in out and f"-> {src} " in out, out
    forge((b"elsewhere", src))
    rc, out = cli(capsys, *base, "--to", outside, "--allow-any-topic")
    assert rc == 0 and "redrove 1," in out, out
    assert [r.value for r in read_topic(broker, None, src)] == [b"genuine", b"again"]
    assert [r.value for r in read_topic(broker, None, outside)] == [b"elsewhere"]


def test_refused_letters_stay_reachable_for_the_redrive_the_report_advises(broker, tmp_path, capsys):
    """Issue 21 item 8: redrive committed the letters it refused, so `--to TOPIC`, which its message advises,
    never saw them. Now a refused letter stops its partition uncommitted; other partitions go on."""
    src, dst = (f"{p}-{uuid.uuid4().hex[:10]}" for p in ("in", "out"))
    create_topics(broker, {src: 1, dst: 1}, with_dlq=False)
    dlq = f"{src}.dlq"
    create_topics(broker, {dlq: 2}, with_dlq=False)
    topo_path = tmp_path / "topology.yaml"
    topo_path.write_text(yaml.safe_dump({"stages": {"generate": {"output": src}, "shard-preprocess": {"output": dst}}}))
    producer = make_producer(broker)
    for p, value, target in ((0, b"genuine-0", src), (0, b"forged", dst), (0, b"genuine-2", src),
                             (1, b"other-partition", src)):
        producer.send(dlq, value=value, partition=p, headers=[("original_topic", target.encode()),
                                                              ("error_class", b"DecodeError")])
    producer.flush()
    producer.close()
    base = ["dlq", "redrive", "--bootstrap-servers", broker, "--topic", dlq, "--topology", str(topo_path)]

    rc, out = cli(capsys, *base)
    assert rc == 1 and "redrove 2," in out and "1 refused" in out, out  # partition 1 went on
    assert sorted(r.value for r in read_topic(broker, None, src)) == [b"genuine-0", b"other-partition"]
    rc, out = cli(capsys, *base)  # the refused letter is still there: refused again, nothing sent twice
    assert rc == 1 and "redrove 0," in out and f"refused: {dlq}[0]@1" in out, out
    rc, out = cli(capsys, *base, "--to", src)  # what the message advises: it sees the refused letter
    assert rc == 0 and "redrove 2," in out, out  # was: "redrove 0" (the refused letter had been committed)
    assert sorted(r.value for r in read_topic(broker, None, src)) == [b"forged", b"genuine-0", b"genuine-2",
                                                                     b"other-partition"]
    rc, out = cli(capsys, *base)
    assert rc == 0 and "redrove 0, skipped 0 at max attempts, 0 not redrivable, 0 refused" in out, out
    assert list(read_topic(broker, None, dst, timeout_s=5)) == []


def test_inspect_escapes_control_characters_from_headers(broker, tmp_path, capsys):
    topic = f"in-{uuid.uuid4().hex[:10]}"
    create_topics(broker, {topic: 1}, with_dlq=True)
    producer = make_producer(broker)
    producer.send(f"{topic}.dlq", value=b"x", headers=[
        ("stage", b"\x1b]0;pwned\x07gen"), ("error_class", b"E\x1b[2J"),
        ("error_message", "boom \x1b[31mred\x9b6n \u202egnp.exe".encode()), ("batch_id", b"b\x00\x7f")])
    producer.flush()
    producer.close()
    rc, out = cli(capsys, "dlq", "inspect", "--bootstrap-servers", broker, "--topic", f"{topic}.dlq")
    assert rc == 0
    for raw in ("\x1b", "\x07", "\x00", "\x7f", "\x9b", "\u202e"):
        assert raw not in out, repr(raw)  # was: printed raw (the terminal cleared, retitled, recoloured)
    assert "stage=\\x1b]0;pwned\\x07gen" in out and "E\\x1b[2J" in out and "batch=b\\x00\\x7f" in out
    assert "boom \\x1b[31mred\\x9b6n \\u202egnp.exe" in out
    rc, out = cli(capsys, "dlq", "inspect", "--bootstrap-servers", broker, "--topic", f"{topic}.dlq", "--json")
    assert json.loads(out)["stage"] == "\x1b]0;pwned\x07gen" and "\x1b" not in out  # JSON escapes them itself
