"""Vision-language models: the built-in tiny Qwen2-VL, and the visual inputs every model stage builds.

``builtin:tiny-vl`` is a Qwen2-VL with random weights built offline; its critic and reward model
are :class:`VisionValueModel` s (a Qwen2-VL backbone plus a linear value head, saved and loaded by
:func:`save_value_model` / :func:`load_value_model`), so they see the pixels too.
:class:`VisionInputs` turns a SampleBatch's claim checks back into model inputs, deterministically
(pixel values and grids in image-token order, a small LRU cache, ``mm_token_type_ids``), with the
seed's image-token repair of sampled pad tokens in the model input only. The tiny model's shape,
the value-model directory convention and the repair: docs/vision.md "In the stages" and
"``builtin:tiny-vl``".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from expstream.errors import PoisonRecordError
from expstream.models.blobs import BlobStore, open_blob_store
from expstream.models.cache import MARKER, TINY_VL_FORMAT, is_complete, tiny_vl_root
from expstream.models.media import (
    VL_SCORING_TYPES,
    BadImageError,
    is_vl_dir,
    is_vl_scoring_dir,
    load_image,
    load_video,
)

log = logging.getLogger("expstream.vl")

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
BUILTIN_TINY_VL = "builtin:tiny-vl"
#: The file of a vision-language critic's / reward model's linear head, next to the backbone.
VALUE_HEAD_FILE = "value_head.safetensors"
_HEAD_FORMAT = "1"
#: Why 256: the processed images of a few micro-batches (n samples of a group share their images);
#: an image of the tiny processor is ~60 KB of float32 patches.
PIXEL_CACHE_ENTRIES = 256
#: The tiny processor's pixel bounds: 56x56 to 112x112 pixels, so 4 to 16 image tokens per image.
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


def build_tiny_vl(cache_dir: str | os.PathLike[str], seed: int = 0) -> dict[str, Path]:
    """Build (once) the tiny Qwen2-VL and its VL critic / reward model; ``{tokenizer, actor, critic, reward}``.

    The critic and the reward model are :class:`VisionValueModel` s on the actor's config, initialised
    after ``torch.manual_seed(seed + 1)`` and ``seed + 2`` (the global RNG untouched).
    """
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLModel

    from expstream.models import hf as M
    from expstream.models import tiny

    root = tiny_vl_root(cache_dir, seed)
    paths = {k: root / k for k in ("tokenizer", "actor", "critic", "reward")}
    if is_complete(root):
        return paths
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with tiny.file_lock(Path(cache_dir) / f".{root.name}.lock"):
        if is_complete(root):
            return paths
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=cache_dir))
        try:
            tok = tiny.train_tokenizer(special_tokens=tiny.SPECIAL_TOKENS + VISION_TOKENS)
            tok.save_pretrained(tmp / "tokenizer")
            ids = tok.convert_tokens_to_ids
            text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]},
                        tie_word_embeddings=False)
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                          temporal_patch_size=2, in_channels=3, mlp_ratio=2)
            cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                                video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                                vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                actor = Qwen2VLForConditionalGeneration(cfg).eval()
            actor.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                       pad_token_id=tok.pad_token_id)
            with M.quiet_progress():
                actor.save_pretrained(tmp / "actor", safe_serialization=True)
            tok.save_pretrained(tmp / "actor")
            image_processor().save_pretrained(tmp / "actor")
            for offset, key in enumerate(("critic", "reward"), start=1):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed + offset)
                    model = VisionValueModel(Qwen2VLModel(cfg).eval(), key)  # type: ignore[arg-type]
                    torch.nn.init.normal_(model.score.weight, std=1.0 / (model.hidden_size + 1))
                save_value_model(model, tmp / key)
                tok.save_pretrained(tmp / key)
                image_processor().save_pretrained(tmp / key)
            (tmp / MARKER).write_text(json.dumps({"format": TINY_VL_FORMAT, "seed": seed}) + "\n")
            if root.exists():
                shutil.rmtree(root, ignore_errors=True)
            os.rename(tmp, root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return paths


def image_processor(path: str | os.PathLike[str] | None = None) -> Any:
    """The Qwen2-VL image processor (the PIL backend: no torchvision here); from ``path`` if given."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if path is not None:
        return Qwen2VLImageProcessorPil.from_pretrained(str(path))
    return Qwen2VLImageProcessorPil(size={"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS},
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


class VisionInputs:
    """A model stage's view of the claim checks (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike[str], tokenizer: Any, store: BlobStore) -> None:
        self.processor = image_processor(model_dir)
        self.store = store
        self.merge = int(self.processor.merge_size)
        ids = tokenizer.convert_tokens_to_ids
        self.image_id, self.video_id = ids("<|image_pad|>"), ids("<|video_pad|>")
        # the tokens that claim visual features: a stray one in a response breaks the forward pass
        self.vision_ids = {self.image_id, self.video_id}
        self.pad_id = int(tokenizer.pad_token_id)
        self._cache: OrderedDict[str, tuple[np.ndarray, tuple[int, int, int]]] = OrderedDict()
        self.repaired = 0
        self.process_s = 0.0

    def image(self, ref: str, what: str) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(patches (n, C*T*P*P) float32, (t, h, w)) of one stored image; BadImageError / MissingBlobError."""
        hit = self._cache.get(ref)
        if hit is not None:
            self._cache.move_to_end(ref)
            return hit
        t0 = time.perf_counter()
        img = load_image(self.store.get(ref), what)
        out = self.processor(images=[img], return_tensors="np")
        patches = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
        self.process_s += time.perf_counter() - t0
        self._cache[ref] = (patches, grid)  # type: ignore[assignment]
        while len(self._cache) > PIXEL_CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return patches, grid  # type: ignore[return-value]

    def video(self, ref: str, what: str) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(patches (n, C*T*P*P) float32, (t, h, w)) of one stored video (a frame-list manifest).

        Qwen2-VL's video layout without its torchvision video processor: every frame resized (bicubic)
        to the first frame's smart_resize size, rescaled and normalised like the images, the frame
        count padded to a multiple of temporal_patch_size by repeating the last frame, then cut into
        (t, h/m, w/m, m, m, C, T, P, P) patches.
        """
        hit = self._cache.get("video:" + ref)
        if hit is not None:
            self._cache.move_to_end("video:" + ref)
            return hit
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        t0 = time.perf_counter()
        frames = load_video(self.store, ref, what)
        p = self.processor
        ps, tps, m = int(p.patch_size), int(p.temporal_patch_size), self.merge
        w0, h0 = frames[0].size
        h, w = smart_resize(h0, w0, factor=ps * m, min_pixels=p.size["shortest_edge"], max_pixels=p.size["longest_edge"])
        mean = np.asarray(p.image_mean, np.float32)[:, None, None]
        std = np.asarray(p.image_std, np.float32)[:, None, None]
        arr = np.stack([(np.asarray(f.resize((w, h), Image.BICUBIC), np.float32).transpose(2, 0, 1) / 255.0 - mean)
                        / std for f in frames])
        if arr.shape[0] % tps:
            arr = np.concatenate([arr, np.repeat(arr[-1:], tps - arr.shape[0] % tps, axis=0)])
        gt, gh, gw = arr.shape[0] // tps, h // ps, w // ps
        c = arr.shape[1]
        patches = arr.reshape(gt, tps, c, gh // m, m, ps, gw // m, m, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        out = (np.ascontiguousarray(patches.reshape(gt * gh * gw, c * tps * ps * ps), dtype=np.float32), (gt, gh, gw))
        self.process_s += time.perf_counter() - t0
        self._cache["video:" + ref] = out  # type: ignore[assignment]
        while len(self._cache) > PIXEL_CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return out  # type: ignore[return-value]

    def tokens_for(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def prompt_images(self, refs: list[str], what: str) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
        got = [self.image(r, f"{what} image {i} ({r[:15]}...)") for i, r in enumerate(refs)]
        return [g[0] for g in got], [g[1] for g in got]

    def prompt_videos(self, refs: list[str], what: str) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
        got = [self.video(r, f"{what} video {i} ({r[:15]}...)") for i, r in enumerate(refs)]
        return [g[0] for g in got], [g[1] for g in got]

    def model_kwargs(self, sequences: torch.Tensor, images: list[list[str]], ids: list[str],
                     prompt_widths: list[int] | None = None, videos: list[list[str]] | None = None) -> dict[str, Any]:
        """pixel_values / image_grid_thw / mm_token_type_ids for a padded (B, L) batch; the response
        tokens are repaired in ``sequences`` in place (see the module docstring).

        ``prompt_widths[b]``: where row b's response starts (its visual tokens after that are repaired).
        """
        patches: list[np.ndarray] = []
        grids: list[tuple[int, int, int]] = []
        vpatches: list[np.ndarray] = []
        vgrids: list[tuple[int, int, int]] = []
        images = images or [[] for _ in ids]
        videos = videos or [[] for _ in ids]
        for b, refs in enumerate(images):
            row = sequences[b]
            if prompt_widths is not None:
                resp = row[prompt_widths[b]:]
                stray = torch.isin(resp, torch.tensor(sorted(self.vision_ids), device=resp.device))
                if bool(stray.any()):
                    self.repaired += int(stray.sum())
                    resp[stray] = self.pad_id
                    log.info("vl: sample %s: %d vision tokens in the response replaced by pad in the model "
                                "input (image-token mismatch repair)", ids[b], int(stray.sum()))
            p, g = self.prompt_images(refs, f"sample {ids[b]}")
            want = sum(self.tokens_for(x) for x in g)
            have = int((row == self.image_id).sum())
            if have != want:
                raise PoisonRecordError(f"sample {ids[b]}: {have} image tokens in the sequence but its {len(refs)} "
                                        f"images need {want} (grids {g}); the prompt was cut (raise "
                                        "generate.prompt_max_len) or its image tokens were edited")
            patches += p
            grids += g
            vp, vg = self.prompt_videos(videos[b], f"sample {ids[b]}")
            want = sum(self.tokens_for(x) for x in vg)
            have = int((row == self.video_id).sum())
            if have != want:
                raise PoisonRecordError(f"sample {ids[b]}: {have} video tokens in the sequence but its {len(vg)} "
                                        f"videos need {want} (grids {vg}); raise generate.prompt_max_len")
            vpatches += vp
            vgrids += vg
        kw: dict[str, Any] = {"mm_token_type_ids": (sequences == self.image_id).long()
                              + 2 * (sequences == self.video_id).long()}
        if patches:
            kw["pixel_values"] = torch.from_numpy(np.concatenate(patches, axis=0))
            kw["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        if vpatches:
            kw["pixel_values_videos"] = torch.from_numpy(np.concatenate(vpatches, axis=0))
            kw["video_grid_thw"] = torch.tensor(vgrids, dtype=torch.long)
        return kw


def vision_for(topology: Any, model_path: str | os.PathLike[str], tokenizer: Any = None) -> VisionInputs | None:
    """A stage's VisionInputs when ``model_path`` is a vision-language model (None otherwise);
    ``tokenizer`` defaults to the one saved in ``model_path``."""
    if not is_vl_dir(model_path):
        return None
    if tokenizer is None:
        from expstream.models.hf import load_tokenizer

        tokenizer = load_tokenizer(model_path)
    where = topology.run.blob_store
    store = open_blob_store(where) if where else _NoStore()
    return VisionInputs(model_path, tokenizer, store)


class _NoStore:
    """A run without images has no blob store; a record that names a blob anyway is dead-lettered."""

    def get(self, ref: str) -> bytes:
        from expstream.models.blobs import MissingBlobError

        raise MissingBlobError(f"blob {ref}: this run has no blob store (run.blob_store); its prompts had no images")

    def put(self, data: bytes) -> str:  # pragma: no cover - stages never store
        raise RuntimeError("stages do not store blobs")

    def exists(self, ref: str) -> bool:
        return False


# -- the vision-language critic and reward model ------------------------------------------------------
class VisionValueModel(torch.nn.Module):
    """A vision-language backbone plus a linear value head (hidden -> 1): the critic or the reward model
    of a VL run, fed the same inputs as the actor (pixels, grids, ``mm_token_type_ids``).

    ``kind="critic"``: ``logits`` (B, L, 1), one value per token (read like a token-classification
    critic: the outputs at ``[:-1]``, last A). ``kind="reward"``: ``logits`` (B, 1), the head at the
    last attended token of each row (the last non-pad token without an attention mask), like a
    sequence-classification reward model. ``base_model`` and ``score`` are named as in transformers'
    ``*ForSequenceClassification``, so the packed forwards of expstream/models/passes.py work unchanged.
    """

    def __init__(self, backbone: torch.nn.Module, kind: str) -> None:
        super().__init__()
        if kind not in ("critic", "reward"):
            raise ValueError(f"VisionValueModel: kind must be 'critic' or 'reward', got {kind!r}")
        self.kind = kind
        self.backbone = backbone
        self.config = backbone.config
        self.hidden_size = int(backbone.config.get_text_config().hidden_size)
        self.score = torch.nn.Linear(self.hidden_size, 1)
        torch.nn.init.zeros_(self.score.weight)
        torch.nn.init.zeros_(self.score.bias)
        param = next(backbone.parameters())
        self.score.to(device=param.device, dtype=param.dtype)

    @property
    def base_model(self) -> torch.nn.Module:
        """The backbone (``last_hidden_state``), as transformers' classification models name it."""
        return self.backbone

    @property
    def pad_token_id(self) -> int | None:
        """The pad token: the config's (``load_reward_model(pad_token_id=...)`` sets it) or the text config's."""
        pad = getattr(self.config, "pad_token_id", None)
        return pad if pad is not None else getattr(self.config.get_text_config(), "pad_token_id", None)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """Values (critic) or scores (reward); ``kwargs`` (pixel_values, image_grid_thw,
        pixel_values_videos, video_grid_thw, mm_token_type_ids, ...) go to the backbone."""
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast, TokenClassifierOutput

        kwargs.setdefault("use_cache", False)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **kwargs).last_hidden_state
        values = self.score(hidden)
        if self.kind == "critic":
            return TokenClassifierOutput(logits=values)
        return SequenceClassifierOutputWithPast(logits=values[torch.arange(values.shape[0], device=values.device),
                                                              self._last_token(input_ids, attention_mask)])

    def _last_token(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """(B,) the index of each row's last attended token (last non-pad token without a 2-D mask)."""
        if attention_mask is not None and attention_mask.dim() == 2:
            keep = attention_mask.to(torch.long)
        elif self.pad_token_id is not None:
            keep = (input_ids != self.pad_token_id).to(torch.long)
        else:
            keep = torch.ones_like(input_ids, dtype=torch.long)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return (positions * keep).argmax(-1)


def load_critic(path: str | os.PathLike[str], device: str | torch.device = "cpu",
                dtype: torch.dtype | str | None = None, *, field: str | None = None) -> Any:
    """A critic directory of either kind: a Qwen2-VL / Qwen2.5-VL one as a :class:`VisionValueModel`
    (fed the pixels), any other through ``expstream.models.hf.load_critic``."""
    if is_vl_dir(path) or is_vl_scoring_dir(path):
        return load_value_model(path, "critic", device, dtype, field=field)
    from expstream.models.hf import load_critic as load_text_critic

    return load_text_critic(path, device, dtype, field=field)


def load_reward_model(path: str | os.PathLike[str], device: str | torch.device = "cpu",
                      dtype: torch.dtype | str | None = None, *, field: str | None = None,
                      pad_token_id: int | None = None) -> Any:
    """A reward model directory of either kind (see :func:`load_critic`); ``pad_token_id`` as in
    ``expstream.models.hf.load_reward_model``."""
    if is_vl_dir(path) or is_vl_scoring_dir(path):
        model = load_value_model(path, "reward", device, dtype, field=field)
        if pad_token_id is not None:
            model.config.pad_token_id = pad_token_id
        return model
    from expstream.models.hf import load_reward_model as load_text_reward_model

    return load_text_reward_model(path, device, dtype, field=field, pad_token_id=pad_token_id)


def save_value_model(model: VisionValueModel, path: str | os.PathLike[str]) -> None:
    """Write a VisionValueModel as a directory: the backbone (``save_pretrained``) and
    ``value_head.safetensors`` (the tokenizer and the image processor are the caller's to add)."""
    from safetensors.torch import save_file

    from expstream.models import hf as M

    out = Path(path)
    with M.quiet_progress():
        model.backbone.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    head = {"weight": model.score.weight.detach().cpu().contiguous(), "bias": model.score.bias.detach().cpu().contiguous()}
    save_file(head, str(out / VALUE_HEAD_FILE), metadata={"format": _HEAD_FORMAT, "kind": model.kind})


def load_value_model(path: str | os.PathLike[str], kind: str, device: str | torch.device = "cpu",
                     dtype: torch.dtype | str | None = None, *, field: str | None = None) -> VisionValueModel:
    """Load a vision-language critic (``kind="critic"``) or reward model (``"reward"``) from ``path``
    (the directory convention of the module docstring), in eval mode, without grads."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from expstream.models import hf as M

    label = field or f"models.{kind}"
    if not is_vl_dir(path):
        raise M.ModelNotFoundError(f"{label}: {path} is a Qwen2-VL model but has no preprocessor_config.json, so its "
                                   "images cannot be processed; copy the processor's preprocessor_config.json into "
                                   "that directory (processor.save_pretrained(dir))")
    if not is_vl_scoring_dir(path):
        raise M.ModelNotFoundError(f"{label}: {path} is a vision-language model but not a Qwen2-VL / Qwen2.5-VL one "
                                   f"(model_type in {VL_SCORING_TYPES}); a VL critic or reward model needs one, or "
                                   "use a text model on the same tokenizer")
    model = VisionValueModel(M.load_auto_model("AutoModel", f"vision-language {kind}", path, "cpu", dtype, field), kind)
    head_file = Path(path).expanduser() / VALUE_HEAD_FILE
    if head_file.is_file():
        try:
            head = load_file(str(head_file))
        except (OSError, SafetensorError) as exc:
            raise M.ModelNotFoundError(f"{label}: {head_file} is not a readable safetensors file ({exc}); save the "
                                       "model again with expstream.models.vl.save_value_model") from exc
        want = {"weight": (1, model.hidden_size), "bias": (1,)}
        got = {k: tuple(v.shape) for k, v in head.items()}
        if got != want:
            raise M.ModelNotFoundError(f"{label}: {head_file} holds {got}, expected {want} for hidden size "
                                       f"{model.hidden_size}; save the head of this backbone with "
                                       "expstream.models.vl.save_value_model")
        model.score.load_state_dict({k: v.to(model.score.weight.dtype) for k, v in head.items()})
    elif kind == "reward":
        raise M.ModelNotFoundError(f"{label}: {path} is a Qwen2-VL backbone without {VALUE_HEAD_FILE}, so it has "
                                   "no reward head; save a trained reward model with expstream.models.vl.save_value_model, "
                                   "or score with a reward function (models.reward_fn)")
    else:
        log.warning("%s: %s has no %s: the critic starts from a zero value head (V = 0 until trained)",
                    label, path, VALUE_HEAD_FILE)
    return M.to_inference(model, device)


__all__ = ["BUILTIN_TINY_VL", "VALUE_HEAD_FILE", "VisionInputs", "VisionValueModel", "BadImageError", "build_tiny_vl",
           "image_processor", "is_vl_dir", "is_vl_scoring_dir", "load_value_model", "save_value_model", "vision_for"]
