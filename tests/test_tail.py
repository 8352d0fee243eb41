"""`expstream topics tail TOPIC` against the session's real broker: good, garbage and tombstone records."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest

from expstream.cli import main
from expstream.kafka.clients import make_producer, send_and_confirm
from expstream.kafka.letters import encode_headers
from expstream.tools.tail import tail
from schemas.codec import encode
from schemas.messages import PromptBatch

pytestmark = pytest.mark.integration

GARBAGE = b"\xc1not msgpack at all"


def prompt_record(batch_id: str, n: int = 2) -> bytes:
    return encode(PromptBatch(batch_id=batch_id, prompt_id=[f"{batch_id}-{i}" for i in range(n)],
                              prompt=["hi"] * n, label=[""] * n, reference=[""] * n))


@pytest.fixture
def mixed_topic(broker, fresh_topic):
    """One partition: a good PromptBatch, garbage bytes, a tombstone, a dead letter with headers."""
    topic = fresh_topic(1)
    producer = make_producer(broker)
    try:
        send_and_confirm(producer, topic, prompt_record("p000001", 3), key=b"p000001")
        send_and_confirm(producer, topic, GARBAGE, key=None)
        producer.send(topic, value=None, key=b"gone")  # a tombstone (send_and_confirm wants bytes)
        producer.flush()
        send_and_confirm(producer, topic, GARBAGE, key=b"p000002",
                         headers=encode_headers(stage="generate", error_class="DecodeError",
                                                original_topic="prompts", original_offset=7))
    finally:
        producer.close()
    return topic


def test_tail_prints_one_line_per_record(broker, mixed_topic, capsys):
    assert main(["topics", "tail", mixed_topic, "--bootstrap-servers", broker, "--from-beginning"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4, lines
    assert lines[0] == (f"{mixed_topic}[0]@0 key=p000001 batch_id=p000001 schema=expstream.PromptBatch v1 "
                        f"prompts=3 size={len(prompt_record('p000001', 3))}")
    assert re.fullmatch(rf"{re.escape(mixed_topic)}\[0\]@1 key=- undecodable \({len(GARBAGE)} bytes\): "
                        r"DecodeError: .*", lines[1]), lines[1]
    assert lines[2] == f"{mixed_topic}[0]@2 key=gone tombstone (no value)"
    assert lines[3].startswith(f"{mixed_topic}[0]@3 key=p000002 undecodable ({len(GARBAGE)} bytes)")
    assert lines[3].endswith("headers: stage=generate error_class=DecodeError original_topic=prompts "
                             "original_offset=7"), lines[3]


def test_tail_json_summarises_tensors(broker, mixed_topic, capsys):
    assert main(["topics", "tail", mixed_topic, "--bootstrap-servers", broker, "--from-beginning",
                 "--json", "--max", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["offset"] for r in rows] == [0, 1, 2]  # --max 3
    assert rows[0]["message"]["schema"] == "expstream.PromptBatch"
    assert rows[0]["message"]["prompt_id"] == ["p000001-0", "p000001-1", "p000001-2"]
    assert rows[1]["error"].startswith("DecodeError") and rows[1]["size"] == len(GARBAGE)
    assert rows[2] == {"topic": mixed_topic, "partition": 0, "offset": 2, "key": "gone", "size": None,
                       "tombstone": True}


def test_json_tensor_summary_has_no_data():
    from types import SimpleNamespace

    import numpy as np

    from expstream.tools.tail import record_json
    from schemas.messages import SampleBatch
    from schemas.tensors import Ragged

    b = SampleBatch(batch_id="b", policy_version=0, n_samples_per_prompt=1, eos_token_id=2, pad_token_id=0,
                    prompt_id=["a"], group_id=["a"], sample_index=[0], prompt=["p"], label=[""],
                    reference=[""], response=["r"],
                    prompt_ids=Ragged.from_rows([np.array([5, 6], np.int32)], "int32"),
                    response_ids=Ragged.from_rows([np.array([7, 8, 2], np.int32)], "int32"),
                    rewards=np.array([0.5], np.float32))
    rec = SimpleNamespace(topic="t", partition=0, offset=0, key=None, value=encode(b), headers=[])
    msg = record_json(rec)["message"]
    assert msg["response_ids"] == {"dtype": "int32", "rows": 1, "values": 3}
    assert msg["rewards"] == {"dtype": "float32", "shape": [1]}


def test_tail_default_shows_the_last_records(broker, fresh_topic, capsys):
    topic = fresh_topic(1)
    producer = make_producer(broker)
    try:
        for i in range(13):
            send_and_confirm(producer, topic, prompt_record(f"p{i:06d}", 1), key=f"p{i:06d}".encode())
    finally:
        producer.close()
    assert main(["topics", "tail", topic, "--bootstrap-servers", broker]) == 0
    offsets = [int(re.search(r"@(\d+) ", line).group(1)) for line in capsys.readouterr().out.splitlines()]
    assert offsets == list(range(3, 13))  # DEFAULT_LAST_N = 10


def test_tail_follow_prints_new_records(broker, fresh_topic):
    topic = fresh_topic(1)
    out = io.StringIO()
    done: list[int] = []
    reader = threading.Thread(target=lambda: done.append(
        tail(broker, None, topic, follow=True, max_records=2, out=out)), daemon=True)
    reader.start()
    producer = make_producer(broker)
    try:
        for i in range(2):
            send_and_confirm(producer, topic, prompt_record(f"p{i:06d}", 1), key=b"k")
    finally:
        producer.close()
    reader.join(timeout=30)  # a follow that never sees the records would hang here
    assert done == [2]
    assert [line.split(" ")[0] for line in out.getvalue().splitlines()] == [f"{topic}[0]@0", f"{topic}[0]@1"]


def test_tail_errors_exit_2(broker, capsys):
    assert main(["topics", "tail", "--bootstrap-servers", broker]) == 2
    assert "TOPIC" in capsys.readouterr().err
    assert main(["topics", "tail", "no-such-topic-xyz", "--bootstrap-servers", broker]) == 2
    err = capsys.readouterr().err
    assert "no-such-topic-xyz" in err and "not found" in err


def test_tail_escapes_control_characters(broker, fresh_topic, capsys):
    topic = fresh_topic(1)
    producer = make_producer(broker)
    try:
        send_and_confirm(producer, topic, GARBAGE, key=b"k\x1b[2J",
                         headers=[("stage", b"\x1b]0;owned\x07"), ("error_message", "\x9b6n \u202eexe".encode())])
    finally:
        producer.close()
    assert main(["topics", "tail", topic, "--bootstrap-servers", broker, "--from-beginning"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\u202e"), repr(out)
    assert "key=k\\x1b[2J" in out and "stage=\\x1b]0;owned\\x07" in out and "error_message=\\x9b6n \\u202eexe" in out
