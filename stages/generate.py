"""generate: prompts -> n sampled responses per prompt, with stable group and sample ids."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np

from expstream.errors import PoisonRecordError
from expstream.models.resolve import model_dir
from expstream.models.vl import vision_for
from expstream.rl.admission import admission_id, backpressure_on, wait_for_admission
from expstream.train.weights import follower_for, refresh_weights
from schemas import PromptBatch, Ragged, SampleBatch
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models.hf import TransformersGenerator, load_causal_lm, load_tokenizer

    topo = ctx.topology
    tok = load_tokenizer(model_dir(topo, "tokenizer"))
    ctx.models["tokenizer"] = tok
    if topo.generate.backend == "vllm":
        from expstream.models.vllm_generator import VllmGenerator, VllmWeights, check_generate_config

        check_generate_config(topo.generate)
        gen = topo.generate
        actor = model_dir(topo, "actor")
        generator = VllmGenerator(actor, tok, seed=topo.run.seed, max_model_len=gen.vllm_max_model_len,
                                  kv_cache_gib=gen.vllm_kv_cache_gib)
        ctx.log.info("generate: vLLM engine for %s ready in %.2f s", actor, generator.startup_s)
        ctx.models["generator"] = generator
        # weights published by the trainer reload into the engine in place (VllmGenerator.reload)
        ctx.models["actor_follower"] = follower_for(ctx, "actor", VllmWeights(generator, actor))
        return
    if topo.generate.backend == "sglang":
        from expstream.models.sglang_generator import SglangGenerator, SglangWeights, check_generate_config

        check_generate_config(topo.generate)
        gen = topo.generate
        actor = model_dir(topo, "actor")
        generator = SglangGenerator(actor, tok, url=gen.sglang_url, python=gen.sglang_python,
                                    device=topo.models.device, seed=topo.run.seed)
        ctx.log.info("generate: SGLang server %s for %s ready in %.2f s", generator.url, actor, generator.startup_s)
        ctx.models["generator"] = generator
        # weights published by the trainer: /update_weights_from_disk, then /flush_cache (SglangGenerator.reload)
        ctx.models["actor_follower"] = follower_for(ctx, "actor", SglangWeights(generator, actor))
        return
    model = load_causal_lm(model_dir(topo, "actor"), device=topo.models.device)
    ctx.models["generator"] = TransformersGenerator(model, tok, device=topo.models.device)
    # a vision-language actor: images come back from the blob store (expstream/models/vl.py); None otherwise
    ctx.models["vision"] = vision_for(topo, model_dir(topo, "actor"), tok)
    # The continuous loop: follow the trainer's published actor versions (None otherwise).
    ctx.models["actor_follower"] = follower_for(ctx, "actor", model)


def teardown(ctx: StageContext) -> None:
    """Shut a vLLM engine or the replica's SGLang server down (a no-op for the transformers backend)."""
    close = getattr(ctx.models.get("generator"), "close", None)
    if close is not None:
        close()
        name = {"vllm": "vLLM", "sglang": "SGLang"}.get(ctx.topology.generate.backend, ctx.topology.generate.backend)
        ctx.log.info("generate: %s engine shut down", name)


def committed(batches: list, ctx: StageContext) -> None:
    """Stage hook (stages/commitgroup.py step 5): these prompt records are committed, so their samples are on
    their way; a rewind that reads one again regenerates it without counting it for admission again
    (expstream/rl/admission.py "Rewinds")."""
    if backpressure_on(ctx.topology):
        ctx.state.mark_delivered([admission_id(b.batch_id) for b in batches if isinstance(b, PromptBatch)])


def batch_seed(run_seed: int, batch_id: str) -> int:
    """A per-record sampling seed: the same record always samples the same responses."""
    digest = hashlib.sha256(f"{run_seed}:{batch_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


#: Where an image goes in a prompt: before the text, one block per image (the Qwen-VL convention).
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"


def tokenize_prompts(batch: PromptBatch, ctx: StageContext) -> list[list[int]]:
    gen = ctx.topology.generate
    tok = ctx.models["tokenizer"]
    vision = ctx.models.get("vision")
    images = batch.images or [[] for _ in batch.prompt_id]
    videos = batch.videos or [[] for _ in batch.prompt_id]
    if (any(images) or any(videos)) and vision is None:
        raise PoisonRecordError(f"PromptBatch.images/videos: models.actor ({ctx.topology.models.actor}) is not a "
                                "vision-language model; use one (e.g. builtin:tiny-vl) or drop the images")
    texts, grids_of = [], []
    for pid, text, refs, vrefs in zip(batch.prompt_id, batch.prompt, images, videos, strict=True):
        if not text or not text.strip():
            raise PoisonRecordError(f"PromptBatch.prompt[{pid}]: empty prompt; give every prompt some text")
        grids = vision.prompt_images(refs, f"prompt {pid}")[1] if refs else []
        vgrids = vision.prompt_videos(vrefs, f"prompt {pid}")[1] if vrefs else []
        text = IMAGE_BLOCK * len(refs) + VIDEO_BLOCK * len(vrefs) + text
        if gen.apply_chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        texts.append(text)
        grids_of.append((grids, vgrids))
    # one tokenizer call per record: the same ids as a call per prompt, at ~2/3 of the cost
    encoded = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for pid, refs, vrefs, (grids, vgrids), ids in zip(batch.prompt_id, images, videos, grids_of, encoded, strict=True):
        if refs:  # one image pad per image -> as many as its grid has merged patches
            ids = _expand_pads(ids, vision, vision.image_id, grids, pid)
        if vrefs:
            ids = _expand_pads(ids, vision, vision.video_id, vgrids, pid)
        if len(ids) > gen.prompt_max_len:
            if not gen.truncate_prompts:
                raise PoisonRecordError(
                    f"PromptBatch.prompt[{pid}]: {len(ids)} tokens > generate.prompt_max_len="
                    f"{gen.prompt_max_len}; shorten it, raise prompt_max_len, or set generate.truncate_prompts=true")
            ids = ids[: gen.prompt_max_len]
            need = sum(vision.tokens_for(g) for g in grids + vgrids) if refs or vrefs else 0
            if need and ids.count(vision.image_id) + ids.count(vision.video_id) != need:
                raise PoisonRecordError(
                    f"PromptBatch.prompt[{pid}]: its {len(refs)} images and {len(vrefs)} videos need {need} "
                    f"visual tokens but generate.prompt_max_len={gen.prompt_max_len} cuts them; raise prompt_max_len "
                    "(image tokens and grid must match)")
        out.append(list(ids))
    return out


def _expand_pads(ids: list[int], vision: object, pad: int, grids: list, pid: str) -> list[int]:
    if ids.count(pad) != len(grids):
        raise PoisonRecordError(f"PromptBatch.prompt[{pid}]: the text holds its own <|image_pad|>/<|video_pad|> "
                                "tokens; leave visual placeholders out of the prompt text (the stage adds them)")
    out: list[int] = []
    it = iter(grids)
    for t in ids:
        out.extend([pad] * vision.tokens_for(next(it)) if t == pad else [t])  # type: ignore[attr-defined]
    return out


def process(batch: PromptBatch, ctx: StageContext) -> list[SampleBatch]:
    if not isinstance(batch, PromptBatch):
        raise PoisonRecordError(f"generate: expected an expstream.PromptBatch, got {type(batch).__name__}; "
                                "only the prompt feeder writes to the input topic")
    gen = ctx.topology.generate
    n = gen.n_samples_per_prompt
    tok = ctx.models["tokenizer"]
    # Bounded staleness (expstream/rl/admission.py): reload newer weights and start only within the admission
    # bound, waiting otherwise. The version returned is the one loaded, admitted and stamped: the weights
    # are never reloaded again between the admission and the generation.
    version = wait_for_admission(ctx, batch.batch_id, len(batch) * n, refresh=lambda: refresh_weights(ctx, "actor"))
    if ctx.metrics is not None:  # a prompt record has no version: show the one generating it (expstream/observe/metrics.py)
        ctx.metrics.policy_version.set(version)
    prompts = tokenize_prompts(batch, ctx)
    images = batch.images or [[] for _ in batch.prompt_id]
    videos = batch.videos or [[] for _ in batch.prompt_id]
    vision = ctx.models.get("vision")
    visual = None
    if any(images) or any(videos):
        rows, vrows = [r for r in images for _ in range(n)], [r for r in videos for _ in range(n)]
        rids = [f"{p}#{i}" for p in batch.prompt_id for i in range(n)]
        visual = lambda input_ids: vision.model_kwargs(input_ids, rows, rids, videos=vrows)  # noqa: E731
    outputs, logprobs = ctx.models["generator"].generate(
        prompts, n, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
        max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
        seed=batch_seed(ctx.topology.run.seed, batch.batch_id),
        should_stop=ctx.should_stop,  # SIGTERM abandons a long generation between tokens (uncommitted)
        return_log_probs=True,  # behaviour log-probs for the trainer's off-policy correction
        **({"model_inputs": visual} if visual is not None else {}),
        # FIRE (expstream/models/fire.py): the first token hot, the rest at temperature
        **({"first_token_temperature": gen.first_token_temperature} if gen.use_fire else {}),
    )
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731 - groups are contiguous
    return [SampleBatch(
        batch_id=batch.batch_id,
        policy_version=int(version),
        n_samples_per_prompt=n,
        eos_token_id=int(tok.eos_token_id),
        pad_token_id=int(tok.pad_token_id),
        prompt_id=rep(batch.prompt_id),
        group_id=rep(batch.prompt_id),
        sample_index=[i for _ in batch.prompt_id for i in range(n)],
        prompt=rep(batch.prompt),
        label=rep(batch.label),
        reference=rep(batch.reference),
        response=tok.batch_decode(outputs, skip_special_tokens=gen.skip_special_tokens),
        prompt_ids=_ragged(rep(prompts), np.int32),
        response_ids=_ragged(outputs, np.int32),
        # response-level (B; o_b) until shard-preprocess aligns it with action_ids
        rollout_log_probs=_ragged(logprobs, np.float32),
        rollout_version=[int(version)] * len(outputs),
        **(_visual_fields(rep(images), rep(videos), vision) if any(images) or any(videos) else {}),
    )]


def _ragged(rows: list, dtype: type) -> Ragged:
    """Rows of Python numbers as one Ragged, converted in one pass (``Ragged.from_rows`` converts and
    checks every row on its own: ~1 ms per field of a 256-sample record)."""
    lengths = np.fromiter(map(len, rows), np.int32, count=len(rows))
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype, count=int(lengths.sum()))
    return Ragged(values, lengths)


def _visual_fields(images: list[list[str]], videos: list[list[str]], vision: object) -> dict:
    """images/videos + their grids for the samples (the grids of their prompt's, from the cache)."""
    out: dict = {}
    for name, lists, fn in (("image", images, "image"), ("video", videos, "video")):
        if any(lists):
            grids = [np.asarray([x for ref in refs for x in getattr(vision, fn)(ref, ref)[1]], np.int32)
                     for refs in lists]
            out[f"{name}s"] = lists
            out[f"{name}_grid_thw"] = Ragged.from_rows(grids, "int32")
    return out
