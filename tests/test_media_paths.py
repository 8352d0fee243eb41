"""What a prompt file may read (issue 21 item 2): paths confined to the media root, no special
files, and bytes that are not an image or video never reach the blob store."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from expstream.errors import EXIT_CONFIG, ConfigError
from expstream.kafka.topics import dlq_topic
from expstream.launch.prompts import (
    PromptRow,
    dead_letter_refused,
    feed_prompts,
    prompt_batches,
    read_prompts,
    store_media,
)
from expstream.models.blobs import DirectoryBlobStore, blob_ref
from expstream.models.media import RefusedMediaError, item_bytes
from schemas import PromptBatch, decode

ROOT = Path(__file__).resolve().parents[1]


def png(size=(32, 24), colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def tree(tmp_path):
    """``tmp/secret.txt`` beside ``tmp/data/`` (the prompt file's directory, holding ``ok.png``)."""
    (tmp_path / "secret.txt").write_text("password=hunter2\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.png").write_bytes(png())
    return data


def write_prompts(where: Path, *image_lists) -> Path:
    path = where / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "what?", "images": imgs}) + "\n"
                            for i, imgs in enumerate(image_lists)))
    return path


def blob_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize("case", ["relative escape", "absolute outside", "symlink out", "proc environ",
                                  "proc under a root of /", "fifo", "directory"])
def test_a_path_outside_the_media_root_or_not_a_regular_file_is_refused_before_it_is_read(tree, case):
    root = None
    if case == "relative escape":
        item, why = "../secret.txt", "outside the media root"
    elif case == "absolute outside":
        item, why = "/etc/passwd", "outside the media root"
    elif case == "symlink out":
        os.symlink(tree.parent / "secret.txt", tree / "cat.png")
        item, why = "cat.png", "resolves to .*secret.txt.*outside the media root"
    elif case == "proc environ":
        item, why = "/proc/self/environ", "outside the media root"
    elif case == "proc under a root of /":
        item, why, root = "/proc/self/environ", "pseudo file system /proc", "/"
    elif case == "fifo":
        os.mkfifo(tree / "pipe.png")  # opening it for reading would block forever
        item, why = "pipe.png", "is a fifo .*not a regular file"
    else:
        (tree / "sub.png").mkdir()
        item, why = "sub.png", "is a directory, not a regular file"
    prompts = write_prompts(tree, ["ok.png"], ["ok.png", item])
    with pytest.raises(ConfigError, match=rf"p.jsonl:2: images\[1\]: .*{why}") as err:
        read_prompts(prompts, media_root=root)
    assert err.value.fix and err.value.field == "--prompts"
    assert "hunter2" not in str(err.value)


def test_the_media_root_can_be_named_and_legit_paths_still_work(tree, tmp_path):
    elsewhere = tmp_path / "images"
    elsewhere.mkdir()
    (elsewhere / "far.png").write_bytes(png((40, 30)))
    os.symlink(tree / "ok.png", tree / "inside-link.png")  # a symlink that stays inside is fine
    prompts = write_prompts(tree, ["ok.png", str(tree / "ok.png"), "inside-link.png"], [str(elsewhere / "far.png")])
    with pytest.raises(ConfigError, match="outside the media root"):
        read_prompts(prompts)
    rows = read_prompts(prompts, media_root=tmp_path)
    assert not any(r.refused for r in rows)
    store = DirectoryBlobStore(tmp_path / "blobs")
    assert store_media(rows, store) == 4
    assert rows[0].images == [blob_ref(png())] * 3 and store.get(rows[1].images[0]) == png((40, 30))
    (batch,) = prompt_batches(rows, 2)
    assert batch.images == [[blob_ref(png())] * 3, [blob_ref(png((40, 30)))]]
    with pytest.raises(ConfigError, match="--media-root .* is not a directory"):
        read_prompts(prompts, media_root=tmp_path / "nowhere")


def test_bytes_that_are_not_a_decodable_image_refuse_their_prompt_and_nothing_of_it_is_stored(tree, tmp_path):
    (tree / "text.png").write_text("root:x:0:0:root:/root:/bin/bash\n")  # a text file renamed .png
    (tree / "big.png").write_bytes(png((600, 600), (1, 2, 3)) + b"\0" * 20_000)
    (tree / "empty.png").write_bytes(b"")
    (tree / "cut.png").write_bytes(png()[:60])
    (tree / "clip.mp4").write_text("not a video at all\n")
    prompts = write_prompts(tree, ["ok.png"], ["ok.png", "text.png"], ["big.png"], ["empty.png"], ["cut.png"])
    with open(prompts, "a") as fh:
        fh.write(json.dumps({"id": "vid", "prompt": "moves?", "videos": ["clip.mp4"]}) + "\n")
        fh.write(json.dumps({"id": "frames", "prompt": "moves?", "videos": [["ok.png", "text.png"]]}) + "\n")
    rows = read_prompts(prompts, media_max_mb=20_000 / 2**20)
    why = {r.prompt_id: r.refused for r in rows}
    assert why["q0"] == ""
    assert "p.jsonl:2: images[1]: not a readable image" in why["q1"] and "signature" in why["q1"]
    assert "p.jsonl:3: images[0]" in why["q2"] and "over the limit of 20000 (run.media_max_mb)" in why["q2"]
    assert "zero bytes" in why["q3"] and "not a readable image" in why["q4"]
    assert "videos[0]: not a readable video" in why["vid"] and "videos[0][1]: not a readable image" in why["frames"]
    assert "root:x" not in " ".join(why.values())  # the bytes themselves are never echoed
    store = DirectoryBlobStore(tmp_path / "blobs")
    assert store_media(rows, store) == 1
    assert blob_files(tmp_path / "blobs") == [store.path(blob_ref(png()))]  # only the good prompt's image
    # a refused row carries the references its bytes would have had (none stored), the good image's too
    assert rows[1].images == [blob_ref(png()), blob_ref((tree / "text.png").read_bytes())]
    assert rows[2].images == [blob_ref((tree / "big.png").read_bytes())]
    with pytest.raises(ValueError, match="refused"):
        list(prompt_batches(rows, 2))


def test_media_a_python_caller_puts_in_a_row_are_checked_before_they_are_stored(tmp_path):
    store = DirectoryBlobStore(tmp_path / "blobs")
    rows = [PromptRow("good", "a", images=[png(), Image.new("RGB", (8, 8))]),
            PromptRow("bad", "b", images=[png(), b"#!/bin/sh\necho hi\n"]),
            PromptRow("badframe", "c", videos=[[png(), b"GIF89a garbage"]])]
    assert store_media(rows, store) == 2
    assert rows[1].refused.startswith("prompt bad: images[1]: not a readable image")
    assert "prompt badframe: videos[0][1]: not a readable image" in rows[2].refused
    assert len(blob_files(tmp_path / "blobs")) == 2  # the good row's two images
    with pytest.raises(RefusedMediaError, match="not a readable image"):
        item_bytes(b"GIF89a garbage", "images[0]")
    with pytest.raises(ConfigError, match="paths are read only from a prompt file"):
        item_bytes("/etc/passwd", "images[0]")


def test_store_media_refuses_an_oversize_python_image_without_storing_it(tmp_path):
    store = DirectoryBlobStore(tmp_path / "blobs")
    rows = [PromptRow("x", "y", images=[png()])]
    assert store_media(rows, store, max_bytes=10) == 0
    assert "over the limit of 10" in rows[0].refused and blob_files(tmp_path / "blobs") == []


@pytest.mark.integration
def test_the_feeder_dead_letters_a_refused_prompt_and_feeds_the_others(tree, broker, fresh_topic, kafka_cfg):
    from expstream.kafka.clients import read_topic
    from expstream.launch.collector import ExperienceCollector
    from expstream.tools.dlq import read_letters

    (tree / "text.png").write_text("not an image\n")
    rows = read_prompts(write_prompts(tree, ["ok.png"], ["text.png"], []))
    topic = fresh_topic(1, with_dlq=True)
    col = ExperienceCollector(broker, kafka_cfg, "experiences-unused", 4, dlq_topics=[dlq_topic(topic)])
    col.expect_groups(r.prompt_id for r in rows)
    store_media(rows, DirectoryBlobStore(tree / "blobs"))
    assert feed_prompts(broker, kafka_cfg, topic, rows, batch_size=4) == 1  # one record: q0 and q2
    (fed,) = [decode(r.value) for r in read_topic(broker, kafka_cfg, topic, timeout_s=10)]
    assert fed.prompt_id == ["q0", "q2"]
    (letter,) = read_letters(broker, kafka_cfg, dlq_topic(topic))
    h = letter.headers
    assert h["stage"] == "feeder" and h["error_class"] == "RefusedMediaError" and h["original_topic"] == topic
    assert "p.jsonl:2: images[0]: not a readable image" in h["error_message"] and h["sample_ids"] == "q1"
    batch = decode(letter.value)
    assert isinstance(batch, PromptBatch) and batch.prompt_id == ["q1"]
    assert batch.images == [[blob_ref(b"not an image\n")]]  # the reference, not the bytes
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not col.dead_groups:
            col.poll(300)
    finally:
        col.close()
    assert col.dead_groups == {"q1"} and "not a readable image" in col.lost_group_reasons(finished=True)["q1"]
    # a continuous run dead-letters the refused rows once and feeds the others epoch after epoch
    other = fresh_topic(1, with_dlq=True)
    assert [r.prompt_id for r in dead_letter_refused(broker, kafka_cfg, other, rows)] == ["q0", "q2"]
    assert [x.headers["sample_ids"] for x in read_letters(broker, kafka_cfg, dlq_topic(other))] == ["q1"]


def test_expstream_run_exits_2_on_a_symlink_out_of_the_media_root_and_stores_nothing(tree, tmp_path):
    os.symlink(tree.parent / "secret.txt", tree / "cat.png")
    prompts = write_prompts(tree, ["ok.png"], ["cat.png"])
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
                          "--no-progress"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == EXIT_CONFIG, res.stderr[-2000:]
    assert "p.jsonl:2: images[0]" in res.stderr and "outside the media root" in res.stderr
    assert "--media-root" in res.stderr and "hunter2" not in res.stderr
    assert blob_files(out) == []
