"""``expstream feed`` (issue 25's follow-up): a prompt file into a running pipeline's input topic, on the
session broker. Epochs never share a batch id or a prompt id; a bad file feeds nothing (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expstream.cli import main
from expstream.kafka.clients import read_topic
from schemas import PromptBatch, decode

pytestmark = pytest.mark.integration

IDS = ["a", "b", "c", "d", "e"]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _feed(broker: str, topic: str, prompts: Path, *extra: str) -> int:
    return main(["feed", "--prompts", str(prompts), "--bootstrap-servers", broker, "--run-id", "feedtest",
                 "--set", f"topics.input={topic}", "--set", "run.prompt_batch_size=2", *extra])


def _records(broker: str, topic: str) -> list[tuple[bytes, PromptBatch]]:
    out = []
    for rec in read_topic(broker, None, topic, timeout_s=60):
        batch = decode(rec.value)
        assert isinstance(batch, PromptBatch)
        out.append((rec.key, batch))
    return out


def test_feed_epochs_never_collide_and_a_bad_file_feeds_nothing(broker, fresh_topic, tmp_path, capsys):
    topic = fresh_topic(with_dlq=True, prefix="feed")
    good = _write(tmp_path / "p.jsonl", [json.dumps({"id": i, "prompt": f"q {i}?", "label": i.upper()}) for i in IDS])

    assert _feed(broker, topic, good) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "fed 5 prompts in 3 records" in line and topic in line and "epoch 0" in line, line
    first = _records(broker, topic)
    assert sorted(b.batch_id for _, b in first) == ["p000000@e0", "p000001@e0", "p000002@e0"]
    assert all(key == b.batch_id.encode() for key, b in first)
    assert [len(b.prompt_id) for _, b in sorted(first, key=lambda kb: kb[1].batch_id)] == [2, 2, 1]
    fed = {p: (q, lab) for _, b in first for p, q, lab in zip(b.prompt_id, b.prompt, b.label, strict=True)}
    assert fed == {f"{i}@e0": (f"q {i}?", i.upper()) for i in IDS}

    assert _feed(broker, topic, good, "--epoch", "1") == 0
    both = _records(broker, topic)
    assert len(both) == 6
    batch_ids = [b.batch_id for _, b in both]
    prompt_ids = [p for _, b in both for p in b.prompt_id]
    assert len(set(batch_ids)) == 6 and len(set(prompt_ids)) == 10, (batch_ids, prompt_ids)
    assert {p for p in prompt_ids if p.endswith("@e1")} == {f"{i}@e1" for i in IDS}

    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), json.dumps({"prompt": "fine too"}),
                                          "{not json"])
    assert _feed(broker, topic, bad, "--epoch", "2") == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: not JSON" in err, err
    assert _feed(broker, topic, good, "--epoch", "-1") == 2
    assert "--epoch" in capsys.readouterr().err
    assert len(_records(broker, topic)) == 6  # nothing of the refused feeds was sent


def test_feed_refuses_a_missing_input_topic(broker, tmp_path, capsys):
    good = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "2+2?"})])
    assert _feed(broker, "no-such-topic-feed", good) == 2
    err = capsys.readouterr().err
    assert "'no-such-topic-feed' does not exist" in err and "expstream topics create" in err, err
