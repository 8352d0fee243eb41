"""Images through the pipeline (issue 13): claim check, prompt inputs, wire v3, model stages, bad input."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from PIL import Image

from expstream.errors import ConfigError, PoisonRecordError
from expstream.launch.prompts import prompt_batches, read_prompts, store_media
from expstream.models.blobs import DirectoryBlobStore, MissingBlobError, blob_ref
from expstream.models.media import BadImageError, MediaPolicy, item_bytes, load_image
from schemas import PromptBatch, Ragged, SampleBatch, decode, encode
from schemas.errors import ValidationError, VersionError
from tests.vlstages import png, vl_stage_contexts

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


# -- the blob store --------------------------------------------------------------------------------
def test_blob_store_is_content_addressed_and_verifies_what_it_reads(tmp_path):
    store = DirectoryBlobStore(tmp_path / "blobs")
    data = png()
    ref = store.put(data)
    assert ref == "sha256:" + __import__("hashlib").sha256(data).hexdigest() == blob_ref(data)
    assert store.put(data) == ref and len(list((tmp_path / "blobs").rglob("*"))) == 2  # one dir, one file
    assert store.get(ref) == data and store.exists(ref)
    missing = blob_ref(b"never stored")
    with pytest.raises(MissingBlobError, match="not in"):
        store.get(missing)
    store.path(ref).write_bytes(data[:-3])  # corrupted on disk
    with pytest.raises(MissingBlobError, match="corrupt"):
        store.get(ref)
    with pytest.raises(MissingBlobError, match="not a blob reference"):
        store.get("sha256:../../etc/passwd")
    assert issubclass(MissingBlobError, PoisonRecordError)  # a sample's problem, never the run's


# -- prompt inputs ---------------------------------------------------------------------------------
def test_every_image_input_form_gives_the_file_bytes(tmp_path):
    data = png()
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    policy = MediaPolicy(base_dir=tmp_path, root=tmp_path)
    assert item_bytes("a.png", "x", policy) == data
    assert item_bytes(str(tmp_path / "a.png"), "x", policy) == data
    assert item_bytes(f"data:image/png;base64,{b64}", "x") == data
    assert item_bytes(b64, "x") == data
    assert item_bytes(data, "x") == data
    pil = item_bytes(Image.new("RGB", (20, 10), (1, 2, 3)), "x")
    assert Image.open(io.BytesIO(pil)).size == (20, 10)


def test_urls_and_missing_files_are_refused_with_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hi", "images": ["https://example.com/cat.png"]}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: images\[0\].*URL.*does not fetch") as e:
        read_prompts(p)
    assert "local path" in str(e.value)
    p.write_text(json.dumps({"prompt": "hi", "images": ["nowhere/cat.png"]}) + "\n")
    with pytest.raises(ConfigError, match="no file"):
        read_prompts(p)
    p.write_text(json.dumps({"prompt": "hi", "images": "cat.png"}) + "\n")
    with pytest.raises(ConfigError, match="must be a list"):
        read_prompts(p)


@pytest.mark.parametrize("data, why", [(b"", "zero bytes"), (png()[:60], "not a readable image"),
                                       (b"GIF89a garbage", "not a readable image")])
def test_unreadable_images_are_poison_with_the_reason(data, why):
    with pytest.raises(BadImageError, match=why):
        load_image(data, "sample q#0 image 0")


def test_prompt_file_images_travel_by_reference_and_text_only_records_stay_v1(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "i", "prompt": "what?", "images": ["a.png", "a.png"]}) + "\n"
                 + json.dumps({"id": "t", "prompt": "2+2?"}) + "\n")
    rows = read_prompts(p)
    with pytest.raises(ValueError, match="store_media"):
        list(prompt_batches(rows, 2))
    store = DirectoryBlobStore(tmp_path / "blobs")
    assert store_media(rows, store) == 2
    (batch,) = prompt_batches(rows, 2)
    assert batch.images == [[blob_ref(png())] * 2, []]
    raw = encode(batch)
    assert msgpack.unpackb(raw)["version"] == 2 and len(raw) < 400  # references, not pixels
    assert decode(raw) == batch
    (text_only,) = prompt_batches(rows[1:], 2)
    assert msgpack.unpackb(encode(text_only))["version"] == 1  # byte-compatible with older readers
    old = {**msgpack.unpackb(raw), "version": 1}
    with pytest.raises(ValidationError, match="unknown field 'images'"):
        decode(msgpack.packb(old))


def _sample(images, grid) -> SampleBatch:
    B = len(images)
    return SampleBatch(batch_id="b", policy_version=0, n_samples_per_prompt=1, eos_token_id=3, pad_token_id=4,
                       prompt_id=[f"q{i}" for i in range(B)], group_id=[f"q{i}" for i in range(B)],
                       sample_index=[0] * B, prompt=["p"] * B, label=[""] * B, reference=[""] * B,
                       response=["r"] * B, images=images,
                       image_grid_thw=None if grid is None else Ragged.from_rows(
                           [np.asarray(g, np.int32) for g in grid], "int32"))


def test_sample_batch_v3_fields_validate_select_and_concat():
    ref = blob_ref(b"x")
    img = _sample([[ref], []], [[1, 4, 4], []])
    raw = encode(img)
    assert msgpack.unpackb(raw)["version"] == 3 and decode(raw) == img
    with pytest.raises(ValidationError, match="image_grid_thw.*2 grid entries for 1 images"):
        _sample([[ref]], [[1, 4]])
    with pytest.raises(ValidationError, match="not a blob reference"):
        _sample([["cat.png"]], None)
    text = _sample([[], []], None).replace(images=[])
    joined = SampleBatch.concat([img, text], "j")
    assert joined.images == [[ref], [], [], []]
    assert joined.image_grid_thw.row(0).tolist() == [1, 4, 4] and joined.image_grid_thw.lengths.tolist() == [3, 0, 0, 0]
    assert joined.select([0]).images == [[ref]]
    # an older reader (SampleBatch 1-2) refuses the new version with a clear message
    from schemas import codec

    saved = codec.READ_VERSIONS["expstream.SampleBatch"]
    codec.READ_VERSIONS["expstream.SampleBatch"] = (1, 2)
    try:
        with pytest.raises(VersionError, match="version 3 is not supported by this reader"):
            decode(raw)
    finally:
        codec.READ_VERSIONS["expstream.SampleBatch"] = saved


# -- the model stages ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl(tmp_path_factory, model_cache):
    """Stage contexts over the tiny VL model, sharing one MemoryState and one blob store."""
    return vl_stage_contexts(tmp_path_factory.mktemp("vl"),
                             ["models.reward=null", "models.reward_fn=tests.rewardfns:image_count_and_width"],
                             ("generate", "shard-preprocess", "actor-logprob", "reference", "reward"), model_cache)


def _through(vl, batch: PromptBatch) -> SampleBatch:
    from stages import STAGES

    _, _, ctxs = vl
    (out,) = STAGES["generate"].process(batch, ctxs["generate"])
    outs = STAGES["shard-preprocess"].process(out, ctxs["shard-preprocess"])
    outs = [o2 for o in outs for o2 in STAGES["actor-logprob"].process(o, ctxs["actor-logprob"])]
    outs = [o2 for o in outs for o2 in STAGES["reward"].process(o, ctxs["reward"])]
    return SampleBatch.concat(outs, "all")


def test_image_log_probs_equal_a_direct_model_forward(vl):
    """Mixed text / one-image / two-image prompts in one micro-batch: the actor stage's log-probs of
    every sample equal an unpadded forward of that sample alone, pixels from the original bytes."""
    from expstream.models.hf import load_causal_lm
    from expstream.models.resolve import model_dir
    from expstream.models.vl import image_processor

    topo, store, ctxs = vl
    a, b = png((64, 64), (250, 0, 0)), png((100, 70), (0, 0, 250))
    ra, rb = store.put(a), store.put(b)
    batch = PromptBatch(batch_id="p0", prompt_id=["t", "one", "two"], prompt=["2+2?", "colour?", "which?"],
                        label=[""] * 3, reference=[""] * 3, images=[[], [ra], [ra, rb]])
    got = _through(vl, batch)
    assert got.sample_ids() == ["t#0", "t#1", "one#0", "one#1", "two#0", "two#1"]
    assert got.images == [[], [], [ra], [ra], [ra, rb], [ra, rb]]
    assert got.image_grid_thw.row(4).tolist() == [1, 4, 4, 1, 4, 8]  # the processor's grids, 4 and 8 tokens
    model = load_causal_lm(model_dir(topo, "actor"))
    proc = image_processor(model_dir(topo, "actor"))
    raw = {ra: a, rb: b}
    image_id, video_id = ctxs["generate"].models["tokenizer"].convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    for i in range(len(got)):
        # the repair: image pads the model sampled into its response are pad tokens in the model input
        ids = got.prompt_ids.row(i).tolist() + [got.pad_token_id if t in (image_id, video_id) else t
                                                 for t in got.action_ids.row(i).tolist()]
        kw = {}
        if got.images[i]:
            enc = proc(images=[Image.open(io.BytesIO(raw[r])).convert("RGB") for r in got.images[i]],
                       return_tensors="pt")
            kw = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
        x = torch.tensor([ids])
        target = torch.tensor(got.action_ids.row(i).tolist())
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x),
                           mm_token_type_ids=(x == image_id).long(), **kw).logits[0].float()
        a_n = len(got.action_ids.row(i))
        want = torch.log_softmax(logits[-a_n - 1:-1], -1).gather(-1, target[:, None])[:, 0]
        assert np.abs(got.action_log_probs.row(i) - want.numpy()).max() <= TOL, got.sample_ids()[i]
    # the reward function got PIL images: count + width/1000 of the first
    assert got.rewards.tolist() == pytest.approx([0.0, 0.0, 1.064, 1.064, 2.064, 2.064], abs=1e-6)
    # algo.packing_samples: the packed micro-batches give the same log-probs (the VL forward runs padded)
    from stages import STAGES
    from stages.context import make_context

    packed_topo = dataclasses_replace_topo(topo)
    packed_topo.algo = __import__("dataclasses").replace(topo.algo, packing_samples=True)
    shard = make_context(packed_topo, "shard-preprocess", state=ctxs["generate"].state)
    (gen_out,) = STAGES["generate"].process(batch, ctxs["generate"])  # the same record: the same samples
    parts = STAGES["shard-preprocess"].process(gen_out, shard)
    assert {p.layout for p in parts} == {"packed"}
    packed = SampleBatch.concat([o for p in parts for o in STAGES["actor-logprob"].process(p, ctxs["actor-logprob"])],
                                "packed")
    assert packed.sample_ids() == got.sample_ids()
    assert np.array_equal(packed.action_ids.values, got.action_ids.values)
    assert np.abs(packed.action_log_probs.values - got.action_log_probs.values).max() <= TOL


def test_stray_vision_tokens_in_a_response_are_repaired_and_cut_image_tokens_are_poison(vl):
    from stages import STAGES

    topo, store, ctxs = vl
    ref = store.put(png())
    batch = PromptBatch(batch_id="p1", prompt_id=["s"], prompt=["look"], label=[""], reference=[""], images=[[ref]])
    (out,) = STAGES["generate"].process(batch, ctxs["generate"])
    (cut,) = STAGES["shard-preprocess"].process(out, ctxs["shard-preprocess"])
    vision = ctxs["actor-logprob"].models["vision"]
    rows = [np.concatenate([[vision.image_id], r[1:]]).astype(np.int32) for r in cut.action_ids.rows()]
    stray = cut.replace(action_ids=Ragged.from_rows(rows, "int32"))
    before = vision.repaired
    (scored,) = STAGES["actor-logprob"].process(stray, ctxs["actor-logprob"])
    assert vision.repaired - before == 2 and np.isfinite(scored.action_log_probs.values).all()
    short = dataclasses_replace_topo(topo, prompt_max_len=8)
    ctx = ctxs["generate"]
    saved, ctx.topology = ctx.topology, short
    try:
        with pytest.raises(PoisonRecordError, match="cuts them; raise prompt_max_len"):
            STAGES["generate"].process(batch, ctx)
    finally:
        ctx.topology = saved


def test_a_missing_blob_and_an_image_token_count_that_cannot_match_its_grid_are_poison(vl):
    """Both are a sample's problem (PoisonRecordError: the runner bisects the micro-batch and
    dead-letters that sample alone, tests/test_runner*.py), with a reason naming the sample."""
    from stages import STAGES

    _, store, ctxs = vl
    ref = store.put(png((64, 64), (1, 2, 3)))
    batch = PromptBatch(batch_id="p2", prompt_id=["m"], prompt=["see"], label=[""], reference=[""], images=[[ref]])
    (out,) = STAGES["generate"].process(batch, ctxs["generate"])
    (cut,) = STAGES["shard-preprocess"].process(out, ctxs["shard-preprocess"])
    missing = blob_ref(b"never stored in this run")
    gone = cut.replace(images=[[ref], [missing]])
    with pytest.raises(MissingBlobError, match=missing.split(":")[1][:12]):
        STAGES["actor-logprob"].process(gone, ctxs["actor-logprob"])
    assert issubclass(MissingBlobError, PoisonRecordError)
    image_id = ctxs["actor-logprob"].models["vision"].image_id
    rows = cut.prompt_ids.rows()
    first_pad = rows[0].tolist().index(image_id)
    rows[0] = np.delete(rows[0], first_pad).astype(np.int32)  # 3 image tokens left for a 4-token grid
    short = cut.replace(prompt_ids=Ragged.from_rows(rows, "int32"))
    with pytest.raises(PoisonRecordError, match=r"m#0: 3 image tokens in the sequence but its 1 images need 4"):
        STAGES["actor-logprob"].process(short, ctxs["actor-logprob"])
    (fine,) = STAGES["actor-logprob"].process(cut, ctxs["actor-logprob"])  # the untouched batch still goes
    assert np.isfinite(fine.action_log_probs.values).all()


def dataclasses_replace_topo(topo, **generate):
    import copy
    import dataclasses

    new = copy.copy(topo)
    new.generate = dataclasses.replace(topo.generate, **generate)
    return new


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_mixed_text_and_image_prompts_through_expstream_run_with_bad_images_dead_lettered(tmp_path, model_cache):
    from expstream.rl.experience import read_experiences

    (tmp_path / "ok.png").write_bytes(png((80, 60)))
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "cut.png").write_bytes(png()[:70])
    (tmp_path / "fake.png").write_text("root:x:0:0:root:/root:/bin/bash\n")  # a text file renamed .png
    lines = [{"id": "text", "prompt": "2+2?"}, {"id": "one", "prompt": "shape?", "images": ["ok.png"]},
             {"id": "two", "prompt": "which?", "images": ["ok.png", f"data:image/png;base64,{base64.b64encode(png()).decode()}"]},
             {"id": "zero", "prompt": "empty?", "images": ["empty.png"]},
             {"id": "trunc", "prompt": "cut?", "images": ["cut.png"]}, {"id": "text2", "prompt": "hello"},
             {"id": "fake", "prompt": "what?", "images": ["fake.png"]},
             {"id": "video", "prompt": "what moves?", "videos": [["ok.png", "ok.png", "ok.png"]]}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
                          "--no-progress", "--set", "models.actor=builtin:tiny-vl", "--set", "run.prompt_batch_size=4",
                          "--set", "run.max_lost_group_share=0.5", "--set", f"models.cache_dir={model_cache}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_complete"] == 5, summary
    assert sorted(summary["groups_dead_lettered"]) == ["fake", "trunc", "zero"], summary
    reasons = " ".join(str(d) for d in summary["dead_letters"])
    assert "zero bytes" in reasons and "not a readable image" in reasons, summary["dead_letters"]
    assert "p.jsonl:7: images[0]: not a readable image" in reasons and "root:x" not in reasons
    # the feeder refused the three bad images: the blob store holds the good ones only (issue 21)
    ok_ref = blob_ref(png((80, 60)))
    from expstream.models.media import video_manifest

    want = {ok_ref, blob_ref(png()), blob_ref(video_manifest([ok_ref] * 3))}
    assert {f.name for f in (out / "blobs").rglob("*") if f.is_file()} == {r.split(":")[1] for r in want}
    exps = read_experiences(out / "experiences.msgpack")
    by_id = {pid: (e, i) for e in exps for i, pid in enumerate(e.prompt_ids)}
    assert set(by_id) == {"text", "one", "two", "text2", "video"}
    ids = [s for e in exps for s in e.sample_ids]
    assert len(ids) == len(set(ids)) == 20  # every group out once
    e, i = by_id["two"]
    assert len(e.images[i]) == 2 and len(e.image_grid_thw[i]) == 2 and e.image_grid_thw[i][0][0] == 1
    e, i = by_id["text"]
    assert e.images == [] or e.images[i] == []
    e, i = by_id["video"]
    # 3 frames of 80x60 px: padded to 4 frames = t 2; rounded to multiples of 28 px (84x56) = 4x6 patches of 14
    assert len(e.videos[i]) == 1 and e.video_grid_thw[i] == [(2, 4, 6)], (e.videos, e.video_grid_thw)
    assert all(torch.isfinite(e.advantages).all() for e in exps)
    _image_log_probs_equal_a_direct_forward(out, model_cache)
    assert len(list((out / "blobs").rglob("*.*"))) == 0 and any((out / "blobs").rglob("*"))  # the claim check
    # the blobs live in the run directory: a replay of the scoring stages reproduces the experiences,
    # also after the run directory was moved (its topology names the old absolute blob directory)
    out = out.rename(tmp_path / "moved")
    rp = tmp_path / "replay"
    res = subprocess.run([sys.executable, "-m", "expstream", "replay", str(out), "--from", "rollouts", "--stages",
                          "shard-preprocess..advantage", "--output", str(rp)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "expstream", "diff", str(out), str(rp), "--topic", "experiences"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "EQUAL within tolerance" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def _image_log_probs_equal_a_direct_forward(run: Path, cache_dir: Path) -> None:
    """The actor log-probs the run recorded for its image samples equal an unpadded forward of the
    tiny VL actor on the same tokens and the pixels of the stored bytes (the run's own blob store)."""
    from expstream.models.hf import load_causal_lm
    from expstream.models.vl import image_processor
    from expstream.tools.samples import read_samples

    store = DirectoryBlobStore(run / "blobs")
    samples = read_samples(run, "actor").samples
    imaged = [s for s in samples.values() if s.fields.get("images")]
    assert {s.sample_id.split("#")[0] for s in imaged} == {"one", "two"}, sorted(samples)
    from expstream.models.resolve import model_dir
    from expstream.tools.show import load_run_topology

    actor_dir = model_dir(load_run_topology(run), "actor")
    assert str(actor_dir).startswith(str(cache_dir)), actor_dir
    model, proc = load_causal_lm(actor_dir), image_processor(actor_dir)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(actor_dir)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    vision_ids = set(tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"]))
    for s in imaged:
        f = s.fields
        acts = f["action_ids"].tolist()
        ids = f["prompt_ids"].tolist() + [f["pad_token_id"] if t in vision_ids else t for t in acts]
        enc = proc(images=[Image.open(io.BytesIO(store.get(r))).convert("RGB") for r in f["images"]],
                   return_tensors="pt")
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == image_id).long(),
                           pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]).logits[0].float()
        want = torch.log_softmax(logits[-len(acts) - 1:-1], -1).gather(-1, torch.tensor(acts)[:, None])[:, 0]
        assert np.abs(f["action_log_probs"] - want.numpy()).max() <= TOL, s.sample_id


def test_prompt_rows_from_python_take_pil_images_and_a_missing_short_path_is_not_base64(tmp_path):
    """A Python caller's PromptRow may hold PIL images (stored as PNG); "pics/cat" is valid base64
    alphabet but no image, so it is reported as a missing file, not stored as 6 garbage bytes."""
    from expstream.launch.prompts import PromptRow

    store = DirectoryBlobStore(tmp_path / "blobs")
    pil = Image.new("RGB", (30, 20), (9, 8, 7))
    rows = [PromptRow("a", "what?", images=[pil, png()], videos=[[pil, pil]])]
    assert store_media(rows, store) == 3  # references: 2 images and 1 video
    assert Image.open(io.BytesIO(store.get(rows[0].images[0]))).size == (30, 20)
    assert rows[0].images[1] == blob_ref(png())
    frames = json.loads(store.get(rows[0].videos[0]))["frames"]
    assert frames == [rows[0].images[0]] * 2
    with pytest.raises(ConfigError, match="no file 'pics/cat'"):
        item_bytes("pics/cat", "p.jsonl:1: images[0]", MediaPolicy(base_dir=tmp_path, root=tmp_path))


def test_a_video_prompt_goes_through_generate_and_the_actor_like_an_unpadded_forward(vl):
    """A video (3 frames: padded to 4 = 2 temporal patches) beside a text prompt in one micro-batch."""
    from expstream.models.hf import load_causal_lm
    from expstream.models.media import store_video
    from expstream.models.resolve import model_dir

    topo, store, ctxs = vl
    vref = store_video(store, [png((64, 64), (10 * i, 0, 0)) for i in range(3)])
    batch = PromptBatch(batch_id="pv", prompt_id=["txt", "vid"], prompt=["hi", "what moves?"], label=[""] * 2,
                        reference=[""] * 2, videos=[[], [vref]])
    got = _through(vl, batch)
    assert got.videos == [[], [], [vref], [vref]] and got.images == []
    assert got.video_grid_thw.row(2).tolist() == [2, 4, 4]
    vision = ctxs["actor-logprob"].models["vision"]
    assert got.prompt_ids.row(2).tolist().count(vision.video_id) == 2 * 4 * 4 // 4
    model = load_causal_lm(model_dir(topo, "actor"))
    patches, grid = vision.video(vref, "v")
    for i in range(len(got)):
        acts = got.action_ids.row(i).tolist()
        ids = got.prompt_ids.row(i).tolist() + [got.pad_token_id if t in vision.vision_ids else t for t in acts]
        x = torch.tensor([ids])
        kw = {"pixel_values_videos": torch.from_numpy(patches), "video_grid_thw": torch.tensor([grid])} \
            if got.videos[i] else {}
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x),
                           mm_token_type_ids=2 * (x == vision.video_id).long(), **kw).logits[0].float()
        want = torch.log_softmax(logits[-len(acts) - 1:-1], -1).gather(-1, torch.tensor(acts)[:, None])[:, 0]
        assert np.abs(got.action_log_probs.row(i) - want.numpy()).max() <= TOL, got.sample_ids()[i]
