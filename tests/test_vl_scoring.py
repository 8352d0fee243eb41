"""The vision-language critic and reward model (issue 13): a Qwen2-VL backbone plus a linear value head,
fed the pixels by the critic and reward stages (in-process stage contexts, no Kafka)."""

from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from schemas import PromptBatch, SampleBatch
from tests.vlstages import png, vl_stage_contexts

TOL = 1e-5


@pytest.fixture(scope="module")
def vl(tmp_path_factory, model_cache):
    """Stage contexts over the tiny-vl family (VL actor, VL critic, VL reward model), one MemoryState."""
    return vl_stage_contexts(tmp_path_factory.mktemp("vlscore"), ["algo.advantage_estimator=gae"],
                             ("generate", "shard-preprocess", "critic", "reward"), model_cache)


def _cut(vl, batch: PromptBatch) -> SampleBatch:
    """generate + shard-preprocess: the padded micro-batch the critic and the reward stage read."""
    from stages import STAGES

    _, _, ctxs = vl
    (out,) = STAGES["generate"].process(batch, ctxs["generate"])
    return SampleBatch.concat(STAGES["shard-preprocess"].process(out, ctxs["shard-preprocess"]), "cut")


def _direct(vl, cut: SampleBatch, i: int, raw: dict[str, bytes], role: str, pixels: bool = True) -> torch.Tensor:
    """An unpadded forward of sample ``i`` alone through the ``role`` model's backbone + head, on the
    processor's inputs for the original image bytes: the head output (L,) at every position."""
    from expstream.models.resolve import model_dir
    from expstream.models.vl import image_processor, load_critic, load_reward_model

    topo, _, ctxs = vl
    path = model_dir(topo, role)
    model = (load_critic if role == "critic" else load_reward_model)(path)
    tok = ctxs["generate"].models["tokenizer"]
    image_id, video_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    # the image-token repair: vision pads the actor sampled into its response are pads in the model input
    ids = cut.prompt_ids.row(i).tolist() + [cut.pad_token_id if t in (image_id, video_id) else t
                                            for t in cut.action_ids.row(i).tolist()]
    x = torch.tensor([ids])
    kw = {}
    if pixels and cut.images[i]:
        enc = image_processor(path)(images=[Image.open(io.BytesIO(raw[r])).convert("RGB") for r in cut.images[i]],
                                    return_tensors="pt")
        kw = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"],
              "mm_token_type_ids": (x == image_id).long()}
    with torch.no_grad():
        hidden = model.backbone(input_ids=x, attention_mask=torch.ones_like(x), **kw).last_hidden_state
        return model.score(hidden)[0, :, 0].float()


def _image_batch(store) -> tuple[PromptBatch, dict[str, bytes]]:
    a, b = png((64, 64), (250, 0, 0)), png((100, 70), (0, 0, 250))
    ra, rb = store.put(a), store.put(b)
    batch = PromptBatch(batch_id="p0", prompt_id=["t", "one", "two"], prompt=["2+2?", "colour?", "which?"],
                        label=[""] * 3, reference=[""] * 3, images=[[], [ra], [ra, rb]])
    return batch, {ra: a, rb: b}


def test_builtin_tiny_vl_critic_and_reward_are_vision_language_models_and_text_runs_keep_text_ones(vl, monkeypatch):
    from expstream.config.topology import load_topology
    from expstream.models import tiny
    from expstream.models.resolve import model_dir
    from expstream.models.vl import VALUE_HEAD_FILE, VisionValueModel, is_vl_scoring_dir

    topo, _, ctxs = vl
    for role in ("critic", "reward"):
        assert is_vl_scoring_dir(model_dir(topo, role)) and (model_dir(topo, role) / VALUE_HEAD_FILE).is_file()
    assert isinstance(ctxs["critic"].models["critic"], VisionValueModel) and ctxs["critic"].models["vision"]
    source = ctxs["reward"].models["reward_sources"]["model"]
    assert isinstance(source.model, VisionValueModel) and source.model.kind == "reward" and source.vision
    text = load_topology(None, ["models.actor=builtin:tiny", f"models.cache_dir={topo.models.cache_dir}"])
    monkeypatch.setattr(tiny, "build_tiny_models", lambda cache_dir: {"critic": Path("text-critic")})
    assert model_dir(text, "critic") == Path("text-critic")  # the text family, untouched


def test_vl_critic_values_equal_a_direct_forward_and_depend_on_the_pixels(vl):
    from stages import STAGES

    _, store, ctxs = vl
    batch, raw = _image_batch(store)
    cut = _cut(vl, batch)
    (got,) = STAGES["critic"].process(cut, ctxs["critic"])
    for i in range(len(got)):
        a_n = len(got.action_ids.row(i))
        want = _direct(vl, cut, i, raw, "critic")[:-1][-a_n:].numpy()
        assert np.abs(got.values.row(i) - want).max() <= TOL, got.sample_ids()[i]
        if got.images[i]:  # the same tokens without the pixels give other values: the pixels reach the critic
            blind = _direct(vl, cut, i, raw, "critic", pixels=False)[:-1][-a_n:].numpy()
            assert np.abs(got.values.row(i) - blind).max() > 1e-3, got.sample_ids()[i]


def test_vl_reward_model_scores_equal_a_direct_forward_and_depend_on_the_pixels(vl):
    from stages import STAGES

    _, store, ctxs = vl
    batch, raw = _image_batch(store)
    cut = _cut(vl, batch)
    (got,) = STAGES["reward"].process(cut, ctxs["reward"])
    assert ctxs["reward"].models["reward_sources"]["model"].vision is not None
    for i in range(len(got)):
        assert abs(got.rewards[i] - float(_direct(vl, cut, i, raw, "reward")[-1])) <= TOL, got.sample_ids()[i]
        if got.images[i]:  # the same tokens without the pixels score otherwise: the pixels reach the model
            assert abs(got.rewards[i] - float(_direct(vl, cut, i, raw, "reward", pixels=False)[-1])) > 1e-3


def test_mixed_text_and_image_micro_batches_through_critic_and_reward_with_vl_and_text_models(vl, tmp_path):
    """Text, one-image and two-image samples in one micro-batch, padded and packed, through the VL
    critic and reward model; then a text critic / reward model on the same tokenizer (tokens only)."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from expstream.models import hf as M
    from expstream.models import tiny
    from expstream.models.resolve import model_dir
    from stages import STAGES
    from stages.context import make_context

    topo, store, ctxs = vl
    batch, _ = _image_batch(store)
    cut = _cut(vl, batch)
    assert [bool(x) for x in cut.images] == [False, False, True, True, True, True]
    (critic_out,) = STAGES["critic"].process(cut, ctxs["critic"])
    (reward_out,) = STAGES["reward"].process(critic_out, ctxs["reward"])
    assert np.isfinite(reward_out.values.values).all() and np.isfinite(reward_out.rewards).all()
    assert list(reward_out.values.lengths) == list(cut.action_ids.lengths)
    # algo.packing_samples: micro-batches with images run padded through the VL models, the same values
    packed_topo = copy.copy(topo)
    packed_topo.algo = dataclasses.replace(topo.algo, packing_samples=True)
    shard = make_context(packed_topo, "shard-preprocess", state=ctxs["generate"].state)
    (gen,) = STAGES["generate"].process(batch, ctxs["generate"])  # the same record: the same samples
    parts = STAGES["shard-preprocess"].process(gen, shard)
    assert {p.layout for p in parts} == {"packed"}
    packed = SampleBatch.concat([o for p in parts for o in STAGES["critic"].process(p, ctxs["critic"])], "packed")
    assert packed.sample_ids() == critic_out.sample_ids()
    assert np.abs(packed.values.values - critic_out.values.values).max() <= TOL
    # a text-only micro-batch in the packed layout still runs packed through the VL models
    (gen,) = STAGES["generate"].process(dataclasses.replace(batch, batch_id="p9", prompt_id=["x"], prompt=["hi"],
                                                            label=[""], reference=[""], images=[[]]),
                                        ctxs["generate"])
    parts = STAGES["shard-preprocess"].process(gen, shard)
    assert {p.layout for p in parts} == {"packed"}
    for part in parts:
        (v,) = STAGES["critic"].process(part, ctxs["critic"])
        (r,) = STAGES["reward"].process(v, ctxs["reward"])
        assert np.isfinite(v.values.values).all() and np.isfinite(r.rewards).all()
    # text critic / reward model on the tiny-vl tokenizer with an image run: tokens only, as before
    tok = M.load_tokenizer(model_dir(topo, "tokenizer"))
    for key, cls in (("critic", AutoModelForTokenClassification), ("reward", AutoModelForSequenceClassification)):
        cls.from_config(tiny.tiny_config(tok, 64, 2, num_labels=1)).save_pretrained(tmp_path / key)
        tok.save_pretrained(tmp_path / key)
    text_topo = copy.copy(topo)
    text_topo.models = dataclasses.replace(topo.models, critic=str(tmp_path / "critic"),
                                           reward=str(tmp_path / "reward"))
    outs = cut
    for name in ("critic", "reward"):
        ctx = make_context(text_topo, name, state=ctxs["generate"].state)
        STAGES[name].setup(ctx)
        (outs,) = STAGES[name].process(outs, ctx)
        if name == "critic":
            assert ctx.models["vision"] is None
        else:
            assert ctx.models["reward_sources"]["model"].vision is None
    assert np.isfinite(outs.values.values).all() and np.isfinite(outs.rewards).all()


def test_value_head_save_load_round_trip_and_missing_or_wrong_heads(vl, tmp_path):
    from expstream.models import hf as text_models
    from expstream.models.hf import ModelNotFoundError
    from expstream.models.resolve import model_dir
    from expstream.models.vl import (
        VALUE_HEAD_FILE,
        image_processor,
        load_critic,
        load_reward_model,
        save_value_model,
    )

    topo, _, _ = vl
    critic = load_critic(model_dir(topo, "critic"))
    with torch.no_grad():
        critic.score.weight.copy_(torch.linspace(-1, 1, critic.hidden_size)[None])
        critic.score.bias.fill_(0.25)
    out = tmp_path / "critic"
    save_value_model(critic, out)
    image_processor(model_dir(topo, "critic")).save_pretrained(out)
    with pytest.raises(ModelNotFoundError, match="vision-language model; load it with expstream.models.vl.load_critic"):
        text_models.load_critic(out)  # the text loader refuses a VL directory and says which loader to use
    back = load_critic(out)
    own, got = critic.state_dict(), back.state_dict()
    assert set(own) == set(got) and all(torch.equal(own[k], got[k]) for k in own)
    assert back.kind == "critic" and not any(p.requires_grad for p in back.parameters())
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(critic(input_ids=x).logits, back(input_ids=x).logits)
    # the same head directory read as a reward model: the score at the last token
    rm = load_reward_model(out)
    with torch.no_grad():
        assert torch.allclose(rm(input_ids=x).logits[0, 0], back(input_ids=x).logits[0, -1, 0])
    # no head: a critic starts from zero values; a reward model is refused with the fix
    (out / VALUE_HEAD_FILE).unlink()
    with torch.no_grad():
        assert torch.equal(load_critic(out)(input_ids=x).logits, torch.zeros(1, 5, 1))
    with pytest.raises(ModelNotFoundError, match=f"without {VALUE_HEAD_FILE}.*save_value_model"):
        load_reward_model(out)
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}, str(out / VALUE_HEAD_FILE))
    with pytest.raises(ModelNotFoundError, match="expected.*hidden size"):
        load_critic(out)


def test_a_vl_reward_directory_without_its_head_is_refused_before_the_run_starts(vl, tmp_path):
    import shutil

    from expstream.config.topology import load_topology
    from expstream.errors import ConfigError
    from expstream.models.resolve import check_models, model_dir
    from expstream.models.vl import VALUE_HEAD_FILE

    topo, _, _ = vl
    headless = tmp_path / "rm"
    shutil.copytree(model_dir(topo, "reward"), headless)
    (headless / VALUE_HEAD_FILE).unlink()
    bad = load_topology(None, ["models.actor=builtin:tiny-vl", f"models.cache_dir={topo.models.cache_dir}",
                               f"models.reward={headless}"])
    with pytest.raises(ConfigError, match=f"models.reward.*without {VALUE_HEAD_FILE}.*save_value_model"):
        check_models(bad)
